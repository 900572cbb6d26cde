"""Classify the first N test images with every implementation, in one process (device check).

The CPU answer (cpu-im2col: NumPy only, safe where Numba is broken) is the yardstick: every
exact GPU rung must give the same accuracy, tensor-core paths must stay within 0.2 points.
Writes one JSON with per-layer Op/Layer Times and accuracy per implementation.

    PYTHONPATH=src python3 benchmarks/classify_all.py --batch 10000 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from convolab import classify, data, models
from convolab.backend import gpu_available
from convolab.registry import all_impls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="also the CPU yardstick (slow on 2 cores)")
    args = ap.parse_args()
    spec = models.spec("ece408")
    x, labels = data.load_images("test", n=args.batch, size=spec.input_size)
    rows: list[dict] = []

    def record(path: str, report: classify.Report, seconds: float) -> None:
        row = {"path": path, "accuracy": report.accuracy, "seconds": seconds,
               "layers": [vars(lt) for lt in report.layers],
               "network_op_ms": report.network_op_ms}
        rows.append(row)
        layers = " ".join(f"{lt.name} op {lt.op_ms:.3f} ms layer {lt.layer_ms:.1f} ms"
                          for lt in report.layers)
        net = f"network op {report.network_op_ms:.3f} ms" if report.network_op_ms else ""
        print(f"{path:28s} acc {report.accuracy:.4f} {layers}{net}", flush=True)
        args.out.write_text(json.dumps({"batch": args.batch, "rows": rows}, indent=2))

    if args.cpu:
        cpu_impl = classify.choose_impl("cpu-im2col", "cpu")
        report = classify.Report("ece408", "cpu", args.batch, "cpu-im2col")
        t0 = time.perf_counter()
        classify.run_per_layer(models.load("ece408"), cpu_impl, "cpu", x, labels, report)
        record("cpu-im2col", report, time.perf_counter() - t0)
    if not gpu_available():
        return
    gpu_name = classify.gpu_name()
    for impl in all_impls("gpu"):
        if impl.pool:
            continue
        network = models.load("ece408").to("gpu")
        report = classify.Report("ece408", "gpu", args.batch, impl.name, gpu=gpu_name)
        t0 = time.perf_counter()
        try:
            classify.run_per_layer(network, impl, "gpu", x, labels, report)
        except Exception as err:  # one broken rung must not hide the others' results
            rows.append({"path": impl.name, "error": f"{type(err).__name__}: {err}"})
            print(f"{impl.name:28s} ERROR {type(err).__name__}: {err}", flush=True)
            continue
        record(impl.name, report, time.perf_counter() - t0)
    for mode in ("exact", "tf32", "fp16"):
        network = models.load("ece408").to("gpu")
        report = classify.Report("ece408", "gpu", args.batch, f"fused-{mode}", gpu=gpu_name)
        t0 = time.perf_counter()
        classify.run_fused(network, mode, x, labels, report)
        record(f"fused network ({mode})", report, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
