"""Kernel 52 (`direct-img-fp16`, `-bf16`, `-tf32`): a wide convolution on small images (VGG's
conv5_x) as a direct convolution over whole images in shared memory, from NCHW fp32, on
Hopper's warpgroup MMA (kernels/52_direct_conv_image_wgmma.cu, sm_90a).

A block takes TM = 64 or 128 output channels of one image (and a slice of the input channels): each
chunk of 64 channels (32 in TF32: a pixel's 128-byte row either way) of the image is loaded once and
converted into a channels-last buffer whose rows are PW = W rounded up to 8 pixels, so that output
pixel n = oh PW + ow reads input row n + p PW + q for tap (p, q): one descriptor shift a tap, no
im2col gather, no layout pass. The weights stream through a ring of TM x 128-byte tap stages
(`pack_weights`); producer warps copy the weights and stage and convert the pixels, so the
consumers only issue wgmmas. With SPLIT slices the slices of a (tile, image) are one thread-block
cluster that adds its fp32 sums through distributed shared memory in rank order; a chosen split
whose clusters would not all run at once is halved (`fitting_plan`). Everything above `prepare`
is pure Python, tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu import direct_conv, gemv_mma
from convolab.gpu import implicit_gemm_wgmma as wg
from convolab.gpu.compile import get_kernel
from convolab.gpu.gemv_wgmma import swizzle_128b
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "52_direct_conv_image_wgmma.cu"
# kernels 50-51's 16-bit modes, and TF32 (a chunk of 32 channels, wgmma k8)
MODES: dict[str, int] = {**direct_conv.MODES, "tf32": 2}
ROW_BYTES = direct_conv.ROW_BYTES  # a pixel's chunk of channels, a weight row's
TILES_M = (64, 128)  # output channels a block: its two warpgroups split pixels or channels
CONSUMERS = 256  # two warpgroups issue the wgmmas
MAX_N = 256  # output pixels a block computes: Ho x PW rounded up to 16, one wgmma's N
ALIGN_SLACK = 1024
DEFAULT_SMS = gemv_mma.DEFAULT_SMS
# TM: output channels a block (0: chosen, `tile_rows`); STAGES: weight taps in the ring; SPLIT:
# slices of the input-channel chunks (0: chosen, `split_for`).
SPACE: dict[str, tuple[int, ...]] = {"TM": (0, 64, 128), "STAGES": (2, 3, 4, 5),
                                     "SPLIT": (0, 1, 2, 4, 8)}
DEFAULTS: dict[str, int] = {"TM": 0, "STAGES": 4, "SPLIT": 0}


def threads(tm: int) -> int:
    """A block: the consumers and one producer warpgroup beside 128-row tiles (whose
    accumulators take the registers), two beside 64-row tiles (more threads converting)."""
    return CONSUMERS + (128 if tm == 128 else 256)


def row_pixels(W: int) -> int:
    return 8 * ceil_div(W, 8)


def n_pixels(shape: ConvShape) -> int:
    """Output pixels a block computes: Ho rows of PW, rounded up to the wgmma's 16."""
    return 16 * ceil_div(shape.H_out * row_pixels(shape.W), 16)


def warpgroup_n(shape: ConvShape, tm: int) -> int:
    """A warpgroup's N: all the block's pixels (TM 128), or half of them rounded up to 16."""
    return n_pixels(shape) if tm == 128 else 16 * ceil_div(n_pixels(shape), 32)


def buffer_pixels(shape: ConvShape, tm: int) -> int:
    """Rows of a pixel buffer: every tap's reads for the pixels computed, on the 8-row period."""
    computed = warpgroup_n(shape, tm) * (1 if tm == 128 else 2)
    return 8 * ceil_div(computed + (shape.K - 1) * (row_pixels(shape.W) + 1), 8)


def sum_row(shape: ConvShape, tm: int) -> int:
    """Floats a row of the cluster's tile of sums: the pixels computed, plus 4."""
    return warpgroup_n(shape, tm) * (1 if tm == 128 else 2) + 4


def chunk_channels(mode: str) -> int:
    """Input channels a chunk: one 128-byte row a pixel, 64 16-bit or 32 tf32 values."""
    return 32 if mode == "tf32" else 64


def smem_bytes(shape: ConvShape, tm: int, stages: int, mode: str) -> int:
    """The weight ring, two pixel buffers, a chunk as staged (fp32 planes) and the alignment
    slack."""
    return (stages * tm * ROW_BYTES + 2 * buffer_pixels(shape, tm) * ROW_BYTES
            + chunk_channels(mode) * shape.H * shape.W * 4 + ALIGN_SLACK)


def chunks_of(shape: ConvShape, mode: str) -> int:
    return ceil_div(shape.C, chunk_channels(mode))


# TM when 0: 64-row tiles where 128-row ones would fill at most 1 / SMALL_TILE_FILL of the SMs,
# so that twice the blocks run without slicing the chunks so much. Measured on conv5_x (H200,
# docs/vgg.md "Kernel 52's slices summed in a cluster", event us): 64-row tiles up to B = 8
# (FP16 B = 8 27.6 against 36.5, TF32 38.5 against 52.8), 128-row ones, sliced in clusters of 2,
# from 12 (FP16 B = 12 / 16 37.7 / 40.1 against 45.5 / 47.6, TF32 54.9 / 54.7 against 69.0 /
# 70.1); at B = 4 in TF32 the 64-row tiles' split is halved to fit its clusters (38.3 against
# 35.3).
SMALL_TILE_FILL = 4


def tile_rows(shape: ConvShape, sms: int) -> int:
    """TM when 0 (`SMALL_TILE_FILL`): 64 for conv5_x up to B = 8, 128 above."""
    return 64 if ceil_div(shape.M, 128) * shape.B * SMALL_TILE_FILL <= sms else 128


def split_for(shape: ConvShape, tm: int, sms: int, mode: str) -> int:
    """Slices of the chunks where the blocks fill at most half the SMs: doubled while the
    blocks stay within the SMs and each slice keeps 2 chunks."""
    units, chunks, split = ceil_div(shape.M, tm) * shape.B, chunks_of(shape, mode), 1
    while units * split * 2 <= sms and chunks >= 4 * split:
        split *= 2
    return split


def defines(mode: str, shape: ConvShape, params: Mapping[str, Any],
            sms: int = DEFAULT_SMS) -> dict[str, int]:
    """The -D set of one configuration (parameters missing from `params`: DEFAULTS');
    ValueError names what is wrong with it."""
    params = {**DEFAULTS, **params}
    if mode not in MODES:
        raise ValueError(f"direct-img: unknown mode {mode!r}; known: {', '.join(MODES)}")
    if any(int(params[k]) not in SPACE[k] for k in SPACE):
        raise ValueError(f"direct-img: TM, STAGES and SPLIT must be in "
                         f"{', '.join(str(SPACE[k]) for k in SPACE)}, got "
                         f"{', '.join(str(params[k]) for k in SPACE)}")
    return {"DW_MODE": MODES[mode], "DI_K": shape.K, "DI_PW": row_pixels(shape.W),
            "DI_HO": shape.H_out, "DI_HW": shape.H * shape.W, "DI_STAGES": int(params["STAGES"]),
            "DI_TM": int(params["TM"]) or tile_rows(shape, sms)}


def supports(shape: ConvShape) -> bool:
    """Stride 1, an image whose output pixels one wgmma covers (Ho x PW <= 256) and whose
    channel planes are whole 16-byte pieces (H W a multiple of 4: a chunk is one bulk copy),
    ring, buffers and staged chunk within shared memory in every mode (a 16-bit chunk stages
    the most), on a GPU that runs sm_90a code."""
    return (shape.S == 1 and n_pixels(shape) <= MAX_N and shape.H * shape.W % 4 == 0
            and max(smem_bytes(shape, tm, DEFAULTS["STAGES"], "fp16") for tm in TILES_M)
            <= direct_conv.SMEM_LIMIT
            and shape.B * shape.M * shape.H_out * shape.W_out < direct_conv.INDEX_LIMIT
            and ceil_div(shape.M, 64) < 65536 and shape.B < 65536
            and not wg.wgmma_ruled_out())


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    grid: tuple[int, int, int]
    slice_chunks: int
    smem: int

    @property
    def slices(self) -> int:
        return self.grid[2]


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any], sms: int) -> LaunchPlan:
    params = {**DEFAULTS, **params}
    d = defines(mode, shape, params, sms)
    tm = d["DI_TM"]
    smem = smem_bytes(shape, tm, d["DI_STAGES"], mode)
    if smem > direct_conv.SMEM_LIMIT:
        raise ValueError(f"direct-img: {shape} needs {smem} B of shared memory with "
                         f"{d['DI_STAGES']} stages, over {direct_conv.SMEM_LIMIT}: fewer STAGES")
    chunks = chunks_of(shape, mode)
    split = min(int(params["SPLIT"]) or split_for(shape, tm, sms, mode), chunks)
    per_slice = ceil_div(chunks, split)
    slices = ceil_div(chunks, per_slice)
    if slices > 1:  # the slices one cluster, summing in shared memory
        d["DI_SPLIT"] = slices
        smem = max(smem, ALIGN_SLACK + tm * sum_row(shape, tm) * 4)
    return LaunchPlan(d, (ceil_div(shape.M, tm), shape.B, slices), per_slice, smem)


def pack_weights(w: Any, mode: str, tm: int) -> Any:
    """(M, C, K, K) fp32 -> kernel 52's weights, uint8: for each tm-row tile, chunk of cc
    channels (`chunk_channels`) and tap (p, q) in that order, one run of tm rows (output
    channels) x 128 bytes, channels e j..e j + e - 1 (e = cc / 8) of row r in 16-byte piece
    j ^ (r mod 8); 16-bit values, or fp32 rounded to tf32 as the kernel rounds x; zero past M
    and C."""
    xp = xp_of(w)
    M, C, K, _ = w.shape
    cc = chunk_channels(mode)
    tiles, chunks = ceil_div(M, tm), ceil_div(C, cc)
    taps_last = xp.ascontiguousarray(w.transpose(0, 2, 3, 1))
    values = (wg.tf32_round(taps_last) if mode == "tf32"
              else gemv_mma.sixteen_bit(taps_last, mode))
    padded = xp.zeros((tiles * tm, K * K, chunks * cc), dtype=values.dtype)
    padded[:M, :, :C] = values.reshape(M, K * K, C)
    a = padded.reshape(tiles, tm, K * K, chunks, 8, cc // 8).transpose(0, 3, 2, 1, 4, 5)
    return xp.ascontiguousarray(swizzle_128b(a)).view(xp.uint8).reshape(-1)


# Where `auto` runs kernel 52 without a cache entry: FP16 and TF32 layers of at least
# AUTO_MIN_CHANNELS input and output channels that it supports, at every batch. Measured on
# conv5_x (H200, Op Time ms against what `auto` ran before: rung 27 or 39 split-K at B = 1-12,
# rung 39 / 40 above), FP16 (docs/vgg.md "Kernel 52"): B = 1 0.028 / 0.036, 3 0.033 / 0.038, 8
# 0.044-0.048 / 0.048-0.052, 12 0.055-0.059 / 0.063, 32 0.071-0.075 / 0.085-0.089, 64
# 0.135-0.140 / 0.145-0.149, level at 16; TF32 ("Kernel 52 in TF32"): B = 1 0.028 / 0.042, 4
# 0.042 / 0.050, 8 0.054 / 0.069, 16 0.078 / 0.098, 32 0.108 / 0.145, 64 0.202 / 0.216.
AUTO_MODES = ("fp16", "tf32")
AUTO_MIN_CHANNELS = 128


def auto_choice(shape: ConvShape, mode: str) -> tuple[str, dict[str, int]] | None:
    """The implementation `auto` runs for this layer in this mode, or None where kernel 52 is
    not its choice."""
    if mode not in AUTO_MODES or min(shape.C, shape.M) < AUTO_MIN_CHANNELS or not supports(shape):
        return None
    return f"direct-img-{mode}", {}


# What CI's nvcc check builds: each mode at conv5_x in both tiles unsplit (B = 64) and as
# clusters of 4 slices (B = 1), and in fp16 a 5 x 5 filter on a 13 x 12 image with the most
# stages.
def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        conv5 = ConvShape(1, 512, 16, 16, 512, 3)
        out = [launch_plan(conv5.with_batch(batch), mode, {"TM": tm, "SPLIT": split},
                           DEFAULT_SMS).defines
               for tm in TILES_M for batch, split in ((64, 1), (1, 4))]
        if mode == "fp16":
            out.append(defines(mode, ConvShape(1, 100, 13, 12, 70, 5),
                               {"TM": 128, "STAGES": 5, "SPLIT": 0}))
        return out

    return variants


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def fitting_plan(shape: ConvShape, mode: str, params: Mapping[str, Any], sms: int,
                 capacity: Callable[[LaunchPlan], int | None]) -> LaunchPlan:
    """`launch_plan`, its chosen split halved until every cluster runs at once: `capacity(plan)`
    is how many clusters of the plan's kernel the GPU holds (None: unknown, taken as enough).
    A cluster's blocks share a GPC, so clusters of 4 or 8 of one block an SM fit fewer than
    SMs / size: on the H200 30 of 4 and 15 of 8, and conv5_x at 128 blocks in clusters of 4 ran
    a second wave (docs/vgg.md, "Kernel 52's slices summed in a cluster")."""
    plan = launch_plan(shape, mode, params, sms)
    while not int({**DEFAULTS, **params}["SPLIT"]) and plan.slices > 1:
        fit = capacity(plan)
        if fit is None or fit * plan.slices >= plan.grid[0] * plan.grid[1] * plan.grid[2]:
            break
        plan = launch_plan(shape, mode, {**params, "SPLIT": plan.slices // 2}, sms)
    return plan


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"direct-img-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import max_active_clusters, sm_count
        from convolab.gpu.launch import BoundLaunch

        w32 = direct_conv.checked_weights(name, shape, w, supports(shape))
        def compiled(plan: LaunchPlan) -> Any:
            kernel = get_kernel(KERNEL_FILE, "direct_conv_image", plan.defines)
            kernel.max_dynamic_shared_size_bytes = plan.smem
            return kernel

        def capacity(plan: LaunchPlan) -> int | None:
            return max_active_clusters(compiled(plan), plan.grid, threads(plan.defines["DI_TM"]),
                                       plan.smem)

        plan = fitting_plan(shape, mode, params, sm_count(), capacity)
        kernel = compiled(plan)
        w_op = pack_weights(w32, mode, plan.defines["DI_TM"])
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        conv = BoundLaunch(kernel, plan.grid, (threads(plan.defines["DI_TM"]),),
                           (None, w_op, b_d, None,
                            *(np.int32(v) for v in (shape.C, shape.W, shape.M,
                                                    chunks_of(shape, mode), plan.slice_chunks))),
                           per_call=(0, 3), shared_mem=plan.smem)
        return conv  # a BoundLaunch is the run: x and y bound per call

    return prepare


for _mode in MODES:
    register(ConvImpl(
        name=f"direct-img-{_mode}", rung=52, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"a wide convolution on small images (conv5_x) as a direct convolution "
                     f"over whole images in shared memory (sm_90a): each {chunk_channels(_mode)}-"
                     f"channel chunk of an image loaded once from NCHW fp32 into a channels-last "
                     f"{_mode} buffer with "
                     f"rows padded to 8 pixels, every filter tap one wgmma descriptor shift, the "
                     f"weights streamed by the bulk copy engine; no im2col gather, no layout "
                     f"pass",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["auto_choice", "buffer_pixels", "chunk_channels", "defines", "fitting_plan",
           "launch_plan", "n_pixels", "pack_weights", "smem_bytes", "split_for", "sum_row",
           "supports"]
