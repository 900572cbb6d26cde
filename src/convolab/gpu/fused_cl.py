"""Host side of kernel 19, the fused LeNet's fp16 path through a channels-last intermediate
(kernels/19_lenet_fp16_channels_last.cu):

    conv1  `fcp_mma_toe_cl`: kernel 17's Toeplitz kernel writing the pooled C1 map as fp16
           channels-last [b][40][40][4] (8 bytes a pixel) instead of fp32 NCHW
    conv2  `fcp_mma_cl`: reads that map with plain 16-byte cp.async (no conversion, no
           shifted copy), writes fp32 features in NCHW flatten order, so kernels/20
           `lenet_head` reads them unchanged

These two kernels are not registry rungs: their input or output is not the NCHW fp32 tensor
the `ConvImpl` contract promises, so `verify`/`bench` could not call them. `FusedLeNet` (mode
'fp16') uses them; `compile_jobs()` lists their define sets for the nvcc compile test.
Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.gpu.device import SMEM_STATIC_LIMIT
from convolab.gpu.fused_ffma import pooled_hw
from convolab.gpu.fused_mma import LANE_G, LANE_T, pack_half2, tc_plan, toeplitz_fragments
from convolab.registry import Run
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "19_lenet_fp16_channels_last.cu"
CL_CHANNELS = 4  # one 8-byte fp16 pixel; a k-step is 4 columns x 4 channels
CL_POOL = 4
KORDERS = (0, 1)


# ---------------------------------------------------------------------------------------------
# conv2: fcp_mma_cl
# ---------------------------------------------------------------------------------------------


def cl_supports(shape: ConvShape, pool: int) -> bool:
    """The shapes `fcp_mma_cl` takes: 4 input channels, stride 1, pool 4, M <= 16, K <= 8,
    the zero-weight padding taps inside the row, the needed rows in shared memory."""
    if (shape.C != CL_CHANNELS or shape.S != 1 or pool != CL_POOL or shape.M > 16
            or shape.K > 8):
        return False
    hp, wp = pooled_hw(shape, pool)
    if hp < 1 or wp < 1:
        return False
    ks = ceil_div(shape.K, 4)
    rows = hp * pool - 1 + shape.K
    return (wp * pool - 1 + 4 * ks - 1 < shape.W and (shape.H * shape.W) % 2 == 0
            and (rows * shape.W) % 2 == 0 and _cl_smem(shape) <= SMEM_STATIC_LIMIT)


def _cl_smem(shape: ConvShape) -> int:
    hp, wp = pooled_hw(shape, CL_POOL)
    rows = hp * CL_POOL - 1 + shape.K
    return rows * shape.W * 8 + shape.M * hp * wp * 4


@dataclass(frozen=True)
class ClPlan:
    """Compile-time defines and block size of `fcp_mma_cl` (grid: one block per image)."""

    defines: dict[str, int]
    warps: int


# Defaults measured on H100 (B = 10000, docs/fused.md): 2 warps of 2 stacked windows each
# (107 registers, no cap) 0.181-0.186 ms vs 0.195 with 4 warps of 1 window; 64-bit B loads
# (korder 1) 0.181 vs 0.191 (korder 0); split staging and nv 4 within 1 %, register caps and
# 8 warps slower. nv falls back to 1 where 2 does not divide the rows.
CL_DEFAULTS: dict[str, int] = {"warps": 2, "minb": 1, "korder": 1, "split": 0, "nv": 2}


def cl_plan(shape: ConvShape, params: Mapping[str, Any] | None = None) -> ClPlan:
    """params may set warps, minb (blocks per SM the registers must allow), korder (0: the
    two-LDS.32 k order, 1: one LDS.64), split (two cp.async groups), nv (vertically stacked
    pool windows a warp works on at once; must divide the pooled rows)."""
    if not cl_supports(shape, CL_POOL):
        raise ValueError(f"fcp_mma_cl does not support {shape} with pool {CL_POOL}")
    given = {k: int(v) for k, v in (params or {}).items() if v is not None}
    p = {**CL_DEFAULTS, **given}
    unknown = set(p) - set(CL_DEFAULTS)
    if unknown:
        raise ValueError(f"fcp_mma_cl: unknown parameters {sorted(unknown)}")
    hp, _ = pooled_hw(shape, CL_POOL)
    if "nv" not in given and hp % p["nv"]:
        p["nv"] = 1
    if p["korder"] not in KORDERS or p["nv"] < 1 or hp % p["nv"] or p["warps"] < 1:
        raise ValueError(f"fcp_mma_cl: bad parameters {p} for {hp} pooled rows")
    if p["split"] and hp // 2 // p["nv"] < 1:
        p["split"] = 0  # no whole upper half of units to start on
    defines = {"CL_H": shape.H, "CL_W": shape.W, "CL_K": shape.K, "CL_M": shape.M,
               "CL_WARPS": p["warps"], "CL_MINB": max(1, p["minb"]), "CL_KORDER": p["korder"],
               "CL_SPLIT": p["split"], "CL_NV": p["nv"]}
    return ClPlan(defines, p["warps"])


def cl_taps(korder: int) -> tuple[np.ndarray, np.ndarray]:
    """(column within the k-step's 4, channel) of each of a k-step's 16 k (see the .cu)."""
    kk = np.arange(16)
    if korder == 0:
        return kk // 4, kk % 4
    if korder == 1:
        return (kk % 8) // 2, 2 * (kk // 8) + kk % 2
    raise ValueError(f"korder must be 0 or 1, got {korder!r}")


def cl_a_matrices(w: np.ndarray, korder: int = 1) -> np.ndarray:
    """The 16 x 16 A operand of each k-step s = p * KS + h: A[s][m][kk] = w[m, c, p, 4h + q]
    with (q, c) = cl_taps(korder)[kk]; padding taps (q >= K) and rows m >= M are zero."""
    w = np.asarray(w, np.float32)
    M, C, K, K2 = w.shape
    if C != CL_CHANNELS or K != K2 or M > 16 or K > 8:
        raise ValueError(f"fcp_mma_cl weights must be (M<=16, 4, K<=8, K), got {w.shape}")
    ks = ceil_div(K, 4)
    wpad = np.zeros((16, C, K, 4 * ks), np.float32)
    wpad[:M, :, :, :K] = w
    q, c = cl_taps(korder)
    p = np.arange(K)[:, None, None, None]
    h = np.arange(ks)[None, :, None, None]
    m = np.arange(16)[None, None, :, None]
    a = wpad[m, c[None, None, None, :], p, 4 * h + q[None, None, None, :]]  # (K, ks, 16, 16)
    return a.reshape(K * ks, 16, 16)


def cl_fragments(w: np.ndarray, korder: int = 1) -> np.ndarray:
    """`cl_a_matrices` in per-lane mma register order, packed like fused_mma.wa_fragments:
    a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..), a3 = (row g+8,
    k 2t+8..), the lower k in the low half. Returns uint32 (steps, 32 lanes, 4 registers)."""
    a = cl_a_matrices(w, korder)
    s = np.arange(a.shape[0])[:, None]
    g, t = LANE_G[None, :], LANE_T[None, :]
    pack = pack_half2
    regs = [pack(a[s, g, 2 * t], a[s, g, 2 * t + 1]),
            pack(a[s, g + 8, 2 * t], a[s, g + 8, 2 * t + 1]),
            pack(a[s, g, 2 * t + 8], a[s, g, 2 * t + 9]),
            pack(a[s, g + 8, 2 * t + 8], a[s, g + 8, 2 * t + 9])]
    return np.ascontiguousarray(np.stack(regs, axis=-1).astype(np.uint32))


def prepare_conv2_cl(shape: ConvShape, w: Any, b: Any,
                     params: Mapping[str, Any] | None = None) -> Run:
    """run(x_cl, y): x_cl fp16 (B, H, W, 4) channels-last, y fp32 (B, M, Hp, Wp)."""
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel

    cp = require_cupy()
    plan = cl_plan(shape, params)
    kernel = get_kernel(KERNEL_FILE, "fcp_mma_cl", plan.defines)
    frag = cp.asarray(cl_fragments(np.asarray(to_numpy(w), np.float32),
                                   plan.defines["CL_KORDER"]))
    b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
    block = (plan.warps * 32,)

    def run(x: Any, y: Any) -> None:
        n = int(x.shape[0])
        if n:
            kernel((n,), block, (x, frag, b_d, y))

    return run


# ---------------------------------------------------------------------------------------------
# conv1: fcp_mma_toe_cl, kernel 17's Toeplitz kernel with the fp16 channels-last store
# ---------------------------------------------------------------------------------------------


# conv1 with the channels-last store: a block per image (TC_TPH = all 40 pooled rows, the
# input staged once) measured 0.246 ms vs 0.250 with kernel 17's 20 rows (H100, B=10000).
TOE_CL_TPH = 40


def _toe_smem(shape: ConvShape, tph: int) -> int:
    ng = ceil_div(2 * pooled_hw(shape, 2)[1], 8)
    return shape.C * ((2 * tph - 1) + shape.K) * (ng * 8 + 8) * 2


def toe_cl_plan(shape: ConvShape,
                params: Mapping[str, Any] | None = None) -> tuple[dict[str, int], int, int]:
    """(defines, tiles_h, warps) of fcp_mma_toe_cl: kernel 17's fp16 toeplitz plan; params may
    set warps, minb (passed to tc_plan) and tph (pooled rows a block; 0 = kernel 17's choice;
    default min(pooled rows, TOE_CL_TPH) where it fits shared memory)."""
    params = dict(params or {})
    tph = params.pop("tph", None)
    if tph is None:
        tph = min(pooled_hw(shape, 2)[0], TOE_CL_TPH)
        if _toe_smem(shape, tph) > SMEM_STATIC_LIMIT:
            tph = 0
    plan = tc_plan(shape, 2, "fp16", params)
    if plan.kernel != "fcp_mma_toe" or shape.M % 2:
        raise ValueError(f"the channels-last conv1 path needs the toeplitz plan, even M: {shape}")
    defines = dict(plan.defines)
    hp, _ = pooled_hw(shape, 2)
    tiles_h = plan.tiles_h
    if tph:  # 0: kernel 17's tile height
        defines["TC_TPH"] = int(tph)
        tiles_h = ceil_div(hp, int(tph))
        if not params.get("warps"):  # kernel 17's rule of thumb, for the new tile height
            ng = ceil_div(2 * pooled_hw(shape, 2)[1], 8)
            defines["TC_WARPS"] = min(2, ceil_div(int(tph) * ng, 8))
    return defines, tiles_h, defines["TC_WARPS"]


def prepare_conv1_cl(shape: ConvShape, w: Any, b: Any,
                     params: Mapping[str, Any] | None = None,
                     raw_hw: tuple[int, int] | None = None) -> Run:
    """run(x, y_cl): x fp32 NCHW (B, C, H, W), y_cl fp16 (B, Hp, Wp, M) channels-last.
    With raw_hw, x is raw uint8 images (B, *raw_hw) instead, resized to H x W while the tile
    is staged (`fcp_mma_toe_cl_raw`, kernels/resize.cuh)."""
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel

    cp = require_cupy()
    defines, tiles_h, warps = toe_cl_plan(shape, params)
    name, head = "fcp_mma_toe_cl", ()
    if raw_hw is not None:
        from convolab.gpu.resize import device_taps

        if shape.C != 1:
            raise ValueError(f"raw images have one channel; this layer takes {shape.C}")
        defines = {**defines, "RAW_H": raw_hw[0], "RAW_W": raw_hw[1]}
        name, head = "fcp_mma_toe_cl_raw", (device_taps(raw_hw[0], raw_hw[1], shape.H,
                                                         shape.W),)
    kernel = get_kernel(KERNEL_FILE, name, defines)
    frag = cp.asarray(toeplitz_fragments(np.asarray(to_numpy(w), np.float32), "fp16"))
    b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
    hp, wp = pooled_hw(shape, 2)
    i32 = np.int32
    tail = (i32(shape.H), i32(shape.W), i32(hp), i32(wp), i32(tiles_h))

    def run(x: Any, y: Any) -> None:
        n = int(x.shape[0])
        if n:
            kernel((n * tiles_h,), (warps * 32,), (x, *head, frag, b_d, y, *tail))

    return run


# ---------------------------------------------------------------------------------------------
# nvcc compile test hook (tests/test_nvcc_compile.py)
# ---------------------------------------------------------------------------------------------


def compile_jobs() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """Every (kernel file, defines) the fp16 channels-last path compiles, by a display name."""
    from convolab.models import conv_blocks

    c1, c3 = (block.shape for block in conv_blocks("ece408"))
    conv1 = [toe_cl_plan(c1, p)[0] for p in ({}, {"tph": 0}, {"warps": 4}, {"tph": 10})]
    conv2 = [cl_plan(c3, p).defines for p in ({}, {"nv": 1, "warps": 4}, {"korder": 0},
                                              {"split": 1}, {"nv": 4, "split": 1},
                                              {"nv": 1, "minb": 6}, {"warps": 8, "minb": 3})]
    return {"lenet-fp16-cl conv1 (fcp_mma_toe_cl)": [(KERNEL_FILE, d) for d in conv1],
            "lenet-fp16-cl conv2 (fcp_mma_cl)": [(KERNEL_FILE, d) for d in conv2]}
