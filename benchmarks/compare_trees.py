"""Time the headline figures of two source trees in one run, interleaved: a refactor's
"no loss of speed" check.

    python benchmarks/compare_trees.py --tree before=/path/to/old/src --tree after=src \
        --rounds 3 --reps 30 --out results.json

Each round runs every tree once, each in its own process with that tree first on
PYTHONPATH, so both see the same GPU state and any drift shows up in both. A tree's worker
measures, at B=10000 with CUDA events (median of --reps after warm-up): the whole ece408
forward in exact and fp16 mode, and the fused conv+ReLU+pool of each conv layer (fp32
implementation with its default parameters). It also hashes its exact outputs, so two trees
whose kernels should be the same machine code must give the same bits. The layer shapes are
read from each tree's own model definition, so the script works on trees older than the
models.conv_blocks helper.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from typing import Any


def _ece408_conv_layers(batch: int) -> list[tuple[Any, int, str]]:
    """(ConvShape, pool, parameter prefix) of each conv layer, from the tree's own layers."""
    from convolab import models
    from convolab.layers import Conv2d, MaxPool2d
    from convolab.shapes import ConvShape

    model = models.spec("ece408")
    layers = model.layers()
    channels, size, out = 1, model.input_size, []
    for i, layer in enumerate(layers):
        if isinstance(layer, Conv2d):
            shape = ConvShape(batch, channels, size, size, layer.out_channels, layer.kernel_size)
            pool = next(p.kernel_size for p in layers[i + 1:] if isinstance(p, MaxPool2d))
            out.append((shape, pool, layer.name))
            channels, size = layer.out_channels, shape.H_out // pool
    return out


def _digest(a: Any) -> str:
    return hashlib.sha256(a.get().tobytes()).hexdigest()[:16]


def worker(batch: int, reps: int) -> dict[str, Any]:
    import cupy as cp

    from convolab import models
    from convolab.gpu.fused import fused_conv_pool_impl
    from convolab.gpu.network import FusedLeNet
    from convolab.timing import Stats, time_gpu

    params = models.load("ece408").params()
    rng = cp.random.default_rng(0)
    result: dict[str, Any] = {}
    layers = _ece408_conv_layers(batch)
    x = rng.random((batch, *layers[0][0].x_shape[1:]), dtype=cp.float32)
    for mode in ("exact", "fp16"):
        net = FusedLeNet(params, mode=mode)
        probs = cp.empty((batch, 10), cp.float32)
        stats = Stats.of(time_gpu(lambda n=net, p=probs: n.forward_into(x, p), reps=reps,
                                  warmup=5))
        result[f"forward_{mode}_ms"] = stats.median_ms
        result[f"forward_{mode}_spread_pct"] = stats.spread_pct
        result[f"forward_{mode}_sha"] = _digest(probs)
    for i, (shape, pool, prefix) in enumerate(layers):
        impl = fused_conv_pool_impl(pool)
        w = cp.asarray(params[f"{prefix}.weight"])
        b = cp.asarray(params[f"{prefix}.bias"])
        run = impl.prepare(shape, w, b, impl.params_for())
        xi = rng.random(shape.x_shape, dtype=cp.float32)
        y = cp.full(impl.out_shape(shape), cp.nan, cp.float32)
        stats = Stats.of(time_gpu(lambda r=run, a=xi, o=y: r(a, o), reps=reps, warmup=5))
        result[f"conv{i + 1}_fused_ms"] = stats.median_ms
        result[f"conv{i + 1}_fused_spread_pct"] = stats.spread_pct
        result[f"conv{i + 1}_fused_sha"] = _digest(y)
        del xi, y
    result["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return result


def run_tree(path: str, batch: int, reps: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(batch),
           "--reps", str(reps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tree {path}: worker failed\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, samples in runs.items():
        keys = [k for k in samples[0] if k.endswith("_ms")]
        out[name] = {k: statistics.median(s[k] for s in samples) for k in keys}
        out[name]["sha"] = {k: sorted({s[k] for s in samples})
                            for k in samples[0] if k.endswith("_sha")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH to a src folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=10000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.batch, args.reps)))
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    if len(trees) < 1 or args.rounds < 1 or args.reps < 20:
        raise SystemExit("give at least one --tree NAME=PATH, --rounds >= 1, --reps >= 20")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, path in trees.items():
            runs[name].append(run_tree(path, args.batch, args.reps))
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in runs[name][-1].items() if k.endswith("_ms")),
                flush=True)
    report = {"batch": args.batch, "reps": args.reps, "rounds": args.rounds,
              "trees": trees, "runs": runs, "median_of_rounds": summarise(runs)}
    print(json.dumps(report["median_of_rounds"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
