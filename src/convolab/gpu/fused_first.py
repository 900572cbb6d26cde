"""Rung 29: a model's first block (one input channel, many output channels) as one kernel,
conv + bias + ReLU + max-pool, from raw uint8 images resized on chip or from float images,
writing the pooled map in fp32 or fp16 (kernels/29_fused_first_conv_pool.cu).

`first_plan` picks the compile-time geometry; `prepare(...)` returns run(x, out), which reads
raw images (B, h, w) uint8 when prepared with `raw_hw`, else float images (B, 1, H, W).
A prepared run says what it reads and writes (`run.in_dtype`, `run.out_dtype`): the fused
network sizes its buffers from them. Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.errors import InputError
from convolab.gpu.device import SM_REGISTERS, SMEM_STATIC_LIMIT
from convolab.gpu.fused_ffma import ACC_BUDGET, CW_BYTES, pooled_hw, zoo_fused_layers
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "29_fused_first_conv_pool.cu"
OUT_DTYPES = ("float32", "float16")
# Block sizes the planner chooses from: pool windows (one per thread) of a block.
THREAD_CHOICES = tuple(range(128, 513, 32))
# Registers a thread needs, fitted to what ptxas used without spills: the P*P*MT accumulators,
# a filter row of inputs per filter row (loaded ahead) and addresses.
REG_OVERHEAD = 24
FLOAT_BYTES = 4


def channels_per_launch(shape: ConvShape, pool: int, params: Mapping[str, Any]) -> int:
    """Output channels of one launch: the accumulators (mt * pool^2) within the register budget
    and the weights and bias (mt * (K*K + 1) floats) within the kernel parameters; a layer with
    more channels runs one launch per group, the groups as even as they can be."""
    cap = max(1, min(ACC_BUDGET // (pool * pool),
                     CW_BYTES // (FLOAT_BYTES * (shape.K * shape.K + 1))))
    if params.get("mt"):
        return max(1, min(int(params["mt"]), cap, shape.M))
    return ceil_div(shape.M, ceil_div(shape.M, cap))


def default_threads(windows: int) -> int:
    """The block size (a multiple of 32) whose blocks cover an image's pool windows with the
    fewest idle threads; ties go to the larger block (fewer blocks stage the same rows)."""
    return min(THREAD_CHOICES, key=lambda t: (ceil_div(windows, t) * t, -t))


def band_rows(shape: ConvShape, pool: int, threads: int) -> int:
    """Input rows a block stages: its windows span at most ceil((threads-1)/Wp) + 1 pooled rows
    (the kernel's FF_ROWS)."""
    _, wp = pooled_hw(shape, pool)
    return min(ceil_div(threads - 1, wp) * pool + pool - 1 + shape.K, shape.H)


def smem_bytes(shape: ConvShape, pool: int, threads: int,
               raw_hw: tuple[int, int] | None = None) -> int:
    """Static shared memory of a block: the band's rows (an even row stride) and, reading raw
    bytes, the raw image as floats (in the same space) and the band's row pass."""
    rows = band_rows(shape, pool, threads)
    band = rows * (shape.W + shape.W % 2) + 2
    if raw_hw is None:
        return FLOAT_BYTES * band
    return FLOAT_BYTES * (max(band, raw_hw[0] * raw_hw[1]) + rows * raw_hw[1])


def supports(shape: ConvShape, pool: int, raw_hw: tuple[int, int] | None = None) -> bool:
    """One input channel, stride 1, a pooled output, and the block's rows (and raw image) in
    static shared memory."""
    if shape.C != 1 or shape.S != 1 or pool < 1 or pool * pool > ACC_BUDGET:
        return False
    hp, wp = pooled_hw(shape, pool)
    if hp < 1 or wp < 1 or FLOAT_BYTES * (shape.K * shape.K + 1) > CW_BYTES:
        return False
    return smem_bytes(shape, pool, max(THREAD_CHOICES), raw_hw) <= SMEM_STATIC_LIMIT


def preferred(shape: ConvShape, pool: int) -> bool:
    """Whether the fused network runs a first block on rung 29 without being asked: where it
    takes the shape and fcp_exact_cw (rung 16, all channels in one thread's multi-window
    tile) does not — ece408's conv1 (M = 4) stays on 16 and its tensor-core / channels-last
    variants."""
    from convolab.gpu.fused_ffma import cw_fits

    return supports(shape, pool) and not cw_fits(shape, 4 if shape.M >= 3 else shape.M)


@dataclass(frozen=True)
class FirstPlan:
    """Compile-time defines and launch geometry of one rung-29 kernel."""

    defines: dict[str, int]
    threads: int
    blocks_per_image: int
    channels: int  # output channels of one launch (FF_MT)
    groups: int  # launches per forward: ceil(M / channels)
    kernel: str  # ff_conv_pool_raw or ff_conv_pool_f32


def first_plan(shape: ConvShape, pool: int, params: Mapping[str, Any] | None = None,
               raw_hw: tuple[int, int] | None = None, out_dtype: str = "float32") -> FirstPlan:
    """params may fix threads (pool windows per block), minb (blocks per SM the registers must
    allow) and mt (channels per launch); 0 or absent means choose."""
    params = params or {}
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"rung 29: out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    if not supports(shape, pool, raw_hw):
        raise ValueError(f"rung 29 (fused first block) does not support {shape} with pool "
                         f"{pool}" + (f" from raw {raw_hw[0]}x{raw_hw[1]} images" if raw_hw
                                      else ""))
    hp, wp = pooled_hw(shape, pool)
    mt = channels_per_launch(shape, pool, params)
    threads = int(params.get("threads") or default_threads(hp * wp))
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"rung 29: threads must be a multiple of 32 in 32..1024, got {threads}")
    if smem_bytes(shape, pool, threads, raw_hw) > SMEM_STATIC_LIMIT:
        raise ValueError(f"rung 29: {threads} threads' rows of {shape} exceed the static "
                         f"shared memory ({SMEM_STATIC_LIMIT} bytes)")
    # Registers: what ptxas needs without spills, capped so that minb blocks fit an SM.
    need = mt * pool * pool + (pool - 1 + shape.K) * 2 + REG_OVERHEAD
    minb = int(params.get("minb") or max(1, SM_REGISTERS // (threads * max(need, 64))))
    defines = {"FF_K": shape.K, "FF_P": pool, "FF_H": shape.H, "FF_W": shape.W, "FF_MT": mt,
               "FF_THREADS": threads, "FF_MINB": minb,
               "FF_HALF": int(out_dtype == "float16")}
    if raw_hw is not None:
        defines |= {"RAW_H": raw_hw[0], "RAW_W": raw_hw[1]}
    return FirstPlan(defines, threads, ceil_div(hp * wp, threads), mt, ceil_div(shape.M, mt),
                     "ff_conv_pool_raw" if raw_hw is not None else "ff_conv_pool_f32")


def group_params(w: np.ndarray, b: np.ndarray, K: int, mt: int) -> list[np.ndarray]:
    """Each launch's weights and bias as the kernel's by-value struct
    {float w[K*K][mt]; float b[mt]} (a one-element structured array: CuPy passes it by value),
    zero-padded past the layer's channels."""
    M = w.shape[0]
    struct = np.dtype({"names": ["w", "b"],
                       "formats": [(np.float32, (K * K, mt)), (np.float32, (mt,))]})
    taps = np.asarray(w, np.float32).reshape(M, K * K)
    out = []
    for m0 in range(0, M, mt):
        packed = np.zeros(1, struct)
        n = min(mt, M - m0)
        packed["w"][0, :, :n] = taps[m0:m0 + n].T
        packed["b"][0, :n] = np.asarray(b, np.float32)[m0:m0 + n]
        out.append(packed)
    return out


def prepare(shape: ConvShape, pool: int, weight: Any, bias: Any,
            kernel_params: Mapping[str, Any] | None = None,
            raw_hw: tuple[int, int] | None = None, out_dtype: str = "float32") -> Run:
    """run(x, out): x raw uint8 images (n, *raw_hw) when raw_hw is given (resized on chip to
    shape.H x shape.W, the rule of data.resize_bilinear), else float32 images (n, 1, H, W);
    out (n, M, Hp, Wp) in out_dtype. n may be any batch size."""
    from convolab.backend import to_numpy
    from convolab.gpu.compile import get_kernel
    from convolab.gpu.resize import device_taps

    plan = first_plan(shape, pool, kernel_params, raw_hw, out_dtype)
    w, b = np.asarray(to_numpy(weight), np.float32), np.asarray(to_numpy(bias), np.float32)
    if w.shape != shape.w_shape or b.shape != (shape.M,):
        raise InputError(f"rung 29: weight {w.shape} and bias {b.shape} do not fit {shape} "
                         f"(want {shape.w_shape} and ({shape.M},))")
    kernel = get_kernel(KERNEL_FILE, plan.kernel, plan.defines)
    structs = group_params(w, b, shape.K, plan.channels)
    head: tuple[Any, ...] = ()
    if raw_hw is not None:
        head = (device_taps(raw_hw[0], raw_hw[1], shape.H, shape.W),)
    in_tail = tuple(raw_hw) if raw_hw is not None else (1, shape.H, shape.W)
    out_tail = (shape.M, *pooled_hw(shape, pool))
    in_dtype = np.uint8 if raw_hw is not None else np.float32
    i32 = np.int32

    def run(x: Any, out: Any) -> None:
        n = int(x.shape[0])
        if x.dtype != in_dtype or tuple(x.shape[1:]) != in_tail or not x.flags.c_contiguous:
            raise InputError(f"rung 29: input must be contiguous {np.dtype(in_dtype)} "
                             f"(n, {', '.join(map(str, in_tail))}), got {x.dtype} "
                             f"{tuple(x.shape)}")
        if out.dtype != out_dtype or tuple(out.shape) != (n, *out_tail):
            raise InputError(f"rung 29: out must be {out_dtype} {(n, *out_tail)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        if n == 0:
            return
        for g, struct in enumerate(structs):
            m0 = g * plan.channels
            kernel((n * plan.blocks_per_image,), (plan.threads,),
                   (x, *head, struct, out, i32(shape.M), i32(m0),
                    i32(min(plan.channels, shape.M - m0))))

    run.in_dtype = np.dtype(in_dtype).name  # type: ignore[attr-defined]
    run.out_dtype = out_dtype  # type: ignore[attr-defined]
    run.plan = plan  # type: ignore[attr-defined]  # for tests and benchmarks
    return run


# ---- the registry entry: float input, fp32 output ---------------------------------------------


def first_layers() -> list[tuple[ConvShape, int]]:
    """(shape, pool) of every zoo conv layer rung 29 takes (batch 1)."""
    return [(s, p) for s, p in zoo_fused_layers() if supports(s, p)]


def compile_variants() -> list[dict[str, int]]:
    """Every define set the host compiles for the zoo's first layers: fp32 and fp16 output,
    float input and Fashion-MNIST's 28x28 raw images."""
    from convolab.data import IMAGE_SIDE

    variants: list[dict[str, int]] = []
    for shape, pool in first_layers():
        for out_dtype in OUT_DTYPES:
            for raw_hw in (None, (IMAGE_SIDE, IMAGE_SIDE)):
                plan = first_plan(shape, pool, {}, raw_hw, out_dtype)
                if plan.defines not in variants:
                    variants.append(plan.defines)
    return variants


def _prepare_f32(pool: int) -> Any:
    def prepare_impl(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        return prepare(shape, pool, w, b, params)

    return prepare_impl


FIRST_POOL = 2  # the zoo's first blocks all pool 2x2
FIRST_IMPL = register(ConvImpl(
    name=f"fused-first-conv-pool{FIRST_POOL}",
    demonstrates=("a first block (C = 1, many output channels) as one kernel: conv + bias + "
                  "ReLU + max-pool, one pool window of all channels per thread, weights as "
                  "constant-bank operands, coalesced pooled stores; raw uint8 input resized "
                  "on chip, fp16 output for an fp16 next layer"),
    device="gpu",
    prepare=_prepare_f32(FIRST_POOL),
    supports=lambda s: supports(s, FIRST_POOL),
    space={"threads": [128, 160, 224, 256, 288], "minb": [1, 2, 3, 4], "mt": [4, 8, 12, 16]},
    defaults={"threads": 0, "minb": 0, "mt": 0},
    tolerance=TOLERANCE["fp32"],
    rung=29,
    kernel_file=KERNEL_FILE,
    compile_variants=compile_variants,
    pool=FIRST_POOL,
))
