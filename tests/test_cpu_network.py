"""The fused CPU network forward (Network.forward/predict in eval mode on NumPy float32), its
on-disk kernel cache, and `bench --network --device cpu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convolab import conv_cpu, models, network
from convolab.conv_cpu import reference_forward
from convolab.errors import ConvolabError

MODELS = tuple(models.MODELS)


def _random_net(name: str, rng: np.random.Generator) -> tuple[network.Network, np.ndarray]:
    net = models.build(name, seed=int(rng.integers(1 << 31))).eval()
    for key, value in net.params().items():  # non-zero biases, so a dropped bias shows
        if key.endswith(".bias"):
            net.set_param(key, rng.standard_normal(value.shape).astype(np.float32) * 0.1)
    size = models.spec(name).input_size
    return net, rng.random((3, 1, size, size), dtype=np.float32)


@pytest.mark.parametrize("name", MODELS)
def test_fused_forward_matches_fp64_reference(name: str, rng: np.random.Generator,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    net, x = _random_net(name, rng)
    calls = []
    fused = conv_cpu.conv_relu_pool_cpu

    def counted(*args: object) -> np.ndarray:
        calls.append(args[-1])
        return fused(*args)

    monkeypatch.setattr(conv_cpu, "conv_relu_pool_cpu", counted)
    probs = net.forward(x)
    assert calls == [b.pool for b in models.conv_blocks(name)], "every block runs fused"
    ref = reference_forward(net.params(), x, model=name)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs, ref, atol=1e-5, rtol=1e-4)


def test_fused_forward_matches_unfused_layers(rng: np.random.Generator) -> None:
    net, x = _random_net("ece408", rng)
    fused = net.forward(x)
    unfused = x
    for layer in net.layers:  # the layer-by-layer path (cpu-im2col, NumPy ReLU/pool)
        unfused = layer.forward(unfused)
    np.testing.assert_allclose(fused, unfused, atol=1e-5, rtol=1e-4)


def test_nan_propagates_through_the_fused_forward(rng: np.random.Generator) -> None:
    net, x = _random_net("ece408-mxnet", rng)
    x[1, 0, 10, 10] = np.nan
    probs = net.forward(x)
    assert np.isnan(probs[1]).all(), "a NaN pixel must not become a plausible answer"
    assert np.isfinite(probs[[0, 2]]).all()


def test_chunking_does_not_change_results(rng: np.random.Generator,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    net, _ = _random_net("eecs498", rng)
    x = rng.random((7, 1, 64, 64), dtype=np.float32)
    whole = net.forward(x)
    per_image = 12 * 64 * 64 * 4  # the estimate _cpu_inference makes for eecs498
    monkeypatch.setattr(network, "CPU_CHUNK_BYTES", 2 * per_image)  # chunks of 2 images
    # The conv blocks are per image; only the head's BLAS GEMM may sum in another order.
    np.testing.assert_allclose(net.forward(x), whole, rtol=1e-6, atol=1e-7)
    assert net.predict(x, batch=3).tolist() == whole.argmax(1).tolist()


def test_training_mode_and_float64_keep_the_layer_path(rng: np.random.Generator) -> None:
    net, x = _random_net("ece408", rng)
    net.train()
    logits = net.logits(x)
    net.backward(np.ones_like(logits))  # a training forward kept what backward needs
    assert net.layers[0].grads()["weight"].shape == net.layers[0].weight.shape
    net.eval()
    probs64 = net.forward(x.astype(np.float64))
    assert probs64.dtype == np.float64
    np.testing.assert_allclose(probs64, net.forward(x), atol=1e-5)


_CACHE_PROBE = """
import json, sys, numpy as np
from convolab import conv_cpu
out = {}
for K in (5, 3):
    rng = np.random.default_rng(K)
    x = rng.random((2, 3, 12 + K, 12 + K), dtype=np.float32)
    w = rng.standard_normal((4, 3, K, K)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    y = conv_cpu.conv_relu_pool_cpu(x, w, b, 1, 2)
    ref = conv_cpu.reference_conv_relu_pool(x, w, b, 1, 2)
    fn = conv_cpu._direct_kernels(K, True)[1]
    out[K] = {"err": float(np.abs(y - ref).max()),
              "hits": sum(fn.stats.cache_hits.values()),
              "misses": sum(fn.stats.cache_misses.values())}
print(json.dumps(out))
"""


def test_kernel_cache_survives_processes(tmp_path: Path) -> None:
    """Process 1 compiles K=5 and K=3 into an empty cache; process 2 loads both (no compile)
    and each gives its own K's right answer (same-named cached kernels once collided)."""
    env = {**os.environ, "CONVOLAB_CACHE": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(Path(conv_cpu.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, check=True,
                              capture_output=True, text=True, timeout=300)
        runs.append(json.loads(done.stdout))
    first, second = runs
    for k in ("5", "3"):
        assert first[k]["misses"] >= 1 and first[k]["err"] < 1e-4
        assert second[k] == {**second[k], "hits": second[k]["hits"], "misses": 0}
        assert second[k]["hits"] >= 1 and second[k]["err"] < 1e-4
    assert list((tmp_path / "numba").glob("convolab_cpu_kernels_*.py"))


def test_bench_network_cpu_rows(tmp_path: Path) -> None:
    from convolab import bench
    from convolab.bench.cpu_network import CONVOLAB_ROW, ORT_ROW

    config = bench.from_flags("ece408", 4, 2, network=True, device="cpu")
    bench.main([config], out=tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["runs"][0]["rows"]
    ours = next(r for r in rows if r["name"] == CONVOLAB_ROW)
    assert ours["batch"] == 4 and ours["median_ms"] > 0 and ours["threads"] >= 1
    assert ours["argmax_agree_vs_fp64"] == 1.0
    ort = next(r for r in rows if r["name"] == ORT_ROW)
    assert "median_ms" in ort or ort["note"].startswith("skipped")
    if "median_ms" in ort:
        assert ours["time_vs_onnxruntime"] == pytest.approx(ours["median_ms"] / ort["median_ms"])
    assert CONVOLAB_ROW in (tmp_path / "results.csv").read_text()


@pytest.mark.parametrize("kwargs, words", [
    ({"device": "cpu"}, "add --network"),
    ({"device": "tpu", "network": True}, "'cpu' or 'gpu'"),
    ({"device": "cpu", "network": True, "variants": ("fp16",)}, "--variant"),
])
def test_bench_device_flag_is_checked(kwargs: dict, words: str) -> None:
    from convolab import bench

    with pytest.raises(ConvolabError, match=words):
        bench.from_flags("ece408", 4, 1, **kwargs)
