"""What the kernels' launch plans need to know about the GPU, defined once.

The per-SM limits are those of compute capability 9.0 (H100/H200), the machines the ladder is
tuned for; plans use them to size tiles and persistent grids, and the driver's occupancy
answer takes over wherever a plan launches (see `occupancy`).
"""

from __future__ import annotations

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
