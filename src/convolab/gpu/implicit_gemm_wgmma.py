"""Rungs 39-40: implicit-GEMM convolution on Hopper's warpgroup MMA
(kernels/39_implicit_gemm_wgmma.cu, 40_implicit_gemm_wgmma_pipelined.cu, wgmma.cuh).

The GEMM and its operand layout are rung 26's (`implicit_gemm`: M x N x Kd, N = B*Ho*Wo,
Kd = K*K*Cp, weights (M, K, K, Cp), x channels-last (B, H, W, Cp)); what differs is the main
loop (wgmma from 128-byte-swizzled shared memory) and that every operand is made ready for it
outside the loop: `prepare` rounds the weights to TF32 (and for 3xTF32 stores their big and
small parts one after the other), and `run` writes x channels-last in the same form (a
counted kernel, always run: the rounding or split happens there). 3xfp16 does the same with
fp16 hi and lo parts of operands first scaled by a power of two (precision.py says why that is
exact): the weights' at prepare, x's per call from max |x| (`wg_absmax`, one more launch), the
two exponents beside the biases where the GEMM's epilogue undoes them. Its k-tile holds 64
elements against 3xTF32's 32, and fp16's MMA runs at twice TF32's rate. It takes NCHW input
only (a channels-last input would skip the pass that makes x's scale). Rung 40 is rung 39 with a
producer warpgroup and per-stage mbarriers instead of a block barrier per k-tile.

`SPLIT` cuts the k-tiles into that many slices, one block each (1: off, the defaults; 0: the
shape's factor, `implicit_gemm.wgmma_split`): the blocks write fp32 partial sums to a
workspace made at prepare (SPLIT slabs of the output's elements, in its order) and a second
kernel (`wg_splitk_reduce`) adds them in slice order, with bias and ReLU, into the output's
form. It serves outputs with fewer tiles than SMs (conv5_x at batch 8-16), where `auto`'s
model (`implicit_gemm.wgmma_tiles`) takes it.

`layout=nhwc` (a parameter, not searched by the tuner, so `auto` never runs it for its NCHW
callers) changes the run's contract: `run(x, y)` takes the input already channels-last in
the operand form (`to_operand`) and writes the output the same way (`output_buffer`,
`to_nchw`), so a network keeps its activations channels-last between layers and pays no
layout pass. `relu=1` applies ReLU after the bias.

wgmma exists on sm_90a only: `supports` is False on any other GPU, and the files are built
for that target (`compile.ARCH_SPECIFIC`). Everything above `prepare` is pure Python and
tested on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none, require_cupy, xp_of
from convolab.gpu import implicit_gemm as ig
from convolab.gpu.compile import get_kernel, pairwise_points
from convolab.gpu.fused_wide import weight_exponent
from convolab.gpu.launch import BoundLaunch
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

FILE = "39_implicit_gemm_wgmma.cu"
ROW_BYTES = 128  # one operand row of a stage: the 128-byte swizzle span, i.e. BK*element size
WG_N = (64, 96, 128, 192, 256)  # the wgmma N a warpgroup may run
PLANE_LIMIT = 2**32  # the loader keeps pixel offsets within one operand plane in 32 bits
SPLIT_MODES = ("3xtf32", "3xfp16")  # two operand planes, three wgmmas, PIPE 0
ABSMAX_BLOCKS = 256  # wg_absmax's blocks: the kernel's WG_ABSMAX_BLOCKS
ALIGN_SLACK = 1024  # the kernels align their ring to the swizzle's 1024-byte period
EPILOGUE_PAD = 4  # fp32 padding of a row of the NHWC epilogue's staging tile ([n][BM + 4])
LAYOUT_TILE = (32, 128)  # the layout pass's (channels, pixels) a block: the kernel's defaults
LAYOUTS = ("nchw", "nhwc")
MAX_SLICES = 65535  # gridDim.z
REDUCE_BLOCK = 256  # wg_splitk_reduce's threads


@dataclass(frozen=True)
class WgRung:
    """What differs between the two wgmma rungs on the host side."""

    rung: int
    prefix: str  # registry names: prefix + mode
    file: str
    kernel: str
    threads: int
    loaders: int  # threads that issue the copies (the loader's pass covers loaders / 8 rows)
    max_acc: int  # fp32 accumulators a consumer thread may hold (3xTF32 holds acc and total)
    bms: tuple[int, ...]
    demonstrates: str
    barrier_bytes: int = 0  # static shared memory a stage adds (rung 40: two mbarriers)
    tma: bool = False  # may bring A by the tensor copy engine (`TMA`); takes the map's address

    @property
    def copy_rows(self) -> int:
        return self.loaders // (ROW_BYTES // 16)


RUNG39 = WgRung(39, "igemm-wg-", FILE, "igemm_wgmma", 256, 256, 192, (64, 128, 256),
                "implicit GEMM on Hopper's wgmma from swizzled shared memory, operands "
                "prepared outside the loop")
# Rung 40: one block an SM (384 threads at 168 registers), so no 64-row tiles: conv1_2's
# M = 64 runs rung 39 with 2-4 blocks an SM. setmaxnreg gives consumers 224 registers.
RUNG40 = WgRung(40, "igemm-wgp-", "40_implicit_gemm_wgmma_pipelined.cu",
                "igemm_wgmma_pipelined", 384, 128, 192, (128, 256),
                "rung 39 with a producer warpgroup filling the ring and per-stage full/empty "
                "mbarriers, no block barrier in the k-loop", barrier_bytes=16, tma=True)
RUNGS = (RUNG39, RUNG40)
THREADS = RUNG39.threads
COPY_ROWS = RUNG39.copy_rows

# Pruned to what won or came close in the H100 sweeps (docs/vgg.md): BN = 256 never won, and
# 3 stages were within 3% of 2 or 4 on every layer. Values outside stay valid (the plans
# that measured them still run); the space is what the tuner searches and CI compiles.
# SPLIT: k-slices (1 = off), every rung and mode; CI compiles its define set (WG_KSLICED, the
# same for every factor) at the first wide tiles only (`_variants`).
SPLITS = (1, 2, 3, 4, 6)
_SPACE = {"BM": (64, 128, 256), "BN": (96, 128, 192), "STAGES": (2, 4), "PIPE": (0, 1),
          "SPLIT": SPLITS}
_SPACE_3X = {"BM": (64, 128), "BN": (64, 128, 192), "STAGES": (2, 3, 4), "SPLIT": SPLITS}
# Rung 40 (no 64-row tiles): 3 or 4 stages, the k-tile before kept in flight, A by cp.async
# or by the tensor copy engine (TMA = 1).
_SPACE_40 = {"BM": (128, 256), "BN": (128, 192), "STAGES": (3, 4), "PIPE": (1,), "TMA": (0, 1),
             "SPLIT": SPLITS}
_SPACE_40_3X = {"BM": (128,), "BN": (128, 192), "STAGES": (2, 3), "TMA": (0, 1),
                "SPLIT": SPLITS}
# 3xfp16 starts from 3xTF32's tiles (the same bytes a stage, twice its k), not yet swept.
# Rung 40's start: 256 x 192 fills 132 SMs in one wave on conv5_x at batch 64 (2 x 66 tiles);
# the wave model (`ig.wgmma_tiles`) weighs it against 128 x 192 and 128 x 128. A by TMA: on
# the H100, conv5_x B=64 NHWC fp16 0.107-0.112 ms against 0.133-0.136 by cp.async (tf32
# 0.171-0.180 against 0.222-0.228), every STAGES/PIPE within 4% (docs/vgg.md). 3xTF32 keeps
# cp.async: its TMA path is checked, not timed.
WGP_WIDE: dict[str, tuple[dict[str, int], ...]] = {
    **{m: ({"BM": 128, "BN": 192, "STAGES": 2, "TMA": 0},
           {"BM": 128, "BN": 128, "STAGES": 3, "TMA": 0})
       for m in SPLIT_MODES},
    **{m: ({"BM": 256, "BN": 192, "STAGES": 4, "PIPE": 1, "TMA": 1},
           {"BM": 128, "BN": 192, "STAGES": 4, "PIPE": 1, "TMA": 1},
           {"BM": 128, "BN": 128, "STAGES": 4, "PIPE": 1, "TMA": 1})
       for m in ("tf32", "fp16", "bf16")},
}
# Parameters every entry knows but the tuner does not search (what the run's contract is).
FIXED = {"layout": "nchw", "relu": 0}


def space(mode: str, rung: WgRung = RUNG39) -> dict[str, tuple[int, ...]]:
    if rung is RUNG40:
        return dict(_SPACE_40_3X if mode in SPLIT_MODES else _SPACE_40)
    return dict(_SPACE_3X if mode in SPLIT_MODES else _SPACE)


def tiles(mode: str, rung: WgRung = RUNG39) -> tuple[dict[str, int], ...]:
    """The wide-tile candidates of `ig.wgmma_tiles` for this rung (the first: its defaults)."""
    return WGP_WIDE[mode] if rung is RUNG40 else ig.WGMMA_WIDE[mode]


def defaults(mode: str, rung: WgRung = RUNG39) -> dict[str, Any]:
    return {**tiles(mode, rung)[0], "SPLIT": 1, **FIXED}


def pipelined_plan(shape: ConvShape, mode: str, sms: int = ig.DEFAULT_SMS
                   ) -> tuple[str, dict[str, int]] | None:
    """Rung 40 where `auto` takes it over rung 39: where the wave model over rung 40's tiles
    picks 256-row ones unsplit (conv5_x at batch 64: 132 tiles of 256 x 192, one wave), which
    only its 224-register consumers hold; the H100 measured 0.107-0.112 ms there against rung
    39's 0.141 (NHWC fp16; tf32 0.171 against 0.218). Not where the model would split them
    (conv5_x at batch 12-20): for `auto`'s NCHW callers rung 40's split ran 1.2-1.5x slower
    than rung 39's tiles (B = 12 fp16 0.089 ms against 0.075 at 128 x 192 split 2; B = 16 0.102
    against 0.072 at 128 x 128 whole; docs/vgg.md), though its channels-last form is the
    fastest there. 3xfp16 has no 256-row tiles: rung 40 takes it where the model picks 128 x 192
    unsplit (conv5_x at B = 32 and 64: 0.225 and 0.442 ms against rung 39's 0.244 and 0.475;
    H200, docs/vgg.md; at B = 16 rung 39's 128 x 128 ran 0.163 against rung 40's 0.192).
    Elsewhere None, and rung 39 keeps the shape."""
    tile = ig.wgmma_tiles(shape, mode, sms, WGP_WIDE[mode])
    wide = tile["BM"] == 256 or (mode == "3xfp16" and tile["BN"] == 192)
    return (RUNG40.prefix + mode, tile) if wide and "SPLIT" not in tile else None


def planes(mode: str) -> int:
    """Operand planes in memory and in each stage: big and small for the 3x modes, else one."""
    return 2 if mode in SPLIT_MODES else 1


def warpgroup_n(bm: int, bn: int) -> int:
    """A warpgroup's wgmma N: BM = 64 puts the two warpgroups side by side along n."""
    return bn // 2 if bm == 64 else bn


def accumulators(mode: str, bm: int, bn: int) -> int:
    """fp32 accumulators a thread holds: N/2 per 64-row wgmma (two of them at BM = 256),
    twice that for the 3x modes' separate total."""
    return (2 if bm == 256 else 1) * warpgroup_n(bm, bn) // 2 * planes(mode)


def smem_bytes(mode: str, bm: int, bn: int, stages: int, nhwc: bool = False) -> int:
    """The ring, or for NHWC output the fp32 staging tile it becomes, if that is larger."""
    ring = stages * (bm + bn) * ROW_BYTES * planes(mode)
    staging = bn * (bm + EPILOGUE_PAD) * 4 if nhwc else 0
    return max(ring, staging) + ALIGN_SLACK


def layout_of(params: Mapping[str, Any]) -> str:
    layout = str(params.get("layout", "nchw"))
    if layout not in LAYOUTS:
        raise ValueError(f"igemm-wg: layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def wgmma_defines(mode: str, params: Mapping[str, Any],
                  rung: WgRung = RUNG39) -> dict[str, int]:
    """The -D set of one tile configuration; ValueError names what is wrong with it."""
    if mode not in ig.MODES:
        raise ValueError(f"igemm-wg: unknown mode {mode!r}; known: {', '.join(ig.MODES)}")
    bm, bn, stages = (int(params[k]) for k in ("BM", "BN", "STAGES"))
    pipe = 0 if mode in SPLIT_MODES else int(params.get("PIPE", 1))
    nhwc, relu = layout_of(params) == "nhwc", int(params.get("relu", 0))
    if nhwc and mode == "3xfp16":
        raise ValueError("igemm-wg: 3xfp16 takes NCHW input only (layout=nchw): x's scale is "
                         "made by the layout pass a channels-last input skips")
    tma, split = int(params.get("TMA", 0)), int(params.get("SPLIT", 1))
    if bm not in rung.bms or bn % rung.copy_rows or warpgroup_n(bm, bn) not in WG_N:
        raise ValueError(f"igemm-wg: rung {rung.rung} runs BM of {rung.bms} and each "
                         f"warpgroup's N ({', '.join(map(str, WG_N))}) a multiple of "
                         f"{rung.copy_rows}; got BM={bm} BN={bn}")
    if accumulators(mode, bm, bn) > rung.max_acc:
        raise ValueError(f"igemm-wg: {mode} with BM={bm} BN={bn} needs more than "
                         f"{rung.max_acc} accumulators a thread")
    if pipe not in (0, 1) or stages < 2 + pipe:
        raise ValueError(f"igemm-wg: PIPE is 0 or 1 and STAGES >= 2 + PIPE, got PIPE={pipe} "
                         f"STAGES={stages}")
    if relu not in (0, 1) or tma not in ((0, 1) if rung.tma else (0,)):
        raise ValueError(f"igemm-wg: relu is 0 or 1, and TMA 0 or (rung 40) 1; got relu={relu} "
                         f"TMA={tma}")
    if split < 0:
        raise ValueError(f"igemm-wg: SPLIT is 0 (from the shape), 1 (off) or the number of "
                         f"k-slices, got SPLIT={split}")
    if smem_bytes(mode, bm, bn, stages, nhwc) + rung.barrier_bytes * stages > ig.SMEM_LIMIT:
        raise ValueError(f"igemm-wg: {stages} stages of {bm}x{bn} exceed {ig.SMEM_LIMIT} B of "
                         "shared memory")
    out = {"IG_MODE": ig.MODES[mode], "BM": bm, "BN": bn, "STAGES": stages, "PIPE": pipe}
    # Only where set: the NCHW sets keep the names the tune and cubin caches know them by. Every
    # split factor is one set (the slices are gridDim.z); SPLIT = 0 builds it too, and prepare
    # asks for the unsplit set where the shape's factor comes out 1.
    return {**out, **({"WG_NHWC": 1} if nhwc else {}), **({"WG_RELU": 1} if relu else {}),
            **({"WP_TMA": 1} if tma else {}), **({"WG_KSLICED": 1} if split != 1 else {})}


def split_of(shape: ConvShape, mode: str, params: Mapping[str, Any],
             sms: int = ig.DEFAULT_SMS) -> int:
    """The k-slices a run makes: SPLIT, or for SPLIT = 0 the shape's factor on `sms` SMs;
    ValueError where a slice would get no k-tile."""
    split = int(params.get("SPLIT", 1))
    if split == 0:
        split = ig.wgmma_split(shape, mode, {k: int(params[k]) for k in ("BM", "BN")}, sms)
    k_tiles = ig.wgmma_k_tiles(shape, mode)
    if not 1 <= split <= min(k_tiles, MAX_SLICES):
        raise ValueError(f"igemm-wg: SPLIT={split} k-slices need 1 to {min(k_tiles, MAX_SLICES)} "
                         f"for this shape ({k_tiles} k-tiles of {ig.WG_TILE_BYTES} bytes)")
    return split


def slab_elements(shape: ConvShape, nhwc: bool) -> int:
    """Elements of one slab of split-K partial sums: one output plane, NCHW (B, M, Ho, Wo) or
    channels-last (B, Ho, Wo, Mp), fp32."""
    M, N, _ = ig.gemm_dims(shape)
    return N * (ig.padded_channels(M) if nhwc else M)


def layout_defines(mode: str, tile: tuple[int, int] = LAYOUT_TILE) -> dict[str, int]:
    """The layout pass's -D set: the operand type (the GEMM's tiles do not matter to it), and
    its own tile where it is not the default."""
    out = {"IG_MODE": ig.MODES[mode], "PIPE": 0}
    if tile != LAYOUT_TILE:
        out |= {"WG_LAYOUT_C": tile[0], "WG_LAYOUT_Q": tile[1]}
    return out


def define_sets(mode: str, rung: WgRung, every_tile: bool = True) -> list[dict[str, int]]:
    """The rung's -D sets: every valid tile of its space (the sets the device warms and the
    cubin cache and measured tiles name; pinned by a test), or, with every_tile False, only
    points covering each pair of tile values (compile.pairwise_points: what CI's nvcc check
    builds, 52 unsplit sets of both rungs instead of 119), then the same NHWC, layout-pass and
    split-K sets either way."""
    sp = {k: v for k, v in space(mode, rung).items() if k != "SPLIT"}

    def define(point: dict[str, Any]) -> dict[str, int]:
        return wgmma_defines(mode, point, rung)

    if every_tile:
        keys = sorted(sp)
        out = []
        for combo in itertools.product(*(sp[k] for k in keys)):
            try:
                out.append(define(dict(zip(keys, combo, strict=True))))
            except ValueError:
                continue
    else:
        out = pairwise_points(sp, define)
    # NHWC at the rung's first two wide tiles (the first also with ReLU, and in rung 40
    # with TMA) and rung 39's 64-row one; none for 3xfp16 (NCHW only).
    first, second = tiles(mode, rung)[:2]
    nhwc = [first, {**first, "relu": 1}, second]
    nhwc += [ig.WGMMA_NARROW[mode]] if rung is RUNG39 else [{**first, "TMA": 1}]
    channels_last = mode != "3xfp16"
    out += [define({**t, "layout": "nhwc"}) for t in nhwc if channels_last]
    if rung is RUNG39:
        out.append(layout_defines(mode))
    # Split-K (one set for every factor): NCHW and NHWC at the first wide tile, NHWC with
    # ReLU at the second (in rung 40 with TMA, as auto's model runs it).
    split = [first] + ([{**first, "layout": "nhwc"},
                        {**second, "layout": "nhwc", "relu": 1,
                         **({"TMA": 1} if rung.tma else {})}] if channels_last else [])
    return out + [define({**t, "SPLIT": 2}) for t in split]


def _variants(mode: str, rung: WgRung) -> Callable[[], list[dict[str, int]]]:
    return lambda: define_sets(mode, rung, every_tile=False)


@functools.cache
def wgmma_ruled_out() -> bool:
    """True where the current GPU cannot run sm_90a code (compute capability other than 9.0).
    With no GPU at all nothing runs anyway, and `supports` answers for the shape alone, as
    every other rung's does (the CPU-side listings and plans see the rung)."""
    cp = cupy_or_none()
    return cp is not None and str(cp.cuda.Device().compute_capability) != "90"


def supports(shape: ConvShape) -> bool:
    plane = shape.B * shape.H * shape.W * ig.padded_channels(shape.C)
    out_plane = shape.B * shape.H_out * shape.W_out * ig.padded_channels(shape.M)
    return (ig.supports(shape) and max(plane, out_plane) < PLANE_LIMIT
            and not wgmma_ruled_out())


def tf32_round(a: Any) -> Any:
    """fp32 -> tf32 values, round to nearest with ties away from zero (cvt.rna.tf32.f32),
    on NumPy or CuPy arrays."""
    xp = xp_of(a)
    u = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    return ((u + xp.uint32(0x1000)) & xp.uint32(0xFFFFE000)).view(xp.float32)


def operand_shape(mode: str, batch: int, h: int, w: int, channels: int) -> tuple[int, ...]:
    """The channels-last operand of `channels` channels: (planes, B, H, W, Cp)."""
    return (planes(mode), batch, h, w, ig.padded_channels(channels))


def operand_dtype(mode: str) -> Any:
    """fp16 (3xfp16's too), bf16 as its bit pattern (uint16: CuPy has no bf16), else fp32
    (tf32 values)."""
    return {"fp16": np.float16, "3xfp16": np.float16, "bf16": np.uint16}.get(mode, np.float32)


def from_operand(a: Any, channels: int, mode: str) -> Any:
    """A channels-last operand (planes, B, H, W, Cp) -> NCHW fp32 of the first `channels`
    channels, planes summed (3xTF32: big + small), on NumPy or CuPy arrays."""
    xp = xp_of(a)
    if mode == "bf16":
        a = (a.astype(xp.uint32) << 16).view(xp.float32)
    full = a.astype(xp.float32).sum(axis=0) if a.shape[0] > 1 else a[0].astype(xp.float32)
    return xp.ascontiguousarray(full[..., :channels].transpose(0, 3, 1, 2))


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def split_fp16(a: Any) -> Any:
    """3xfp16's planes of `a` (already scaled): (2, ...) fp16, hi = fp16(a), lo = fp16(a - hi)
    (a - hi is exact in fp32), on NumPy or CuPy arrays."""
    xp = xp_of(a)
    a = xp.asarray(a, dtype=xp.float32)
    hi = a.astype(xp.float16)
    return xp.stack([hi, (a - hi.astype(xp.float32)).astype(xp.float16)])


def operand_weights(w: Any, mode: str, exponent: int = 0) -> Any:
    """(M, C, K, K) fp32 -> (planes, M, K, K, Cp) in the operand type: 16-bit casts, TF32
    rounded, for 3xTF32 the big part then the small one (w = big + small, both TF32), for
    3xfp16 the hi and lo parts of w 2^exponent (fused_wide.weight_exponent(w): the scale)."""
    cp = require_cupy()
    if mode in ("fp16", "bf16"):
        return ig.operand_weights(w, mode)[None]
    if mode == "3xfp16":
        full = ig.operand_weights(w, "tf32")  # fp32, channels-last, padded
        return split_fp16(cp.ldexp(full, cp.int32(exponent)))
    full = ig.operand_weights(w, "tf32")  # fp32, channels-last, padded
    big = tf32_round(full)
    if mode == "tf32":
        return big[None]
    return cp.stack([big, tf32_round(full - big)])


# The driver's enums (cuda.h): data types copied as raw bits, 128-byte swizzle, L2 fills of 128
# bytes, out-of-range elements as zeros.
_MAP_TYPE = {2: 1, 4: 2}  # element bytes -> CU_TENSOR_MAP_DATA_TYPE_UINT16 / _UINT32
_SWIZZLE_128B, _L2_128B = 3, 2
_MAP_BYTES, _MAP_ALIGN = 128, 64


def tensor_map_geometry(planes_: int, m: int, kd: int, esize: int, box_rows: int
                        ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(dims, byte strides, box) of the weights (planes, M, Kd) as a 3-D tensor map, innermost
    first: one box is a stage's A section, BM rows of one 128-byte k-tile in every plane."""
    return ((kd, m, planes_), (kd * esize, m * kd * esize),
            (ROW_BYTES // esize, box_rows, planes_))


@functools.cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def encode_tensor_map(what: str, a: Any, dims: tuple[int, ...], strides: tuple[int, ...],
                      box: tuple[int, ...]) -> Any:
    """The 128-byte-swizzled tensor map of device array `a` (dims and box innermost first, byte
    strides of the outer dims), in device memory: the kernels read it there (CuPy passes no
    128-byte structs). `what` names the operand in the error."""
    cp = require_cupy()
    n = len(dims)
    raw = ctypes.create_string_buffer(_MAP_BYTES + _MAP_ALIGN)
    at = (ctypes.addressof(raw) + _MAP_ALIGN - 1) // _MAP_ALIGN * _MAP_ALIGN
    res = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(at), _MAP_TYPE[a.itemsize], n, ctypes.c_void_p(a.data.ptr),
        (ctypes.c_uint64 * n)(*dims), (ctypes.c_uint64 * (n - 1))(*strides),
        (ctypes.c_uint32 * n)(*box), (ctypes.c_uint32 * n)(*([1] * n)), 0, _SWIZZLE_128B,
        _L2_128B, 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused {what}'s map (CUresult {res}): "
                           f"dims {dims}, strides {strides}, box {box}")
    return cp.asarray(np.frombuffer(ctypes.string_at(at, _MAP_BYTES), dtype=np.uint8))


def tensor_map(w_op: Any, box_rows: int) -> Any:
    """The tensor map of the operand weights (planes, M, K, K, Cp) for rung 40's TMA loads."""
    planes_, m = w_op.shape[:2]
    dims, strides, box = tensor_map_geometry(planes_, m, w_op[0, 0].size, w_op.itemsize,
                                             box_rows)
    return encode_tensor_map("the weights", w_op, dims, strides, box)


def layout_pass(shape: ConvShape, mode: str, tile: tuple[int, int] = LAYOUT_TILE,
                exponent: Any = None) -> Callable[[Any], Any]:
    """x NCHW fp32 -> the kernels' (planes, B, H, W, Cp) operand buffer (reused each call);
    `tile`: the (channels, pixels) a block moves (benchmarks/layout_rate.py compares them).
    3xfp16: `wg_absmax` first, and the pass writes x's scale exponent to `exponent` (one fp32
    element of device memory: the slot after the weights' exponent in the GEMM's bias)."""
    cp = require_cupy()
    cp_ = ig.padded_channels(shape.C)
    buf = cp.empty(operand_shape(mode, shape.B, shape.H, shape.W, shape.C),
                   dtype=operand_dtype(mode))
    defines = layout_defines(mode, tile)
    kernel = get_kernel(FILE, "wg_channels_last", defines)
    channels, pixels = tile
    grid = (ceil_div(shape.H * shape.W, pixels), ceil_div(cp_, channels), shape.B)
    x_max = cp.zeros(ABSMAX_BLOCKS, dtype=cp.float32)
    if exponent is None:
        if mode == "3xfp16":
            raise ValueError("igemm-wg: 3xfp16's layout pass needs the slot for x's exponent")
        exponent = x_max[:1]  # never written outside 3xfp16
    args = (*(np.int32(v) for v in (shape.C, cp_, shape.H, shape.W)), np.int64(buf[0].size),
            x_max, exponent)
    launch = BoundLaunch(kernel, grid, (256,), (None, buf, *args), per_call=(0,))
    absmax = None
    if mode == "3xfp16":
        absmax = BoundLaunch(get_kernel(FILE, "wg_absmax", defines), (ABSMAX_BLOCKS,), (256,),
                             (None, np.int64(shape.B * shape.C * shape.H * shape.W), x_max),
                             per_call=(0,))

    def convert(x: Any) -> Any:
        if absmax is not None:
            absmax(x)
        launch(x)
        return buf

    return convert


def to_operand(x: Any, mode: str) -> Any:
    """x NCHW fp32 (CuPy) -> a new channels-last operand in `mode`'s form: what a `layout=nhwc`
    run takes (and, for the next layer, what one writes)."""
    if mode == "3xfp16":
        raise ValueError("igemm-wg: 3xfp16 has no channels-last operand form (NCHW input only)")
    shape = ConvShape(x.shape[0], x.shape[1], x.shape[2], x.shape[3], 1, 1)
    return layout_pass(shape, mode)(x).copy()


def output_buffer(shape: ConvShape, mode: str) -> Any:
    """The output of a `layout=nhwc` run: (planes, B, Ho, Wo, Mp) in the operand type."""
    cp = require_cupy()
    return cp.empty(operand_shape(mode, shape.B, shape.H_out, shape.W_out, shape.M),
                    dtype=operand_dtype(mode))


def poison_operand(a: Any, mode: str) -> None:
    """Fill a channels-last operand with NaN (bf16's as its bit pattern) before a run."""
    a.fill(0x7FC0 if mode == "bf16" else np.nan)


def _check_operand(name: str, what: str, a: Any, want: tuple[int, ...], mode: str) -> None:
    if tuple(a.shape) != want or a.dtype != operand_dtype(mode) or not a.flags.c_contiguous:
        raise ValueError(f"{name} (layout=nhwc): {what} must be a C-contiguous {want} "
                         f"{np.dtype(operand_dtype(mode)).name} channels-last operand, got "
                         f"{tuple(a.shape)} {a.dtype}")


def _prepare(mode: str, rung: WgRung) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = rung.prefix + mode

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        from convolab.gpu.device import sm_count

        cp = require_cupy()
        wgmma_defines(mode, params, rung)  # the parameters' own errors first
        split = split_of(shape, mode, params, sm_count())
        defines = wgmma_defines(mode, {**params, "SPLIT": split}, rung)
        bm, bn, nhwc = defines["BM"], defines["BN"], "WG_NHWC" in defines
        smem = smem_bytes(mode, bm, bn, defines["STAGES"], nhwc)
        w_exp = weight_exponent(cp.asarray(w)) if mode == "3xfp16" else 0
        w_op = operand_weights(w, mode, w_exp)
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        if mode == "3xfp16":  # the biases, the weights' scale exponent, x's (the layout pass's)
            b_d = cp.concatenate([b_d, cp.asarray([w_exp, 0], dtype=cp.float32)])
        M, N, _ = ig.gemm_dims(shape)
        kernel = get_kernel(rung.file, rung.kernel, defines)
        kernel.max_dynamic_shared_size_bytes = smem
        grid = (ceil_div(N, bn), ceil_div(M, bm), split)
        x_plane = np.int64(shape.B * shape.H * shape.W * ig.padded_channels(shape.C))
        dims = ig.problem_args(shape)

        # Rung 40 takes the map's address last (the weights themselves where A is cp.async's).
        extra = (tensor_map(w_op, bm) if "WP_TMA" in defines else w_op,) if rung.tma else ()
        slabs = reduce = None
        if split > 1:  # the GEMM writes partial sums to `slabs`; `reduce` makes y of them
            slabs = cp.empty((split, slab_elements(shape, nhwc)), dtype=cp.float32)
            reduce = get_kernel(rung.file, "wg_splitk_reduce", defines)
            per_thread = 16 // np.dtype(operand_dtype(mode)).itemsize if nhwc else 1
            r_grid = (min(ceil_div(slabs[0].size // per_thread, REDUCE_BLOCK), 65535),)
            r_args = tuple(np.int32(v) for v in (M, N, shape.H_out * shape.W_out, split))

        # Arguments bound once (launch.BoundLaunch): at conv5_x's small batches a call is tens
        # of microseconds, and CuPy's call converts every argument of every launch.
        if slabs is None:
            gemm = BoundLaunch(kernel, grid, (rung.threads,),
                               (None, w_op, b_d, None, *dims, x_plane, *extra), per_call=(0, 3),
                               shared_mem=smem)

            def launch(x_op: Any, y: Any) -> None:
                gemm(x_op, y)
        else:
            gemm = BoundLaunch(kernel, grid, (rung.threads,),
                               (None, w_op, b_d, slabs, *dims, x_plane, *extra), per_call=(0,),
                               shared_mem=smem)
            sum_slabs = BoundLaunch(reduce, r_grid, (REDUCE_BLOCK,), (slabs, b_d, None, *r_args),
                                    per_call=(2,))

            def launch(x_op: Any, y: Any) -> None:
                gemm(x_op)
                sum_slabs(y)

        if nhwc:
            x_want = operand_shape(mode, shape.B, shape.H, shape.W, shape.C)
            y_want = operand_shape(mode, shape.B, shape.H_out, shape.W_out, shape.M)

            def run_nhwc(x: Any, y: Any) -> None:
                _check_operand(name, "input", x, x_want, mode)
                _check_operand(name, "output", y, y_want, mode)
                launch(x, y)

            return run_nhwc
        exponent = b_d[shape.M + 1:] if mode == "3xfp16" else None
        convert = layout_pass(shape, mode, exponent=exponent)
        return lambda x, y: launch(convert(x), y)

    return prepare


MODE_OF: dict[str, str] = {}  # registry name -> operand mode, for the NHWC contender form

for _rung, _mode in itertools.product(RUNGS, ("3xtf32", "3xfp16", "tf32", "fp16", "bf16")):
    MODE_OF[_rung.prefix + _mode] = _mode
    register(ConvImpl(
        name=_rung.prefix + _mode, rung=_rung.rung, device="gpu", kernel_file=_rung.file,
        demonstrates=f"{_rung.demonstrates} ({ig.WHAT[_mode]})",
        prepare=_prepare(_mode, _rung), supports=supports, space=space(_mode, _rung),
        defaults=defaults(_mode, _rung), compile_variants=_variants(_mode, _rung),
        tolerance=TOLERANCE[_mode]))

__all__ = ["MODE_OF", "RUNG39", "RUNG40", "encode_tensor_map", "from_operand", "layout_pass",
           "operand_dtype", "operand_shape", "operand_weights", "output_buffer",
           "pipelined_plan", "poison_operand", "slab_elements", "smem_bytes", "split_of",
           "tensor_map", "tensor_map_geometry", "tf32_round", "to_operand", "warpgroup_n",
           "wgmma_defines", "wgmma_ruled_out"]
