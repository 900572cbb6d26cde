"""The command line end to end, as a user runs it: real data, shipped weights, real exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from convolab import models

SHIPPED = models.weights_path("ece408")


def convolab(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "convolab", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.skipif(not SHIPPED.is_file(), reason="shipped ece408 weights not trained yet")
def test_classify_batch_100_end_to_end(tmp_path: Path) -> None:
    """The default CPU path is the fused network; --per-layer times each conv layer. Both give
    the same accuracy, and the JSON records what was printed."""
    out = tmp_path / "report.json"
    result = convolab("classify", "--images", "100", "--device", "cpu", "--json", str(out))
    assert result.returncode == 0, result.stderr
    pattern = (r"Whole network \[fused CPU network\], B=100\n"
               r"\s+Op Time: ([\d.]+) ms\n\s+Layer Time: ([\d.]+) ms")
    block = re.search(pattern, result.stdout)
    assert block, result.stdout
    assert 0 < float(block.group(1)) <= float(block.group(2))
    accuracy = float(re.search(r"Test Accuracy: ([\d.]+)", result.stdout).group(1))
    assert 0.8 <= accuracy <= 1.0  # shipped weights; the course reached 0.86 on these 100
    report = json.loads(out.read_text())
    assert report["batch"] == 100 and abs(report["accuracy"] - accuracy) < 1e-4

    per_layer = convolab("classify", "--images", "100", "--device", "cpu", "--per-layer")
    assert per_layer.returncode == 0, per_layer.stderr
    for layer in ("c1", "c3"):
        pattern = rf"Conv layer {layer} .*?\n\s+Op Time: ([\d.]+) ms\n\s+Layer Time: ([\d.]+) ms"
        block = re.search(pattern, per_layer.stdout)
        assert block, per_layer.stdout
        op, layer_time = float(block.group(1)), float(block.group(2))
        assert 0 < op <= layer_time
    assert f"Test Accuracy: {accuracy:.4f}" in per_layer.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["classify", "--images", "0", "--device", "cpu"], "--images must be between 1 and 100"),
        (["classify", "-n", "10001", "--device", "cpu"], "--images must be between 1 and 100"),
        (["classify", "--model", "alexnet", "--device", "cpu"], "unknown model 'alexnet'"),
        (["classify", "--impl", "no-such-rung", "--device", "cpu", "--images", "5"],
         "unknown implementation 'no-such-rung'"),
        (["classify", "--weights", "/nonexistent/w.safetensors", "--device", "cpu"],
         "/nonexistent/w.safetensors"),
        (["classify", "--device", "tpu"], "--device must be 'cpu' or 'gpu'"),
        (["train", "--epochs", "0"], "--epochs must be positive"),
    ],
)
def test_bad_arguments_fail_cleanly(args: list[str], message: str) -> None:
    result = convolab(*args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_list_shows_the_cpu_implementations() -> None:
    result = convolab("list")
    assert result.returncode == 0, result.stderr
    for name in ("cpu-ref", "cpu-loops", "cpu-im2col"):
        assert name in result.stdout


def test_info_names_the_dataset_location() -> None:
    result = convolab("info")
    assert result.returncode == 0, result.stderr
    assert "dataset" in result.stdout and "numpy" in result.stdout
