"""Rung 29: a model's first block (one input channel, many output channels) as one kernel,
conv + bias + ReLU + max-pool, from raw uint8 images resized on chip or from float images,
writing the pooled map in fp32 or fp16:

    ff_conv_pool_raw / _f32   FFMA (precision fp32: modes 'exact' and 'tf32'),
                              kernels/29_fused_first_conv_pool.cu
    ff_toe_raw / _f32         fp16 tensor cores, Toeplitz mapping in channel groups,
                              kernels/29b_fused_first_conv_pool_mma.cu
    fr_conv_pool_raw / _f32   fp16 tensor cores, two filter rows per MMA and the channels in
                              its n ('fp16'), or each operand split in two fp16 parts
                              ('3xfp16': fp32 accuracy), kernels/29c_..._rowpair.cu
    frw_conv_pool_raw / _f32  the same operands on the warpgroup MMA (sm_90a), a warpgroup's
                              four m-tiles a wgmma, kernels/45_fused_first_conv_pool_wgmma.cu

`first_plan` picks the family, its defines and its launch geometry; `prepare(...)` returns
run(x, out), reading raw images (n, h, w) uint8 when prepared with `raw_hw`, else float images
(n, 1, H, W). A prepared run says what it reads and writes (`run.in_dtype`, `run.out_dtype`):
the fused network sizes its buffers from them. Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from convolab.errors import InputError
from convolab.gpu.device import SM_REGISTERS, SMEM_STATIC_LIMIT
from convolab.gpu.fused_ffma import ACC_BUDGET, pooled_hw, zoo_fused_layers
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "29_fused_first_conv_pool.cu"  # FFMA
TC_KERNEL_FILE = "29b_fused_first_conv_pool_mma.cu"  # fp16 tensor cores, Toeplitz
RP_KERNEL_FILE = "29c_fused_first_conv_pool_rowpair.cu"  # fp16 tensor cores, row pairs
WG_KERNEL_FILE = "45_fused_first_conv_pool_wgmma.cu"  # row pairs on the warpgroup MMA
OUT_DTYPES = ("float32", "float16")
PRECISIONS = ("fp32", "fp16", "3xfp16")  # FFMA; fp16 tensor cores; split fp16 (fp32-accurate)
# The `tc` parameter: which family runs a precision that has more than one.
TC_FFMA, TC_CHOOSE, TC_TOEPLITZ, TC_ROWPAIR, TC_WGMMA = -1, 0, 1, 2, 3
# What the fused network asks of rung 29 per precision of its mode (gpu/network.py): the split
# fp16 tensor cores are fp32-accurate, so they serve the exact and tf32 modes.
NETWORK_PRECISION = {"fp32": "3xfp16", "tf32": "3xfp16", "fp16": "fp16"}
# FFMA block sizes the planner chooses from: pool windows (one per thread) of a block.
THREAD_CHOICES = tuple(range(128, 513, 32))
# FFMA registers a thread needs, fitted to what ptxas used without spills (mxnet 88, eecs498
# 90 at 12 channels): the P*P*MT accumulators, a group's weights for one filter row, addresses.
REG_OVERHEAD = 40
FLOAT_BYTES = 4
# Tensor cores: the Toeplitz B operand gives 8 outputs from 16 input columns (K <= 9); a block
# stages at most TC_ROWS pooled rows, runs TC_WARPS warps, and holds one channel group's
# fragments (K x group x 2 registers): 6 channels up to K = 5 (124 registers), else 4 (114).
TC_MAX_K = 9
TC_ROWS = 16
TC_WARPS = 4
HALF_BYTES = 2


def _round4(n: int) -> int:
    return ceil_div(n, 4) * 4


# ---- FFMA -------------------------------------------------------------------------------------


def ffma_channels(shape: ConvShape, pool: int, params: Mapping[str, Any]) -> int:
    """Output channels of an FFMA channel group: mt * pool^2 accumulators within the register
    budget; the groups as even as they can be."""
    cap = max(1, ACC_BUDGET // (pool * pool))
    if params.get("mt"):
        return max(1, min(int(params["mt"]), cap, shape.M))
    return ceil_div(shape.M, ceil_div(shape.M, cap))


def default_threads(windows: int) -> int:
    """The block size (a multiple of 32) whose blocks cover an image's pool windows with the
    fewest idle threads; ties go to the larger block (fewer blocks stage the same rows)."""
    return min(THREAD_CHOICES, key=lambda t: (ceil_div(windows, t) * t, -t))


def band_rows(shape: ConvShape, pool: int, threads: int) -> int:
    """Input rows an FFMA block stages: its windows span at most ceil((threads-1)/Wp) + 1
    pooled rows (the kernel's FF_ROWS)."""
    _, wp = pooled_hw(shape, pool)
    return min(ceil_div(threads - 1, wp) * pool + pool - 1 + shape.K, shape.H)


def raw_stage_bytes(shape: ConvShape, raw_hw: tuple[int, int]) -> int:
    """first_block.cuh's FfRawRows: the byte -> [0, 1] table, the resize taps (3 words each)
    and the raw image, 16-aligned."""
    return ceil_div(FLOAT_BYTES * (256 + 3 * (shape.H + shape.W)) + raw_hw[0] * raw_hw[1],
                    16) * 16


def ffma_smem_bytes(shape: ConvShape, pool: int, threads: int, mt: int,
                    raw_hw: tuple[int, int] | None = None) -> int:
    """Static shared memory of an FFMA block: the band's rows (an even row stride), every
    group's weights and bias and, reading raw bytes, the raw staging and the band's row pass."""
    rows = band_rows(shape, pool, threads)
    band = rows * (shape.W + shape.W % 2) + 2
    weights = ceil_div(shape.M, mt) * (shape.K * shape.K + 1) * _round4(mt)
    if raw_hw is None:
        return FLOAT_BYTES * (band + weights)
    return (FLOAT_BYTES * (band + rows * raw_hw[1] + weights)
            + raw_stage_bytes(shape, raw_hw))


# ---- tensor cores -----------------------------------------------------------------------------


def tc_group(shape: ConvShape) -> int:
    return 6 if shape.K <= 5 else 4


def tc_rows(shape: ConvShape, pool: int) -> int:
    """Pooled rows of a block: the image's in as few even tiles of at most TC_ROWS as cover it."""
    hp, _ = pooled_hw(shape, pool)
    return ceil_div(hp, ceil_div(hp, TC_ROWS))


def tc_smem_bytes(shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None = None) -> int:
    """Static shared memory of a tensor-core block (fused_mma.cuh's TOE_IR x TOE_RS fp16 tile,
    and the raw staging and row pass)."""
    _, wp = pooled_hw(shape, pool)
    in_rows = 2 * tc_rows(shape, pool) - 1 + shape.K
    tile = HALF_BYTES * in_rows * (ceil_div(2 * wp, 8) * 8 + 8)
    if raw_hw is None:
        return tile
    return tile + raw_stage_bytes(shape, raw_hw) + FLOAT_BYTES * in_rows * raw_hw[1]


def tc_supports(shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None = None) -> bool:
    return (shape.C == 1 and shape.S == 1 and pool == 2 and shape.K <= TC_MAX_K
            and min(pooled_hw(shape, pool)) >= 1
            and tc_smem_bytes(shape, pool, raw_hw) <= SMEM_STATIC_LIMIT)


# ---- tensor cores, row pairs (29c) ------------------------------------------------------------

RP_MAX_K = 7  # two outputs an A row: 8 - K + 1 >= 2
RP_WARPS = 4
RP_SCALE = 14  # the largest |operand| scaled into [2^RP_SCALE, 2^(RP_SCALE + 1)) for 3xfp16
RP_EMAX = 60  # the kernel's FR_EMAX: both scale exponents stay within +-RP_EMAX


def rp_geometry(shape: ConvShape, tph: int) -> dict[str, int]:
    """The kernel's derived sizes (FR_D, FR_CN, FR_NT, FR_KS, FR_NR, FR_IR, FR_RS) for tph
    pooled rows a block."""
    _, wp = pooled_hw(shape, 2)
    d = 4 if shape.K <= 5 else 2
    nr = ceil_div(2 * wp, d)
    ks = ceil_div(shape.K, 2)
    return {"D": d, "CN": 8 // d, "NT": ceil_div(shape.M, 8 // d), "KS": ks, "NR": nr,
            "IR": 2 * tph + 2 * ks - 1, "RS": (nr - 1) * d + 8}


def rp_smem_bytes(shape: ConvShape, tph: int, split: bool,
                  raw_hw: tuple[int, int] | None = None) -> int:
    """Static shared memory of a row-pair block: the fp16 tile (hi and lo with the split), the
    max's scratch and, reading raw bytes, the raw staging and the row pass of the rows."""
    geo = rp_geometry(shape, tph)
    tile = HALF_BYTES * geo["IR"] * geo["RS"] * (2 if split else 1) + FLOAT_BYTES * RP_WARPS
    if raw_hw is None:
        return tile
    return tile + raw_stage_bytes(shape, raw_hw) + FLOAT_BYTES * geo["IR"] * raw_hw[1]


def rp_rows(shape: ConvShape, split: bool, raw_hw: tuple[int, int] | None = None) -> int:
    """Pooled rows of a block: the whole image (the raw bytes staged once) where it fits the
    static shared memory, else the image's in as few even tiles as fit."""
    hp, _ = pooled_hw(shape, 2)
    for tiles in range(1, hp + 1):
        tph = ceil_div(hp, tiles)
        if rp_smem_bytes(shape, tph, split, raw_hw) <= SMEM_STATIC_LIMIT:
            return tph
    return 0


def rp_supports(shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None = None,
                split: bool = False) -> bool:
    return (shape.C == 1 and shape.S == 1 and pool == 2 and shape.K <= RP_MAX_K
            and min(pooled_hw(shape, pool)) >= 1 and rp_rows(shape, split, raw_hw) > 0)


def pow2_exponent(largest: float) -> int:
    """e with largest * 2^e in [2^RP_SCALE, 2^(RP_SCALE + 1)), within +-RP_EMAX (0 for 0)."""
    if not np.isfinite(largest) or largest <= 0:
        return 0
    return int(np.clip(RP_SCALE - np.floor(np.log2(largest)), -RP_EMAX, RP_EMAX))


def _rowpair_parts(w: np.ndarray, split: bool) -> tuple[list[np.ndarray], int]:
    """The row-pair B operand as float32 arrays [s][n-tile][k][n] (16 x 8 per k-step and
    n-tile), one per part, and the weights' scale exponent (0 without the split).
    B[k][c * D + dx] = w[c][2s + k // 8][k % 8 - dx] of n-tile channels c; with the split, part
    0 is hi = fp16(w 2^e), part 1 lo = fp16(w 2^e - hi)."""
    M, _, K, _ = w.shape
    geo = rp_geometry(ConvShape(1, 1, K, K, M, K), 1)
    d, cn, nt, ks = geo["D"], geo["CN"], geo["NT"], geo["KS"]
    wpad = np.zeros((nt * cn, 2 * ks, K), np.float64)
    wpad[:M, :K] = np.asarray(w, np.float64)[:, 0]
    e = pow2_exponent(float(np.abs(wpad).max())) if split else 0
    band = np.zeros((ks, nt, 16, 8), np.float64)  # [s][n-tile][k][n]
    for k in range(16):
        for n in range(8):
            j = k % 8 - n % d  # the tap of output dx = n % d
            if 0 <= j < K:
                band[:, :, k, n] = wpad[np.arange(nt)[None, :] * cn + n // d,
                                        2 * np.arange(ks)[:, None] + k // 8, j]
    scaled = (band * 2.0 ** e).astype(np.float32)
    hi = scaled.astype(np.float16).astype(np.float32)
    return ([hi, (scaled - hi)] if split else [scaled]), e


def rowpair_fragments(w: np.ndarray, split: bool) -> tuple[np.ndarray, int]:
    """29c's B operand per lane, uint32 (parts, KS, NT, 32 lanes, 2 registers) from
    _rowpair_parts, and the weights' scale exponent."""
    from convolab.gpu.fused_mma import LANE_G, LANE_T, pack_half2

    parts, e = _rowpair_parts(w, split)
    g, t = LANE_G, LANE_T
    frags = [np.stack([pack_half2(p[:, :, 2 * t, g], p[:, :, 2 * t + 1, g]),
                       pack_half2(p[:, :, 2 * t + 8, g], p[:, :, 2 * t + 9, g])], axis=-1)
             for p in parts]
    return np.ascontiguousarray(np.stack(frags).astype(np.uint32)), e


def rowpair_wgmma_tiles(w: np.ndarray, split: bool) -> tuple[np.ndarray, int]:
    """Rung 45's B operand as its shared memory holds it: uint16 fp16 bits (parts, KS, NT, 2, 8,
    8) — per (part, k-step) NT x 2 core matrices of 8 columns x 8 k (k 8-15 the second), each
    column's 8 k contiguous — and the weights' scale exponent. With the split and an odd K, the
    last k-step's filter row 2 KS - 1 is zero: its hi tile holds row K - 1's hi in both k
    halves instead, which the kernel multiplies by [hi | lo] of the input (odd_last_step)."""
    parts, e = _rowpair_parts(w, split)
    if odd_last_step(w.shape[2], split):
        parts[0][-1, :, 8:] = parts[0][-1, :, :8]
    # [s][nt][k][n] -> [s][nt][k half][n][k % 8]
    tiles = [p.reshape(*p.shape[:2], 2, 8, 8).transpose(0, 1, 2, 4, 3) for p in parts]
    return np.ascontiguousarray(np.stack(tiles).astype(np.float16)).view(np.uint16), e


# ---- row pairs on the warpgroup MMA (45) --------------------------------------------------------


def odd_last_step(K: int, split: bool) -> bool:
    """Whether rung 45 runs the last k-step of the split in two wgmmas instead of three (odd K
    above 1: that step's second filter row is zero, so its k 8-15 carry the input's lo part;
    K = 1's only step also starts the sums)."""
    return split and K % 2 == 1 and K > 1

# The precisions the unasked choice (tc = 0, the fused network's) runs on rung 45 where it
# takes the shape. H200, B = 10,000 (docs/raw.md, "Rung 45"): the exact forward 1.178 ms with
# conv1 on 45 against 1.311 on 29c (eecs498), 1.247 against 1.358 (mxnet); the fp16 forward a
# tie (0.604 / 0.610 and 0.628 / 0.610 ms, eecs498; its conv1 writes fp16 maps through shared
# memory either way), so fp16 stays on 29c.
WG_CHOSEN = ("3xfp16",)
WG_NT = (1, 2, 3, 4, 6, 8)  # n-tiles a wgmma takes (wgmma_rs.cuh's N = 8 NT)
WG_WARPS = 4  # one warpgroup a block


def wg_b_bytes(shape: ConvShape, split: bool) -> int:
    """FR_B_BYTES: the B tiles of every (part, k-step), 256 bytes an n-tile."""
    geo = rp_geometry(shape, 1)
    return (2 if split else 1) * geo["KS"] * geo["NT"] * 256


def wg_why_not(shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None = None,
               split: bool = False) -> str | None:
    """None where rung 45 takes the first block, else why not."""
    from convolab.gpu.implicit_gemm_wgmma import wgmma_ruled_out

    if not rp_supports(shape, pool, raw_hw, split):
        return "rung 29c's row pairs do not take the shape (C = 1, stride 1, pool 2, K <= 7)"
    if rp_geometry(shape, 1)["NT"] not in WG_NT:
        return f"wgmma N = 8 NT needs NT in {WG_NT} (M = {shape.M}, K = {shape.K})"
    if wgmma_ruled_out():
        return "this GPU cannot run sm_90a code (wgmma)"
    return None


def wg_supports(shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None = None,
                split: bool = False) -> bool:
    return wg_why_not(shape, pool, raw_hw, split) is None


# ---- either -----------------------------------------------------------------------------------


def supports(shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None = None) -> bool:
    """The FFMA family: one input channel, stride 1, a pooled output, and a block's rows,
    weights (and raw image) in static shared memory at the smallest block."""
    if shape.C != 1 or shape.S != 1 or pool < 1 or pool * pool > ACC_BUDGET:
        return False
    if min(pooled_hw(shape, pool)) < 1:
        return False
    mt = ffma_channels(shape, pool, {})
    return ffma_smem_bytes(shape, pool, min(THREAD_CHOICES), mt, raw_hw) <= SMEM_STATIC_LIMIT


def wide_models() -> tuple[str, ...]:
    """The zoo models whose first block the fused network runs on rung 29 by default."""
    from convolab.models import MODELS, conv_blocks

    return tuple(m for m in MODELS if preferred(conv_blocks(m)[0].shape, conv_blocks(m)[0].pool))


def preferred(shape: ConvShape, pool: int) -> bool:
    """Whether the fused network runs a first block on rung 29 without being asked: where it
    takes the shape and fcp_exact_cw (rung 16: all channels in one thread's multi-window tile,
    weights as constant-bank operands) does not — ece408's conv1 (M = 4) stays on 16 (0.558
    vs 0.774 ms on H100) and its tensor-core / channels-last variants (17: 0.259 vs 0.299)."""
    from convolab.gpu.fused_ffma import cw_fits

    return supports(shape, pool) and not cw_fits(shape, 4 if shape.M >= 3 else shape.M)


@dataclass(frozen=True)
class FirstPlan:
    """Compile-time defines and launch geometry of one rung-29 kernel."""

    kernel: str  # ff_conv_pool_*, ff_toe_*, fr_conv_pool_* or frw_conv_pool_* (raw or f32)
    defines: dict[str, int]
    threads: int
    blocks_per_image: int
    channels: int  # output channels of a group (FF_MT, FF_GC; the layer's M for row pairs)
    smem: int = 0  # dynamic shared memory a block (29c's staged output, FR_OUT_SMEM)

    @property
    def tensor_cores(self) -> bool:
        return not self.kernel.startswith("ff_conv")

    @property
    def kernel_file(self) -> str:
        return {"ff_conv": KERNEL_FILE, "ff_toe_": TC_KERNEL_FILE,
                "fr_conv": RP_KERNEL_FILE, "frw_con": WG_KERNEL_FILE}[self.kernel[:7]]


def _family(shape: ConvShape, pool: int, params: Mapping[str, Any],
            raw_hw: tuple[int, int] | None, precision: str) -> str:
    """'wgmma' (45), 'rowpair' (29c), 'toe' (29b) or 'ffma' (29) for a precision and the `tc`
    parameter: each tensor-core precision takes the first family of its order that takes the
    shape (45 unasked only in the precisions of WG_CHOSEN)."""
    tc = int(params.get("tc") or TC_CHOOSE)
    split = precision == "3xfp16"
    if precision == "fp32" or tc == TC_FFMA:
        return "ffma"
    if (tc == TC_WGMMA or (tc == TC_CHOOSE and precision in WG_CHOSEN)) \
            and wg_supports(shape, pool, raw_hw, split):
        return "wgmma"
    if tc in (TC_CHOOSE, TC_ROWPAIR, TC_WGMMA) and rp_supports(shape, pool, raw_hw, split):
        return "rowpair"
    if not split and tc in (TC_CHOOSE, TC_TOEPLITZ) and tc_supports(shape, pool, raw_hw):
        return "toe"
    return "ffma"


def first_plan(shape: ConvShape, pool: int, params: Mapping[str, Any] | None = None,
               raw_hw: tuple[int, int] | None = None, out_dtype: str = "float32",
               precision: str = "fp32") -> FirstPlan:
    """precision 'fp16' runs fp16 tensor cores where they take the shape (29c's row pairs, else
    29b's Toeplitz operand; params tc = 1 / 2 asks for one, -1 keeps FFMA), '3xfp16' 29c's split
    (else FFMA), 'fp32' FFMA. FFMA params may fix threads (pool windows per block), minb (blocks
    per SM the registers must allow) and mt (channels per group); tensor-core params warps,
    minb and (29c) rows, pooled rows a block, and osm (1: the output through shared memory, the
    default for fp16 output); 0 or absent means choose."""
    params = params or {}
    if out_dtype not in OUT_DTYPES or precision not in PRECISIONS:
        raise ValueError(f"rung 29: out_dtype must be one of {OUT_DTYPES} and precision one of "
                         f"{PRECISIONS}, got {out_dtype!r}, {precision!r}")
    entry = "raw" if raw_hw is not None else "f32"
    base = {"FF_K": shape.K, "FF_P": pool, "FF_H": shape.H, "FF_W": shape.W,
            "FF_HALF": int(out_dtype == "float16")}
    if raw_hw is not None:
        base |= {"RAW_H": raw_hw[0], "RAW_W": raw_hw[1]}
    family = _family(shape, pool, params, raw_hw, precision)
    if family in ("rowpair", "wgmma"):
        return _rowpair_plan(shape, params, base, entry, precision == "3xfp16", raw_hw,
                             family == "wgmma")
    if family == "toe":
        warps = int(params.get("warps") or TC_WARPS)
        tph = tc_rows(shape, pool)
        defines = {**base, "FF_GC": tc_group(shape), "FF_TPH": tph,
                   "FF_WARPS": warps, "FF_MINB": int(params.get("minb") or 1)}
        return FirstPlan(f"ff_toe_{entry}", defines, 32 * warps,
                         ceil_div(pooled_hw(shape, pool)[0], tph), tc_group(shape))
    if not supports(shape, pool, raw_hw):
        raise ValueError(f"rung 29 (fused first block) does not support {shape} with pool "
                         f"{pool}" + (f" from raw {raw_hw[0]}x{raw_hw[1]} images" if raw_hw
                                      else ""))
    return _ffma_plan(shape, pool, params, base, entry)


def _rowpair_plan(shape: ConvShape, params: Mapping[str, Any], base: dict[str, int],
                  entry: str, split: bool, raw_hw: tuple[int, int] | None,
                  wgmma: bool = False) -> FirstPlan:
    hp, _ = pooled_hw(shape, 2)
    tph = min(int(params.get("rows") or rp_rows(shape, split, raw_hw)), hp)
    warps = int(params.get("warps") or (WG_WARPS if wgmma else RP_WARPS))
    rung = "45" if wgmma else "29c"
    if not 1 <= warps <= 32 or (wgmma and warps % 4) \
            or rp_smem_bytes(shape, tph, split, raw_hw) > SMEM_STATIC_LIMIT:
        raise ValueError(f"rung {rung}: {tph} pooled rows a block of {shape} exceed the static "
                         f"shared memory ({SMEM_STATIC_LIMIT} bytes), or warps {warps} "
                         f"is not in 1..32" + (" (a multiple of 4)" if wgmma else ""))
    # The output through shared memory (osm = 1) sends whole sectors to L2 where an m-tile's
    # stores write half (fp16, K = 7: 16 bytes a channel) or unaligned ones. Nsight Compute
    # (B = 10,000, docs/raw.md), fp16 from floats: H100 eecs498 206 vs 298 us, mxnet 228 vs 255;
    # H200 204 vs 238 and 223 vs 213. Off for fp32 output (H200: 446-452 vs 419-423 us) and
    # from raw bytes, whose staging leaves too little shared memory (H200, eecs498: 0.757 vs
    # 0.745 ms a forward).
    half = base["FF_HALF"] == 1
    osm = int(params.get("osm", int(half and raw_hw is None)))
    if osm not in (0, 1):
        raise ValueError(f"rung {rung}: osm (output through shared memory) is 0 or 1, got {osm}")
    defines = {**base, "FR_M": shape.M, "FR_SPLIT": int(split), "FR_TPH": tph,
               "FR_WARPS": warps, "FF_MINB": int(params.get("minb") or 1), "FR_OUT_SMEM": osm}
    smem = osm * shape.M * tph * pooled_hw(shape, 2)[1] * (HALF_BYTES if half else FLOAT_BYTES)
    if wgmma:
        smem += wg_b_bytes(shape, split)

    return FirstPlan(f"fr{'w' if wgmma else ''}_conv_pool_{entry}", defines, 32 * warps,
                     ceil_div(hp, tph), shape.M, smem)


def _ffma_plan(shape: ConvShape, pool: int, params: Mapping[str, Any], base: dict[str, int],
               entry: str) -> FirstPlan:
    hp, wp = pooled_hw(shape, pool)
    mt = ffma_channels(shape, pool, params)
    threads = int(params.get("threads") or default_threads(hp * wp))
    raw_hw = (base["RAW_H"], base["RAW_W"]) if "RAW_H" in base else None
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"rung 29: threads must be a multiple of 32 in 32..1024, got {threads}")
    if ffma_smem_bytes(shape, pool, threads, mt, raw_hw) > SMEM_STATIC_LIMIT:
        raise ValueError(f"rung 29: {threads} threads' rows of {shape} exceed the static "
                         f"shared memory ({SMEM_STATIC_LIMIT} bytes)")
    need = mt * pool * pool + REG_OVERHEAD
    minb = int(params.get("minb") or max(1, SM_REGISTERS // (threads * need)))
    defines = {**base, "FF_MT": mt, "FF_G": ceil_div(shape.M, mt),
               "FF_THREADS": threads, "FF_MINB": minb}
    return FirstPlan(f"ff_conv_pool_{entry}", defines, threads, ceil_div(hp * wp, threads), mt)


def ffma_weights(w: np.ndarray, b: np.ndarray, mt: int) -> np.ndarray:
    """Weights and bias as the FFMA kernel stages them: every group's [K*K][mt4] block, then
    every group's bias [mt4] (mt4: mt rounded up to whole float4s), zero-padded."""
    M, K = w.shape[0], w.shape[-1]
    groups, mt4 = ceil_div(M, mt), _round4(mt)
    blocks = np.zeros((groups, K * K, mt4), np.float32)
    biases = np.zeros((groups, mt4), np.float32)
    taps = np.asarray(w, np.float32).reshape(M, K * K)
    for m in range(M):
        g, j = divmod(m, mt)
        blocks[g, :, j] = taps[m]
        biases[g, j] = b[m]
    return np.concatenate([blocks.ravel(), biases.ravel()])


def toe_weights(w: np.ndarray, group: int) -> tuple[np.ndarray, int]:
    """kernel 17's fp16 Toeplitz fragments of the channels zero-padded to whole groups, and that
    padded channel count."""
    from convolab.gpu.fused_mma import toeplitz_fragments

    M = w.shape[0]
    m_pad = ceil_div(M, group) * group
    wpad = np.zeros((m_pad, *w.shape[1:]), np.float32)
    wpad[:M] = w
    return toeplitz_fragments(wpad, "fp16"), m_pad


def prepare(shape: ConvShape, pool: int, weight: Any, bias: Any,
            kernel_params: Mapping[str, Any] | None = None,
            raw_hw: tuple[int, int] | None = None, out_dtype: str = "float32",
            precision: str = "fp32", staged: Mapping[str, int] | None = None) -> Run:
    """run(x, out): x raw uint8 images (n, *raw_hw) when raw_hw is given (resized on chip to
    shape.H x shape.W, the rule of data.resize_bilinear), else float32 images (n, 1, H, W);
    out (n, M, Hp, Wp) in out_dtype. n may be any batch size. precision 'fp16' runs fp16
    tensor cores where they take the shape, '3xfp16' split fp16 ones (fp32 accuracy), 'fp32'
    FFMA (first_plan). With `staged` (a record layout, fused_wgmma.staged_record), rung 45 in
    3xfp16 writes the next block's staged records instead: out uint16 (n, record elements)."""
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel
    from convolab.gpu.resize import device_taps

    plan = first_plan(shape, pool, kernel_params, raw_hw, out_dtype, precision)
    w, b = np.asarray(to_numpy(weight), np.float32), np.asarray(to_numpy(bias), np.float32)
    if w.shape != shape.w_shape or b.shape != (shape.M,):
        raise InputError(f"rung 29: weight {w.shape} and bias {b.shape} do not fit {shape} "
                         f"(want {shape.w_shape} and ({shape.M},))")
    if staged is not None:
        plan = _staged_plan(plan, shape, staged)
        b = staged_bias(w, b)
    cp = require_cupy()
    kernel = get_kernel(plan.kernel_file, plan.kernel, plan.defines)
    if plan.smem:
        kernel.max_dynamic_shared_size_bytes = plan.smem
    i32 = np.int32
    if plan.kernel_file in (RP_KERNEL_FILE, WG_KERNEL_FILE):
        pack = rowpair_wgmma_tiles if plan.kernel_file == WG_KERNEL_FILE else rowpair_fragments
        frag, w_e = pack(w, bool(plan.defines["FR_SPLIT"]))
        args = (cp.asarray(frag), cp.asarray(b))
        tail = (i32(w_e), i32(plan.blocks_per_image))
    elif plan.tensor_cores:
        frag, m_pad = toe_weights(w, plan.channels)
        args: tuple[Any, ...] = (cp.asarray(frag), cp.asarray(b))
        tail: tuple[Any, ...] = (i32(shape.M), i32(m_pad), i32(plan.blocks_per_image))
    else:
        args, tail = (cp.asarray(ffma_weights(w, b, plan.channels)),), (i32(shape.M),)
    if raw_hw is not None:
        args = (device_taps(raw_hw[0], raw_hw[1], shape.H, shape.W), *args)
    if staged is not None:
        return _checked_run(kernel, plan, args, tail, shape, pool, raw_hw, "uint16",
                            (staged["FR_STG_REC"] // 2,))
    return _checked_run(kernel, plan, args, tail, shape, pool, raw_hw, out_dtype)


def staged_bias(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The bias as rung 45 reads it when it writes staged records: the biases, then the bound of
    the next block's scale, W1 = the largest sum of |w| over a filter and B1 = the largest |b|
    (rounded up: still a bound)."""
    out = np.concatenate([b, [np.abs(w.astype(np.float64)).sum(axis=(1, 2, 3)).max(),
                              np.abs(b.astype(np.float64)).max()]]).astype(np.float32)
    out[-2:] = np.nextafter(out[-2:], np.float32(np.inf))
    return out


# The staged records' stores are a lane's 4 consecutive channels of one pixel where a row-pair
# A row holds 2 output columns (K > 5); with 4 (K <= 5) a lane's values scatter over pixel
# pairs, and mxnet's conv1 took 943 us writing records against 306 writing fp32 maps (H200,
# docs/raw.md "Rung 46"), so the handoff is taken from K > 5 only.
STAGED_MIN_K = 6


def staged_takes(shape: ConvShape, pool: int, kernel_params: Mapping[str, Any],
                 raw_hw: tuple[int, int] | None) -> bool:
    """Whether rung 45 writes this first block as the next block's staged records: where the
    network's exact conv1 runs on 45 with the split and a whole image a block, K >=
    STAGED_MIN_K."""
    if shape.K < STAGED_MIN_K:
        return False
    try:
        plan = first_plan(shape, pool, kernel_params, raw_hw, "float32", "3xfp16")
    except ValueError:
        return False
    return _can_write_records(plan)


def _can_write_records(plan: FirstPlan) -> bool:
    """Rung 45 with the split, a whole image a block (one scale) and no staged fp32 output."""
    return (plan.kernel_file == WG_KERNEL_FILE and plan.defines["FR_SPLIT"] == 1
            and plan.blocks_per_image == 1 and not plan.defines["FR_OUT_SMEM"])


def _staged_plan(plan: FirstPlan, shape: ConvShape, staged: Mapping[str, int]) -> FirstPlan:
    if not _can_write_records(plan):
        raise ValueError(f"rung 45: staged records need the split on 45, a whole image a "
                         f"block and no staged output ({plan.kernel} {plan.defines})")
    keys = ("FR_STG_WS", "FR_STG_CS", "FR_STG_IMG1", "FR_STG_REC")
    if set(staged) != set(keys) or staged["FR_STG_CS"] < shape.M \
            or staged["FR_STG_WS"] < pooled_hw(shape, 2)[1]:
        raise ValueError(f"rung 45: a staged layout names {keys} and holds the {shape.M} "
                         f"channels and the pooled row, got {dict(staged)}")
    return replace(plan, defines={**plan.defines, "FR_STG": 1,
                                              **{k: int(staged[k]) for k in keys}})


def _checked_run(kernel: Any, plan: FirstPlan, args: tuple[Any, ...], tail: tuple[Any, ...],
                 shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None,
                 out_dtype: str, out_tail: tuple[int, ...] | None = None) -> Run:
    in_tail = tuple(raw_hw) if raw_hw is not None else (1, shape.H, shape.W)
    out_tail = out_tail or (shape.M, *pooled_hw(shape, pool))
    in_dtype = np.dtype(np.uint8 if raw_hw is not None else np.float32)

    def run(x: Any, out: Any) -> None:
        n = int(x.shape[0])
        if x.dtype != in_dtype or tuple(x.shape[1:]) != in_tail or not x.flags.c_contiguous:
            raise InputError(f"rung 29: input must be contiguous {in_dtype} "
                             f"(n, {', '.join(map(str, in_tail))}), got {x.dtype} "
                             f"{tuple(x.shape)}")
        if out.dtype != out_dtype or tuple(out.shape) != (n, *out_tail):
            raise InputError(f"rung 29: out must be {out_dtype} {(n, *out_tail)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        if n:
            kernel((n * plan.blocks_per_image,), (plan.threads,), (x, *args, out, *tail),
                   shared_mem=plan.smem)

    run.in_dtype = in_dtype.name  # type: ignore[attr-defined]
    run.out_dtype = out_dtype  # type: ignore[attr-defined]
    run.out_tail = out_tail  # type: ignore[attr-defined]
    run.plan = plan  # type: ignore[attr-defined]  # for tests and benchmarks
    return run


# ---- registry entries: float input, fp32 output -----------------------------------------------


def first_layers() -> list[tuple[ConvShape, int]]:
    """(shape, pool) of every zoo conv layer rung 29 takes (batch 1)."""
    return [(s, p) for s, p in zoo_fused_layers() if supports(s, p)]


def compile_variants(precision: str, tc: int) -> list[dict[str, int]]:
    """Every define set the host compiles for the zoo's first layers in one precision and
    family (`tc`): fp32 and fp16 output, float input and Fashion-MNIST's 28x28 raw images."""
    from convolab.data import IMAGE_SIDE

    file = {TC_FFMA: KERNEL_FILE, TC_TOEPLITZ: TC_KERNEL_FILE, TC_ROWPAIR: RP_KERNEL_FILE,
            TC_WGMMA: WG_KERNEL_FILE}[tc]
    variants: list[dict[str, int]] = []
    for shape, pool in first_layers():
        for out_dtype in OUT_DTYPES:
            for raw_hw in (None, (IMAGE_SIDE, IMAGE_SIDE)):
                plan = first_plan(shape, pool, {"tc": tc}, raw_hw, out_dtype, precision)
                if plan.defines not in variants and plan.kernel_file == file:
                    variants.append(plan.defines)
    if tc == TC_WGMMA and precision == "3xfp16":
        variants += [v for v in staged_variants() if v not in variants]
    return variants


def staged_variants() -> list[dict[str, int]]:
    """Rung 45's define sets that write the next block's staged records: each zoo model whose
    exact forward runs that pair (rung 46 fed by records), float and 28x28 raw input."""
    from convolab.data import IMAGE_SIDE
    from convolab.gpu import fused_wgmma
    from convolab.models import MODELS, conv_blocks

    out: list[dict[str, int]] = []
    for model in MODELS:
        blocks = conv_blocks(model, 1)
        if len(blocks) < 2 or not fused_wgmma.staged_takes(blocks[1].shape, blocks[1].pool,
                                                           "3xfp16", {}):
            continue
        first, second = blocks[0], blocks[1]
        layout = fused_wgmma.staged_record(
            fused_wgmma.ws_plan(second.shape, "3xfp16", {}, fused_wgmma.STAGED).defines)
        for raw_hw in (None, (IMAGE_SIDE, IMAGE_SIDE)):
            if staged_takes(first.shape, first.pool, {}, raw_hw):
                plan = first_plan(first.shape, first.pool, {}, raw_hw, "float32", "3xfp16")
                out.append(_staged_plan(plan, first.shape, layout).defines)
    return out


def _prepare_impl(pool: int, precision: str, tc: int) -> Any:
    def prepare_impl(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        return prepare(shape, pool, w, b, {**params, "tc": tc}, precision=precision)

    return prepare_impl


FIRST_POOL = 2  # the zoo's first blocks all pool 2x2
FIRST_IMPL = register(ConvImpl(
    name=f"fused-first-conv-pool{FIRST_POOL}",
    demonstrates=("a first block (C = 1, many output channels) as one kernel: conv + bias + "
                  "ReLU + max-pool, one pool window of every channel group per thread, the "
                  "input band staged once, coalesced pooled stores; raw uint8 input resized on "
                  "chip, fp16 output for an fp16 next layer"),
    device="gpu",
    prepare=_prepare_impl(FIRST_POOL, "fp32", TC_FFMA),
    supports=lambda s: supports(s, FIRST_POOL),
    space={"threads": [128, 160, 224, 256, 288], "minb": [1, 2, 3, 4], "mt": [4, 8, 12, 16]},
    defaults={"threads": 0, "minb": 0, "mt": 0},
    tolerance=TOLERANCE["fp32"],
    rung=29,
    kernel_file=KERNEL_FILE,
    compile_variants=lambda: compile_variants("fp32", TC_FFMA),
    pool=FIRST_POOL,
))
FIRST_TC_IMPL = register(ConvImpl(
    name=f"fused-first-conv-pool{FIRST_POOL}-tc",
    demonstrates=("rung 29 on fp16 tensor cores: kernel 17's Toeplitz mapping (positions as A "
                  "rows, banded weights as B) for many output channels, in channel groups over "
                  "one staged fp16 tile"),
    device="gpu",
    prepare=_prepare_impl(FIRST_POOL, "fp16", TC_TOEPLITZ),
    supports=lambda s: tc_supports(s, FIRST_POOL),
    space={"warps": [2, 4, 8], "minb": [1, 2, 3]},
    defaults={"warps": 0, "minb": 0},
    tolerance=TOLERANCE["fp16"],
    rung=29,
    kernel_file=TC_KERNEL_FILE,
    compile_variants=lambda: compile_variants("fp16", TC_TOEPLITZ),
    pool=FIRST_POOL,
))
FIRST_RP_IMPL = register(ConvImpl(
    name=f"fused-first-conv-pool{FIRST_POOL}-rowpair",
    demonstrates=("rung 29 on fp16 tensor cores with two filter rows per MMA (an A row is 8 "
                  "pixels of two input rows) and the output channels in its n: 10-14 of 16 "
                  "k-terms useful instead of K, every channel's fragments in registers, one "
                  "pass over the staged image"),
    device="gpu",
    prepare=_prepare_impl(FIRST_POOL, "fp16", TC_ROWPAIR),
    supports=lambda s: rp_supports(s, FIRST_POOL),
    space={"warps": [2, 4, 8], "minb": [1, 2, 3], "rows": [0, 4, 8, 16]},
    defaults={"warps": 0, "minb": 0, "rows": 0},
    tolerance=TOLERANCE["fp16"],
    rung=29,
    kernel_file=RP_KERNEL_FILE,
    compile_variants=lambda: compile_variants("fp16", TC_ROWPAIR),
    pool=FIRST_POOL,
))
FIRST_3X_IMPL = register(ConvImpl(
    name=f"fused-first-conv-pool{FIRST_POOL}-3xfp16",
    demonstrates=("rung 29c at fp32 accuracy on fp16 tensor cores: each operand split into "
                  "power-of-two-scaled hi and lo fp16 parts, three MMAs per product (lo*hi, "
                  "hi*lo, hi*hi), fp32 accumulation"),
    device="gpu",
    prepare=_prepare_impl(FIRST_POOL, "3xfp16", TC_ROWPAIR),
    supports=lambda s: rp_supports(s, FIRST_POOL, split=True),
    space={"warps": [2, 4, 8], "minb": [1, 2, 3], "rows": [0, 4, 8, 16]},
    defaults={"warps": 0, "minb": 0, "rows": 0},
    tolerance=TOLERANCE["3xfp16"],
    rung=29,
    kernel_file=RP_KERNEL_FILE,
    compile_variants=lambda: compile_variants("3xfp16", TC_ROWPAIR),
    pool=FIRST_POOL,
))
WG_DEMONSTRATES = {
    "fp16": ("rung 29c's row pairs on the warpgroup MMA (sm_90a): a warpgroup's 64 rows are four "
             "m-tiles, their A quads in registers as 29c loads them, the weights as B by "
             "descriptor from shared memory, one m64nNk16 wgmma for every channel of a k-step"),
    "3xfp16": ("rung 45 at fp32 accuracy: 29c's hi/lo fp16 split, three wgmmas per k-step "
               "(lo*hi, hi*lo, hi*hi) into one fp32 accumulator set"),
}


def _wgmma_impl(precision: str) -> ConvImpl:
    """Rung 45's registry entry in one precision (fp16 or 3xfp16)."""
    split = precision == "3xfp16"
    return register(ConvImpl(
        name=f"fused-first-conv-pool{FIRST_POOL}-wgmma" + ("-3xfp16" if split else ""),
        demonstrates=WG_DEMONSTRATES[precision],
        device="gpu",
        prepare=_prepare_impl(FIRST_POOL, precision, TC_WGMMA),
        supports=lambda s: wg_supports(s, FIRST_POOL, split=split),
        space={"warps": [4, 8], "minb": [1, 2, 3, 4, 5, 6], "rows": [0, 4, 8, 16],
               "osm": [0, 1]},
        defaults={"warps": 0, "minb": 0, "rows": 0, "osm": 0},
        tolerance=TOLERANCE[precision],
        rung=45,
        kernel_file=WG_KERNEL_FILE,
        compile_variants=lambda: compile_variants(precision, TC_WGMMA),
        pool=FIRST_POOL,
    ))


FIRST_WG_IMPL = _wgmma_impl("fp16")
FIRST_WG_3X_IMPL = _wgmma_impl("3xfp16")

# Each registry entry's precision and family: what its raw entry runs (prepare_registered).
REGISTERED: dict[str, tuple[str, int]] = {
    FIRST_IMPL.name: ("fp32", TC_FFMA), FIRST_TC_IMPL.name: ("fp16", TC_TOEPLITZ),
    FIRST_RP_IMPL.name: ("fp16", TC_ROWPAIR), FIRST_3X_IMPL.name: ("3xfp16", TC_ROWPAIR),
    FIRST_WG_IMPL.name: ("fp16", TC_WGMMA), FIRST_WG_3X_IMPL.name: ("3xfp16", TC_WGMMA)}


def prepare_registered(name: str, shape: ConvShape, weight: Any, bias: Any,
                       params: Mapping[str, Any], raw_hw: tuple[int, int] | None) -> Run:
    """A registry entry's run with its parameters, reading raw images where raw_hw is given
    (the bench's raw per-layer rows); fp32 output."""
    precision, tc = REGISTERED[name]
    return prepare(shape, FIRST_POOL, weight, bias, {**params, "tc": tc}, raw_hw,
                   precision=precision)
