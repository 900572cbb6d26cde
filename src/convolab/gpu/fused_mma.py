"""Host side of the tensor-core fused conv + bias + ReLU + max-pool kernels (rungs 17, 18):

    fcp_mma_toe  kernels/17_fused_conv_pool_mma_toeplitz.cu  conv1-like: positions as A rows
    fcp_mma_wa   kernels/18_fused_conv_pool_mma.cu           conv2-like: weights as A

`tc_plan` picks the mapping (`tc_kind`), defines and grid; the fragment packers put weights in
per-lane mma register order (`pack_half2`, `tf32_bits`, `LANE_G`/`LANE_T` are public: the
channels-last family in gpu/fused_cl.py packs with them too). Nothing here imports CuPy at
module import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.gpu.device import SMEM_STATIC_LIMIT
from convolab.gpu.fused_ffma import pooled_hw, supports_pool, zoo_fused_layers
from convolab.registry import Run
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILES: dict[str, str] = {
    "fcp_mma_toe": "17_fused_conv_pool_mma_toeplitz.cu",
    "fcp_mma_wa": "18_fused_conv_pool_mma.cu",
}


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


def f16_bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)


def pack_half2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two fp16 values in one 32-bit register: the lower k index in the low half (PTX order)."""
    return f16_bits(lo) | (f16_bits(hi) << np.uint32(16))


def tf32_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> tf32 rounded to nearest, ties away from zero (what cvt.rna.tf32.f32 does)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)


LANE = np.arange(32)
LANE_G, LANE_T = LANE // 4, LANE % 4  # mma fragment coordinates of each lane: group, thread


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
        g, t = LANE_G[None, :], LANE_T[None, :]
        regs = [
            pack_half2(wp[g, 2 * s, 2 * t], wp[g, 2 * s, 2 * t + 1]),
            pack_half2(wp[g + 8, 2 * s, 2 * t], wp[g + 8, 2 * s, 2 * t + 1]),
            pack_half2(wp[g, 2 * s + 1, 2 * t], wp[g, 2 * s + 1, 2 * t + 1]),
            pack_half2(wp[g + 8, 2 * s + 1, 2 * t], wp[g + 8, 2 * s + 1, 2 * t + 1]),
        ]
    else:
        s = np.arange(rows)[:, None]
        g, t = LANE_G[None, :], LANE_T[None, :]
        regs = [tf32_bits(wp[g, s, t]), tf32_bits(wp[g + 8, s, t]),
                tf32_bits(wp[g, s, t + 4]), tf32_bits(wp[g + 8, s, t + 4])]
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
    g, t = LANE_G[None, None, :], LANE_T[None, None, :]
    r = np.arange(rows)[:, None, None]
    m = np.arange(M)[None, :, None]
    if precision == "fp16":
        b0 = pack_half2(band[r, 2 * t, m, g], band[r, 2 * t + 1, m, g])
        b1 = pack_half2(band[r, 2 * t + 8, m, g], band[r, 2 * t + 9, m, g])
        out = np.stack([b0, b1], axis=-1)[:, None]
    else:
        halves = []
        for h in range(2):
            b0 = tf32_bits(band[r, 8 * h + t, m, g])
            b1 = tf32_bits(band[r, 8 * h + t + 4, m, g])
            halves.append(np.stack([b0, b1], axis=-1))
        out = np.stack(halves, axis=1)
    return np.ascontiguousarray(out.astype(np.uint32))


def _best_warps(units: int) -> int:
    """Warps per block that split `units` work items most evenly (ties: the first listed)."""
    return max((4, 5, 3, 2, 6, 8, 1), key=lambda w: units / (ceil_div(units, w) * w))


@dataclass(frozen=True)
class TcPlan:
    """Kernel name, compile-time defines and launch geometry of a tensor-core variant."""

    kernel: str  # fcp_mma_toe or fcp_mma_wa
    defines: dict[str, int]
    tiles_w: int
    tiles_h: int
    warps: int

    @property
    def kernel_file(self) -> str:
        return KERNEL_FILES[self.kernel]


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
        ng = ceil_div(2 * wp, 8)

        def toe_smem(tph: int) -> int:
            return shape.C * ((2 * tph - 1) + shape.K) * (ng * 8 + 8) * elem

        while tph > 1 and toe_smem(tph) > SMEM_STATIC_LIMIT:
            tph //= 2
        # 2 warps per block measured fastest for conv1 on H100 (0.32 vs 0.38 ms with 5)
        warps = int(params.get("warps") or min(2, ceil_div(tph * ng, 8)))
        defines = {"TC_PREC": prec, "TC_C": shape.C, "TC_K": shape.K, "TC_P": 2,
                   "TC_M": shape.M, "TC_TPH": tph, "TC_TPW": wp, "TC_WARPS": warps,
                   "TC_MINB": int(params.get("minb") or 1)}
        return TcPlan("fcp_mma_toe", defines, 1, ceil_div(hp, tph), warps)

    tph, tpw = min(hp, 8), min(wp, 8)
    copies = 2 if precision == "fp16" else 1

    def wa_smem(tph: int, tpw: int) -> int:
        rs = ceil_div(tpw * pool - 1 + 8, 2) * 2 + 2
        return copies * shape.C * (tph * pool - 1 + shape.K) * rs * elem

    while wa_smem(tph, tpw) > SMEM_STATIC_LIMIT and max(tph, tpw) > 1:
        if tph >= tpw:
            tph = max(1, tph // 2)
        else:
            tpw = max(1, tpw // 2)
    units = tph * tpw if pool == 4 else ceil_div(tph * tpw, 2)
    warps = int(params.get("warps") or _best_warps(units))
    # fp16: capping registers at 128 (4 blocks of 4 warps) measured 5% faster on conv2
    minb = int(params.get("minb") or (max(1, 512 // (warps * 32)) if prec == 0 else 1))
    defines = {"TC_PREC": prec, "TC_C": shape.C, "TC_K": shape.K, "TC_P": pool,
               "TC_M": 16, "TC_TPH": tph, "TC_TPW": tpw, "TC_WARPS": warps,
               "TC_MINB": minb}
    return TcPlan("fcp_mma_wa", defines, ceil_div(wp, tpw), ceil_div(hp, tph), warps)


def prepare_tc(pool: int,
               precision: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    """The registry's prepare for fused-conv-pool{pool}-tc / -tf32."""

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        from convolab.backend import require_cupy, to_numpy
        from convolab.gpu.compile import get_kernel

        cp = require_cupy()
        plan = tc_plan(shape, pool, precision, params)
        w_h = np.asarray(to_numpy(w), np.float32)
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        hp, wp = pooled_hw(shape, pool)
        i32 = np.int32
        kernel = get_kernel(plan.kernel_file, plan.kernel, plan.defines)
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


def prepare_toe_raw(shape: ConvShape, w: Any, b: Any, precision: str,
                    params: Mapping[str, Any], raw_hw: tuple[int, int]) -> Run | None:
    """run(raw, y) of `fcp_mma_toe_raw`: the pool-2 toeplitz layer reading raw uint8 images
    (B, *raw_hw) and resizing them while staging (kernels/resize.cuh); None where the layer
    does not take the toeplitz kernel (the caller then resizes first: gpu/resize.py)."""
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel
    from convolab.gpu.resize import device_taps

    if shape.C != 1 or tc_kind(shape, 2) != "toeplitz":
        return None
    plan = tc_plan(shape, 2, precision, params)
    cp = require_cupy()
    defines = {**plan.defines, "RAW_H": raw_hw[0], "RAW_W": raw_hw[1]}
    kernel = get_kernel(plan.kernel_file, "fcp_mma_toe_raw", defines)
    frag = cp.asarray(toeplitz_fragments(np.asarray(to_numpy(w), np.float32), precision))
    b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
    taps = device_taps(raw_hw[0], raw_hw[1], shape.H, shape.W)
    hp, wp = pooled_hw(shape, 2)
    i32 = np.int32
    tail = (i32(shape.H), i32(shape.W), i32(hp), i32(wp), i32(plan.tiles_h))
    block = (plan.warps * 32,)

    def run(raw: Any, y: Any) -> None:
        n = int(raw.shape[0])
        if n:
            kernel((n * plan.tiles_h,), block, (raw, taps, frag, b_d, y, *tail))

    return run


def compile_plans() -> list[TcPlan]:
    """The default plan of every zoo layer a tensor-core kernel takes, fp16 and tf32."""
    plans: list[TcPlan] = []
    for shape, pool in zoo_fused_layers():
        if tc_kind(shape, pool) is None:
            continue
        for precision in ("fp16", "tf32"):
            plan = tc_plan(shape, pool, precision)
            if plan not in plans:
                plans.append(plan)
    return plans


def compile_jobs() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """(kernel file, defines) of every tensor-core fused kernel the host compiles, by kernel."""
    jobs: dict[str, list[tuple[str, dict[str, int]]]] = {}
    for plan in compile_plans():
        jobs.setdefault(plan.kernel, []).append((plan.kernel_file, plan.defines))
    return jobs
