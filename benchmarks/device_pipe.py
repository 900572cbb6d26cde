"""fcp_exact_pipe (persistent, double-buffered rung 13) against fcp_exact on the device.

    PYTHONPATH=src python3 benchmarks/device_pipe.py --out DIR [--reps 30] [--budget 170]

Correctness first (every variant: B = 1 and 5 random, NaN-poisoned, vs fp64; then at
B = 10000 its first and last 16 images, which the last tasks of the persistent blocks
write), then Op Time at B = 10000: CUDA events, 3 warm-ups, median of --reps.
Writes DIR/pipe.json and prints one line per variant. Stops timing (but still writes what
it has) when --budget seconds have passed.

Prediction, written before the first run (H100, fcp_exact conv1 0.696 ms, conv2 1.456 ms):
  * conv1 fcp_exact: 0.69-0.70 ms, as before (its machine code is byte-identical).
  * conv1 pipe, whole image per task (RPT 5): 61 KB of shared memory -> 3 blocks of 5 warps
    per SM (15 warps instead of 20). The staging bubble goes but occupancy drops:
    0.62 +- 0.03 ms.
  * conv1 pipe, one 8-row tile per task (RPT 1): 16 KB, 95 registers at 4 blocks/SM
    (20 warps), 22 staged rows per 16 used (the halo comes from L2): the best candidate,
    0.60 +- 0.03 ms. bps 2 (10 warps) too few warps to hide latency, > 0.7 ms; bps 6 caps
    registers at 64 (ptxas: 240 B of spills), > 0.75 ms. RPT 2 computes 48 rows for 40:
    ~20 % slower than RPT 1.
  * conv1 pipe with weights in registers (wreg: 1 channel x 16 columns per thread): per
    pooled row 1568 FFMA with 48 row loads and no weight loads (now 98 + 24 loads):
    if FFMA issue is the limit, another 3-5 %: ~0.58 ms.
  * conv2 fcp_exact: 1.45 ms. It runs one 8-warp block per SM (191 registers x 256
    threads), so every image's staging is a full bubble; the pipe (still 1 block/SM)
    hides it: 1.30-1.35 ms. 2 channel groups (mg 2, 2 blocks of 4 warps) or half-image
    tiles: within +-5 % of that; bps 2 (128-register cap, spills): slower, ~1.6 ms.

Outcome of run 1 (benchmarks/results/pipe_h100_2026-11-23.json): all variants exact
(rel-L2 <= 2.5e-7). conv1: fcp_exact 0.696; every pipe with fcp_exact's tile was SLOWER,
0.82 (RPT 5, 3 blocks/SM) to 1.02 ms; RPT 1 cost 12 % more than RPT 5 at equal warps (two
barriers and a 22-row stage per 8 pooled rows); weights in registers with 16 columns per
thread (pw 8) 0.88-0.91 (TX 5: 16-float lane stride, 4-way bank conflicts on the row
loads, and 128-144 registers); with 8 columns (pw 4, 320 threads, 2 blocks/SM) 0.670, the
only gain. So the staging bubble was not conv1's loss; warps per SM and shared-memory
loads are. conv2: pipe 1.397 (-3.6 %), half-image tiles at 2 blocks/SM 1.387.

Prediction for run 2 (only the register-weight family, "wreg4"/"wreg2", is new): per
pooled row a pw-4 thread does 784 FFMA and 32 row loads (2-way conflicts), a pw-2 thread
392 FFMA and 24 conflict-free loads; the tile height / blocks-per-SM variants of wreg4 keep
20 warps and should land within +-3 % of 0.670; wreg2 with 160-thread blocks (auto: 5
blocks = 25 warps if it compiles to <= 80 registers) is the one with room to go lower:
0.62-0.66. 0.60 is unlikely.

Outcome of run 2 (..._run2.json; this GPU ran ~1.3 % slower across the board: conv2
fcp_exact 1.468 vs 1.449): conv1 fcp_exact 0.695, default (= wreg4 rpt5 bps2) 0.688 and
0.689 (run 1: 0.670), so the register-weight gain is 1-4 %, near the 2-3 % spread. The
other wreg4 shapes 0.70-0.90 (RPT 1 and 2-channel blocks lose most); wreg2 0.73-0.83 (auto
took 72 registers with spills at 25 warps: 0.83; at 20 warps 0.75). Prediction missed:
no variant beats 0.67. conv2: pipe 1.415 (-3.6 % again), ty4 rpt1 bps2 1.403.

Prediction for run 3 (fcp_exact_cw, conv1 only): ncu on the register-weight pipe showed the
shared-memory pipe at 85 % (72 M of 128 M wavefronts are bank conflicts of its 32-byte lane
stride) with the FMA pipe at 62 %; fcp_exact's tile has no conflicts but spends 98 broadcast
weight loads per 1568 FFMA. With the weights as constant-bank operands the loop is 1568 FFMA
+ 24 conflict-free LDS.128 per pooled row, 64 registers (6 blocks, 30 warps per SM):
0.55-0.60 ms if the FMA pipe reaches ~85 %; ty 4 / 10 / 20 within +-5 %.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from convolab.check import poison, rel_l2  # noqa: E402
from convolab.gpu import fused  # noqa: E402
from convolab.gpu import network as gnet  # noqa: E402
from convolab.shapes import ConvShape  # noqa: E402

LAYERS = {"conv1": (ConvShape(10000, 1, 86, 86, 4, 7), 2),
          "conv2": (ConvShape(10000, 4, 40, 40, 16, 7), 4)}
WREG4 = {**fused.PIPE_WREG_TILE, "mg": 4}  # 1 channel x 8 columns per thread, weights in regs
WREG8 = {**WREG4, "pw": 8}  # 1 channel x 16 columns
WREG2 = {**WREG4, "pw": 2}  # 1 channel x 4 columns
# Runs 1 and 2 timed the pipe and register-weight families (docstring, results files);
# run 3 puts fcp_exact_cw (weights as a by-value parameter) beside the best of them.
VARIANTS: dict[str, list[tuple[str, dict[str, int]]]] = {
    "conv1": [
        ("exact", {"pipe": -1, "cw": -1}),
        ("wreg4 rpt5 bps2", {**WREG4, "rpt": 5, "bps": 2}),
        ("default", {}),  # = cw since run 3
        ("cw minb2", {"cw": 1, "minb": 2}),
        ("cw minb6", {"cw": 1, "minb": 6}),
        ("cw ty4 rpt10", {"cw": 1, "ty": 4}),
        ("cw ty10 rpt4", {"cw": 1, "ty": 10}),
        ("cw ty20 rpt2", {"cw": 1, "ty": 20}),
        ("cw pw1", {"cw": 1, "pw": 1}),
        ("cw pw4", {"cw": 1, "pw": 4}),
    ],
    "conv2": [
        ("exact", {"pipe": -1}),
        ("default", {}),  # = pipe auto since run 1
        ("pipe ty4 rpt1 bps2", {"pipe": 1, "ty": 4, "rpt": 1, "bps": 2}),
    ],
}


def pooled_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, pool: int) -> np.ndarray:
    """fp64 maxpool(relu(conv + b)): the network module's reference."""
    return gnet.conv_relu_pool_numpy(x, w, b, pool)


def kernel_of(shape: ConvShape, pool: int, params: dict[str, int]) -> tuple[Any, Any]:
    import cupy as cp

    from convolab.gpu.compile import get_kernel

    cp.cuda.Device(0).use()  # a worker thread needs the context current to load the module
    plan = fused.exact_plan(shape, pool, params)
    return plan, get_kernel(fused.KERNEL_FILE, plan.kernel, plan.defines)


def check_small(cp: Any, rng: np.random.Generator, shape: ConvShape, pool: int,
                params: dict[str, int]) -> float:
    impl = fused.fused_conv_pool_impl(pool)
    worst = 0.0
    for batch in (1, 5):
        s = ConvShape(batch, shape.C, shape.H, shape.W, shape.M, shape.K, shape.S)
        x = rng.standard_normal(s.x_shape, dtype=np.float32)
        w = rng.standard_normal(s.w_shape, dtype=np.float32)
        b = rng.standard_normal((s.M,), dtype=np.float32)
        run = impl.prepare(s, cp.asarray(w), cp.asarray(b), impl.params_for(params))
        y = cp.empty(impl.out_shape(s), cp.float32)
        poison(y)
        run(cp.asarray(x), y)
        worst = max(worst, rel_l2(y, pooled_ref(x, w, b, pool)))
    return worst


def time_layer(cp: Any, rng: np.random.Generator, shape: ConvShape, pool: int,
               rows: list[dict[str, Any]], args: argparse.Namespace, t_start: float,
               save: Any) -> None:
    from convolab.timing import Stats, time_gpu

    x = cp.random.random(shape.x_shape, dtype=cp.float32)
    w = (rng.standard_normal(shape.w_shape) * 0.2).astype(np.float32)
    b = (rng.standard_normal(shape.M) * 0.1).astype(np.float32)
    n = 16
    x_first, x_last = x[:n].get(), x[-n:].get()
    ref_first, ref_last = pooled_ref(x_first, w, b, pool), pooled_ref(x_last, w, b, pool)
    impl = fused.fused_conv_pool_impl(pool)
    hp, wp = fused.pooled_hw(shape, pool)
    flops = 2 * shape.B * shape.M * shape.C * shape.K**2 * (hp * pool) * (wp * pool)
    for row in rows:
        if "error" in row:
            continue
        if time.perf_counter() - t_start > args.budget:
            row["skipped"] = "time budget"
            continue
        try:
            run = impl.prepare(shape, cp.asarray(w), cp.asarray(b),
                               impl.params_for(row["params"]))
            y = cp.empty(impl.out_shape(shape), cp.float32)
            poison(y)
            run(x, y)
            row["rel_l2_first"] = rel_l2(y[:n], ref_first)
            row["rel_l2_last"] = rel_l2(y[-n:], ref_last)
            row["all_finite"] = bool(cp.isfinite(y).all())
            if hasattr(run, "grid"):
                row["grid"] = run.grid
                plan, kernel = kernel_of(shape, pool, row["params"])
                row["occupancy"] = fused.pipe_occupancy(kernel, plan)
            st = Stats.of(time_gpu(lambda run=run, y=y: run(x, y), reps=args.reps, warmup=3))
            row.update(st.as_dict())
            row["tflops_computed"] = flops / st.median_ms / 1e9
        except Exception as err:
            row["error"] = repr(err)[:600]
            traceback.print_exc()
        save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget", type=float, default=170.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    import cupy as cp

    dev = cp.cuda.runtime.getDeviceProperties(0)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    n_sm = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    result: dict[str, Any] = {"device": name, "sms": n_sm, "batch": 10000, "reps": args.reps,
                              "warmup": 3, "date": datetime.date.today().isoformat(),
                              "layers": {}}

    def save() -> None:
        (args.out / "pipe.json").write_text(json.dumps(result, indent=1, default=str))

    # Compile every variant at once (NVRTC runs outside the GIL; CuPy caches on disk).
    jobs = [(layer, label, params) for layer, vs in VARIANTS.items() for label, params in vs]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        futures = {(layer, label): pool.submit(kernel_of, *LAYERS[layer], params)
                   for layer, label, params in jobs}
    compiled = {}
    for (layer, label), fut in futures.items():
        try:
            compiled[(layer, label)] = fut.result()
        except Exception:  # retry in the main thread; a broken variant must not stop the rest
            try:
                params = dict(VARIANTS[layer])[label]
                compiled[(layer, label)] = kernel_of(*LAYERS[layer], params)
            except Exception as err:
                compiled[(layer, label)] = err
    result["compile_s"] = time.perf_counter() - t0
    print(f"{name}, {n_sm} SMs; compiled {len(jobs)} variants in {result['compile_s']:.1f} s",
          flush=True)

    rng = np.random.default_rng()
    # (a) correctness of every variant at small batches
    for layer, label, params in jobs:
        shape, pool = LAYERS[layer]
        row: dict[str, Any] = {"label": label, "params": params}
        got = compiled[(layer, label)]
        if isinstance(got, Exception):
            row["error"] = f"compile: {got!r}"[:600]
        else:
            plan, kernel = got
            row.update(kernel=plan.kernel, defines=plan.defines, block=plan.block,
                       smem_dynamic=plan.smem_dynamic, regs=int(kernel.num_regs),
                       local_bytes=int(kernel.local_size_bytes))
            # blocks per SM (the pipe's is the driver's answer, after prepare's smem opt-in)
            row["occupancy"] = fused.resident_blocks(
                row["regs"], plan.threads, plan.smem_dynamic + int(kernel.shared_size_bytes))
            try:
                row["rel_l2_small"] = check_small(cp, rng, shape, pool, params)
            except Exception as err:
                row["error"] = repr(err)[:600]
                traceback.print_exc()
        result["layers"].setdefault(layer, []).append(row)
    save()

    # (b) B = 10000: correctness on the first and last images, then Op Time
    for layer, (shape, pool) in LAYERS.items():
        time_layer(cp, rng, shape, pool, result["layers"][layer], args, t_start, save)
        cp.get_default_memory_pool().free_all_blocks()

    result["total_s"] = time.perf_counter() - t_start
    save()
    print(f"{'layer':6s} {'variant':20s} {'ms':>7s} {'spr%':>5s} {'TF/s':>5s} {'regs':>4s} "
          f"{'lmem':>4s} {'occ':>3s} {'grid':>11s} {'smem':>6s} {'err small':>9s} "
          f"{'err 10k':>9s}")
    for layer, rows in result["layers"].items():
        for r in rows:
            err10k = max(r.get("rel_l2_first", float("nan")), r.get("rel_l2_last", float("nan")))
            print(f"{layer:6s} {r['label']:20s} {r.get('median_ms', float('nan')):7.4f} "
                  f"{r.get('spread_pct', float('nan')):5.1f} "
                  f"{r.get('tflops_computed', float('nan')):5.1f} {r.get('regs', -1):4d} "
                  f"{r.get('local_bytes', -1):4d} {str(r.get('occupancy', '-')):>3s} "
                  f"{str(r.get('grid', '-')):>11s} {r.get('smem_dynamic', 0):6d} "
                  f"{r.get('rel_l2_small', float('nan')):9.1e} {err10k:9.1e} "
                  f"{r.get('error', r.get('skipped', ''))[:80]}")
    print(f"total {result['total_s']:.1f} s")


if __name__ == "__main__":
    main()
