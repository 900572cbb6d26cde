"""Rung 39: implicit-GEMM convolution on Hopper's warpgroup MMA (kernels/39_implicit_gemm_wgmma.cu).

The GEMM and its operand layout are rung 26's (`implicit_gemm`: M x N x Kd, N = B*Ho*Wo,
Kd = K*K*Cp, weights (M, K, K, Cp), x channels-last (B, H, W, Cp)); what differs is the main
loop (wgmma from 128-byte-swizzled shared memory) and that every operand is made ready for it
outside the loop: `prepare` rounds the weights to TF32 (and for 3xTF32 stores their big and
small parts one after the other), and `run` writes x channels-last in the same form (a
counted kernel, always run: the rounding or split happens there). wgmma exists on sm_90a only:
`supports` is False on any other GPU, and the file is built for that target
(`compile.ARCH_SPECIFIC`). Everything above `prepare` is pure Python and tested on the CPU.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none, require_cupy, xp_of
from convolab.gpu import implicit_gemm as ig
from convolab.gpu.compile import get_kernel
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

FILE = "39_implicit_gemm_wgmma.cu"
THREADS = 256  # two warpgroups
ROW_BYTES = 128  # one operand row of a stage: the 128-byte swizzle span, i.e. BK*element size
COPY_ROWS = THREADS // (ROW_BYTES // 16)  # rows one pass of the block's 16-byte copies covers
WG_N = (64, 96, 128, 192, 256)  # the wgmma N a warpgroup may run
MAX_ACC = 192  # fp32 accumulators a thread may hold (3xTF32 holds two sets: acc and total)
PLANE_LIMIT = 2**32  # the loader keeps pixel offsets within one operand plane in 32 bits
ALIGN_SLACK = 1024  # the kernel aligns its ring to the swizzle's 1024-byte period
LAYOUT_TILE = 32  # the layout pass transposes 32 x 32 tiles with (32, 8) threads

# Pruned to what won or came close in the H100 sweeps (docs/vgg.md): BN = 256 never won, and
# 3 stages were within 3% of 2 or 4 on every layer. Values outside stay valid (the plans
# that measured them still run); the space is what the tuner searches and CI compiles.
_SPACE = {"BM": (64, 128, 256), "BN": (128, 192), "STAGES": (2, 4), "PIPE": (0, 1)}
_SPACE_3X = {"BM": (64, 128), "BN": (64, 128, 192), "STAGES": (2, 3, 4)}


def space(mode: str) -> dict[str, tuple[int, ...]]:
    return dict(_SPACE_3X if mode == "3xtf32" else _SPACE)


def defaults(mode: str) -> dict[str, int]:
    return dict(ig.WGMMA_WIDE[mode][0])


def planes(mode: str) -> int:
    """Operand planes in memory and in each stage: big and small for 3xTF32, else one."""
    return 2 if mode == "3xtf32" else 1


def warpgroup_n(bm: int, bn: int) -> int:
    """A warpgroup's wgmma N: BM = 64 puts the two warpgroups side by side along n."""
    return bn // 2 if bm == 64 else bn


def accumulators(mode: str, bm: int, bn: int) -> int:
    """fp32 accumulators a thread holds: N/2 per 64-row wgmma (two of them at BM = 256),
    twice that for 3xTF32's separate total."""
    return (2 if bm == 256 else 1) * warpgroup_n(bm, bn) // 2 * planes(mode)


def smem_bytes(mode: str, bm: int, bn: int, stages: int) -> int:
    return stages * (bm + bn) * ROW_BYTES * planes(mode) + ALIGN_SLACK


def wgmma_defines(mode: str, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one tile configuration; ValueError names what is wrong with it."""
    if mode not in ig.MODES:
        raise ValueError(f"igemm-wg: unknown mode {mode!r}; known: {', '.join(ig.MODES)}")
    bm, bn, stages = (int(params[k]) for k in ("BM", "BN", "STAGES"))
    pipe = 0 if mode == "3xtf32" else int(params.get("PIPE", 1))
    if bm not in (64, 128, 256) or bn % COPY_ROWS or warpgroup_n(bm, bn) not in WG_N:
        raise ValueError(f"igemm-wg: BM must be 64, 128 or 256 and each warpgroup's N "
                         f"({', '.join(map(str, WG_N))}) a multiple of {COPY_ROWS}; got "
                         f"BM={bm} BN={bn}")
    if accumulators(mode, bm, bn) > MAX_ACC:
        raise ValueError(f"igemm-wg: {mode} with BM={bm} BN={bn} needs more than {MAX_ACC} "
                         "accumulators a thread")
    if pipe not in (0, 1) or stages < 2 + pipe:
        raise ValueError(f"igemm-wg: PIPE is 0 or 1 and STAGES >= 2 + PIPE, got PIPE={pipe} "
                         f"STAGES={stages}")
    if smem_bytes(mode, bm, bn, stages) > ig.SMEM_LIMIT:
        raise ValueError(f"igemm-wg: {stages} stages of {bm}x{bn} exceed {ig.SMEM_LIMIT} B of "
                         "shared memory")
    return {"IG_MODE": ig.MODES[mode], "BM": bm, "BN": bn, "STAGES": stages, "PIPE": pipe}


def _variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        sp = space(mode)
        keys = sorted(sp)
        out = []
        for combo in itertools.product(*(sp[k] for k in keys)):
            try:
                out.append(wgmma_defines(mode, dict(zip(keys, combo, strict=True))))
            except ValueError:
                continue
        return out

    return variants


@functools.cache
def wgmma_ruled_out() -> bool:
    """True where the current GPU cannot run sm_90a code (compute capability other than 9.0).
    With no GPU at all nothing runs anyway, and `supports` answers for the shape alone, as
    every other rung's does (the CPU-side listings and plans see the rung)."""
    cp = cupy_or_none()
    return cp is not None and str(cp.cuda.Device().compute_capability) != "90"


def supports(shape: ConvShape) -> bool:
    plane = shape.B * shape.H * shape.W * ig.padded_channels(shape.C)
    return ig.supports(shape) and plane < PLANE_LIMIT and not wgmma_ruled_out()


def tf32_round(a: Any) -> Any:
    """fp32 -> tf32 values, round to nearest with ties away from zero (cvt.rna.tf32.f32),
    on NumPy or CuPy arrays."""
    xp = xp_of(a)
    u = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    return ((u + xp.uint32(0x1000)) & xp.uint32(0xFFFFE000)).view(xp.float32)


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def operand_weights(w: Any, mode: str) -> Any:
    """(M, C, K, K) fp32 -> (planes, M, K, K, Cp) in the operand type: 16-bit casts, TF32
    rounded, or for 3xTF32 the big part then the small one (w = big + small, both TF32)."""
    cp = require_cupy()
    if mode in ("fp16", "bf16"):
        return ig.operand_weights(w, mode)[None]
    full = ig.operand_weights(w, "tf32")  # fp32, channels-last, padded
    big = tf32_round(full)
    if mode == "tf32":
        return big[None]
    return cp.stack([big, tf32_round(full - big)])


def _layout_pass(shape: ConvShape, mode: str, defines: Mapping[str, int]) -> Callable[[Any], Any]:
    """x NCHW fp32 -> the kernel's (planes, B, H, W, Cp) operand buffer."""
    cp = require_cupy()
    cp_ = ig.padded_channels(shape.C)
    dtype = {"fp16": np.float16, "bf16": np.uint16}.get(mode, np.float32)
    buf = cp.empty((planes(mode), shape.B, shape.H, shape.W, cp_), dtype=dtype)
    kernel = get_kernel(FILE, "wg_channels_last", defines)
    grid = (ceil_div(shape.W, LAYOUT_TILE), ceil_div(cp_, LAYOUT_TILE), shape.B * shape.H)
    args = (*(np.int32(v) for v in (shape.C, cp_, shape.H, shape.W)), np.int64(buf[0].size))

    def convert(x: Any) -> Any:
        kernel(grid, (LAYOUT_TILE, 8), (x, buf, *args))
        return buf

    return convert


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        defines = wgmma_defines(mode, params)
        bm, bn = defines["BM"], defines["BN"]
        smem = smem_bytes(mode, bm, bn, defines["STAGES"])
        w_op = operand_weights(w, mode)
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        convert = _layout_pass(shape, mode, defines)
        M, N, _ = ig.gemm_dims(shape)
        kernel = get_kernel(FILE, "igemm_wgmma", defines)
        kernel.max_dynamic_shared_size_bytes = smem
        grid = (ceil_div(N, bn), ceil_div(M, bm))
        x_plane = np.int64(shape.B * shape.H * shape.W * ig.padded_channels(shape.C))
        dims = ig.problem_args(shape)

        def run(x: Any, y: Any) -> None:
            kernel(grid, (THREADS,), (convert(x), w_op, b_d, y, *dims, x_plane),
                   shared_mem=smem)

        return run

    return prepare


for _mode in ("3xtf32", "tf32", "fp16", "bf16"):
    register(ConvImpl(
        name=f"igemm-wg-{_mode}", rung=39, device="gpu", kernel_file=FILE,
        demonstrates=f"implicit GEMM on Hopper's wgmma from swizzled shared memory, operands "
                     f"prepared outside the loop ({ig.WHAT[_mode]})",
        prepare=_prepare(_mode), supports=supports, space=space(_mode),
        defaults=defaults(_mode), compile_variants=_variants(_mode),
        tolerance=TOLERANCE[_mode]))

__all__ = ["operand_weights", "smem_bytes", "tf32_round", "warpgroup_n",
           "wgmma_defines", "wgmma_ruled_out"]
