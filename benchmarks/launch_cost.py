"""Host microseconds of one kernel launch, by each way this project could launch one.

    python3 benchmarks/launch_cost.py [--reps R]

An empty kernel with 2 and with 12 parameters (pointers and ints, as the rungs take), launched
(a) through CuPy's RawKernel call, (b) through the driver's cuLaunchKernel with the parameter array
built once (only the input's pointer slot rewritten per call), by ctypes and by CuPy's own
binding (cupy_backends' driver.launchKernel), and, for scale, (c)
torch.matmul on a 64 x 4096 by 4096 x 1024 fp16 product (the cuBLAS anchor's call). Medians of
R host times (perf_counter around the call), and the event time of R back-to-back calls / R.
"""

from __future__ import annotations

import argparse
import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
from call_overhead import host_us

SOURCE = r"""
extern "C" __global__ void empty2(const float* x, float* y) {
  if (threadIdx.x == 1024) y[0] = x[0];
}
extern "C" __global__ void empty12(const float* x, const float* w, const float* b, float* y,
                                   float* p, int* t, int a0, int a1, int a2, int a3, int a4,
                                   int a5) {
  if (threadIdx.x == 1024) y[0] = x[0] + w[a0] + b[a1] + p[a2] + t[a3] + a4 + a5;
}
"""


def _queued(cp: Any, fn: Callable[[], Any], reps: int) -> float:
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    fn()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps


def _driver_launch(cp: Any, fn: Any, args: list[Any]
                   ) -> tuple[Callable[[], None], Callable[[], None]]:
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.restype = ctypes.c_int
    slots = [ctypes.c_int(int(a)) if isinstance(a, np.integer) else ctypes.c_void_p(a.data.ptr)
             for a in args]
    params = (ctypes.c_void_p * len(slots))(*[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p)
                                              for s in slots])
    func = ctypes.c_void_p(fn.kernel.ptr)  # the CUfunction behind the RawKernel

    def go() -> None:
        slots[0].value = args[0].data.ptr  # the per-call input pointer, as a run would
        err = launch(func, 1, 1, 1, 32, 1, 1, 0,
                     ctypes.c_void_p(cp.cuda.get_current_stream().ptr), params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel: {err}")

    def via_cupy() -> None:  # the same array through CuPy's own binding of cuLaunchKernel
        slots[0].value = args[0].data.ptr
        driver.launchKernel(fn.kernel.ptr, 1, 1, 1, 32, 1, 1, 0,
                            cp.cuda.get_current_stream().ptr, ctypes.addressof(params), 0)

    from cupy_backends.cuda.api import driver

    return go, via_cupy


def main() -> None:
    import cupy as cp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    reps = parser.parse_args().reps
    module = cp.RawModule(code=SOURCE)
    x, y = cp.zeros(64, cp.float32), cp.zeros(64, cp.float32)
    t = cp.zeros(64, cp.int32)
    ints = tuple(np.int32(i) for i in range(6))
    cases: dict[str, Callable[[], Any]] = {}
    k2, k12 = module.get_function("empty2"), module.get_function("empty12")
    cases["cupy RawKernel, 2 params"] = lambda: k2((1,), (32,), (x, y))
    cases["cupy RawKernel, 12 params"] = lambda: k12((1,), (32,), (x, x, x, y, y, t, *ints))
    for n, fn, args in ((2, k2, [x, y]), (12, k12, [x, x, x, y, y, t, *ints])):
        by_ctypes, by_cupy = _driver_launch(cp, fn, args)
        cases[f"cuLaunchKernel (ctypes), {n} params"] = by_ctypes
        cases[f"cupy driver.launchKernel, {n} params"] = by_cupy
    try:
        import torch

        a = torch.zeros(64, 4096, dtype=torch.float16, device="cuda")
        bm = torch.zeros(4096, 1024, dtype=torch.float16, device="cuda")
        cases["torch.matmul fp16 64x4096x1024"] = lambda: torch.matmul(a, bm)
    except Exception as err:  # torch is optional
        print(f"torch: {err}")
    print(f"{'launch':<40} {'host us':>8} {'queued us':>10}")
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        cp.cuda.Device().synchronize()
        print(f"{name:<40} {host_us(fn, reps):8.2f} {_queued(cp, fn, reps):10.2f}", flush=True)
        cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
