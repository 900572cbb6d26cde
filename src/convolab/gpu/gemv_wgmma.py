"""Kernel 49 (`gemv-wg-fp16`, `gemv-wg-bf16`): a classifier layer at batch 16-64 on Hopper's
warpgroup MMA, weights and x both brought by the bulk copy engine
(kernels/49_gemv_wgmma_bulk.cu).

Kernel 43 at 32-64 columns reads x's chunk from shared memory once a warp (64 KB a chunk for
32 KB of weights) after converting it through registers between two block barriers; here wgmma
reads both operands from shared memory by descriptor, x is converted once a call into chunks
laid out as wgmma reads them, and a chunk of x travels with the block's chunk of weights into
a ring on mbarriers. Layout of both operands: each k-tile of 64 values is a row of 128 bytes
in wgmma's 128-byte swizzle (16-byte piece j of row r at j ^ (r mod 8)). `pack_weights` puts
a block's rows in the order that gives warp w of warpgroup g kernel 42's m-tiles of warp
4g + w, so the kernel ends with kernel 42's `finish`. Everything above `prepare` is pure
Python, tested on the CPU; CuPy is imported inside `prepare` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu import device, gemv_mma
from convolab.gpu.compile import get_kernel
from convolab.gpu.implicit_gemm_wgmma import wgmma_ruled_out
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "49_gemv_wgmma_bulk.cu"
MODES: dict[str, int] = {"fp16": 0, "bf16": 1}
K_TILE = 64  # k values in one 128-byte operand row
ROW_BYTES = 128
WARPGROUPS = 2
PACK_THREADS = 256
# MT: 64-row wgmmas a warpgroup (a block's rows: 128 MT); KT: k-tiles a chunk; STAGES: chunks
# in the ring; MINB: the launch bound's blocks an SM; SPLIT: k slices (0: chosen,
# `gemv_mma.slice_chunks`); EARLY: the GEMM launched to start while x is converted (its
# weight copies go out at once; `launch.BoundLaunch`, early=True).
SPACE: dict[str, tuple[int, ...]] = {"MT": (1, 2), "KT": (1, 2), "STAGES": (2, 3, 4, 5, 6),
                                     "SPLIT": (0, 4, 8, 16, 32, 64), "MINB": (1, 2),
                                     "EARLY": (0, 1)}
DEFAULTS: dict[str, int] = {"MT": 1, "KT": 1, "STAGES": 4, "SPLIT": 0, "MINB": 1, "EARLY": 1}


def supports(shape: ConvShape) -> bool:
    """Kernel 42's layers (a linear layer, B <= 64, C a multiple of 8) on a GPU that runs
    sm_90a code."""
    return gemv_mma.supports(shape) and not wgmma_ruled_out()


def defines(mode: str, B: int, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one configuration; ValueError names what is wrong with it."""
    if mode not in MODES:
        raise ValueError(f"gemv-wg: unknown mode {mode!r}; known: {', '.join(MODES)}")
    keys = ("MT", "KT", "STAGES", "MINB")
    if any(int(params[k]) not in SPACE[k] for k in keys):
        raise ValueError(f"gemv-wg: MT, KT, STAGES and MINB must be in "
                         f"{', '.join(str(SPACE[k]) for k in keys)}, got "
                         f"{', '.join(str(params[k]) for k in keys)}")
    return {"TM_MODE": MODES[mode], "TM_NT": gemv_mma.n_tiles(B), "TM_MT": int(params["MT"]),
            "TM_WARPS": 4 * WARPGROUPS, "TM_MINB": int(params["MINB"]),
            "GW_KT": int(params["KT"]), "GW_STAGES": int(params["STAGES"])}


def tile_rows(d: Mapping[str, int]) -> int:
    return WARPGROUPS * 64 * d["TM_MT"]


def a_bytes(d: Mapping[str, int]) -> int:
    """A block's chunk of weights: KT k-tiles of its rows."""
    return d["GW_KT"] * tile_rows(d) * ROW_BYTES


def x_bytes(d: Mapping[str, int]) -> int:
    """x's chunk: KT k-tiles of 8 TM_NT rows."""
    return d["GW_KT"] * 8 * d["TM_NT"] * ROW_BYTES


def smem_bytes(d: Mapping[str, int]) -> int:
    """The ring, and 1 KB to align it (the swizzle repeats on 1 KB boundaries)."""
    return d["GW_STAGES"] * (a_bytes(d) + x_bytes(d)) + 1024


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    tiles: int  # gridDim.x: row tiles of tile_rows
    chunks: int  # chunks of KT k-tiles along k (packed, zero past C)
    slice_chunks: int  # chunks a block
    slices: int  # gridDim.y
    smem: int

    @property
    def grid(self) -> tuple[int, int]:
        return self.tiles, self.slices


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any],
                sms: int = gemv_mma.DEFAULT_SMS) -> LaunchPlan:
    """Row tiles and k slices, by kernel 42's model (`gemv_mma.slice_chunks`) on the blocks an
    SM holds: MINB, or fewer where the ring does not fit twice."""
    d = defines(mode, shape.B, params)
    smem = smem_bytes(d)
    if smem > gemv_mma.SMEM_LIMIT:
        raise ValueError(f"gemv-wg: {d['GW_STAGES']} stages of {a_bytes(d) + x_bytes(d)} bytes "
                         f"need {smem} B of shared memory, over {gemv_mma.SMEM_LIMIT}: fewer "
                         f"STAGES, KT or MT")
    resident = max(1, min(d["TM_MINB"], device.resident_blocks(1, 32 * d["TM_WARPS"], smem)))
    tiles = ceil_div(shape.M, tile_rows(d))
    chunks = ceil_div(shape.C, K_TILE * d["GW_KT"])
    per_slice = gemv_mma.slice_chunks(chunks, tiles, sms * resident, a_bytes(d), tile_rows(d),
                                      shape.B, int(params["SPLIT"]))
    return LaunchPlan(d, tiles, chunks, per_slice, ceil_div(chunks, per_slice), smem)


# --------------------------------------------------------------------------------------
# The operands (NumPy or CuPy)
# --------------------------------------------------------------------------------------


def _swizzle(a: Any) -> Any:
    """(..., rows, 8 pieces, 8 values) with rows a multiple of 8 -> the 128-byte swizzle:
    piece j of row r stored at j ^ (r mod 8)."""
    xp = xp_of(a)
    rows = a.shape[-3]
    r = xp.arange(rows)[:, None]
    return a[..., r, xp.arange(8)[None, :] ^ (r % 8), :]


def pack_weights(w2: Any, mode: str, d: Mapping[str, int]) -> Any:
    """(M, C) fp32 -> kernel 49's weights, uint8: for each row tile and each chunk, one
    contiguous run of KT k-tiles, each 2 MT wgmma A tiles (warpgroup g, its wgmma mi) of 64
    rows x 128 bytes, swizzled. Row 16 w + r of tile (g, mi) is row 16 ((4 g + w) MT + mi) + r
    of the row tile: kernel 42's m-tile mi of warp 4 g + w. Zero past M and C."""
    xp = xp_of(w2)
    if w2.ndim != 2 or w2.shape[1] % gemv_mma.CHANNEL_ALIGN:
        raise ValueError(f"gemv-wg: weights must be (M, C) with C a multiple of "
                         f"{gemv_mma.CHANNEL_ALIGN}, got shape {w2.shape}")
    values = gemv_mma.sixteen_bit(w2, mode)
    M, C = values.shape
    mt, kt = d["TM_MT"], d["GW_KT"]
    rows = tile_rows(d)
    tiles, chunks = ceil_div(M, rows), ceil_div(C, K_TILE * kt)
    padded = xp.zeros((tiles * rows, chunks * kt * K_TILE), dtype=values.dtype)
    padded[:M, :C] = values
    a = padded.reshape(tiles, WARPGROUPS, 4, mt, 16, chunks, kt, 8, 8)
    a = a.transpose(0, 5, 6, 1, 3, 2, 4, 7, 8).reshape(tiles, chunks, kt, WARPGROUPS * mt, 64, 8, 8)
    return xp.ascontiguousarray(_swizzle(a)).view(xp.uint8).reshape(-1)


def pack_x(x: Any, mode: str, d: Mapping[str, int], chunks: int) -> Any:
    """(B, C) fp32 -> what gemv_pack_x writes, uint8 (the CPU's statement of it, for the
    tests): k-tile t of every chunk is 8 TM_NT rows of 128 bytes, swizzled; zero past B and
    C."""
    xp = xp_of(x)
    values = gemv_mma.sixteen_bit(x, mode)
    B, C = values.shape
    n, tiles = 8 * d["TM_NT"], chunks * d["GW_KT"]
    padded = xp.zeros((n, tiles * K_TILE), dtype=values.dtype)
    padded[:B, :C] = values
    a = padded.reshape(n, tiles, 8, 8).transpose(1, 0, 2, 3)
    return xp.ascontiguousarray(_swizzle(a)).view(xp.uint8).reshape(-1)


# What CI's nvcc check builds: each mode at the fewest and the most batch tiles (TM_NT changes
# the wgmma's N) with the defaults, and in fp16 each other value of MT, KT and STAGES once.
def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        points = [(8, DEFAULTS), (gemv_mma.MAX_BATCH, DEFAULTS)]
        if mode == "fp16":
            points += [(gemv_mma.MAX_BATCH, {**DEFAULTS, k: v}) for k in ("MT", "KT", "STAGES")
                       for v in SPACE[k] if v != DEFAULTS[k]]
        out: list[dict[str, int]] = []
        for batch, point in points:
            d = defines(mode, batch, point)
            if d not in out:
                out.append(d)
        return out

    return variants


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"gemv-wg-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import sm_count
        from convolab.gpu.launch import BoundLaunch

        if not supports(shape):
            raise ValueError(f"{name} does not support shape {shape}")
        if w.shape[0] != shape.M or w.size != shape.M * shape.C:
            raise ValueError(f"{name}: weights of shape {tuple(w.shape)} for {shape} "
                             f"(want {shape.w_shape})")
        plan = launch_plan(shape, mode, params, sm_count())
        d = plan.defines
        w_op = pack_weights(cp.asarray(w, dtype=cp.float32).reshape(shape.M, shape.C), mode, d)
        x_op = cp.zeros(plan.chunks * x_bytes(d), dtype=cp.uint8)
        pieces = x_op.size // 16
        pack = BoundLaunch(get_kernel(KERNEL_FILE, "gemv_pack_x", d),
                           (ceil_div(pieces, PACK_THREADS),), (PACK_THREADS,),
                           (None, x_op, np.int32(shape.B), np.int32(shape.C), np.int32(pieces)),
                           per_call=(0,))
        kernel = get_kernel(KERNEL_FILE, "gemv_wgmma", d)
        kernel.max_dynamic_shared_size_bytes = plan.smem
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        partial = cp.empty((plan.slices if plan.slices > 1 else 0, shape.B, shape.M),
                           dtype=cp.float32)
        tickets = cp.zeros(plan.tiles, dtype=cp.int32)
        gemm = BoundLaunch(kernel, plan.grid, (32 * d["TM_WARPS"],),
                           (x_op, w_op, b_d, None, partial, tickets, np.int32(shape.B),
                            np.int32(shape.M), np.int32(plan.chunks), np.int32(plan.slice_chunks)),
                           per_call=(3,), shared_mem=plan.smem, early=bool(params["EARLY"]))

        def run(x: Any, y: Any) -> None:
            pack(x)
            gemm(y)

        return run

    return prepare


WHAT = {"fp16": "fp16 weights and x", "bf16": "bf16 weights and x"}

for _mode in MODES:
    register(ConvImpl(
        name=f"gemv-wg-{_mode}", rung=49, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"classifier layer at batch 16-64 on the warpgroup MMA (sm_90a): weights "
                     f"and x, converted once a call, both in wgmma's swizzled layout and brought "
                     f"chunk by chunk by the bulk copy engine into a ring on full/empty "
                     f"mbarriers, no block barrier in the loop ({WHAT[_mode]}, fp32 accumulate)",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["a_bytes", "defines", "launch_plan", "pack_weights", "pack_x", "smem_bytes",
           "supports", "x_bytes"]
