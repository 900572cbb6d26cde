"""Kernel 53 (`gemv-wgc-fp16`, `gemv-wgc-bf16`): a classifier layer at batch 17-64 on Hopper's
warpgroup MMA, x converted once a thread-block cluster (kernels/53_gemv_wgmma_cluster.cu).

Kernel 49 brings x's chunk in fp32 into every stage of every block and converts it there; here
the row tiles of one k slice form a cluster that converts the slice's x once, before the loop,
into a scratch buffer laid out as wgmma reads it, so a stage is two bulk copies (the weights,
packed as kernel 49 packs them, and x in 16 bits). The weights' layout, the plan's slices and
the kernel's end are kernel 49's. Everything above `prepare` is pure Python, tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu import device, gemv_mma, gemv_wgmma
from convolab.gpu.compile import get_kernel
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "53_gemv_wgmma_cluster.cu"
MODES = gemv_wgmma.MODES
THREADS = gemv_wgmma.THREADS
MAX_CLUSTER = 8  # the portable cluster size
# kernel 49's MT, KT, SPLIT and MINB; STAGES: chunks in the ring (a stage no longer holds x in
# fp32, so more fit); CLUSTER: row tiles a cluster, which share one conversion of x.
SPACE: dict[str, tuple[int, ...]] = {**gemv_wgmma.SPACE, "STAGES": (2, 3, 4, 5, 6, 8),
                                     "CLUSTER": (1, 2, 4, 8)}
DEFAULTS: dict[str, int] = {**gemv_wgmma.DEFAULTS, "MT": 2, "STAGES": 5, "CLUSTER": 8}


def supports(shape: ConvShape) -> bool:
    """Kernel 49's layers, on a GPU that runs sm_90a code (which has clusters)."""
    return gemv_wgmma.supports(shape)


def defines(mode: str, B: int, params: Mapping[str, Any]) -> dict[str, int]:
    """Kernel 49's -D set with this kernel's ring depth and cluster size (GC_CLUSTER is set by
    `launch_plan`: at most the row tiles)."""
    if any(int(params[k]) not in SPACE[k] for k in ("CLUSTER", "STAGES")):
        raise ValueError(f"gemv-wgc: CLUSTER must be in {SPACE['CLUSTER']} and STAGES in "
                         f"{SPACE['STAGES']}, got {params['CLUSTER']} and {params['STAGES']}")
    d = gemv_wgmma.defines(mode, B, {**params, "STAGES": gemv_wgmma.DEFAULTS["STAGES"]})
    return {**d, "GW_STAGES": int(params["STAGES"]), "GC_CLUSTER": int(params["CLUSTER"])}


def x_bytes(d: Mapping[str, int]) -> int:
    """x's chunk in a stage, in the operand type."""
    return d["GW_KT"] * 8 * d["TM_NT"] * gemv_wgmma.ROW_BYTES


def smem_bytes(d: Mapping[str, int]) -> int:
    """The ring, and 1 KB to align it (the swizzle repeats on 1 KB boundaries)."""
    return d["GW_STAGES"] * (gemv_wgmma.a_bytes(d) + x_bytes(d)) + 1024


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    tiles: int  # gridDim.x: row tiles, a multiple of the cluster (past M: zero weights)
    chunks: int  # chunks of KT k-tiles along k
    slice_chunks: int  # chunks a block
    slices: int  # gridDim.y
    smem: int

    @property
    def grid(self) -> tuple[int, int]:
        return self.tiles, self.slices

    @property
    def clusters(self) -> int:
        """Clusters a slice: each converts the slice's x into its own part of the scratch."""
        return self.tiles // self.defines["GC_CLUSTER"]

    @property
    def scratch_bytes(self) -> int:
        return self.clusters * self.chunks * x_bytes(self.defines)


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any],
                sms: int = gemv_mma.DEFAULT_SMS) -> LaunchPlan:
    """Kernel 49's row tiles and slices; the cluster at most the power of two at or below the
    layer's row tiles, and the row tiles rounded up to whole clusters."""
    d = defines(mode, shape.B, params)
    smem = smem_bytes(d)
    if smem > gemv_mma.SMEM_LIMIT:
        raise ValueError(f"gemv-wgc: {d['GW_STAGES']} stages of "
                         f"{gemv_wgmma.a_bytes(d) + x_bytes(d)} bytes need {smem} B of shared "
                         f"memory, over {gemv_mma.SMEM_LIMIT}: fewer STAGES, KT or MT")
    rows = gemv_wgmma.tile_rows(d)
    real_tiles = ceil_div(shape.M, rows)
    cluster = min(d["GC_CLUSTER"], 1 << (real_tiles.bit_length() - 1))
    d["GC_CLUSTER"] = cluster
    tiles = ceil_div(real_tiles, cluster) * cluster
    resident = max(1, min(d["TM_MINB"], device.resident_blocks(1, THREADS, smem)))
    chunks = ceil_div(shape.C, gemv_wgmma.K_TILE * d["GW_KT"])
    per_slice = gemv_mma.slice_chunks(chunks, tiles, sms * resident, gemv_wgmma.a_bytes(d), rows,
                                      shape.B, int(params["SPLIT"]))
    return LaunchPlan(d, tiles, chunks, per_slice, ceil_div(chunks, per_slice), smem)


def pack_weights(w2: Any, mode: str, plan: LaunchPlan) -> Any:
    """Kernel 49's packing of (M, C) fp32 weights, with zero rows up to the plan's row tiles."""
    xp = xp_of(w2)
    rows = plan.tiles * gemv_wgmma.tile_rows(plan.defines)
    if w2.ndim == 2 and w2.shape[0] < rows:
        w2 = xp.concatenate([w2, xp.zeros((rows - w2.shape[0], w2.shape[1]), w2.dtype)])
    return gemv_wgmma.pack_weights(w2, mode, plan.defines)


# What CI's nvcc check builds: each mode at the fewest and the most batch tiles with the
# defaults, and in fp16 each other value of MT, KT and CLUSTER once (with the most stages that
# fit), and each STAGES value with 128-row tiles.
def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        points = [(8, DEFAULTS), (gemv_mma.MAX_BATCH, DEFAULTS)]
        if mode == "fp16":
            points += [(gemv_mma.MAX_BATCH, {**DEFAULTS, k: v})
                       for k in ("MT", "KT", "CLUSTER") for v in SPACE[k] if v != DEFAULTS[k]]
            points += [(gemv_mma.MAX_BATCH, {**DEFAULTS, "MT": 1, "STAGES": v})
                       for v in SPACE["STAGES"]]
        out: list[dict[str, int]] = []
        for batch, point in points:
            d = defines(mode, batch, point)
            while smem_bytes(d) > gemv_mma.SMEM_LIMIT and d["GW_STAGES"] > SPACE["STAGES"][0]:
                d["GW_STAGES"] = max(s for s in SPACE["STAGES"] if s < d["GW_STAGES"])
            if d not in out:
                out.append(d)
        return out

    return variants


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"gemv-wgc-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import sm_count
        from convolab.gpu.launch import BoundLaunch

        w2 = gemv_mma.layer_weights(name, shape, w, supports(shape))
        plan = launch_plan(shape, mode, params, sm_count())
        w_op = pack_weights(w2, mode, plan)
        kernel = get_kernel(KERNEL_FILE, "gemv_wgmma_cluster", plan.defines)
        kernel.max_dynamic_shared_size_bytes = plan.smem
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        partial = cp.empty((plan.slices if plan.slices > 1 else 0, shape.B, shape.M),
                           dtype=cp.float32)
        tickets = cp.zeros(plan.tiles, dtype=cp.int32)
        scratch = cp.empty(plan.scratch_bytes, dtype=cp.uint8)
        sizes = (shape.B, shape.M, shape.C, plan.chunks, plan.slice_chunks)
        return BoundLaunch(kernel, plan.grid, (THREADS,),
                           (None, w_op, b_d, None, partial, tickets, scratch,
                            *(np.int32(v) for v in sizes)),
                           per_call=(0, 3), shared_mem=plan.smem)

    return prepare


WHAT = {"fp16": "fp16 weights and x", "bf16": "bf16 weights and x"}

for _mode in MODES:
    register(ConvImpl(
        name=f"gemv-wgc-{_mode}", rung=53, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"classifier layer at batch 17-64 on the warpgroup MMA (sm_90a): the row "
                     f"tiles of a k slice are a thread-block cluster that converts the slice's "
                     f"x once into the operand layout in global scratch, after which a stage is "
                     f"two bulk copies, weights and x ({WHAT[_mode]}, fp32 accumulate)",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["defines", "launch_plan", "pack_weights", "smem_bytes", "supports", "x_bytes"]
