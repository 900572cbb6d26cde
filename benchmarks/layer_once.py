"""One launch of each named conv implementation on one layer, for Nsight Compute; with
`--timed R`, also where the bench's Op Time of each goes (host call against device).

    ncu --profile-from-start off --section SpeedOfLight ... \
        python3 benchmarks/layer_once.py --shape 10000,12,29,29,24,7 IMPL[:k=v,...] ...
    python3 benchmarks/layer_once.py --timed 50 --shape 64,4096,1,1,1024,1 IMPL ... cublas-fp16

Each implementation runs twice outside the profiled range (compiling, first allocations), then
once inside it, on random input and weights (seed 1), so ncu lists one launch per
implementation in the order given. `cublas-tf32` / `cublas-fp16` (GEMM-shaped layers: 1x1
images, K = 1) run torch.matmul on operands converted beforehand, as the bench's anchors do.
Rungs 39-40 with `layout=nhwc` take their channels-last input converted beforehand, as the
bench's contender form does.

`--timed R` prints, per implementation, medians of R (microseconds): the event time the bench
reports (start event, call, stop event), the host time of the call inside it, and the event
time of R calls enqueued back to back (divided by R: device time once the host runs ahead).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from call_overhead import call_us


def _cublas(name: str, shape: Any, x: Any, w: Any) -> Callable[[], Any]:
    import torch

    dtype = torch.float16 if name == "cublas-fp16" else torch.float32
    w_t = torch.from_dlpack(w).reshape(shape.M, shape.C).t().to(dtype)
    x_t = torch.from_dlpack(x).reshape(shape.B, shape.C).to(dtype)

    def matmul() -> Any:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 operands run TF32, as the anchor
        return torch.matmul(x_t, w_t)

    return matmul


def _timed(cp: Any, fn: Callable[[], Any], reps: int) -> tuple[float, float, float]:
    host, event = call_us(cp, fn, reps)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return event, host, cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps


def main() -> None:
    import cupy as cp

    from convolab.bench.specs import parse_impl
    from convolab.registry import get_impl
    from convolab.shapes import ConvShape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("impls", nargs="+", help="registry name[:param=value,...] or cublas-*")
    parser.add_argument("--shape", required=True, help="B,C,H,W,M,K (stride 1)")
    parser.add_argument("--timed", type=int, default=0, metavar="R",
                        help="also time R calls each (no profiler range)")
    args = parser.parse_args()
    shape = ConvShape(*(int(v) for v in args.shape.split(",")))
    rng = np.random.default_rng(1)
    x = cp.asarray(np.abs(rng.standard_normal(shape.x_shape)).astype(np.float32))
    w = cp.asarray((rng.standard_normal(shape.w_shape) / 20).astype(np.float32))
    b = cp.asarray(rng.standard_normal(shape.M).astype(np.float32))
    if args.timed:
        print(f"{'implementation':<44} {'event us':>9} {'host us':>8} {'queued us':>10}")
    for text in args.impls:
        if text.startswith("cublas-"):
            fn = _cublas(text, shape, x, w)
        else:
            spec = parse_impl(text)
            impl = get_impl(spec.name)
            params = impl.params_for(dict(spec.params))
            run = impl.prepare(shape, w, b, params)
            pool = impl.pool or 1
            x_in, y = x, cp.empty((shape.B, shape.M, shape.H_out // pool, shape.W_out // pool),
                                  cp.float32)
            if params.get("layout") == "nhwc":  # rungs 39-40's channels-last operands
                from convolab.gpu import implicit_gemm_wgmma as wg

                mode = spec.name.rsplit("-", 1)[1]
                x_in, y = wg.to_operand(x, mode), wg.output_buffer(shape, mode)
            elif int(params.get("x16", 0)):  # kernel 49 with x in the operand type
                from convolab.gpu import gemv_wgmma

                x_in = gemv_wgmma.to_operand(x, spec.name.rsplit("-", 1)[1])

            def fn(run: Any = run, x_in: Any = x_in, y: Any = y) -> None:
                run(x_in, y)
        for _ in range(2):
            fn()
        cp.cuda.Device().synchronize()
        if args.timed:
            event, host, queued = _timed(cp, fn, args.timed)
            print(f"{text:<44} {event:9.1f} {host:8.1f} {queued:10.1f}", flush=True)
            continue
        cp.cuda.runtime.profilerStart()
        fn()
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
