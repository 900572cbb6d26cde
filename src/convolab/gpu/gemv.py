"""Kernel 41: classifier layers at small batch as a weight-streaming GEMV
(kernels/41_gemv_weight_stream.cu; `gemv-fp32`, `gemv-tf32`, `gemv-fp16`, `gemv-bf16`).

A 1x1 convolution over 1x1 images (VGG's fc6 25088 -> 4096, fc7 4096 -> 1024) at B <= 16 is
bound by reading the weights once; the kernel streams them in the operand precision (fp32, or
fp16 / bf16 at half the bytes) with fp32 FFMA against x in shared memory. `gemv-fp32` is exact
(fp32 products and sums). `gemv-tf32` stores the weights `prepare` is given rounded to TF32 (19
significant bits) in 2.5 bytes a weight (`tf32_planes`): the kernel rebuilds each TF32 value
exactly, so its products are those of TF32 operands (x stays fp32, sums in fp32) and it streams
5/8 of fp32's bytes. Everything above `prepare` is pure Python, tested on the CPU; CuPy is
imported inside `prepare` only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu.compile import get_kernel
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "41_gemv_weight_stream.cu"
MODES: dict[str, int] = {"fp32": 0, "fp16": 1, "bf16": 2, "tf32": 3}
PIECE_BYTES = 16  # one load of W (tf32: of its 16-bit plane, plus a 4-byte word of the second)
BATCH_COLUMNS = (1, 2, 4, 8, 16)  # GV_NB: the batch padded to a power of two
MAX_BATCH = BATCH_COLUMNS[-1]
CHANNEL_ALIGN = 8  # C: rows of 16-bit weights (and x in fp32) start on 16-byte boundaries
WARPS = 8
SUMS_PER_LANE = 32  # GV_ROWS x GV_NB when ROWS is chosen from the batch: one sum a lane
SMEM_LIMIT = 227 * 1024
X_SLICE_BYTES = 32 * 1024  # x staged a block: 3-6 blocks an SM keep their slices
MAX_SLICES = 64
# The grid: at least MIN_WAVES waves of the blocks an SM holds at once (the driver's answer at
# prepare; RESIDENT_GUESS where no GPU is asked: 2-3 blocks of 256 threads at 60-120 registers).
MIN_WAVES = 2
RESIDENT_GUESS = 3
MAX_GROUPS = 8
DEFAULT_SMS = 132  # H100 SXM: the planner's assumption where no GPU is asked

# Tunable: ROWS, UNROLL and LANES are compile-time (GV_ROWS, GV_UNROLL, GV_LANES), SPLIT and
# GROUPS launch parameters; 0 is "chosen from the shape" (ROWS: 32 sums a lane over the batch
# columns, at most 4 rows; SPLIT, GROUPS: `launch_plan`).
SPACE: dict[str, tuple[int, ...]] = {"ROWS": (0, 2, 4), "UNROLL": (2, 4), "LANES": (8, 32),
                                     "SPLIT": (0, 4, 8, 16, 32, 64),
                                     "GROUPS": (0, 1, 2, 4, 8)}
DEFAULTS: dict[str, int] = {"ROWS": 0, "UNROLL": 2, "LANES": 8, "SPLIT": 0, "GROUPS": 0}


def piece_weights(mode: str) -> int:
    """Weights in one 16-byte piece (GV_VEC): 4 fp32, else 8 16-bit values (tf32: upper halves)."""
    return 4 if mode == "fp32" else 8


def elem_bytes(mode: str) -> float:
    """Bytes streamed a weight: 4 fp32, 2 fp16 / bf16, 2.5 tf32 (16 bits + a 4-bit nibble)."""
    return PIECE_BYTES / piece_weights(mode) + (0.5 if mode == "tf32" else 0)


def batch_columns(B: int) -> int:
    """GV_NB: the smallest power of two >= B (the kernel's columns past B are zeros)."""
    for nb in BATCH_COLUMNS:
        if nb >= B:
            return nb
    raise ValueError(f"gemv: batch {B} is over the {MAX_BATCH} kernel 41 keeps in registers")


def supports(shape: ConvShape) -> bool:
    """A linear layer (1x1 images, 1x1 kernel), B <= 16, C a multiple of 8, and x's slices
    within shared memory at MAX_SLICES."""
    return (shape.H == 1 and shape.W == 1 and shape.K == 1 and shape.B <= MAX_BATCH
            and shape.C % CHANNEL_ALIGN == 0 and shape.M * shape.C < 2**31
            and batch_columns(shape.B) * ceil_div(shape.C, MAX_SLICES) * 4 <= SMEM_LIMIT // 2)


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    k_slice: int  # elements of k a block
    slices: int  # gridDim.y
    groups: int  # row groups a block
    tile_rows: int  # rows a block: WARPS x ROWS x (32 / LANES) x groups
    tiles: int  # gridDim.x
    smem: int  # dynamic shared memory: the block's x slice

    @property
    def grid(self) -> tuple[int, int]:
        return self.tiles, self.slices


def gemv_defines(mode: str, B: int, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one configuration; ValueError names what is wrong with it."""
    if mode not in MODES:
        raise ValueError(f"gemv: unknown mode {mode!r}; known: {', '.join(MODES)}")
    nb = batch_columns(B)
    rows, unroll, lanes = (int(params[k]) for k in ("ROWS", "UNROLL", "LANES"))
    if rows == 0:
        rows = max(1, min(4, SUMS_PER_LANE // nb))
    if rows not in (1, 2, 4) or unroll not in (1, 2, 4) or lanes not in (8, 32):
        raise ValueError(f"gemv: ROWS and UNROLL must be 1, 2 or 4 and LANES 8 or 32, got "
                         f"{rows}, {unroll}, {lanes}")
    return {"GV_MODE": MODES[mode], "GV_NB": nb, "GV_ROWS": rows, "GV_WARPS": WARPS,
            "GV_UNROLL": unroll, "GV_LANES": lanes}


def _slice_steps(params: Mapping[str, Any], steps: int, nb: int, step: int) -> list[int]:
    """Candidate slice lengths in steps: a forced SPLIT's, else every length whose x slice fits
    X_SLICE_BYTES and that leaves at most MAX_SLICES slices."""
    if int(params["SPLIT"]):
        return [ceil_div(steps, min(int(params["SPLIT"]), steps))]
    longest = max(1, X_SLICE_BYTES // (nb * step * 4))
    return [n for n in range(1, min(steps, longest) + 1)
            if ceil_div(steps, n) <= MAX_SLICES] or [ceil_div(steps, MAX_SLICES)]


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any],
                sms: int = DEFAULT_SMS, resident: int = RESIDENT_GUESS) -> LaunchPlan:
    """Slices of k and row groups a block. Automatic (0): among slice lengths whose x slice
    fits X_SLICE_BYTES and row groups up to MAX_GROUPS (x is staged once for all of a block's
    rows), the grid with at least MIN_WAVES waves of `resident` blocks an SM where it can have
    them (blocks taken as SMs free up balance the stream), then the fullest last wave (fc6 at
    B=1 on an H100: 1056 blocks ran 0.167 ms, 1152 0.156: 2.67 and 2.91 waves of 3), then the
    fewest slices, then the most groups. A slice is a whole number of a row's sweeps (LANES x
    UNROLL pieces)."""
    d = gemv_defines(mode, shape.B, params)
    K, M, nb = shape.C, shape.M, d["GV_NB"]
    step = d["GV_LANES"] * d["GV_UNROLL"] * piece_weights(mode)
    steps = ceil_div(K, step)
    rows_per_pass = WARPS * d["GV_ROWS"] * 32 // d["GV_LANES"]
    capacity = sms * max(1, resident)
    forced = int(params["GROUPS"])
    group_options = [forced] if forced else [
        g for g in (1, 2, 4, 8) if g <= MAX_GROUPS and (g == 1 or g * rows_per_pass <= M)]

    def key(option: tuple[int, int]) -> tuple[int, float, int, int]:
        n, groups = option
        blocks = ceil_div(M, groups * rows_per_pass) * ceil_div(steps, n)
        waves = ceil_div(blocks, capacity)
        return (min(waves, MIN_WAVES), round(blocks / (waves * capacity), 2),
                -ceil_div(steps, n), groups)

    n, groups = max(itertools.product(_slice_steps(params, steps, nb, step), group_options),
                    key=key)
    k_slice = n * step
    smem = nb * k_slice * 4
    if smem > SMEM_LIMIT:
        raise ValueError(f"gemv: a {k_slice}-wide slice of {nb} batch columns needs {smem} B "
                         f"of shared memory, over {SMEM_LIMIT}: use more slices")
    tile_rows = rows_per_pass * groups
    return LaunchPlan(d, k_slice, ceil_div(K, k_slice), groups, tile_rows,
                      ceil_div(M, tile_rows), smem)


# What CI's nvcc check builds (compile_variants): every batch-column count and ROWS, each with
# both of these (UNROLL, LANES) pairs, so that every value of each parameter is compiled beside
# every GV_NB x GV_ROWS (what the kernel's static_asserts and its reduce-scatter depend on; UNROLL
# and LANES only set loop steps and trip counts) at half the builds of the whole product. The
# tuner still searches every pair (SPACE).
COMPILED_UNROLL_LANES = ((2, 8), (4, 32))


def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        out = []
        for nb, rows, (unroll, lanes) in itertools.product(
                BATCH_COLUMNS, SPACE["ROWS"], COMPILED_UNROLL_LANES):
            d = gemv_defines(mode, nb, {"ROWS": rows, "UNROLL": unroll, "LANES": lanes})
            if d not in out:
                out.append(d)
        return out

    return variants


def tf32_planes(w2: Any) -> tuple[Any, Any]:
    """(M, C) fp32, C a multiple of 8 -> the TF32 mode's two planes (NumPy or CuPy arrays).

    Each weight is rounded to TF32 (nearest, ties away from zero: cvt.rna.tf32.f32; NaN stays
    a NaN, inf an inf). hi (M, C) uint16: its upper 16 bits (sign, exponent, 7 mantissa bits);
    lo (M, C / 8) uint32: the next 3 mantissa bits of each 16-byte piece's 8 weights, weight e
    in bits 4e..4e+2. The kernel's value is (hi << 16) | (nibble << 13), the TF32 value exactly.
    """
    from convolab.gpu.implicit_gemm_wgmma import tf32_round

    xp = xp_of(w2)
    w2 = xp.ascontiguousarray(w2, dtype=xp.float32)
    if w2.ndim != 2 or w2.shape[1] % CHANNEL_ALIGN:
        raise ValueError(f"gemv-tf32: weights must be (M, C) with C a multiple of "
                         f"{CHANNEL_ALIGN}, got shape {w2.shape}")
    u = tf32_round(w2).view(xp.uint32)
    # A NaN with its payload in the 13 dropped bits would round to inf (or, signed, wrap to
    # zero): it becomes a quiet NaN of the same sign instead.
    quiet = (w2.view(xp.uint32) | xp.uint32(0x400000)) & xp.uint32(0xFFFFE000)
    u = xp.where(xp.isnan(w2), quiet, u)
    lo = xp.zeros((w2.shape[0], w2.shape[1] // 8), dtype=xp.uint32)
    for e in range(8):
        lo |= ((u[:, e::8] >> xp.uint32(13)) & xp.uint32(7)) << xp.uint32(4 * e)
    return (u >> xp.uint32(16)).astype(xp.uint16), lo


def pack_tf32(w2: Any) -> Any:
    """(M, C) fp32 -> the TF32 mode's operand (NumPy or CuPy): one uint8 buffer of 2.5 bytes a
    weight, `tf32_planes`' 16-bit plane then its nibble plane (the kernel finds the second at
    byte 2 * M * C)."""
    xp = xp_of(w2)
    hi, lo = tf32_planes(w2)
    return xp.concatenate([hi.reshape(-1).view(xp.uint8), lo.reshape(-1).view(xp.uint8)])


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def operand_weights(w: Any, mode: str) -> Any:
    """(M, C, 1, 1) fp32 -> (M, C) in the operand type (bf16 as uint16 bit patterns; tf32 as
    `pack_tf32`'s two planes in one buffer)."""
    cp = require_cupy()
    from convolab.gpu.implicit_gemm import to_bf16_bits

    w2 = cp.ascontiguousarray(cp.asarray(w, dtype=cp.float32).reshape(w.shape[0], -1))
    if mode == "fp16":
        return w2.astype(cp.float16)
    if mode == "bf16":
        return to_bf16_bits(w2)
    if mode == "tf32":
        return pack_tf32(w2)
    return w2


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import occupancy, sm_count
        from convolab.gpu.launch import BoundLaunch

        if not supports(shape):
            raise ValueError(f"gemv-{mode} does not support shape {shape}")
        if w.shape[0] != shape.M or w.size != shape.M * shape.C:
            raise ValueError(f"gemv-{mode}: weights of shape {tuple(w.shape)} for {shape} "
                             f"(want {shape.w_shape})")
        kernel = get_kernel(KERNEL_FILE, "gemv_stream", gemv_defines(mode, shape.B, params))
        kernel.max_dynamic_shared_size_bytes = SMEM_LIMIT
        resident = occupancy(kernel, 32 * WARPS, X_SLICE_BYTES)
        plan = launch_plan(shape, mode, params, sm_count(), resident)
        w_op = operand_weights(w, mode)
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        partial = cp.empty((plan.slices if plan.slices > 1 else 0, shape.B, shape.M),
                           dtype=cp.float32)
        tickets = cp.zeros(plan.tiles, dtype=cp.int32)
        args = tuple(np.int32(v) for v in (shape.B, shape.M, shape.C, plan.k_slice,
                                           plan.groups))
        launch = BoundLaunch(kernel, plan.grid, (32 * WARPS,),
                             (None, w_op, b_d, None, partial, tickets, *args), per_call=(0, 3),
                             shared_mem=plan.smem)

        def run(x: Any, y: Any) -> None:
            launch(x, y)

        return run

    return prepare


WHAT = {"fp32": "fp32 weights, exact FFMA", "fp16": "fp16 weights (half the bytes), fp32 FFMA",
        "bf16": "bf16 weights (half the bytes), fp32 FFMA",
        "tf32": "TF32 weights in 2.5 bytes (16-bit and nibble planes), fp32 FFMA"}

for _mode in MODES:
    register(ConvImpl(
        name=f"gemv-{_mode}", rung=41, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"classifier layer at batch <= {MAX_BATCH} as a GEMV streaming the "
                     f"weights once at copy speed, split k, ordered in-kernel sum "
                     f"({WHAT[_mode]})",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["batch_columns", "elem_bytes", "gemv_defines", "launch_plan", "operand_weights",
           "pack_tf32", "piece_weights", "supports", "tf32_planes"]
