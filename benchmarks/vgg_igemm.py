"""Rungs 26-27 on DianNao's VGG16 layers against cuDNN/cuBLAS, with their tile sweep.

For each layer and batch: every tile configuration of every precision's rung (26 and 27) is
checked on the first images of its full-batch output against an fp64 reference (torch,
float64 on the GPU; output poisoned with NaN), then timed with CUDA events (warm-up, median
of REPS, inputs rotated over more than twice the L2 cache). The anchors run in the same
process: cuDNN (torch.nn.functional.conv2d) in fp32, TF32 and fp16 channels-last for the
convolutions, cuBLAS (torch.matmul) in fp32, TF32 and fp16 for the classifier layers; their
inputs are converted outside the timed region, ours inside it (NCHW fp32 in, NCHW fp32 out).

    python benchmarks/vgg_igemm.py --out DIR [--batches 1,16,64] [--modes fp16,tf32,3xtf32]

Writes DIR/vgg_igemm.json (every configuration) and prints the best per precision.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from convolab.bench.cases import vgg_cases
from convolab.gpu import implicit_gemm as ig
from convolab.registry import get_impl
from convolab.shapes import ConvShape

REPS = 20
CHECK_IMAGES = 1
ANCHOR_PRECISION = {"fp32": "3xtf32", "tf32": "tf32", "fp16": "fp16"}


def configs(mode: str, split: bool, full: bool) -> list[dict[str, Any]]:
    impl = get_impl(f"igemm-{'splitk-' if split else ''}{mode}")
    if not full:
        return [impl.params_for()]
    keys = sorted(impl.space)
    out = []
    for combo in itertools.product(*(impl.space[k] for k in keys)):
        p = dict(zip(keys, combo, strict=True))
        if split and p["SPLIT"] not in (0, 4):
            continue
        try:
            ig.igemm_defines(mode, p)
        except ValueError:
            continue
        out.append(p)
    return out


def rotation(cp: Any, shape: ConvShape) -> list[Any]:
    nbytes = 4 * math.prod(shape.x_shape)
    count = min(64, max(1, math.ceil(2 * 50 * 2**20 / nbytes)))
    return [cp.random.standard_normal(shape.x_shape, dtype=np.float32) for _ in range(count)]


def events_ms(cp: Any, fn: Any, reps: int) -> float:
    for _ in range(3):
        fn()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(samples))


def reference(torch: Any, x: Any, w: Any, b: Any, shape: ConvShape) -> np.ndarray:
    xt = torch.from_dlpack(x[:CHECK_IMAGES]).double()
    out = torch.nn.functional.conv2d(xt, torch.from_dlpack(w).double(),
                                     torch.from_dlpack(b).double(), stride=shape.S)
    return out.cpu().numpy()


def measure_impl(cp: Any, name: str, params: dict[str, Any], shape: ConvShape, data: dict,
                 reps: int) -> dict[str, Any]:
    from convolab.check import poison, rel_l2

    impl = get_impl(name)
    row: dict[str, Any] = {"impl": name, "params": params}
    try:
        run = impl.prepare(shape, data["w"], data["b"], impl.params_for(params))
        y = cp.empty(shape.y_shape, dtype=cp.float32)
        poison(y)
        run(data["xs"][0], y)
        row["rel_l2"] = rel_l2(y[:CHECK_IMAGES], data["ref"])
        row["ok"] = bool(row["rel_l2"] <= impl.tolerance)
        if row["ok"]:
            it = itertools.cycle(data["xs"])
            row["ms"] = events_ms(cp, lambda: run(next(it), y), reps)
    except Exception as err:  # one broken configuration must not end the sweep
        row.update(ok=False, error=f"{type(err).__name__}: {err}"[:300])
    return row


def anchor_runs(torch: Any, shape: ConvShape, data: dict) -> dict[str, Any]:
    """name -> zero-argument launcher (inputs converted here, outside the timed region)."""
    F = torch.nn.functional
    xs = [torch.from_dlpack(x) for x in data["xs"]]
    w, b = torch.from_dlpack(data["w"]), torch.from_dlpack(data["b"])
    it = itertools.cycle(range(len(xs)))
    if shape.K == 1 and shape.H == 1 and shape.W == 1:
        x2 = [x.reshape(shape.B, shape.C) for x in xs]
        x2h = [x.half() for x in x2]
        wt, wth = w.reshape(shape.M, shape.C).t(), w.reshape(shape.M, shape.C).t().half()

        def mm(tf32: bool, half: bool) -> Any:
            def go() -> None:
                torch.backends.cuda.matmul.allow_tf32 = tf32
                i = next(it)
                torch.matmul(x2h[i], wth) if half else torch.matmul(x2[i], wt)
            return go

        return {"cublas-fp32": mm(False, False), "cublas-tf32": mm(True, False),
                "cublas-fp16": mm(False, True)}
    xh = [x.half().to(memory_format=torch.channels_last) for x in xs]
    wh, bh = w.half().to(memory_format=torch.channels_last), b.half()

    def conv(tf32: bool, half: bool) -> Any:
        def go() -> None:
            torch.backends.cudnn.allow_tf32 = tf32
            i = next(it)
            F.conv2d(xh[i], wh, bh) if half else F.conv2d(xs[i], w, b, stride=shape.S)
        return go

    return {"cudnn-fp32": conv(False, False), "cudnn-tf32": conv(True, False),
            "cudnn-fp16-cl": conv(False, True)}


def torch_ms(torch: Any, fn: Any, reps: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return float(np.median(samples))


def layer(cp: Any, torch: Any, label: str, shape: ConvShape, modes: list[str], full: bool,
          reps: int) -> list[dict[str, Any]]:
    w = cp.random.standard_normal(shape.w_shape, dtype=np.float32)
    w *= np.float32(1 / math.sqrt(shape.C * shape.K * shape.K))
    b = cp.random.standard_normal(shape.M, dtype=np.float32)
    data = {"w": w, "b": b, "xs": rotation(cp, shape)}
    data["ref"] = reference(torch, data["xs"][0], w, b, shape)
    rows = []
    base = {"layer": label, "B": shape.B, "shape": str(shape), "gflop": shape.flops / 1e9}
    torch.backends.cudnn.benchmark = True
    for name, fn in anchor_runs(torch, shape, data).items():
        rows.append({**base, "impl": name, "ok": True, "ms": torch_ms(torch, fn, reps)})
    for mode in modes:
        for split in (False, True):
            name = f"igemm-{'splitk-' if split else ''}{mode}"
            for p in configs(mode, split, full and mode != "bf16"):
                rows.append({**base, **measure_impl(cp, name, p, shape, data, reps)})
    del data
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict[str, Any]]) -> None:
    def best(sel: list[dict[str, Any]]) -> dict[str, Any] | None:
        timed = [r for r in sel if r.get("ms")]
        return min(timed, key=lambda r: r["ms"]) if timed else None

    keys = sorted({(r["layer"], r["B"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for lay, bsz in keys:
        sel = [r for r in rows if r["layer"] == lay and r["B"] == bsz]
        gflop = sel[0]["gflop"]
        parts = []
        for r in sel:
            if not r["impl"].startswith("igemm"):
                parts.append(f"{r['impl']} {r['ms']:.4f}")
        for mode in ("3xtf32", "tf32", "fp16", "bf16"):
            r = best([s for s in sel
                      if s["impl"].startswith("igemm") and s["impl"].endswith("-" + mode)])
            if r:
                parts.append(f"{mode} {r['ms']:.4f} ({r['impl'][6:]} {r['params']}, "
                             f"{gflop / r['ms']:.0f} TF/s)")
        bad = [r for r in sel if r["impl"].startswith("igemm") and not r.get("ok")]
        print(f"{lay} B={bsz}: " + "; ".join(parts) + (f"; FAILED {len(bad)}: "
              f"{[(r['impl'], r.get('rel_l2'), r.get('error')) for r in bad][:3]}" if bad else ""))


def precompile(modes: list[str]) -> int:
    """Every tile configuration's kernels, 16 NVRTC compiles at a time (CuPy caches them on
    disk, so later processes load them)."""
    from concurrent.futures import ThreadPoolExecutor

    from convolab.gpu.compile import get_kernel

    jobs = []
    for mode, split in itertools.product(modes, (False, True)):
        impl = get_impl(f"igemm-{'splitk-' if split else ''}{mode}")
        names = (("igemm_conv_splitk", "splitk_reduce") if split else ("igemm_conv",)) + (
            "to_channels_last",)
        jobs += [(impl.kernel_file, n, d) for d in impl.compile_variants() for n in names]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: get_kernel(*j), jobs))
    return len(jobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--modes", default="3xtf32,tf32,fp16,bf16")
    ap.add_argument("--layers", default="conv1_2,conv5_x,fc6,fc7")
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--full", action="store_true", help="every tile configuration")
    ap.add_argument("--tag", default="vgg_igemm", help="name of the JSON file written")
    ap.add_argument("--precompile", action="store_true", help="only compile every variant")
    args = ap.parse_args()
    if args.precompile:
        t0 = time.time()
        print(f"compiled {precompile(args.modes.split(','))} kernels in {time.time() - t0:.0f}s")
        return
    import cupy as cp
    import torch

    rows: list[dict[str, Any]] = []
    t0 = time.time()
    cases = {c.label.split("/")[1]: c for c in vgg_cases(64)}
    for lay, bsz in itertools.product(args.layers.split(","), args.batches.split(",")):
        shape = cases[lay].shape.with_batch(int(bsz))
        rows += layer(cp, torch, lay, shape, args.modes.split(","), args.full, args.reps)
        print(f"[{time.time() - t0:.0f}s] {lay} B={bsz}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.tag}.json").write_text(json.dumps(rows, indent=1))
    summary(rows)


if __name__ == "__main__":
    main()
