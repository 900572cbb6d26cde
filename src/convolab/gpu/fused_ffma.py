"""Host side of the FFMA fused conv + bias + ReLU + max-pool kernels (rungs 13, 15, 16):

    fcp_exact       kernels/13_fused_conv_pool.cu                 register tiles, shared weights
    fcp_simple      kernels/13_fused_conv_pool.cu                 fallback: P > 8 or K > 15
    fcp_exact_pipe  kernels/15_fused_conv_pool_pipelined.cu       persistent, double-buffered
    fcp_exact_cw    kernels/16_fused_conv_pool_const_weights.cu   weights as a kernel parameter

`exact_plan` picks the kernel, its defines and its launch geometry; `prepare_exact` returns
the registry's run(x, y). Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.gpu.device import (
    SM_REGISTERS,
    SMEM_DYNAMIC_TWO_BLOCKS,
    SMEM_NO_OPT_IN,
    SMEM_STATIC_LIMIT,
    occupancy,
    resident_blocks,
)
from convolab.registry import Run
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILES: dict[str, str] = {
    "fcp_exact": "13_fused_conv_pool.cu",
    "fcp_simple": "13_fused_conv_pool.cu",
    "fcp_exact_pipe": "15_fused_conv_pool_pipelined.cu",
    "fcp_exact_cw": "16_fused_conv_pool_const_weights.cu",
}
KERNEL_FILE = KERNEL_FILES["fcp_exact"]
ACC_BUDGET = 64  # fp32 accumulators per thread before the register file spills
WREG_BUDGET = 64  # fcp_exact_pipe holds the thread's weights in registers up to this many
CW_BYTES = 3900  # kernel parameters are limited to 4 KB; the rest of fcp_exact_cw's < 100 B
# The pipe with the weights in registers: one channel per thread (K*K registers), 8 conv
# columns x 2 rows per thread, up to 4 channels as threadIdx.z, 8 pooled rows per tile row.
PIPE_WREG_TILE: dict[str, int] = {"pipe": 1, "wreg": 1, "mt": 1, "pw": 4, "ty": 8}


def pooled_hw(shape: ConvShape, pool: int) -> tuple[int, int]:
    return shape.H_out // pool, shape.W_out // pool


def supports_pool(shape: ConvShape, pool: int) -> bool:
    hp, wp = pooled_hw(shape, pool)
    return pool >= 1 and hp >= 1 and wp >= 1


@dataclass(frozen=True)
class ExactPlan:
    """Kernel, compile-time defines and launch geometry of an FFMA fused kernel."""

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

    @property
    def kernel_file(self) -> str:
        return KERNEL_FILES[self.kernel]


@dataclass(frozen=True)
class _Tile:
    """A thread tile: mt channels x pw pooled columns; tx x ty threads; mg channel groups."""

    mt: int
    pw: int
    tx: int
    ty: int
    mg: int = 1


# ---- shared memory ----------------------------------------------------------------------------


def smem_bytes(K: int, S: int, P: int, mb: int, pw: int, tx: int, ty: int, cc: int) -> int:
    """Shared memory of fcp_exact: cc channels of the input tile (ty pooled rows high) and
    their weights for the block's mb output channels."""
    span = (pw * P - 1) * S + K
    span4 = ceil_div(span, 4) * 4
    in_rows = (ty * P - 1) * S + K
    in_stride = ceil_div((tx - 1) * pw * P * S + span4, 4) * 4
    return 4 * cc * (in_rows * in_stride + K * K * mb)


def pipe_smem_bytes(K: int, S: int, P: int, mb: int, pw: int, tx: int, ty: int, c: int,
                    wreg: bool) -> int:
    """Dynamic shared memory of fcp_exact_pipe: two input buffers of c channels (ty pooled
    rows high) plus, unless the weights live in registers, the block's weights."""
    one = smem_bytes(K, S, P, mb, pw, tx, ty, c) - 4 * c * K * K * mb  # one input buffer
    return 2 * one + (0 if wreg else 4 * c * K * K * mb)


# ---- the planner ------------------------------------------------------------------------------


def exact_plan(shape: ConvShape, pool: int, params: Mapping[str, Any]) -> ExactPlan | None:
    """The tiling for the FFMA kernels, or None where only `fcp_simple` can do it (huge P, K).

    params may fix mt (channels per thread), pw (pooled columns per thread), tx, ty
    (threads per tile axis), mg (channel groups per block), rpt (tile rows a block walks
    through), minb (blocks per SM the registers must allow); 0 means choose.
    Persistent double-buffered `fcp_exact_pipe` (single-chunk tiles only, else fcp_exact):
    pipe (1 on, -1 off, 0 choose), bps (persistent blocks per SM, 0 = as many as fit),
    wreg (1: weights in registers, taken where C*mt*K*K <= WREG_BUDGET).
    `fcp_exact_cw` (weights as a by-value kernel parameter, read from the constant bank):
    cw (1 on, -1 off, 0 choose), where `cw_fits`.
    """
    params = with_measured_defaults(shape, pool, params)
    if pool > 8 or shape.K > 15:
        return None
    mt = _channels_per_thread(shape, pool, params)
    tile = _tile_search(shape, pool, params, mt)
    if tile is None:
        return None
    tile = _channel_grouping(shape, pool, params, tile)
    cc = _chunk_channels(shape, pool, tile)
    if int(params.get("cw") or 0) > 0 and cc >= shape.C and cw_fits(shape, mt):
        return _cw_plan(shape, pool, params, tile)
    pipe = cc >= shape.C and int(params.get("pipe") or 0) > 0
    wreg = pipe and bool(params.get("wreg")) and shape.C * mt * shape.K * shape.K <= WREG_BUDGET
    rpt = _rows_per_block(shape, pool, params, tile, cc, pipe, wreg)
    if pipe:
        return _pipe_plan(shape, pool, params, tile, rpt, wreg)
    return _fcp_exact_plan(shape, pool, params, tile, cc, rpt)


def _channels_per_thread(shape: ConvShape, pool: int, params: Mapping[str, Any]) -> int:
    mt = int(params.get("mt") or (4 if shape.M >= 3 else shape.M))
    return 1 if mt * pool * pool > 2 * ACC_BUDGET else mt


def _tile_search(shape: ConvShape, pool: int, params: Mapping[str, Any],
                 mt: int) -> _Tile | None:
    """The (pw, tx, ty) with the least idle fraction (ties: more columns a thread, more
    threads) whose one-channel tile fits static shared memory."""
    K, S, P = shape.K, shape.S, pool
    hp, wp = pooled_hw(shape, P)
    pws = [int(params["pw"])] if params.get("pw") else [
        v for v in (1, 2, 4, 8) if v == 1 or mt * P * P * v <= ACC_BUDGET
    ]
    fixed = bool(params.get("tx") or params.get("ty"))
    best: tuple[float, int, int, int, int] | None = None  # (waste, -pw, -threads, tx, ty)
    for pw in pws:
        tx = int(params.get("tx") or min(ceil_div(wp, pw), 32))
        ty_choices = [int(params["ty"])] if params.get("ty") else range(1, min(hp, 256 // tx) + 1)
        for ty in ty_choices:
            if tx * ty < 32 and not fixed and hp * wp >= 32:
                continue
            if smem_bytes(K, S, P, mt, pw, tx, ty, 1) > SMEM_STATIC_LIMIT:
                continue
            key = (round(_block_waste(hp, wp, pw, tx, ty), 6), -pw, -(tx * ty), tx, ty)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    return _Tile(mt, -best[1], best[3], best[4])


def _block_waste(hp: int, wp: int, pw: int, tx: int, ty: int) -> float:
    """Idle fraction of a launch: partial tiles on each axis and partial warps, multiplied."""
    rows = ceil_div(hp, ty) * ty / hp
    cols = ceil_div(wp, tx * pw) * tx * pw / wp
    threads = tx * ty
    return rows * cols * (ceil_div(threads, 32) * 32 / threads)


def _channel_grouping(shape: ConvShape, pool: int, params: Mapping[str, Any],
                      tile: _Tile) -> _Tile:
    """mg channel groups per block (they share one staged input tile), within shared memory."""
    groups = ceil_div(shape.M, tile.mt)
    mg = int(params.get("mg") or max(1, min(groups, 256 // (tile.tx * tile.ty))))
    while mg > 1 and _tile_smem(shape, pool, tile, mg, tile.ty, 1) > SMEM_STATIC_LIMIT:
        mg -= 1
    return _Tile(tile.mt, tile.pw, tile.tx, tile.ty, mg)


def _tile_smem(shape: ConvShape, pool: int, tile: _Tile, mg: int, rows: int, c: int) -> int:
    return smem_bytes(shape.K, shape.S, pool, tile.mt * mg, tile.pw, tile.tx, rows, c)


def _chunk_channels(shape: ConvShape, pool: int, tile: _Tile) -> int:
    """Input channels staged per pass (all C where they fit: a single-chunk tile)."""
    per_channel = _tile_smem(shape, pool, tile, tile.mg, tile.ty, 1)
    return max(1, min(shape.C, 16, SMEM_STATIC_LIMIT // per_channel))


def _rows_per_block(shape: ConvShape, pool: int, params: Mapping[str, Any], tile: _Tile,
                    cc: int, pipe: bool, wreg: bool) -> int:
    """Tile rows a block walks down: where the whole input fits, as many as shared memory
    (the pipe's dynamic limit, or the static one) allows, up to params['rpt']."""
    if cc < shape.C:
        return 1
    hp, _ = pooled_hw(shape, pool)

    def fits(rows: int) -> bool:
        if pipe:
            return pipe_smem_bytes(shape.K, shape.S, pool, tile.mt * tile.mg, tile.pw,
                                   tile.tx, rows, shape.C, wreg) <= SMEM_DYNAMIC_TWO_BLOCKS
        return _tile_smem(shape, pool, tile, tile.mg, rows, shape.C) <= SMEM_STATIC_LIMIT

    rpt = 1
    want = int(params.get("rpt") or ceil_div(hp, tile.ty))
    while rpt < want and fits(tile.ty * (rpt + 1)):
        rpt += 1
    return rpt


def _geometry_defines(shape: ConvShape, pool: int, tile: _Tile, cc: int, rpt: int,
                      minb: int) -> dict[str, int]:
    return {
        "FCP_K": shape.K, "FCP_S": shape.S, "FCP_P": pool, "FCP_MT": tile.mt,
        "FCP_PW": tile.pw, "FCP_TX": tile.tx, "FCP_TY": tile.ty, "FCP_CC": cc,
        "FCP_MINB": minb, "FCP_MG": tile.mg, "FCP_RPT": rpt,
    }


def _fcp_exact_plan(shape: ConvShape, pool: int, params: Mapping[str, Any], tile: _Tile,
                    cc: int, rpt: int) -> ExactPlan:
    hp, wp = pooled_hw(shape, pool)
    threads = tile.tx * tile.ty * tile.mg
    # Register cap ~168: conv2 at 128 registers spills and runs 5% slower than at 168 with
    # half the resident warps (H100, docs/fused.md).
    minb = int(params.get("minb") or max(1, min(16, (SM_REGISTERS // 168) // threads)))
    defines = _geometry_defines(shape, pool, tile, cc, rpt, minb)
    return ExactPlan(defines, ceil_div(wp, tile.tx * tile.pw), ceil_div(hp, tile.ty * rpt),
                     (tile.tx, tile.ty, tile.mg), ceil_div(shape.M, tile.mt * tile.mg))


# ---- fcp_exact_cw -----------------------------------------------------------------------------


def cw_fits(shape: ConvShape, mt: int) -> bool:
    """fcp_exact_cw needs every weight index to be a compile-time constant: all M output
    channels in one thread's tile, and C*K*K*mt floats within the parameter space."""
    return mt >= shape.M and 4 * shape.C * shape.K * shape.K * mt <= CW_BYTES and shape.C <= 16


def _cw_plan(shape: ConvShape, pool: int, params: Mapping[str, Any], tile: _Tile) -> ExactPlan:
    """fcp_exact_cw: fcp_exact's tile (one channel group), whole image rows per block."""
    tile = _Tile(tile.mt, tile.pw, tile.tx, tile.ty, 1)
    hp, wp = pooled_hw(shape, pool)
    rpt = 1
    want = int(params.get("rpt") or ceil_div(hp, tile.ty))
    while rpt < want and smem_bytes(shape.K, shape.S, pool, 0, tile.pw, tile.tx,
                                    tile.ty * (rpt + 1), shape.C) <= SMEM_STATIC_LIMIT:
        rpt += 1
    # Registers: the weights are constant-bank operands, so a thread needs its accumulators,
    # one input row and addresses (conv1: 64); minb only caps, it does not force.
    minb = int(params.get("minb") or max(1, min(16, (SM_REGISTERS // 96) // (tile.tx * tile.ty))))
    defines = _geometry_defines(shape, pool, tile, shape.C, rpt, minb)
    return ExactPlan(defines, ceil_div(wp, tile.tx * tile.pw), ceil_div(hp, tile.ty * rpt),
                     (tile.tx, tile.ty, 1), 1, "fcp_exact_cw")


def cw_weights(w: np.ndarray, C: int, K: int, mt: int) -> np.ndarray:
    """Weights (M, C, K, K) as fcp_exact_cw's by-value struct {float w[C][K*K][mt]}: a
    one-element NumPy structured array, which CuPy passes to the kernel by value."""
    M = w.shape[0]
    packed = np.zeros((C, K * K, mt), np.float32)
    packed[:, :, :M] = np.asarray(w, np.float32).reshape(M, C, K * K).transpose(1, 2, 0)
    struct = np.dtype({"names": ["w"], "formats": [(np.float32, (C, K * K, mt))]})
    return packed.ravel().view(struct)


# ---- fcp_exact_pipe ---------------------------------------------------------------------------

# What pipe = 0 picks, measured on H100 at B = 10000 (docs/fused.md has the runs):
#   conv1-like (C*K*K within WREG_BUDGET): the pipe with register weights, PIPE_WREG_TILE
#     (0.670 ms vs fcp_exact 0.696), unless fcp_exact_cw fits (0.568 ms: it does for conv1);
#   other single-chunk shapes: the pipe with fcp_exact's tile (conv2 1.397 vs 1.449 ms);
#   multi-chunk shapes (C channels do not fit one buffer) always run fcp_exact.


def with_measured_defaults(shape: ConvShape, pool: int,
                           params: Mapping[str, Any]) -> Mapping[str, Any]:
    """params with pipe = cw = 0 resolved to the measured choice above; an explicit pipe or
    cw (1 or -1) or explicit tiling parameters are left alone."""
    if params.get("pipe") or params.get("cw"):
        return params
    tiled = any(params.get(k) for k in ("mt", "pw", "mg", "tx", "ty"))
    wreg_fits = (shape.C * shape.K * shape.K <= WREG_BUDGET
                 and pool * pool * PIPE_WREG_TILE["pw"] <= ACC_BUDGET)
    if not tiled and cw_fits(shape, 4 if shape.M >= 3 else shape.M):
        choice: dict[str, int] = {"cw": 1}
    elif wreg_fits and not tiled:
        choice = {**PIPE_WREG_TILE, "mg": min(4, shape.M)}
    else:
        choice = {"pipe": 1}
    return {**choice, **{k: v for k, v in params.items() if v}}


def _pipe_plan(shape: ConvShape, pool: int, params: Mapping[str, Any], tile: _Tile, rpt: int,
               wreg: bool) -> ExactPlan:
    """fcp_exact_pipe for a single-chunk tiling (all C channels of a tile in one buffer)."""
    K, P, C = shape.K, pool, shape.C
    hp, wp = pooled_hw(shape, P)
    threads = tile.tx * tile.ty * tile.mg
    smem = pipe_smem_bytes(K, shape.S, P, tile.mt * tile.mg, tile.pw, tile.tx, tile.ty * rpt,
                           C, wreg)
    fit = resident_blocks(1, threads, smem)  # what shared memory alone allows
    bps = int(params.get("bps") or 0)
    # Registers a thread needs, fitted to what compiled without spills: conv1's tile (32
    # accumulators) in 95 at 4 blocks of 160 threads; conv2's (64) spills at 128 and uses
    # ~190 uncapped; conv1 with register weights (16 accumulators + 49 weights) in 96.
    acc = tile.mt * P * P * tile.pw
    need = 2 * acc + C * tile.mt * K * K + 16 if wreg else 32 + 2 * acc
    minb = int(params.get("minb") or bps
               or max(1, min(fit, SM_REGISTERS // (threads * need), 16)))
    defines = {**_geometry_defines(shape, pool, tile, C, rpt, minb), "FCP_WREG": int(wreg)}
    return ExactPlan(defines, ceil_div(wp, tile.tx * tile.pw), ceil_div(hp, tile.ty * rpt),
                     (tile.tx, tile.ty, tile.mg), ceil_div(shape.M, tile.mt * tile.mg),
                     "fcp_exact_pipe", smem, bps)


# ---- run --------------------------------------------------------------------------------------


def _as_device_f32(cp: Any, a: Any) -> Any:
    return cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32))


def prepare_exact(pool: int) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    """The registry's prepare for fused-conv-pool{pool} (fp32)."""

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        from convolab.backend import require_cupy
        from convolab.gpu.compile import get_kernel

        cp = require_cupy()
        w_d, b_d = _as_device_f32(cp, w), _as_device_f32(cp, b)
        plan = exact_plan(shape, pool, params)
        if plan is None:
            return _simple_run(shape, pool, w_d, b_d)
        kernel = get_kernel(plan.kernel_file, plan.kernel, plan.defines)
        hp, wp = pooled_hw(shape, pool)
        i32 = np.int32
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


def prepare_exact_raw(shape: ConvShape, pool: int, w: Any, b: Any, params: Mapping[str, Any],
                      raw_hw: tuple[int, int]) -> Run | None:
    """run(raw, y) of `fcp_exact_cw_raw`: the layer reading raw uint8 images (B, *raw_hw) and
    resizing them to shape.H x shape.W while staging its tile (kernels/resize.cuh); None where
    the layer does not run `fcp_exact_cw` (the caller then resizes first: gpu/resize.py)."""
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel
    from convolab.gpu.resize import device_taps

    plan = exact_plan(shape, pool, params) if shape.C == 1 else None
    if plan is None or plan.kernel != "fcp_exact_cw":
        return None
    tile_rows = plan.block[1] * plan.defines["FCP_RPT"]
    in_rows = (tile_rows * pool - 1) * shape.S + shape.K
    raw_bytes = 4 * raw_hw[1] * (raw_hw[0] + in_rows)  # the raw image and the tile's row pass
    if smem_bytes(shape.K, shape.S, pool, 0, plan.defines["FCP_PW"], plan.block[0], tile_rows,
                  1) + raw_bytes > SMEM_NO_OPT_IN:
        return None
    cp = require_cupy()
    defines = {**plan.defines, "RAW_H": raw_hw[0], "RAW_W": raw_hw[1]}
    kernel = get_kernel(plan.kernel_file, "fcp_exact_cw_raw", defines)
    w_arg = cw_weights(to_numpy(w), 1, shape.K, plan.defines["FCP_MT"])
    b_d = _as_device_f32(cp, b)
    taps = device_taps(raw_hw[0], raw_hw[1], shape.H, shape.W)
    hp, wp = pooled_hw(shape, pool)
    i32 = np.int32
    tail = (i32(shape.H), i32(shape.W), i32(shape.M), i32(hp), i32(wp), i32(plan.tiles_w),
            i32(plan.tiles_per_image))

    def run(raw: Any, y: Any) -> None:
        n = int(raw.shape[0])
        if n:
            kernel((n * plan.tiles_per_image,), plan.block, (raw, taps, w_arg, b_d, y, *tail))

    return run


def _simple_run(shape: ConvShape, pool: int, w_d: Any, b_d: Any) -> Run:
    from convolab.gpu.compile import get_kernel

    kernel = get_kernel(KERNEL_FILES["fcp_simple"], "fcp_simple", {})
    hp, wp = pooled_hw(shape, pool)
    total = shape.B * shape.M * hp * wp
    grid = min(ceil_div(total, 256), 65535 * 32)
    i32 = np.int32

    def run_simple(x: Any, y: Any) -> None:
        kernel((grid,), (256,), (x, w_d, b_d, y, np.int64(total), i32(shape.C), i32(shape.H),
                                 i32(shape.W), i32(shape.M), i32(shape.K), i32(shape.S),
                                 i32(pool), i32(hp), i32(wp)))

    return run_simple


def _pipe_run(cp: Any, kernel: Any, plan: ExactPlan, batch: int, wb: tuple[Any, Any],
              args_tail: tuple[Any, ...]) -> Run:
    if plan.smem_dynamic > SMEM_NO_OPT_IN:
        kernel.max_dynamic_shared_size_bytes = plan.smem_dynamic
    kernel.preferred_shared_memory_carveout = 100  # all of L1 as shared memory: 2-3 blocks
    tasks = batch * plan.tiles_per_image
    bps = plan.blocks_per_sm or max(1, occupancy(kernel, plan.threads, plan.smem_dynamic))
    n_sm = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    grid = (max(1, min(tasks, n_sm * bps)), plan.channel_groups)
    w_d, b_d = wb
    tail = (*args_tail, np.int32(tasks))

    def run(x: Any, y: Any) -> None:
        kernel(grid, plan.block, (x, w_d, b_d, y, *tail), shared_mem=plan.smem_dynamic)

    run.grid = grid  # type: ignore[attr-defined]  # for tests and benchmarks
    return run


# ---- compile variants (tests/test_nvcc_compile.py) --------------------------------------------


def zoo_fused_layers() -> list[tuple[ConvShape, int]]:
    """(shape, pool) of every zoo conv layer followed by a max-pool (batch 1)."""
    from convolab.models import MODELS, conv_blocks

    out: list[tuple[ConvShape, int]] = []
    for model in MODELS:
        for block in conv_blocks(model):
            if block.pool and (block.shape, block.pool) not in out:
                out.append((block.shape, block.pool))
    return out


def compile_plans() -> list[ExactPlan]:
    """Every plan the zoo's layers run with: the measured defaults, pipe forced on and off,
    and the cw / register-weight pipe tiles where they apply (distinct define sets)."""
    jobs: list[tuple[ConvShape, int, dict[str, int]]] = []
    for shape, pool in zoo_fused_layers():
        jobs += [(shape, pool, {"pipe": pipe}) for pipe in (-1, 1)]
        jobs += [(shape, pool, {}), (shape, pool, {"pipe": 1, "rpt": 1})]
        jobs += [(shape, pool, {**PIPE_WREG_TILE, "mg": 4, "pw": 8})]
        jobs += [(shape, pool, {"cw": 1}), (shape, pool, {"cw": 1, "ty": 4})]
    plans: list[ExactPlan] = []
    for shape, pool, params in jobs:
        plan = exact_plan(shape, pool, params)
        if plan is not None and (plan.kernel, plan.defines) not in [
                (p.kernel, p.defines) for p in plans]:
            plans.append(plan)
    return plans


def compile_jobs() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """(kernel file, defines) of every FFMA fused kernel the host compiles, by kernel."""
    jobs: dict[str, list[tuple[str, dict[str, int]]]] = {"fcp_simple": [
        (KERNEL_FILES["fcp_simple"], {})]}
    for plan in compile_plans():
        jobs.setdefault(plan.kernel, []).append((plan.kernel_file, plan.defines))
    return jobs
