"""Every kernel file compiles with nvcc for sm_90 (or its own target, compile.ARCH_SPECIFIC):
standalone (no -D, the #ifndef defaults) and with each set of defines its registry entry says
the host code uses. Needs nvcc, not a GPU,
and never imports CuPy, so it runs on CI. `-cubin` runs the full device compile (front end and
ptxas) without nvcc's host-side pass, which the NVRTC-loaded kernels never use.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from convolab.gpu.compile import KERNEL_DIR, define_flags, nvcc_target
from convolab.registry import all_impls

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

Job = tuple[str, tuple[str, ...]]  # (kernel file, -D flags)
# Modules whose kernels live in more files than their registry entry's kernel_file, or that
# are not registry entries at all.
EXTRA_COMPILE_MODULES = ("convolab.gpu.fused_ffma", "convolab.gpu.fused_mma",
                         "convolab.gpu.fused_pair", "convolab.gpu.fused_cl",
                         "convolab.gpu.lenet_head", "convolab.gpu.dense_head",
                         "convolab.gpu.trainer")


def gpu_jobs() -> dict[str, list[Job]]:
    """Per registered GPU implementation with a kernel file, the (file, flags) compiles it needs.

    Implementations without one (a dispatcher such as `auto`, library calls such as cuFFT)
    compile nothing of their own.
    """
    jobs: dict[str, list[Job]] = {}
    for impl in all_impls("gpu"):
        if not impl.kernel_file:
            continue
        variants = impl.compile_variants() or [{}]
        jobs[impl.name] = [(impl.kernel_file, define_flags(v)) for v in variants]
    # Kernels outside the registry entries' kernel_file: each such module lists its compiles
    # as compile_jobs() -> {name: [(kernel file, defines)]}.
    for module in EXTRA_COMPILE_MODULES:
        for name, variants in importlib.import_module(module).compile_jobs().items():
            jobs[name] = [(filename, define_flags(v)) for filename, v in variants]
    return jobs


def standalone_jobs() -> list[Job]:
    """Every .cu file of the package as it stands (the #ifndef defaults)."""
    return [(path.name, ()) for path in sorted(KERNEL_DIR.glob("*.cu"))]


def nvcc(job: Job) -> str | None:
    """None on success, else the command and nvcc's complaint."""
    filename, flags = job
    cmd = [
        str(NVCC),
        *nvcc_target(filename),
        "-std=c++17",
        "-cubin",  # device code only: what NVRTC builds at run time, twice as fast as -c
        "-o",
        "/dev/null",
        f"-I{KERNEL_DIR}",
        *flags,
        str(Path(KERNEL_DIR) / filename),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    return f"{' '.join(cmd)}\n{proc.stderr[-2000:]}"


@pytest.fixture(scope="module")
def compile_results() -> dict[Job, str | None]:
    """Every distinct compile once, two at a time (CI runners have two cores)."""
    unique = sorted({job for jobs in gpu_jobs().values() for job in jobs} | set(standalone_jobs()))
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(unique, pool.map(nvcc, unique), strict=True))


def test_gpu_implementations_are_registered() -> None:
    assert gpu_jobs(), "no GPU implementation is registered"


@pytest.mark.parametrize("name", sorted(gpu_jobs()))
def test_registered_variants_compile(name: str, compile_results: dict[Job, str | None]) -> None:
    errors = [compile_results[job] for job in gpu_jobs()[name] if compile_results[job]]
    assert not errors, "\n\n".join(e for e in errors if e)


@pytest.mark.parametrize("filename", [name for name, _ in standalone_jobs()])
def test_kernel_file_compiles_standalone(
    filename: str, compile_results: dict[Job, str | None]
) -> None:
    error = compile_results[(filename, ())]
    assert error is None, error


def test_every_wgmma_kernel_is_built_for_sm_90a() -> None:
    """A file whose headers bring the warpgroup MMA must be in compile.ARCH_SPECIFIC: built for
    plain sm_90, its wgmma paths are a trap at run time."""
    import re

    from convolab.gpu.compile import ARCH_SPECIFIC

    def includes(name: str, seen: set[str]) -> set[str]:
        for dep in re.findall(r'#include "([^"]+)"', (KERNEL_DIR / name).read_text()):
            if dep not in seen:
                seen.add(dep)
                includes(dep, seen)
        return seen

    wgmma = {path.name for path in KERNEL_DIR.glob("*.cu")
             if "wgmma_core.cuh" in includes(path.name, set())}
    assert "47_fused_first_pair_wgmma_ws.cu" in wgmma
    assert wgmma == set(ARCH_SPECIFIC)
