"""Device measurements for GPU rungs 8-12 and 14 (run by benchmarks/device_advanced.sh).

    python benchmarks/device_advanced.py sanitize          # each rung once, B=4 LeNet shapes
    python benchmarks/device_advanced.py bench --json F    # Op Time / Layer Time at B=10000
    python benchmarks/device_advanced.py collect --from OUTDIR --json RESULTS.json

A benchmark, not a test: it prints and records, and fails only if a kernel is wrong.
Every timed configuration is first checked against the fp64 reference (first images of the
same output, poisoned with NaN before the run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from typing import Any

import numpy as np

from convolab.check import poison, rel_l2
from convolab.gpu import ladder_advanced as adv
from convolab.gpu import tune
from convolab.registry import get_impl
from convolab.shapes import ConvShape
from convolab.timing import Stats, time_gpu, time_host_gpu

LENET = {"conv1": ConvShape(1, 1, 86, 86, 4, 7, 1), "conv2": ConvShape(1, 4, 40, 40, 16, 7, 1)}
# (rung, params): defaults, plus the variants whose comparison the report needs.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("channel-tree", {}),
    ("channel-tree", {"CSPLIT": 1, "MPT": 4, "PIX": 128, "PPT": 4}),
    ("channel-tree", {"CSPLIT": 1, "MPT": 8, "PIX": 128, "PPT": 2}),
    ("channel-atomic", {}),
    ("channel-atomic", {"CGROUP": 1}),
    ("fp16", {"HALF_ACCUM": 1}),
    ("fp16", {"HALF_ACCUM": 0}),
    ("fp16", {"HALF_ACCUM": 1, "MPAIRS": 2, "PPT": 4}),
    ("tensor-core-tf32", {}),
    ("tensor-core-fp16", {}),
    ("tensor-core-fp16", {"PREFETCH": 1}),
    ("tensor-core-bf16", {}),
    ("tensor-core-3xtf32", {}),
    ("tensor-core-3xtf32", {"NFRAG": 2, "BK": 32}),
    ("tensor-core-tf32", {"NFRAG": 2, "BK": 32}),
    ("streams", {}),
    ("fft", {}),
    ("fft", {"fft_size": 16}),
    ("auto", {}),
]
# Where channel-atomic should win: large C, small output. And two where it should lose.
CROSSOVER = [
    ConvShape(1, 512, 14, 14, 512, 3, 1),
    ConvShape(1, 1024, 9, 9, 256, 3, 1),
    ConvShape(4, 256, 16, 16, 128, 3, 1),
    ConvShape(32, 64, 32, 32, 64, 3, 1),
    ConvShape(256, 64, 32, 32, 64, 3, 1),
]


def data(shape: ConvShape, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    x = rng.random(shape.x_shape, dtype=np.float32)
    w = (rng.standard_normal(shape.w_shape) / math.sqrt(shape.C * shape.K**2)).astype(np.float32)
    b = rng.standard_normal(shape.M).astype(np.float32)
    return x, w, b


def sanitize() -> int:
    """Every rung once on B=4 LeNet shapes (run under compute-sanitizer)."""
    import cupy as cp

    rng = np.random.default_rng(0)
    worst = 0.0
    for layer, shape in LENET.items():
        shape = shape.with_batch(4)
        x, w, b = data(shape, rng)
        ref = tune.reference_conv(x, w, b, shape.S)
        for name, params in CONFIGS:
            impl = get_impl(name)
            run = impl.prepare(shape, cp.asarray(w), cp.asarray(b), impl.params_for(params))
            y = cp.empty(shape.y_shape, dtype=cp.float32)
            poison(y)
            run(cp.asarray(x), y)
            err = rel_l2(y, ref)
            worst = max(worst, err / impl.tolerance)
            print(f"{layer} {name} {params}: rel_l2 {err:.3g}", flush=True)
        y = adv.layer_forward_streams(x, w, b, 1, {"chunks": 2, "streams": 2})
        print(f"{layer} layer_forward_streams: rel_l2 {rel_l2(y, ref):.3g}", flush=True)
    cp.cuda.Device().synchronize()
    return 0 if worst <= 1 else 1


def op_time(
    name: str,
    params: dict[str, Any],
    shape: ConvShape,
    xd: Any,
    wd: Any,
    bd: Any,
    ref: np.ndarray,
    reps: int,
) -> dict[str, Any]:
    import cupy as cp

    impl = get_impl(name)
    row: dict[str, Any] = {"impl": name, "params": impl.params_for(params), "rung": impl.rung}
    try:
        run = impl.prepare(shape, wd, bd, impl.params_for(params))
        y = cp.empty(shape.y_shape, dtype=cp.float32)
        poison(y)
        stats = Stats.of(time_gpu(lambda: run(xd, y), reps=reps, warmup=3))
        err = rel_l2(y[: ref.shape[0]], ref)
    except Exception as err_:  # record and go on: one broken rung must not hide the rest
        row["error"] = f"{type(err_).__name__}: {err_}"
        return row
    row.update(stats.as_dict())
    row["gflops"] = shape.flops / (stats.median_ms * 1e6)
    row["rel_l2"] = err
    row["ok"] = bool(err <= impl.tolerance)
    return row


def bench(json_path: str | None, batch: int, reps: int) -> int:
    import cupy as cp

    rng = np.random.default_rng(1)
    out: dict[str, Any] = {
        "device": tune.gpu_name(),
        "date": dt.date.today().isoformat(),
        "batch": batch,
        "reps": reps,
        "op_time": {},
        "layer_time": {},
        "crossover": [],
    }
    bad = 0
    for layer, base in LENET.items():
        shape = base.with_batch(batch)
        x, w, b = data(shape, rng)
        ref = tune.reference_conv(x[:4], w, b, shape.S)
        xd, wd, bd = cp.asarray(x), cp.asarray(w), cp.asarray(b)
        rows = []
        for name, params in CONFIGS:
            row = op_time(name, params, shape, xd, wd, bd, ref, reps)
            rows.append(row)
            bad += int(not row.get("ok", False))
            med = row.get("median_ms", float("nan"))
            print(
                f"{layer} {name:<20} {json.dumps(params):<40} "
                f"{med:8.3f} ms  spread {row.get('spread_pct', float('nan')):5.1f}%  "
                f"{row.get('gflops', float('nan')):7.0f} GFLOP/s  "
                f"rel_l2 {row.get('rel_l2', float('nan')):.2e} {row.get('error', '')}",
                flush=True,
            )
        out["op_time"][layer] = rows
        from convolab.gpu import auto

        for mode in tune.MODES:
            choice = auto.choose(shape, mode)
            out.setdefault("auto_choice", {}).setdefault(layer, {})[mode] = choice.__dict__
            print(f"{layer} auto ({mode}) -> {choice}", flush=True)
        del xd
        # Layer Time: host x in, host y out. Same kernel (channel-tree, CSPLIT=1) both ways.
        inner_params = {"CSPLIT": 1, "MPT": 4, "PIX": 128, "PPT": 4}
        lt: dict[str, Any] = {}
        plain = Stats.of(
            time_host_gpu(
                lambda x=x, w=w, b=b, ip=inner_params: adv.layer_forward_plain(
                    x, w, b, 1, "channel-tree", ip
                ),
                reps=7,
                warmup=2,
            )
        )
        lt["plain"] = plain.as_dict()
        print(f"{layer} Layer Time plain  : {plain.median_ms:8.2f} ms", flush=True)
        for chunks, streams in ((4, 2), (8, 3), (16, 4), (32, 4)):
            params = {"chunks": chunks, "streams": streams, "inner_params": inner_params}
            y = adv.layer_forward_streams(x, w, b, 1, params)
            err = rel_l2(y[:4], tune.reference_conv(x[:4], w, b, 1))
            s = Stats.of(
                time_host_gpu(
                    lambda p=params, x=x, w=w, b=b: adv.layer_forward_streams(x, w, b, 1, p),
                    reps=7,
                    warmup=2,
                )
            )
            lt[f"streams_{chunks}x{streams}"] = {**s.as_dict(), "rel_l2": err}
            print(
                f"{layer} Layer Time streams chunks={chunks} streams={streams}: "
                f"{s.median_ms:8.2f} ms (rel_l2 {err:.1e})",
                flush=True,
            )
        out["layer_time"][layer] = lt
        cp.get_default_memory_pool().free_all_blocks()

    for shape in CROSSOVER:
        x, w, b = data(shape, rng)
        ref = tune.reference_conv(x[:2], w, b, shape.S)
        xd, wd, bd = cp.asarray(x), cp.asarray(w), cp.asarray(b)
        best: dict[str, Any] = {}
        for name, grid in (
            ("channel-tree", [{"CSPLIT": c, "MPT": m} for c in (1, 4, 8) for m in (4, 8)]),
            ("channel-atomic", [{"CGROUP": g, "MPT": m} for g in (4, 16, 64) for m in (4, 8)]),
        ):
            rows = [op_time(name, p, shape, xd, wd, bd, ref, 10) for p in grid]
            rows = [r for r in rows if r.get("ok")]
            if rows:
                best[name] = min(rows, key=lambda r: r["median_ms"])
        entry = {
            "shape": str(shape),
            "flops": shape.flops,
            **{k: {"median_ms": v["median_ms"], "params": v["params"]} for k, v in best.items()},
        }
        out["crossover"].append(entry)
        print("crossover", json.dumps(entry), flush=True)

    if json_path:
        with open(json_path, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 1 if bad else 0


def collect(folder: str, json_path: str) -> int:
    """Merge one device run's files (bench JSON, tune cache + trials, test and sanitizer
    logs) into the committed results file."""
    from pathlib import Path

    src = Path(folder)
    result: dict[str, Any] = {}
    bench_file = src / "advanced_bench.json"
    if bench_file.exists():
        result.update(json.loads(bench_file.read_text()))
    for name in ("tune.json", "tune_trials.json"):
        if (src / name).exists():
            result[name.removesuffix(".json")] = json.loads((src / name).read_text())
    for name in ("tests.log", "sanitizer.log", "env.txt"):
        if (src / name).exists():
            lines = (src / name).read_text().splitlines()
            keep = [
                ln
                for ln in lines
                if any(
                    k in ln
                    for k in (
                        "worst",
                        "passed",
                        "failed",
                        "FAILED",
                        "rc=",
                        "ERROR SUMMARY",
                        "took",
                        "NVIDIA",
                        "cupy",
                        "rel_l2",
                    )
                )
            ]
            result[name.replace(".", "_")] = keep[-60:]
    Path(json_path).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {json_path}")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["sanitize", "bench", "collect"])
    parser.add_argument("--json")
    parser.add_argument("--from", dest="folder", help="collect: the device run's $OUT copy")
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.what == "sanitize":
        return sanitize()
    if args.what == "collect":
        if not args.folder or not args.json:
            parser.error("collect needs --from FOLDER and --json FILE")
        return collect(args.folder, args.json)
    return bench(args.json, args.batch, args.reps)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
