"""Kernel 54 (`gemv-wg-cluster-tf32`): a classifier layer in TF32 at batch 16-64 on Hopper's
warpgroup MMA, x copied straight into its operand, the k slices of a row tile one thread-block
cluster (kernels/54_gemv_wgmma_cluster_tf32.cu, sm_90a).

In TF32 a chunk of 32 channels of a batch row of x is 128 bytes of fp32, already a row of the
wgmma's K-major B operand: a producer warpgroup copies it by cp.async to its place in the
128-byte swizzle and rounds it in place; the weights (rounded to TF32 and packed in the same
swizzle here) come by the bulk copy engine; one consumer warpgroup issues m64nNk8 wgmmas (N:
the batch rounded up to 16). A row tile's SPLIT k slices are one cluster that adds its sums
through distributed shared memory in rank order (kernel 48's sum): one launch, no partials in
global memory. Everything above `prepare` is pure Python, tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu import gemv_cluster, gemv_mma
from convolab.gpu.compile import get_kernel
from convolab.gpu.gemv_wgmma import ROW_BYTES, swizzle_128b
from convolab.gpu.implicit_gemm_wgmma import tf32_round, wgmma_ruled_out
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "54_gemv_wgmma_cluster_tf32.cu"
NAME = "gemv-wg-cluster-tf32"
CHUNK_K = ROW_BYTES // 4  # channels a chunk: one 128-byte swizzle row of tf32 values
THREADS = 256  # a consumer warpgroup, a producer warpgroup
ALIGN_SLACK = 1024  # the ring is aligned to 1 KB, as the swizzle needs
BARRIER_BYTES = 3 * 8  # loaded, full, empty: one mbarrier each a stage
# MT: 64-row wgmmas a block (its rows: 64 MT); STAGES: chunks in the ring; SPLIT: k slices = the
# blocks of a cluster (0: chosen, `gemv_cluster.auto_split`). The defaults were fastest or
# within 1 us of it on fc7 at every batch measured (H200, docs/vgg.md "Kernel 54"): deeper
# rings were slower at B = 64 (8 stages of 64-row tiles 20.5 us queued against 12.7).
SPACE: dict[str, tuple[int, ...]] = {"MT": (1, 2), "STAGES": (2, 4, 6, 8, 12),
                                     "SPLIT": (0, 1, 2, 4, 8)}
DEFAULTS: dict[str, int] = {"MT": 2, "STAGES": 4, "SPLIT": 0}


def supports(shape: ConvShape) -> bool:
    """A linear layer (1x1 images, 1x1 kernel), B <= 64, C a multiple of 8, on a GPU that runs
    sm_90a code (wgmma and clusters)."""
    return gemv_mma.supports(shape) and not wgmma_ruled_out()


def batch_rows(B: int) -> int:
    """The wgmma's N: x's rows a stage, the batch rounded up to 16."""
    return 16 * ceil_div(B, 16)


def tile_rows(mt: int) -> int:
    return 64 * mt


def stage_bytes(B: int, mt: int) -> int:
    """A chunk's weights (64 MT rows) and x (N rows), 128 bytes a row."""
    return (tile_rows(mt) + batch_rows(B)) * ROW_BYTES


def smem_bytes(B: int, mt: int, stages: int) -> int:
    return ALIGN_SLACK + stages * (stage_bytes(B, mt) + BARRIER_BYTES)


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    tiles: int  # gridDim.y: row tiles of 64 MT
    chunks: int  # chunks of 32 channels (packed, zero past C)
    slice_chunks: int  # chunks a block
    smem: int

    @property
    def split(self) -> int:
        return self.defines["GT_SPLIT"]

    @property
    def grid(self) -> tuple[int, int]:
        return self.split, self.tiles


def _checked(params: Mapping[str, Any]) -> tuple[int, int]:
    for key, values in SPACE.items():
        if int(params[key]) not in values:
            raise ValueError(f"{NAME}: {key} must be one of {values}, got {params[key]}")
    return int(params["MT"]), int(params["STAGES"])


def launch_plan(shape: ConvShape, params: Mapping[str, Any],
                sms: int = gemv_mma.DEFAULT_SMS) -> LaunchPlan:
    """Row tiles, slices (none empty: the cluster is exactly the slices) and shared memory;
    ValueError names what is wrong."""
    mt, stages = _checked(params)
    if not gemv_mma.supports(shape):
        raise ValueError(f"{NAME} does not support shape {shape}")
    smem = smem_bytes(shape.B, mt, stages)
    if smem > gemv_mma.SMEM_LIMIT:
        raise ValueError(f"{NAME}: {stages} stages of {stage_bytes(shape.B, mt)} bytes need "
                         f"{smem} B of shared memory, over {gemv_mma.SMEM_LIMIT}: fewer STAGES "
                         f"or MT")
    tiles, chunks = ceil_div(shape.M, tile_rows(mt)), ceil_div(shape.C, CHUNK_K)
    split = min(int(params["SPLIT"]) or gemv_cluster.auto_split(tiles, chunks, sms), chunks)
    per_slice = ceil_div(chunks, split)
    d = {"GT_MT": mt, "GT_STAGES": stages, "GT_SPLIT": ceil_div(chunks, per_slice),
         "DW_N": batch_rows(shape.B)}
    return LaunchPlan(d, tiles, chunks, per_slice, smem)


def pack_weights(w2: Any, mt: int) -> Any:
    """(M, C) fp32 -> kernel 54's weights, uint8: for each row tile of 64 MT rows and each chunk
    of 32 channels, one run of MT wgmma A tiles of 64 rows x 128 bytes (fp32 rounded to TF32,
    nearest, ties away: the kernel's rounding of x) in the 128-byte swizzle: channels 4j..4j+3
    of row r in 16-byte piece j ^ (r mod 8). Zero past M and C."""
    xp = xp_of(w2)
    if w2.ndim != 2:
        raise ValueError(f"{NAME}: weights must be (M, C), got shape {w2.shape}")
    M, C = w2.shape
    rows = tile_rows(mt)
    tiles, chunks = ceil_div(M, rows), ceil_div(C, CHUNK_K)
    padded = xp.zeros((tiles * rows, chunks * CHUNK_K), dtype=xp.float32)
    padded[:M, :C] = tf32_round(xp.asarray(w2, dtype=xp.float32))
    a = padded.reshape(tiles, mt, 64, chunks, 8, 4).transpose(0, 3, 1, 2, 4, 5)
    return xp.ascontiguousarray(swizzle_128b(a)).view(xp.uint8).reshape(-1)


# Where `auto` runs kernel 54 without a cache entry: TF32 classifier layers under
# gemv_mma.BIG_LAYER weights (fc7, not fc6) at every batch. fc7 on an H200 (docs/vgg.md "Kernel
# 54", event / queued us): B = 1 15.9 / 8.9 against kernel 48's 17.9 / 10.5, 16 18.5 / 9.7
# against 18.0 / 12.6, 32 16.0 / 10.6 against 21.3 / 15.6, 64 18.0 / 12.7 against 29-38 /
# 32.8; cuBLAS TF32 22-27 / 16-23. On fc6 the weight stream bounds it: 197 us at B = 64 against
# cuBLAS's 147.
def auto_choice(shape: ConvShape, mode: str) -> tuple[str, dict[str, int]] | None:
    """The implementation `auto` runs for this layer in this mode, or None where kernel 54 is
    not its choice."""
    if mode != "tf32" or not supports(shape) or shape.M * shape.C >= gemv_mma.BIG_LAYER:
        return None
    return NAME, {}


# What CI's nvcc check builds: the defaults at 16 and 64 columns (the wgmma's N), each other MT
# and the smallest ring, one without a cluster.
def compile_variants() -> list[dict[str, int]]:
    points = [(64, DEFAULTS), (16, DEFAULTS), (64, {**DEFAULTS, "MT": 1, "STAGES": 8}),
              (48, {**DEFAULTS, "STAGES": 2, "SPLIT": 1})]
    return [launch_plan(ConvShape(b, 4096, 1, 1, 1024, 1), p, 132).defines for b, p in points]


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    cp = require_cupy()
    from convolab.gpu.device import sm_count
    from convolab.gpu.launch import BoundLaunch

    w2 = gemv_mma.layer_weights(NAME, shape, w, supports(shape))
    plan = launch_plan(shape, params, sm_count())
    kernel = get_kernel(KERNEL_FILE, "gemv_wgmma_tf32", plan.defines)
    kernel.max_dynamic_shared_size_bytes = plan.smem
    w_op = pack_weights(w2, plan.defines["GT_MT"])
    b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
    sizes = (shape.B, shape.M, shape.C, plan.chunks, plan.slice_chunks)
    launch = BoundLaunch(kernel, plan.grid, (THREADS,),
                         (None, w_op, b_d, None, *(np.int32(v) for v in sizes)),
                         per_call=(0, 3), shared_mem=plan.smem)

    def run(x: Any, y: Any) -> None:
        launch(x, y)

    return run


register(ConvImpl(
    name=NAME, rung=54, device="gpu", kernel_file=KERNEL_FILE,
    demonstrates="classifier layer in TF32 at batch 16-64 on the warpgroup MMA (sm_90a): x's "
                 "fp32 rows copied by cp.async straight into the swizzled B operand and rounded "
                 "in place, the weights by the bulk copy engine, a row tile's k slices one "
                 "thread-block cluster summing in distributed shared memory (fp32 weights and x "
                 "rounded to TF32, fp32 accumulate)",
    prepare=prepare, supports=supports, space=SPACE, defaults=DEFAULTS,
    compile_variants=compile_variants, tolerance=TOLERANCE["tf32"]))

__all__ = ["auto_choice", "batch_rows", "launch_plan", "pack_weights", "smem_bytes", "stage_bytes",
           "supports"]
