"""Device driver for rung 13 and the fused LeNet forward (one call, < 420 s with the .sh).

    python3 benchmarks/device_fused.py --smoke        tiny batches of every kernel (sanitizers)
    python3 benchmarks/device_fused.py --out DIR      timings -> DIR/fused.json, DIR/network.json

Timings: CUDA events around the launches, 3 warm-ups, median and spread of --reps runs,
B=10000 (inputs 296 MB / 256 MB: larger than the 50 MB L2). Every timed configuration is
first checked against fp64 on its first images, output poisoned with NaN.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
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
# Exact-kernel tilings tried besides the default plan (the tuner's space, hand-picked).
SWEEP = {
    "conv1": [{"minb": 4}, {"rpt": 1}, {"pw": 4, "ty": 10, "rpt": 4}],
    "conv2": [{"minb": 2}, {"mg": 2, "minb": 2}],
}
TC_SWEEP = {
    "conv1": [{"warps": 4}, {"warps": 5}, {"warps": 1}],
    "conv2": [{"warps": 4, "minb": 1}, {"warps": 2, "minb": 8}, {"warps": 8, "minb": 2}],
}


def ref_pooled(x: np.ndarray, w: np.ndarray, b: np.ndarray, pool: int) -> np.ndarray:
    """fp64 maxpool(relu(conv + b)): the network module's reference."""
    return gnet.conv_relu_pool_numpy(x, w, b, pool)


def smoke() -> None:
    import cupy as cp

    rng = np.random.default_rng(0)
    cases = [(ConvShape(3, 1, 86, 86, 4, 7), 2), (ConvShape(3, 4, 40, 40, 16, 7), 4),
             (ConvShape(2, 3, 23, 27, 11, 5), 2), (ConvShape(2, 2, 30, 31, 5, 3, 2), 3),
             (ConvShape(2, 3, 30, 31, 5, 3), 9)]
    for shape, pool in cases:
        for prec in fused.PRECISIONS:
            impl = fused.fused_conv_pool_impl(pool, prec)
            if not impl.supports(shape) or (prec != "fp32" and fused.tc_kind(shape, pool) is None):
                continue
            x = rng.random(shape.x_shape, dtype=np.float32)
            w = rng.standard_normal(shape.w_shape).astype(np.float32)
            b = rng.standard_normal(shape.M).astype(np.float32)
            run = impl.prepare(shape, cp.asarray(w), cp.asarray(b), impl.params_for())
            y = cp.empty(impl.out_shape(shape), cp.float32)
            poison(y)
            run(cp.asarray(x), y)
            err = rel_l2(y, ref_pooled(x, w, b, pool) if shape.S == 1 else y)
            print(f"smoke {impl.name:24s} {shape} err {err:.2e}")
    params = gnet.random_params(1)
    x = rng.random((5, 1, 86, 86), dtype=np.float32)
    for mode in gnet.MODES:
        net = gnet.FusedLeNet(params, mode)
        p = net(cp.asarray(x)).get()
        q = net.forward_chunks(x, chunk=2, streams=2)
        print(f"smoke FusedLeNet {mode}: max|single-chunked| {np.abs(p - q).max():.2e}")
    cp.cuda.Device().synchronize()


def time_layer(impl: Any, shape: ConvShape, params: dict[str, int], x: Any, w: np.ndarray,
               b: np.ndarray, reps: int) -> dict[str, Any]:
    import cupy as cp

    from convolab.timing import Stats, time_gpu

    run = impl.prepare(shape, cp.asarray(w), cp.asarray(b), impl.params_for(params))
    y = cp.empty(impl.out_shape(shape), cp.float32)
    poison(y)
    run(x, y)
    n = 16
    err = rel_l2(y[:n], ref_pooled(x[:n].get(), w, b, impl.pool))
    st = Stats.of(time_gpu(lambda: run(x, y), reps=reps, warmup=3))
    useful = 2 * shape.B * shape.M * (impl.out_shape(shape)[2] * impl.pool) * (
        impl.out_shape(shape)[3] * impl.pool) * shape.C * shape.K ** 2
    row = {"impl": impl.name, "params": params, "rel_l2": err, **st.as_dict(),
           "gflops_nominal": shape.flops / st.median_ms / 1e6,
           "gflops_computed": useful / st.median_ms / 1e6}
    if impl.name.endswith(("2", "4")):
        plan = fused.exact_plan(shape, impl.pool, impl.params_for(params))
        row["defines"] = plan.defines if plan else None
    return row


def bench(out: Path, reps: int) -> None:
    import cupy as cp

    dev = cp.cuda.runtime.getDeviceProperties(0)
    result: dict[str, Any] = {
        "device": dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"],
        "date": datetime.date.today().isoformat(), "reps": reps, "layers": {},
    }
    rng = np.random.default_rng(0)

    def save() -> None:
        (out / "fused.json").write_text(json.dumps(result, indent=1, default=str))

    for layer, (shape, pool) in LAYERS.items():
        x = cp.asarray(rng.random(shape.x_shape, dtype=np.float32))
        w = (rng.standard_normal(shape.w_shape) * 0.2).astype(np.float32)
        b = (rng.standard_normal(shape.M) * 0.1).astype(np.float32)
        rows = []
        configs = ([("fp32", {})] + [("fp32", p) for p in SWEEP[layer]]
                   + [("fp16", {}), ("tf32", {})] + [("fp16", p) for p in TC_SWEEP[layer]])
        for prec, params in configs:
            impl = fused.fused_conv_pool_impl(pool, prec)
            try:
                row = time_layer(impl, shape, params, x, w, b, reps)
            except Exception as err:
                row = {"impl": impl.name, "params": params, "error": repr(err)[:400]}
            rows.append(row)
            print(layer, json.dumps({k: row.get(k) for k in
                                     ("impl", "params", "rel_l2", "median_ms", "spread_pct",
                                      "gflops_computed", "error")}), flush=True)
        result["layers"][layer] = rows
        save()
        del x

    t0 = time.perf_counter()
    rows = gnet.bench_network(batch=10000, reps=reps)
    for r in rows:
        print("network", json.dumps({k: r.get(k) for k in ("name", "median_ms", "spread_pct",
              "speedup_vs_torch_eager_fp32", "argmax_agree_vs_exact", "error")}), flush=True)
    (out / "network.json").write_text(json.dumps(
        {"device": result["device"], "date": result["date"], "batch": 10000, "rows": rows},
        indent=1, default=str))
    result["network"] = rows
    result["network_bench_s"] = time.perf_counter() - t0
    save()

    # Host-to-host streaming: a batch far larger than one chunk, from ordinary host memory.
    n = 200_000
    block = rng.random((1000, 1, 86, 86), dtype=np.float32)
    xs = np.tile(block, (n // 1000, 1, 1, 1))
    params = gnet.random_params(0)
    stream_rows = []
    for mode in ("exact", "fp16"):
        net = gnet.FusedLeNet(params, mode)
        ref = net(cp.asarray(block)).get()
        for chunk, streams in ((16384, 2), (16384, 3), (32768, 2)):
            probs, rate = net.throughput(xs, chunk=chunk, streams=streams)
            same = bool(np.array_equal(probs[:1000], ref) and np.array_equal(probs[-1000:], ref))
            stream_rows.append({"mode": mode, "images": n, "chunk": chunk, "streams": streams,
                                "images_per_s": rate, "matches_single_shot": same})
            print("stream", stream_rows[-1], flush=True)
    # the PCIe ceiling for the same bytes: pinned host -> device copy of one chunk
    pinned = gnet._pinned(cp, (16384, 1, 86, 86))
    dst = cp.empty(pinned.shape, cp.float32)
    from convolab.timing import Stats, time_gpu

    h2d = Stats.of(time_gpu(lambda: dst.set(pinned), reps=10, warmup=2))
    result["h2d_chunk_16384_ms"] = h2d.as_dict()
    result["h2d_images_per_s"] = 16384 / (h2d.median_ms / 1e3)
    result["streaming"] = stream_rows
    save()

    # Real data: accuracy of every mode against the fp64 NumPy forward (identical argmax).
    try:
        from convolab import data, models

        try:
            params = {k: np.asarray(v) for k, v in models.load("ece408").params().items()}
            weights = "shipped ece408 weights"
        except Exception as err:
            params, weights = gnet.random_params(0), f"random (no trained weights: {err})"
        images, labels = data.load_images("test", n=10000)
        n_ref = 2000  # the fp64 NumPy forward is slow: compare on the first 2000 images
        t_ref = time.perf_counter()
        ref = gnet.numpy_forward(params, images[:n_ref])
        print(f"fp64 NumPy forward of {n_ref} images: {time.perf_counter() - t_ref:.1f} s")
        acc = {"weights": weights, "n_ref": n_ref,
               f"fp64_numpy_first{n_ref}": float((ref.argmax(1) == labels[:n_ref]).mean())}
        for mode in gnet.MODES:
            p = gnet.FusedLeNet(params, mode).forward_chunks(images)
            acc[mode] = float((p.argmax(1) == labels).mean())
            acc[f"{mode}_first{n_ref}"] = float((p[:n_ref].argmax(1) == labels[:n_ref]).mean())
            acc[f"{mode}_argmax_differs_from_fp64"] = int(
                (p[:n_ref].argmax(1) != ref.argmax(1)).sum())
            acc[f"{mode}_rel_l2_vs_fp64"] = rel_l2(p[:n_ref], ref)
        result["test_set"] = acc
        print("test set", acc, flush=True)
    except Exception as err:
        result["test_set"] = {"error": repr(err)[:400]}
        traceback.print_exc()
    save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    bench(args.out, args.reps)


if __name__ == "__main__":
    main()
