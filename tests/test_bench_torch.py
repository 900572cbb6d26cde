"""bench/torch_network.py: PyTorch's rows of `bench --network`, generated from the layer list.

Without torch: the argument checks and the one row that says torch is missing. With torch (CPU):
the generated forward of every zoo model against conv_cpu.reference_forward in fp64, and the
on-GPU preprocessing's rule against data.resize_bilinear. On the GPU (marker `gpu`): every
row of every zoo model, raw and float inputs, device and host io, agrees with fp64.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from convolab.bench import torch_network as tn
from convolab.conv_cpu import reference_forward
from convolab.data import resize_bilinear
from convolab.models import MODELS, build, spec
from convolab.precision import TOLERANCE


def raw_images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)


def model_params(model: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """models.build's weights with random biases (a zero bias would hide a bias bug)."""
    p = {k: np.asarray(v, np.float32)
         for k, v in build(model, int(rng.integers(1 << 30))).params().items()}
    for k in p:
        if k.endswith(".bias"):
            p[k] = (0.3 * rng.standard_normal(p[k].shape)).astype(np.float32)
    return p


def test_rows_without_torch(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    rows = tn.torch_rows("ece408", model_params("ece408", rng), raw_images(rng, 4), 3,
                         np.full((4, 10), 0.1))
    assert len(rows) == 1 and "PyTorch unavailable" in rows[0]["error"]


@pytest.mark.parametrize("kwargs,message", [
    ({"inputs": "png"}, "inputs"),
    ({"io": "disk"}, "io"),
    ({"raw_host": np.zeros((4, 28, 28), np.float32)}, "uint8"),
    ({"raw_host": np.zeros((28, 28), np.uint8)}, "uint8"),
    ({"raw_host": np.zeros((0, 28, 28), np.uint8)}, "non-empty"),
    ({"reps": 0}, "reps"),
    ({"model": "lenet-9"}, "unknown model"),
])
def test_rows_check_arguments(kwargs: dict, message: str, rng: np.random.Generator) -> None:
    args = {"model": "ece408", "params": model_params("ece408", rng),
            "raw_host": raw_images(rng, 4), "reps": 3, "ref_probs": np.full((4, 10), 0.1),
            **kwargs}
    with pytest.raises(ValueError, match=message):
        tn.torch_rows(**args)


def test_row_names_say_input_and_io() -> None:
    names = {tn.row_name(v, i, o) for v in tn.VARIANTS for i in tn.INPUTS for o in tn.IOS}
    assert len(names) == len(tn.VARIANTS) * len(tn.INPUTS) * len(tn.IOS)
    assert tn.row_name(tn.EAGER_FP32, "raw", "host") == (
        "torch eager fp32 (raw uint8, pinned host -> host)")
    assert tn.row_name("torch.compile fp32", "float", "device") == (
        "torch.compile fp32 (float, device -> device)")


@pytest.mark.parametrize("model", list(MODELS))
def test_torch_forward_matches_reference(model: str, rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    p = model_params(model, rng)
    size = spec(model).input_size
    x = rng.random((3, 1, size, size))
    got = tn.torch_forward(torch, model)(torch.from_numpy(x),
                                         {k: torch.from_numpy(v.astype(np.float64))
                                          for k, v in p.items()})
    assert got.dtype == torch.float32  # softmax runs in fp32 whatever the network's dtype
    ref = reference_forward(p, x, model=model)
    assert np.abs(got.numpy() - ref).max() <= 1e-6


def test_torch_resize_follows_data_rule(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    raw = raw_images(rng, 5)
    for size in sorted({m.input_size for m in MODELS.values()}):
        got = tn.torch_resize(torch, size, torch.float32)(torch.from_numpy(raw)).numpy()
        assert got.shape == (5, 1, size, size)
        # w0 * a + w1 * b against a + t * (b - a): a few fp32 ulps apart
        assert np.abs(got - resize_bilinear(raw, size)).max() <= TOLERANCE["fp32"]


def test_rows_without_cuda(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    rows = tn.torch_rows("ece408", model_params("ece408", rng), raw_images(rng, 4), 3,
                         np.full((4, 10), 0.1))
    assert len(rows) == 1 and "CUDA" in rows[0]["error"]


def _check_rows(rows: list[dict], compiled: bool) -> None:
    variants = [v for v in tn.VARIANTS if compiled or "compile" not in v]
    assert [r.get("variant") for r in rows] == variants
    for r in rows:
        assert "error" not in r, r
        assert r["median_ms"] > 0 and r["images_per_s"] > 0
        fp16 = "fp16" in r["variant"]
        bound = 5e-2 if fp16 else 1e-2 if "tf32" in r["variant"] else 1e-4
        assert r["max_abs_prob_diff_vs_fp64"] <= bound, r
        if not fp16:  # random weights leave some top-2 gaps within fp16's rounding
            assert r["argmax_agree_vs_fp64"] >= 0.95, r


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("inputs", tn.INPUTS)
@pytest.mark.parametrize("io", tn.IOS)
def test_rows_on_gpu(model: str, inputs: str, io: str, rng: np.random.Generator) -> None:
    pytest.importorskip("torch")
    p, raw = model_params(model, rng), raw_images(rng, 300)
    ref = reference_forward(p, resize_bilinear(raw[:64], spec(model).input_size), model=model)
    compiled = (model, inputs, io) == ("ece408", "raw", "host")  # one compile: tens of seconds
    rows = tn.torch_rows(model, p, raw, 3, ref, inputs=inputs, io=io, compile=compiled)
    _check_rows(rows, compiled)
    for r in rows:
        assert r["model"] == model and r["inputs"] == inputs and r["io"] == io
        assert r["name"] == tn.row_name(r["variant"], inputs, io)


@pytest.mark.gpu
def test_rows_on_device_float_input(rng: np.random.Generator) -> None:
    """The form bench.network calls today: ece408's float input already on the device."""
    pytest.importorskip("torch")
    import cupy as cp

    p = model_params("ece408", rng)
    x = resize_bilinear(raw_images(rng, 200), spec("ece408").input_size)
    ref = reference_forward(p, x[:64])
    rows = tn.torch_rows(p, cp.asarray(x), 200, 3, ref)
    _check_rows(rows, True)
    assert rows[0]["name"] == "torch eager fp32"
