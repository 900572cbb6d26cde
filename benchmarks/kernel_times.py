"""Each kernel of one fused forward, per model and variant, for Nsight Compute to time.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --profile-from-start off \
        python3 benchmarks/kernel_times.py [--batch N] MODEL:VARIANT ...

VARIANT is a bench variant (`fp16`, `fp16:head.ti=8`, ...). Each forward runs twice outside
the profiled range (compiling, first allocations), then once inside it, launched kernel by
kernel (no CUDA graph), so ncu lists every kernel of the forwards in the order given.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    import cupy as cp

    from convolab.bench.specs import parse_variant
    from convolab.data import resize_bilinear
    from convolab.gpu.network import FusedLeNet
    from convolab.models import build, spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="+", help="MODEL:VARIANT, e.g. eecs498:fp16:head.ti=8")
    parser.add_argument("--batch", type=int, default=10_000)
    args = parser.parse_args()
    raw = np.random.default_rng(1).integers(0, 256, (args.batch, 28, 28), dtype=np.uint8)
    nets = []
    for job in args.jobs:
        model, _, text = job.partition(":")
        v = parse_variant(text)
        params = {k: np.asarray(a, np.float32) for k, a in build(model, 0).params().items()}
        net = FusedLeNet(params, mode=v.mode, kernel_params=v.kernel_params_dict(),
                         model=model, graphs=False)
        x = cp.asarray(resize_bilinear(raw, spec(model).input_size))
        for _ in range(2):
            net(x)
        nets.append((job, net, x))
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    for job, net, x in nets:
        net(x)
        cp.cuda.Device().synchronize()
        print(job, flush=True)
    cp.cuda.profiler.stop()


if __name__ == "__main__":
    main()
