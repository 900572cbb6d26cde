"""Rung 28 (fused-conv-pool-wide, kernels/28_fused_conv_pool_wide.cu): conv + bias + ReLU +
max-pool on tensor cores for wide layers, fp16 / tf32 / 3xTF32 / 3xfp16, fp32 or fp16 input.

CPU: the plan's limits and argument checks, the weight packing, and the kernel source itself
compiled with g++ and run with the mma.sync fragment layouts emulated per warp (so index
arithmetic and shared-memory use are checked where no GPU is). GPU: random shapes around the
zoo's conv2 against the fp64 reference on poisoned outputs, the zoo layers, NaN, and the
whole-network paths that use the rung.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
from cuda_emulator import (
    BLOCK_SHIM,
    CUDA_SHIM,
    FUSED_MAIN,
    MMA_SHIM,
    inline_headers,
    run_fused_emulator,
)

from convolab.check import poison, rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.errors import InputError
from convolab.gpu import fused_mma, fused_wide
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.models import MODELS, conv_blocks, param_shapes
from convolab.precision import NETWORK_MODES, TOLERANCE
from convolab.registry import Run, get_impl
from convolab.shapes import ConvShape

PRECISIONS = tuple(fused_wide.PRECISIONS)
WIDE_MODELS = ("ece408-mxnet", "eecs498")
GXX = shutil.which("g++")
# fp16 / tf32 operands: the kernel against the fp64 result of its own rounded operands. The
# tensor cores truncate while they accumulate (~1e-6 here); a wrong tap or fragment costs ~1e-2.
KERNEL_TOL = 1e-4


def wide_blocks(batch: int = 1) -> list[tuple[ConvShape, int]]:
    """The conv blocks of the wide zoo models that rungs 17/18 do not take (their conv2)."""
    return [(b.shape, b.pool) for m in WIDE_MODELS for b in conv_blocks(m, batch)
            if fused_mma.tc_kind(b.shape, b.pool) is None]


def random_wide_shape(rng: np.random.Generator, precision: str) -> tuple[ConvShape, int]:
    """Around the zoo's conv2: C 8-16, M 17-40, K 3/5/7, pool 2 or 4, odd sizes, odd batch,
    within what the rung takes in `precision` (3xtf32's fp32 weights fill shared memory first)."""
    while True:
        pool = int(rng.choice([2, 4]))
        K = int(rng.choice([3, 5, 7]))
        side = K - 1 + pool * int(rng.integers(3, 12))
        H = side + int(rng.integers(0, pool)) | 1
        W = side + int(rng.integers(0, pool)) | 1
        shape = ConvShape(int(rng.integers(0, 5)) * 2 + 1, int(rng.integers(8, 17)), H, W,
                          int(rng.integers(17, 41)), K)
        if fused_wide.supports(shape, pool, precision):
            return shape, pool


def round_operand(a: np.ndarray, precision: str) -> np.ndarray:
    """What the MMA multiplies: fp16 (nearest even), tf32 (nearest, ties away: cvt.rna), or,
    for the exact precisions, the fp32 value itself."""
    if precision == "fp16":
        return a.astype(np.float16).astype(np.float32)
    if precision == "tf32":
        return fused_mma.tf32_bits(a).view(np.float32)
    return a


def problem(rng: np.random.Generator, shape: ConvShape, in_dtype: str):  # noqa: ANN201
    """Non-negative input (a previous layer's ReLU output) in in_dtype, mixed-sign weights."""
    x = np.abs(rng.standard_normal(shape.x_shape)).astype(in_dtype)
    w = (rng.standard_normal(shape.w_shape) / np.sqrt(shape.C * shape.K ** 2)).astype(np.float32)
    b = (0.1 * rng.standard_normal(shape.M)).astype(np.float32)
    return x, w, b


def wide_range_problem(rng: np.random.Generator, shape: ConvShape):  # noqa: ANN201
    """Inputs of both signs spread log-uniformly over 1e-6..1e3, image 1 scaled down by 1e-12
    (its own scale) and image 2 all zeros (any scale), zero bias: each image is checked on
    its own."""
    x = rng.choice([-1.0, 1.0], shape.x_shape) * 10.0 ** rng.uniform(-6, 3, shape.x_shape)
    if shape.B > 1:
        x[1] *= 1e-12
    if shape.B > 2:
        x[2] = 0.0
    w = (rng.standard_normal(shape.w_shape) / np.sqrt(shape.C * shape.K ** 2)).astype(np.float32)
    return x.astype(np.float32), w, np.zeros(shape.M, np.float32)


def check_each_image(y: np.ndarray, x: np.ndarray, w: np.ndarray, pool: int,
                     precision: str) -> None:
    ref = reference_conv_relu_pool(x, w, np.zeros(w.shape[0], np.float32), 1, pool)
    for i in range(len(x)):
        if not ref[i].any():
            assert not y[i].any(), f"image {i}: zeros in, nonzero out"
            continue
        err = rel_l2(y[i], ref[i])
        assert err <= TOLERANCE[precision], f"{precision}, image {i}: rel err {err}"


def check_result(y: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray, pool: int,
                 precision: str) -> None:
    x32 = x.astype(np.float32)
    err = rel_l2(y, reference_conv_relu_pool(x32, w, b, 1, pool))
    assert err <= TOLERANCE[precision], f"{precision}: rel err {err} against fp64"
    if precision not in fused_wide.EXACT:
        own = reference_conv_relu_pool(round_operand(x32, precision),
                                       round_operand(w, precision), b, 1, pool)
        err_own = rel_l2(y, own)
        assert err_own <= KERNEL_TOL, f"{precision}: {err_own} against its rounded operands"


# ---- CPU: plans and argument checks ---------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_zoo_wide_layers_are_taken(precision: str) -> None:
    blocks = wide_blocks()
    assert len(blocks) == len(WIDE_MODELS)  # one conv2 each
    for shape, pool in blocks:
        assert fused_wide.supports(shape, pool, precision)
        assert get_impl(f"fused-conv-pool{pool}-wide-{fused_wide._SUFFIX[precision]}").supports(
            shape)
        geo = fused_wide.geometry(shape, pool, precision)
        # k padding: one filter row's K x 12 taps in whole 32-byte chunks
        assert geo.chunks * 32 // fused_wide.elem_bytes(precision) < shape.K * geo.cs + 32
        assert fused_wide.compile_variants(pool, precision)


def test_what_the_rung_refuses() -> None:
    s = ConvShape(1, 12, 33, 33, 24, 5)
    assert fused_wide.why_not(s, 3, "fp16") and not fused_wide.supports(s, 3, "fp16")
    assert fused_wide.why_not(ConvShape(1, 12, 33, 33, 24, 5, 2), 2, "fp16")  # stride 2
    assert fused_wide.why_not(ConvShape(1, 12, 33, 33, 65, 5), 2, "fp16")  # M > 64
    assert fused_wide.why_not(ConvShape(1, 12, 5, 5, 24, 5), 2, "fp16")  # 1x1 output, no window
    assert fused_wide.why_not(ConvShape(1, 64, 64, 64, 24, 5), 2, "fp16")  # shared memory
    assert fused_wide.why_not(s, 2, "bf16")
    with pytest.raises(InputError, match="pool 3"):
        fused_wide.wide_plan(s, 3, "fp16")
    with pytest.raises(InputError, match="input dtype"):
        fused_wide.wide_plan(s, 2, "fp16", {}, "float64")
    with pytest.raises(InputError, match="warps"):
        fused_wide.wide_plan(s, 2, "fp16", {"warps": -1})
    with pytest.raises(InputError, match="unknown parameter"):
        fused_wide.wide_plan(s, 2, "fp16", {"mt": 4})
    with pytest.raises(ValueError, match="precision"):
        fused_wide.wide_impl(2, "fp32")
    with pytest.raises(ValueError, match="unknown parameter"):
        get_impl("fused-conv-pool2-wide-tc").params_for({"mt": 4})


def test_plan_defines_follow_params_and_input_dtype() -> None:
    s = ConvShape(3, 12, 29, 29, 24, 7)
    plan = fused_wide.wide_plan(s, 2, "tf32", {"warps": 8, "units": 3, "bps": 2}, np.float16)
    d = plan.defines
    assert (d["FW_WARPS"], d["FW_UNITS"], d["FW_IN_HALF"], d["FW_PREC"]) == (8, 3, 1, 1)
    assert (plan.warps, plan.bps) == (8, 2)
    assert fused_wide.wide_plan(s, 2, "3xtf32").defines["FW_UNITS"] == 1
    assert fused_wide.wide_plan(s, 2, "fp16").defines["FW_IN_HALF"] == 0
    # the prefetch buffer: where asked and it fits; never for an image of 4-byte-ragged size
    geo = fused_wide.geometry(s, 2, "fp16", 1, "float32", fused_wide.row_pitch(s, 2, "fp16", 1))
    on = fused_wide.wide_plan(s, 2, "fp16", {"prefetch": 1})
    off = fused_wide.wide_plan(s, 2, "fp16", {"prefetch": -1})
    assert (on.defines["FW_PREFETCH"], on.smem) == (1, geo.smem_prefetch)
    assert (off.defines["FW_PREFETCH"], off.smem) == (0, geo.smem)
    # by default only for fp16 input (half the buffer), unless turned off
    assert fused_wide.wide_plan(s, 2, "fp16", {}, "float16").defines["FW_PREFETCH"] == 1
    assert fused_wide.wide_plan(s, 2, "fp16", {"prefetch": -1}, "float16").defines[
        "FW_PREFETCH"] == 0
    assert fused_wide.wide_plan(s, 2, "fp16").defines["FW_PREFETCH"] == 0
    ragged = ConvShape(1, 9, 13, 13, 24, 3)  # 9 * 13 * 13 fp16 values: 3042 bytes
    assert fused_wide.wide_plan(ragged, 2, "fp16", {"prefetch": 1}, "float16").defines[
        "FW_PREFETCH"] == 0
    # a unit two pooled rows high only where the output has two
    assert fused_wide.wide_plan(ConvShape(1, 12, 7, 9, 24, 5), 2, "fp16", {"rows": 2}).defines[
        "FW_RP"] == 1


def test_wavefront_count() -> None:
    """The bank model of row_pitch: 32 lanes x 4 bytes in distinct banks take one wavefront,
    the same word broadcasts, two words of one bank take two, whatever the lane order."""
    lanes = np.arange(32)
    spread = (4 * lanes[::-1])[None, None, :]
    assert fused_wide.wavefronts_per_load(spread, 1, 0) == 1.0
    assert fused_wide.wavefronts_per_load(np.zeros((1, 1, 32), int), 1, 0) == 1.0
    clash = np.where(lanes == 1, 128, 4 * lanes)[None, None, :]  # lane 1 on lane 0's bank
    assert fused_wide.wavefronts_per_load(clash, 1, 0) == 2.0
    # lanes 16.. on the banks of lanes ..15 (other words): two wavefronts at every shift
    assert fused_wide.wavefronts_per_load((4 * (lanes % 16) + 128 * (lanes // 16))[None, None],
                                          2, 64) == 2.0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_row_pitch_makes_the_zoo_loads_conflict_free(precision: str) -> None:
    for shape, pool in wide_blocks():
        for rows in (1, 2):
            pitch = fused_wide.row_pitch(shape, pool, precision, rows)
            assert shape.W <= pitch <= shape.W + fused_wide.MAX_PITCH_PAD
            cost = fused_wide.load_cost(shape, pool, precision, rows, pitch)
            assert cost <= fused_wide.load_cost(shape, pool, precision, rows, shape.W)
            if rows == 1:
                assert cost == 1.0  # one wavefront, every load
        plan = fused_wide.wide_plan(shape, pool, precision, {"pitch": shape.W + 3})
        assert plan.defines["FW_WS"] == shape.W + 3


def test_block_warps_fill_the_schedulers_evenly() -> None:
    """Warps in fours (one each scheduler), as many blocks as shared memory allows up to 16
    warps an SM, and registers capped (FW_MINB) so that those blocks fit."""
    for smem in range(8_000, 228_000, 997):
        warps, minb = fused_wide.block_warps(smem)
        fit = 233_472 // (smem + 1024)
        assert warps % 4 == 0 and 4 <= warps <= 16 and 1 <= minb <= max(1, fit)
        assert minb * warps <= 16 and minb * warps >= min(12, 4 * fit)
    for shape, pool in wide_blocks():
        plan = fused_wide.wide_plan(shape, pool, "fp16")
        assert (plan.warps, plan.defines["FW_MINB"]) == (4, 4)  # ~46-57 KB: four blocks
        assert fused_wide.wide_plan(shape, pool, "fp16", {"warps": 6}).defines["FW_MINB"] == 1


def unpack_fragments(words: np.ndarray, M: int, C: int, K: int, precision: str) -> np.ndarray:
    """The kernel's B fragments (J, K, NT, 32, 2) back to weights (M, C, K, K) by its rule:
    lane (g, t)'s two words are bytes 4t and 16 + 4t of channel 8n + g's chunk; the padding
    must hold zeros."""
    cs, ch, chunks = fused_wide.run_layout(C, K, precision)
    nt = -(-M // 8)
    assert words.shape == (chunks, K, nt, 32, 2) and words.dtype == np.uint32
    if fused_wide.elem_bytes(precision) == 2:
        vals = words.view(np.float16).astype(np.float32)  # (J, K, NT, 32, 4)
    else:
        vals = words.view(np.float32)
    per = ch // 8
    run = np.zeros((nt * 8, K, chunks * ch), np.float32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for n in range(nt):
            for j in range(chunks):
                for half in range(2):
                    at = j * ch + half * ch // 2 + t * per
                    piece = vals[j, :, n, lane, half * per:(half + 1) * per]
                    run[8 * n + g, :, at:at + per] = piece
    taps = run[:, :, :K * cs].reshape(nt * 8, K, K, cs)
    assert not taps[M:].any() and not taps[:, :, :, C:].any() and not run[:, :, K * cs:].any()
    return taps[:M, :, :, :C].transpose(0, 3, 1, 2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fragments_hold_every_weight_once(precision: str, rng: np.random.Generator) -> None:
    """Unpacking the per-lane fragments by the kernel's rule gives the weights back, each in
    its (p, q, c) slot, and zeros in the padding; 3xfp16's hi + lo is the scaled weight to
    ~2^-22."""
    M, C, K = int(rng.integers(17, 41)), int(rng.integers(8, 17)), int(rng.choice([3, 5, 7]))
    w = (rng.standard_normal((M, C, K, K)) * 10.0 ** rng.uniform(-4, 2)).astype(np.float32)
    frag = fused_wide.wide_fragments(w, precision)
    if precision != "3xfp16":
        want = round_operand(w, precision) if precision in ("fp16", "tf32") else w
        np.testing.assert_array_equal(unpack_fragments(frag, M, C, K, precision), want)
        return
    assert frag.shape[0] == 2
    hi, lo = (unpack_fragments(part, M, C, K, precision) for part in frag)
    scaled = w * np.float32(2.0 ** fused_wide.weight_exponent(w))
    assert 2 ** 14 <= np.abs(scaled).max() < 2 ** 15
    np.testing.assert_array_equal(hi, round_operand(scaled, "fp16"))
    err = np.abs(hi.astype(np.float64) + lo - scaled)
    assert (err <= np.maximum(2.0 ** -22 * np.abs(scaled), 2.0 ** -25)).all()
    assert np.abs(lo).max() <= 2 ** 4  # half an fp16 ulp of 2^14 ... 2^15


def test_fp16_scale_exponent_puts_the_maximum_in_the_top_binade(rng: np.random.Generator) -> None:
    for amax in np.concatenate([10.0 ** rng.uniform(-40, 38, 200), [2.0 ** 14, 2.0 ** 15 - 1,
                                                                     1.0, 3e38]]):
        e = fused_wide.fp16_scale_exponent(float(np.float32(amax)))
        assert 2 ** 14 <= np.float64(np.float32(amax)) * 2.0 ** e < 2 ** 15 or e == 126, amax
    assert fused_wide.fp16_scale_exponent(0.0) == 126  # any scale: the image is zeros
    assert fused_wide.fp16_scale_exponent(float("inf")) == 0
    assert fused_wide.fp16_scale_exponent(float("nan")) == 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", NETWORK_MODES)
def test_network_sends_the_wide_blocks_to_rung_28(model: str, mode: str) -> None:
    """FusedLeNet runs rung 28, or on Hopper its wgmma form rung 44 in the precisions that has,
    exactly for the blocks rungs 17/18 do not take (the wide models' conv2)."""
    from convolab.gpu import fused_wgmma, network

    net = object.__new__(network.FusedLeNet)
    net.model, net.mode = model, mode
    on = mode != "exact" or fused_wide.EXACT_PRECISION is not None
    precision = {"exact": fused_wide.EXACT_PRECISION}.get(mode, NETWORK_MODES[mode])
    blocks = conv_blocks(model, 3)
    for block in blocks:
        wide = model in WIDE_MODELS and fused_mma.tc_kind(block.shape, block.pool) is None
        hopper = wide and on and fused_wgmma.network_takes(block.shape, block.pool, precision,
                                                           {})
        assert (net._block_impl(block).rung == 44) == hopper, block
        assert (net._block_impl(block).rung in (28, 44)) == (wide and on), block
    assert any(net._block_impl(b).rung in (28, 44) for b in blocks) == (model in WIDE_MODELS
                                                                        and on)


@pytest.mark.parametrize("model", WIDE_MODELS)
@pytest.mark.parametrize("mode", NETWORK_MODES)
def test_plan_feeds_rung_28_its_input_dtype(model: str, mode: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan asks rung 28 for fp16 input in mode 'fp16' (fp32 elsewhere), and the block
    before it is asked to write what rung 28 declares it reads (run.in_dtype)."""
    from types import SimpleNamespace

    from convolab.gpu import fused_wgmma, network

    net = object.__new__(network.FusedLeNet)
    net._cp = SimpleNamespace(empty=np.empty, float16=np.float16, float32=np.float32)
    net.model, net.mode, net._kernel_params = model, mode, {}
    net.channels_last = False
    net.params = {k: np.zeros(v, np.float32) for k, v in param_shapes(model).items()}
    asked: dict[str, object] = {}

    def prepare(shape, w, b, kp, precision, in_dtype, *, pool):  # noqa: ANN001, ANN202
        asked.update(precision=precision, in_dtype=in_dtype, pool=pool)
        return SimpleNamespace(in_dtype=in_dtype)

    def first_run(block, hw, out_dtype):  # noqa: ANN001, ANN202
        asked["first_writes"] = out_dtype
        return SimpleNamespace(out_dtype=out_dtype)

    def prepare_wgmma(shape, w, b, kp, precision, in_dtype):  # noqa: ANN001, ANN202
        return prepare(shape, w, b, kp, precision, in_dtype, pool=2)

    monkeypatch.setattr(fused_wide, "prepare", prepare)
    monkeypatch.setattr(fused_wgmma, "prepare", prepare_wgmma)
    monkeypatch.setattr(net, "_first_run", first_run)
    monkeypatch.setattr(net, "_staged_pair", lambda blocks, hw: None)
    monkeypatch.setattr(net, "_merged_pair", lambda blocks, hw: None)
    blocks = conv_blocks(model, 3)
    _, buffers = net._new_plan(3, None)
    want = "float16" if mode == "fp16" else "float32"
    assert asked["in_dtype"] == asked["first_writes"] == want
    assert asked["precision"] == {"exact": fused_wide.EXACT_PRECISION}.get(mode,
                                                                          NETWORK_MODES[mode])
    assert asked["pool"] == blocks[1].pool and buffers[1].dtype == np.dtype(want)


# ---- CPU: the kernel source under g++, mma.sync emulated -------------------------------------

EMU = CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + r"""
alignas(16) unsigned char fw_smem[232448];
#include "kernel.inc"
#define EMU_SMEM fw_smem
#define EMU_W_BYTES FW_WBYTES
#define EMU_SMEM_BYTES FW_SMEM_BYTES
#define EMU_KERNEL fcp_wide
#define EMU_BLOCK_SETUP
""" + FUSED_MAIN

def kernel_source(precision: str) -> str:
    """The precision's kernel file (28 or 28b) with rung 28's headers inlined, common.cuh's
    PTX and cuda_bf16.h left to the shim."""
    source = inline_headers((KERNEL_DIR / fused_wide.kernel_file(precision)).read_text(),
                            KERNEL_DIR)
    return source.replace("#include <cuda_bf16.h>", "")


def emulate(tmp_path: Path, shape: ConvShape, pool: int, precision: str, in_dtype: str,
            x: np.ndarray, w: np.ndarray, b: np.ndarray, params: dict[str, int],
            grid: int) -> tuple[np.ndarray, int]:
    """The kernel's output for (x, w, b) run on the CPU, and its FW_SMEM_BYTES."""
    plan = fused_wide.wide_plan(shape, pool, precision, params, in_dtype)
    w_unscale = 2.0 ** -fused_wide.weight_exponent(w) if precision == "3xfp16" else 1.0
    files = {"x.bin": np.ascontiguousarray(x, in_dtype),
             "w.bin": fused_wide.wide_fragments(w, precision), "b.bin": b.astype(np.float32)}
    return run_fused_emulator(tmp_path, EMU, kernel_source(precision),
                              define_flags(plan.defines), files,
                              (shape.B, shape.M, shape.H_out // pool, shape.W_out // pool),
                              [str(shape.B), str(grid), repr(w_unscale)])


EMULATED = [  # (precision, input, shape, pool, params, grid): small images, both pools
    ("fp16", "float32", ConvShape(3, 12, 15, 17, 24, 5), 2, {"prefetch": -1}, 2),
    ("fp16", "float32", ConvShape(3, 12, 15, 17, 24, 5), 2, {"prefetch": 1}, 2),
    ("fp16", "float16", ConvShape(2, 9, 13, 13, 19, 3), 4, {"warps": 2}, 1),
    ("fp16", "float16", ConvShape(3, 12, 14, 14, 24, 7), 2, {"rows": 2, "prefetch": 1}, 2),
    ("tf32", "float32", ConvShape(2, 12, 14, 14, 24, 7), 2, {"units": 3}, 1),  # reads the slack
    ("tf32", "float32", ConvShape(2, 12, 14, 14, 24, 7), 2, {"pitch": 17}, 1),  # and the pad
    ("tf32", "float16", ConvShape(1, 13, 16, 18, 33, 5), 4, {"rows": 2}, 1),  # Hp 3: unit moved up
    ("3xtf32", "float32", ConvShape(2, 12, 19, 15, 24, 5), 2, {"units": 2, "rows": 2}, 2),
    ("3xtf32", "float16", ConvShape(1, 8, 15, 12, 17, 3), 4, {"prefetch": 1}, 1),
    ("3xtf32", "float32", ConvShape(2, 12, 15, 17, 24, 5), 2, {"split": 2, "pitch": 20}, 2),
    ("3xtf32", "float16", ConvShape(1, 11, 16, 18, 30, 3), 4, {"split": 2, "rows": 2}, 1),
    ("3xfp16", "float32", ConvShape(3, 12, 15, 17, 24, 5), 2, {"warps": 3}, 2),
    ("3xfp16", "float32", ConvShape(2, 12, 14, 14, 24, 7), 2, {"units": 2, "prefetch": 1}, 1),
    ("3xfp16", "float16", ConvShape(2, 9, 13, 13, 19, 3), 4, {"rows": 2, "pitch": 15}, 1),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("case", range(len(EMULATED)))
def test_kernel_emulated_on_cpu(case: int, tmp_path: Path, rng: np.random.Generator) -> None:
    precision, in_dtype, shape, pool, params, grid = EMULATED[case]
    x, w, b = problem(rng, shape, in_dtype)
    y, smem = emulate(tmp_path, shape, pool, precision, in_dtype, x, w, b, params, grid)
    assert smem == fused_wide.wide_plan(shape, pool, precision, params, in_dtype).smem
    check_result(y, x, w, b, pool, precision)
    if precision in fused_wide.EXACT:  # the emulated MMA is exact: the split's ~2^-21, fp32 sums
        assert rel_l2(y, reference_conv_relu_pool(x.astype(np.float32), w, b, 1, pool)) <= 2e-6


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("precision", fused_wide.EXACT)
def test_exact_kernels_emulated_on_a_wide_dynamic_range(precision: str, tmp_path: Path,
                                                        rng: np.random.Generator) -> None:
    """Values 1e-6..1e3 in one image, a tiny image and a zero one: 3xfp16 scales each image
    by its own maximum, and its lo parts of the small values go subnormal."""
    shape = ConvShape(3, 12, 14, 15, 24, 5)
    x, w, b = wide_range_problem(rng, shape)
    y, _ = emulate(tmp_path, shape, 2, precision, "float32", x, w, b, {}, 2)
    check_each_image(y, x, w, 2, precision)


# ---- GPU -------------------------------------------------------------------------------------


def run_gpu(shape: ConvShape, pool: int, precision: str, in_dtype: str, x: np.ndarray,
            w: np.ndarray, b: np.ndarray, params: dict[str, int] | None = None) -> np.ndarray:
    import cupy as cp

    run = fused_wide.prepare(shape, cp.asarray(w), cp.asarray(b), params or {}, precision,
                             in_dtype, pool=pool)
    return output_of(run, shape, pool, x)


def output_of(run: Run, shape: ConvShape, pool: int, x: np.ndarray) -> np.ndarray:
    """A fused rung's pooled output for x, written over a NaN-poisoned buffer."""
    import cupy as cp

    y = cp.empty((shape.B, shape.M, shape.H_out // pool, shape.W_out // pool), cp.float32)
    poison(y)
    run(cp.asarray(x), y)
    return y.get()


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", fused_wide.IN_DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", range(3))
def test_random_wide_shapes(case: int, precision: str, in_dtype: str,
                            rng: np.random.Generator) -> None:
    shape, pool = random_wide_shape(rng, precision)
    x, w, b = problem(rng, shape, in_dtype)
    params = {"rows": int(rng.integers(1, 3)), "prefetch": int(rng.choice([-1, 1]))}
    check_result(run_gpu(shape, pool, precision, in_dtype, x, w, b, params), x, w, b, pool,
                 precision)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", fused_wide.IN_DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_zoo_wide_layers(precision: str, in_dtype: str, rng: np.random.Generator) -> None:
    for shape, pool in wide_blocks(7):
        x, w, b = problem(rng, shape, in_dtype)
        check_result(run_gpu(shape, pool, precision, in_dtype, x, w, b), x, w, b, pool,
                     precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", fused_wide.EXACT)
@pytest.mark.parametrize("case", range(4))
def test_exact_precisions_on_a_wide_dynamic_range(case: int, precision: str,
                                                  rng: np.random.Generator) -> None:
    shape, pool = (wide_blocks(5) + [random_wide_shape(rng, precision) for _ in range(2)])[case]
    shape = ConvShape(max(3, shape.B), shape.C, shape.H, shape.W, shape.M, shape.K)
    x, w, b = wide_range_problem(rng, shape)
    check_each_image(run_gpu(shape, pool, precision, "float32", x, w, b), x, w, pool, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("params", [{"warps": 2, "units": 1}, {"warps": 5, "units": 3},
                                    {"warps": 8, "minb": 2}, {"bps": 1}, {"rows": 2},
                                    {"rows": 2, "units": 2, "prefetch": 1}, {"prefetch": -1},
                                    {"prefetch": 1, "warps": 7}])
def test_tunable_parameters_keep_the_result(params: dict[str, int],
                                            rng: np.random.Generator) -> None:
    shape, pool = wide_blocks(13)[int(rng.integers(2))]
    x, w, b = problem(rng, shape, "float32")
    for precision in PRECISIONS:
        check_result(run_gpu(shape, pool, precision, "float32", x, w, b, params), x, w, b, pool,
                     precision)


@pytest.mark.gpu
def test_registry_entries_through_forward(rng: np.random.Generator) -> None:
    import cupy as cp

    shape, pool = wide_blocks(5)[0]
    x, w, b = problem(rng, shape, "float32")
    for precision in PRECISIONS:
        impl = fused_wide.wide_impl(pool, precision)
        y = impl.forward(cp.asarray(x), cp.asarray(w), cp.asarray(b), warps=2)
        check_result(y.get(), x, w, b, pool, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_nan_stays_in_its_image(precision: str, rng: np.random.Generator) -> None:
    shape, pool = wide_blocks(3)[0]
    x, w, b = problem(rng, shape, "float32")
    x[1, 5, shape.H // 2, shape.W // 3] = np.nan
    y = run_gpu(shape, pool, precision, "float32", x, w, b)
    ref = reference_conv_relu_pool(x, w, b, 1, pool)
    assert np.isnan(y[np.isnan(ref)]).all(), "a pool window with a NaN gave a finite value"
    for i in (0, 2):
        assert rel_l2(y[i], ref[i]) <= TOLERANCE[precision]


@functools.cache
def cpu_test_predictions(model: str) -> np.ndarray:
    from convolab import data
    from convolab.models import load, spec

    raw, _ = data.load_split("test")
    return load(model).predict(data.resize_bilinear(raw, spec(model).input_size))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", fused_wide.EXACT)
@pytest.mark.parametrize("model", WIDE_MODELS)
def test_shipped_wide_models_exact_gpu_equals_cpu_on_every_test_image(
        model: str, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact mode (rung 28 for conv2 in either exact precision; EXACT_PRECISION is the one it
    ships with) predicts what the CPU framework does."""
    from convolab import data
    from convolab.gpu.network import FusedLeNet
    from convolab.models import load

    monkeypatch.setattr(fused_wide, "EXACT_PRECISION", precision)
    raw, labels = data.load_split("test")
    net = FusedLeNet(load(model).params(), mode="exact", model=model)
    assert net._block_impl(conv_blocks(model, 1)[1]).name.endswith(precision)
    gpu = net.forward_chunks(raw, labels=True)
    cpu = cpu_test_predictions(model)
    assert np.array_equal(gpu, cpu)
    assert (gpu == labels).mean() > 0.85
