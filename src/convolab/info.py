"""`convolab info` and `convolab list`: what this machine has and what the registry holds."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shutil
import subprocess
from pathlib import Path

from rich.console import Console
from rich.table import Table

from convolab.registry import all_impls

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
console = Console()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_registry() -> None:
    table = Table(title="convolab implementations (ladder order)")
    table.add_column("name", no_wrap=True)
    for col in ("device", "rung", "tolerance", "demonstrates", "tunable parameters"):
        table.add_column(col, overflow="fold")
    for impl in all_impls():
        space = ", ".join(f"{k}∈{list(v)}" for k, v in impl.space.items()) or "-"
        rung = "ref" if impl.reference_only else (str(impl.rung) if impl.rung is not None else "-")
        table.add_row(impl.name, impl.device, rung, f"{impl.tolerance:g}", impl.demonstrates, space)
    console.print(table)


def gpu_lines() -> list[str]:
    from convolab.backend import cupy_or_none

    cp = cupy_or_none()
    if cp is None:
        return ["none usable (CuPy missing or no CUDA device)"]
    lines = []
    for i in range(cp.cuda.runtime.getDeviceCount()):
        p = cp.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        lines.append(
            f"{i}: {name}, sm_{p['major']}{p['minor']}, {p['multiProcessorCount']} SMs, "
            f"{p['totalGlobalMem'] / 2**30:.1f} GiB, L2 {p['l2CacheSize'] / 2**20:.0f} MiB"
        )
    return lines


def nvcc_line() -> str:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return "not found (kernels compile at run time through NVRTC anyway)"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    last = [ln for ln in out.stdout.splitlines() if "release" in ln]
    return f"{nvcc} ({last[0].strip() if last else 'unknown version'})"


def weights_lines() -> list[str]:
    lines = []
    for f in sorted(WEIGHTS_DIR.glob("*.safetensors")):
        meta_file = f.with_suffix(".json")
        acc = ""
        if meta_file.is_file():
            try:
                meta = json.loads(meta_file.read_text())
                if "test_accuracy" in meta:
                    acc = f", test accuracy {meta['test_accuracy']:.4f}"
            except (OSError, ValueError):
                acc = ", sidecar unreadable"
        lines.append(f"{f.name} ({f.stat().st_size / 1024:.0f} KiB{acc})")
    return lines or ["none shipped"]


def dataset_line(data_dir: Path | None) -> str:
    from convolab import data

    status = data.dataset_status(data_dir)
    if status.get("found"):
        if status.get("verified"):
            return f"{status['path']} ({status.get('source')}, SHA-256 verified)"
        reason = status.get("reason") or "not checked"
        return f"{status['path']} ({status.get('source')}, NOT usable: {reason})"
    searched = status.get("searched") or [[None]]
    origin, folder = searched[0][0], searched[0][1] if len(searched[0]) > 1 else None
    if origin in ("--data-dir", "$CONVOLAB_DATA"):
        # A folder the user named is used as it is: nothing is downloaded into it.
        if folder is not None and not Path(folder).is_dir():
            return f"not found: {origin} {folder}: no such directory"
        return f"not found: {status.get('reason')}"
    return f"not found: {status.get('reason')}; would download into {status.get('cache_dir')}"


def tuner_line() -> str:
    from convolab.gpu import tune

    path = tune.cache_path()
    if not path.is_file():
        return f"{path} (empty: run `convolab tune` on a GPU)"
    entries = tune.load_cache(path)  # warns about and ignores a stale or corrupt file
    return f"{path} ({len(entries)} tuned layer shapes)"


def main(data_dir: Path | None = None) -> None:
    rows = [
        ("convolab", _version("convolab")),
        ("python", f"{platform.python_version()} ({platform.machine()})"),
        *((dist, _version(dist)) for dist in ("numpy", "numba", "safetensors", "rich", "typer")),
        ("cupy", _version("cupy-cuda13x") if _version("cupy-cuda13x") != "not installed"
         else _version("cupy")),
        ("torch (bench extra)", _version("torch")),
        ("nvcc", nvcc_line()),
        *(("gpu", line) for line in gpu_lines()),
        ("dataset", dataset_line(data_dir)),
        *(("weights", line) for line in weights_lines()),
        ("tuner cache", tuner_line()),
        ("implementations", ", ".join(i.name for i in all_impls())),
    ]
    table = Table(title="convolab info", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
