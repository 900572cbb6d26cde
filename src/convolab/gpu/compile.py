"""Compile kernels/NN_name.cu through CuPy's RawModule (NVRTC), once per (file, defines, GPU).

Compile-time parameters (tile sizes, K, coarsening) are passed as -D defines, so the same
file compiles standalone with `nvcc -arch=sm_90 -DNAME=value` in CI's check. Every .cu file
gives each parameter a default with #ifndef so it also compiles with no -D at all.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from convolab.backend import require_cupy

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"


def kernel_path(filename: str) -> Path:
    path = KERNEL_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} is missing")
    return path


def cuda_include_dirs() -> list[str]:
    """Where <mma.h> and <cuda_fp16.h> live: NVRTC does not find crt/mma.h by itself."""
    candidates = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    return [str(Path(c) / "include") for c in candidates if c and (Path(c) / "include").is_dir()]


def define_flags(defines: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(f"-D{key}={int(value)}" for key, value in sorted(defines.items()))


@functools.cache
def _module(filename: str, flags: tuple[str, ...], device_id: int) -> Any:
    cp = require_cupy()
    source = kernel_path(filename).read_text()
    options = (
        "--std=c++17",
        f"-I{KERNEL_DIR}",
        *(f"-I{d}" for d in cuda_include_dirs()),
        *flags,
    )
    module = cp.RawModule(code=source, options=options)
    module.compile()  # compile now so a broken kernel fails here, not at first launch
    return module


def get_kernel(filename: str, name: str, defines: Mapping[str, Any] | None = None) -> Any:
    """The `extern "C"` kernel `name` from kernels/`filename`, compiled with `defines`."""
    cp = require_cupy()
    device_id = cp.cuda.runtime.getDevice()
    return _module(filename, define_flags(defines or {}), device_id).get_function(name)


def get_module(filename: str, defines: Mapping[str, Any] | None = None) -> Any:
    """The whole RawModule (for __constant__ symbols via get_global)."""
    cp = require_cupy()
    return _module(filename, define_flags(defines or {}), cp.cuda.runtime.getDevice())
