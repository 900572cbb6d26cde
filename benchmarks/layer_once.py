"""One launch of each named conv implementation on one layer, for Nsight Compute.

    ncu --profile-from-start off --section SpeedOfLight ... \
        python3 benchmarks/layer_once.py --shape 10000,12,29,29,24,7 IMPL[:k=v,...] ...

Each implementation runs twice outside the profiled range (compiling, first allocations), then
once inside it, on random input and weights (seed 1), so ncu lists one launch per
implementation in the order given.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    import cupy as cp

    from convolab.bench.specs import parse_impl
    from convolab.registry import get_impl
    from convolab.shapes import ConvShape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("impls", nargs="+", help="registry name[:param=value,...]")
    parser.add_argument("--shape", required=True, help="B,C,H,W,M,K (stride 1)")
    args = parser.parse_args()
    shape = ConvShape(*(int(v) for v in args.shape.split(",")))
    rng = np.random.default_rng(1)
    x = cp.asarray(np.abs(rng.standard_normal(shape.x_shape)).astype(np.float32))
    w = cp.asarray((rng.standard_normal(shape.w_shape) / 20).astype(np.float32))
    b = cp.asarray(rng.standard_normal(shape.M).astype(np.float32))
    for text in args.impls:
        spec = parse_impl(text)
        impl = get_impl(spec.name)
        run = impl.prepare(shape, w, b, dict(spec.params))
        pool = impl.pool or 1
        y = cp.empty((shape.B, shape.M, shape.H_out // pool, shape.W_out // pool), cp.float32)
        for _ in range(2):
            run(x, y)
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStart()
        run(x, y)
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
