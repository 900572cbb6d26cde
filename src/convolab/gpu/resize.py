"""Raw uint8 images resized on the GPU (kernels/25_resize_u8.cu, kernels/resize.cuh).

The same half-pixel bilinear rule as `data.resize_bilinear`, bit for bit: the taps come from
`data.bilinear_taps` (float64 positions, float32 weights) and the kernel rounds each step as
NumPy does. Fused kernels that read raw bytes take the same `device_taps` table.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from convolab.backend import require_cupy
from convolab.data import bilinear_taps
from convolab.errors import InputError

KERNEL_FILE = "25_resize_u8.cu"
# One ResizeTap of resize.cuh: the two source indices and the weight of the second.
TAP_DTYPE = np.dtype([("lo", np.int32), ("hi", np.int32), ("t", np.float32)])
THREADS = 256


def resize_taps(in_h: int, in_w: int, out_h: int, out_w: int) -> np.ndarray:
    """The taps of every output row, then of every output column (out_h + out_w entries)."""
    taps = np.empty(out_h + out_w, TAP_DTYPE)
    for part, (n_in, n_out) in zip((taps[:out_h], taps[out_h:]),
                                   ((in_h, out_h), (in_w, out_w)), strict=True):
        lo, hi, t = bilinear_taps(n_in, n_out)
        part["lo"], part["hi"], part["t"] = lo, hi, t.astype(np.float32)
    return taps


@functools.cache
def _device_taps(in_h: int, in_w: int, out_h: int, out_w: int, device_id: int) -> Any:
    cp = require_cupy()
    host = resize_taps(in_h, in_w, out_h, out_w)
    return cp.asarray(host.view(np.uint8))  # raw bytes: CuPy has no structured dtypes


def device_taps(in_h: int, in_w: int, out_h: int, out_w: int) -> Any:
    """The tap table on the current device (cached): pass `.data.ptr` as `const ResizeTap*`."""
    cp = require_cupy()
    return _device_taps(in_h, in_w, out_h, out_w, cp.cuda.runtime.getDevice())


def check_raw(raw: Any, what: str = "raw images") -> None:
    """One clear error unless `raw` is a uint8 (N, H, W) array."""
    if raw.ndim != 3:
        raise InputError(f"{what} must have shape (N, H, W), got {tuple(raw.shape)}")
    if raw.dtype != np.uint8:
        raise InputError(f"{what} must be uint8 (the bytes of the image file), got {raw.dtype}")
    if 0 in raw.shape[1:]:
        raise InputError(f"{what} must have H, W >= 1, got shape {tuple(raw.shape)}")


def resize_u8(raw: Any, size: int, index: Any = None, out: Any = None) -> Any:
    """(N, 1, size, size) float32 on the GPU from uint8 images (N, H, W) on the GPU.

    index: optional int64 device array; output i is then the resize of raw[index[i]]
    (a shuffled batch without a gather copy)."""
    from convolab.gpu.compile import get_kernel

    cp = require_cupy()
    check_raw(raw)
    raw = cp.ascontiguousarray(raw)
    n, in_h, in_w = (int(v) for v in raw.shape)
    if index is not None:
        index = cp.ascontiguousarray(index, dtype=cp.int64)
        n = int(index.shape[0])
    if out is None:
        out = cp.empty((n, 1, size, size), cp.float32)
    elif out.shape != (n, 1, size, size) or out.dtype != cp.float32 or not out.flags.c_contiguous:
        raise InputError(f"out must be a contiguous float32 array of shape {(n, 1, size, size)}")
    if n == 0:
        return out
    kernel = get_kernel(KERNEL_FILE, "resize_u8")
    taps = device_taps(in_h, in_w, size, size)
    null = np.uintp(0)  # a null `index`
    kernel((n,), (THREADS,),
           (raw, index if index is not None else null, taps, out, cp.int32(in_h),
            cp.int32(in_w), cp.int32(size), cp.int32(size)),
           shared_mem=4 * in_h * in_w)
    return out
