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

