"""Shared test set-up.

GPU tests (marker `gpu`) skip where CuPy sees no device.

Every random test draws from the `rng` fixture (or takes the integer `seed`): one base seed
per session, printed in pytest's header and beside every failure, and each test's own seed
derived from it and the test's id, so a failure replays alone or in the whole suite with
`pytest --seed N` (or `CONVOLAB_TEST_SEED=N`). Without either, the base seed is fresh each
run: the random shapes and inputs are new every time the suite runs.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from convolab.backend import gpu_available

SEED_ENV = "CONVOLAB_TEST_SEED"
_base_seed: int | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--seed", type=int, default=None,
                     help=f"base seed of every random test (default: ${SEED_ENV}, else fresh)")


def pytest_configure(config: pytest.Config) -> None:
    global _base_seed
    chosen = config.getoption("--seed")
    if chosen is None and os.environ.get(SEED_ENV, "").strip():
        try:
            chosen = int(os.environ[SEED_ENV])
        except ValueError:
            raise pytest.UsageError(
                f"{SEED_ENV} must be an integer, got {os.environ[SEED_ENV]!r}") from None
    _base_seed = int(chosen) if chosen is not None else int(
        np.random.SeedSequence().entropy % (2**32))


def pytest_report_header(config: pytest.Config) -> str:
    return f"convolab random tests: base seed {_base_seed} (replay: pytest --seed {_base_seed})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU usable here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def test_seed_of(nodeid: str, base: int) -> int:
    """The seed of one test: stable for a base seed, independent of which tests run."""
    digest = hashlib.sha256(f"{base}:{nodeid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


test_seed_of.__test__ = False  # a helper, not a test


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """This test's seed (printed, so it shows beside a failure)."""
    assert _base_seed is not None
    value = test_seed_of(request.node.nodeid, _base_seed)
    print(f"seed {value} (base seed {_base_seed}: replay with pytest --seed {_base_seed})")
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def module_seed(request: pytest.FixtureRequest) -> int:
    """The seed of a module's shared random cases (a module-scoped fixture cannot take
    `seed`): derived from the base seed and the module's id, printed like `seed`."""
    assert _base_seed is not None
    value = test_seed_of(request.node.nodeid, _base_seed)
    print(f"module seed {value} (base seed {_base_seed}: replay with pytest --seed {_base_seed})")
    return value
