"""Where a measurement was taken: library versions, CPU and GPU names, date and command.

One place for what every results file records (`convolab bench`, `convolab profile`,
`convolab info`), so two files from the same machine describe it the same way.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none


def versions() -> dict[str, str]:
    """Python, NumPy, and where loaded CuPy (CUDA runtime and driver) and torch (cuDNN)."""
    out = {"python": platform.python_version(), "numpy": np.__version__}
    cp = cupy_or_none()
    if cp is not None:
        out["cupy"] = cp.__version__
        out["cuda_runtime"] = str(cp.cuda.runtime.runtimeGetVersion())
        out["cuda_driver"] = str(cp.cuda.runtime.driverGetVersion())
    if "torch" in sys.modules:  # only if already imported: loading torch costs seconds
        import torch

        out["torch"] = torch.__version__
        if torch.backends.cudnn.is_available():
            out["cudnn"] = str(torch.backends.cudnn.version())
    return out


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it, with the logical CPU count."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} logical CPUs)"


def device_name(gpu: bool) -> str:
    """The GPU's name where one is used, else 'cpu: <model>'."""
    if not gpu:
        return f"cpu: {cpu_name()}"
    from convolab.gpu.device import gpu_name

    return gpu_name()


def now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def describe(gpu: bool, command: str) -> dict[str, Any]:
    """The environment block of a results file."""
    return {"date": now(), "command": command, "device": device_name(gpu), "cpu": cpu_name(),
            "versions": versions()}
