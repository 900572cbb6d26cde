"""Kernel 50 (`direct-fp16`, `direct-bf16`): a narrow convolution (C and M up to 64, stride 1)
straight from NCHW fp32 input on tensor cores (kernels/50_direct_conv_mma.cu).

Rungs 39-40 take NCHW callers through a layout pass (the whole input written channels-last in
the operand type) and then read every input pixel from L2 once per filter tap. Kernel 50 has
no pass and no operand buffer: a block walks a run of output rows, brings each input row once
by cp.async in fp32, converts it into a channels-last row of a K-row ring in shared memory
(a pixel's 64 channels one 128-byte row, 16-byte piece j at j ^ (pixel mod 8)), and reads tap
(p, q) of an output row as ring row p from pixel q on, by ldmatrix; the weights, packed here in
the same swizzle (`pack_weights`), stay in shared memory. Its shape: VGG's conv1_2 (224 x 224,
64 -> 64), whose FP16 NCHW calls lost to cuDNN's channels-last fp16 (docs/vgg.md "Kernel 50").

Everything above `prepare` is pure Python, tested on the CPU; CuPy is imported in `prepare`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu import gemv_mma
from convolab.gpu.compile import get_kernel
from convolab.gpu.gemv_wgmma import swizzle_128b
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "50_direct_conv_mma.cu"
MODES: dict[str, int] = {"fp16": 0, "bf16": 1}  # the kernel's DC_MODE
ROW_BYTES = 128  # a pixel's channels (or a weight row) in shared memory: 64 16-bit values
MAX_CHANNELS = ROW_BYTES // 2  # C and M
MAX_ACCUMULATORS = 32  # a warp's m-tiles x n-tiles (128 fp32 accumulator registers a thread)
SMEM_LIMIT = gemv_mma.SMEM_LIMIT
INDEX_LIMIT = 2**31  # rows and pixel offsets within an image plane stay in 32 bits
# WM / WN: warps along the output channels / the output row (WM 0: two where the m-tiles split
# evenly, else one: on conv1_2 B = 16 eight warps ran 0.29 ms, four 0.41, H200); NT: n-tiles of
# 8 columns a warp (0: the fewest that cover the row in one pass, `n_tiles`).
SPACE: dict[str, tuple[int, ...]] = {"WM": (0, 1, 2), "WN": (2, 4, 8), "NT": (0, 2, 4, 6, 7, 8)}
DEFAULTS: dict[str, int] = {"WM": 0, "WN": 4, "NT": 0}


def m_tiles(M: int) -> int:
    return ceil_div(M, 16)


def n_tiles(Wo: int, wn: int, warp_m_tiles: int) -> int:
    """A warp's n-tiles when NT is 0: the output row in as few passes as the accumulators
    allow, spread evenly over the warps (conv1_2: 28 tiles, 4 warps, 7 each)."""
    cap = MAX_ACCUMULATORS // warp_m_tiles
    passes = ceil_div(ceil_div(Wo, 8), wn * cap)
    return ceil_div(ceil_div(Wo, 8), wn * passes)


def vector_floats(W: int) -> int:
    """Floats a cp.async moves: the widest of 4, 2, 1 that divides the input width (a channel's
    row of image b starts at a multiple of W floats)."""
    return next(v for v in (4, 2, 1) if W % v == 0)


def defines(mode: str, shape: ConvShape, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one configuration; ValueError names what is wrong with it."""
    if mode not in MODES:
        raise ValueError(f"direct: unknown mode {mode!r}; known: {', '.join(MODES)}")
    if any(int(params[k]) not in SPACE[k] for k in SPACE):
        raise ValueError(f"direct: WM, WN and NT must be in "
                         f"{', '.join(str(SPACE[k]) for k in SPACE)}, got "
                         f"{', '.join(str(params[k]) for k in SPACE)}")
    mt, wm, wn = m_tiles(shape.M), int(params["WM"]), int(params["WN"])
    wm = wm or (2 if mt % 2 == 0 else 1)
    if mt % wm:
        raise ValueError(f"direct: {mt} m-tiles (M = {shape.M}) do not split over WM = {wm} warps")
    nt = int(params["NT"]) or n_tiles(shape.W_out, wn, mt // wm)
    if (mt // wm) * nt > MAX_ACCUMULATORS:
        raise ValueError(f"direct: {mt // wm} m-tiles x NT = {nt} n-tiles a warp exceed "
                         f"{MAX_ACCUMULATORS} accumulator tiles: larger WM or smaller NT")
    return {"DC_MODE": MODES[mode], "DC_K": shape.K, "DC_KK": ceil_div(shape.C, 16),
            "DC_MT": mt, "DC_WM": wm, "DC_WN": wn, "DC_NT": nt,
            "DC_VEC": vector_floats(shape.W)}


def threads(d: Mapping[str, int]) -> int:
    return 32 * d["DC_WM"] * d["DC_WN"]


def pass_columns(d: Mapping[str, int]) -> int:
    return 8 * d["DC_NT"] * d["DC_WN"]


def slot_pixels(shape: ConvShape, d: Mapping[str, int]) -> int:
    """Pixels of a ring row: every pass's columns plus the filter's overhang, so that the
    columns past Wo (computed, not stored) read inside it."""
    return ceil_div(shape.W_out, pass_columns(d)) * pass_columns(d) + shape.K - 1


def stage_stride(shape: ConvShape) -> int:
    """Floats between two channels' rows in the staging area: W rounded up to 16 bytes."""
    return ceil_div(shape.W, 4) * 4


def smem_bytes(shape: ConvShape, d: Mapping[str, int]) -> int:
    """The weights (K*K taps x 16 MT rows), K ring rows and one staged input row."""
    weights = shape.K * shape.K * 16 * d["DC_MT"] * ROW_BYTES
    return (weights + shape.K * slot_pixels(shape, d) * ROW_BYTES
            + 4 * shape.C * stage_stride(shape))


def supports(shape: ConvShape) -> bool:
    """Stride 1, C and M up to 64, and the defaults' shared memory within one block's limit."""
    if (shape.S != 1 or shape.C > MAX_CHANNELS or shape.M > MAX_CHANNELS
            or shape.B * shape.H_out >= INDEX_LIMIT or shape.C * shape.H * shape.W >= INDEX_LIMIT):
        return False
    return smem_bytes(shape, defines("fp16", shape, DEFAULTS)) <= SMEM_LIMIT


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    blocks: int
    threads: int
    smem: int
    slot_pixels: int
    stage_stride: int


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any], sms: int,
                resident: int = 1) -> LaunchPlan:
    """One block per SM (times the blocks an SM holds), each a run of output rows; never more
    blocks than rows. ValueError where the configuration does not fit in shared memory."""
    d = defines(mode, shape, params)
    smem = smem_bytes(shape, d)
    if smem > SMEM_LIMIT:
        raise ValueError(f"direct: {shape} needs {smem} B of shared memory with these tiles, over "
                         f"{SMEM_LIMIT}: fewer n-tiles (NT, WN)")
    blocks = min(shape.B * shape.H_out, sms * max(1, resident))
    return LaunchPlan(d, blocks, threads(d), smem, slot_pixels(shape, d), stage_stride(shape))


def pack_weights(w: Any, mode: str, rows: int) -> Any:
    """(M, C, K, K) fp32 -> kernels 50-51's weights, uint8: for each tap (p, q) in row-major
    order, `rows` rows (output channels) of 128 bytes, channels 8j..8j+7 of row m in 16-byte
    piece j ^ (m mod 8) (wgmma's 128-byte swizzle); zero past M and C."""
    xp = xp_of(w)
    M, C, K, _ = w.shape
    values = gemv_mma.sixteen_bit(xp.ascontiguousarray(w.transpose(2, 3, 0, 1)), mode)
    padded = xp.zeros((K * K, rows, MAX_CHANNELS), dtype=values.dtype)
    padded[:, :M, :C] = values.reshape(K * K, M, C)
    return xp.ascontiguousarray(swizzle_128b(padded.reshape(K * K, -1, 8, 8))).view(
        xp.uint8).reshape(-1)


def checked_weights(name: str, shape: ConvShape, w: Any, supported: bool) -> Any:
    """w as the fp32 CuPy array kernels 50-52 pack, after the checks each of their `prepare`s
    makes: ValueError naming the implementation and the shape, or the weights' shape."""
    if not supported:
        raise ValueError(f"{name} does not support shape {shape}")
    if tuple(w.shape) != shape.w_shape:
        raise ValueError(f"{name}: weights of shape {tuple(w.shape)} for {shape} "
                         f"(want {shape.w_shape})")
    cp = require_cupy()
    return cp.asarray(w, dtype=cp.float32)


# What CI's nvcc check builds: each mode at conv1_2's defaults (odd NT: the x2 ldmatrix), and
# in fp16 a 5 x 5 filter on 20 channels with two warps along M and even NT.
def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        out = [defines(mode, ConvShape(1, 64, 226, 226, 64, 3), DEFAULTS)]
        if mode == "fp16":
            out.append(defines(mode, ConvShape(1, 20, 40, 40, 48, 5), {"WM": 1, "WN": 2, "NT": 6}))
            out.append(defines(mode, ConvShape(1, 64, 30, 30, 64, 3), {"WM": 2, "WN": 4, "NT": 4}))
        return out

    return variants


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"direct-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu import device
        from convolab.gpu.launch import BoundLaunch

        w32 = checked_weights(name, shape, w, supports(shape))
        d = defines(mode, shape, params)
        kernel = get_kernel(KERNEL_FILE, "direct_conv", d)
        resident = device.resident_blocks(kernel.num_regs, threads(d), smem_bytes(shape, d))
        plan = launch_plan(shape, mode, params, device.sm_count(), resident)
        kernel.max_dynamic_shared_size_bytes = plan.smem
        w_op = pack_weights(w32, mode, 16 * d["DC_MT"])
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        launch = BoundLaunch(kernel, (plan.blocks,), (plan.threads,),
                             (None, w_op, b_d, None,
                              *(np.int32(v) for v in (shape.B, shape.C, shape.H, shape.W,
                                                      shape.M, plan.slot_pixels,
                                                      plan.stage_stride))),
                             per_call=(0, 3), shared_mem=plan.smem)

        return launch  # a BoundLaunch is the run: x and y bound per call

    return prepare


for _mode in MODES:
    register(ConvImpl(
        name=f"direct-{_mode}", rung=50, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"a narrow convolution (C, M <= 64) straight from NCHW fp32: each input row "
                     f"copied once by cp.async and converted into a channels-last {_mode} ring in "
                     f"shared memory, every filter tap an ldmatrix address shift into it, the "
                     f"weights resident; mma.sync, fp32 accumulate (no layout pass, no operand "
                     f"buffer)",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["defines", "launch_plan", "n_tiles", "pack_weights", "slot_pixels", "smem_bytes",
           "supports"]
