"""Correctness yardsticks shared by `verify`, the tuner, the benchmarks and the tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from convolab.backend import to_numpy

POISON = np.float32(np.nan)  # any element an implementation forgets to write fails the check


def rel_l2(y: Any, ref: Any) -> float:
    """||y - ref||_2 / ||ref||_2 in float64. NaN or inf anywhere in y gives inf (never passes)."""
    y = np.asarray(to_numpy(y), dtype=np.float64)
    ref = np.asarray(to_numpy(ref), dtype=np.float64)
    if y.shape != ref.shape:
        raise ValueError(f"output shape {y.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(y)):
        return float("inf")
    denom = float(np.linalg.norm(ref))
    return float(np.linalg.norm(y - ref) / (denom if denom > 0 else 1.0))


def poison(y: Any) -> None:
    """Fill an output buffer with NaN before a run so unwritten elements fail rel_l2."""
    y.fill(POISON)
