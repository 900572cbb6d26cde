"""Device run for GPU rungs 1-7: tests, compute-sanitizer, and timings of the ece408 layers.

    PYTHONPATH=src python3 benchmarks/device_ladder.py --out "$OUT"          # everything
    PYTHONPATH=src python3 benchmarks/device_ladder.py --only-small         # sanitizer target

Phases (each guarded, so one failure does not lose the others' results):
  1. pytest -m gpu tests/test_gpu_ladder.py
  2. compute-sanitizer memcheck and racecheck on every rung, once, LeNet-shaped inputs (B=4)
  3. Op Time of every rung on conv1 and conv2 at B=10000 (CUDA events, warm-up, median of 20),
     checked first against the fp64 reference (first images) and torch fp32 (whole batch);
     torch.nn.functional.conv2d fp32 with TF32 off side by side; a small rung-7 config sweep.
Writes ladder.json (and logs) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from convolab.check import poison, rel_l2
from convolab.gpu import ladder
from convolab.shapes import ConvShape
from convolab.timing import Stats, time_gpu

LAYERS = {
    "conv1": ConvShape(B=10000, C=1, H=86, W=86, M=4, K=7),
    "conv2": ConvShape(B=10000, C=4, H=40, W=40, M=16, K=7),
}
CHECK_IMAGES = 8  # images checked against the fp64 reference (the whole batch vs torch)
ROOT = Path(__file__).resolve().parent.parent


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int) -> np.ndarray:
    from convolab.conv_cpu import conv_reference

    return conv_reference(x, w, b, stride)


def run_small() -> int:
    """Each rung once on B=4 LeNet-shaped layers: the compute-sanitizer target."""
    import cupy as cp

    rng = np.random.default_rng(0)
    bad = 0
    for shape in (LAYERS["conv1"].with_batch(4), LAYERS["conv2"].with_batch(4)):
        x = rng.standard_normal(shape.x_shape, dtype=np.float32)
        w = rng.standard_normal(shape.w_shape, dtype=np.float32)
        b = rng.standard_normal((shape.M,), dtype=np.float32)
        ref = reference(x, w, b, shape.S)
        runs = [(impl, {}) for impl in ladder.LADDER] + [(ladder.REGISTER_TILED, {"PIPE": 1})]
        for impl, params in runs:
            run = impl.prepare(shape, cp.asarray(w), cp.asarray(b), impl.params_for(params))
            y = cp.empty(shape.y_shape, dtype=cp.float32)
            poison(y)
            run(cp.asarray(x), y)
            cp.cuda.Device().synchronize()
            err = rel_l2(y, ref)
            ok = err <= impl.tolerance
            bad += not ok
            label = impl.name + "".join(f"[{k}={v}]" for k, v in params.items())
            print(f"{label:24s} {shape}  rel L2 {err:.2e}  {'ok' if ok else 'WRONG'}")
    return 1 if bad else 0


def phase_tests(out: Path) -> dict[str, Any]:
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu_ladder.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    (out / "pytest.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return {"returncode": proc.returncode, "seconds": round(time.time() - t0, 1), "tail": tail}


def find_sanitizer() -> str | None:
    for candidate in (
        shutil.which("compute-sanitizer"),
        "/usr/local/cuda/bin/compute-sanitizer",
        "/usr/local/cuda/compute-sanitizer/compute-sanitizer",
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def phase_sanitizer(out: Path) -> dict[str, Any]:
    tool_path = find_sanitizer()
    if tool_path is None:
        return {"error": "compute-sanitizer not found"}
    results: dict[str, Any] = {"path": tool_path}
    for tool in ("memcheck", "racecheck"):
        t0 = time.time()
        cmd = [
            tool_path, "--tool", tool, "--error-exitcode", "3",
            *(["--racecheck-report", "all"] if tool == "racecheck" else []),
            sys.executable, str(Path(__file__).resolve()), "--only-small",
        ]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as err:
            text, rc = f"timeout: {err}", -1
        (out / f"sanitizer_{tool}.log").write_text(text)
        summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line or "WRONG" in line
                   or "RACECHECK SUMMARY" in line or "Error" in line][:20]
        results[tool] = {"returncode": rc, "seconds": round(time.time() - t0, 1),
                         "summary": summary, "tail": text.strip().splitlines()[-8:]}
        print(tool, results[tool], flush=True)
    return results


def torch_conv(x: Any, w: Any, b: Any, shape: ConvShape, reps: int) -> dict[str, Any] | None:
    try:
        import torch
    except Exception as err:  # torch is optional: the anchor, not a dependency
        return {"error": f"torch unavailable: {err}"}
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    xt, wt, bt = (torch.as_tensor(a, device="cuda") for a in (x, w, b))
    results: dict[str, Any] = {
        "version": torch.__version__, "cudnn": torch.backends.cudnn.version(),
    }
    yt = None
    for bench_mode in (False, True):
        torch.backends.cudnn.benchmark = bench_mode

        def call() -> Any:
            return torch.nn.functional.conv2d(xt, wt, bt, stride=shape.S)

        for _ in range(3):
            yt = call()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        stats = Stats.of(samples)
        results["benchmark" if bench_mode else "default"] = {
            **stats.as_dict(), "gflops": shape.flops / stats.median_ms / 1e6,
        }
    results["y"] = yt
    return results


def time_impl(impl, shape, x, w, b, params, reps, y_torch, ref) -> dict[str, Any]:
    import cupy as cp

    entry: dict[str, Any] = {"params": dict(params)}
    if not impl.supports(shape):
        return {**entry, "error": "shape not supported"}
    if impl.name == "register-tiled":
        entry["config"] = ladder.register_tiled_config(shape, params)
    run = impl.prepare(shape, w, b, impl.params_for(params))
    y = cp.empty(shape.y_shape, dtype=cp.float32)
    poison(y)
    run(x, y)
    cp.cuda.Device().synchronize()
    entry["rel_l2_ref_first_images"] = rel_l2(y[:CHECK_IMAGES], ref)
    if y_torch is not None:  # whole batch, on the device (the output is up to 1 GB)
        diff = cp.linalg.norm((y - y_torch).ravel()) / cp.linalg.norm(y_torch.ravel())
        entry["rel_l2_vs_torch_fp32"] = float(diff) if bool(cp.isfinite(y).all()) else "inf"
    ok = entry["rel_l2_ref_first_images"] <= impl.tolerance
    entry["correct"] = ok
    if ok:
        stats = Stats.of(time_gpu(lambda: run(x, y), reps=reps, warmup=3))
        entry.update(stats.as_dict())
        entry["gflops"] = shape.flops / stats.median_ms / 1e6
    return entry


SWEEP = {
    "conv1": [
        {"PIPE": 1}, {"PIPE": 1, "BY": 1}, {"PIPE": 1, "TN": 4, "BY": 2}, {"QU": 1},
        {"QU": 1, "PIPE": 1}, {"TN": 8, "BY": 3}, {"TN": 4, "BY": 2}, {"TN": 8, "BX": 40},
        {"QU": 1, "TN": 4, "BY": 2}, {"TN": 8, "BY": 1},
    ],
    "conv2": [
        {"PIPE": 1}, {"PIPE": 1, "TN": 4}, {"PIPE": 1, "CCH": 4}, {"QU": 1},
        {"QU": 1, "PIPE": 1}, {"QU": 1, "PIPE": 1, "CCH": 4}, {"TN": 4}, {"TN": 4, "QU": 1},
        {"TN": 2, "BY": 7}, {"TM": 8}, {"TN": 4, "CCH": 2}, {"CCH": 2}, {"QU": 1, "CCH": 2},
    ],
}


def phase_timing(out: Path, reps: int, sweep: bool, report: dict) -> None:
    import cupy as cp

    rng = np.random.default_rng(2026_11_23)
    timings: dict[str, Any] = {}
    report["timing"] = timings
    for layer, shape in LAYERS.items():
        x_h = rng.standard_normal(shape.x_shape, dtype=np.float32)
        w_h = (rng.standard_normal(shape.w_shape, dtype=np.float32) / shape.K).astype(np.float32)
        b_h = rng.standard_normal((shape.M,), dtype=np.float32)
        ref = reference(x_h[:CHECK_IMAGES], w_h, b_h, shape.S)
        x, w, b = cp.asarray(x_h), cp.asarray(w_h), cp.asarray(b_h)
        del x_h
        layer_out: dict[str, Any] = {"shape": str(shape), "gflop": shape.flops / 1e9}
        timings[layer] = layer_out
        tr = torch_conv(x, w, b, shape, reps)
        y_torch = None
        if tr is not None and "y" in tr:
            y_torch = cp.asarray(tr.pop("y"))
        layer_out["torch_fp32_no_tf32"] = tr
        print(layer, "torch", {k: v for k, v in (tr or {}).items()}, flush=True)
        for impl in ladder.LADDER:
            try:
                entry = time_impl(impl, shape, x, w, b, {}, reps, y_torch, ref)
            except Exception as err:  # record and go on: later rungs still get measured
                entry = {"error": f"{type(err).__name__}: {err}"}
            layer_out[impl.name] = entry
            cp.get_default_memory_pool().free_all_blocks()
            print(layer, impl.name, {k: entry.get(k) for k in
                  ("median_ms", "spread_pct", "gflops", "rel_l2_ref_first_images",
                   "rel_l2_vs_torch_fp32", "error", "config")}, flush=True)
            (out / "ladder.json").write_text(json.dumps(report, indent=2, default=str))
        try:  # the persistent variant next to the default, same rules
            entry = time_impl(ladder.REGISTER_TILED, shape, x, w, b, {"PIPE": 1}, reps, y_torch,
                              ref)
        except Exception as err:
            entry = {"error": f"{type(err).__name__}: {err}"}
        layer_out["register-tiled[PIPE=1]"] = entry
        print(layer, "register-tiled[PIPE=1]", entry.get("median_ms"), entry.get("config"),
              entry.get("error"), flush=True)
        if sweep:
            rows = []
            for params in SWEEP[layer]:
                try:
                    entry = time_impl(ladder.REGISTER_TILED, shape, x, w, b, params, 10,
                                      y_torch, ref)
                except Exception as err:
                    entry = {"params": params, "error": f"{type(err).__name__}: {err}"}
                rows.append(entry)
                print(layer, "sweep", params, entry.get("config"), entry.get("median_ms"),
                      entry.get("error"), flush=True)
            layer_out["register_tiled_sweep"] = rows
            # The sweep's winner, re-timed with full repetitions (the tuner's job in miniature).
            timed = [r for r in rows if "median_ms" in r]
            if timed:
                best = min(timed, key=lambda r: r["median_ms"])
                entry = time_impl(ladder.REGISTER_TILED, shape, x, w, b, best["params"], reps,
                                  y_torch, ref)
                layer_out["register-tiled[best-of-sweep]"] = entry
                print(layer, "best-of-sweep", best["params"], entry.get("median_ms"), flush=True)
        del x, w, b, y_torch
        cp.get_default_memory_pool().free_all_blocks()
        (out / "ladder.json").write_text(json.dumps(report, indent=2, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--only-small", action="store_true", help="sanitizer target: B=4 runs")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tests", "sanitizer", "timing"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time rung-7 configs")
    args = parser.parse_args()
    if args.only_small:
        return run_small()

    import cupy as cp

    args.out.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    report: dict[str, Any] = {
        "what": "convolab GPU ladder rungs 1-7, Op Time (CUDA events around run), B=10000",
        "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "date": datetime.date.today().isoformat(),
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "driver": cp.cuda.runtime.driverGetVersion(),
        "reps": args.reps,
    }
    for name, phase in (("tests", phase_tests), ("sanitizer", phase_sanitizer)):
        if name in args.skip:
            continue
        try:
            report[name] = phase(args.out)
        except Exception as err:
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        (args.out / "ladder.json").write_text(json.dumps(report, indent=2, default=str))
    if "timing" not in args.skip:
        phase_timing(args.out, args.reps, args.sweep, report)
    (args.out / "ladder.json").write_text(json.dumps(report, indent=2, default=str))
    print("wrote", args.out / "ladder.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
