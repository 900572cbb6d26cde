"""Rungs 26-27: implicit-GEMM convolution on the tensor cores (mma.sync) for large channel
counts, and its split-K form for small outputs (kernels/igemm.cuh, 26_*.cu, 27_*.cu).

The GEMM is M x N x Kd with N = B*Ho*Wo and Kd = K*K*Cp, Cp = C rounded up to `CHANNEL_ALIGN`
so that every 16-byte copy stays inside one tap. `prepare` lays the weights out once as
(M, K, K, Cp) in the operand type; `run` makes x channels-last in that type (a counted kernel;
skipped where x already is, fp32 modes on 1x1 images with aligned C), then launches the GEMM
(and, for split-K, the ordered reduction). Everything above `prepare` is pure Python and is
tested on the CPU. CuPy is imported inside `prepare` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from convolab.backend import require_cupy
from convolab.gpu.compile import get_kernel, pairwise_points
from convolab.gpu.launch import BoundLaunch
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

MMA_FILE = "26_implicit_gemm_mma.cu"
SPLITK_FILE = "27_implicit_gemm_splitk.cu"
# 3xfp16 (4) exists in the wgmma rungs only (39-40: implicit_gemm_wgmma.py).
MODES: dict[str, int] = {"tf32": 0, "fp16": 1, "bf16": 2, "3xtf32": 3, "3xfp16": 4}
CHANNEL_ALIGN = 8  # Cp: one 16-byte piece holds 8 fp16 or 4 fp32 channels of one tap
SMEM_LIMIT = 227 * 1024  # dynamic shared memory one block may opt into (compute capability 9.0)
REDUCE_BLOCK = 256
DEFAULT_SMS = 132  # H100 SXM: the split rule's assumption where no GPU is asked
MAX_SPLIT = 32
INT32_LIMIT = 2**31

# The tunable space (BK in elements: one k-tile is 32 or 64 (fp32) / 64 or 128 (16-bit) bytes).
# Split-K serves small N (B*Ho*Wo), so its columns are narrower.
_TILE_SPACE: dict[str, tuple[int, ...]] = {"BM": (64, 128), "BN": (64, 128), "STAGES": (3, 4)}
_SPLIT_BN = (16, 32, 64)  # 16: fc6/fc7 at batch <= 16, where wider tiles are mostly padding
_BK = {"fp32": (16, 32), "16bit": (32, 64)}
SPLIT_SPACE = (0, 2, 4, 8, 16)  # 0: chosen from the shape by split_factor


def elem_bytes(mode: str) -> int:
    return 4 if mode in ("tf32", "3xtf32") else 2


def space(mode: str, split: bool = False) -> dict[str, tuple[int, ...]]:
    bk = _BK["fp32" if elem_bytes(mode) == 4 else "16bit"]
    out = {**_TILE_SPACE, "BK": bk}
    if split:
        out.update(BN=_SPLIT_BN, SPLIT=SPLIT_SPACE)
    return out


# Tile choices per operand family, from the H100 tile sweep on the VGG layers
# (docs/vgg.md): (BM, BN, BK, STAGES) for rung 26 with M > 64, with M <= 64, and for 27.
_TILES: dict[str, dict[str, tuple[int, int, int, int]]] = {
    "3xtf32": {"wide": (128, 64, 32, 3), "narrow": (64, 64, 16, 4), "split": (128, 64, 32, 4)},
    "tf32": {"wide": (128, 128, 16, 4), "narrow": (64, 128, 32, 4), "split": (128, 64, 32, 3)},
    "fp16": {"wide": (128, 128, 64, 3), "narrow": (64, 128, 64, 4), "split": (128, 64, 64, 4)},
    "bf16": {"wide": (128, 128, 64, 3), "narrow": (64, 128, 64, 4), "split": (128, 64, 64, 4)},
}
# Rung 39's tiles (kernels/39_implicit_gemm_wgmma.cu: BM 64/128/256, BN, STAGES, PIPE), from
# its H100 tile sweeps (docs/vgg.md). M <= 64 ("narrow", conv1_2): one 64-row tile, 128
# columns, few stages so that 2-4 blocks share an SM (conv1_2 B=16 fp16: 2 stages 0.435 ms,
# 4 stages 0.516). M > 64: the candidates `wgmma_tiles` weighs, first wins a tie.
WGMMA_NARROW: dict[str, dict[str, int]] = {
    "3xtf32": {"BM": 64, "BN": 128, "STAGES": 2},
    "3xfp16": {"BM": 64, "BN": 128, "STAGES": 2},
    "tf32": {"BM": 64, "BN": 128, "STAGES": 2, "PIPE": 0},
    "fp16": {"BM": 64, "BN": 128, "STAGES": 2, "PIPE": 0},
    "bf16": {"BM": 64, "BN": 128, "STAGES": 2, "PIPE": 0},
}
# 128 x 96 (4 x 33 = 132 tiles, one full wave, on conv5_x at B = 16; H200, docs/vgg.md): TF32
# 0.096 ms, FP16 0.059 against 128 x 128's 0.112 and 0.066 (100 tiles, 32 SMs idle).
_WG_16BIT = ({"BM": 128, "BN": 192, "STAGES": 4, "PIPE": 1},
             {"BM": 128, "BN": 128, "STAGES": 4, "PIPE": 1},
             {"BM": 128, "BN": 96, "STAGES": 4, "PIPE": 1})
WGMMA_WIDE: dict[str, tuple[dict[str, int], ...]] = {
    "3xtf32": ({"BM": 128, "BN": 192, "STAGES": 2}, {"BM": 128, "BN": 128, "STAGES": 3}),
    "3xfp16": ({"BM": 128, "BN": 192, "STAGES": 2}, {"BM": 128, "BN": 128, "STAGES": 3}),
    "tf32": ({"BM": 256, "BN": 192, "STAGES": 4, "PIPE": 1}, *_WG_16BIT),
    "fp16": _WG_16BIT,
    "bf16": _WG_16BIT,
}


# Split-K in the wgmma rungs (WG_KSLICED: block z multiplies k-slice z, a second kernel adds
# the slices' fp32 slabs in order). The rule's factor is at most WG_MAX_SPLIT (the tuner's
# space), keeps WG_SLICE_MIN k-tiles a slice (fewer leave the ring nothing to overlap) and
# fills at most one wave of one block an SM: a block beyond that shares an SM and finishes
# last (conv5_x B = 4, 128 x 96 TF32: split 3, 108 blocks, 0.048 ms; split 4, 144 blocks,
# 0.057; H200). auto's model splits only where the 128 x 128 tiles fill less than
# WG_SPLIT_BELOW_WAVES of the SMs and N >= WGMMA_SPLIT_MIN_N (`wgmma_splits`: conv5_x at
# B = 3..12 on 132 SMs). Below that (conv5_x at B <= 2) and on fc6/fc7 (N = B) rung 27's
# 16-64-column split-K tiles keep the shape: at N = B = 32-64 rung 39 / 40 split 4-8 with
# 64-column tiles ran fc6 FP16 at 0.125-0.19 ms against kernels 42-43's 0.073-0.086. A split
# tile's cost is its unsplit wave cost / split x WG_SPLIT_COST (the slabs' round trip and the
# reduction). Up to 6 slices: conv5_x B = 3 (20 tiles of 128 x 128) TF32 0.038 ms split 6
# against 0.043 split 4 and rung 27's 0.080 (FP16 0.032 / 0.035 / 0.045; H200, docs/vgg.md).
WG_MAX_SPLIT = 6
WG_SLICE_MIN = 4
WG_SPLIT_COST = 1.1
WG_SPLIT_BELOW_WAVES = 0.6
WGMMA_SPLIT_MIN_N = 512
WG_TILE_BYTES = 128  # a wgmma k-tile: 128 bytes of an operand row


def wgmma_k_tiles(shape: ConvShape, mode: str) -> int:
    """k-tiles of the wgmma rungs' main loop: Kd in 128-byte steps."""
    return ceil_div(gemm_dims(shape)[2], WG_TILE_BYTES // elem_bytes(mode))


def wgmma_split(shape: ConvShape, mode: str, tile: Mapping[str, int],
                sms: int = DEFAULT_SMS) -> int:
    """The wgmma rungs' split-K factor for a tile (what SPLIT = 0 runs): the largest up to
    WG_MAX_SPLIT that keeps tiles x split within one wave of `sms` blocks and each slice at
    least WG_SLICE_MIN k-tiles; 1 where the tiles alone fill the SMs (conv5_x B=8 fp16 on 132
    SMs: 36 tiles of 128 x 192 split 3 = 108 blocks of 24 k-tiles)."""
    M, N, _ = gemm_dims(shape)
    tiles = ceil_div(M, tile["BM"]) * ceil_div(N, tile["BN"])
    k_tiles = wgmma_k_tiles(shape, mode)
    split = 1
    while (split < WG_MAX_SPLIT and tiles * (split + 1) <= sms
           and k_tiles // (split + 1) >= WG_SLICE_MIN):
        split += 1
    return split


def wgmma_splits(shape: ConvShape, sms: int = DEFAULT_SMS) -> bool:
    """Whether auto's model runs the wgmma rungs split on this shape (see WG_MAX_SPLIT): where
    the 128 x 128 tiles fill less than WG_SPLIT_BELOW_WAVES of the SMs. On conv5_x (NCHW,
    docs/vgg.md): B = 3-4 (20-28 tiles; H200) TF32 0.038-0.044 ms split 4-6 against rung 27's
    0.080; (H100) B = 8 (52 tiles) ran 0.051 ms fp16 at 128 x 192 split 3 against 0.068 whole;
    B = 12 (76 tiles) 128 x 192 split 2 tied fp16 (0.075) and won TF32 (0.096 against 0.119)
    and 3xTF32 (0.204 against 0.270); at B = 16 (100 tiles) every split lost (fp16 0.089
    against 0.072 whole)."""
    M, N, _ = gemm_dims(shape)
    return (M > 64 and N >= WGMMA_SPLIT_MIN_N
            and ceil_div(M, 128) * ceil_div(N, 128) < sms * WG_SPLIT_BELOW_WAVES)


def wgmma_tiles(shape: ConvShape, mode: str, sms: int = DEFAULT_SMS,
                wide: Sequence[Mapping[str, int]] | None = None,
                split: bool | None = None) -> dict[str, int]:
    """Rung 39's tile for the shape: WGMMA_NARROW for M <= 64, else the WGMMA_WIDE candidate
    (or rung 40's, `wide`) with the least waves x (BM + BN). Its main loop streams both
    operands from L2, so a tile costs about its BM + BN rows per k-step, and a partly filled
    last wave costs a full one (conv5_x on 132 SMs: B=64 takes 128 x 192, 264 tiles in 2
    waves, over 128 x 128's 392 in 3; unsplit, B=16 keeps 128 x 128, 100 tiles in one wave).
    Where `split` (default: `wgmma_splits`), each candidate runs at its `wgmma_split` factor,
    which divides its k-steps (cost / split x WG_SPLIT_COST), and a split winner comes with
    SPLIT = 0 (the rule again at prepare, on the GPU's own SM count)."""
    M, N, _ = gemm_dims(shape)
    if M <= 64:
        return dict(WGMMA_NARROW[mode])
    splits = wgmma_splits(shape, sms) if split is None else split

    def split_of(t: Mapping[str, int]) -> int:
        return wgmma_split(shape, mode, t, sms) if splits else 1

    def cost(t: Mapping[str, int]) -> float:
        split = split_of(t)
        blocks = ceil_div(M, t["BM"]) * ceil_div(N, t["BN"]) * split
        waves = ceil_div(blocks, sms) * (t["BM"] + t["BN"]) / split
        return waves * WG_SPLIT_COST if split > 1 else waves

    candidates = WGMMA_WIDE[mode] if wide is None else wide
    if splits:  # measured split: 128-row tiles (docs/vgg.md); 256-row ones only whole
        candidates = [t for t in candidates if t["BM"] == 128] or candidates
    best = min(candidates, key=cost)
    return {**best, "SPLIT": 0} if split_of(best) > 1 else dict(best)


# Split-K pays while the output has fewer 128 x 128 tiles than this fraction of the SMs:
# on conv5_x (H100, 132 SMs) it wins at 52 tiles (B=8: 0.080 vs 0.112 ms fp16) and loses
# from 76 (B=12: 0.124 vs 0.115 ms).
SPLIT_BELOW_WAVES = 0.5


# Split-K's row tile: 128 unless that needs more than SPLIT_ROWS_MAX_SLICES slices or leaves
# fewer blocks than SMs; 64 rows then double the tiles and halve the split. fc7 at B=64 (8
# tiles of 128 x 64, H100, results/2026-11-25_h100_fc/call2_tiles): 64-row tiles with 16 slices
# ran 0.030 ms TF32 and 0.035 3xTF32 against 0.034 and 0.040 for 128 rows with 32; FP16 (16
# slices either way, 128 blocks at 128 rows) 0.035-0.037 against 0.041. conv5_x at B=1 keeps
# 128 rows (16 slices, 256 blocks): FP16 0.036 ms against 0.042 with 64.
SPLIT_ROWS_MAX_SLICES = 16


def split_rows(shape: ConvShape, bn: int, bk: int, sms: int = DEFAULT_SMS) -> int:
    M, N, _ = gemm_dims(shape)
    split = split_factor(shape, 128, bn, bk, sms)
    blocks = ceil_div(M, 128) * ceil_div(N, bn) * split
    return 128 if split <= SPLIT_ROWS_MAX_SLICES and blocks >= sms else 64


def _tile_params(mode: str, kind: str) -> dict[str, int]:
    bm, bn, bk, stages = _TILES[mode][kind]
    return {"BM": bm, "BN": bn, "BK": bk, "STAGES": stages}


def defaults(mode: str, split: bool = False) -> dict[str, int]:
    if split:
        return {**_tile_params(mode, "split"), "SPLIT": 0}
    return _tile_params(mode, "wide")


def plan(shape: ConvShape, mode: str, sms: int = DEFAULT_SMS,
         wgmma: bool = False) -> tuple[str, dict[str, int]]:
    """The rung and tiles the shape model picks (auto without a cache entry): split-K where
    the output has fewer than SPLIT_BELOW_WAVES x sms tiles of 128 x 128 (its rows by
    split_rows, its factor then chosen by split_factor at prepare), unless the GPU has wgmma
    and `wgmma_splits` gives the shape to rung 39's own split-K; else rung 39 (wgmma, tiles
    and split by `wgmma_tiles`) where the GPU has it, else rung 26, each with 64-row tiles
    for M <= 64."""
    if mode not in _TILES:
        raise ValueError(f"igemm: unknown mode {mode!r}; known: {', '.join(_TILES)}")
    M, N, _ = gemm_dims(shape)
    kind = "narrow" if M <= 64 else "wide"
    if (ceil_div(M, 128) * ceil_div(N, 128) < SPLIT_BELOW_WAVES * sms
            and not (wgmma and wgmma_splits(shape, sms))):
        params = defaults(mode, split=True)
        params["BN"] = next((bn for bn in _SPLIT_BN if bn >= N), params["BN"])
        params["BM"] = split_rows(shape, params["BN"], params["BK"], sms)
        return f"igemm-splitk-{mode}", params
    if wgmma:
        return f"igemm-wg-{mode}", wgmma_tiles(shape, mode, sms)
    return f"igemm-{mode}", _tile_params(mode, kind)


def warps(bm: int, bn: int) -> tuple[int, int]:
    """(WARPS_M, WARPS_N): warp tiles of 64 (BM >= 128) or 32 rows by 32 columns (by BN
    where BN is 16)."""
    return (bm // 64 if bm >= 128 else max(1, bm // 32)), max(1, bn // 32)


def smem_bytes(mode: str, bm: int, bn: int, bk: int, stages: int) -> int:
    return stages * (bm + bn) * (bk * elem_bytes(mode) + 16)


def igemm_defines(mode: str, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one tile configuration; ValueError names what is wrong with it."""
    if mode not in _TILES:  # rungs 26-27: no 3xfp16
        raise ValueError(f"igemm: unknown mode {mode!r}; known: {', '.join(_TILES)}")
    bm, bn, bk, stages = (int(params[k]) for k in ("BM", "BN", "BK", "STAGES"))
    wm, wn = warps(bm, bn)
    row = bk * elem_bytes(mode)
    threads = 32 * wm * wn
    if bm % 32 or bn % 16 or bm < 32 or bn < 16 or row % 32:
        raise ValueError(f"igemm: BM must be a multiple of 32, BN of 16 and BK*"
                         f"{elem_bytes(mode)} bytes of 32, got BM={bm} BN={bn} BK={bk}")
    chunks = row // 16
    if threads % chunks or (bm * chunks) % threads or (bn * chunks) % threads:
        raise ValueError(f"igemm: {threads} threads cannot split a {bm}x{bn}x{bk} tile evenly")
    if stages < 2:
        raise ValueError(f"igemm: STAGES must be >= 2, got {stages}")
    if smem_bytes(mode, bm, bn, bk, stages) > SMEM_LIMIT:
        raise ValueError(f"igemm: {stages} stages of {bm}x{bn}x{bk} exceed {SMEM_LIMIT} B of "
                         "shared memory")
    return {"IG_MODE": MODES[mode], "BM": bm, "BN": bn, "BK": bk, "WARPS_M": wm,
            "WARPS_N": wn, "STAGES": stages}


def _variants(mode: str, split: bool) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        tiles = {k: v for k, v in space(mode, split).items() if k != "SPLIT"}
        return pairwise_points(tiles, lambda p: igemm_defines(mode, p))

    return variants


def padded_channels(C: int) -> int:
    return ceil_div(C, CHANNEL_ALIGN) * CHANNEL_ALIGN


def gemm_dims(shape: ConvShape) -> tuple[int, int, int]:
    """(M, N, Kd) of the GEMM the convolution is."""
    return shape.M, shape.B * shape.H_out * shape.W_out, shape.K * shape.K * padded_channels(
        shape.C)


def needs_layout_pass(shape: ConvShape, mode: str) -> bool:
    """x must be rewritten channels-last unless NCHW already is (1x1 images) and the type and
    channel padding already match (fp32 modes, C a multiple of CHANNEL_ALIGN)."""
    already = shape.H == 1 and shape.W == 1 and padded_channels(shape.C) == shape.C
    return not (already and elem_bytes(mode) == 4)


def supports(shape: ConvShape) -> bool:
    M, N, Kd = gemm_dims(shape)
    return (N < INT32_LIMIT and M * Kd < INT32_LIMIT and shape.B * shape.H < 65536
            and ceil_div(M, 32) < 65536)


def split_factor(shape: ConvShape, bm: int, bn: int, bk: int, sms: int = DEFAULT_SMS) -> int:
    """Slices of k for split-K: a power of two, doubled while the blocks stay within two per
    SM (tiles x split <= 2 x sms) and each slice keeps at least 4 k-tiles (fewer leave the
    cp.async ring nothing to overlap)."""
    M, N, Kd = gemm_dims(shape)
    tiles = ceil_div(M, bm) * ceil_div(N, bn)
    split = 1
    while (tiles * split * 2 <= 2 * sms and split * 2 <= MAX_SPLIT
           and ceil_div(Kd, split * 2) >= 4 * bk):
        split *= 2
    return split


def k_slices(Kd: int, split: int, bk: int) -> tuple[int, int]:
    """(k_slice, slices): slice length a multiple of BK; the slices cover [0, Kd) exactly."""
    k_slice = ceil_div(ceil_div(Kd, max(1, split)), bk) * bk
    return k_slice, ceil_div(Kd, k_slice)


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def to_bf16_bits(a: Any) -> Any:
    """fp32 -> bfloat16 bit patterns (uint16), round to nearest even (CuPy has no bf16)."""
    cp = require_cupy()
    u = cp.ascontiguousarray(a, dtype=cp.float32).view(cp.uint32)
    rounded = u + ((u >> 16) & 1) + cp.uint32(0x7FFF)
    return (rounded >> 16).astype(cp.uint16)


def operand_weights(w: Any, mode: str) -> Any:
    """(M, C, K, K) fp32 -> (M, K, K, Cp) in the operand type, zero channels C..Cp-1."""
    cp = require_cupy()
    w = cp.asarray(w, dtype=cp.float32)
    M, C, K, _ = w.shape
    out = cp.zeros((M, K, K, padded_channels(C)), dtype=cp.float32)
    out[..., :C] = w.transpose(0, 2, 3, 1)
    if mode == "fp16":
        return out.astype(cp.float16)
    if mode == "bf16":
        return to_bf16_bits(out)
    return out


def _operand_dtype(mode: str) -> Any:
    return {"fp16": np.float16, "bf16": np.uint16}.get(mode, np.float32)


def _layout_pass(shape: ConvShape, mode: str, defines: Mapping[str, int],
                 file: str) -> Callable[[Any], Any]:
    """x NCHW fp32 -> the GEMM's channels-last operand (a view of x where nothing moves)."""
    cp = require_cupy()
    if not needs_layout_pass(shape, mode):
        return lambda x: x
    cp_ = padded_channels(shape.C)
    buf = cp.empty((shape.B, shape.H, shape.W, cp_), dtype=_operand_dtype(mode))
    if shape.H == 1 and shape.W == 1:
        grid = (min(ceil_div(shape.B * cp_, REDUCE_BLOCK), 65535),)
        args = tuple(np.int32(v) for v in (shape.C, cp_, shape.B))
        launch = BoundLaunch(get_kernel(file, "cast_channels", defines), grid, (REDUCE_BLOCK,),
                             (None, buf, *args), per_call=(0,))
    else:
        grid = (ceil_div(shape.W, 32), ceil_div(cp_, 32), shape.B * shape.H)
        args = tuple(np.int32(v) for v in (shape.C, cp_, shape.H, shape.W))
        launch = BoundLaunch(get_kernel(file, "to_channels_last", defines), grid, (32, 8),
                             (None, buf, *args), per_call=(0,))

    def convert(x: Any) -> Any:
        launch(x)
        return buf

    return convert


def problem_args(shape: ConvShape) -> tuple[np.int32, ...]:
    M, N, Kd = gemm_dims(shape)
    s = shape
    return tuple(np.int32(v) for v in (N, M, Kd, padded_channels(s.C), s.H, s.W, s.K, s.S,
                                       s.H_out, s.W_out))


def _gemm_kernel(file: str, name: str, defines: Mapping[str, int], smem: int) -> Any:
    kernel = get_kernel(file, name, defines)
    kernel.max_dynamic_shared_size_bytes = smem
    return kernel


def _prepare(mode: str, split: bool) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    file = SPLITK_FILE if split else MMA_FILE

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        defines = igemm_defines(mode, params)
        bm, bn, bk = defines["BM"], defines["BN"], defines["BK"]
        smem = smem_bytes(mode, bm, bn, bk, defines["STAGES"])
        threads = 32 * defines["WARPS_M"] * defines["WARPS_N"]
        w_op = operand_weights(w, mode)
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        convert = _layout_pass(shape, mode, defines, file)
        M, N, Kd = gemm_dims(shape)
        dims = problem_args(shape)
        # Arguments bound once (launch.BoundLaunch): CuPy's call converts every argument of
        # every launch, and up to three launch a call here.
        if not split:
            gemm = BoundLaunch(_gemm_kernel(file, "igemm_conv", defines, smem),
                               (ceil_div(N, bn), ceil_div(M, bm)), (threads,),
                               (None, w_op, b_d, None, *dims), per_call=(0, 3), shared_mem=smem)

            def run(x: Any, y: Any) -> None:
                gemm(convert(x), y)

            return run
        from convolab.gpu.device import sm_count

        factor = int(params["SPLIT"]) or split_factor(shape, bm, bn, bk, sm_count())
        k_slice, slices = k_slices(Kd, factor, bk)
        partial = cp.empty((slices, M, N), dtype=cp.float32)
        gemm = BoundLaunch(_gemm_kernel(file, "igemm_conv_splitk", defines, smem),
                           (ceil_div(N, bn), ceil_div(M, bm), slices), (threads,),
                           (None, w_op, partial, *dims, np.int32(k_slice)), per_call=(0,),
                           shared_mem=smem)
        r_args = tuple(np.int32(v) for v in (M, N, shape.H_out * shape.W_out, slices))
        sum_slices = BoundLaunch(get_kernel(file, "splitk_reduce", defines),
                                 (min(ceil_div(M * N, REDUCE_BLOCK), 65535),), (REDUCE_BLOCK,),
                                 (partial, b_d, None, *r_args), per_call=(2,))

        def run_split(x: Any, y: Any) -> None:
            gemm(convert(x))
            sum_slices(y)

        return run_split

    return prepare


WHAT = {
    "3xtf32": "fp32-exact: operands split big+small TF32, 3 MMAs",
    "3xfp16": "fp32-exact: operands scaled by powers of two and split hi+lo FP16, 3 MMAs",
    "tf32": "TF32 operands",
    "fp16": "FP16 operands, FP32 accumulation",
    "bf16": "BF16 operands, FP32 accumulation",
}

for _mode in ("3xtf32", "tf32", "fp16", "bf16"):
    register(ConvImpl(
        name=f"igemm-{_mode}", rung=26, device="gpu", kernel_file=MMA_FILE,
        demonstrates=f"implicit GEMM, mma.sync + ldmatrix, cp.async ring, channels-last "
                     f"operands ({WHAT[_mode]})",
        prepare=_prepare(_mode, split=False), supports=supports,
        space=space(_mode), defaults=defaults(_mode), compile_variants=_variants(_mode, False),
        tolerance=TOLERANCE[_mode]))
    register(ConvImpl(
        name=f"igemm-splitk-{_mode}", rung=27, device="gpu", kernel_file=SPLITK_FILE,
        demonstrates=f"split-K implicit GEMM, slices summed in a fixed order ({WHAT[_mode]})",
        prepare=_prepare(_mode, split=True), supports=supports,
        space=space(_mode, split=True), defaults=defaults(_mode, split=True),
        compile_variants=_variants(_mode, True), tolerance=TOLERANCE[_mode]))

__all__ = ["gemm_dims", "igemm_defines", "k_slices", "operand_weights", "plan",
           "split_factor", "wgmma_k_tiles", "wgmma_split", "wgmma_splits", "wgmma_tiles"]
