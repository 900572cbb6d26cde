"""Host side of rung 28 (kernels/28_fused_conv_pool_wide.cu, `fcp_wide`): the fused
conv + bias + ReLU + max-pool on tensor cores for wide layers (many output channels, a long
C*K*K reduction: the wider zoo models' conv2), in fp16 or tf32, and of its split precisions,
rung 28b (kernels/28b_fused_conv_pool_wide_split.cu): fp32-exact as 3xTF32 or 3xfp16 (each
operand scaled by a power of two and split hi + lo in fp16: three fp16 MMAs).

`wide_plan` sizes the kernel (its defines mirror the kernel's FW_* arithmetic, and the CPU
emulator test checks that they agree); `wide_fragments` packs the weights in the kernel's
per-lane B-fragment order; `prepare(shape, weight, bias, kernel_params, precision, in_dtype)`
returns run(x, out) for fp32 or fp16 NCHW input. The registry entries
`fused-conv-pool{2,4}-wide-{tc,tf32,3xtf32,3xfp16}` wrap it for fp32 input. Nothing here imports
CuPy at module import time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import xp_of
from convolab.errors import InputError
from convolab.gpu.device import SM_SMEM_BYTES, SMEM_DYNAMIC_TWO_BLOCKS
from convolab.gpu.implicit_gemm import SMEM_LIMIT
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "28_fused_conv_pool_wide.cu"  # fp16, tf32
SPLIT_KERNEL_FILE = "28b_fused_conv_pool_wide_split.cu"  # 3xtf32, 3xfp16
KERNEL = "fcp_wide"
PRECISIONS: dict[str, int] = {"fp16": 0, "tf32": 1, "3xtf32": 2, "3xfp16": 3}  # -> FW_PREC
EXACT = ("3xtf32", "3xfp16")  # fp32-exact: chunks summed from zero, operands split in two


def kernel_file(precision: str) -> str:
    """The kernel file of a precision: rung 28b's for the split (fp32-exact) ones."""
    return SPLIT_KERNEL_FILE if precision in EXACT else KERNEL_FILE


IN_DTYPES = ("float32", "float16")
POOLS = (2, 4)
MAX_M = 64  # n-tiles of accumulators a lane holds: 8 at most
MAX_K = 11  # the shift loop is unrolled K + P - 1 deep
MAX_C = 64
_SUFFIX = {"fp16": "tc", "tf32": "tf32", "3xtf32": "3xtf32", "3xfp16": "3xfp16"}
SPACE: dict[str, list[int]] = {
    "warps": [2, 4, 5, 7, 8],  # 0: the count that splits the image's unit groups evenly
    "units": [1, 2, 3],  # units a warp computes together (sharing its weight registers)
    "rows": [1, 2],  # pooled rows of one unit (FW_RP): more MMAs per loaded fragment (0: 1)
    "prefetch": [-1, 1],  # 1: cp.async the next image while this one computes (0: fp16 input)
    "split": [3, 2],  # 3xtf32: three tf32 MMAs a step, or tf32 + one bf16 for both cross terms
    "pitch": [0],  # staged row pitch in pixels (0: row_pitch, the fewest bank conflicts)
    "minb": [1, 2, 3, 4],  # blocks per SM the registers must allow (__launch_bounds__)
    "bps": [0, 1, 2, 3, 4],  # persistent blocks per SM (0: as many as fit)
}


def elem_bytes(precision: str) -> int:
    return 2 if precision in ("fp16", "3xfp16") else 4


def parts(precision: str) -> int:
    """Staged images and weight sets: 3xfp16 keeps hi and lo of each."""
    return 2 if precision == "3xfp16" else 1


# 3xfp16's bytes after its two images: the warps' partial maxima of the image.
REDUCE_BYTES = 128


def fp16_scale_exponent(amax: float) -> int:
    """3xfp16's scale 2^e for values of largest magnitude amax: amax * 2^e in [2^14, 2^15)
    (kernel fw_scale_exponent: 0 for inf or NaN, at most 126 for zero or tiny values)."""
    biased = int(np.array(abs(amax), np.float32).view(np.uint32)) >> 23 & 0xFF
    return 0 if biased == 0xFF else min(141 - biased, 126)


@dataclass(frozen=True)
class WideGeometry:
    """The kernel's FW_* sizes for one shape, precision and unit height (FW_RP)."""

    cs: int  # staged channels (C rounded up to a quad)
    chunks: int  # 32-byte k-chunks per filter row (FW_J)
    ntiles: int  # n-tiles of 8 output channels (FW_NT)
    units: int  # units of one image (FW_NUNITS)
    weight_bytes: int
    image_bytes: int
    raw_bytes: int  # one input image in its own dtype (the prefetch buffer)

    @property
    def smem(self) -> int:
        """Without the prefetch buffer."""
        return self.weight_bytes + self.image_bytes

    @property
    def smem_prefetch(self) -> int:
        return self.smem + ceil_div(self.raw_bytes, 16) * 16


def run_layout(C: int, K: int, precision: str) -> tuple[int, int, int]:
    """(staged channels FW_CS, elements a 32-byte k-chunk FW_CH, chunks a filter row FW_J):
    one filter row's K x CS taps, padded to whole chunks."""
    cs = ceil_div(C, 4) * 4
    ch = 32 // elem_bytes(precision)
    return cs, ch, ceil_div(K * cs, ch)


def geometry(shape: ConvShape, pool: int, precision: str, rows: int = 1,
             in_dtype: Any = "float32", pitch: int = 0) -> WideGeometry:
    """pitch: the staged row in pixels (FW_WS; 0: the image width)."""
    cs, ch, chunks = run_layout(shape.C, shape.K, precision)
    ntiles = ceil_div(shape.M, 8)
    hp, wp = shape.H_out // pool, shape.W_out // pool
    anchors = ceil_div(hp, rows) * wp
    pitch = max(pitch, shape.W)
    image = ceil_div((shape.H * pitch * cs + chunks * ch) * elem_bytes(precision), 16) * 16
    image = parts(precision) * image + (REDUCE_BYTES if precision == "3xfp16" else 0)
    raw = shape.C * shape.H * shape.W * np.dtype(in_dtype).itemsize
    return WideGeometry(cs, chunks, ntiles, ceil_div(anchors, 16 // pool),
                        parts(precision) * chunks * shape.K * ntiles * 256, image, raw)


def why_not(shape: ConvShape, pool: int, precision: str) -> str | None:
    """None where fcp_wide takes the layer, else the reason it does not."""
    if precision not in PRECISIONS:
        return f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}"
    if pool not in POOLS:
        return f"pool must be one of {POOLS}, got {pool}"
    if shape.S != 1:
        return f"stride {shape.S} (fcp_wide takes stride 1)"
    if shape.H_out < pool or shape.W_out < pool:
        return f"the {shape.H_out}x{shape.W_out} output holds no {pool}x{pool} window"
    if shape.M > MAX_M or shape.K > MAX_K or shape.C > MAX_C:
        return f"M <= {MAX_M}, K <= {MAX_K}, C <= {MAX_C} (got M={shape.M}, K={shape.K}, " \
               f"C={shape.C})"
    smem = geometry(shape, pool, precision).smem
    if smem > SMEM_DYNAMIC_TWO_BLOCKS:
        return f"the image and weights need {smem} bytes of shared memory " \
               f"(> {SMEM_DYNAMIC_TWO_BLOCKS})"
    return None


def supports(shape: ConvShape, pool: int, precision: str) -> bool:
    return why_not(shape, pool, precision) is None


@dataclass(frozen=True)
class WidePlan:
    defines: dict[str, int]
    smem: int  # dynamic shared memory bytes
    warps: int
    bps: int  # persistent blocks per SM (0: as many as fit)


# 3xtf32's MMAs a k-step: 3 (a_s*b_b + a_b*b_s + a_b*b_b in tf32) or 2 (a_b*b_b in tf32, the two
# cross terms as one bf16 MMA whose k runs over both). 2 measured 3-14% faster on the zoo's
# conv2 at 4.7e-7 relative error against 2.0e-7 (H100, docs/raw.md); 3 is the default because
# exact mode's every-test-image prediction check ran with it.
DEFAULT_SPLIT = 3


def default_units(precision: str, rows: int) -> int:
    """fp16/tf32: two units share a warp's weight registers (fewer weight loads per MMA);
    the exact precisions need the registers for their split parts and chunk sums, and taller
    units hold twice the accumulators."""
    return 1 if precision in EXACT or rows > 1 else 2


# Pixels a staged row may be padded by to keep the A-fragment loads conflict-free.
MAX_PITCH_PAD = 8


def a_row_offsets(shape: ConvShape, pool: int, precision: str, rows: int,
                  pitch: int) -> np.ndarray:
    """Byte offsets of every lane's 4-byte A loads, (units, 2 rows g / g+8, 32 lanes), for
    shift 0, chunk 0 and the chunk's first 16 bytes (kernel fw_rows: the other shifts, chunks
    and the second 16 bytes add the same offset to the whole warp)."""
    cs, _, _ = run_layout(shape.C, shape.K, precision)
    hp, wp = shape.H_out // pool, shape.W_out // pool
    anchors = ceil_div(hp, rows) * wp
    units = ceil_div(anchors, 16 // pool)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    slot = g >> 1 if pool == 4 else g  # the window of each lane
    anchor = np.minimum(np.arange(units)[:, None] * (16 // pool) + slot[None, :], anchors - 1)
    wy = np.minimum((anchor // wp) * rows, hp - rows)
    ox = (anchor % wp) * pool + (2 * (g & 1) if pool == 4 else 0)
    e = elem_bytes(precision)
    swap = (g >= 4) & (e == 4)  # fp32 pixels: lanes g >= 4 read the right output as row g
    px = (wy * pool * pitch + ox) * cs
    lo = (px + swap * cs) * e + 4 * t
    return np.stack([lo, (px + (1 - swap) * cs) * e + 4 * t], axis=1)


def wavefronts_per_load(offsets: np.ndarray, shifts: int, row_bytes: int) -> float:
    """Mean shared-memory wavefronts of the warp's 4-byte loads over every shift (a bank
    serves one distinct 4-byte word a wavefront; 1: conflict-free)."""
    words = (offsets[..., None, :] + np.arange(shifts)[:, None] * row_bytes) // 4
    words = np.sort(words, axis=-1)  # (units, 2, shifts, 32 lanes)
    distinct = np.ones(words.shape, bool)
    distinct[..., 1:] = np.diff(words, axis=-1) != 0
    per_bank = ((words[..., None] % 32 == np.arange(32)) & distinct[..., None]).sum(axis=-2)
    return float(per_bank.max(axis=-1).mean())


def row_pitch(shape: ConvShape, pool: int, precision: str, rows: int) -> int:
    """The staged row pitch (FW_WS, pixels) in W..W+MAX_PITCH_PAD whose A-fragment loads
    take the fewest wavefronts (ties: the narrowest)."""
    return _row_pitch(ConvShape(1, shape.C, shape.H, shape.W, shape.M, shape.K), pool,
                      precision, rows)


def load_cost(shape: ConvShape, pool: int, precision: str, rows: int, pitch: int) -> float:
    """Mean wavefronts of the kernel's A loads at a staged row pitch (1: no conflicts)."""
    cs, _, _ = run_layout(shape.C, shape.K, precision)
    offsets = a_row_offsets(shape, pool, precision, rows, pitch)
    return wavefronts_per_load(offsets, shape.K + pool * rows - 1,
                               pitch * cs * elem_bytes(precision))


@functools.cache
def _row_pitch(shape: ConvShape, pool: int, precision: str, rows: int) -> int:
    return min(range(shape.W, shape.W + MAX_PITCH_PAD + 1),
               key=lambda p: (load_cost(shape, pool, precision, rows, p), p))


# Warps an SM should hold (latency hiding; at ~128 registers a thread, all the file holds).
SM_WARPS = 16


def block_warps(smem: int) -> tuple[int, int]:
    """(warps a block, blocks an SM the registers must allow: FW_MINB) for a block of `smem`
    bytes. Warps come in fours: an SM's four schedulers (each with its own tensor cores) take
    warps w, w + 4, ..., so a block of 5-7 warps loads some schedulers twice as much as
    others (the kernel rotates the unit groups among a block's warps image by image, which
    evens out only the warps' shares, not the schedulers'). As many blocks as shared memory
    lets an SM hold, up to SM_WARPS warps, with registers capped so that they all fit."""
    blocks = max(1, SM_SMEM_BYTES // (smem + 1024))
    warps = max(4, SM_WARPS // min(blocks, SM_WARPS // 4) // 4 * 4)
    return warps, max(1, min(blocks, SM_WARPS // warps))


def _in_dtype_name(in_dtype: Any) -> str:
    name = np.dtype(in_dtype).name
    if name not in IN_DTYPES:
        raise InputError(f"fcp_wide: input dtype must be one of {IN_DTYPES}, got {name}")
    return name


def _check_params(params: Mapping[str, Any]) -> None:
    unknown = sorted(set(params) - set(SPACE))
    if unknown:
        raise InputError(f"fcp_wide: unknown parameter(s) {unknown} (known: {list(SPACE)})")
    for key, value in params.items():
        if not isinstance(value, int | np.integer) or (value < 0 and key != "prefetch"):
            raise InputError(f"fcp_wide: {key} must be an int >= 0, got {value!r}")


def _prefetch(geo: WideGeometry, params: Mapping[str, Any], in_name: str) -> bool:
    """Where asked (prefetch=1; -1: never) or, by default, for fp16 input; and only where
    cp.async takes 4-byte pieces and the buffer fits. On the zoo's conv2 (H100) with fp32 input
    the fp16 rung took 0.58 ms with it against 0.47-0.51 without (the 52 KB buffer halves the
    blocks an SM holds), tf32 and 3xtf32 within +-5%; with fp16 input (mode fp16's conv2, a
    26 KB buffer: 3 blocks an SM instead of 4) the whole forward took 0.97 / 1.00 ms with it
    against 1.06 / 1.05 without (mxnet / eecs498 medians, 2-9% spread; back to back 0.904 /
    0.904 against 0.920 / 0.919, docs/raw.md)."""
    fits = geo.raw_bytes % 4 == 0 and geo.smem_prefetch <= SMEM_LIMIT
    asked = int(params.get("prefetch") or 0)
    return fits and (asked > 0 or (asked == 0 and in_name == "float16"))


def _split(precision: str, params: Mapping[str, Any]) -> int:
    split = int(params.get("split") or DEFAULT_SPLIT)
    if split not in (2, 3):
        raise InputError(f"fcp_wide: split must be 2 or 3, got {split}")
    return split if precision == "3xtf32" else 3


def wide_plan(shape: ConvShape, pool: int, precision: str,
              params: Mapping[str, Any] | None = None, in_dtype: Any = "float32") -> WidePlan:
    """Defines and launch geometry; params (SPACE) may fix warps, units, rows, prefetch, minb,
    bps (0: chosen here)."""
    reason = why_not(shape, pool, precision)
    if reason is not None:
        raise InputError(f"fcp_wide does not take {shape} with pool {pool}: {reason}")
    params = params or {}
    _check_params(params)
    in_name = _in_dtype_name(in_dtype)
    rows = int(params.get("rows") or 1)
    if (shape.H_out // pool) < rows:
        rows = 1  # the output is lower than one unit
    pitch = max(shape.W, int(params.get("pitch") or row_pitch(shape, pool, precision, rows)))
    geo = geometry(shape, pool, precision, rows, in_name, pitch)
    units = int(params.get("units") or default_units(precision, rows))
    prefetch = _prefetch(geo, params, in_name)
    smem = geo.smem_prefetch if prefetch else geo.smem
    warps, minb = block_warps(smem)
    if params.get("warps"):
        warps, minb = int(params["warps"]), 1
    defines = {
        "FW_PREC": PRECISIONS[precision], "FW_IN_HALF": int(in_name == "float16"),
        "FW_C": shape.C, "FW_H": shape.H, "FW_W": shape.W, "FW_WS": pitch,
        "FW_M": shape.M, "FW_K": shape.K,
        "FW_P": pool, "FW_WARPS": warps, "FW_UNITS": units, "FW_RP": rows,
        "FW_PREFETCH": int(prefetch), "FW_MINB": int(params.get("minb") or minb),
        "FW_SPLIT": _split(precision, params),
    }
    return WidePlan(defines, smem, warps, int(params.get("bps") or 0))


def wide_fragments(w: np.ndarray, precision: str) -> np.ndarray:
    """Weights (M, C, K, K) as the kernel's B fragments: uint32 (J, K, NT, 32 lanes, 2), for
    3xfp16 (2: hi, lo, J, K, NT, 32, 2) of w * 2^weight_exponent(w).

    k runs over one filter row's (q, c) taps, channels innermost and padded to a quad, the run
    padded with zeros to whole 32-byte chunks, each chunk one MMA's k in PTX order: lane
    (g, t) of n-tile n holds channel 8n + g's 4 bytes at offsets 4t and 16 + 4t of each chunk
    (an fp16 pair each, or one tf32 / fp32 value)."""
    M, C, K, _ = w.shape
    cs, ch, chunks = run_layout(C, K, precision)
    nt = ceil_div(M, 8)
    taps = np.zeros((nt * 8, K, K, cs), np.float32)  # (m, p, q, c)
    taps[:M, :, :, :C] = np.asarray(w, np.float32).transpose(0, 2, 3, 1)
    run = np.zeros((nt * 8, K, chunks * ch), np.float32)
    run[:, :, :K * cs] = taps.reshape(nt * 8, K, K * cs)
    per = ch // 8  # elements of a 4-byte word
    # (n, g, p, j, half, t, piece) -> (j, p, n, g, t, half, piece): lane = 4g + t
    lanes = run.reshape(nt, 8, K, chunks, 2, 4, per).transpose(3, 2, 0, 1, 5, 4, 6)
    lanes = np.ascontiguousarray(lanes.reshape(chunks, K, nt, 32, 2 * per))
    if precision == "fp16":
        bits = lanes.astype(np.float16).view(np.uint32)  # two halves a word, low k first
    elif precision == "tf32":
        from convolab.gpu.fused_mma import tf32_bits

        bits = tf32_bits(lanes)
    elif precision == "3xfp16":
        scaled = lanes * np.float32(2.0 ** weight_exponent(w))  # exact: a power of two
        hi = scaled.astype(np.float16)
        lo = (scaled - hi.astype(np.float32)).astype(np.float16)  # the difference is exact
        bits = np.stack([hi.view(np.uint32), lo.view(np.uint32)])
        return np.ascontiguousarray(bits.reshape(2, chunks, K, nt, 32, 2))
    else:
        bits = lanes.view(np.uint32)  # split into big + small on the device
    return np.ascontiguousarray(bits.reshape(chunks, K, nt, 32, 2))


def weight_exponent(w: Any) -> int:
    """e of 3xfp16's weight scale: max |w| * 2^e in [2^14, 2^15) (NumPy or CuPy arrays)."""
    xp = xp_of(w)
    w = xp.asarray(w, dtype=xp.float32)
    return fp16_scale_exponent(float(xp.abs(w).max())) if w.size else 0


def prepare(shape: ConvShape, weight: Any, bias: Any, kernel_params: Mapping[str, Any],
            precision: str, in_dtype: Any = "float32", *, pool: int) -> Run:
    """run(x, out): x (B, C, H, W) NCHW in `in_dtype` (float32 or float16), out
    (B, M, Ho // pool, Wo // pool) float32, written with maxpool(relu(conv(x, weight) + bias)).
    kernel_params may fix warps, units, rows, prefetch, minb, bps (SPACE; 0 or absent: chosen)."""
    return _prepare(shape, pool, precision, weight, bias, kernel_params, in_dtype)


def _prepare(shape: ConvShape, pool: int, precision: str, weight: Any, bias: Any,
             params: Mapping[str, Any], in_dtype: Any) -> Run:
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel
    from convolab.gpu.device import occupancy, sm_count

    plan = wide_plan(shape, pool, precision, params, in_dtype)
    in_name = _in_dtype_name(in_dtype)
    w_h = np.asarray(to_numpy(weight), np.float32)
    if w_h.shape != shape.w_shape:
        raise InputError(f"fcp_wide: weights have shape {w_h.shape}, {shape} needs "
                         f"{shape.w_shape}")
    cp = require_cupy()
    frag = cp.asarray(wide_fragments(w_h, precision))
    b_d = cp.ascontiguousarray(cp.asarray(bias, dtype=cp.float32))
    if b_d.shape != (shape.M,):
        raise InputError(f"fcp_wide: bias has shape {b_d.shape}, needs ({shape.M},)")
    kernel = get_kernel(kernel_file(precision), KERNEL, plan.defines)
    kernel.max_dynamic_shared_size_bytes = plan.smem
    # All of L1 as shared memory: left to the driver, the carveout (and the occupancy it
    # answers) fit one block an SM (ncu, H100: 7 warps an SM, grid 132).
    kernel.preferred_shared_memory_carveout = 100
    threads = plan.warps * 32
    per_sm = plan.bps or max(1, occupancy(kernel, threads, plan.smem))
    grid = (max(1, min(shape.B, sm_count() * per_sm)),)
    batch = np.int32(shape.B)
    # 3xfp16: the power of two that undoes the weights' scale (exact; 1 elsewhere)
    w_unscale = np.float32(2.0 ** -weight_exponent(w_h) if precision == "3xfp16" else 1.0)

    def run(x: Any, y: Any) -> None:
        if shape.B:
            kernel(grid, (threads,), (x, frag, b_d, y, batch, w_unscale), shared_mem=plan.smem)

    run.grid = grid  # type: ignore[attr-defined]  # for tests and benchmarks
    run.in_dtype = in_name  # type: ignore[attr-defined]  # FusedLeNet's plan reads it
    return run


# ---- the fused network's choice ------------------------------------------------------------

# Exact mode's precision on rung 28 (None: exact stays on the FFMA rung). 3xfp16 keeps fp32
# accuracy at the fp16 MMA rate: on the H100 the zoo's conv2 took 1.2-1.5 ms in it against
# 1.7-2.2 ms in 3xTF32 (docs/raw.md), and exact mode with it predicts the CPU framework's class
# on every test image (tests/test_gpu_fused_wide.py, both exact precisions).
EXACT_PRECISION: str | None = "3xfp16"


def network_in_dtype(precision: str) -> str:
    """What rung 28 reads in the fused network: fp16 where its operands are fp16 anyway (the
    block before writes fp16, or a cast follows it: the same rounding, half the bytes)."""
    return "float16" if precision == "fp16" else "float32"


def network_precision(shape: ConvShape, pool: int, precision: str) -> str | None:
    """The precision FusedLeNet runs a block with on rung 28 in a mode of `precision`
    (precision.NETWORK_MODES: 'fp32' for exact, 'tf32', 'fp16'), or None. Rung 28 takes the
    blocks the narrow tensor-core rungs 17/18 leave to the FFMA rung (M > 16, C*K > 32)."""
    from convolab.gpu.fused_mma import tc_kind

    wide = EXACT_PRECISION if precision == "fp32" else precision
    if wide is None or tc_kind(shape, pool) is not None or not supports(shape, pool, wide):
        return None
    return wide


# ---- registry -------------------------------------------------------------------------------


def zoo_wide_layers() -> list[tuple[ConvShape, int]]:
    """(shape, pool) of every zoo conv block that the fused tensor-core rungs 17/18 leave to
    this one (batch 1)."""
    from convolab.gpu.fused_ffma import zoo_fused_layers
    from convolab.gpu.fused_mma import tc_kind

    return [(s, p) for s, p in zoo_fused_layers()
            if tc_kind(s, p) is None and supports(s, p, "fp16")]


def compile_variants(pool: int, precision: str) -> list[dict[str, int]]:
    """The define sets the host compiles: each zoo layer's default plan, fp32 and fp16 input."""
    out: list[dict[str, int]] = []
    for shape, p in zoo_wide_layers():
        if p != pool or not supports(shape, p, precision):
            continue
        for in_dtype in IN_DTYPES:
            defines = wide_plan(shape, p, precision, {}, in_dtype).defines
            if defines not in out:
                out.append(defines)
    return out


@functools.cache
def wide_impl(pool: int, precision: str) -> ConvImpl:
    """The registry entry of rung 28 for one pool window and precision (fp32 input)."""
    if pool not in POOLS or precision not in PRECISIONS:
        raise ValueError(f"fcp_wide takes pool in {POOLS} and precision in "
                         f"{tuple(PRECISIONS)}, got {pool}, {precision!r}")
    what = {"fp16": "fp16 operands", "tf32": "TF32 operands",
            "3xtf32": "3xTF32: operands split big + small, fp32-exact",
            "3xfp16": "3xfp16: operands scaled by powers of two and split hi + lo in fp16, "
                      "fp32-exact"}[precision]

    def prepare_fp32(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        return _prepare(shape, pool, precision, w, b, params, "float32")

    return ConvImpl(
        name=f"fused-conv-pool{pool}-wide-{_SUFFIX[precision]}",
        demonstrates=(f"fused conv + ReLU + max-pool {pool} on tensor cores for wide layers: "
                      f"positions as A rows, channels as n-tiles, k over (p, q, c) from a "
                      f"channels-last tile, one fragment load per filter-row shift ({what})"),
        device="gpu",
        prepare=prepare_fp32,
        supports=lambda s: supports(s, pool, precision),
        space=SPACE,
        defaults={key: 0 for key in SPACE},
        tolerance=TOLERANCE[precision],
        rung=28,
        kernel_file=kernel_file(precision),
        compile_variants=lambda: compile_variants(pool, precision),
        pool=pool,
    )


for _pool in POOLS:
    for _precision in PRECISIONS:
        register(wide_impl(_pool, _precision))
