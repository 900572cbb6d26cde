"""Rung 29 (gpu/fused_first.py, kernels/29_fused_first_conv_pool.cu and 29b): a first block
(C = 1, many output channels) as one kernel, FFMA or fp16 tensor cores, from raw bytes resized
on chip or from floats, writing fp32 or fp16.

Every GPU check runs fresh random shapes and inputs into a NaN-poisoned output against the
fp64 reference on data.resize_bilinear's output; the raw and float entries must agree bit for
bit, the fp16 output must be the fp32 output rounded to nearest even, and the FFMA family's
fp32 output the same bits as the FFMA fused rung's (so the exact network does not change).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda_emulator import BLOCK_SHIM, CUDA_SHIM, MMA_SHIM, WGMMA_SHIM, inline_headers

from convolab import data
from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.gpu import fused_first
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.gpu.fused_ffma import ACC_BUDGET
from convolab.models import MODELS, conv_blocks, spec
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape, ceil_div

POOL = fused_first.FIRST_POOL
# (precision, tc): every family — FFMA, 29b's Toeplitz fp16, 29c's row pairs fp16 and 3xfp16,
# and the row pairs on the warpgroup MMA (45) in both
FAMILIES = (("fp32", fused_first.TC_FFMA), ("fp16", fused_first.TC_TOEPLITZ),
            ("fp16", fused_first.TC_ROWPAIR), ("3xfp16", fused_first.TC_ROWPAIR),
            ("fp16", fused_first.TC_WGMMA), ("3xfp16", fused_first.TC_WGMMA))
FILES = {fused_first.TC_FFMA: fused_first.KERNEL_FILE,
         fused_first.TC_TOEPLITZ: fused_first.TC_KERNEL_FILE,
         fused_first.TC_ROWPAIR: fused_first.RP_KERNEL_FILE,
         fused_first.TC_WGMMA: fused_first.WG_KERNEL_FILE}
WIDE = fused_first.wide_models()


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


def takes(shape: ConvShape, raw_hw: tuple[int, int] | None, precision: str, tc: int) -> bool:
    """Whether the family (precision, tc) runs the shape (rather than a fallback)."""
    try:
        plan = fused_first.first_plan(shape, POOL, {"tc": tc}, raw_hw, "float32", precision)
    except ValueError:
        return False
    return plan.kernel_file == FILES[tc]


def check_entries(rng: np.random.Generator, shape: ConvShape, raw_hw: tuple[int, int],
                  precision: str, tc: int) -> None:
    """Raw entry vs fp64 on the resized images, vs the float entry (bits), fp16 vs fp32 out."""
    params = random_params(rng) if precision == "fp32" else {}
    params["tc"] = tc
    w, b = weights(rng, shape)
    n = shape.B
    raw = rng.integers(0, 256, (n, *raw_hw), dtype=np.uint8)
    x = data.resize_bilinear(raw, shape.H)
    out = pooled_shape(shape, n)
    what = (shape, raw_hw, params, precision)

    def entry(raw_in: tuple[int, int] | None, dtype: str = "float32") -> Any:
        return fused_first.prepare(shape, POOL, w, b, params, raw_in, dtype, precision)

    assert entry(raw_hw).plan.kernel_file == FILES[tc]
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
@pytest.mark.parametrize(("precision", "tc"), FAMILIES)
def test_raw_entry_matches_fp64_and_the_float_entry(precision: str, tc: int,
                                                    rng: np.random.Generator) -> None:
    checked = 0
    while checked < 4:
        shape, raw_hw = random_shape(rng, square=True), random_raw_hw(rng)
        if takes(shape, raw_hw, precision, tc):
            check_entries(rng, shape, raw_hw, precision, tc)
            checked += 1


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "tc"), FAMILIES)
def test_float_entry_odd_rectangles_match_fp64(precision: str, tc: int,
                                               rng: np.random.Generator) -> None:
    checked = 0
    while checked < 4:
        shape = random_shape(rng, square=False)
        if not takes(shape, None, precision, tc):
            continue
        checked += 1
        params = {"minb": int(rng.choice([0, 1, 2, 3])), "tc": tc}
        if precision == "fp32":
            params |= random_params(rng)
        elif tc == fused_first.TC_ROWPAIR:
            params |= {"warps": int(rng.choice([0, 2, 3, 8])), "rows": int(rng.integers(0, 6))}
        elif tc == fused_first.TC_WGMMA:
            params |= {"warps": int(rng.choice([0, 4, 8])), "rows": int(rng.integers(0, 6))}
        w, b = weights(rng, shape)
        x = rng.random(shape.x_shape, dtype=np.float32)
        # a scale far from 1 (3xfp16's power of two must follow it)
        x = x * np.float32(rng.choice([1e-3, 1.0, 500.0]))
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
@pytest.mark.parametrize("impl", [fused_first.FIRST_IMPL, fused_first.FIRST_TC_IMPL,
                                  fused_first.FIRST_RP_IMPL, fused_first.FIRST_3X_IMPL,
                                  fused_first.FIRST_WG_IMPL, fused_first.FIRST_WG_3X_IMPL],
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
    """All 10,000 test images from raw bytes: exact mode (rung 29 in the precision
    NETWORK_PRECISION gives it) within fp32's tolerance of the path before it (rung 25 + the
    FFMA rung) and predicting the CPU framework's class for every image; fp16 / tf32 the same
    labels wherever the exact forward's top two classes are not a near-tie."""
    from convolab.gpu.network import FusedLeNet
    from convolab.models import load

    network = load(model)
    params = network.params()
    raw, labels = data.load_split("test")
    exact = None
    for mode in ("exact", "tf32", "fp16"):
        new = FusedLeNet(params, mode=mode, model=model).forward_chunks(raw)
        old = FusedLeNet(params, mode=mode, model=model,
                         kernel_params={"c1": {"first": -1}}).forward_chunks(raw)
        if mode == "exact":
            assert rel_l2(new, old) <= TOLERANCE["fp32"]
            cpu = network.predict(data.resize_bilinear(raw, spec(model).input_size))
            np.testing.assert_array_equal(new.argmax(1), cpu)
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
        raw_hw = random_raw_hw(rng) if rng.integers(2) else None
        hp = shape.H_out // POOL
        for precision, tc, rows_key in (("fp16", fused_first.TC_TOEPLITZ, "FF_TPH"),
                                        ("fp16", fused_first.TC_ROWPAIR, "FR_TPH"),
                                        ("3xfp16", fused_first.TC_ROWPAIR, "FR_TPH"),
                                        ("fp16", fused_first.TC_WGMMA, "FR_TPH"),
                                        ("3xfp16", fused_first.TC_WGMMA, "FR_TPH")):
            if not takes(shape, raw_hw, precision, tc):
                continue
            plan = fused_first.first_plan(shape, POOL, {"tc": tc}, raw_hw, "float16", precision)
            assert plan.tensor_cores and plan.defines["FF_HALF"] == 1
            tph = plan.defines[rows_key]
            assert plan.blocks_per_image * tph >= hp > (plan.blocks_per_image - 1) * tph
            if tc == fused_first.TC_TOEPLITZ:
                assert tph <= fused_first.TC_ROWS
            else:  # the whole image where it fits, and within the static shared memory
                split = precision == "3xfp16"
                assert fused_first.rp_smem_bytes(shape, tph, split, raw_hw) <= (
                    fused_first.SMEM_STATIC_LIMIT)
                assert tph == hp or fused_first.rp_smem_bytes(shape, hp, split, raw_hw) > (
                    fused_first.SMEM_STATIC_LIMIT)
        # by default a precision of WG_CHOSEN takes 45 where it takes the shape, else the row
        # pairs; tc = -1 keeps FFMA; fp32 never tensor cores
        for precision in ("fp16", "3xfp16"):
            split = precision == "3xfp16"
            wg = precision in fused_first.WG_CHOSEN and fused_first.wg_supports(
                shape, POOL, None, split)
            want = fused_first.WG_KERNEL_FILE if wg else fused_first.RP_KERNEL_FILE
            if fused_first.rp_supports(shape, POOL, None, split):
                plan = fused_first.first_plan(shape, POOL, {}, None, "float16", precision)
                assert plan.kernel_file == want, (shape, precision)
                if want == fused_first.WG_KERNEL_FILE:  # the B tiles ahead of the staged maps
                    assert plan.smem == fused_first.wg_b_bytes(shape, split) + (
                        plan.defines["FR_OUT_SMEM"] * shape.M * plan.defines["FR_TPH"]
                        * (shape.W_out // POOL) * 2)
        assert not fused_first.first_plan(shape, POOL, {"tc": -1}, None, "float16",
                                          "fp16").tensor_cores
        assert not fused_first.first_plan(shape, POOL, {}, None, "float16").tensor_cores


def rowpair_weights(rng: np.random.Generator) -> tuple[int, int, np.ndarray, dict[str, int]]:
    """K, M, weights (M, 1, K, K) at a random scale, and the row pairs' geometry for them."""
    K = int(rng.choice([3, 5, 7]))
    M = int(rng.integers(1, 20))
    w = (rng.standard_normal((M, 1, K, K)) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)
    return K, M, w, fused_first.rp_geometry(ConvShape(1, 1, K, K, M, K), 1)


def test_rowpair_fragments_hold_the_weights(rng: np.random.Generator) -> None:
    """Unpacked from the lanes, B[k][c * D + dx] is w[c][2s + k // 8][k % 8 - dx] (zero
    elsewhere); the split's parts sum to the weights to ~2^-22 and keep the power of two."""
    from convolab.gpu.fused_mma import LANE_G, LANE_T

    K, M, w, geo = rowpair_weights(rng)
    d, cn = geo["D"], geo["CN"]
    for split in (False, True):
        frag, e = fused_first.rowpair_fragments(w, split)
        assert frag.shape == (1 + split, geo["KS"], geo["NT"], 32, 2)
        halves = frag.view(np.float16).astype(np.float64)  # (..., 32, 4): k 2t, 2t+1, +8, +9
        total = halves.sum(axis=0) if split else halves[0]
        band = np.zeros((geo["KS"], geo["NT"], 16, 8))
        for i, k in enumerate((0, 1, 8, 9)):
            band[:, :, 2 * LANE_T + k, LANE_G] = total[:, :, :, i]
        want = np.zeros_like(band)
        for s in range(geo["KS"]):
            for n in range(geo["NT"]):
                for k in range(16):
                    for col in range(8):
                        c, p, j = n * cn + col // d, 2 * s + k // 8, k % 8 - col % d
                        if c < M and p < K and 0 <= j < K:
                            want[s, n, k, col] = w[c, 0, p, j] * 2.0 ** e
        scale = np.abs(want).max()
        assert np.abs(band - want).max() <= scale * (2.0 ** -21 if split else 2.0 ** -10)
        if split:
            assert 2 ** 14 <= np.abs(w).max() * 2.0 ** e < 2 ** 15


def test_wgmma_tiles_hold_the_weights_where_the_descriptors_point(
        rng: np.random.Generator) -> None:
    """Read back as 45's descriptors address them (tile (part, s) at (part KS + s) NT 256 bytes,
    8 k of column n at n // 8 * 256 + n % 8 * 16, k 8-15 128 bytes on), B[k][n] is 29c's B: the
    two packings hold the same operand, except that with the split and an odd K > 1 the last
    hi tile repeats its k 0-7 in k 8-15 (where 29c's B is zero)."""
    K, M, w, geo = rowpair_weights(rng)
    ks, nt = geo["KS"], geo["NT"]
    for split in (False, True):
        tiles, e = fused_first.rowpair_wgmma_tiles(w, split)
        frag, e_frag = fused_first.rowpair_fragments(w, split)
        assert e == e_frag and tiles.dtype == np.uint16
        assert tiles.nbytes == fused_first.wg_b_bytes(ConvShape(1, 1, K, K, M, K), split)
        smem = tiles.reshape(-1).view(np.float16)
        halves = frag.view(np.float16)  # (parts, KS, NT, 32, 4): k 2t, 2t+1, 2t+8, 2t+9
        for part in range(1 + split):
            for s in range(ks):
                base = (part * ks + s) * nt * 256
                for n in range(8 * nt):
                    for k in range(16):
                        at = (base + n // 8 * 256 + (k // 8) * 128 + n % 8 * 16 + k % 8 * 2) // 2
                        lane = 4 * (n % 8) + k % 8 // 2  # g = n, t = k // 2
                        reg = (k % 2) + 2 * (k // 8)
                        if fused_first.odd_last_step(K, split) and s == ks - 1 and k >= 8:
                            assert halves[part, s, n // 8, lane, reg] == 0
                            if part == 0:  # k - 8's weight, (hi) x [hi | lo] of the input
                                reg -= 2
                        assert smem[at] == halves[part, s, n // 8, lane, reg], (part, s, n, k)


def test_wgmma_refuses_what_its_wgmma_cannot_take() -> None:
    eecs498, mxnet = (conv_blocks(m)[0] for m in ("eecs498", "ece408-mxnet"))
    for block in (eecs498, mxnet):
        for split in (False, True):
            assert fused_first.wg_why_not(block.shape, block.pool, None, split) is None
    # K = 5: two channels an n-tile, so M = 10 needs NT = 5 (no m64n40 wrapper)
    assert "NT in" in fused_first.wg_why_not(ConvShape(1, 1, 30, 30, 10, 5), POOL)
    assert "row pairs" in fused_first.wg_why_not(ConvShape(1, 1, 30, 30, 8, 9), POOL)
    with pytest.raises(ValueError, match="multiple of 4"):
        fused_first.first_plan(eecs498.shape, POOL, {"tc": fused_first.TC_WGMMA, "warps": 6},
                               precision="fp16")


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


# ---- CPU: 29c's and 45's source under g++, mma.sync and wgmma emulated -------------------------

# What the row-pair kernels need beyond MMA_SHIM (kernel 47's emulator takes it too): their
# block-scope __shared__ arrays as statics (one block runs at a time), float2, half2 packing,
# the resize's correctly rounded operations.
ROWPAIR_SHIM = r"""
#undef __shared__
#define __shared__ static
#include <memory>
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
struct __half2 { __half x, y; };
inline __half2 pack_half2(float lo, float hi) { return {(__half)lo, (__half)hi}; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float fminf(float a, float b) { return std::fmin(a, b); }
inline float fabsf(float a) { return std::fabs(a); }
using std::max;
"""
EMU = CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + ROWPAIR_SHIM + r"""
alignas(128) unsigned char emu_smem[64 * 1024];  // the dynamic shared memory
#define FR_DYN_SMEM emu_smem
""" + WGMMA_SHIM + r"""
#include "kernel.inc"
#ifdef FR_B_BYTES  // rung 45: its packed B tiles
#define EMU_W_COUNT (FR_B_BYTES / 16)
#else  // 29c: a lane's fragments
#define EMU_W_COUNT (FR_PARTS * FR_KS * FR_NT * 32)
#endif
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int batch = atoi(argv[2]), tiles_h = atoi(argv[3]), w_e = atoi(argv[4]);
#if FR_STG  // staged records (as floats: a record is a multiple of 16 bytes)
  const size_t ny = (size_t)batch * FR_STG_REC / sizeof(ff_out);
#else
  const size_t ny = (size_t)batch * FR_M * FF_TASKS;
#endif
#ifdef RAW_INPUT
  auto* x = read<unsigned char>(dir, "x.bin", (size_t)batch * RAW_H * RAW_W);
  auto* taps = read<ResizeTap>(dir, "taps.bin", FF_H + FF_W);
#else
  auto* x = read<float>(dir, "x.bin", (size_t)batch * FF_H * FF_W);
#endif
  auto* frag = read<fr_b_t>(dir, "w.bin", EMU_W_COUNT);
  auto* bias = read<float>(dir, "b.bin", FR_M + 2 * FR_STG);  // (the staged scale's bound)
  auto* y = read<ff_out>(dir, "y.bin", ny + 64);
  for (int blk = 0; blk < batch * tiles_h; ++blk) {
    static_assert(FR_THREADS == 32 * FR_WARPS);
    std::memset(emu_smem, 0xFF, sizeof emu_smem);  // NaN in fp16 and fp32: unwritten shows
    std::vector<std::unique_ptr<std::barrier<>>> wgb;  // each warpgroup's (45)
    for (int g = 0; g < FR_WARPS / 4; ++g) {
      wgb.emplace_back(new std::barrier<>(128));
      wg_bar[g] = wgb.back().get();
    }
    run_block(blk, FR_THREADS, [=] {
#ifdef RAW_INPUT
      FR_ENTRY(raw)(x, taps, frag, bias, y, w_e, tiles_h);
#else
      FR_ENTRY(f32)(x, frag, bias, y, w_e, tiles_h);
#endif
    });
  }
  char path[1024]; snprintf(path, sizeof path, "%s/y_out.bin", dir);
  FILE* f = fopen(path, "wb"); fwrite(y, sizeof(ff_out), ny + 64, f); fclose(f);
}
"""
GXX = shutil.which("g++")
SENTINEL = 64  # outputs past the last, which must stay untouched


def run_emulator(tmp_path: Path, plan: fused_first.FirstPlan, shape: ConvShape, x: np.ndarray,
                 raw_hw: tuple[int, int] | None, weights: np.ndarray, bias: np.ndarray,
                 y: np.ndarray, w_e: int) -> np.ndarray:
    """A row-pair kernel's plan built with g++ over EMU and run on every block of the batch:
    x, the packed weights, the bias (as the kernel reads it) and the output's initial contents
    y go in; y's contents after the run come back (same dtype and size)."""
    from convolab.gpu.resize import resize_taps

    source = inline_headers((KERNEL_DIR / plan.kernel_file).read_text(), KERNEL_DIR,
                            keep=("common.cuh", "wgmma_core.cuh", "wgmma_rs.cuh"))
    assert "asm" not in source, "inline PTX the emulator does not know"
    (tmp_path / "kernel.inc").write_text(source)
    (tmp_path / "emu.cpp").write_text(EMU)
    exe = tmp_path / "emu"
    flags = [*define_flags(plan.defines), *(["-DRAW_INPUT"] if raw_hw else [])]
    build = subprocess.run([str(GXX), "-std=c++20", "-O1", "-pthread", "-w", *flags, "-o",
                            str(exe), str(tmp_path / "emu.cpp")], capture_output=True,
                           text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    x.tofile(tmp_path / "x.bin")
    if raw_hw:
        resize_taps(*raw_hw, shape.H, shape.W).tofile(tmp_path / "taps.bin")
    weights.tofile(tmp_path / "w.bin")
    bias.astype(np.float32).tofile(tmp_path / "b.bin")
    y.tofile(tmp_path / "y.bin")
    run = subprocess.run([str(exe), str(tmp_path), str(shape.B), str(plan.blocks_per_image),
                          str(w_e)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return np.fromfile(tmp_path / "y_out.bin", y.dtype)


def emulate(tmp_path: Path, shape: ConvShape, x: np.ndarray, w: np.ndarray, b: np.ndarray,
            raw_hw: tuple[int, int] | None, split: bool, out_dtype: str,
            params: dict[str, int], tc: int = fused_first.TC_ROWPAIR) -> np.ndarray:
    """29c's (tc 2) or 45's (tc 3) output for (x, w, b) run on the CPU (every block of the
    batch)."""
    precision = "3xfp16" if split else "fp16"
    plan = fused_first.first_plan(shape, POOL, {**params, "tc": tc}, raw_hw, out_dtype,
                                  precision)
    assert plan.kernel_file == FILES[tc]
    pack = (fused_first.rowpair_wgmma_tiles if tc == fused_first.TC_WGMMA
            else fused_first.rowpair_fragments)
    frag, w_e = pack(w, split)
    out = pooled_shape(shape, shape.B)
    ny = int(np.prod(out))
    y = run_emulator(tmp_path, plan, shape, x, raw_hw, frag, b,
                     np.full(ny + SENTINEL, np.nan, out_dtype), w_e)
    assert np.isnan(y[ny:]).all(), "wrote past the output"
    return y[:ny].reshape(out).astype(np.float32)


EMULATED = [  # (shape, raw_hw, split, out_dtype, params): odd sizes, K 3/5/7, both families
    (ConvShape(2, 1, 15, 17, 12, 5), None, False, "float32", {}),
    (ConvShape(2, 1, 15, 17, 12, 5), None, True, "float32", {"rows": 2}),
    (ConvShape(1, 1, 20, 19, 13, 7), None, True, "float16", {"warps": 3}),
    (ConvShape(2, 1, 18, 18, 12, 7), (11, 13), False, "float32", {"rows": 3}),
    (ConvShape(1, 1, 14, 14, 7, 3), (28, 28), True, "float32", {"warps": 2}),
    (ConvShape(1, 1, 13, 13, 5, 5), (9, 9), True, "float32", {}),
    # the output through shared memory: bands of rows, and fp32 whole images
    (ConvShape(3, 1, 21, 19, 12, 7), None, False, "float16", {"rows": 3}),
    (ConvShape(2, 1, 17, 17, 11, 5), (13, 11), True, "float32", {"osm": 1}),
    (ConvShape(2, 1, 16, 16, 12, 5), None, False, "float16", {"osm": 0}),
    (ConvShape(3, 1, 18, 18, 12, 7), (28, 28), False, "float16", {"osm": 1}),  # 8-byte runs
]
EMULATED_WGMMA = [  # rung 45: N = 8, 24, 32, 48; two warpgroups; bands; raw; staged output
    (ConvShape(2, 1, 18, 17, 12, 7), None, True, "float32", {}),
    (ConvShape(2, 1, 15, 17, 12, 5), None, False, "float32", {"warps": 8}),
    (ConvShape(1, 1, 20, 20, 13, 7), (28, 28), True, "float32", {"rows": 3}),
    (ConvShape(2, 1, 14, 13, 7, 3), None, True, "float16", {"warps": 8, "osm": 1}),
    (ConvShape(3, 1, 16, 16, 4, 7), (11, 13), False, "float16", {"rows": 2}),
    (ConvShape(1, 1, 21, 21, 11, 5), (13, 11), True, "float16", {}),
    (ConvShape(2, 1, 16, 15, 12, 5), None, False, "float16", {"warps": 8}),
]
# An fp16 output's rounding (2^-11 relative) with room for the fp32 sums' order.
FP16_OUTPUT_ROUNDING = 1e-3
CASES = [(case, fused_first.TC_ROWPAIR) for case in EMULATED] + [
    (case, fused_first.TC_WGMMA) for case in EMULATED_WGMMA]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_rowpair_kernel_emulated_on_cpu(case: int, tmp_path: Path,
                                        rng: np.random.Generator) -> None:
    """Every output written and close to fp64, and a raw image the same bits as its resized
    floats. 3xfp16 is fp32-exact: within 2e-6 of the fp64 reference (the emulated MMA being
    exact). fp16 is held to the arithmetic it defines, the fp64 sum of fp16-rounded operands,
    within the output's rounding: against the unrounded reference its error is data-dependent,
    ~1e-2 where the ReLU leaves a few small outputs (4 channels, negative weight sums)."""
    (shape, raw_hw, split, out_dtype, params), tc = CASES[case]
    w, b = weights(rng, shape)
    if raw_hw:
        raw = rng.integers(0, 256, (shape.B, *raw_hw), dtype=np.uint8)
        x = data.resize_bilinear(raw, shape.H)
    else:  # a scale far from 1: the split's power of two must follow it
        x = (rng.standard_normal(shape.x_shape) * 300).astype(np.float32)
    y = emulate(tmp_path, shape, raw if raw_hw else x, w, b, raw_hw, split, out_dtype, params,
                tc)
    assert np.isfinite(y).all(), CASES[case]
    if split:
        ref = reference_conv_relu_pool(x, w, b, 1, POOL)
    else:
        ref = reference_conv_relu_pool(x.astype(np.float16), w.astype(np.float16), b, 1, POOL)
    bound = 2e-6 if out_dtype == "float32" else FP16_OUTPUT_ROUNDING
    assert rel_l2(y, ref) <= bound, CASES[case]
    if raw_hw:
        y_float = emulate(tmp_path, shape, x, w, b, None, split, out_dtype, params, tc)
        assert np.array_equal(y.view(np.uint32), y_float.view(np.uint32))


# ---- CPU: the bench's raw per-layer rows (benchmarks/plans/first_block.toml) -----------------


def test_first_block_plan_times_rung_29_against_the_path_before() -> None:
    from convolab.bench.contenders import named_contender, raw_contender
    from convolab.bench.plan import load_plan

    plan = Path(__file__).parents[1] / "benchmarks" / "plans" / "first_block.toml"
    runs = load_plan(plan)
    raw_runs = [r for r in runs if r.inputs == "raw" and not r.network]
    assert {r.model for r in raw_runs} == set(WIDE)
    for run in raw_runs:
        shape = conv_blocks(run.model, run.batch)[0].shape
        names = []
        for spec_ in run.impls:
            c = raw_contender(named_contender(spec_, gpu=True), (data.IMAGE_SIDE,) * 2)
            assert c.supports(shape) and not c.supports(conv_blocks(run.model)[1].shape)
            names.append(c.name)
        if run.label.endswith("-raw"):  # rung 29's own raw entries, and rung 25 in front
            assert "fused-first-conv-pool2 (raw)" in names  # of the kernels before it
            assert "rung 25 + fused-conv-pool2" in names
    assert {r.model for r in runs if r.network} == set(WIDE)
    for run in runs:  # the float runs are the same first blocks
        for text in run.custom_shapes:
            assert parse(text) in {conv_blocks(m, run.batch)[0].shape for m in WIDE}


def parse(text: str) -> ConvShape:
    from convolab.bench.cases import parse_shape

    return parse_shape(text).shape


STAGED_CASES = [  # rung 45 writing rung 46's staged records: (conv1 shape, raw_hw, conv2 K),
    # K 5 and 3 too (the network takes the records from K 7, the kernel writes any)
    (ConvShape(3, 1, 18, 17, 12, 7), None, 3),
    (ConvShape(2, 1, 16, 16, 12, 5), (28, 28), 3),
    (ConvShape(2, 1, 14, 13, 7, 3), None, 3),
    # K 6-7 (two conv columns an A row, the network's case) at other channel counts: M 16, 4,
    # and 8 from raw bytes
    (ConvShape(2, 1, 15, 16, 16, 7), None, 3),
    (ConvShape(2, 1, 16, 17, 4, 6), None, 3),
    (ConvShape(2, 1, 18, 18, 8, 7), (28, 28), 3),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("case", range(len(STAGED_CASES)))
def test_wgmma_writes_the_next_blocks_staged_records(case: int, tmp_path: Path,
                                                     rng: np.random.Generator) -> None:
    """Each image's record: its scale exponent from the bound 2^(15 - e) W1 + B1 (e the input's
    exponent), conv1's pooled maps as hi + lo of v 2^e2 at conv2's staged positions (equal to
    the fp64 reference to 3xfp16's tolerance), nothing written in the padding or slack."""
    from convolab.gpu import fused_wgmma, fused_wide

    shape, raw_hw, k2 = STAGED_CASES[case]
    w, b = weights(rng, shape)
    if raw_hw:
        x = rng.integers(0, 256, (shape.B, *raw_hw), dtype=np.uint8)
        images = data.resize_bilinear(x, shape.H)
    else:
        x = images = (rng.standard_normal(shape.x_shape) * 300).astype(np.float32)
    hp, wp = pooled_shape(shape, 1)[2:]
    plan2 = fused_wgmma.ws_plan(ConvShape(shape.B, shape.M, hp, wp, 24, k2), "3xfp16", {},
                                fused_wgmma.STAGED)
    layout = fused_wgmma.staged_record(plan2.defines)
    assert fused_first.staged_takes(shape, POOL, {}, raw_hw) == (shape.K >= 6)
    plan = fused_first._staged_plan(fused_first.first_plan(shape, POOL, {}, raw_hw, "float32",
                                                           "3xfp16"), shape, layout)
    tiles, w_e = fused_first.rowpair_wgmma_tiles(w, True)
    w1 = np.abs(w.astype(np.float64)).sum(axis=(1, 2, 3)).max()
    b1 = np.abs(b.astype(np.float64)).max()
    bias = np.concatenate([b, np.nextafter(np.float32([w1, b1]), np.float32(np.inf))])
    rec = layout["FR_STG_REC"] // 2
    poison = np.full(shape.B * rec + 2 * SENTINEL, 0x7E00, np.uint16)  # fp16 NaN
    out = run_emulator(tmp_path, plan, shape, x, raw_hw, tiles, bias, poison, w_e)
    assert (out[shape.B * rec:] == 0x7E00).all(), "wrote past the records"
    records = out[:shape.B * rec].reshape(shape.B, rec)
    ref = reference_conv_relu_pool(images.astype(np.float64), w, b, 1, POOL)
    ws, cs, part = layout["FR_STG_WS"], layout["FR_STG_CS"], layout["FR_STG_IMG1"]
    at = ((np.arange(hp)[:, None] * ws + np.arange(wp)[None, :])[None] * cs
          + np.arange(shape.M)[:, None, None])
    written = np.zeros(rec, bool)
    written[at], written[part + at] = True, True
    written[2 * part:2 * part + 2] = True
    # the kernel's input scale covers the pixels it stages (rows and columns past the last
    # pooled window's are never read: a largest value there does not count)
    geo = fused_first.rp_geometry(shape, plan.defines["FR_TPH"])
    for i in range(shape.B):
        e_in = fused_first.pow2_exponent(
            float(np.abs(images[i][..., :geo["IR"], :geo["RS"]]).max()))
        bound = np.float32(2.0 ** (15 - e_in)) * np.float32(w1) + np.float32(b1)
        e2 = int(records[i, 2 * part:2 * part + 2].view(np.int32)[0])
        assert e2 == fused_wide.fp16_scale_exponent(float(bound)), (i, e2)
        hi = records[i, at].view(np.float16).astype(np.float64)
        lo = records[i, part + at].view(np.float16).astype(np.float64)
        got = (hi + lo) * 2.0 ** -e2
        assert rel_l2(got, ref[i]) <= TOLERANCE["3xfp16"], i
        assert (records[i, ~written] == 0x7E00).all(), "wrote into the padding or slack"
