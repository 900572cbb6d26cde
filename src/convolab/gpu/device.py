"""What the kernels' launch plans need to know about the GPU, defined once.

The per-SM limits are those of compute capability 9.0 (H100/H200), the machines the ladder is
tuned for; plans use them to size tiles and persistent grids, and the driver's occupancy
answer takes over wherever a plan launches (see `occupancy`).
"""

from __future__ import annotations

import ctypes
from typing import Any

from convolab.backend import cupy_or_none
from convolab.shapes import ceil_div

# A block gets 48 KB of shared memory without asking; beyond that a kernel must opt in
# (cudaFuncAttributeMaxDynamicSharedMemorySize). Static __shared__ arrays cannot opt in, so
# they stay under it, with 2 KB left for the compiler's own.
SMEM_NO_OPT_IN = 48 * 1024
SMEM_STATIC_LIMIT = SMEM_NO_OPT_IN - 2 * 1024
# Dynamic shared memory one block may opt into so that two blocks still share an SM
# (228 KB per SM, 1 KB of it reserved per block).
SMEM_DYNAMIC_TWO_BLOCKS = 113 * 1024
SM_SMEM_BYTES = 228 * 1024
SM_REGISTERS = 65536
SM_MAX_THREADS = 2048
SM_MAX_BLOCKS = 32


def gpu_name() -> str:
    """The current CUDA device's name, or 'no CUDA GPU'."""
    cp = cupy_or_none()
    if cp is None:
        return "no CUDA GPU"
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def sm_count() -> int:
    cp = cupy_or_none()
    if cp is None:
        raise RuntimeError("sm_count: no CUDA GPU is usable here")
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


def resident_blocks(num_regs: int, threads: int, smem_bytes: int) -> int:
    """Blocks of one kernel an SM holds at once (registers are allocated per warp in units
    of 256; each block also reserves 1 KB of shared memory)."""
    warps = ceil_div(threads, 32)
    per_warp = ceil_div(max(num_regs, 1) * 32, 256) * 256
    by_regs = (SM_REGISTERS // per_warp) // warps
    by_smem = SM_SMEM_BYTES // (smem_bytes + 1024)
    return max(0, min(by_regs, by_smem, SM_MAX_THREADS // (warps * 32), SM_MAX_BLOCKS))


def occupancy(kernel: Any, threads: int, smem_dynamic: int) -> int:
    """Blocks of a compiled kernel one SM holds: the driver's answer where CuPy exposes it,
    else computed from the kernel's register count."""
    try:
        from cupy_backends.cuda.api import driver

        return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, threads, smem_dynamic))
    except (ImportError, AttributeError):
        return resident_blocks(int(kernel.num_regs), threads, smem_dynamic)


class _LaunchConfig(ctypes.Structure):
    """The driver's CUlaunchConfig: grid, block, dynamic shared memory, stream, attributes."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


def max_active_clusters(kernel: Any, grid: tuple[int, ...], threads: int,
                        smem_dynamic: int) -> int | None:
    """Thread-block clusters of a compiled kernel (its cluster shape compiled in, as
    `__cluster_dims__` sets it) the GPU runs at once, from the driver
    (cuOccupancyMaxActiveClusters); None where the driver cannot answer. A cluster's blocks
    share one GPC: with one block an SM, clusters of 4 or 8 leave a GPC's remainder SMs idle,
    so fewer than SMs / size run at once."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    config = _LaunchConfig((ctypes.c_uint * 3)(*(tuple(grid) + (1, 1))[:3]),
                           (ctypes.c_uint * 3)(threads, 1, 1), smem_dynamic, None, None, 0)
    count = ctypes.c_int(0)
    status = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(count),
                                               ctypes.c_void_p(kernel.kernel.ptr),
                                               ctypes.byref(config))
    return int(count.value) if status == 0 else None
