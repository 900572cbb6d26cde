"""NaN propagates through the GPU's fused paths as through the CPU's (docs/spec.md,
Measurement): an output whose pool window holds a NaN conv output is NaN, the others are
the finite fp64 answer."""

from __future__ import annotations

import numpy as np
import pytest

from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.models import build, conv_blocks
from convolab.registry import get_impl

pytestmark = pytest.mark.gpu

EXACT = ["fused-conv-pool2", "fused-conv-pool4"]
TENSOR_CORE = ["fused-conv-pool2-tc", "fused-conv-pool4-tc", "fused-conv-pool2-tf32",
               "fused-conv-pool4-tf32"]


def _nan_case(rng: np.random.Generator, pool: int) -> tuple:
    block = next(b for b in conv_blocks("ece408", 3) if b.pool == pool)
    shape = block.shape
    x = rng.random(shape.x_shape).astype(np.float32)
    x[1, 0, shape.H // 2, shape.W // 3] = np.nan  # one bad pixel in image 1
    w = (rng.standard_normal(shape.w_shape) * 0.2).astype(np.float32)
    b = (rng.standard_normal(shape.M) * 0.1).astype(np.float32)
    return shape, pool, x, w, b


@pytest.mark.parametrize("name", EXACT + TENSOR_CORE)
def test_fused_rungs_propagate_nan(name: str, rng: np.random.Generator) -> None:
    import cupy as cp

    impl = get_impl(name)
    shape, pool, x, w, b = _nan_case(rng, impl.pool)
    ref = reference_conv_relu_pool(x, w, b, 1, pool)
    got = impl.forward(cp.asarray(x), cp.asarray(w), cp.asarray(b)).get()
    bad = np.isnan(ref)
    assert bad[1].any() and not bad[0].any() and not bad[2].any()
    assert np.isnan(got[bad]).all(), "a pool window with a NaN gave a finite value"
    # images without NaN are untouched and still match the reference
    for i in (0, 2):
        assert rel_l2(got[i], ref[i]) <= impl.tolerance
    if name in EXACT:  # FFMA kernels: NaN exactly where the reference has it
        assert np.array_equal(np.isnan(got), bad)


def test_fused_network_propagates_nan(rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = {k: np.asarray(v, np.float32) for k, v in build("ece408", 0).params().items()}
    shape = conv_blocks("ece408", 4)[0].shape
    x = rng.random(shape.x_shape).astype(np.float32)
    x[2, 0, 40, 40] = np.nan
    for mode in ("exact", "tf32", "fp16"):
        probs = FusedLeNet(params, mode=mode)(cp.asarray(x)).get()
        assert np.isnan(probs[2]).all(), mode
        assert np.isfinite(probs[[0, 1, 3]]).all(), mode
