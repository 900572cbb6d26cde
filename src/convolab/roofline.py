"""Measured hardware ceilings for the roofline columns of `convolab bench`.

A roofline percentage is only as honest as its ceilings, so they are measured on the machine
the benchmark runs on, once per run: device-to-device copy bandwidth (read + write counted)
and large-GEMM throughput at fp32 (FFMA), TF32 and FP16 through cuBLAS. Where a measurement
is impossible (no GPU, no cuBLAS entry point) the fallback ceilings below stand in (the H100
figures docs/spec.md lists as the course machine's), and the result says so in `source`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none
from convolab.gpu.device import gpu_name
from convolab.timing import time_cpu, time_gpu

# Fallback ceilings: the course machine (H100 80GB HBM3, 132 SMs) as docs/spec.md states them.
FALLBACK_GPU_COPY_GBPS = 2970.0
FALLBACK_GPU_FP32_GFLOPS = 51_500.0
FALLBACK_GPU_TF32_GFLOPS = 404_000.0
FALLBACK_GPU_FP16_GFLOPS = 747_000.0
FALLBACK_SOURCE = "docs/spec.md course machine (H100 80GB HBM3)"

# cuBLAS math modes (cublas_api.h); CuPy exposes them under these names in recent versions.
_CUBLAS_DEFAULT_MATH = 0
_CUBLAS_TF32_TENSOR_OP_MATH = 3


@dataclass
class Ceilings:
    """Peak rates in GB/s and GFLOP/s; `source` maps each field to where its number came from."""

    device: str
    copy_gbps: float
    fp32_gflops: float
    tf32_gflops: float
    fp16_gflops: float
    source: dict[str, str] = field(default_factory=dict)

    def peak_gflops(self, precision: str) -> float:
        try:
            return {"fp32": self.fp32_gflops, "tf32": self.tf32_gflops,
                    "fp16": self.fp16_gflops}[precision]
        except KeyError:
            raise ValueError(f"unknown precision {precision!r}: fp32, tf32 or fp16") from None

    def floor_ms(self, flops: float, nbytes: float, precision: str = "fp32") -> float:
        """The roofline's lower bound on time: the slower of compute at peak and traffic at peak."""
        return max(flops / (self.peak_gflops(precision) * 1e6), nbytes / (self.copy_gbps * 1e6))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    """Host wall clock, one warm-up (CPU ceilings)."""
    return statistics.median(time_cpu(fn, reps=reps, warmup=1))


def _gpu_event_ms(cp: Any, fn: Callable[[], object], reps: int) -> float:
    """CUDA events, one warm-up (GPU ceilings); `cp` kept for the callers' symmetry."""
    return statistics.median(time_gpu(fn, reps=reps, warmup=1))


def _gpu_copy_gbps(cp: Any, nbytes: int = 1 << 30, reps: int = 10) -> float:
    src = cp.ones(nbytes // 4, dtype=np.float32)
    dst = cp.empty_like(src)

    def copy() -> None:
        dst.data.copy_from_device_async(src.data, src.nbytes)

    ms = _gpu_event_ms(cp, copy, reps)
    return 2 * nbytes / (ms * 1e6)  # every byte is read once and written once


def _gpu_sgemm_gflops(cp: Any, math_mode: int, n: int = 8192, reps: int = 10) -> float:
    """cuBLAS SGEMM with an explicit math mode: DEFAULT forbids TF32, TF32_TENSOR_OP allows it.

    cupy.matmul would follow CUPY_TF32 from the environment, so the handle is driven directly.
    """
    from cupy.cuda import cublas

    a = cp.random.random((n, n), dtype=np.float32)
    b = cp.random.random((n, n), dtype=np.float32)
    c = cp.empty((n, n), dtype=np.float32)
    alpha = np.ones(1, np.float32)
    beta = np.zeros(1, np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    previous, previous_pointer = cublas.getMathMode(handle), cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.setMathMode(handle, math_mode)
    try:
        def gemm() -> None:
            cublas.sgemm(handle, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, n, n,
                         alpha.ctypes.data, a.data.ptr, n, b.data.ptr, n,
                         beta.ctypes.data, c.data.ptr, n)

        ms = _gpu_event_ms(cp, gemm, reps)
    finally:
        cublas.setMathMode(handle, previous)
        cublas.setPointerMode(handle, previous_pointer)
    return 2 * n**3 / (ms * 1e6)


def _gpu_hgemm_gflops(cp: Any, n: int = 8192, reps: int = 10) -> float:
    a = cp.random.random((n, n), dtype=np.float32).astype(np.float16)
    b = cp.random.random((n, n), dtype=np.float32).astype(np.float16)
    ms = _gpu_event_ms(cp, lambda: cp.matmul(a, b), reps)
    return 2 * n**3 / (ms * 1e6)


def measure_gpu_ceilings() -> Ceilings:
    """Measure the GPU's copy bandwidth and GEMM peaks; each failure keeps its fallback ceiling."""
    ceilings = Ceilings(gpu_name(), FALLBACK_GPU_COPY_GBPS, FALLBACK_GPU_FP32_GFLOPS,
                        FALLBACK_GPU_TF32_GFLOPS, FALLBACK_GPU_FP16_GFLOPS,
                        {k: f"fallback: {FALLBACK_SOURCE}" for k in
                         ("copy_gbps", "fp32_gflops", "tf32_gflops", "fp16_gflops")})
    cp = cupy_or_none()
    if cp is None:
        ceilings.source = {k: f"{v} (no GPU here)" for k, v in ceilings.source.items()}
        return ceilings
    probes: dict[str, tuple[Callable[[], float], str]] = {
        "copy_gbps": (lambda: _gpu_copy_gbps(cp), "measured: 1 GiB cudaMemcpy D2D, read+write"),
        "fp32_gflops": (lambda: _gpu_sgemm_gflops(cp, _CUBLAS_DEFAULT_MATH),
                        "measured: cuBLAS SGEMM 8192^3, CUBLAS_DEFAULT_MATH (no TF32)"),
        "tf32_gflops": (lambda: _gpu_sgemm_gflops(cp, _CUBLAS_TF32_TENSOR_OP_MATH),
                        "measured: cuBLAS SGEMM 8192^3, CUBLAS_TF32_TENSOR_OP_MATH"),
        "fp16_gflops": (lambda: _gpu_hgemm_gflops(cp), "measured: cupy.matmul fp16 8192^3"),
    }
    for key, (probe, how) in probes.items():
        try:
            setattr(ceilings, key, float(probe()))
            ceilings.source[key] = how
        except Exception as err:  # a missing cuBLAS entry point must not stop the benchmark
            ceilings.source[key] = f"fallback: {FALLBACK_SOURCE} ({type(err).__name__}: {err})"
    cp.get_default_memory_pool().free_all_blocks()
    return ceilings


def measure_cpu_ceilings(n: int = 2048, copy_mb: int = 128) -> Ceilings:
    """Loose CPU ceilings: NumPy fp32 matmul (BLAS) GFLOP/s and a large memcpy's GB/s."""
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    gemm_ms = _median_ms(lambda: a @ a, reps=5)
    src = np.ones(copy_mb * (1 << 20) // 4, np.float32)
    dst = np.empty_like(src)
    copy_ms = _median_ms(lambda: np.copyto(dst, src), reps=5)
    gflops = 2 * n**3 / (gemm_ms * 1e6)
    how = f"measured: NumPy fp32 matmul {n}^3 (no separate TF32/FP16 on the CPU)"
    return Ceilings(
        device="cpu",
        copy_gbps=2 * src.nbytes / (copy_ms * 1e6),
        fp32_gflops=gflops, tf32_gflops=gflops, fp16_gflops=gflops,
        source={"copy_gbps": f"measured: np.copyto {copy_mb} MB, read+write",
                "fp32_gflops": how, "tf32_gflops": how, "fp16_gflops": how},
    )
