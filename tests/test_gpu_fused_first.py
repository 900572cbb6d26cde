"""Rung 29 (gpu/fused_first.py, kernels/29_fused_first_conv_pool.cu and 29b): a first block
(C = 1, many output channels) as one kernel, FFMA or fp16 tensor cores, from raw bytes resized
on chip or from floats, writing fp32 or fp16.

Every GPU check runs fresh random shapes and inputs into a NaN-poisoned output against the
fp64 reference on data.resize_bilinear's output; the raw and float entries must agree bit for
bit, the fp16 output must be the fp32 output rounded to nearest even, and the FFMA family's
fp32 output the same bits as the FFMA fused rung's (so the exact network does not change).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from convolab import data
from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.gpu import fused_first
from convolab.gpu.fused_ffma import ACC_BUDGET
from convolab.models import MODELS, conv_blocks, spec
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape, ceil_div

POOL = fused_first.FIRST_POOL
WIDE = tuple(m for m in MODELS if fused_first.preferred(conv_blocks(m)[0].shape,
                                                       conv_blocks(m)[0].pool))


def random_shape(rng: np.random.Generator, square: bool) -> ConvShape:
    """C = 1, M 4..32, K 3/5/7, odd sides, an odd batch."""
    K = int(rng.choice([3, 5, 7]))
    H = int(rng.integers(K + 2, 48)) | 1
    W = H if square else int(rng.integers(K + 2, 48)) | 1
    return ConvShape(int(rng.integers(1, 24)) | 1, 1, H, W, int(rng.integers(4, 33)), K)


def random_raw_hw(rng: np.random.Generator) -> tuple[int, int]:
    """A raw size other than Fashion-MNIST's, smaller or larger than the resized image."""
    while True:
        hw = (int(rng.integers(5, 48)), int(rng.integers(5, 48)))
        if hw != (data.IMAGE_SIDE, data.IMAGE_SIDE):
            return hw


def random_params(rng: np.random.Generator) -> dict[str, int]:
    space = fused_first.FIRST_IMPL.space
    return {key: int(rng.choice([0, *space[key]])) for key in ("threads", "mt")}


def weights(rng: np.random.Generator, shape: ConvShape) -> tuple[np.ndarray, np.ndarray]:
    w = (rng.standard_normal(shape.w_shape) / shape.K).astype(np.float32)
    return w, (0.1 * rng.standard_normal(shape.M)).astype(np.float32)


def run_into(run, x, out_shape, dtype):  # type: ignore[no-untyped-def]
    import cupy as cp

    out = cp.full(out_shape, cp.nan, dtype)  # poisoned
    run(cp.asarray(x), out)
    return out.get()


def pooled_shape(shape: ConvShape, n: int) -> tuple[int, int, int, int]:
    return (n, shape.M, shape.H_out // POOL, shape.W_out // POOL)


# ---- GPU -------------------------------------------------------------------------------------


def check_entries(rng: np.random.Generator, shape: ConvShape, raw_hw: tuple[int, int],
                  precision: str) -> None:
    """Raw entry vs fp64 on the resized images, vs the float entry (bits), fp16 vs fp32 out."""
    params = random_params(rng) if precision == "fp32" else {}
    w, b = weights(rng, shape)
    n = shape.B
    raw = rng.integers(0, 256, (n, *raw_hw), dtype=np.uint8)
    x = data.resize_bilinear(raw, shape.H)
    out = pooled_shape(shape, n)
    what = (shape, raw_hw, params, precision)

    def entry(raw_in: tuple[int, int] | None, dtype: str = "float32") -> Any:
        return fused_first.prepare(shape, POOL, w, b, params, raw_in, dtype, precision)

    assert entry(raw_hw).plan.tensor_cores == (precision == "fp16")
    from_raw = run_into(entry(raw_hw), raw, out, np.float32)
    from_float = run_into(entry(None), x, out, np.float32)
    assert np.array_equal(from_raw.view(np.uint32), from_float.view(np.uint32)), what
    assert np.all(np.isfinite(from_raw)), what
    assert rel_l2(from_raw, reference_conv_relu_pool(x, w, b, 1, POOL)) <= TOLERANCE[
        precision], what
    half = run_into(entry(raw_hw, "float16"), raw, out, np.float16)
    # within fp16 rounding: exactly the fp32 output rounded to nearest even
    assert np.array_equal(half.view(np.uint16),
                          from_raw.astype(np.float16).view(np.uint16)), what


@pytest.mark.gpu
@pytest.mark.parametrize("precision", fused_first.PRECISIONS)
def test_raw_entry_matches_fp64_and_the_float_entry(precision: str,
                                                    rng: np.random.Generator) -> None:
    family = fused_first.tc_supports if precision == "fp16" else fused_first.supports
    checked = 0
    while checked < 4:
        shape, raw_hw = random_shape(rng, square=True), random_raw_hw(rng)
        if family(shape, POOL, raw_hw):
            check_entries(rng, shape, raw_hw, precision)
            checked += 1


@pytest.mark.gpu
@pytest.mark.parametrize("precision", fused_first.PRECISIONS)
def test_float_entry_odd_rectangles_match_fp64(precision: str,
                                               rng: np.random.Generator) -> None:
    checked = 0
    while checked < 4:
        shape = random_shape(rng, square=False)
        if precision == "fp16" and not fused_first.tc_supports(shape, POOL):
            continue
        checked += 1
        params = {"minb": int(rng.choice([0, 1, 2, 3]))}
        if precision == "fp32":
            params |= random_params(rng)
        w, b = weights(rng, shape)
        x = rng.random(shape.x_shape, dtype=np.float32)
        got = run_into(fused_first.prepare(shape, POOL, w, b, params, precision=precision), x,
                       pooled_shape(shape, shape.B), np.float32)
        assert np.all(np.isfinite(got)), (shape, params)
        assert rel_l2(got, reference_conv_relu_pool(x, w, b, 1, POOL)) <= TOLERANCE[precision]


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODELS)
def test_fp32_output_is_the_ffma_rungs_bits(model: str, rng: np.random.Generator) -> None:
    """Same accumulation order, pooling and bias as fcp_accumulate / fcp_store: moving a first
    block to rung 29 leaves an exact forward's bits as they were."""
    import cupy as cp

    from convolab.registry import get_impl

    block = conv_blocks(model, int(rng.integers(1, 40)) | 1)[0]
    shape = block.shape
    w, b = weights(rng, shape)
    x = rng.random(shape.x_shape, dtype=np.float32)
    ours = run_into(fused_first.prepare(shape, block.pool, w, b), x,
                    pooled_shape(shape, shape.B), np.float32)
    ffma = get_impl(f"fused-conv-pool{block.pool}")
    theirs = ffma.forward(cp.asarray(x), cp.asarray(w), cp.asarray(b)).get()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), model


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [fused_first.FIRST_IMPL, fused_first.FIRST_TC_IMPL],
                         ids=lambda i: i.name)
def test_registry_entries_run_their_shapes(impl: Any, rng: np.random.Generator) -> None:
    import cupy as cp

    shape = random_shape(rng, square=False)
    while not impl.supports(shape):
        shape = random_shape(rng, square=False)
    w, b = weights(rng, shape)
    x = rng.standard_normal(shape.x_shape, dtype=np.float32)
    y = impl.forward(cp.asarray(x), cp.asarray(w), cp.asarray(b), minb=1).get()
    assert y.shape == impl.out_shape(shape)
    assert rel_l2(y, reference_conv_relu_pool(x, w, b, 1, POOL)) <= impl.tolerance


@pytest.mark.gpu
def test_run_checks_its_arrays() -> None:
    import cupy as cp

    from convolab.errors import InputError

    shape = conv_blocks(WIDE[0], 2)[0].shape
    w, b = np.ones(shape.w_shape, np.float32), np.zeros(shape.M, np.float32)
    run = fused_first.prepare(shape, POOL, w, b, raw_hw=(28, 28), out_dtype="float16")
    out = cp.empty(pooled_shape(shape, 2), cp.float16)
    with pytest.raises(InputError, match="uint8"):
        run(cp.zeros((2, 28, 28), cp.float32), out)
    with pytest.raises(InputError, match="float16"):
        run(cp.zeros((2, 28, 28), cp.uint8), out.astype(cp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("model", WIDE)
def test_shipped_weights_predictions_unchanged(model: str) -> None:
    """All 10,000 test images from raw bytes: exact mode gives the same bits with rung 29 as
    with the path before it (rung 25 + the FFMA rung), and fp16 / tf32 the same labels wherever
    the exact forward's top two classes are not a near-tie."""
    from convolab.gpu.network import FusedLeNet
    from convolab.models import load

    params = load(model).params()
    raw, labels = data.load_split("test")
    exact = None
    for mode in ("exact", "tf32", "fp16"):
        new = FusedLeNet(params, mode=mode, model=model).forward_chunks(raw)
        old = FusedLeNet(params, mode=mode, model=model,
                         kernel_params={"c1": {"first": -1}}).forward_chunks(raw)
        if mode == "exact":
            assert np.array_equal(new.view(np.uint32), old.view(np.uint32))
            exact = new
            assert (new.argmax(1) == labels).mean() > 0.85
            continue
        assert exact is not None
        top2 = np.sort(exact, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.05
        np.testing.assert_array_equal(new.argmax(1)[clear], exact.argmax(1)[clear])
        np.testing.assert_array_equal(new.argmax(1)[clear], old.argmax(1)[clear])


# ---- CPU: the planner ------------------------------------------------------------------------


def test_plan_covers_every_channel_within_the_limits(rng: np.random.Generator) -> None:
    for _ in range(50):
        shape = random_shape(rng, square=bool(rng.integers(2)))
        shape = ConvShape(shape.B, 1, shape.H, shape.W, int(rng.integers(1, 65)), shape.K)
        pool = int(rng.choice([2, 3]))
        if not fused_first.supports(shape, pool):
            continue
        plan = fused_first.first_plan(shape, pool, random_params(rng))
        mt, groups = plan.channels, plan.defines["FF_G"]
        assert not plan.tensor_cores
        assert groups * mt >= shape.M > (groups - 1) * mt
        assert mt * pool * pool <= ACC_BUDGET
        hp, wp = shape.H_out // pool, shape.W_out // pool
        assert plan.blocks_per_image == ceil_div(hp * wp, plan.threads)
        assert plan.threads % 32 == 0
        # every block's windows read rows inside its staged band
        for j in range(plan.blocks_per_image):
            first, last = j * plan.threads, min((j + 1) * plan.threads, hp * wp) - 1
            rows = (last // wp) * pool + pool - 1 + shape.K - (first // wp) * pool
            assert rows <= fused_first.band_rows(shape, pool, plan.threads)


def test_tensor_core_plan_covers_the_pooled_rows(rng: np.random.Generator) -> None:
    for _ in range(30):
        shape = random_shape(rng, square=bool(rng.integers(2)))
        if not fused_first.tc_supports(shape, POOL):
            continue
        plan = fused_first.first_plan(shape, POOL, {}, None, "float16", "fp16")
        assert plan.tensor_cores and plan.defines["FF_HALF"] == 1
        hp = shape.H_out // POOL
        tph = plan.defines["FF_TPH"]
        assert plan.blocks_per_image * tph >= hp > (plan.blocks_per_image - 1) * tph
        assert tph <= fused_first.TC_ROWS
        # tc = -1 keeps FFMA; precision fp32 never runs tensor cores
        assert not fused_first.first_plan(shape, POOL, {"tc": -1}, None, "float16",
                                          "fp16").tensor_cores
        assert not fused_first.first_plan(shape, POOL, {}, None, "float16").tensor_cores


def test_ffma_weights_pack_groups_and_bias(rng: np.random.Generator) -> None:
    M, K, mt = int(rng.integers(5, 30)), int(rng.choice([3, 5, 7])), int(rng.integers(2, 9))
    w = rng.standard_normal((M, 1, K, K)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    packed = fused_first.ffma_weights(w, b, mt)
    groups, mt4 = ceil_div(M, mt), ceil_div(mt, 4) * 4
    assert packed.dtype == np.float32 and packed.size == groups * (K * K + 1) * mt4
    blocks = packed[:groups * K * K * mt4].reshape(groups, K * K, mt4)
    biases = packed[groups * K * K * mt4:].reshape(groups, mt4)
    for g in range(groups):
        for j in range(mt4):
            c = g * mt + j
            real = j < mt and c < M
            assert np.array_equal(blocks[g, :, j], w[c, 0].ravel() if real
                                  else np.zeros(K * K, np.float32))
            assert biases[g, j] == (b[c] if real else 0.0)


def test_supports_only_single_channel_stride_one() -> None:
    shape = conv_blocks(WIDE[0])[0].shape
    assert fused_first.supports(shape, POOL)
    assert fused_first.supports(shape, POOL, (data.IMAGE_SIDE, data.IMAGE_SIDE))
    assert not fused_first.supports(ConvShape(1, 2, shape.H, shape.W, shape.M, shape.K), POOL)
    assert not fused_first.supports(ConvShape(1, 1, shape.H, shape.W, shape.M, shape.K, 2),
                                    POOL)
    assert not fused_first.supports(shape, POOL, (400, 400))  # the raw image is too large
    assert not fused_first.supports(ConvShape(1, 1, 9, 9, 4, 9), POOL)  # nothing to pool
    for model in MODELS:  # the wide models' conv1 is what it is for
        block = conv_blocks(model)[0]
        assert fused_first.preferred(block.shape, block.pool) == (block.shape.M > 4), model
        assert fused_first.tc_supports(block.shape, block.pool), model
    assert not fused_first.tc_supports(ConvShape(1, 1, 40, 40, 8, 11), POOL)  # K > 9


def test_default_threads_leave_fewest_idle(rng: np.random.Generator) -> None:
    for windows in [int(v) for v in rng.integers(1, 5000, 20)] + [
            (spec(m).input_size - conv_blocks(m)[0].shape.K + 1) ** 2 // 4 for m in MODELS]:
        t = fused_first.default_threads(windows)
        assert t in fused_first.THREAD_CHOICES
        assert all(ceil_div(windows, t) * t <= ceil_div(windows, u) * u
                   for u in fused_first.THREAD_CHOICES)
