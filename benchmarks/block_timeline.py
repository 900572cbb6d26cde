"""When each block of kernel 49 starts, ends its loop and leaves, on one layer: where a launch's
time goes between the first block's start and the last block's end (a tail of blocks that
finish late, the split-k sum, or the start).

    python3 benchmarks/block_timeline.py --shape 64,25088,1,1,4096,1 [--runs 5] PARAMS ...

PARAMS are kernel 49's parameters (`STAGES=6,x16=1`); each is built with TIMELINE=1 (its blocks
write their SM and %globaltimer stamps into the module's `gw_timeline`) and run `--runs` times
after a warm-up. Per run it prints, in microseconds from the first block's start: the blocks'
start (median, max), loop end (min, median, max) and leaving time (median, max), and the SMs
that held no block; split, the steps of the split-k end (median / max over blocks, us): the
partials stored, fenced, the ticket taken, and the last blocks' sum; then, per k slice, the
median loop end.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np


def parse_params(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def main() -> None:
    import cupy as cp

    from convolab.gpu import gemv_wgmma
    from convolab.gpu.compile import get_module
    from convolab.gpu.device import sm_count
    from convolab.registry import get_impl
    from convolab.shapes import ConvShape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, help="B,C,H,W,M,K of a linear layer")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mode", default="fp16", choices=list(gemv_wgmma.MODES))
    parser.add_argument("params", nargs="+")
    args = parser.parse_args()
    shape = ConvShape(*(int(v) for v in args.shape.split(",")))
    impl = get_impl(f"gemv-wg-{args.mode}")
    rng = np.random.default_rng(1)
    w = cp.asarray(rng.standard_normal(shape.w_shape, dtype=np.float32) * 0.01)
    b = cp.asarray(rng.standard_normal(shape.M, dtype=np.float32))
    x32 = cp.asarray(rng.standard_normal(shape.x_shape, dtype=np.float32))
    y = cp.empty(shape.y_shape, dtype=cp.float32)
    for text in args.params:
        params = impl.params_for({**parse_params(text), "TIMELINE": 1})
        plan = gemv_wgmma.launch_plan(shape, args.mode, params, sm_count())
        blocks = plan.tiles * plan.slices
        if blocks > 4096:
            raise SystemExit(f"{text}: {blocks} blocks, over the 4096 the timeline holds")
        run = impl.prepare(shape, w, b, params)
        x = gemv_wgmma.to_operand(x32, args.mode) if params["x16"] else x32
        timeline = get_module(gemv_wgmma.KERNEL_FILE, plan.defines).get_global("gw_timeline")
        stamps = cp.ndarray((4096, 8), dtype=cp.uint64, memptr=timeline)
        run(x, y)
        print(f"== {text}: grid {plan.grid}, {blocks} blocks")
        for _ in range(args.runs):
            stamps.fill(0)
            run(x, y)
            cp.cuda.Device().synchronize()
            t = stamps[:blocks].get().astype(np.int64)
            sm, start, loop, leave = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
            t0 = start.min()
            us = {k: (v - t0) / 1e3 for k, v in (("start", start), ("loop", loop),
                                                   ("leave", leave))}
            idle = sm_count() - len(set(sm.tolist()))
            print(f"start med {np.median(us['start']):6.1f} max {us['start'].max():6.1f} | "
                  f"loop end min {us['loop'].min():6.1f} med {np.median(us['loop']):6.1f} "
                  f"max {us['loop'].max():6.1f} | leave med {np.median(us['leave']):6.1f} "
                  f"max {us['leave'].max():6.1f} | idle SMs {idle}")
            if plan.slices > 1:
                steps = [("stored", loop, t[:, 4]), ("fenced", t[:, 4], t[:, 5]),
                         ("ticket", t[:, 5], t[:, 6])]
                summed = t[:, 7] > 0
                steps.append(("sum", t[summed, 6], t[summed, 7]))
                print("   split-k end: " + " | ".join(
                    f"{name} {np.median(b - a) / 1e3:.2f} / {(b - a).max() / 1e3:.2f}"
                    for name, a, b in steps))
        per_slice = us["loop"].reshape(plan.slices, plan.tiles)
        print("loop end by slice (median):",
              " ".join(f"{statistics.median(row.tolist()):.1f}" for row in per_slice))


if __name__ == "__main__":
    main()
