"""Kernels 42 and 43: classifier layers at batch 1-64 on tensor cores, the weights streamed as the
MMA's A operand and the batch as its columns (kernels/42_gemv_tensor_core.cu: `gemv-mma-fp16`,
`-bf16`, `-tf32`, `-3xtf32`; kernels/43_gemv_tensor_core_bulk.cu: `gemv-bulk-*`, the same with
each block's weights brought a chunk at a time by the bulk copy engine, `pack_chunks`).

Kernel 41 spends B FFMAs and B shared-memory reads of x on every weight, so from B = 8 it is
bound by those rather than by the weight stream; an m16n8 MMA takes 16 rows x 8 columns at once.
`prepare` packs W once in fragment order (`pack_weights`): a warp's load of one k piece of one
16-row tile is 512 contiguous bytes, each lane's 16 bytes its A registers. TF32 keeps kernel 41's
2.5 bytes a weight (`gemv.tf32_planes` applied to the packed pieces); 3xTF32 streams fp32 and
splits in registers (fp32 accuracy). Everything above `prepare` is pure Python, tested on the
CPU; CuPy is imported inside `prepare` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu import device, gemv
from convolab.gpu.compile import get_kernel
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "42_gemv_tensor_core.cu"
MODES: dict[str, int] = {"fp16": 0, "bf16": 1, "tf32": 2, "3xtf32": 3}
N_TILES = (1, 2, 4, 8)  # TM_NT: batch columns in tiles of 8
MAX_BATCH = 8 * N_TILES[-1]
CHANNEL_ALIGN = gemv.CHANNEL_ALIGN  # x read in float4s: kernel 41's layers, no others
MAX_SLICES = 64
SMEM_LIMIT = gemv.SMEM_LIMIT
DEFAULT_SMS = gemv.DEFAULT_SMS
REDUCE_WEIGHT = 0.1  # `launch_plan`: a byte of the split-k sum against a byte of the stream
# `launch_plan`: what a wave of blocks costs beyond its chunks, in chunks: the first chunk's
# loads with nothing to overlap, the sums' stores and the ticket. fc6 FP16 B = 8 with 2 blocks
# an SM (H200): 16 slices, one wave of 25 chunks, 55.5 us; 33 slices, two waves of 12, 65.6.
RAMP_CHUNKS = 3

# Tunable, all compile-time but SPLIT (0: chosen from the shape, `launch_plan`): MT m-tiles of
# 16 rows a warp, CP k pieces a chunk (the weights a lane has in flight: MT x CP 16-byte loads),
# WARPS a block, MINB the blocks an SM the registers must leave room for (the launch bound's
# second argument: left to itself ptxas gives these kernels 170-250 registers, one block an SM).
SPACE: dict[str, tuple[int, ...]] = {"MT": (1, 2, 4), "CP": (2, 4, 8), "WARPS": (4, 8),
                                     "SPLIT": (0, 4, 8, 16, 32, 64), "MINB": (1, 2, 3, 4)}
DEFAULTS: dict[str, int] = {"MT": 2, "CP": 4, "WARPS": 8, "SPLIT": 0, "MINB": 1}
# Kernel 43 adds STAGES, the chunks of weights in its shared-memory ring.
BULK_KERNEL_FILE = "43_gemv_tensor_core_bulk.cu"
BULK_SPACE: dict[str, tuple[int, ...]] = {**SPACE, "STAGES": (2, 3, 4)}
BULK_DEFAULTS: dict[str, int] = {**DEFAULTS, "STAGES": 4}


def piece_k(mode: str) -> int:
    """k values in one lane's 16-byte piece: a k16 step (fp16, bf16, tf32's two k8 steps in
    16-bit halves) or a k8 step of fp32 (3xTF32)."""
    return 8 if mode == "3xtf32" else 16


def elem_bytes(mode: str) -> float:
    """Bytes streamed a weight: 2 fp16 / bf16, 2.5 tf32, 4 3xtf32."""
    return {"fp16": 2.0, "bf16": 2.0, "tf32": 2.5, "3xtf32": 4.0}[mode]


def n_tiles(B: int) -> int:
    """TM_NT: the fewest 8-column tiles in N_TILES that hold B columns."""
    for nt in N_TILES:
        if 8 * nt >= B:
            return nt
    raise ValueError(f"gemv-mma: batch {B} is over the {MAX_BATCH} columns kernel 42 keeps")


def supports(shape: ConvShape) -> bool:
    """A linear layer (1x1 images, 1x1 kernel), B <= 64, C a multiple of 8."""
    return (shape.H == 1 and shape.W == 1 and shape.K == 1 and shape.B <= MAX_BATCH
            and shape.C % CHANNEL_ALIGN == 0 and shape.M * shape.C < 2**31)


def mma_defines(mode: str, B: int, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one configuration; ValueError names what is wrong with it."""
    if mode not in MODES:
        raise ValueError(f"gemv-mma: unknown mode {mode!r}; known: {', '.join(MODES)}")
    keys = ("MT", "CP", "WARPS", "MINB")
    mt, cp_, warps, minb = (int(params[k]) for k in keys)
    if any(int(params[k]) not in SPACE[k] for k in keys):
        raise ValueError(f"gemv-mma: MT, CP, WARPS and MINB must be in "
                         f"{', '.join(str(SPACE[k]) for k in keys)}, got {mt}, {cp_}, {warps}, "
                         f"{minb}")
    return {"TM_MODE": MODES[mode], "TM_NT": n_tiles(B), "TM_MT": mt, "TM_CP": cp_,
            "TM_WARPS": warps, "TM_MINB": minb}


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    m_tiles: int  # 16-row tiles of W (packed, zero rows past M)
    pieces: int  # k pieces a row (packed, zero past K)
    slice_pieces: int  # pieces a block: whole chunks
    slices: int  # gridDim.y
    tiles: int  # gridDim.x: row tiles of WARPS x MT m-tiles
    smem: int  # x's staged chunk

    @property
    def grid(self) -> tuple[int, int]:
        return self.tiles, self.slices

    @property
    def threads(self) -> int:
        return 32 * self.defines["TM_WARPS"]


def staged_x_bytes(mode: str, defines: Mapping[str, int]) -> int:
    """Shared memory for x's chunk: 8 TM_NT rows of the chunk's k in the operand type, each row
    padded by 16 bytes (the kernel's bank-conflict-free stride); 3xTF32 keeps big and small
    parts as two planes."""
    words = defines["TM_CP"] * piece_k(mode) // (2 if mode in ("fp16", "bf16") else 1)
    return (2 if mode == "3xtf32" else 1) * 8 * defines["TM_NT"] * (words + 4) * 4


def bulk_defines(mode: str, B: int, params: Mapping[str, Any]) -> dict[str, int]:
    """Kernel 43's -D set: kernel 42's plus TB_STAGES."""
    stages = int(params["STAGES"])
    if stages not in BULK_SPACE["STAGES"]:
        raise ValueError(f"gemv-bulk: STAGES must be in {BULK_SPACE['STAGES']}, got {stages}")
    return {**mma_defines(mode, B, params), "TB_STAGES": stages}


def chunk_bytes(mode: str, defines: Mapping[str, int]) -> int:
    """One block's chunk of packed weights (kernel 43's copy): its pieces' 16 bytes a lane,
    plus TF32's nibble word a lane."""
    return (defines["TM_WARPS"] * defines["TM_MT"] * defines["TM_CP"] * 32
            * (20 if mode == "tf32" else 16))


def bulk_smem(mode: str, defines: Mapping[str, int]) -> int:
    """Kernel 43's dynamic shared memory: the ring, the mbarriers (16-byte aligned), x."""
    stages = defines["TB_STAGES"]
    return (stages * chunk_bytes(mode, defines) + ceil_div(8 * stages, 16) * 16
            + staged_x_bytes(mode, defines))


def bulk_resident(defines: Mapping[str, int], smem: int) -> int:
    """Kernel 43's blocks an SM: MINB (its launch bound holds the registers to that), or fewer
    where their rings do not fit the SM's shared memory (`device.resident_blocks`)."""
    by_smem = device.resident_blocks(1, 32 * defines["TM_WARPS"], smem)
    return max(1, min(defines["TM_MINB"], by_smem))


def piece_bytes(mode: str) -> int:
    """Bytes a warp streams for one piece of one m-tile: 32 lanes x 16 bytes (TF32: plus one
    word of nibbles a lane)."""
    return 32 * (20 if mode == "tf32" else 16)


def slice_chunks(chunks: int, tiles: int, slots: int, chunk_bytes: int, tile_rows: int, B: int,
                 forced: int = 0) -> int:
    """Chunks a k slice of a row tile, for `tiles` row tiles of `chunks` chunks each on `slots`
    block slots a wave: with `forced` (SPLIT) that many slices, else the count with the least
    modelled time, in bytes the busiest slot moves: (waves, rounded up) x (chunks a block +
    RAMP_CHUNKS) x chunk_bytes, plus the slice sum at the end, which one block a row tile does
    alone: slices x tile_rows x B fp32 partials, weighted REDUCE_WEIGHT (an SM alone reads L2
    several times faster than its share of the stream)."""
    options = [min(forced, chunks)] if forced else range(1, min(chunks, MAX_SLICES) + 1)

    def cost(slices: int) -> tuple[float, int]:
        per_slice = ceil_div(chunks, slices)
        real = ceil_div(chunks, per_slice)
        stream = ceil_div(tiles * real, slots) * (per_slice + RAMP_CHUNKS) * chunk_bytes
        reduce = real * tile_rows * B * 4 * REDUCE_WEIGHT if real > 1 else 0.0
        return stream + reduce, real

    return ceil_div(chunks, min(cost(s) for s in options)[1])


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any],
                sms: int = DEFAULT_SMS, resident: int | None = None) -> LaunchPlan:
    """Row tiles and k slices (`slice_chunks`; SPLIT 0 chooses). `resident`: the blocks an SM
    holds at once, MINB unless the caller knows fewer fit."""
    d = mma_defines(mode, shape.B, params)
    slots = sms * (d["TM_MINB"] if resident is None else resident)
    m_tiles, pieces = ceil_div(shape.M, 16), ceil_div(shape.C, piece_k(mode))
    tiles = ceil_div(m_tiles, d["TM_MT"] * d["TM_WARPS"])
    chunks = ceil_div(pieces, d["TM_CP"])
    chunk_bytes = d["TM_WARPS"] * d["TM_MT"] * d["TM_CP"] * piece_bytes(mode)
    tile_rows = 16 * d["TM_MT"] * d["TM_WARPS"]
    per_slice = slice_chunks(chunks, tiles, slots, chunk_bytes, tile_rows, shape.B,
                             int(params["SPLIT"]))
    slices = ceil_div(chunks, per_slice)
    smem = staged_x_bytes(mode, d)
    if smem > SMEM_LIMIT:
        raise ValueError(f"gemv-mma: x's chunk needs {smem} B of shared memory, over "
                         f"{SMEM_LIMIT}: use a smaller CP")
    return LaunchPlan(d, m_tiles, pieces, per_slice * d["TM_CP"], slices, tiles, smem)


# Where `auto` runs kernel 42 without a cache entry (H100, 2026-11-28, docs/vgg.md "Kernel 42"),
# against kernel 41 and the split-K GEMMs it replaces, and cuBLAS in the same runs:
# - TF32 from B = 8: fc6 0.114-0.131 ms at B = 8-32 (before: 0.177-0.189; cuBLAS TF32
#   0.17-0.20), 0.18 at 64 (0.19); fc7 at 8-16 (0.021-0.022 at 16 against 0.030). Below 8,
#   kernel 41's FFMA stream of the same 2.5-byte weights is as fast. fc7 at 32-64 is not
#   taken: there it ran 0.028-0.047 ms against the split-K GEMM's 0.025-0.031.
# - FP16 up to B = 32 on every classifier layer: fc6 0.087-0.105 (kernel 41 / split-K
#   0.095-0.118), fc7 0.015-0.025 (0.016-0.027). At 64 both layers ran slower (fc6 0.131
#   against split-K's 0.121, fc7 0.038 against 0.030).
# Layers below BIG_LAYER weights with B >= SMALL_TILE_BATCH use 64-row tiles (MT = 1, WARPS =
# 4): fc7 (M = 1024) has only 4 tiles of 256 rows, so k is split 8-16 ways and one block sums
# a quarter-megabyte of partials (fc7 fp16 B = 32: 0.025 against 0.048 ms; TF32 B = 16: 0.021
# against 0.033-0.040). B = 12 runs the same kernel as 16 (two batch tiles).
# On an H200 (2026-11-28, docs/vgg.md "fc6's weight stream"): fc6 FP16 reads 205 MB, and a
# block of kernel 42 waits for its chunk every chunk, so the stream needs more than one block
# an SM (MINB; left alone ptxas takes 164-250 registers): device time at B = 8 / 16 / 32, us:
# one block 71 / 68 / 74; MINB 2 52 / 55 / 67; 128-row tiles of 8-piece chunks (MT 1, CP 8,
# MINB 2) 49 / 51 / 70; MT 1, MINB 2 57 / 59 / 64 (cuBLAS 52-54). At B = 64 those spill or
# sum too long a tail; kernel 43 (one block, a ring of 4 chunks) 82-84 against the split-K
# GEMM's 94. TF32 at B = 8 / 16: MINB 2 79 / 71 against 87 / 71 (cuBLAS TF32 108-110).
AUTO_BATCHES: dict[str, tuple[int, int]] = {"tf32": (8, MAX_BATCH), "fp16": (1, MAX_BATCH)}
SMALL_LAYER_MAX_BATCH = {"tf32": 16, "fp16": 32}
BIG_LAYER = 1 << 24  # weights (M x C): fc6 has 102.8M, fc7 4.2M
SMALL_TILE_BATCH = 12
SMALL_TILES: dict[str, int] = {"MT": 1, "WARPS": 4}
BULK_FROM_BATCH: dict[str, int] = {"tf32": 32, "fp16": 64}
# fp32 on layers of BIG_LAYER weights (fc6), every batch: kernel 43 in 3xTF32, the fp32 weights
# by the bulk copy engine (4 bytes a weight, as kernel 41's) split big + small on chip. H200,
# 2026-11-29 (docs/vgg.md "fc6 exact on kernel 43"), ms: B = 1-16 0.108-0.122 against kernel
# 41's 0.113-0.180; 17-32 0.150-0.151 against rung 39's 3xfp16 split-K 0.178-0.222; 64 0.241
# against rung 27's 3xTF32 split-K 0.311; cuBLAS SGEMM 0.111-0.350 in the same runs.
EXACT_BIG_LAYER = "gemv-bulk-3xtf32"
# Big layers on kernel 42: (up to this batch, parameters), the first that holds B.
BIG_LAYER_TILES: dict[str, tuple[tuple[int, dict[str, int]], ...]] = {
    "fp16": ((16, {"MT": 1, "CP": 8, "MINB": 2}), (32, {"MT": 1, "MINB": 2})),
    "tf32": ((16, {"MINB": 2}),),
}


def auto_choice(shape: ConvShape, mode: str) -> tuple[str, dict[str, int]] | None:
    """The implementation `auto` runs for this layer in this mode and its parameters (only the
    ones that differ from the defaults), or None where it keeps kernel 41 or the GEMMs.
    Kernel 43 on layers of BIG_LAYER weights from BULK_FROM_BATCH (TF32 fc6 B = 32: 0.120 ms
    against kernel 42's 0.135, B = 64: 0.140 against 0.186); kernel 42 below that with
    BIG_LAYER_TILES on them, SMALL_TILES on small layers from SMALL_TILE_BATCH; for fp32,
    EXACT_BIG_LAYER on layers of BIG_LAYER weights at every batch, nothing on others."""
    if mode == "fp32":
        big = supports(shape) and shape.M * shape.C >= BIG_LAYER
        return (EXACT_BIG_LAYER, {}) if big else None
    if mode not in AUTO_BATCHES or not supports(shape):
        return None
    low, high = AUTO_BATCHES[mode]
    big = shape.M * shape.C >= BIG_LAYER
    if not low <= shape.B <= (high if big else SMALL_LAYER_MAX_BATCH[mode]):
        return None
    bulk_from = BULK_FROM_BATCH.get(mode, MAX_BATCH + 1)
    if big and bulk_from <= shape.B:
        return f"gemv-bulk-{mode}", {}
    if big:
        for up_to, params in BIG_LAYER_TILES.get(mode, ()):
            if up_to >= shape.B:
                return f"gemv-mma-{mode}", dict(params)
        return f"gemv-mma-{mode}", {}
    small_tiles = shape.B >= SMALL_TILE_BATCH
    return f"gemv-mma-{mode}", dict(SMALL_TILES) if small_tiles else {}


# What CI's nvcc check builds (compile_variants): every mode at the fewest and the most batch
# tiles with the defaults (TM_NT and TM_MODE change the code paths), and for fp16 and 3xTF32
# (the fewest and the most registers a value) each other value of MT, CP and WARPS once at the
# most tiles: they change only register arrays and trip counts, the same in every mode.
VARIED_MODES = ("fp16", "3xtf32")


def _covering_sets(mode: str, bulk: bool) -> list[dict[str, int]]:
    """The fewest and the most batch tiles at the defaults; then, at the most tiles, each other
    value of the parameters that change code size once: MT, CP and WARPS for kernel 42 in
    VARIED_MODES, the ring depth for kernel 43 in fp16 (its tile values are kernel 42's code,
    compiled there)."""
    defaults, space = (BULK_DEFAULTS, BULK_SPACE) if bulk else (DEFAULTS, SPACE)
    varied = (("STAGES",) if mode == "fp16" else ()) if bulk else (
        ("MT", "CP", "WARPS") if mode in VARIED_MODES else ())
    points = [(8 * N_TILES[0], dict(defaults)), (MAX_BATCH, dict(defaults))]
    points += [(MAX_BATCH, {**defaults, key: value}) for key in varied
               for value in space[key] if value != defaults[key]]
    out: list[dict[str, int]] = []
    for batch, point in points:
        d = (bulk_defines if bulk else mma_defines)(mode, batch, point)
        if d not in out:
            out.append(d)
    return out


def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    return lambda: _covering_sets(mode, bulk=False)


def bulk_compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    return lambda: _covering_sets(mode, bulk=True)


# --------------------------------------------------------------------------------------
# The weights in fragment order (NumPy or CuPy)
# --------------------------------------------------------------------------------------

# Axis orders that take W, reshaped to (m-tile, row half h, g, piece, ...k axes), to (m-tile,
# piece, g, t, one lane's values in register order). fp16 / bf16 (m16n8k16): register r holds
# row g + 8 (r % 2), columns 2t, 2t + 1 (+ 8 for r >= 2): k axes (k half, t, pair). TF32 pieces
# (two m16n8k8 steps s): value 4s + 2c + h is row g + 8h, column 8s + t + 4c: k axes (s, c, t).
# 3xTF32 (one m16n8k8 step): value 2c + h, column t + 4c: k axes (c, t).
_ORDER = {
    "fp16": ((2, 4, 2), (0, 3, 2, 5, 4, 1, 6)),
    "tf32": ((2, 2, 4), (0, 3, 2, 6, 4, 5, 1)),
    "3xtf32": ((2, 4), (0, 3, 2, 5, 4, 1)),
}


def fragment_values(w2: Any, mode: str) -> Any:
    """(M, C) -> (m-tiles, pieces, 32 lanes, values a lane) in the MMA's register order, zero
    rows past M and zero columns past C (same dtype, NumPy or CuPy)."""
    xp = xp_of(w2)
    M, C = w2.shape
    pk = piece_k(mode)
    mt, pieces = ceil_div(M, 16), ceil_div(C, pk)
    padded = xp.zeros((16 * mt, pk * pieces), dtype=w2.dtype)
    padded[:M, :C] = w2
    k_axes, order = _ORDER["fp16" if mode == "bf16" else mode]
    v = padded.reshape(mt, 2, 8, pieces, *k_axes).transpose(order)
    return xp.ascontiguousarray(v).reshape(mt, pieces, 32, -1)


def operand_values(w2: Any, mode: str) -> Any:
    """(M, C) fp32 -> `fragment_values` in the operand type: fp16 values, bf16 bit patterns
    (uint16, nearest even), fp32 (3xTF32; TF32 before its rounding in `gemv.tf32_planes`)."""
    xp = xp_of(w2)
    w2 = xp.ascontiguousarray(w2, dtype=xp.float32)
    if w2.ndim != 2 or w2.shape[1] % CHANNEL_ALIGN:
        raise ValueError(f"gemv-mma: weights must be (M, C) with C a multiple of "
                         f"{CHANNEL_ALIGN}, got shape {w2.shape}")
    if mode not in MODES:
        raise ValueError(f"gemv-mma: unknown mode {mode!r}; known: {', '.join(MODES)}")
    return fragment_values(sixteen_bit(w2, mode) if mode in ("fp16", "bf16") else w2, mode)


def sixteen_bit(a: Any, mode: str) -> Any:
    """fp32 values in a 16-bit operand type, round to nearest even: fp16 values, or bf16 bit
    patterns (uint16)."""
    xp = xp_of(a)
    a = xp.ascontiguousarray(a, dtype=xp.float32)
    if mode == "fp16":
        return a.astype(xp.float16)
    u = a.view(xp.uint32)
    return ((u + ((u >> xp.uint32(16)) & xp.uint32(1)) + xp.uint32(0x7FFF))
            >> xp.uint32(16)).astype(xp.uint16)


def _tf32_bytes(values: Any) -> tuple[Any, Any]:
    """Pieces of 8 TF32 values (..., 8) fp32 -> their 16-bit upper halves and nibble words, as
    bytes of the same leading shape (16 and 4 bytes a piece)."""
    xp = xp_of(values)
    lead = values.shape[:-1]
    hi, lo = gemv.tf32_planes(values.reshape(-1, 8))
    return (xp.ascontiguousarray(hi).view(xp.uint8).reshape(*lead, 16),
            xp.ascontiguousarray(lo).view(xp.uint8).reshape(*lead, 4))


def pack_weights(w2: Any, mode: str) -> Any:
    """(M, C) fp32 -> kernel 42's operand: `operand_values`, or for TF32 one uint8 buffer: the
    pieces' 16-bit upper halves, then one 32-bit word of 3-bit nibbles a lane and piece."""
    xp = xp_of(w2)
    values = operand_values(w2, mode)
    if mode != "tf32":
        return values
    hi, lo = _tf32_bytes(values)
    return xp.concatenate([hi.reshape(-1), lo.reshape(-1)])


def pack_chunks(w2: Any, mode: str, defines: Mapping[str, int]) -> Any:
    """(M, C) fp32 -> kernel 43's operand, uint8: for each row group (a block's TM_WARPS x TM_MT
    m-tiles) and each chunk of TM_CP pieces, one contiguous run: the pieces in (warp, m-tile,
    piece, lane) order, 16 bytes each, then for TF32 their nibble words in the same order.
    m-tiles and pieces past the layer are zero."""
    xp = xp_of(w2)
    values = operand_values(w2, mode)
    warps, mt, cp_ = defines["TM_WARPS"], defines["TM_MT"], defines["TM_CP"]
    tiles, pieces, lanes, n = values.shape
    groups, chunks = ceil_div(tiles, warps * mt), ceil_div(pieces, cp_)
    padded = xp.zeros((groups * warps * mt, chunks * cp_, lanes, n), dtype=values.dtype)
    padded[:tiles, :pieces] = values
    blocks = padded.reshape(groups, warps, mt, chunks, cp_, lanes, n).transpose(
        0, 3, 1, 2, 4, 5, 6)
    blocks = xp.ascontiguousarray(blocks).reshape(groups, chunks, -1, n)
    if mode == "tf32":
        hi, lo = _tf32_bytes(blocks)
        parts = [hi.reshape(groups, chunks, -1), lo.reshape(groups, chunks, -1)]
        return xp.ascontiguousarray(xp.concatenate(parts, axis=2)).reshape(-1)
    return blocks.reshape(groups, chunks, -1).view(xp.uint8).reshape(-1)


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def layer_weights(name: str, shape: ConvShape, w: Any, supported: bool) -> Any:
    """w as the (M, C) fp32 CuPy array a classifier kernel packs, after the checks each of their
    `prepare`s makes (kernels 42, 43, 48, 49): ValueError naming the implementation and the
    shape, or the weights' shape."""
    cp = require_cupy()
    if not supported:
        raise ValueError(f"{name} does not support shape {shape}")
    if w.shape[0] != shape.M or w.size != shape.M * shape.C:
        raise ValueError(f"{name}: weights of shape {tuple(w.shape)} for {shape} "
                         f"(want {shape.w_shape})")
    return cp.asarray(w, dtype=cp.float32).reshape(shape.M, shape.C)


def _prepare(mode: str, bulk: bool) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"gemv-{'bulk' if bulk else 'mma'}-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import sm_count
        from convolab.gpu.launch import BoundLaunch

        w2 = layer_weights(name, shape, w, supports(shape))
        resident = None
        if bulk:
            defines = bulk_defines(mode, shape.B, params)
            smem = bulk_smem(mode, defines)
            if smem > SMEM_LIMIT:
                raise ValueError(f"{name}: {defines['TB_STAGES']} stages of "
                                 f"{chunk_bytes(mode, defines)} bytes and x need {smem} B of "
                                 f"shared memory, over {SMEM_LIMIT}: fewer STAGES or a smaller CP")
            resident = bulk_resident(defines, smem)
        plan = launch_plan(shape, mode, params, sm_count(), resident)
        if bulk:
            kernel = get_kernel(BULK_KERNEL_FILE, "gemv_bulk", defines)
            w_op = pack_chunks(w2, mode, defines)
            cp_ = defines["TM_CP"]
            sizes = (shape.B, shape.M, shape.C, ceil_div(plan.pieces, cp_),
                     plan.slice_pieces // cp_)
        else:
            smem = plan.smem
            kernel = get_kernel(KERNEL_FILE, "gemv_mma", plan.defines)
            w_op = pack_weights(w2, mode)
            sizes = (shape.B, shape.M, shape.C, plan.m_tiles, plan.pieces, plan.slice_pieces)
        kernel.max_dynamic_shared_size_bytes = smem
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        partial = cp.empty((plan.slices if plan.slices > 1 else 0, shape.B, shape.M),
                           dtype=cp.float32)
        tickets = cp.zeros(plan.tiles, dtype=cp.int32)
        launch = BoundLaunch(kernel, plan.grid, (plan.threads,),
                             (None, w_op, b_d, None, partial, tickets,
                              *(np.int32(v) for v in sizes)), per_call=(0, 3), shared_mem=smem)

        def run(x: Any, y: Any) -> None:
            launch(x, y)

        return run

    return prepare


WHAT = {"fp16": "fp16 weights and x, fp32 accumulate", "bf16": "bf16 weights and x",
        "tf32": "TF32 weights in 2.5 bytes, x rounded to TF32",
        "3xtf32": "fp32 weights split big + small in registers, three TF32 MMAs (fp32-accurate)"}

for _mode in MODES:
    register(ConvImpl(
        name=f"gemv-mma-{_mode}", rung=42, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"classifier layer at batch <= {MAX_BATCH} on tensor cores: weights packed "
                     f"in fragment order and streamed once as the MMA's A, the batch as its "
                     f"columns, split k summed in slice order in-kernel ({WHAT[_mode]})",
        prepare=_prepare(_mode, False), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))
    register(ConvImpl(
        name=f"gemv-bulk-{_mode}", rung=43, device="gpu", kernel_file=BULK_KERNEL_FILE,
        demonstrates=f"kernel 42 with each block's chunk of weights packed contiguously and "
                     f"brought by the bulk copy engine into a shared-memory ring on mbarriers "
                     f"({WHAT[_mode]})",
        prepare=_prepare(_mode, True), supports=supports, space=BULK_SPACE,
        defaults=BULK_DEFAULTS, compile_variants=bulk_compile_variants(_mode),
        tolerance=TOLERANCE[_mode]))

__all__ = ["auto_choice", "bulk_defines", "bulk_resident", "bulk_smem", "chunk_bytes",
           "elem_bytes", "fragment_values", "launch_plan", "layer_weights", "mma_defines",
           "n_tiles", "operand_values", "pack_chunks", "pack_weights", "piece_k", "sixteen_bit",
           "slice_chunks", "staged_x_bytes", "supports"]
