"""A kernel launch with its arguments bound once, for layers whose whole run is microseconds.

CuPy's `RawKernel.__call__` converts every argument on every call: on the H200 machines this
project is measured on, 10.7 us of host time for an empty kernel of 12 parameters against 5.2
through the driver's cuLaunchKernel with the parameter array built beforehand
(`benchmarks/launch_cost.py`). The bench's Op Time starts its clock before the call, so at fc7
(a 5-25 us kernel) that difference is a fifth of the measurement. `BoundLaunch` builds the
array at prepare; a call rewrites only the slots of the arrays that change per call (x, y) and
launches on the current stream. The classifier-layer kernels (41, 42, 43, 48, 49) and the
implicit-GEMM rungs (26, 27, 39, 40: layout pass, GEMM, split-k sum) launch through it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from convolab.backend import require_cupy

_SCALARS: dict[type, type] = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
                              np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64,
                              np.float32: ctypes.c_float}


class BoundLaunch:
    """`kernel(grid, block, args, shared_mem=...)` with args fixed but for the positions in
    `per_call`, which each call passes (device arrays, in that order)."""

    def __init__(self, kernel: Any, grid: Sequence[int], block: Sequence[int],
                 args: Sequence[Any], per_call: Sequence[int], shared_mem: int = 0) -> None:
        from cupy_backends.cuda.api import driver

        self._launch = driver.launchKernel
        self._stream = require_cupy().cuda.get_current_stream
        self._function = kernel.kernel.ptr  # compiles on first use, here rather than timed
        self._grid = (tuple(grid) + (1, 1))[:3]
        self._block = (tuple(block) + (1, 1))[:3]
        self._shared_mem = int(shared_mem)
        self._keep = list(args)  # the bound arrays must outlive every launch
        self._slots = [self._slot(i, a, per_call) for i, a in enumerate(args)]
        self._per_call = [self._slots[i] for i in per_call]
        self._params = (ctypes.c_void_p * len(self._slots))(
            *[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p) for s in self._slots])
        self._address = ctypes.addressof(self._params)
        # The slots are shared: one caller at a time sets them and launches (the driver copies
        # the parameters at the launch, so the next caller may rewrite them right after).
        self._lock = threading.Lock()

    @staticmethod
    def _slot(index: int, arg: Any, per_call: Sequence[int]) -> Any:
        if index in per_call:
            return ctypes.c_void_p(0)
        if type(arg) in _SCALARS:
            return _SCALARS[type(arg)](arg.item())
        if hasattr(arg, "data") and hasattr(arg.data, "ptr"):
            return ctypes.c_void_p(arg.data.ptr)
        raise TypeError(f"BoundLaunch: argument {index} is a {type(arg).__name__}; bind device "
                        f"arrays or NumPy scalars of {sorted(t.__name__ for t in _SCALARS)}")

    def __call__(self, *arrays: Any) -> None:
        gx, gy, gz = self._grid
        bx, by, bz = self._block
        with self._lock:
            for slot, a in zip(self._per_call, arrays, strict=True):
                slot.value = a.data.ptr
            self._launch(self._function, gx, gy, gz, bx, by, bz, self._shared_mem,
                         self._stream().ptr, self._address, 0)


__all__ = ["BoundLaunch"]
