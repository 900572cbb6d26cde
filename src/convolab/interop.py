"""Arrays from elsewhere: NumPy, CuPy and anything speaking DLPack (torch, JAX) in, the
caller's kind of array out, zero-copy where the producer allows it.

`to_xp(a, label)` gives a float32 C-contiguous NumPy (host) or CuPy (CUDA device) array and a
`Kind` that `Kind.back(result)` uses to hand a result back as the caller's type. Nothing here
imports CuPy, torch or JAX unless the caller's array already belongs to one of them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none, vector_aligned
from convolab.errors import InputError, InputTypeError

# DLPack device types (dlpack.h, DLDeviceType) that hold memory convolab can read.
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
_HOST_DEVICES = (DL_CPU, DL_CUDA_HOST)
# Floating dtypes converted to float32 (with a copy); anything else is refused.
_CONVERTED = (np.float64, np.float16)


@dataclass(frozen=True)
class Kind:
    """Where an argument came from: 'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (any other
    producer, answered with NumPy/CuPy arrays since there is no generic constructor)."""

    name: str
    device: str  # 'cpu' or 'gpu'

    def back(self, result: Any) -> Any:
        """`result` (NumPy or CuPy) as the caller's kind of array, zero-copy via DLPack."""
        if self.name == "torch":
            import torch

            return torch.from_dlpack(result)
        if self.name == "jax":
            import jax.numpy as jnp

            return jnp.from_dlpack(result)
        return result


def _producer(a: Any) -> str:
    root = type(a).__module__.split(".", 1)[0]
    if root == "torch":
        return "torch"
    if root in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def _from_dlpack(a: Any, label: str) -> tuple[Any, Kind]:
    try:
        device_type = int(a.__dlpack_device__()[0])
    except Exception as err:  # a broken producer: name it rather than fail deep inside
        raise InputTypeError(f"{label}: __dlpack_device__() failed: {err}") from None
    producer = _producer(a)
    if device_type in _HOST_DEVICES:
        module, device = np, "cpu"
    elif device_type in (DL_CUDA, DL_CUDA_MANAGED):
        module, device = cupy_or_none(), "gpu"
        if module is None:
            raise InputError(f"{label} is on a CUDA device, but CuPy is not usable here "
                             "(install the 'gpu' extra), so convolab cannot read it")
    else:
        raise InputError(f"{label} lives on DLPack device type {device_type}; convolab reads "
                         "host (CPU) and CUDA memory only")
    try:
        return module.from_dlpack(a), Kind(producer, device)
    except Exception as err:  # e.g. torch refuses tensors that require grad
        raise InputTypeError(f"{label}: cannot be shared through DLPack: {err}") from None


def as_array(a: Any, label: str) -> tuple[Any, Kind]:
    """`a` as the NumPy or CuPy array it is (or shares memory with, through DLPack), and where
    it came from: no dtype or layout change."""
    if isinstance(a, np.ndarray):
        return a, Kind("numpy", "cpu")
    cp = sys.modules.get("cupy")  # a CuPy array implies CuPy is imported already
    if cp is not None and isinstance(a, cp.ndarray):
        return a, Kind("cupy", "gpu")
    if hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__"):
        return _from_dlpack(a, label)
    raise InputTypeError(f"{label} must be an array (NumPy, CuPy, or anything with __dlpack__ "
                         f"such as a torch tensor), got {type(a).__name__}")


def to_xp(a: Any, label: str, ndim: int | None = None) -> tuple[Any, Kind]:
    """`a` as a float32, C-contiguous NumPy or CuPy array (shared memory where it already is
    one), and where it came from. float64 and float16 are converted to float32 (a copy); other
    dtypes are refused; a non-contiguous array is copied to a contiguous one, and so is a CuPy
    array whose data does not start on a 16-byte boundary (`backend.vector_aligned`)."""
    arr, kind = as_array(a, label)
    if ndim is not None and arr.ndim != ndim:
        raise InputError(f"{label} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if arr.dtype != np.float32:
        if arr.dtype not in _CONVERTED:
            raise InputTypeError(f"{label} must be floating point (float32; float64 and float16 "
                                 f"are converted), got {arr.dtype}")
        arr = arr.astype(np.float32)
    if not arr.flags.c_contiguous:
        module = np if kind.device == "cpu" else cupy_or_none()
        arr = module.ascontiguousarray(arr)
    return vector_aligned(arr), kind


def same_device(kind: Kind, other: Kind, label: str, first: str = "x") -> None:
    if kind.device != other.device:
        raise InputError(f"{label} is on the {other.device.upper()} but {first} is on the "
                         f"{kind.device.upper()}: pass both on one device")
