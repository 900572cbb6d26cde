"""Device check and timings of the fused LeNet's fp16 channels-last path (gpu/tc_cl.py).

    PYTHONPATH=src python3 benchmarks/device_tc_cl.py --out DIR   checks + timings -> DIR/tc_cl.json
    PYTHONPATH=src python3 benchmarks/device_tc_cl.py --smoke     tiny batches (for sanitizers)

First correctness (fresh random inputs, outputs NaN-poisoned, fp64 NumPy answers): every conv1
and conv2 variant at a small batch, then every timed configuration again on the first images
of its B=10000 output. Then B=10000 timings (CUDA events, 3 warm-ups, median of --reps):
conv1 tc with fp32 NCHW vs fp16 channels-last output, conv2 fcp_mma_wa vs fcp_mma_cl, tuning
variants, the head, and the whole fp16 forward before/after (plus the fastest measured pair).

Predictions, written before the first run (H100, B = 10000; today 0.26 + 0.37 + 0.08 = 0.71):
  * conv1 CL output: 0.26 -> ~0.22 ms. 128 MB fewer bytes written (0.04 ms at 3 TB/s) and
    one 8-byte store per pooled pixel instead of four scattered 4-byte ones. TC_TPH 40
    (a block per image, input staged once) within +-5 %; warps 1/4 no better than 2.
  * conv2 fcp_mma_cl: 0.37 -> ~0.18 ms. It reads 122 MB (fp16, only the 38 needed rows)
    instead of 244 MB of fp32 plus the L1 re-reads of the shifted copy, with no convert and
    no shared stores from registers; what is left is the ~0.15 ms of mma.sync and the
    LDS that feed it. KORDER 1 (one LDS.64 per fragment) ~5-10 % faster than KORDER 0 (two
    LDS.32); nv 2 (one fragment load per 2.2 mma instead of 1.6) ~5 % faster than nv 1, nv 4
    no better (131 registers: 3 blocks an SM); split staging within +-3 %; minb 6 (80
    registers, 6 blocks an SM) a few % better than no cap (90 registers, 5 blocks).
  * whole fp16 forward: 0.71 -> ~0.48 ms (target 0.60), head + gaps unchanged at ~0.08.
Run 1 (same day): conv1 0.261 -> 0.250 (tph 40: 0.246); conv2 0.374 -> 0.196 (nv 2 + 2 warps
0.186; korder 0 +6 %, register caps +5 %, 8 warps +22 %); head alone 0.098; forward 0.722 ->
0.538, 0.503 with tph 40 + nv 2/2 warps (now the defaults). Run 2 predictions: defaults
reproduce 0.50 +-0.01; head with 16 images a block (625 blocks instead of 313 on 132 SMs)
~0.07 instead of ~0.10 ms.
Run 2: forward 0.719 (old) -> 0.501 ms (b2b 0.490) with the defaults, as predicted; conv2
0.374 -> 0.181; head 16 images a block 0.109 and 64 0.185 vs 0.100 with 32: the prediction
was wrong (per-block k-loop and barriers, not the block count, set the head's time), 32 stays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from convolab.check import rel_l2  # noqa: E402
from convolab.gpu import fused, tc_cl  # noqa: E402
from convolab.gpu import network as gnet  # noqa: E402
from convolab.shapes import ConvShape  # noqa: E402

BATCH = 10000
C1, C3 = ConvShape(BATCH, 1, 86, 86, 4, 7), ConvShape(BATCH, 4, 40, 40, 16, 7)
C1_VARIANTS: list[dict[str, int]] = [
    {}, {"tph": 0}, {"tph": 40, "warps": 1}, {"tph": 40, "warps": 4}, {"tph": 0, "warps": 1},
]
C3_VARIANTS: list[dict[str, int]] = [
    {}, {"nv": 1, "warps": 4}, {"split": 1}, {"nv": 4}, {"warps": 1}, {"nv": 4, "warps": 1},
    {"warps": 4}, {"korder": 0}, {"warps": 4, "split": 1}, {"nv": 1, "warps": 2},
]
HEAD_IMGS = [16, 32]  # kernels/15 since its persistent version (16 = default)
WA_VARIANTS: list[dict[str, int]] = [{}]  # rung 13's measured default (4 warps, minb 4)
N_CHECK = 16  # images of each B=10000 output checked against fp64


def ref_pool(x: np.ndarray, w: np.ndarray, b: np.ndarray, pool: int) -> np.ndarray:
    return gnet.conv_relu_pool_numpy(np.asarray(x, np.float64), np.asarray(w, np.float64), b,
                                     pool)


def r16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float64)


def nan_buffer(cp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    y = cp.empty(shape, dtype)
    y.fill(np.nan)
    return y


def stats(fn: Any, reps: int) -> dict[str, float]:
    from convolab.timing import Stats, time_gpu

    return Stats.of(time_gpu(fn, reps=reps, warmup=3)).as_dict()


def kernel_attrs(kernel: Any) -> dict[str, Any]:
    try:
        return {"regs": int(kernel.num_regs), "local_bytes": int(kernel.local_size_bytes),
                "smem_bytes": int(kernel.shared_size_bytes)}
    except Exception as err:  # attribute names differ across CuPy versions
        return {"attrs_error": repr(err)[:200]}


def small_checks(cp: Any, rng: np.random.Generator, params: dict[str, np.ndarray],
                 batches: tuple[int, ...] = (1, 6), c1_variants: list | None = None,
                 c3_variants: list | None = None) -> dict:
    """Every variant at small batches against fp64, poisoned outputs."""
    from convolab.gpu.compile import get_kernel

    out: dict[str, Any] = {"conv1_cl": [], "conv2_cl": [], "ok": True}
    for batch in batches:
        s1 = C1.with_batch(batch)
        x = rng.random(s1.x_shape, dtype=np.float32)
        w1, b1 = params["c1.weight"], params["c1.bias"]
        want16, want = ref_pool(r16(x), r16(w1), b1, 2), ref_pool(x, w1, b1, 2)
        for p in C1_VARIANTS if c1_variants is None else c1_variants:
            try:
                y = nan_buffer(cp, (batch, 40, 40, 4), cp.float16)
                tc_cl.prepare_conv1_cl(s1, w1, b1, p)(cp.asarray(x), y)
                got = y.get().astype(np.float64).transpose(0, 3, 1, 2)
                e16, e = rel_l2(got, want16), rel_l2(got, want)
                row = {"batch": batch, "params": p, "err_vs_rounded": e16, "err_vs_fp64": e,
                       "ok": e16 <= 1e-3 and e <= 1e-2}
            except Exception as err:
                row = {"batch": batch, "params": p, "error": repr(err)[:300], "ok": False}
            out["ok"] &= row["ok"]
            out["conv1_cl"].append(row)
        s3 = C3.with_batch(batch)
        xc = np.abs(rng.standard_normal((batch, 40, 40, 4))).astype(np.float16)
        w3, b3 = params["c3.weight"], params["c3.bias"]
        xn = xc.astype(np.float64).transpose(0, 3, 1, 2)
        want16, want = ref_pool(xn, r16(w3), b3, 4), ref_pool(xn, w3, b3, 4)
        for p in C3_VARIANTS if c3_variants is None else c3_variants:
            try:
                y = nan_buffer(cp, (batch, 16, 8, 8), cp.float32)
                tc_cl.prepare_conv2_cl(s3, w3, b3, p)(cp.asarray(xc), y)
                e16, e = rel_l2(y, want16), rel_l2(y, want)
                row = {"batch": batch, "params": p, "err_vs_rounded": e16, "err_vs_fp64": e,
                       "ok": e16 <= 1e-5 and e <= 1e-2}
                if batch == batches[0]:
                    row.update(kernel_attrs(get_kernel(tc_cl.KERNEL_FILE, "fcp_mma_cl",
                                                       tc_cl.cl_plan(s3, p).defines)))
            except Exception as err:
                row = {"batch": batch, "params": p, "error": repr(err)[:300], "ok": False}
            out["ok"] &= row["ok"]
            out["conv2_cl"].append(row)
    for key in ("conv1_cl", "conv2_cl"):
        bad = [r for r in out[key] if not r["ok"]]
        print(f"check {key}: {len(out[key]) - len(bad)}/{len(out[key])} ok"
              + (f"  FAILED {str(bad)[:1500]}" if bad else ""), flush=True)
    regs = {str(r["params"]): r.get("regs") for r in out["conv2_cl"] if "regs" in r}
    print(f"fcp_mma_cl registers: {regs}", flush=True)
    return out


def network_check(cp: Any, rng: np.random.Generator, params: dict[str, np.ndarray],
                  batch: int) -> dict[str, Any]:
    x = rng.random((batch, 1, 86, 86), dtype=np.float32)
    ref = gnet.numpy_forward(params, x)
    new = gnet.FusedLeNet(params, "fp16")(cp.asarray(x)).get()
    old = gnet.FusedLeNet(params, "fp16", fp16_layout="nchw")(cp.asarray(x)).get()
    row = {"batch": batch, "rel_l2_new": rel_l2(new, ref), "rel_l2_old": rel_l2(old, ref),
           "max_abs_diff_new": float(np.abs(new - ref).max()),
           "argmax_agree_new": float((new.argmax(1) == ref.argmax(1)).mean()),
           "argmax_agree_old": float((old.argmax(1) == ref.argmax(1)).mean()),
           "max_abs_new_vs_old": float(np.abs(new - old).max())}
    row["ok"] = bool(row["rel_l2_new"] <= 1e-2 and row["max_abs_new_vs_old"] <= 1e-4)
    print("check network", json.dumps(row), flush=True)
    return row


def bench(out_dir: Path, reps: int) -> None:
    import cupy as cp

    dev = cp.cuda.runtime.getDeviceProperties(0)
    seed = int(np.random.SeedSequence().entropy % (2**32))
    rng = np.random.default_rng(seed)
    params = gnet.random_params(int(rng.integers(1 << 30)))
    result: dict[str, Any] = {
        "device": dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"],
        "date": datetime.date.today().isoformat(), "batch": BATCH, "reps": reps, "seed": seed,
        "timing": "CUDA events, 3 warm-ups, median of reps",
    }

    def save() -> None:
        (out_dir / "tc_cl.json").write_text(json.dumps(result, indent=1, default=str))

    t0 = time.perf_counter()
    result["checks"] = small_checks(cp, rng, params)
    result["checks"]["network"] = [network_check(cp, rng, params, n) for n in (1, 7, 257)]
    result["checks_s"] = time.perf_counter() - t0
    save()

    w1, b1, w3, b3 = (params[k] for k in ("c1.weight", "c1.bias", "c3.weight", "c3.bias"))
    x_h = rng.random((BATCH, 1, 86, 86), dtype=np.float32)
    x = cp.asarray(x_h)
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"{row['layer']:8s} {row['name']:44s} {row.get('median_ms', float('nan')):7.4f} ms"
              f"  spread {row.get('spread_pct', float('nan')):4.1f} %  err {row.get('err', 0):.1e}"
              + (f"  {row['error']}" if "error" in row else ""), flush=True)
        result["rows"] = rows
        save()

    # conv1: NCHW fp32 out (rung 13 tc) vs fp16 channels-last out
    want1 = ref_pool(x_h[:N_CHECK], w1, b1, 2)
    a1_nchw = nan_buffer(cp, (BATCH, 4, 40, 40), cp.float32)
    run = fused.fused_conv_pool_impl(2, "fp16").prepare(C1, cp.asarray(w1), cp.asarray(b1), {})
    run(x, a1_nchw)
    record({"layer": "conv1", "name": "tc fp32 NCHW out (rung 13)", "params": {},
            "err": rel_l2(a1_nchw[:N_CHECK], want1), **stats(lambda: run(x, a1_nchw), reps)})
    a1_cl = nan_buffer(cp, (BATCH, 40, 40, 4), cp.float16)
    c1_best: tuple[float, dict[str, int]] = (float("inf"), {})
    for p in C1_VARIANTS:
        try:
            run = tc_cl.prepare_conv1_cl(C1, w1, b1, p)
            y = nan_buffer(cp, (BATCH, 40, 40, 4), cp.float16)
            run(x, y)
            got = y[:N_CHECK].get().astype(np.float64).transpose(0, 3, 1, 2)
            err = rel_l2(got, want1)
            st = stats(lambda run=run, y=y: run(x, y), reps)
            record({"layer": "conv1", "name": f"tc fp16 CL out {p or 'default'}", "params": p,
                    "err": err, **st})
            if err <= 1e-2 and st["median_ms"] < c1_best[0]:
                c1_best = (st["median_ms"], p)
            if not p:
                a1_cl = y
        except Exception as err:  # one broken variant must not sink the others
            record({"layer": "conv1", "name": f"tc fp16 CL out {p}", "params": p,
                    "error": repr(err)[:300]})
    # conv2: rung 13 fcp_mma_wa on the fp32 NCHW map vs fcp_mma_cl on the fp16 CL map
    a1n = a1_nchw[:N_CHECK].get().astype(np.float64)
    a1c = a1_cl[:N_CHECK].get().astype(np.float64).transpose(0, 3, 1, 2)
    feats = nan_buffer(cp, (BATCH, 16, 8, 8), cp.float32)
    for p in WA_VARIANTS:
        run = fused.fused_conv_pool_impl(4, "fp16").prepare(C3, cp.asarray(w3), cp.asarray(b3), p)
        run(a1_nchw, feats)
        record({"layer": "conv2", "name": f"wa on fp32 NCHW (rung 13) {p or 'default'}",
                "params": p, "err": rel_l2(feats[:N_CHECK], ref_pool(r16(a1n), r16(w3), b3, 4)),
                **stats(lambda run=run: run(a1_nchw, feats), reps)})
    want3 = ref_pool(a1c, r16(w3), b3, 4)  # the CL map is fp16 already: exact up to fp32 sums
    c3_best: tuple[float, dict[str, int]] = (float("inf"), {})
    for p in C3_VARIANTS:
        try:
            run = tc_cl.prepare_conv2_cl(C3, w3, b3, p)
            y = nan_buffer(cp, (BATCH, 16, 8, 8), cp.float32)
            run(a1_cl, y)
            err = rel_l2(y[:N_CHECK], want3)
            st = stats(lambda run=run, y=y: run(a1_cl, y), reps)
            record({"layer": "conv2", "name": f"cl {p or 'default'}", "params": p, "err": err,
                    **st})
            if err <= 1e-5 and st["median_ms"] < c3_best[0]:
                c3_best = (st["median_ms"], p)
        except Exception as err:
            record({"layer": "conv2", "name": f"cl {p}", "params": p, "error": repr(err)[:300]})

    # the head alone (images per block), and the whole forward before / after
    head_best: tuple[float, int] = (float("inf"), 16)
    for imgs in HEAD_IMGS:
        net = gnet.FusedLeNet(params, "fp16", kernel_params={"head": {"imgs": imgs}})
        probs = nan_buffer(cp, (BATCH, 10), cp.float32)
        net.forward_into(x, probs)
        _, _, _, a3 = net._plan(BATCH)
        p = net.params

        def head(net: Any = net, a3: Any = a3, p: Any = p, probs: Any = probs) -> None:
            net._head(a3, net._w5t, p["f5.bias"], p["f6.weight"], p["f6.bias"], probs)

        st = stats(head, reps)
        record({"layer": "head", "name": f"lenet_head (kernels/15) HEAD_IMGS={imgs}",
                "params": {"imgs": imgs}, **st})
        if st["median_ms"] < head_best[0]:
            head_best = (st["median_ms"], imgs)
    n_ref = 200
    ref = gnet.numpy_forward(params, x_h[:n_ref])
    run1_defaults = {"c1": {"tph": 0}, "c3": {"nv": 1, "warps": 4}}
    forwards = [("fp16 old: rung-13 pair, fp32 NCHW map", "nchw", {}),
                ("fp16 CL, run-1 defaults (c1 tph 20, c3 nv 1 warps 4)", "cl", run1_defaults),
                ("fp16 CL, defaults", "cl", {}),
                ("fp16 CL, defaults + head 32 imgs/tile", "cl", {"head": {"imgs": 32}})]
    fastest = {"c1": c1_best[1], "c3": c3_best[1], "head": {"imgs": head_best[1]}}
    result["fastest"] = fastest
    if c1_best[1] or c3_best[1]:
        forwards.append((f"fp16 CL, fastest measured {fastest}", "cl", fastest))
    for name, layout, kernel_params in forwards:
        net = gnet.FusedLeNet(params, "fp16", fp16_layout=layout, kernel_params=kernel_params)
        probs = nan_buffer(cp, (BATCH, 10), cp.float32)
        net.forward_into(x, probs)
        got = probs[:n_ref].get()
        row = {"layer": "forward", "name": name, "layout": layout,
               "kernel_params": kernel_params, "err": rel_l2(got, ref),
               "max_abs_prob_diff": float(np.abs(got - ref).max()),
               "argmax_agree": float((got.argmax(1) == ref.argmax(1)).mean()),
               "all_finite": bool(cp.isfinite(probs).all()),
               **stats(lambda net=net, probs=probs: net.forward_into(x, probs), reps)}
        row["back_to_back_ms"] = gnet._back_to_back(
            lambda net=net, probs=probs: net.forward_into(x, probs), reps)
        record(row)
    result["total_s"] = time.perf_counter() - t0
    save()
    print("\nsummary (ms, B=10000):")
    for r in rows:
        extra = f"  b2b {r['back_to_back_ms']:.4f}" if "back_to_back_ms" in r else ""
        ms = r.get("median_ms", float("nan"))
        print(f"  {r['layer']:8s} {r['name'][:72]:72s} {ms:.4f}{extra}")
    ok = result["checks"]["ok"] and all(c["ok"] for c in result["checks"]["network"])
    print(f"checks ok: {ok}; total {result['total_s']:.0f} s")


def smoke() -> None:
    """Every kernel of the path at tiny batches, for compute-sanitizer."""
    import cupy as cp

    rng = np.random.default_rng(0)
    params = gnet.random_params(1)
    checks = small_checks(cp, rng, params, batches=(2,), c1_variants=[{}, {"tph": 0}],
                          c3_variants=[{}, {"nv": 1, "korder": 0}, {"split": 1, "nv": 4}])
    x = rng.random((3, 1, 86, 86), dtype=np.float32)
    p = gnet.FusedLeNet(params, "fp16")(cp.asarray(x)).get()
    print(f"smoke ok {checks['ok']}, forward finite {bool(np.isfinite(p).all())}")
    cp.cuda.Device().synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/convolab-tc-cl"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    bench(args.out, args.reps)


if __name__ == "__main__":
    main()
