"""A batch larger than the GPU: FusedLeNet chunks it (sized from the free device memory) or
refuses it with one ConvolabError naming the batch and the memory; never a CuPy
OutOfMemoryError. The sizing rule is a pure function, tested here on the CPU; the device tests
(marker `gpu`) report a small free memory to FusedLeNet, or ask for a batch whose buffers exceed
the real free memory (computed from memGetInfo, never allocated)."""

from __future__ import annotations

import hypothesis
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convolab.errors import ConvolabError
from convolab.gpu import network
from convolab.gpu.network import DEVICE_MEMORY_SHARE, bytes_per_image, chunk_for, image_shape
from convolab.models import conv_blocks, param_shapes
from convolab.precision import NETWORK_MODES, TOLERANCE


def test_bytes_per_image_counts_each_buffer() -> None:
    b1, b3 = conv_blocks("ece408", 1)
    c1_map = b1.shape.M * (b1.shape.H_out // b1.pool) * (b1.shape.W_out // b1.pool)
    features = b3.shape.M * (b3.shape.H_out // b3.pool) * (b3.shape.W_out // b3.pool)
    pixels = int(np.prod(image_shape()))
    assert bytes_per_image("exact") == 4 * (c1_map + features + 10 + pixels)
    assert bytes_per_image("tf32", with_input=False) == 4 * (c1_map + features + 10)
    assert bytes_per_image("fp16") == 2 * c1_map + 4 * (features + 10 + pixels)


def test_chunk_for_keeps_a_batch_that_fits_and_refuses_when_one_image_does_not() -> None:
    per = bytes_per_image("exact")
    assert chunk_for(100, per * 1000, per) == 100
    assert chunk_for(0, 0, per) == 0
    with pytest.raises(ConvolabError, match=r"batch of 7 images.*free bytes"):
        chunk_for(7, per, per, slots=2)


def test_chunk_for_properties(seed: int) -> None:
    @settings(max_examples=60, deadline=None, derandomize=False, database=None)
    @given(batch=st.integers(1, 10**12), free=st.integers(0, 2**47),
           per=st.integers(1, 2**20), slots=st.integers(1, 4))
    def prop(batch: int, free: int, per: int, slots: int) -> None:
        budget = int(free * DEVICE_MEMORY_SHARE)
        if per * slots > budget:
            with pytest.raises(ConvolabError, match=f"batch of {batch} images"):
                chunk_for(batch, free, per, slots)
            return
        step = chunk_for(batch, free, per, slots)
        assert 1 <= step <= batch
        assert step * per * slots <= budget  # fits
        assert step == batch or (step + 1) * per * slots > budget  # and is the largest that does

    hypothesis.seed(seed)(prop)()


# ---- on the device ---------------------------------------------------------------------------
def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]) if len(s) > 1 else 1.0)
                ).astype(np.float32) for k, s in param_shapes("ece408").items()}


def _report_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(network, "device_free_bytes", lambda: free)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(NETWORK_MODES))
def test_device_batch_beyond_free_memory_is_chunked(monkeypatch, rng, mode: str) -> None:
    import cupy as cp

    from convolab.conv_cpu import reference_forward

    params = _params(rng)
    x = rng.random((37, *image_shape())).astype(np.float32)
    net = network.FusedLeNet(params, mode=mode)
    # Room for 8 images' intermediates at a time: 37 = 4 chunks of 8 and one of 5.
    _report_free(monkeypatch, int(8.5 * bytes_per_image(mode, False) / DEVICE_MEMORY_SHARE))
    probs = net(cp.asarray(x))
    assert not net._plans, "a chunked batch must not keep its buffers cached"
    want = reference_forward(params, x)
    err = np.linalg.norm(cp.asnumpy(probs) - want) / np.linalg.norm(want)
    assert err <= TOLERANCE[NETWORK_MODES[mode]]


@pytest.mark.gpu
def test_host_chunk_beyond_free_memory_is_reduced(monkeypatch, rng) -> None:
    params = _params(rng)
    x = rng.random((50, *image_shape())).astype(np.float32)
    net = network.FusedLeNet(params)
    whole = network.FusedLeNet(params).forward_chunks(x, chunk=50, streams=1)
    _report_free(monkeypatch, int(3 * 6 * bytes_per_image("exact") / DEVICE_MEMORY_SHARE))
    probs = net.forward_chunks(x, chunk=50, streams=2)
    assert {key[0] for key in net._plans} <= {6, 50 % 6}  # chunks of 6 (and the rest)
    np.testing.assert_allclose(probs, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_no_room_for_one_image_is_one_error(monkeypatch, rng) -> None:
    import cupy as cp

    net = network.FusedLeNet(_params(rng))
    _report_free(monkeypatch, bytes_per_image("exact") // 2)
    with pytest.raises(ConvolabError, match="batch of 4 images"):
        net(cp.zeros((4, *image_shape()), cp.float32))
    with pytest.raises(ConvolabError, match="batch of 4 images"):
        net.forward_chunks(np.zeros((4, *image_shape()), np.float32))


@pytest.mark.gpu
def test_plan_larger_than_the_gpu_is_one_error_not_a_cupy_traceback(rng) -> None:
    # Twice the real free memory: CuPy's allocator fails, FusedLeNet must name the batch.
    net = network.FusedLeNet(_params(rng))
    batch = 2 * network.device_free_bytes() // bytes_per_image("exact", False) + 1
    with pytest.raises(ConvolabError, match=f"batch of {batch} images"):
        net._plan(batch)
    assert not net._plans
