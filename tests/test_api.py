"""The public library API: convolab.conv2d / conv2d_relu_pool / load_model / list_impls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_interop import Bare

import convolab
from convolab.conv_cpu import conv_reference, reference_conv_relu_pool
from convolab.errors import ConvolabError, InputError, InputTypeError


def test_import_stays_light() -> None:
    code = ("import sys, convolab; convolab.conv2d; "
            "print([m for m in ('numba', 'cupy', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_conv2d_matches_the_reference(rng: np.random.Generator) -> None:
    x = rng.random((2, 3, 15, 15))  # float64: converted to float32
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    for impl in ("auto", "cpu-im2col"):
        y = convolab.conv2d(x, w, b, stride=2, impl=impl)
        assert isinstance(y, np.ndarray) and y.dtype == np.float32
        np.testing.assert_allclose(y, conv_reference(x, w, b, 2), rtol=1e-5, atol=1e-5)


def test_conv2d_relu_pool_through_the_dlpack_protocol(rng: np.random.Generator) -> None:
    x = rng.random((2, 2, 12, 12), dtype=np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    want = reference_conv_relu_pool(x, w, None, 1, 2)
    for impl in ("auto", "cpu-ref"):
        y = convolab.conv2d_relu_pool(Bare(x), Bare(w), impl=impl)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("call", "error", "needle"), [
    (lambda x, w: convolab.conv2d(x, w, stride=0), InputError, "stride"),
    (lambda x, w: convolab.conv2d(x, w, impl="nope"), InputError, "unknown implementation"),
    (lambda x, w: convolab.conv2d(x, w, impl="register-tiled"), InputError, "runs on the GPU"),
    (lambda x, w: convolab.conv2d(x, w[:, :1]), InputError, "channels"),
    (lambda x, w: convolab.conv2d(x, w, b=np.zeros(5, np.float32)), InputError, "bias"),
    (lambda x, w: convolab.conv2d(x.astype(np.int64), w), InputTypeError, "int64"),
    (lambda x, w: convolab.conv2d_relu_pool(x, w, pool=9), InputError, "larger than"),
])
def test_bad_calls_are_one_clear_error(call, error: type, needle: str) -> None:
    x, w = np.zeros((1, 2, 8, 8), np.float32), np.zeros((3, 2, 3, 3), np.float32)
    with pytest.raises(error, match=needle):
        call(x, w)


def test_list_impls() -> None:
    cpu = convolab.list_impls("cpu")
    assert {i.name for i in cpu} >= {"cpu-ref", "cpu-fused"} and {i.device for i in cpu} == {"cpu"}
    assert {i.device for i in convolab.list_impls()} == {"cpu", "gpu"}
    with pytest.raises(InputError, match="device"):
        convolab.list_impls("tpu")


@pytest.fixture(scope="module")
def test_images() -> tuple[np.ndarray, np.ndarray]:
    from convolab import data

    return data.load_images("test", n=100, size=86)


def test_load_model_classifies(test_images: tuple[np.ndarray, np.ndarray]) -> None:
    x, labels = test_images
    model = convolab.load_model("ece408", device="cpu")
    probs = model(x)
    assert probs.shape == (100, 10) and np.allclose(probs.sum(axis=1), 1, atol=1e-5)
    predicted = model.predict(Bare(x), batch=33)
    np.testing.assert_array_equal(predicted, probs.argmax(axis=1))
    assert (predicted == labels).mean() > 0.8
    with pytest.raises(InputError, match=r"\(B, 1, 86, 86\)"):
        model(x[:, :, :80, :80])
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        model(x * 255)


def test_load_model_by_path_and_bad_names(tmp_path: Path) -> None:
    from convolab import models, weights

    path = weights.save(models.build("eecs498", seed=1), tmp_path / "mine.safetensors")
    assert convolab.load_model(path, device="cpu").name == "eecs498"
    with pytest.raises(InputError, match="neither a zoo model"):
        convolab.load_model("resnet50")
    with pytest.raises(InputError, match="mode"):
        convolab.load_model("ece408", device="cpu", mode="fp8")
    with pytest.raises(InputError, match="device"):
        convolab.load_model("ece408", device="tpu")


def test_load_model_onnx_goes_through_onnx_io(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """Until the ONNX reader is merged, a stub stands in for convolab.onnx_io."""
    import types

    from convolab import models

    seen: list[Path] = []
    stub = types.ModuleType("convolab.onnx_io")
    stub.network_from_onnx = lambda path: seen.append(path) or models.build("ece408")
    monkeypatch.setitem(sys.modules, "convolab.onnx_io", stub)
    file = tmp_path / "m.onnx"
    file.write_bytes(b"stub")
    model = convolab.load_model(file, device="cpu")
    assert seen == [file] and model.name == "ece408"
    with pytest.raises(ConvolabError, match="does not exist"):
        convolab.load_model(tmp_path / "missing.onnx", device="cpu")


@pytest.mark.gpu
def test_gpu_cupy_in_cupy_out(rng: np.random.Generator) -> None:
    import cupy as cp

    x = rng.random((2, 4, 40, 40), dtype=np.float32)
    w = rng.standard_normal((16, 4, 7, 7)).astype(np.float32)
    y = convolab.conv2d_relu_pool(cp.asarray(x), cp.asarray(w), pool=4)
    assert isinstance(y, cp.ndarray)
    np.testing.assert_allclose(y.get(), reference_conv_relu_pool(x, w, None, 1, 4),
                               rtol=1e-4, atol=1e-5)
    z = convolab.conv2d(cp.asarray(x), cp.asarray(w))
    assert isinstance(z, cp.ndarray)
    np.testing.assert_allclose(z.get(), conv_reference(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_model_agrees_with_cpu(test_images: tuple[np.ndarray, np.ndarray]) -> None:
    import cupy as cp

    x, _ = test_images
    gpu, cpu = convolab.load_model("ece408", device="gpu"), convolab.load_model("ece408",
                                                                                device="cpu")
    probs = gpu(cp.asarray(x))
    assert isinstance(probs, cp.ndarray)
    np.testing.assert_allclose(probs.get(), cpu(x), atol=1e-5)
    np.testing.assert_array_equal(gpu.predict(x), cpu.predict(x))


@pytest.mark.parametrize("model_name", ["ece408", "eecs498"])
def test_raw_bytes_are_resized_like_the_float_path(model_name: str) -> None:
    from convolab import data, models

    raw, _ = data.load_split("test", limit=40)
    model = convolab.load_model(model_name, device="cpu")
    size = models.spec(model_name).input_size
    np.testing.assert_array_equal(model(raw), model(data.resize_bilinear(raw, size)))
    np.testing.assert_array_equal(model.predict(raw), model.predict(
        data.resize_bilinear(raw, size)))
    with pytest.raises(InputTypeError):
        model(raw.astype(np.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", ["ece408", "ece408-mxnet", "eecs498"])
def test_gpu_model_takes_raw_bytes_host_and_device(model_name: str) -> None:
    import cupy as cp

    from convolab import data, models

    raw, _ = data.load_split("test", limit=300)
    size = models.spec(model_name).input_size
    gpu = convolab.load_model(model_name, device="gpu")
    floats = gpu(data.resize_bilinear(raw, size))
    np.testing.assert_array_equal(gpu(raw), floats)  # exact: the same bits
    on_device = gpu(cp.asarray(raw))
    assert isinstance(on_device, cp.ndarray)
    np.testing.assert_array_equal(on_device.get(), floats)
    np.testing.assert_array_equal(gpu.predict(raw, batch=77), floats.argmax(1))


@pytest.mark.gpu
@pytest.mark.parametrize(("impl", "shape"), [
    ("igemm-wg-fp16", (3, 64, 16, 16, 40, 3)),   # the layout pass reads x in float4s
    ("gemv-mma-fp16", (3, 256, 1, 1, 64, 1)),    # the GEMV stages x in float4s
    ("gemv-tf32", (3, 256, 1, 1, 64, 1)),
])
def test_gpu_input_off_a_16_byte_boundary_is_copied(impl: str, shape: tuple[int, ...],
                                                    rng: np.random.Generator) -> None:
    """A contiguous view that starts 4 bytes into a buffer (as x[1:] of a batch of 29 x 29
    single-channel images starts 3,364 bytes in) runs as its aligned copy does, through the
    library, the registry's forward and an evaluating Conv2d layer."""
    import cupy as cp

    from convolab.registry import get_impl
    from convolab.shapes import ConvShape

    b, c, h, w_, m, k = shape
    if not get_impl(impl).supports(ConvShape(b, c, h, w_, m, k)):
        pytest.skip(f"{impl} does not run here")
    flat = cp.asarray(rng.standard_normal(b * c * h * w_ + 1).astype(np.float32))
    x = flat[1:].reshape(b, c, h, w_)
    assert x.data.ptr % 16 != 0 and x.flags.c_contiguous
    w = cp.asarray((rng.standard_normal((m, c, k, k)) / 10).astype(np.float32))
    want = cp.asnumpy(convolab.conv2d(x.copy(), w, impl=impl))
    np.testing.assert_array_equal(cp.asnumpy(convolab.conv2d(x, w, impl=impl)), want)
    np.testing.assert_array_equal(cp.asnumpy(get_impl(impl).forward(x, w)), want)
    from convolab.layers import Conv2d

    layer = Conv2d(c, m, k, bias=False, impl=impl).eval()  # a prepared run, held by the layer
    layer.weight = w
    np.testing.assert_array_equal(cp.asnumpy(layer(x)), want)
