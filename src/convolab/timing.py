"""Timers the course's way: CUDA events around launches on the GPU, wall clock on the CPU.

Every timer returns all samples in milliseconds; `Stats` summarises them (median and spread).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from convolab.backend import require_cupy


@dataclass(frozen=True)
class Stats:
    median_ms: float
    min_ms: float
    max_ms: float
    p10_ms: float
    p90_ms: float
    reps: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> Stats:
        if not samples_ms:
            raise ValueError("no timing samples")
        s = sorted(samples_ms)
        q = statistics.quantiles(s, n=10) if len(s) >= 2 else [s[0]] * 9
        return cls(statistics.median(s), s[0], s[-1], q[0], q[-1], len(s))

    @property
    def spread_pct(self) -> float:
        """(p90 - p10) / median: how much to trust a difference between two medians."""
        return 100.0 * (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms else 0.0

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["spread_pct"] = self.spread_pct
        return d


def time_cpu(fn: Callable[[], object], reps: int = 1, warmup: int = 0) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def time_gpu(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> list[float]:
    """Device time of whatever `fn` enqueues on the current stream, CUDA events around it."""
    cp = require_cupy()
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    samples = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop))
    return samples


def time_host_gpu(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> list[float]:
    """Wall clock of a host-side call that ends with its results on the host (Layer Time)."""
    cp = require_cupy()

    def synced() -> None:
        fn()
        cp.cuda.Device().synchronize()

    return time_cpu(synced, reps=reps, warmup=warmup)
