"""Rung 29 on the GPU: every zoo model's first block at B images, raw and float input, fp32 and
fp16 output, against the path before it and the memory floor; a block-size sweep; and the whole
FusedLeNet forward with and without rung 29 (shipped weights).

    python3 benchmarks/first_block.py --out DIR          the timings -> DIR/first_block.json
    python3 benchmarks/first_block.py --small            one small launch of each entry
                                                         (for compute-sanitizer)

The path before rung 29, per mode: exact — the FFMA fused rung (fused-conv-pool2's default
kernel), from raw bytes behind rung 25's resize unless the layer runs fcp_exact_cw_raw; fp16 —
the tensor-core fused rung where it takes the shape (else the exact one), raw likewise. The
floor: bytes in + bytes out at the bandwidth of a large device-to-device copy (read + write).
Every timing is the median of CUDA-event samples after a warm-up; every output is poisoned
first and checked against the fp64 reference on its first images.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from convolab import data
from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.models import conv_blocks, load
from convolab.shapes import ConvShape

BATCH = 10_000
WIDE = ("ece408-mxnet", "eecs498")  # the models whose conv1 rung 29 is for
REPS = 30
CHECK_IMAGES = 64  # fp64 reference on this many images
COPY_BYTES = 2 << 30
# Sweep points (0 = the planner's choice): FFMA (threads, minb), tensor cores (warps, minb).
SWEEP = {"fp16": ((8, 0), (4, 2), (4, -11)),  # negative minb: rows = -minb
         "3xfp16": ((2, 0), (8, 0), (4, -11))}


def median_ms(fn: Callable[[], Any], reps: int = REPS) -> float:
    from convolab.timing import time_gpu

    return float(np.median(time_gpu(fn, reps=reps, warmup=3)))


def copy_bandwidth(cp: Any) -> float:
    """Bytes per second moved (read + written) by a large device-to-device copy."""
    src = cp.ones(COPY_BYTES // 4, cp.float32)
    dst = cp.empty_like(src)
    ms = median_ms(lambda: cp.copyto(dst, src), 10)
    return 2 * COPY_BYTES / (ms / 1e3)


class Layer:
    """One model's first block at BATCH images: weights, inputs and the fp64 check."""

    def __init__(self, cp: Any, model: str, rng: np.random.Generator) -> None:
        from convolab.gpu.resize import resize_u8

        block = conv_blocks(model, BATCH)[0]
        self.cp, self.model, self.shape, self.pool = cp, model, block.shape, block.pool
        s = block.shape
        self.w = (rng.standard_normal(s.w_shape) / s.K).astype(np.float32)
        self.b = (0.1 * rng.standard_normal(s.M)).astype(np.float32)
        self.raw = rng.integers(0, 256, (BATCH, data.IMAGE_SIDE, data.IMAGE_SIDE), np.uint8)
        self.raw_d = cp.asarray(self.raw)
        self.x_d = resize_u8(self.raw_d, s.H)  # resize_bilinear's bits (rung 25)
        x64 = data.resize_bilinear(self.raw[:CHECK_IMAGES], s.H)
        self.ref = reference_conv_relu_pool(x64, self.w, self.b, 1, self.pool)
        self.out_shape = (BATCH, s.M, s.H_out // self.pool, s.W_out // self.pool)

    def bytes_moved(self, raw: bool, itemsize: int) -> int:
        s = self.shape
        into = BATCH * (data.IMAGE_SIDE ** 2 if raw else 4 * s.H * s.W)
        return into + itemsize * int(np.prod(self.out_shape))

    def measure(self, name: str, run: Callable[[Any, Any], None], raw: bool,
                dtype: str) -> tuple[dict[str, Any], Any]:
        cp = self.cp
        out = cp.full(self.out_shape, cp.nan, dtype)
        src = self.raw_d if raw else self.x_d
        run(src, out)
        got = out[:CHECK_IMAGES].get()
        row = {"model": self.model, "name": name, "input": "raw" if raw else "float",
               "out": dtype, "rel_l2": rel_l2(got.astype(np.float32), self.ref),
               "finite": bool(np.isfinite(got).all()),
               "ms": median_ms(lambda: run(src, out)),
               "bytes": self.bytes_moved(raw, np.dtype(dtype).itemsize)}
        return row, out


def old_runs(layer: Layer) -> dict[str, tuple[Callable, bool, str]]:
    """The path before rung 29: exact and fp16-mode, raw and float."""
    from convolab.gpu import fused_ffma, fused_mma
    from convolab.gpu.fused import fused_conv_pool_impl
    from convolab.gpu.resize import resize_u8

    s, pool, cp = layer.shape, layer.pool, layer.cp
    w, b = cp.asarray(layer.w), cp.asarray(layer.b)
    resized = cp.empty(s.x_shape, cp.float32)
    runs: dict[str, tuple[Callable, bool, str]] = {}
    for mode, precision in (("exact", "fp32"), ("fp16", "fp16")):
        impl = fused_conv_pool_impl(pool, precision)
        impl = impl if impl.supports(s) else fused_conv_pool_impl(pool, "fp32")
        run = impl.prepare(s, w, b, impl.params_for())
        fused = (fused_ffma.prepare_exact_raw(s, pool, w, b, {}, (28, 28)) if precision == "fp32"
                 else fused_mma.prepare_toe_raw(s, w, b, precision, {}, (28, 28)))

        def behind_resize(raw: Any, y: Any, run: Callable = run) -> None:
            resize_u8(raw, s.H, out=resized)
            run(resized, y)

        runs[f"before, {mode} mode ({impl.name})"] = (run, False, "float32")
        runs[f"before, {mode} mode, raw ({'fused' if fused else 'rung 25 + ' + impl.name})"] = (
            fused or behind_resize, True, "float32")
    return runs


def layer_rows(layer: Layer) -> list[dict[str, Any]]:
    from convolab.gpu import fused_first

    s, pool = layer.shape, layer.pool
    old = old_runs(layer)
    rows = [layer.measure(name, run, raw, dtype)[0] for name, (run, raw, dtype) in old.items()]
    checks: dict[str, Any] = {"model": layer.model, "name": "bit checks"}
    for precision, tc in (("fp32", -1), ("fp16", 1), ("fp16", 2), ("3xfp16", 2)):
        outs: dict[tuple[bool, str], Any] = {}
        for raw in (True, False):
            for dtype in fused_first.OUT_DTYPES:
                run = fused_first.prepare(s, pool, layer.w, layer.b, {"tc": tc},
                                          (28, 28) if raw else None, dtype, precision)
                name = f"rung 29 {precision} {run.plan.kernel_file[:3]}"
                row, outs[raw, dtype] = layer.measure(name, run, raw, dtype)
                rows.append({**row, "plan": run.plan.defines})
        precision = f"{precision}_{tc}"
        f32 = outs[True, "float32"]
        checks[f"{precision}_raw_equals_float"] = bool(
            (f32.view("uint32") == outs[False, "float32"].view("uint32")).all())
        checks[f"{precision}_fp16_is_fp32_rounded"] = bool(
            (outs[True, "float16"].view("uint16") == f32.astype("float16").view("uint16")).all())
        if precision == "fp32_-1":
            ffma = old[next(k for k in old if k.startswith("before, exact mode ("))][0]
            theirs = layer.cp.full(layer.out_shape, layer.cp.nan, "float32")
            ffma(layer.x_d, theirs)
            checks["fp32_equals_ffma_rung_bits"] = bool(
                (theirs.view("uint32") == f32.view("uint32")).all())
        del outs
    return [*rows, checks]


def sweep_rows(layer: Layer) -> list[dict[str, Any]]:
    from convolab.gpu import fused_first

    rows = []
    for precision, points in SWEEP.items():
        for a, minb in points:
            params = ({"threads": a, "minb": minb} if precision == "fp32"
                      else {"warps": a, "minb": minb} if minb >= 0
                      else {"warps": a, "rows": -minb})
            try:
                run = fused_first.prepare(layer.shape, layer.pool, layer.w, layer.b, params,
                                          (28, 28), "float16", precision)
            except ValueError as err:
                rows.append({"model": layer.model, "name": "sweep", "params": params,
                             "error": str(err)})
                continue
            row, _ = layer.measure(f"sweep {precision}", run, True, "float16")
            rows.append({**row, "params": params, "plan": run.plan.defines})
    return rows


def network_rows(cp: Any, model: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The whole forward (shipped weights), device -> device, rung 29 on (default) and off."""
    from convolab.gpu.network import FusedLeNet

    params = load(model).params()
    raw = cp.asarray(rng.integers(0, 256, (BATCH, data.IMAGE_SIDE, data.IMAGE_SIDE), np.uint8))
    size = conv_blocks(model)[0].shape.H
    from convolab.gpu.resize import resize_u8

    floats = resize_u8(raw, size)
    rows = []
    for mode in ("exact", "tf32", "fp16"):
        for first in (1, -1):  # 1: rung 29 wherever it takes the shape
            net = FusedLeNet(params, mode=mode, model=model,
                             kernel_params={"c1": {"first": first}})
            probs = {}
            for kind, x in (("raw", raw), ("float", floats)):
                probs[kind] = net(x)
                rows.append({"model": model, "name": "network", "mode": mode,
                             "rung29": first > 0, "input": kind,
                             "ms": median_ms(lambda net=net, x=x: net(x), 20)})
            rows[-1]["raw_equals_float"] = bool((probs["raw"] == probs["float"]).all())
    return rows


def small_launches() -> None:
    """One launch of each entry and output type at a small odd shape (compute-sanitizer)."""
    import cupy as cp

    from convolab.gpu import fused_first

    rng = np.random.default_rng(0)
    shape = ConvShape(5, 1, 23, 21, 20, 5)
    w = rng.standard_normal(shape.w_shape).astype(np.float32)
    b = rng.standard_normal(shape.M).astype(np.float32)
    raw = rng.integers(0, 256, (5, 17, 30), np.uint8)
    out_shape = (5, shape.M, shape.H_out // 2, shape.W_out // 2)
    x = rng.random(shape.x_shape, dtype=np.float32)
    sq = ConvShape(5, 1, 23, 23, 20, 5)
    ref_raw = reference_conv_relu_pool(data.resize_bilinear(raw, 23), w, b, 1, 2)
    for precision, tc in (("fp32", -1), ("fp16", 1), ("fp16", 2), ("3xfp16", 2)):
        for dtype in fused_first.OUT_DTYPES:
            y = cp.full(out_shape, cp.nan, dtype)
            fused_first.prepare(shape, 2, w, b, {"tc": tc}, None, dtype, precision)(
                cp.asarray(x), y)
            err = rel_l2(y.get().astype(np.float32), reference_conv_relu_pool(x, w, b, 1, 2))
            print(f"small float {precision} {tc} {dtype}: rel_l2 {err:.2e}")
        y = cp.full(out_shape[:2] + (sq.H_out // 2, sq.W_out // 2), cp.nan, "float32")
        fused_first.prepare(sq, 2, w, b, {"tc": tc}, (17, 30), precision=precision)(
            cp.asarray(raw), y)
        print(f"small raw {precision} {tc} float32: rel_l2 {rel_l2(y.get(), ref_raw):.2e}")


def write_json(path: Path, payload: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-network", action="store_true")
    args = parser.parse_args()
    if args.small:
        small_launches()
        return
    import cupy as cp

    from convolab.gpu.device import gpu_name

    rng = np.random.default_rng(29)
    bw = copy_bandwidth(cp)
    result: dict[str, Any] = {"device": gpu_name(), "batch": BATCH, "copy_bytes_per_s": bw,
                              "rows": []}
    print(f"{gpu_name()}: device copy {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    for model in WIDE:
        layer = Layer(cp, model, rng)
        rows = layer_rows(layer) + ([] if args.no_sweep or model not in WIDE
                                    else sweep_rows(layer))
        for row in rows:
            if "bytes" in row:
                row["floor_ms"] = row["bytes"] / bw * 1e3
            print(json.dumps(row), flush=True)
        result["rows"] += rows
        del layer
        cp.get_default_memory_pool().free_all_blocks()
        write_json(args.out / "first_block.json", result)
    if not args.no_network:
        for model in WIDE:
            rows = network_rows(cp, model, rng)
            for row in rows:
                print(json.dumps(row), flush=True)
            result["rows"] += rows
            write_json(args.out / "first_block.json", result)
    print_table(result["rows"])


def print_table(rows: list[dict[str, Any]]) -> None:
    """The timings last, one short line each (the reply carries the end of the output)."""
    for r in rows:
        if "ms" not in r:
            print(r["model"], {k: v for k, v in r.items() if isinstance(v, bool)})
            continue
        what = r.get("params") or r.get("mode", "")
        err = f"{r['rel_l2']:.1e}" if "rel_l2" in r else ""
        print(f"{r['model'][:8]:8} {r['name'][:34]:34} {r['input'][:3]} {r.get('out', '')[-2:]:2}"
              f" {r['ms']:6.3f} {err:7} {what}")


if __name__ == "__main__":
    main()
