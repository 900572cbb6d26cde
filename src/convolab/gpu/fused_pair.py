"""Kernel 47: the exact forward's first two blocks in one persistent kernel, rung 45's conv1
on conv1 warpgroups writing conv2's staged form into shared memory, rung 46's consumers
computing conv2 from it (kernels/47_fused_first_pair_wgmma_ws.cu says why).

`pair_why_not` says whether it takes a model's first two blocks, `pair_plan` gives its defines
and shared memory, `prepare_pair(...)` returns run(x, y): float images (n, 1, H, W) in, conv2's
pooled maps (n, M2, Hp2, Wp2) fp32 out. It equals rung 45 writing records followed by rung 46
reading them, with the same conv2 loop defines (`c3.consumers = 2` and this module's LOOP),
bit for bit. Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.errors import InputError
from convolab.gpu import fused_first, fused_wgmma, fused_wide
from convolab.gpu.fused_ffma import pooled_hw
from convolab.gpu.implicit_gemm import SMEM_LIMIT
from convolab.registry import Run
from convolab.shapes import ConvShape

KERNEL_FILE = "47_fused_first_pair_wgmma_ws.cu"
KERNEL = "fpair_wgmma_ws"
POOL = 2
CONSUMERS = 2  # conv2's warpgroups
# conv1's warps (the kernel's FR_WARPS): two warpgroups; with one (first_wgs = 1) conv1 is
# latency-bound, 1,151 us for the pair against 974 with two (H200, docs/raw.md "Kernel 47")
FIRST_WARPS = 8
# conv2's loop defines in the registers setmaxnreg leaves the consumers beside two conv1
# warpgroups (144 a thread; rung 46 with three consumers has 152 and the same loop)
LOOP = {"ring": 4, "sum": 6}
KEYS = ("ring", "lead", "sum", "pitch", "tails",  # conv2's parameters this kernel takes
        "first_wgs")  # conv1 warpgroups (1 or 2)
# FusedLeNet runs a model's first two blocks on this kernel unasked (exact mode, float input,
# where it takes them; the second block's kernel parameter merge = 1 / -1 asks / refuses):
# eecs498's pair 974 us against 344 + 657 apart, the forward 1.016 against 1.035 ms (H200,
# docs/raw.md "Kernel 47").
NETWORK = True


@dataclass(frozen=True)
class PairPlan:
    defines: dict[str, int]
    smem: int  # dynamic shared memory (the static part: conv1's tile, fused_first's count)
    threads: int


def pair_why_not(first: ConvShape, second: ConvShape, pool1: int = POOL, pool2: int = POOL,
                 params: Mapping[str, Any] | None = None) -> str | None:
    """None where kernel 47 takes this pair of blocks (conv1 on rung 45 writing records, conv2
    on rung 46 fed them), else why not."""
    from convolab.gpu.implicit_gemm_wgmma import wgmma_ruled_out

    if pool1 != POOL or pool2 != POOL:
        return f"both blocks pool {POOL}x{POOL}"
    if (first.M, *pooled_hw(first, POOL)) != (second.C, second.H, second.W):
        return "conv2's input is not conv1's pooled output"
    if not fused_first.staged_takes(first, pool1, {}, None):
        return "rung 45 does not write this conv1's staged records (K >= 6, float input)"
    if not fused_wgmma.staged_takes(second, pool2, "3xfp16", {}):
        return "rung 46 does not take this conv2 fed records"
    if wgmma_ruled_out():
        return "this GPU cannot run sm_90a code (wgmma)"
    plan = pair_plan(first, second, params)
    static = (fused_first.rp_smem_bytes(first, pooled_hw(first, POOL)[0], True)
              + 4 * plan.defines["FR_WARPS"])  # (rp_smem_bytes counts red for 4 warps)
    if plan.smem + static > SMEM_LIMIT:
        return f"it needs {plan.smem + static} bytes of shared memory (> {SMEM_LIMIT})"
    return None


def pair_plan(first: ConvShape, second: ConvShape,
              params: Mapping[str, Any] | None = None) -> PairPlan:
    """Defines (rung 45's for conv1, rung 46's for conv2 fed records, LOOP unless params say)
    and the dynamic shared memory: conv2's weights, two slots, conv1's B tiles, exponents."""
    params = dict(params or {})
    unknown = sorted(set(params) - set(KEYS))
    if unknown:
        raise InputError(f"kernel 47: unknown parameter(s) {unknown} (known: {list(KEYS)})")
    c1 = fused_first.first_plan(first, POOL, {"tc": fused_first.TC_WGMMA}, None, "float32",
                                "3xfp16").defines
    first_wgs = int(params.pop("first_wgs", 0) or FIRST_WARPS // 4)
    if first_wgs not in (1, 2):
        raise InputError(f"kernel 47: first_wgs must be 1 or 2, got {first_wgs}")
    c2 = fused_wgmma.ws_plan(second, "3xfp16", {**LOOP, **params, "consumers": CONSUMERS},
                             fused_wgmma.STAGED).defines
    defines = {k: c1[k] for k in ("FF_K", "FF_H", "FF_W", "FR_M")}
    defines |= {k: v for k, v in c2.items() if k != "FWS_STAGED_IN"}
    defines["FR_WARPS"] = 4 * first_wgs
    slot = fused_wgmma.staged_record(c2)["FR_STG_REC"] - fused_wgmma.RECORD_TAIL
    smem = (fused_wgmma.ALIGN + fused_wgmma.weight_bytes(second, "3xfp16", bool(c2["FW_TAILS"]))
            + 2 * slot + fused_first.wg_b_bytes(first, True) + 16)
    return PairPlan(defines, smem, 128 * (CONSUMERS + first_wgs))


def prepare_pair(first: ConvShape, w1: Any, b1: Any, second: ConvShape, w2: Any, b2: Any,
                 params: Mapping[str, Any] | None = None) -> Run:
    """run(x, y): x float32 (n, 1, H, W) images, y float32 (n, M2, Hp2, Wp2) = conv2's pooled
    maps of conv1's pooled maps, in exact mode (3xfp16 on both)."""
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel
    from convolab.gpu.device import sm_count

    reason = pair_why_not(first, second, params=params)
    if reason is not None:
        raise InputError(f"kernel 47 does not take {first} then {second}: {reason}")
    plan = pair_plan(first, second, params)
    w1h, b1h = np.asarray(to_numpy(w1), np.float32), np.asarray(to_numpy(b1), np.float32)
    w2h, b2h = np.asarray(to_numpy(w2), np.float32), np.asarray(to_numpy(b2), np.float32)
    for shape, w, b in ((first, w1h, b1h), (second, w2h, b2h)):
        if w.shape != shape.w_shape or b.shape != (shape.M,):
            raise InputError(f"kernel 47: weight {w.shape} and bias {b.shape} do not fit {shape} "
                             f"(want {shape.w_shape} and ({shape.M},))")
    cp = require_cupy()
    tiles, w_e = fused_first.rowpair_wgmma_tiles(w1h, True)
    args1 = (cp.asarray(tiles), cp.asarray(fused_first.staged_bias(w1h, b1h)), np.int32(w_e))
    packed = cp.asarray(fused_wgmma.wgmma_blocks(w2h, "3xfp16", bool(plan.defines["FW_TAILS"])))
    w_unscale = np.float32(2.0 ** -fused_wide.weight_exponent(w2h))
    bias2 = cp.asarray(b2h)
    kernel = get_kernel(KERNEL_FILE, KERNEL, plan.defines)
    kernel.max_dynamic_shared_size_bytes = plan.smem
    kernel.preferred_shared_memory_carveout = 100
    sms = sm_count()  # (a device query: once here, not in every forward)
    in_tail = (1, first.H, first.W)
    out_tail = (second.M, *pooled_hw(second, POOL))

    def run(x: Any, y: Any) -> None:
        n = int(x.shape[0])
        if x.dtype != np.float32 or tuple(x.shape[1:]) != in_tail or not x.flags.c_contiguous:
            raise InputError(f"kernel 47: input must be contiguous float32 (n, "
                             f"{', '.join(map(str, in_tail))}), got {x.dtype} {tuple(x.shape)}")
        if y.dtype != np.float32 or tuple(y.shape) != (n, *out_tail):
            raise InputError(f"kernel 47: out must be float32 {(n, *out_tail)}, got {y.dtype} "
                             f"{tuple(y.shape)}")
        if n:
            grid = (min(n, sms),)
            kernel(grid, (plan.threads,), (x, *args1, packed, bias2, y, np.int32(n), w_unscale),
                   shared_mem=plan.smem)

    run.in_dtype = "float32"  # type: ignore[attr-defined]
    run.out_dtype = "float32"  # type: ignore[attr-defined]
    run.out_tail = out_tail  # type: ignore[attr-defined]
    run.plan = plan  # type: ignore[attr-defined]
    return run


def compile_jobs() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """Each zoo model's pair that kernel 47 takes (tests/test_nvcc_compile.py)."""
    from convolab.models import MODELS, conv_blocks

    jobs: dict[str, list[tuple[str, dict[str, int]]]] = {}
    for model in MODELS:
        blocks = conv_blocks(model, 1)
        if len(blocks) < 2:
            continue
        first, second = blocks[0], blocks[1]
        if pair_why_not(first.shape, second.shape, first.pool, second.pool) is None:
            jobs[f"fused-pair {model} ({KERNEL})"] = [
                (KERNEL_FILE, pair_plan(first.shape, second.shape, {"first_wgs": n}).defines)
                for n in (1, 2)]
    return jobs

