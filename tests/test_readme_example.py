"""The README's library example runs as written (on the CPU, torch optional: the example
itself falls back to the fp64 reference check when torch is missing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def library_example() -> str:
    section = README.read_text().split("## Use it as a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_library_example_runs() -> None:
    code = library_example()
    assert "convolab.load_model" in code and "torch.nn.functional.conv2d" in code
    env_cpu = "import convolab.backend as b; b.cupy_or_none.cache_clear(); " \
              "b.cupy_or_none = lambda: None\n"  # the CPU path, as in CI
    result = subprocess.run([sys.executable, "-c", env_cpu + code], capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"accuracy ([\d.]+)", result.stdout).group(1))
    assert 0.8 <= accuracy <= 1.0
