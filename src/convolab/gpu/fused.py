"""Rung 13 host side: fused conv + bias + ReLU + max-pool (kernels/13_fused_conv_pool.cu).

Pool size is a field of `ConvImpl` (it decides `out_shape`), so one registry entry cannot
serve two pool sizes. Rather than registering a name per imaginable window, a factory
`fused_conv_pool_impl(pool, precision)` builds (and caches) the entry for any pool size;
the ones the zoo needs are registered by name at import:

    fused-conv-pool2, fused-conv-pool4            fp32 FFMA, exact to fp32 rounding
    fused-conv-pool2-tc, fused-conv-pool4-tc      tensor cores (mma.sync), fp16 in, fp32 acc
    fused-conv-pool2-tf32, fused-conv-pool4-tf32  tensor cores, TF32 in, fp32 acc

`pool_impl_for(pool)` is what a layer asks for when it wants "the fused rung for this pool".
Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape

KERNEL_FILE = "13_fused_conv_pool.cu"
_SMEM_LIMIT = 46 * 1024  # static shared memory must stay under 48 KB
# fcp_exact_pipe: dynamic shared memory per block, at most what lets 2 blocks share an SM
# (228 KB per SM, 1 KB of it reserved per block).
_PIPE_SMEM_LIMIT = 113 * 1024
_SM_SMEM_BYTES, _SM_REGS, _SM_THREADS, _SM_BLOCKS = 228 * 1024, 65536, 2048, 32
_ACC_BUDGET = 64  # fp32 accumulators per thread before the register file spills
PRECISIONS = ("fp32", "fp16", "tf32")


def pooled_hw(shape: ConvShape, pool: int) -> tuple[int, int]:
    return shape.H_out // pool, shape.W_out // pool


def supports_pool(shape: ConvShape, pool: int) -> bool:
    hp, wp = pooled_hw(shape, pool)
    return pool >= 1 and hp >= 1 and wp >= 1


# ---------------------------------------------------------------------------------------------
# Exact (fp32 FFMA) kernel: launch geometry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactPlan:
    """Compile-time defines and launch geometry of `fcp_exact` (or `fcp_exact_pipe`)."""

    defines: dict[str, int]
    tiles_w: int
    tiles_h: int
    block: tuple[int, int, int]
    channel_groups: int  # grid.y: blocks along the output channels
    kernel: str = "fcp_exact"
    smem_dynamic: int = 0  # fcp_exact_pipe: bytes of dynamic shared memory per block
    blocks_per_sm: int = 0  # fcp_exact_pipe: persistent blocks per SM; 0 = as many as fit

    @property
    def tiles_per_image(self) -> int:
        return self.tiles_w * self.tiles_h

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _smem_bytes(K: int, S: int, P: int, mb: int, pw: int, tx: int, ty: int, cc: int) -> int:
    """Shared memory of fcp_exact: cc channels of the input tile (ty pooled rows high) and
    their weights for the block's mb output channels."""
    span = (pw * P - 1) * S + K
    span4 = _ceil_div(span, 4) * 4
    in_rows = (ty * P - 1) * S + K
    in_stride = _ceil_div((tx - 1) * pw * P * S + span4, 4) * 4
    return 4 * cc * (in_rows * in_stride + K * K * mb)


def _pipe_smem_bytes(K: int, S: int, P: int, mb: int, pw: int, tx: int, ty: int, c: int,
                     wreg: bool) -> int:
    """Dynamic shared memory of fcp_exact_pipe: two input buffers of c channels (ty pooled
    rows high) plus, unless the weights live in registers, the block's weights."""
    one = _smem_bytes(K, S, P, mb, pw, tx, ty, c) - 4 * c * K * K * mb  # one input buffer
    return 2 * one + (0 if wreg else 4 * c * K * K * mb)


def resident_blocks(num_regs: int, threads: int, smem_bytes: int) -> int:
    """Blocks of one kernel an H100 SM holds at once (registers are allocated per warp in
    units of 256; each block also reserves 1 KB of shared memory)."""
    warps = _ceil_div(threads, 32)
    per_warp = _ceil_div(max(num_regs, 1) * 32, 256) * 256
    by_regs = (_SM_REGS // per_warp) // warps
    by_smem = _SM_SMEM_BYTES // (smem_bytes + 1024)
    return max(0, min(by_regs, by_smem, _SM_THREADS // (warps * 32), _SM_BLOCKS))


def _block_waste(hp: int, wp: int, pw: int, tx: int, ty: int) -> float:
    """Idle fraction of a launch: partial tiles on each axis and partial warps, multiplied."""
    rows = _ceil_div(hp, ty) * ty / hp
    cols = _ceil_div(wp, tx * pw) * tx * pw / wp
    threads = tx * ty
    return rows * cols * (_ceil_div(threads, 32) * 32 / threads)


def exact_plan(shape: ConvShape, pool: int, params: Mapping[str, Any]) -> ExactPlan | None:
    """The tiling for `fcp_exact`, or None where only `fcp_simple` can do it (huge P or K).

    params may fix mt (channels per thread), pw (pooled columns per thread), tx, ty
    (threads per tile axis), mg (channel groups per block), rpt (tile rows a block walks
    through), minb (blocks per SM the registers must allow); 0 means choose.
    Persistent double-buffered `fcp_exact_pipe` (single-chunk tiles only, else fcp_exact):
    pipe (1 on, -1 off, 0 choose), bps (persistent blocks per SM, 0 = as many as fit),
    wreg (1: weights in registers, taken where C*mt*K*K <= 64).
    `fcp_exact_cw` (weights as a by-value kernel parameter, read from the constant bank):
    cw (1 on, -1 off, 0 choose), where `cw_fits` (all M channels in one thread, C*K*K*mt
    floats within the 4 KB parameter space).
    """
    params = _with_measured_defaults(shape, pool, params)
    K, S, P, M = shape.K, shape.S, pool, shape.M
    hp, wp = pooled_hw(shape, P)
    if P > 8 or K > 15:
        return None
    mt = int(params.get("mt") or (4 if M >= 3 else M))
    if mt * P * P > 2 * _ACC_BUDGET:
        mt = 1
    pws = [int(params["pw"])] if params.get("pw") else [
        v for v in (1, 2, 4, 8) if v == 1 or mt * P * P * v <= _ACC_BUDGET
    ]
    best: tuple[float, int, int, int, int] | None = None  # (waste, -pw, -threads, tx, ty)
    for pw in pws:
        tx = int(params.get("tx") or min(_ceil_div(wp, pw), 32))
        ty_choices = [int(params["ty"])] if params.get("ty") else range(1, min(hp, 256 // tx) + 1)
        for ty in ty_choices:
            if tx * ty < 32 and not (params.get("tx") or params.get("ty")) and hp * wp >= 32:
                continue
            if _smem_bytes(K, S, P, mt, pw, tx, ty, 1) > _SMEM_LIMIT:
                continue
            key = (round(_block_waste(hp, wp, pw, tx, ty), 6), -pw, -(tx * ty), tx, ty)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    pw, tx, ty = -best[1], best[3], best[4]
    groups = _ceil_div(M, mt)
    mg = int(params.get("mg") or max(1, min(groups, 256 // (tx * ty))))
    while mg > 1 and _smem_bytes(K, S, P, mt * mg, pw, tx, ty, 1) > _SMEM_LIMIT:
        mg -= 1
    per_channel = _smem_bytes(K, S, P, mt * mg, pw, tx, ty, 1)
    cc = max(1, min(shape.C, 16, _SMEM_LIMIT // per_channel))
    if int(params.get("cw") or 0) > 0 and cc >= shape.C and cw_fits(shape, mt):
        return _cw_plan(shape, pool, params, mt, pw, tx, ty)
    pipe = cc >= shape.C and _use_pipe(shape, pool, int(params.get("pipe") or 0))
    wreg = pipe and bool(params.get("wreg")) and shape.C * mt * K * K <= _WREG_BUDGET

    def fits(rows: int) -> bool:
        if pipe:
            return _pipe_smem_bytes(K, S, P, mt * mg, pw, tx, rows, shape.C,
                                    wreg) <= _PIPE_SMEM_LIMIT
        return _smem_bytes(K, S, P, mt * mg, pw, tx, rows, shape.C) <= _SMEM_LIMIT

    rpt = 1
    if cc >= shape.C:  # the whole input fits: let a block walk down more rows of the image
        want = int(params.get("rpt") or _ceil_div(hp, ty))
        while rpt < want and fits(ty * (rpt + 1)):
            rpt += 1
    threads = tx * ty * mg
    if pipe:
        return _pipe_plan(shape, pool, params, mt, pw, tx, ty, mg, rpt, wreg)
    # Register cap ~168: measured on H100, conv2 at 128 registers spills and runs 5% slower
    # than at 168 with half the resident warps (docs/fused.md).
    minb = int(params.get("minb") or max(1, min(16, (65536 // 168) // threads)))
    defines = {
        "FCP_K": K, "FCP_S": S, "FCP_P": P, "FCP_MT": mt, "FCP_PW": pw,
        "FCP_TX": tx, "FCP_TY": ty, "FCP_CC": cc, "FCP_MINB": minb, "FCP_MG": mg,
        "FCP_RPT": rpt, "FCP_KERNEL": 1,
    }
    return ExactPlan(defines, _ceil_div(wp, tx * pw), _ceil_div(hp, ty * rpt), (tx, ty, mg),
                     _ceil_div(M, mt * mg))


_CW_BYTES = 3900  # kernel parameters are limited to 4 KB; the rest of fcp_exact_cw's < 100 B


def cw_fits(shape: ConvShape, mt: int) -> bool:
    """fcp_exact_cw needs every weight index to be a compile-time constant: all M output
    channels in one thread's tile, and C*K*K*mt floats within the parameter space."""
    return mt >= shape.M and 4 * shape.C * shape.K * shape.K * mt <= _CW_BYTES and shape.C <= 16


def _cw_plan(shape: ConvShape, pool: int, params: Mapping[str, Any], mt: int, pw: int,
             tx: int, ty: int) -> ExactPlan | None:
    """fcp_exact_cw: fcp_exact's tile (one channel group), whole image rows per block."""
    K, S, P, C = shape.K, shape.S, pool, shape.C
    hp, wp = pooled_hw(shape, P)
    rpt = 1
    want = int(params.get("rpt") or _ceil_div(hp, ty))
    while rpt < want and _smem_bytes(K, S, P, 0, pw, tx, ty * (rpt + 1), C) <= _SMEM_LIMIT:
        rpt += 1
    # Registers: the weights are constant-bank operands, so a thread needs its accumulators,
    # one input row and addresses (conv1: 64); minb only caps, it does not force.
    minb = int(params.get("minb") or max(1, min(16, (65536 // 96) // (tx * ty))))
    defines = {
        "FCP_K": K, "FCP_S": S, "FCP_P": P, "FCP_MT": mt, "FCP_PW": pw,
        "FCP_TX": tx, "FCP_TY": ty, "FCP_CC": C, "FCP_MINB": minb, "FCP_MG": 1,
        "FCP_RPT": rpt, "FCP_KERNEL": 6,
    }
    return ExactPlan(defines, _ceil_div(wp, tx * pw), _ceil_div(hp, ty * rpt), (tx, ty, 1),
                     1, "fcp_exact_cw")


def cw_weights(w: np.ndarray, C: int, K: int, mt: int) -> np.ndarray:
    """Weights (M, C, K, K) as fcp_exact_cw's by-value struct {float w[C][K*K][mt]}: a
    one-element NumPy structured array, which CuPy passes to the kernel by value."""
    M = w.shape[0]
    packed = np.zeros((C, K * K, mt), np.float32)
    packed[:, :, :M] = np.asarray(w, np.float32).reshape(M, C, K * K).transpose(1, 2, 0)
    struct = np.dtype({"names": ["w"], "formats": [(np.float32, (C, K * K, mt))]})
    return packed.ravel().view(struct)


# fcp_exact_pipe holds the thread's weights in registers (wreg) only up to this many.
_WREG_BUDGET = 64
# The pipe with the weights in registers: one channel per thread (K*K registers), 8 conv
# columns x 2 rows per thread, up to 4 channels as threadIdx.z, 8 pooled rows per tile row.
PIPE_WREG_TILE: dict[str, int] = {"pipe": 1, "wreg": 1, "mt": 1, "pw": 4, "ty": 8}

# What pipe = 0 picks, by measurement (H100, B = 10000, CUDA events, median of 30, two runs:
# benchmarks/results/pipe_h100_2026-11-23.json and ..._run2.json), Op Time in ms:
#   conv1 (C=1, K=7, pool 2)  fcp_exact 0.696 / 0.695; the pipe with fcp_exact's tile
#       (4 channels x 4 columns per thread, weights in shared memory) 0.82-1.04 for every
#       RPT / blocks-per-SM tried (double buffers cost a block per SM or registers; the
#       staging bubble was not conv1's loss); pipe + weights in registers, 1 channel x 8
#       columns, 320 threads, 2 blocks/SM: 0.670 / 0.688 (1-4 %, spread 2-3 %)
#       -> PIPE_WREG_TILE wherever C*K*K fits the register budget
#   conv2 (C=4, K=7, pool 4)  fcp_exact 1.449 / 1.468; pipe (same tile, one 8-warp block
#       per SM, so every staging bubble was exposed) 1.397 / 1.415 (-3.6 %)
#       -> the pipe for the other single-chunk shapes. (Half-image tiles at 2 blocks/SM,
#       {"pipe": 1, "ty": 4, "rpt": 1, "bps": 2}: 1.387 / 1.403, reachable by the tuner.)
# Multi-chunk shapes (C channels do not fit one buffer) always run fcp_exact.


def _with_measured_defaults(shape: ConvShape, pool: int,
                            params: Mapping[str, Any]) -> Mapping[str, Any]:
    """params with pipe = 0 resolved to the measured choice above; an explicit pipe (1 or
    -1) or explicit tiling parameters are left alone."""
    if params.get("pipe") or params.get("cw"):
        return params
    tiled = any(params.get(k) for k in ("mt", "pw", "mg", "tx", "ty"))
    wreg_fits = (shape.C * shape.K * shape.K <= _WREG_BUDGET
                 and pool * pool * PIPE_WREG_TILE["pw"] <= _ACC_BUDGET)
    if not tiled and cw_fits(shape, 4 if shape.M >= 3 else shape.M):
        choice: dict[str, int] = {"cw": 1}
    elif wreg_fits and not tiled:
        choice = {**PIPE_WREG_TILE, "mg": min(4, shape.M)}
    else:
        choice = {"pipe": 1}
    return {**choice, **{k: v for k, v in params.items() if v}}


def _use_pipe(shape: ConvShape, pool: int, pipe: int) -> bool:
    """pipe 1 / -1 force fcp_exact_pipe / fcp_exact (for single-chunk tiles)."""
    return pipe > 0


def _pipe_plan(shape: ConvShape, pool: int, params: Mapping[str, Any], mt: int, pw: int,
               tx: int, ty: int, mg: int, rpt: int, wreg: bool) -> ExactPlan:
    """fcp_exact_pipe for a single-chunk tiling (all C channels of a tile in one buffer)."""
    K, S, P, C = shape.K, shape.S, pool, shape.C
    hp, wp = pooled_hw(shape, P)
    threads = tx * ty * mg
    smem = _pipe_smem_bytes(K, S, P, mt * mg, pw, tx, ty * rpt, C, wreg)
    fit = resident_blocks(1, threads, smem)  # what shared memory alone allows
    bps = int(params.get("bps") or 0)
    # Registers a thread needs, fitted to what compiled without spills: conv1's tile (32
    # accumulators) in 95 at 4 blocks of 160 threads; conv2's (64) spills at 128 and uses
    # ~190 uncapped; conv1 with register weights (16 accumulators + 49 weights) in 96.
    acc = mt * P * P * pw
    need = 2 * acc + C * mt * K * K + 16 if wreg else 32 + 2 * acc
    minb = int(params.get("minb") or bps or max(1, min(fit, _SM_REGS // (threads * need), 16)))
    defines = {
        "FCP_K": K, "FCP_S": S, "FCP_P": P, "FCP_MT": mt, "FCP_PW": pw,
        "FCP_TX": tx, "FCP_TY": ty, "FCP_CC": C, "FCP_MINB": minb, "FCP_MG": mg,
        "FCP_RPT": rpt, "FCP_WREG": int(wreg), "FCP_KERNEL": 5,
    }
    return ExactPlan(defines, _ceil_div(wp, tx * pw), _ceil_div(hp, ty * rpt), (tx, ty, mg),
                     _ceil_div(shape.M, mt * mg), "fcp_exact_pipe", smem, bps)


def _as_device_f32(cp: Any, a: Any) -> Any:
    return cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32))


def _prepare_exact(pool: int):
    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        from convolab.backend import require_cupy
        from convolab.gpu.compile import get_kernel

        cp = require_cupy()
        w_d, b_d = _as_device_f32(cp, w), _as_device_f32(cp, b)
        hp, wp = pooled_hw(shape, pool)
        i32 = np.int32
        plan = exact_plan(shape, pool, params)
        if plan is None:
            kernel = get_kernel(KERNEL_FILE, "fcp_simple", {"FCP_KERNEL": 2})
            total = shape.B * shape.M * hp * wp
            grid = min(_ceil_div(total, 256), 65535 * 32)

            def run_simple(x: Any, y: Any) -> None:
                kernel((grid,), (256,), (x, w_d, b_d, y, np.int64(total), i32(shape.C),
                       i32(shape.H), i32(shape.W), i32(shape.M), i32(shape.K), i32(shape.S),
                       i32(pool), i32(hp), i32(wp)))

            return run_simple

        kernel = get_kernel(KERNEL_FILE, plan.kernel, plan.defines)
        args_tail = (i32(shape.C), i32(shape.H), i32(shape.W), i32(shape.M), i32(hp), i32(wp),
                     i32(plan.tiles_w), i32(plan.tiles_per_image))
        if plan.kernel == "fcp_exact_pipe":
            return _pipe_run(cp, kernel, plan, shape.B, (w_d, b_d), args_tail)
        grid = (shape.B * plan.tiles_per_image, plan.channel_groups)
        if plan.kernel == "fcp_exact_cw":
            from convolab.backend import to_numpy

            w_arg = cw_weights(to_numpy(w), shape.C, shape.K, plan.defines["FCP_MT"])

            def run_cw(x: Any, y: Any) -> None:
                kernel(grid, plan.block, (x, w_arg, b_d, y, *args_tail))

            return run_cw

        def run(x: Any, y: Any) -> None:
            kernel(grid, plan.block, (x, w_d, b_d, y, *args_tail))

        return run

    return prepare


def pipe_occupancy(kernel: Any, plan: ExactPlan) -> int:
    """Blocks of the compiled pipe kernel one SM holds (the driver's answer where CuPy
    exposes it, else computed from its register count)."""
    try:
        from cupy_backends.cuda.api import driver

        return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, plan.threads, plan.smem_dynamic))
    except (ImportError, AttributeError):
        return resident_blocks(int(kernel.num_regs), plan.threads, plan.smem_dynamic)


def _pipe_run(cp: Any, kernel: Any, plan: ExactPlan, batch: int, wb: tuple[Any, Any],
              args_tail: tuple[Any, ...]) -> Run:
    if plan.smem_dynamic > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = plan.smem_dynamic
    kernel.preferred_shared_memory_carveout = 100  # all of L1 as shared memory: 2-3 blocks
    tasks = batch * plan.tiles_per_image
    bps = plan.blocks_per_sm or max(1, pipe_occupancy(kernel, plan))
    n_sm = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    grid = (max(1, min(tasks, n_sm * bps)), plan.channel_groups)
    w_d, b_d = wb
    tail = (*args_tail, np.int32(tasks))

    def run(x: Any, y: Any) -> None:
        kernel(grid, plan.block, (x, w_d, b_d, y, *tail), shared_mem=plan.smem_dynamic)

    run.grid = grid  # type: ignore[attr-defined]  # for tests and benchmarks
    return run


def _exact_variants() -> list[dict[str, int]]:
    """The define sets the zoo's layers compile with (CI's nvcc check builds each)."""
    from convolab.shapes import ConvShape as S

    out: list[dict[str, int]] = []
    conv1, conv2 = (S(1, 1, 86, 86, 4, 7), 2), (S(1, 4, 40, 40, 16, 7), 4)
    layers = [conv1, conv2, (S(1, 1, 70, 70, 12, 5), 2), (S(1, 12, 33, 33, 24, 5), 2)]
    jobs = [(layer, {"pipe": pipe}) for layer in layers for pipe in (-1, 1)]
    jobs += [(layer, {}) for layer in layers]  # the measured defaults (pipe = 0)
    jobs += [(conv1, {"pipe": 1, "rpt": 1}), (conv1, {**PIPE_WREG_TILE, "mg": 4, "pw": 8})]
    jobs += [(conv1, {"cw": 1}), (conv1, {"cw": 1, "ty": 4})]
    for (shape, pool), params in jobs:
        plan = exact_plan(shape, pool, params)
        if plan is not None and plan.defines not in out:
            out.append(plan.defines)
    return out


# ---------------------------------------------------------------------------------------------
# Tensor-core kernels (mma.sync): see the comment block in the .cu file for the mappings
# ---------------------------------------------------------------------------------------------

# TF32 keeps 10 mantissa bits on both operands, like fp16: on 49-196-term sums with mixed-sign
# weights the measured rel-L2 error is 2e-4 to 5e-4 (NumPy replay, 40 seeds), so the SPEC's
# generic 5e-4 would fail a few percent of fresh random draws; the rung promises 1e-3.
TC_TOLERANCE = {"fp16": 1e-2, "tf32": 1e-3}


def tc_kind(shape: ConvShape, pool: int) -> str | None:
    """Which tensor-core mapping fits: 'toeplitz' (few output channels, e.g. conv1),
    'wa' (weights as the 16-row A operand, e.g. conv2), or None."""
    if shape.S != 1 or not supports_pool(shape, pool):
        return None
    if pool == 2 and shape.M <= 4 and shape.C * shape.K <= 8 and shape.K <= 9:
        return "toeplitz"
    if pool in (2, 4) and shape.M <= 16 and shape.K <= 8 and shape.C * shape.K <= 32:
        return "wa"
    return None


def _f16_bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)


def _pack_half2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two fp16 values in one 32-bit register: the lower k index in the low half (PTX order)."""
    return _f16_bits(lo) | (_f16_bits(hi) << np.uint32(16))


def _tf32_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> tf32 rounded to nearest, ties away from zero (what cvt.rna.tf32.f32 does)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)


_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4


def wa_fragments(w: np.ndarray, precision: str) -> np.ndarray:
    """Weights as the mma A operand (16 channels x k), in per-lane register order.

    k runs over filter rows r = (c, p), each padded to 8 taps; fp16 steps take two rows.
    Returns uint32 (steps, 32 lanes, 4 registers)."""
    M, C, K, _ = w.shape
    rows = C * K
    rows_pad = rows + (rows % 2) if precision == "fp16" else rows
    wp = np.zeros((16, rows_pad, 8), np.float32)
    wp[:M, :rows, :K] = w.reshape(M, rows, K)
    if precision == "fp16":
        s = np.arange(rows_pad // 2)[:, None]
        g, t = _G[None, :], _T[None, :]
        regs = [
            _pack_half2(wp[g, 2 * s, 2 * t], wp[g, 2 * s, 2 * t + 1]),
            _pack_half2(wp[g + 8, 2 * s, 2 * t], wp[g + 8, 2 * s, 2 * t + 1]),
            _pack_half2(wp[g, 2 * s + 1, 2 * t], wp[g, 2 * s + 1, 2 * t + 1]),
            _pack_half2(wp[g + 8, 2 * s + 1, 2 * t], wp[g + 8, 2 * s + 1, 2 * t + 1]),
        ]
    else:
        s = np.arange(rows)[:, None]
        g, t = _G[None, :], _T[None, :]
        regs = [_tf32_bits(wp[g, s, t]), _tf32_bits(wp[g + 8, s, t]),
                _tf32_bits(wp[g, s, t + 4]), _tf32_bits(wp[g + 8, s, t + 4])]
    return np.ascontiguousarray(np.stack(regs, axis=-1).astype(np.uint32))


def toeplitz_fragments(w: np.ndarray, precision: str) -> np.ndarray:
    """Banded weights T[r][j][m][dx] = w[m, c, p, j - dx] as the mma B operand, per lane.

    Returns uint32 (rows, ksteps, M, 32 lanes, 2 registers)."""
    M, C, K, _ = w.shape
    rows = C * K
    wr = w.reshape(M, rows, K).astype(np.float32)
    band = np.zeros((rows, 16, M, 8), np.float32)
    for dx in range(8):
        for q in range(K):
            band[:, dx + q, :, dx] = wr[:, :, q].T
    g, t = _G[None, None, :], _T[None, None, :]
    r = np.arange(rows)[:, None, None]
    m = np.arange(M)[None, :, None]
    if precision == "fp16":
        b0 = _pack_half2(band[r, 2 * t, m, g], band[r, 2 * t + 1, m, g])
        b1 = _pack_half2(band[r, 2 * t + 8, m, g], band[r, 2 * t + 9, m, g])
        out = np.stack([b0, b1], axis=-1)[:, None]
    else:
        halves = []
        for h in range(2):
            b0 = _tf32_bits(band[r, 8 * h + t, m, g])
            b1 = _tf32_bits(band[r, 8 * h + t + 4, m, g])
            halves.append(np.stack([b0, b1], axis=-1))
        out = np.stack(halves, axis=1)
    return np.ascontiguousarray(out.astype(np.uint32))


def _best_warps(units: int) -> int:
    """Warps per block that split `units` work items most evenly (ties: the first listed)."""
    return max((4, 5, 3, 2, 6, 8, 1), key=lambda w: units / (_ceil_div(units, w) * w))


@dataclass(frozen=True)
class TcPlan:
    """Kernel name, compile-time defines and launch geometry of a tensor-core variant."""

    kernel: str  # fcp_mma_toe or fcp_mma_wa
    defines: dict[str, int]
    tiles_w: int
    tiles_h: int
    warps: int


def tc_plan(shape: ConvShape, pool: int, precision: str,
            params: Mapping[str, Any] | None = None) -> TcPlan:
    """params may fix warps (per block) and minb (blocks per SM the registers must allow)."""
    params = params or {}
    kind = tc_kind(shape, pool)
    if kind is None:
        raise ValueError(
            f"fused-conv-pool tensor-core kernels do not support {shape} with pool {pool}"
        )
    hp, wp = pooled_hw(shape, pool)
    prec = 0 if precision == "fp16" else 1
    elem = 2 if precision == "fp16" else 4
    if kind == "toeplitz":
        tph = min(hp, 20)  # enough m-tiles per block to amortise staging the input
        ng = _ceil_div(2 * wp, 8)

        def toe_smem(tph: int) -> int:
            return shape.C * ((2 * tph - 1) + shape.K) * (ng * 8 + 8) * elem

        while tph > 1 and toe_smem(tph) > _SMEM_LIMIT:
            tph //= 2
        # 2 warps per block measured fastest for conv1 on H100 (0.32 vs 0.38 ms with 5)
        warps = int(params.get("warps") or min(2, _ceil_div(tph * ng, 8)))
        defines = {"TC_PREC": prec, "TC_C": shape.C, "TC_K": shape.K, "TC_P": 2,
                   "TC_M": shape.M, "TC_TPH": tph, "TC_TPW": wp, "TC_WARPS": warps,
                   "TC_MINB": int(params.get("minb") or 1), "FCP_KERNEL": 3}
        return TcPlan("fcp_mma_toe", defines, 1, _ceil_div(hp, tph), warps)

    tph, tpw = min(hp, 8), min(wp, 8)
    copies = 2 if precision == "fp16" else 1

    def wa_smem(tph: int, tpw: int) -> int:
        rs = _ceil_div(tpw * pool - 1 + 8, 2) * 2 + 2
        return copies * shape.C * (tph * pool - 1 + shape.K) * rs * elem

    while wa_smem(tph, tpw) > _SMEM_LIMIT and max(tph, tpw) > 1:
        if tph >= tpw:
            tph = max(1, tph // 2)
        else:
            tpw = max(1, tpw // 2)
    units = tph * tpw if pool == 4 else _ceil_div(tph * tpw, 2)
    warps = int(params.get("warps") or _best_warps(units))
    # fp16: capping registers at 128 (4 blocks of 4 warps) measured 5% faster on conv2
    minb = int(params.get("minb") or (max(1, 512 // (warps * 32)) if prec == 0 else 1))
    defines = {"TC_PREC": prec, "TC_C": shape.C, "TC_K": shape.K, "TC_P": pool,
               "TC_M": 16, "TC_TPH": tph, "TC_TPW": tpw, "TC_WARPS": warps,
               "TC_MINB": minb, "FCP_KERNEL": 4}
    return TcPlan("fcp_mma_wa", defines, _ceil_div(wp, tpw), _ceil_div(hp, tph), warps)


def _prepare_tc(pool: int, precision: str):
    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        from convolab.backend import require_cupy, to_numpy
        from convolab.gpu.compile import get_kernel

        cp = require_cupy()
        plan = tc_plan(shape, pool, precision, params)
        w_h = np.asarray(to_numpy(w), np.float32)
        b_d = _as_device_f32(cp, b)
        hp, wp = pooled_hw(shape, pool)
        i32 = np.int32
        kernel = get_kernel(KERNEL_FILE, plan.kernel, plan.defines)
        block = (plan.warps * 32,)
        if plan.kernel == "fcp_mma_toe":
            frag = cp.asarray(toeplitz_fragments(w_h, precision))
            grid = (shape.B * plan.tiles_h,)
            tail = (i32(shape.H), i32(shape.W), i32(hp), i32(wp), i32(plan.tiles_h))
        else:
            frag = cp.asarray(wa_fragments(w_h, precision))
            tiles = plan.tiles_w * plan.tiles_h
            grid = (shape.B * tiles,)
            tail = (i32(shape.M), i32(shape.H), i32(shape.W), i32(hp), i32(wp),
                    i32(plan.tiles_w), i32(tiles))

        def run(x: Any, y: Any) -> None:
            kernel(grid, block, (x, frag, b_d, y, *tail))

        return run

    return prepare


def _tc_variants() -> list[dict[str, int]]:
    from convolab.shapes import ConvShape as S

    return [tc_plan(shape, pool, prec).defines
            for shape, pool in ((S(1, 1, 86, 86, 4, 7), 2), (S(1, 4, 40, 40, 16, 7), 4))
            for prec in ("fp16", "tf32")]


# ---------------------------------------------------------------------------------------------
# Registry entries
# ---------------------------------------------------------------------------------------------

_EXACT_SPACE: Mapping[str, list[int]] = {
    "mt": [1, 2, 4, 8],
    "pw": [1, 2, 4],
    "ty": [4, 8, 16],
    "mg": [1, 2, 4],
    "rpt": [1, 2, 5],
    "minb": [1, 2, 4, 6, 8],
    "pipe": [-1, 1],  # fcp_exact / fcp_exact_pipe (0 = _with_measured_defaults)
    "bps": [0, 2, 3, 4],  # pipe: persistent blocks per SM (0 = as many as fit)
    "wreg": [0, 1],  # pipe: weights in registers (with mt=1)
    "cw": [-1, 1],  # fcp_exact_cw: weights as a by-value kernel parameter (constant bank)
}


@functools.cache
def fused_conv_pool_impl(pool: int, precision: str = "fp32") -> ConvImpl:
    """The rung-13 implementation for a pool window `pool` (stride = window, floor)."""
    if not isinstance(pool, int) or pool < 1:
        raise ValueError(f"pool must be a positive int, got {pool!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return ConvImpl(
            name=f"fused-conv-pool{pool}",
            demonstrates=(
                f"conv + bias + ReLU + max-pool {pool}x{pool} in one kernel: pool windows kept "
                "in registers, only pooled values written; register-tiled FFMA"
            ),
            device="gpu",
            prepare=_prepare_exact(pool),
            supports=lambda s: supports_pool(s, pool),
            space=_EXACT_SPACE,
            defaults={"mt": 0, "pw": 0, "tx": 0, "ty": 0, "mg": 0, "rpt": 0, "minb": 0,
                      "pipe": 0, "bps": 0, "wreg": 0, "cw": 0},
            tolerance=1e-5,
            rung=13,
            kernel_file=KERNEL_FILE,
            compile_variants=_exact_variants,
            pool=pool,
        )
    suffix = "tc" if precision == "fp16" else precision
    return ConvImpl(
        name=f"fused-conv-pool{pool}-{suffix}",
        demonstrates=(
            f"fused conv + ReLU + max-pool {pool} on tensor cores (mma.sync, {precision} "
            "inputs, fp32 accumulate); pooling done on the accumulator fragments"
        ),
        device="gpu",
        prepare=_prepare_tc(pool, precision),
        supports=lambda s: tc_kind(s, pool) is not None,
        space={"warps": [2, 4, 5, 8], "minb": [1, 2, 3, 4]},
        defaults={"warps": 0, "minb": 0},
        tolerance=TC_TOLERANCE[precision],
        rung=13,
        kernel_file=KERNEL_FILE,
        compile_variants=_tc_variants,
        pool=pool,
    )


def pool_impl_for(pool: int, precision: str = "fp32") -> ConvImpl:
    return fused_conv_pool_impl(pool, precision)


for _pool in (2, 4):
    for _precision in PRECISIONS:
        register(fused_conv_pool_impl(_pool, _precision))
