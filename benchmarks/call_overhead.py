"""The host's share of one `net(x)`: where the microseconds between the bench's start event and
the forward's first kernel go.

    python3 benchmarks/call_overhead.py [--batch N] [--reps R] MODEL:VARIANT ...

For each job it prints, in microseconds (medians of R): the host time of `net(x)` and of
`net.forward_into(x, probs)` (both timed as the bench times them: start event, call, stop
event, synchronise) beside their device times, and then each step of `__call__` alone, in a
loop: the input checks, the output's allocation, `ascontiguousarray`, the plan lookup, the
current stream, and the graph's launch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def host_us(fn: Callable[[], Any], reps: int) -> float:
    """Median host time of fn in a loop (fn enqueues no device work, or little)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def call_us(cp: Any, fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(host, device) medians in us of fn, timed as `timing.time_gpu` times it."""
    host, device = [], []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        fn()
    for _ in range(reps):
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        stop.record()
        stop.synchronize()
        device.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
    return statistics.median(host) * 1e6, statistics.median(device) * 1e6


def main() -> None:
    import cupy as cp

    from convolab.bench.specs import parse_variant
    from convolab.data import resize_bilinear
    from convolab.gpu.network import FusedLeNet
    from convolab.models import build, spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="+", help="MODEL:VARIANT, e.g. eecs498:fp16")
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    raw = np.random.default_rng(1).integers(0, 256, (args.batch, 28, 28), dtype=np.uint8)
    for job in args.jobs:
        model, _, text = job.partition(":")
        v = parse_variant(text)
        params = {k: np.asarray(a, np.float32) for k, a in build(model, 0).params().items()}
        net = FusedLeNet(params, mode=v.mode, kernel_params=v.kernel_params_dict(), model=model)
        x = cp.asarray(resize_bilinear(raw, spec(model).input_size))
        probs = cp.empty((args.batch, net.classes), cp.float32)
        call = call_us(cp, lambda net=net, x=x: net(x), args.reps)
        into = call_us(cp, lambda net=net, x=x, p=probs: net.forward_into(x, p), args.reps)
        key = (args.batch, 0, None)
        graph = next(g for g in net._graphs[key].values() if g is not None)
        stream = cp.cuda.get_current_stream()
        steps = {
            "check": lambda net=net, x=x: net._check_batch(x),
            "empty": lambda n=net.classes: cp.empty((args.batch, n), cp.float32),
            "ascontiguousarray": lambda x=x: cp.ascontiguousarray(x),
            "plan lookup": lambda net=net, key=key: net._plan(*key),
            "ptrs": lambda x=x, p=probs: (int(x.data.ptr), int(p.data.ptr)),
            "current stream": cp.cuda.get_current_stream,
            "graph launch": lambda g=graph, s=stream: g.launch(s),
        }
        parts = {name: host_us(fn, args.reps) for name, fn in steps.items()}
        stream.synchronize()
        print(f"{job} B={args.batch}: net(x) host {call[0]:.1f} us, device {call[1]:.1f} us; "
              f"forward_into host {into[0]:.1f} us, device {into[1]:.1f} us", flush=True)
        print("  " + ", ".join(f"{k} {us:.1f}" for k, us in parts.items()), flush=True)


if __name__ == "__main__":
    main()
