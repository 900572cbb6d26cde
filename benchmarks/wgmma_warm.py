"""Build every define set of the wgmma rungs (39, 40; `define_sets`) in parallel threads, so that
the GPU tests and plans that follow find their sm_90a cubins in the on-disk cache
(`compile._arch_cubin`): one NVRTC build takes seconds, and the tests draw random tiles.
`--plan FILE` also builds the wgmma rows of a bench plan that lie outside those sets.
`--check` then runs each rung and mode once at its defaults, NCHW and channels-last, on a
conv5_x-like layer at batch 2 against the fp64 reference, and split-K (SPLIT=3) the same way
(a quick look before the plans);
`--once NAME:k=v,...` runs one contender on conv5_x at batch 64 once (for a profiler).

    PYTHONPATH=src python3 benchmarks/wgmma_warm.py [--plan FILE] [--check] [--once SPEC]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from convolab.bench import load_plan
from convolab.bench.specs import parse_impl
from convolab.gpu import implicit_gemm_wgmma as wg
from convolab.gpu.compile import get_kernel
from convolab.registry import get_impl

Job = tuple[str, str, tuple[tuple[str, int], ...]]


def jobs(plan: Path | None = None) -> list[tuple[str, str, dict[str, int]]]:
    """(file, kernel, defines) of every distinct build: the registered sets, and the wgmma
    rows of `plan`."""
    seen: dict[Job, None] = {}
    for rung in wg.RUNGS:
        for mode in dict.fromkeys(wg.MODE_OF.values()):
            for defines in wg.define_sets(mode, rung):
                kernel = rung.kernel if "BM" in defines else "wg_channels_last"
                seen[(rung.file, kernel, tuple(sorted(defines.items())))] = None
    rungs = {r.prefix + m: r for r in wg.RUNGS for m in wg.MODE_OF.values()}
    for config in load_plan(plan) if plan else []:
        for spec in config.impls:
            if spec.name in rungs:
                rung, impl = rungs[spec.name], get_impl(spec.name)
                defines = wg.wgmma_defines(wg.MODE_OF[spec.name],
                                           impl.params_for(dict(spec.params)), rung)
                seen[(rung.file, rung.kernel, tuple(sorted(defines.items())))] = None
    return [(f, k, dict(d)) for f, k, d in seen]


def check() -> None:
    import cupy as cp
    import numpy as np

    from convolab.check import poison, rel_l2
    from convolab.conv_cpu import conv_reference
    from convolab.shapes import ConvShape

    rng = np.random.default_rng()
    shape = ConvShape(2, 512, 16, 16, 512, 3)
    x = rng.standard_normal(shape.x_shape, dtype=np.float32)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32) / np.float32(48)
    b = rng.standard_normal(shape.M, dtype=np.float32)
    ref = conv_reference(x, w, b)
    x_d, w_d, b_d = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    runs = [(n, {}) for n in wg.MODE_OF] + [(n, {"TMA": 1}) for n in wg.MODE_OF
                                            if n.startswith(wg.RUNG40.prefix)]
    runs += [(n, {"SPLIT": 3}) for n in wg.MODE_OF]  # split-K: 3 k-slices of 24 / 48 k-tiles
    for name, extra in runs:
        impl, mode = get_impl(name), wg.MODE_OF[name]
        y = cp.empty(shape.y_shape, dtype=cp.float32)
        poison(y)
        impl.prepare(shape, w_d, b_d, impl.params_for(extra))(x_d, y)
        err = rel_l2(y, ref)
        y_cl = wg.output_buffer(shape, mode)
        wg.poison_operand(y_cl, mode)
        run = impl.prepare(shape, w_d, b_d, impl.params_for({**extra, "layout": "nhwc"}))
        run(wg.to_operand(x_d, mode), y_cl)
        err_cl = rel_l2(wg.from_operand(y_cl, shape.M, mode), ref)
        verdict = "ok" if max(err, err_cl) <= impl.tolerance else "WRONG"
        label = name + "".join(f" {k}={v}" for k, v in extra.items())
        print(f"{label:24s} nchw {err:.3g}  nhwc {err_cl:.3g}  (tol {impl.tolerance}) {verdict}",
              flush=True)


def once(text: str) -> None:
    """One run of a contender on conv5_x at batch 64 (its input made outside, as the bench)."""
    import cupy as cp
    import numpy as np

    from convolab.bench.contenders import from_impl
    from convolab.shapes import ConvShape

    spec = parse_impl(text)
    impl = get_impl(spec.name)
    shape = ConvShape(64, 512, 16, 16, 512, 3)
    w = cp.random.standard_normal(shape.w_shape, dtype=np.float32) / np.float32(48)
    prepared = from_impl(impl, impl.params_for(dict(spec.params))).prepare(
        shape, w, cp.zeros(shape.M, dtype=np.float32))
    x = cp.random.standard_normal(shape.x_shape, dtype=np.float32)
    prepared.op(x)
    cp.cuda.Device().synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, help="also build this plan's wgmma rows")
    parser.add_argument("--check", action="store_true", help="run each rung once, checked")
    parser.add_argument("--once", help="run this contender on conv5_x at batch 64 once")
    args = parser.parse_args()
    todo = jobs(args.plan)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda job: get_kernel(*job), todo))
    print(f"{len(todo)} wgmma builds in {time.perf_counter() - start:.1f} s", flush=True)
    if args.check:
        check()
    if args.once:
        once(args.once)


if __name__ == "__main__":
    main()
