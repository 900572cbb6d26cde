"""GPU rungs 1-7 (docs/spec.md, Ladder): the host side of kernels/01_basic.cu ...
07_register_tiled.cu.

Each rung is a registry entry whose `prepare` compiles its kernel (cached per defines), copies
weights where the rung keeps them (constant memory), allocates workspace, and returns a
`run(x, y)` that only launches kernels. CuPy is touched only inside `prepare`/`run`, so this
module imports on machines without a GPU (CI's nvcc check lists the entries from here).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from convolab.backend import require_cupy
from convolab.gpu.compile import get_kernel, get_module
from convolab.gpu.device import SMEM_STATIC_LIMIT, occupancy, sm_count
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

# Capacity of the __constant__ weight bank in 03/04 (must match CONST_WEIGHT_CAP there).
CONST_WEIGHT_CAP = 14336
# Rung 5's unrolled matrix is bounded so B=10000 never needs gigabytes of workspace.
UNROLL_WORKSPACE_BYTES = 256 * 1024 * 1024
# Largest block rung 7 launches (its __launch_bounds__, MAX_THREADS in the .cu file).
REGISTER_TILED_MAX_THREADS = 256
REGISTER_TILED_SMEM_BUDGET = 24 * 1024  # per block, so several blocks share an SM

KSIZES = tuple(range(1, 8))  # kernel sizes the tests draw; models use 3, 5, 7

_i32 = np.int32


def _check_int32(shape: ConvShape) -> bool:
    """Kernels index within one image and weight set in 32 bits and count blocks in grid.x."""
    s = shape
    return max(s.C * s.H * s.W, s.M * s.H_out * s.W_out, s.M * s.C * s.K * s.K) < 2**31


def _as_f32(a: Any) -> Any:
    cp = require_cupy()
    return cp.ascontiguousarray(a, dtype=cp.float32)


# --------------------------------------------------------------------------- constant memory


class _ConstantArena:
    """First-fit slices of one module's __constant__ weight bank.

    Two layers prepared with the same compiled module (same defines) share one bank, so each
    prepared run gets its own slice, released when the run is garbage-collected.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live: dict[int, int] = {}  # offset -> size

    def allocate(self, size: int) -> int:
        offset = 0
        for start, length in sorted(self.live.items()):
            if start - offset >= size:
                break
            offset = max(offset, start + length)
        if offset + size > self.capacity:
            used = sum(self.live.values())
            raise ValueError(
                f"constant memory is full: {size} weights requested, {used} of "
                f"{self.capacity} floats held by {len(self.live)} other prepared layer(s)"
            )
        self.live[offset] = size
        return offset

    def free(self, offset: int) -> None:
        self.live.pop(offset, None)


_ARENAS: dict[int, _ConstantArena] = {}


def _upload_constant(module: Any, w: Any) -> tuple[int, _ConstantArena]:
    arena = _ARENAS.setdefault(id(module), _ConstantArena(CONST_WEIGHT_CAP))
    flat = _as_f32(w).ravel()
    offset = arena.allocate(int(flat.size))
    bank = module.get_global("c_weights")
    (bank + offset * 4).copy_from_device(flat.data, flat.nbytes)
    return offset, arena


def _fits_constant(shape: ConvShape) -> bool:
    return shape.M * shape.C * shape.K * shape.K <= CONST_WEIGHT_CAP and _check_int32(shape)


def _check_constant(shape: ConvShape, name: str) -> None:
    n = shape.M * shape.C * shape.K * shape.K
    if n > CONST_WEIGHT_CAP:
        raise ValueError(
            f"{name}: M*C*K*K = {n} weights do not fit the {CONST_WEIGHT_CAP}-float "
            f"constant bank ({CONST_WEIGHT_CAP * 4 // 1024} KB); use another implementation"
        )


# --------------------------------------------------------------------------- rung 1


def _prepare_basic(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    block = int(params["BLOCK"])
    kernel = get_kernel("01_basic.cu", "conv_basic", {"BLOCK_SIZE": block})
    w, b = _as_f32(w), _as_f32(b)
    s = shape
    total = s.B * s.M * s.H_out * s.W_out
    grid = (ceil_div(total, block),)
    args = tuple(_i32(v) for v in (s.B, s.C, s.H, s.W, s.M, s.K, s.S, s.H_out, s.W_out))

    def run(x: Any, y: Any) -> None:
        kernel(grid, (block,), (x, w, b, y, *args))

    return run


# --------------------------------------------------------------------------- rungs 2-4


def _fitting_tile(shape: ConvShape, tile: int) -> int:
    """The requested tile, halved until its input patch + halo fits in shared memory."""
    while tile > 1 and (((tile - 1) * shape.S + shape.K) ** 2) * 4 > SMEM_STATIC_LIMIT:
        tile //= 2
    return tile


def _tile_launch(shape: ConvShape, tile: int) -> tuple[tuple, tuple, int, tuple]:
    tiles_w, tiles_h = ceil_div(shape.W_out, tile), ceil_div(shape.H_out, tile)
    grid = (shape.B * tiles_w * tiles_h, shape.M)
    smem = ((tile - 1) * shape.S + shape.K) ** 2 * 4
    return grid, (tile, tile), smem, (_i32(tiles_w), _i32(tiles_w * tiles_h))


def _tile_supports(shape: ConvShape) -> bool:
    return _check_int32(shape) and shape.M <= 65535 and shape.B * shape.H_out * shape.W_out < 2**31


def _prepare_tiled(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    tile = _fitting_tile(shape, int(params["TILE"]))
    kernel = get_kernel("02_tiled.cu", "conv_tiled", {"TILE": tile})
    w, b = _as_f32(w), _as_f32(b)
    s = shape
    grid, block, smem, tiling = _tile_launch(s, tile)
    args = tuple(_i32(v) for v in (s.B, s.C, s.H, s.W, s.M, s.K, s.S, s.H_out, s.W_out))

    def run(x: Any, y: Any) -> None:
        kernel(grid, block, (x, w, b, y, *args, *tiling), shared_mem=smem)

    return run


def _prepare_constant(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    _check_constant(shape, "constant")
    tile = _fitting_tile(shape, int(params["TILE"]))
    defines = {"TILE": tile}
    module = get_module("03_constant.cu", defines)
    kernel = module.get_function("conv_constant")
    offset, arena = _upload_constant(module, w)
    b = _as_f32(b)
    s = shape
    grid, block, smem, tiling = _tile_launch(s, tile)
    args = tuple(_i32(v) for v in (s.B, s.C, s.H, s.W, s.M, s.K, s.S, s.H_out, s.W_out))

    def run(x: Any, y: Any) -> None:
        kernel(grid, block, (x, b, y, _i32(offset), *args, *tiling), shared_mem=smem)

    weakref.finalize(run, arena.free, offset)
    return run


def _prepare_restrict_unroll(
    shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]
) -> Run:
    _check_constant(shape, "restrict-unroll")
    tile = _fitting_tile(shape, int(params["TILE"]))
    module = get_module("04_restrict_unroll.cu", {"TILE": tile, "KSIZE": shape.K})
    kernel = module.get_function("conv_restrict_unroll")
    offset, arena = _upload_constant(module, w)
    b = _as_f32(b)
    s = shape
    grid, block, smem, tiling = _tile_launch(s, tile)
    args = tuple(_i32(v) for v in (s.B, s.C, s.H, s.W, s.M, s.S, s.H_out, s.W_out))

    def run(x: Any, y: Any) -> None:
        kernel(grid, block, (x, b, y, _i32(offset), *args, *tiling), shared_mem=smem)

    weakref.finalize(run, arena.free, offset)
    return run


# --------------------------------------------------------------------------- rung 5


def unroll_chunk(shape: ConvShape, workspace_bytes: int | None = None) -> int:
    """Images per unroll+GEMM pass so X_unroll stays within the workspace bound."""
    if workspace_bytes is None:
        workspace_bytes = UNROLL_WORKSPACE_BYTES  # read at call time: tests shrink it
    per_image = shape.C * shape.K * shape.K * shape.H_out * shape.W_out * 4
    return max(1, min(shape.B, workspace_bytes // per_image))


def _prepare_unroll_gemm(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    cp = require_cupy()
    tile = int(params["TILE"])
    unroll = get_kernel("05_unroll_gemm.cu", "unroll_input", {"TILE": tile})
    gemm = get_kernel("05_unroll_gemm.cu", "gemm_bias", {"TILE": tile})
    s = shape
    w_mat, b = _as_f32(w).reshape(s.M, -1), _as_f32(b)
    kk, howo = s.C * s.K * s.K, s.H_out * s.W_out
    chunk = unroll_chunk(s)
    workspace = cp.empty(kk * howo * chunk, dtype=cp.float32)
    dims = tuple(_i32(v) for v in (s.C, s.H, s.W, s.K, s.S, s.H_out, s.W_out))
    passes = []
    for b0 in range(0, s.B, chunk):
        nb = min(chunk, s.B - b0)
        n = nb * howo
        passes.append(
            (
                (ceil_div(n * kk, 256),),
                (_i32(b0), _i32(nb)),
                (ceil_div(n, tile), ceil_div(s.M, tile)),
                (_i32(s.M), _i32(kk), _i32(n), _i32(howo), _i32(b0)),
            )
        )

    def run(x: Any, y: Any) -> None:
        for unroll_grid, unroll_args, gemm_grid, gemm_args in passes:
            unroll(unroll_grid, (256,), (x, workspace, *unroll_args, *dims))
            gemm(gemm_grid, (tile, tile), (w_mat, workspace, b, y, *gemm_args))

    return run


def _unroll_supports(shape: ConvShape) -> bool:
    n_chunk = unroll_chunk(shape) * shape.H_out * shape.W_out
    return _check_int32(shape) and n_chunk * shape.C * shape.K * shape.K < 2**31


# --------------------------------------------------------------------------- rung 6


def _prepare_fused_gemm(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    tile = int(params["TILE"])
    kernel = get_kernel("06_fused_gemm.cu", "conv_fused_gemm", {"TILE": tile})
    w, b = _as_f32(w), _as_f32(b)
    s = shape
    grid = (ceil_div(s.B * s.H_out * s.W_out, tile), ceil_div(s.M, tile))
    args = tuple(_i32(v) for v in (s.B, s.C, s.H, s.W, s.M, s.K, s.S, s.H_out, s.W_out))

    def run(x: Any, y: Any) -> None:
        kernel(grid, (tile, tile), (x, w, b, y, *args))

    return run


def _gemm_supports(shape: ConvShape) -> bool:
    return _check_int32(shape) and ceil_div(shape.B * shape.H_out * shape.W_out, 16) < 2**31


# --------------------------------------------------------------------------- rung 7


def _register_tiled_tm_tn(shape: ConvShape, params: Mapping[str, Any]) -> tuple[int, int]:
    tm = int(params.get("TM", 0)) or (4 if shape.M <= 4 else 8 if shape.M <= 8 else 16)
    # Measured on H100 (conv1, conv2 at B=10000): 8 rows for TM=4, 2 for TM=8 and 16.
    tn = int(params.get("TN", 0)) or (8 if tm == 4 else 2)
    if tm not in (4, 8, 16) or tn not in (1, 2, 4, 8):
        raise ValueError(
            f"register-tiled: TM must be 4, 8 or 16 and TN 1, 2, 4 or 8 (got {tm}, {tn})"
        )
    return tm, tn


def _register_tiled_block(shape: ConvShape, params: Mapping[str, Any], tn: int) -> tuple[int, int]:
    """BX spans the output row (balanced tiles when wider than 128); BY row groups, chosen to
    weigh padded rows (wasted compute) against tiny blocks (halo loads, scheduling)."""
    threads = REGISTER_TILED_MAX_THREADS
    bx = int(params.get("BX", 0)) or ceil_div(shape.W_out, ceil_div(shape.W_out, 128))
    groups = ceil_div(shape.H_out, tn)
    by = int(params.get("BY", 0))
    if bx < 1 or bx > threads:
        raise ValueError(f"register-tiled: BX must be in 1..{threads}, got {bx}")
    if not by:
        limit = max(1, min(groups, threads // bx))
        by = min(
            range(1, limit + 1),
            key=lambda v: ceil_div(groups, v) * v / groups * (1 + 32 / (bx * v)),
        )
    if bx * by > threads:
        raise ValueError(f"register-tiled: BX*BY = {bx * by} threads exceeds {threads}")
    return bx, by


def register_tiled_channel_bytes(shape: ConvShape, tm: int, tn: int, bx: int, by: int) -> int:
    """Shared memory one staged input channel takes: TM output channels' K*K weights plus the
    input patch under a BX x (BY*TN) output tile."""
    rows = (by * tn - 1) * shape.S + shape.K
    cols = (bx - 1) * shape.S + shape.K
    return 4 * (shape.K * shape.K * tm + rows * cols)


def register_tiled_config(shape: ConvShape, params: Mapping[str, Any]) -> dict[str, int]:
    """Concrete TM, TN, BX, BY, CCH, STRIDE, PIPE, QU for a shape; 0 in params means "choose
    for me".

    TM (channels per thread = the block's M-extent) is the smallest of 4/8/16 covering M so the
    small ece408 layers pad nothing; TN trades register reuse of each input strip against
    registers. BX and BY come from `_register_tiled_block`; CCH is the channels staged per pass
    within the shared-memory budget.
    """
    s = shape
    tm, tn = _register_tiled_tm_tn(s, params)
    bx, by = _register_tiled_block(s, params, tn)
    pipe, q_unroll = int(params.get("PIPE", 0)), int(params.get("QU", 0))
    if pipe not in (0, 1) or q_unroll not in (0, 1):
        raise ValueError(f"register-tiled: PIPE and QU must be 0 or 1, got {pipe}, {q_unroll}")
    copies = 2 if pipe else 1  # the pipelined kernel double-buffers its shared memory
    limit_bytes = SMEM_STATIC_LIMIT // copies - 16

    def channel_bytes(by_: int, bx_: int) -> int:
        return register_tiled_channel_bytes(s, tm, tn, bx_, by_)

    # Large strides blow up the staged patch: give up rows, then columns, until one fits.
    while channel_bytes(by, bx) > limit_bytes and by > 1:
        by = max(1, by // 2)
    while channel_bytes(by, bx) > limit_bytes and bx > 1:
        bx = ceil_div(bx, 2)
    if channel_bytes(by, bx) > limit_bytes:
        raise ValueError(f"register-tiled: no tile of shape {s} fits in shared memory")
    budget = REGISTER_TILED_SMEM_BUDGET // copies
    cch = min(int(params.get("CCH", 0)) or max(1, budget // channel_bytes(by, bx)), s.C)
    while cch > 1 and cch * channel_bytes(by, bx) > limit_bytes:
        cch -= 1
    return {
        "TM": tm, "TN": tn, "BX": bx, "BY": by, "CCH": cch, "STRIDE": 1 if s.S == 1 else 0,
        "PIPE": pipe, "QU": q_unroll,
    }


def arrange_register_tiled_weights(w: Any, tm: int) -> Any:
    """(M, C, K, K) -> [ceil(M/TM)][C][q][p][TM], zero-padded past M.

    The layout the kernel stages with straight 16-byte copies: for one (channel group, c, q)
    the K*TM weights an input strip meets are contiguous, TM channels innermost.
    """
    cp = require_cupy()
    m, c, k, _ = w.shape
    groups = ceil_div(m, tm)
    padded = cp.zeros((groups * tm, c, k, k), dtype=cp.float32)
    padded[:m] = w
    return cp.ascontiguousarray(padded.reshape(groups, tm, c, k, k).transpose(0, 2, 4, 3, 1))


def _prepare_register_tiled(
    shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]
) -> Run:
    s = shape
    cfg = register_tiled_config(s, params)
    tm, tn, bx, by, cch = cfg["TM"], cfg["TN"], cfg["BX"], cfg["BY"], cfg["CCH"]
    defines = {"KSIZE": s.K, "STRIDE": cfg["STRIDE"], "TM": tm, "TN": tn}
    if cfg["QU"]:  # only then, so the default keeps the define set CI compiles
        defines["QUNROLL"] = 1
    name = "conv_register_tiled_pipelined" if cfg["PIPE"] else "conv_register_tiled"
    kernel = get_kernel("07_register_tiled.cu", name, defines)
    w, b = arrange_register_tiled_weights(_as_f32(w), tm), _as_f32(b)
    buffer_floats = 4 * ceil_div(cch * register_tiled_channel_bytes(s, tm, tn, bx, by) // 4, 4)
    tiles_w, tiles_h = ceil_div(s.W_out, bx), ceil_div(s.H_out, by * tn)
    total_tiles = s.B * tiles_w * tiles_h
    args = tuple(
        _i32(v)
        for v in (s.B, s.C, s.H, s.W, s.M, s.S, s.H_out, s.W_out, cch, tiles_w, tiles_w * tiles_h)
    )
    if cfg["PIPE"]:
        smem = 2 * 4 * buffer_floats
        resident = _resident_blocks(kernel, bx * by, smem)
        grid = (min(total_tiles, resident), ceil_div(s.M, tm))
        args += (_i32(buffer_floats),)
    else:
        smem = 4 * buffer_floats
        grid = (total_tiles, ceil_div(s.M, tm))

    def run(x: Any, y: Any) -> None:
        kernel(grid, (bx, by), (x, w, b, y, *args), shared_mem=smem)

    return run


def _resident_blocks(kernel: Any, threads: int, smem: int) -> int:
    """Blocks the whole GPU holds at once (registers, shared memory, threads): the persistent
    kernel's grid, so every block starts at once and each walks an equal share of tiles."""
    return max(1, occupancy(kernel, threads, smem)) * sm_count()


def _register_tiled_supports(shape: ConvShape) -> bool:
    if not _check_int32(shape):
        return False
    try:
        cfg = register_tiled_config(shape, {})
    except ValueError:
        return False
    tiles = ceil_div(shape.W_out, cfg["BX"]) * ceil_div(shape.H_out, cfg["BY"] * cfg["TN"])
    return shape.B * tiles < 2**31


def _register_tiled_variants() -> list[dict[str, int]]:
    """The auto config for every K at stride 1, each auto TM/TN pair at the models' K, and the
    run-time-stride path (kept short: every entry is one nvcc run in CI)."""
    auto_pairs = ((4, 8), (8, 2), (16, 2))
    variants = [{"KSIZE": k, "STRIDE": 1, "TM": 16, "TN": 2} for k in KSIZES]
    variants += [
        {"KSIZE": k, "STRIDE": 1, "TM": tm, "TN": tn}
        for k, (tm, tn) in itertools.product((3, 5, 7), auto_pairs[:2])
    ]
    variants += [{"KSIZE": k, "STRIDE": 0, "TM": 16, "TN": 2} for k in (3, 7)]
    variants += [{"KSIZE": 7, "STRIDE": 0, "TM": 4, "TN": 8}]
    variants += [
        {"KSIZE": 7, "STRIDE": 1, "TM": tm, "TN": tn, "QUNROLL": 1} for tm, tn in auto_pairs
    ]
    return variants


# --------------------------------------------------------------------------- the registry

TILES = (8, 16, 32)
GEMM_TILES = (16, 32)

BASIC = register(
    ConvImpl(
        name="basic",
        demonstrates="one thread per output element, everything from global memory",
        device="gpu",
        rung=1,
        kernel_file="01_basic.cu",
        prepare=_prepare_basic,
        supports=_check_int32,
        space={"BLOCK": (128, 256, 512)},
        defaults={"BLOCK": 256},
        compile_variants=lambda: [{"BLOCK_SIZE": v} for v in (128, 256, 512)],
    )
)

TILED = register(
    ConvImpl(
        name="tiled",
        demonstrates="input tile + halo staged in shared memory",
        device="gpu",
        rung=2,
        kernel_file="02_tiled.cu",
        prepare=_prepare_tiled,
        supports=_tile_supports,
        space={"TILE": TILES},
        defaults={"TILE": 16},
        compile_variants=lambda: [{"TILE": t} for t in TILES],
    )
)

CONSTANT = register(
    ConvImpl(
        name="constant",
        demonstrates="weights in __constant__ memory (broadcast to the whole block)",
        device="gpu",
        rung=3,
        kernel_file="03_constant.cu",
        prepare=_prepare_constant,
        supports=lambda s: _fits_constant(s) and _tile_supports(s),
        space={"TILE": TILES},
        defaults={"TILE": 16},
        compile_variants=lambda: [{"TILE": t} for t in TILES],
    )
)

RESTRICT_UNROLL = register(
    ConvImpl(
        name="restrict-unroll",
        demonstrates="__restrict__ pointers and a compile-time, fully unrolled K x K loop",
        device="gpu",
        rung=4,
        kernel_file="04_restrict_unroll.cu",
        prepare=_prepare_restrict_unroll,
        supports=lambda s: _fits_constant(s) and _tile_supports(s),
        space={"TILE": TILES},
        defaults={"TILE": 16},
        compile_variants=lambda: [{"TILE": 16, "KSIZE": k} for k in KSIZES]
        + [{"TILE": t, "KSIZE": 7} for t in (8, 32)],
    )
)

UNROLL_GEMM = register(
    ConvImpl(
        name="unroll-gemm",
        demonstrates="im2col unroll of a batch chunk + tiled shared-memory GEMM",
        device="gpu",
        rung=5,
        kernel_file="05_unroll_gemm.cu",
        prepare=_prepare_unroll_gemm,
        supports=_unroll_supports,
        space={"TILE": GEMM_TILES},
        defaults={"TILE": 16},
        compile_variants=lambda: [{"TILE": t} for t in GEMM_TILES],
    )
)

FUSED_GEMM = register(
    ConvImpl(
        name="fused-gemm",
        demonstrates="implicit GEMM: im2col computed while loading the B tile",
        device="gpu",
        rung=6,
        kernel_file="06_fused_gemm.cu",
        prepare=_prepare_fused_gemm,
        supports=_gemm_supports,
        space={"TILE": GEMM_TILES},
        defaults={"TILE": 16},
        compile_variants=lambda: [{"TILE": t} for t in GEMM_TILES],
    )
)

REGISTER_TILED = register(
    ConvImpl(
        name="register-tiled",
        demonstrates="register + shared-memory tiling, TM channels x TN pixels per thread",
        device="gpu",
        rung=7,
        kernel_file="07_register_tiled.cu",
        prepare=_prepare_register_tiled,
        supports=_register_tiled_supports,
        # 0 = chosen from the shape by register_tiled_config.
        space={
            "TM": (0, 4, 8, 16), "TN": (0, 2, 4, 8), "BY": (0, 1, 2, 4), "PIPE": (0, 1),
            "QU": (0, 1),
        },
        defaults={"TM": 0, "TN": 0, "BX": 0, "BY": 0, "CCH": 0, "PIPE": 0, "QU": 0},
        compile_variants=_register_tiled_variants,
    )
)

LADDER: tuple[ConvImpl, ...] = (
    BASIC,
    TILED,
    CONSTANT,
    RESTRICT_UNROLL,
    UNROLL_GEMM,
    FUSED_GEMM,
    REGISTER_TILED,
)
