"""Kernel 51 (`direct-wg-fp16`, `direct-wg-bf16`): kernel 50's direct convolution from NCHW fp32
on Hopper's warpgroup MMA (kernels/51_direct_conv_wgmma.cu, sm_90a).

The ring of channels-last input rows that kernel 50 reads by ldmatrix is already wgmma's K-major
128-byte swizzle, so each warpgroup issues m64nNk16 with both operands by descriptor: the
weights of tap (p, q) (packed by `direct_conv.pack_weights`, 64 rows a tap) and ring row oh + p
from pixel q on. The ring has K + 2 rows: while an output row's wgmmas run, the input row loaded
during the previous output row is converted into it and the next one's loads are issued into
registers. Everything above `prepare` is pure Python, tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy
from convolab.gpu import direct_conv
from convolab.gpu.compile import get_kernel
from convolab.gpu.implicit_gemm_wgmma import wgmma_ruled_out
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "51_direct_conv_wgmma.cu"
MODES = direct_conv.MODES
ROW_BYTES = direct_conv.ROW_BYTES
A_ROWS = 64  # the wgmma's M: every tap's weights are 64 rows, zero past M
MAX_N = 128  # a warpgroup's N (its accumulators: N / 2 registers a thread)
ALIGN_SLACK = 1024  # the kernel aligns its shared memory to the swizzle's 1024-byte period
# WG: warpgroups along the output row; N: a warpgroup's columns a pass (0: chosen, `n_columns`).
SPACE: dict[str, tuple[int, ...]] = {"WG": (1, 2), "N": (0, 16, 32, 48, 64, 80, 96, 112, 128)}
DEFAULTS: dict[str, int] = {"WG": 2, "N": 0}


def n_columns(Wo: int, wg: int) -> int:
    """A warpgroup's N when N is 0: the row in as few passes of wg x MAX_N columns as it
    takes, split evenly, rounded up to 16 (conv1_2: 224 columns, 2 x 112)."""
    passes = ceil_div(Wo, wg * MAX_N)
    return 16 * ceil_div(ceil_div(Wo, wg * passes), 16)


def defines(mode: str, shape: ConvShape, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one configuration; ValueError names what is wrong with it."""
    if mode not in MODES:
        raise ValueError(f"direct-wg: unknown mode {mode!r}; known: {', '.join(MODES)}")
    if any(int(params[k]) not in SPACE[k] for k in SPACE):
        raise ValueError(f"direct-wg: WG and N must be in {SPACE['WG']} and {SPACE['N']}, got "
                         f"{params['WG']} and {params['N']}")
    wg = int(params["WG"])
    kk = ceil_div(shape.C, 16)
    return {"DW_MODE": MODES[mode], "DW_K": shape.K, "DW_KK": kk, "DW_WG": wg,
            "DW_N": int(params["N"]) or n_columns(shape.W_out, wg),
            "DW_LOADS": ceil_div(shape.W * 2 * kk, 128 * wg)}


def threads(d: Mapping[str, int]) -> int:
    return 128 * d["DW_WG"]


def slot_pixels(shape: ConvShape, d: Mapping[str, int]) -> int:
    """Pixels of a ring row: every pass's columns plus the filter's overhang, rounded up to 8
    (ring rows stay on the swizzle's 1024-byte period)."""
    cols = d["DW_WG"] * d["DW_N"]
    return 8 * ceil_div(ceil_div(shape.W_out, cols) * cols + shape.K - 1, 8)


def smem_bytes(shape: ConvShape, d: Mapping[str, int]) -> int:
    """The weights (K*K taps x 64 rows), K + 2 ring rows, and the alignment slack."""
    return (shape.K * shape.K * A_ROWS * ROW_BYTES
            + (shape.K + 2) * slot_pixels(shape, d) * ROW_BYTES + ALIGN_SLACK)


def supports(shape: ConvShape) -> bool:
    """Kernel 50's shapes whose weights and ring fit at the defaults, on a GPU that runs sm_90a
    code."""
    if (shape.S != 1 or shape.C > direct_conv.MAX_CHANNELS or shape.M > A_ROWS
            or shape.B * shape.H_out >= direct_conv.INDEX_LIMIT or wgmma_ruled_out()):
        return False
    return smem_bytes(shape, defines("fp16", shape, DEFAULTS)) <= direct_conv.SMEM_LIMIT


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    blocks: int
    threads: int
    smem: int
    slot_pixels: int


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any], sms: int) -> LaunchPlan:
    """One block an SM, each a run of output rows; never more blocks than rows. ValueError
    where the configuration does not fit in shared memory."""
    d = defines(mode, shape, params)
    smem = smem_bytes(shape, d)
    if smem > direct_conv.SMEM_LIMIT:
        raise ValueError(f"direct-wg: {shape} needs {smem} B of shared memory with these tiles, "
                         f"over {direct_conv.SMEM_LIMIT}: a smaller N or WG")
    return LaunchPlan(d, min(shape.B * shape.H_out, sms), threads(d), smem, slot_pixels(shape, d))


# Where `auto` runs kernel 51 without a cache entry: FP16 layers of at least GEMM-sized channel
# counts (32) that it supports, with output rows of at least AUTO_MIN_WIDTH columns (one
# warpgroup's N a pass or more). Measured on conv1_2 (H200, docs/vgg.md "Kernels 50-51"): B = 16
# 0.24 ms against rung 39's 0.35 (with its layout pass) and cuDNN fp16-cl's 0.31.
AUTO_MODES = ("fp16",)
AUTO_MIN_CHANNELS = 32
AUTO_MIN_WIDTH = 112


def auto_choice(shape: ConvShape, mode: str) -> tuple[str, dict[str, int]] | None:
    """The implementation `auto` runs for this layer in this mode, or None where kernel 51 is
    not its choice."""
    if (mode not in AUTO_MODES or min(shape.C, shape.M) < AUTO_MIN_CHANNELS
            or shape.W_out < AUTO_MIN_WIDTH or not supports(shape)):
        return None
    return f"direct-wg-{mode}", {}


# What CI's nvcc check builds: each mode at conv1_2's defaults, and in fp16 one warpgroup, a
# 5 x 5 filter on 20 channels, and the widest N.
def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        out = [defines(mode, ConvShape(1, 64, 226, 226, 64, 3), DEFAULTS)]
        if mode == "fp16":
            out.append(defines(mode, ConvShape(1, 20, 40, 40, 48, 5), {"WG": 1, "N": 0}))
            out.append(defines(mode, ConvShape(1, 64, 30, 300, 64, 3), {"WG": 2, "N": 128}))
        return out

    return variants


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"direct-wg-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import sm_count
        from convolab.gpu.launch import BoundLaunch

        w32 = direct_conv.checked_weights(name, shape, w, supports(shape))
        plan = launch_plan(shape, mode, params, sm_count())
        kernel = get_kernel(KERNEL_FILE, "direct_conv_wgmma", plan.defines)
        kernel.max_dynamic_shared_size_bytes = plan.smem
        w_op = direct_conv.pack_weights(w32, mode, A_ROWS)
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        launch = BoundLaunch(kernel, (plan.blocks,), (plan.threads,),
                             (None, w_op, b_d, None,
                              *(np.int32(v) for v in (shape.B, shape.C, shape.H, shape.W,
                                                      shape.M, plan.slot_pixels))),
                             per_call=(0, 3), shared_mem=plan.smem)

        return launch  # a BoundLaunch is the run: x and y bound per call

    return prepare


for _mode in MODES:
    register(ConvImpl(
        name=f"direct-wg-{_mode}", rung=51, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"kernel 50 on the warpgroup MMA (sm_90a): the channels-last {_mode} ring "
                     f"read by wgmma descriptors (a filter tap is a descriptor start q rows into "
                     f"the swizzled ring row), the next input row loaded through registers while "
                     f"a row's wgmmas run",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["auto_choice", "defines", "launch_plan", "n_columns", "slot_pixels", "smem_bytes",
           "supports"]
