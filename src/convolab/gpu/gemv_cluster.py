"""Kernel 48: a classifier layer at batch 1-64 in one launch, its k slices one thread-block
cluster whose partial sums meet in distributed shared memory
(kernels/48_gemv_tensor_core_cluster.cu: `gemv-cluster-fp16`, `-bf16`, `-tf32`).

Kernel 42 sums a row tile's slices through global memory, one block alone, after an atomic
ticket, and keeps one chunk in flight a block; on a layer as small as fc7 both are latency.
Here the slices of a row tile are the blocks of one cluster (at most 8), each adds 1/SPLIT of
the tile across the cluster in rank order, and weights and x arrive by cp.async into a ring of
STAGES chunks. W is packed as kernel 42 packs it (`gemv_mma.operand_values`: fragment order,
16 bytes a lane and piece); TF32 uses kernel 42's 3xTF32 layout (4 fp32 values a lane and k8
step) rounded to TF32 here, not its 2.5-byte form: the whole of fc7 fits in L2 either way.
The launch's arguments are bound at prepare (`launch.BoundLaunch`). Everything above `prepare`
is pure Python, tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none, require_cupy
from convolab.gpu import gemv_mma
from convolab.gpu.compile import get_kernel
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "48_gemv_tensor_core_cluster.cu"
MODES: dict[str, int] = {"fp16": 0, "bf16": 1, "tf32": 2}
MAX_BATCH = gemv_mma.MAX_BATCH
MAX_SPLIT = 8  # the portable cluster size
SMEM_LIMIT = gemv_mma.SMEM_LIMIT
PIECE_BYTES = 512  # one m-tile's k piece: 32 lanes x 16 bytes

# Tunable, compile-time: CP k pieces a chunk, WARPS 16-row m-tiles a block, NSPLIT warps an
# m-tile (each a share of the batch columns; at most the n-tiles there are), STAGES chunks in
# the ring, SPLIT k slices = blocks a cluster (0: chosen from the shape, `launch_plan`).
SPACE: dict[str, tuple[int, ...]] = {"CP": (2, 4, 8), "WARPS": (4, 8), "NSPLIT": (1, 2, 4),
                                     "STAGES": (2, 3, 4, 6), "SPLIT": (0, 1, 2, 4, 8),
                                     "XONCE": (0, 1)}
DEFAULTS: dict[str, int] = {"CP": 4, "WARPS": 4, "NSPLIT": 1, "STAGES": 4, "SPLIT": 0,
                            "XONCE": 1}


def piece_k(mode: str) -> int:
    """k values in a lane's 16-byte piece: a k16 step of fp16 / bf16, a k8 step of fp32."""
    return 8 if mode == "tf32" else 16


def clusters_ruled_out() -> bool:
    """True where the current GPU has no thread-block clusters (compute capability below 9.0);
    with no GPU, `supports` answers for the shape alone, as every other rung's does."""
    cp = cupy_or_none()
    return cp is not None and int(cp.cuda.Device().compute_capability) < 90


def supports(shape: ConvShape) -> bool:
    """A linear layer (1x1 images, 1x1 kernel), B <= 64, C a multiple of 8, on a GPU with
    clusters."""
    return gemv_mma.supports(shape) and not clusters_ruled_out()


# Where `auto` runs kernel 48 without a cache entry: the classifier layers under
# gemv_mma.BIG_LAYER weights (fc7, not fc6) in FP16 and TF32 at every batch it takes, with these
# parameters (docs/vgg.md, "Kernel 48": fc7 on an H200 at B = 1-64, against kernel 42, the
# split-K GEMMs and cuBLAS in the same runs). On fc6 the weight stream, not latency, is the
# bound, and kernels 42 / 43 keep it. TF32 takes chunks of 8 k8 pieces in a 3-deep ring up to
# AUTO_LONG_CHUNKS_BATCH columns (fc7 B = 1-32: 15.6-21.6 us against 18.6-23.2 at the defaults)
# and the defaults above (B = 64: 39 us against ~26-28).
AUTO_MODES = ("fp16", "tf32")
AUTO_LONG_CHUNKS: dict[str, int] = {"CP": 8, "STAGES": 3}
AUTO_LONG_CHUNKS_BATCH = 32


def auto_params(mode: str, batch: int) -> dict[str, int]:
    """The parameters `auto` gives kernel 48 (only those that differ from the defaults)."""
    return dict(AUTO_LONG_CHUNKS) if mode == "tf32" and batch <= AUTO_LONG_CHUNKS_BATCH else {}


def auto_choice(shape: ConvShape, mode: str) -> tuple[str, dict[str, int]] | None:
    """The implementation `auto` runs for this layer in this mode and its parameters, or None
    where kernel 48 is not its choice."""
    if mode not in AUTO_MODES or not supports(shape) or shape.M * shape.C >= gemv_mma.BIG_LAYER:
        return None
    return f"gemv-cluster-{mode}", auto_params(mode, shape.B)


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    m_tiles: int  # 16-row tiles of W (packed, zero rows past M)
    pieces: int  # k pieces a row (packed, zero past K)
    slice_pieces: int  # pieces a block: whole chunks
    tiles: int  # gridDim.y: row tiles of WARPS m-tiles
    smem: int

    @property
    def split(self) -> int:
        return self.defines["TC_SPLIT"]

    @property
    def grid(self) -> tuple[int, int]:
        return self.split, self.tiles

    @property
    def threads(self) -> int:
        return 32 * self.defines["TC_WARPS"] * self.defines["TC_NSPLIT"]


def x_row(mode: str, cp_: int) -> int:
    """TC_XROW, x's row stride in floats: a chunk's k rounded up to 32, plus 4 (TF32: a B
    fragment's lanes read words t + g XROW) or 8 (fp16 / bf16: pairs at 2t + g XROW), so that
    a fragment's reads fall in 32 different banks."""
    return ceil_div(cp_ * piece_k(mode), 32) * 32 + (4 if mode == "tf32" else 8)


def operand_row(mode: str, cp_: int) -> int:
    """TC_OROW, the converted chunk's row stride in 32-bit words: a chunk's k in operand words
    (fp16 / bf16 pairs, TF32 one a word) plus 4, so that a B fragment's lanes (g, t) at
    t + g OROW read 32 different banks."""
    kc = cp_ * piece_k(mode)
    return (kc if mode == "tf32" else kc // 2) + 4


def smem_bytes(mode: str, defines: Mapping[str, int]) -> int:
    """The ring (each stage: every warp's CP pieces, then 8 NT rows of x's chunk in fp32 with
    the padded stride TC_XROW) and, with XONCE, the converted chunk (rows of TC_OROW words);
    at least the tile of sums it all becomes at the end."""
    rows = 8 * defines["TC_NT"]
    stage = (defines["TC_WARPS"] * defines["TC_CP"] * PIECE_BYTES
             + rows * defines["TC_XROW"] * 4)
    converted = rows * defines["TC_OROW"] * 4 if defines["TC_XONCE"] else 0
    return max(defines["TC_STAGES"] * stage + converted, rows * 16 * defines["TC_WARPS"] * 4)


def _check(mode: str, params: Mapping[str, Any]) -> None:
    if mode not in MODES:
        raise ValueError(f"gemv-cluster: unknown mode {mode!r}; known: {', '.join(MODES)}")
    for key, values in SPACE.items():
        if int(params[key]) not in values:
            raise ValueError(f"gemv-cluster: {key} must be one of {values}, got {params[key]}")


def auto_split(tiles: int, chunks: int, sms: int) -> int:
    """The most slices (1, 2, 4 or 8) whose blocks still fit one wave and none of which is
    empty: fc7 (16 row tiles of 64) takes 8, 128 blocks on 132 SMs."""
    def fits(split: int) -> bool:
        return tiles * split <= sms and (split - 1) * ceil_div(chunks, split) < chunks

    return max(s for s in (1, 2, 4, MAX_SPLIT) if s == 1 or fits(s))


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any],
                sms: int = gemv_mma.DEFAULT_SMS) -> LaunchPlan:
    """Row tiles, slices and shared memory; ValueError names what does not fit."""
    _check(mode, params)
    if not supports(shape):
        raise ValueError(f"gemv-cluster does not support shape {shape}")
    warps, cp_ = int(params["WARPS"]), int(params["CP"])
    m_tiles, pieces = ceil_div(shape.M, 16), ceil_div(shape.C, piece_k(mode))
    tiles, chunks = ceil_div(m_tiles, warps), ceil_div(pieces, cp_)
    split = int(params["SPLIT"]) or auto_split(tiles, chunks, sms)
    slice_pieces = ceil_div(chunks, split) * cp_
    nt = gemv_mma.n_tiles(shape.B)
    defines = {"TC_MODE": MODES[mode], "TC_NT": nt, "TC_WARPS": warps,
               "TC_NSPLIT": min(int(params["NSPLIT"]), nt), "TC_CP": cp_,
               "TC_XROW": x_row(mode, cp_), "TC_OROW": operand_row(mode, cp_),
               "TC_XONCE": int(params["XONCE"]), "TC_STAGES": int(params["STAGES"]),
               "TC_SPLIT": split}
    smem = smem_bytes(mode, defines)
    if smem > SMEM_LIMIT:
        raise ValueError(f"gemv-cluster: {defines['TC_STAGES']} stages need {smem} B of shared "
                         f"memory, over {SMEM_LIMIT}: fewer STAGES, a smaller CP or fewer WARPS")
    return LaunchPlan(defines, m_tiles, pieces, slice_pieces, tiles, smem)


def pack_weights(w2: Any, mode: str) -> Any:
    """(M, C) fp32 -> kernel 48's operand in fragment order: fp16 values, bf16 bit patterns,
    or fp32 values rounded to TF32 (nearest, ties away: the kernel's cvt.rna for x)."""
    from convolab.gpu.implicit_gemm_wgmma import tf32_round

    if mode == "tf32":
        return tf32_round(gemv_mma.operand_values(w2, "3xtf32"))
    return gemv_mma.operand_values(w2, mode)


def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    """CI's nvcc set: the defaults at 8 batch tiles in a cluster of 8, and one tile without a
    cluster with x converted as read (the other code paths); in fp16 also each other CP, WARPS,
    NSPLIT and STAGES extreme once (they change array sizes and trip counts, the same in every
    mode)."""
    def variants() -> list[dict[str, int]]:
        cp_ = DEFAULTS["CP"]
        base = {"TC_MODE": MODES[mode], "TC_WARPS": DEFAULTS["WARPS"], "TC_CP": cp_,
                "TC_XROW": x_row(mode, cp_), "TC_OROW": operand_row(mode, cp_),
                "TC_STAGES": DEFAULTS["STAGES"], "TC_NSPLIT": DEFAULTS["NSPLIT"]}
        top = {**base, "TC_NT": 8, "TC_SPLIT": MAX_SPLIT, "TC_XONCE": 1}
        out = [top, {**base, "TC_NT": 1, "TC_SPLIT": 1, "TC_XONCE": 0}]
        if mode == "fp16":
            out += [{**top, "TC_CP": v, "TC_XROW": x_row(mode, v), "TC_OROW": operand_row(mode, v)}
                    for v in (SPACE["CP"][0], SPACE["CP"][-1])]
            out += [{**top, f"TC_{key}": SPACE[key][-1]} for key in ("WARPS", "NSPLIT", "STAGES")]
        return out

    return variants


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"gemv-cluster-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import sm_count
        from convolab.gpu.launch import BoundLaunch

        w2 = gemv_mma.layer_weights(name, shape, w, supports(shape))
        plan = launch_plan(shape, mode, params, sm_count())
        kernel = get_kernel(KERNEL_FILE, "gemv_cluster", plan.defines)
        kernel.max_dynamic_shared_size_bytes = plan.smem
        w_op = pack_weights(w2, mode)
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        sizes = (shape.B, shape.M, shape.C, plan.m_tiles, plan.pieces, plan.slice_pieces)
        launch = BoundLaunch(kernel, plan.grid, (plan.threads,),
                             (None, w_op, b_d, None, *(np.int32(v) for v in sizes)),
                             per_call=(0, 3), shared_mem=plan.smem)

        def run(x: Any, y: Any) -> None:
            launch(x, y)

        return run

    return prepare


WHAT = {"fp16": "fp16 weights and x", "bf16": "bf16 weights and x",
        "tf32": "fp32 weights rounded to TF32, x rounded to TF32"}

for _mode in MODES:
    register(ConvImpl(
        name=f"gemv-cluster-{_mode}", rung=48, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"classifier layer at batch <= {MAX_BATCH} in one launch: a row tile's k "
                     f"slices are one thread-block cluster whose partial sums are added through "
                     f"distributed shared memory in rank order; weights and x by cp.async into "
                     f"a ring ({WHAT[_mode]}, fp32 accumulate)",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["auto_choice", "auto_params", "auto_split", "clusters_ruled_out", "launch_plan",
           "operand_row", "pack_weights", "piece_k", "smem_bytes", "supports", "x_row"]
