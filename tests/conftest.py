"""Shared test set-up: GPU tests (marker `gpu`) skip where CuPy sees no device."""

from __future__ import annotations

import numpy as np
import pytest

from convolab.backend import gpu_available


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU usable here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh random data every run (seed printed on failure through pytest's -ra)."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def rel_l2(y: np.ndarray, ref: np.ndarray) -> float:
    """||y - ref||_2 / ||ref||_2 in float64; NaN anywhere never passes."""
    y = np.asarray(y, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if y.shape != ref.shape:
        raise AssertionError(f"shape {y.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(y)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / (denom if denom > 0 else 1.0))
