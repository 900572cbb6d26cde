"""Compile kernels/NN_name.cu through CuPy's RawModule (NVRTC), once per (file, defines, GPU).

Compile-time parameters (tile sizes, K, coarsening) are passed as -D defines, so the same
file compiles standalone with `nvcc -arch=sm_90 -DNAME=value` in CI's check. Every .cu file
gives each parameter a default with #ifndef so it also compiles with no -D at all.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convolab.backend import require_cupy

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
# Kernel files built for an architecture-specific target instead of the device's own: the
# warpgroup MMA (wgmma) of rungs 39, 40, 44-47, 49, 51, 52 and 54 exists on sm_90a only, and such
# code runs on nothing else.
ARCH_SPECIFIC: dict[str, str] = {"39_implicit_gemm_wgmma.cu": "sm_90a",
                                 "40_implicit_gemm_wgmma_pipelined.cu": "sm_90a",
                                 "44_fused_conv_pool_wgmma.cu": "sm_90a",
                                 "45_fused_first_conv_pool_wgmma.cu": "sm_90a",
                                 "46_fused_conv_pool_wgmma_ws.cu": "sm_90a",
                                 "47_fused_first_pair_wgmma_ws.cu": "sm_90a",
                                 "49_gemv_wgmma_bulk.cu": "sm_90a",
                                 "51_direct_conv_wgmma.cu": "sm_90a",
                                 "52_direct_conv_image_wgmma.cu": "sm_90a",
                                 "54_gemv_wgmma_cluster_tf32.cu": "sm_90a"}


def nvcc_target(filename: str) -> tuple[str, ...]:
    """nvcc's target flags for a kernel file (CI's compile check): sm_90, or the file's
    architecture-specific target (`-arch=sm_90a` would also run a plain sm_90 pass)."""
    arch = ARCH_SPECIFIC.get(filename)
    if arch is None:
        return ("-arch=sm_90",)
    return (f"-gencode=arch=compute_{arch.removeprefix('sm_')},code={arch}",)


def kernel_path(filename: str) -> Path:
    path = KERNEL_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} is missing")
    return path


def cuda_include_dirs() -> list[str]:
    """Where <mma.h> and <cuda_fp16.h> live: NVRTC does not find crt/mma.h by itself."""
    candidates = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    return [str(Path(c) / "include") for c in candidates if c and (Path(c) / "include").is_dir()]


def pairwise_points(space: Mapping[str, Sequence[Any]],
                    define: Callable[[dict[str, Any]], dict[str, int]]) -> list[dict[str, int]]:
    """The define sets CI's nvcc check builds for a tunable space: instead of the whole product,
    points chosen so that every pair of values of any two parameters that some valid point has
    appears together in at least one (a compile error needs one value, or two that clash).
    `define` maps a point to its -D set and raises ValueError for a point the host refuses.
    Greedy and deterministic: the valid point that covers the most uncovered pairs, first in
    product order on a tie."""
    keys = sorted(space)
    valid = []
    for combo in itertools.product(*(space[k] for k in keys)):
        point = dict(zip(keys, combo, strict=True))
        try:
            valid.append((point, define(point)))
        except ValueError:
            continue

    def pairs(point: Mapping[str, Any]) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
        return {((a, point[a]), (b, point[b])) for a, b in itertools.combinations(keys, 2)}

    uncovered = set().union(*(pairs(p) for p, _ in valid)) if valid else set()
    chosen: list[dict[str, int]] = []
    while uncovered or not chosen:
        best = max(valid, key=lambda pd: len(pairs(pd[0]) & uncovered), default=None)
        if best is None:
            break
        uncovered -= pairs(best[0])
        if best[1] not in chosen:
            chosen.append(best[1])
    return chosen


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
    arch = ARCH_SPECIFIC.get(filename)
    if arch is not None:
        return cp.RawModule(path=str(_arch_cubin(filename, source, options, arch)))
    module = cp.RawModule(code=source, options=options)
    module.compile()  # compile now so a broken kernel fails here, not at first launch
    return module


def _arch_cubin(filename: str, source: str, options: tuple[str, ...], arch: str) -> Path:
    """NVRTC-built cubin for `arch`, cached on disk by content. CuPy's own compile path adds
    the device's `-arch=sm_90` itself, which cannot assemble sm_90a-only instructions."""
    from cupy_backends.cuda.libs import nvrtc

    opts = (*options, f"--gpu-architecture={arch}")
    headers = [p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh"))]
    text = "\0".join((source, *headers, *opts, str(nvrtc.getVersion())))
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    folder = Path(tempfile.gettempdir()) / f"convolab-cubin-{os.getuid()}"
    path = folder / f"{Path(filename).stem}-{key}.cubin"
    if path.is_file():
        return path
    prog = nvrtc.createProgram(source, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception:  # NVRTCError; its log says what is wrong
            raise RuntimeError(f"NVRTC could not build {filename} for {arch}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    folder.mkdir(mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(cubin)
        os.replace(tmp, path)  # whole or absent: a concurrent build writes the same bytes
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def get_kernel(filename: str, name: str, defines: Mapping[str, Any] | None = None) -> Any:
    """The `extern "C"` kernel `name` from kernels/`filename`, compiled with `defines`."""
    cp = require_cupy()
    device_id = cp.cuda.runtime.getDevice()
    return _module(filename, define_flags(defines or {}), device_id).get_function(name)


def get_module(filename: str, defines: Mapping[str, Any] | None = None) -> Any:
    """The whole RawModule (for __constant__ symbols via get_global)."""
    cp = require_cupy()
    return _module(filename, define_flags(defines or {}), cp.cuda.runtime.getDevice())
