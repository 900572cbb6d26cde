"""One array interface: NumPy on the CPU, CuPy on the GPU. Nothing here imports CuPy eagerly."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np


@functools.cache
def cupy_or_none() -> ModuleType | None:
    """CuPy if it imports and sees at least one CUDA device, else None."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return None


def gpu_available() -> bool:
    return cupy_or_none() is not None


def require_cupy() -> ModuleType:
    cp = cupy_or_none()
    if cp is None:
        raise RuntimeError(
            "no CUDA GPU is usable here (CuPy is missing or sees no device); "
            "install the 'gpu' extra on a machine with an NVIDIA GPU, or use --device cpu"
        )
    return cp


def xp_of(a: Any) -> ModuleType:
    """The array module (numpy or cupy) that owns `a`."""
    if isinstance(a, np.ndarray) or np.isscalar(a):
        return np
    cp = cupy_or_none()
    if cp is not None and isinstance(a, cp.ndarray):
        return cp
    raise TypeError(f"expected a NumPy or CuPy array, got {type(a).__name__}")


def is_gpu_array(a: Any) -> bool:
    return xp_of(a) is not np


VECTOR_BYTES = 16  # the widest load a GPU kernel issues on an input array (float4, cp.async)


def vector_aligned(a: Any) -> Any:
    """`a` itself where it is a NumPy array or its data starts on a VECTOR_BYTES boundary (every
    CuPy allocation does), else a contiguous copy that does. A view at an offset into a batch
    (x[1:] of single-channel 29x29 images starts 3,364 bytes in) would fault in a kernel's
    16-byte loads, and a faulted kernel leaves the CUDA context unusable."""
    if isinstance(a, np.ndarray) or a.data.ptr % VECTOR_BYTES == 0:
        return a
    return a.copy()


def to_numpy(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def to_device(a: Any, device: str) -> Any:
    """Move an array to 'cpu' (NumPy) or 'gpu' (CuPy)."""
    if device == "cpu":
        return to_numpy(a)
    if device == "gpu":
        return require_cupy().asarray(a)
    raise ValueError(f"unknown device {device!r}: use 'cpu' or 'gpu'")
