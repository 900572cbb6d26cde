"""Device check + timing of the LeNet head kernel (kernels/15 `lenet_head`: F5 + ReLU, F6,
softmax): the working tree's kernel in several define sets against the earlier versions kept
in benchmarks/head_candidates/ and CuPy/cuBLAS as a yardstick. One call, ~40 s.

    PYTHONPATH=src python3 benchmarks/device_head.py --out DIR [--network] [extra.cu ...]

Every candidate first runs on fresh random data for B in 1, 31, 33, 1000, 9999, 10000 with its
output (and 16 sentinel rows past B) poisoned with NaN, compared with an fp64 NumPy reference;
then it is timed at B=10000 with CUDA events (3 warm-ups, median of --reps): "hot" back to back
(the 41 MB of features mostly stay in the 50 MB L2, as after conv2 in the network) and "cold"
with a 128 MB write between launches (features from HBM). Extra .cu files on the command line
are launched like v2 (ceil(B / 32) blocks of 256 threads). --network adds the FusedLeNet
forward (fp16 and exact) at B=10000 with the working tree's default head.

Prediction (v4, persistent, weights in shared memory): 0.02-0.03 ms hot, bound by the FMA
issue rate (~0.013 ms at 1.75 GHz) and the feature stream (~0.014 ms at ~3 TB/s).
Measured (H100, results/head_h100_2026-11-23.json): v4 default 0.035 ms hot / 0.032 cold,
v2 0.092 / 0.094, v3 0.082 / 0.091, cuBLAS F5 matmul alone 0.063 / 0.051.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from convolab.gpu import network as gnet  # noqa: E402
from convolab.gpu.compile import cuda_include_dirs, define_flags, kernel_path  # noqa: E402
from convolab.timing import Stats  # noqa: E402

HERE = Path(__file__).resolve().parent
BATCHES = (1, 31, 33, 1000, 9999, 10000)
BENCH_B = 10000
SENTINEL = 16  # rows past B that must stay NaN
TOL = 1e-5  # max abs probability error vs fp64 (as tests/test_gpu_fused.py; fp32 sums of
#             1024 products give ~1e-6 at unit-scale features, ~3e-6 at the 3x rows)

# (name, source, defines, geometry): "v2" = ceil(B / 32) blocks of 256 threads, static smem;
# "v4" = persistent, gnet.head_grid / head_smem_bytes.
V4 = [dict(gnet.HEAD_VARIANTS[16]), dict(gnet.HEAD_VARIANTS[32]),
      {"HEAD_IMGS": 16, "HEAD_LO": 4, "HEAD_KC": 16, "HEAD_NS": 4, "HEAD_RB": 2},
      {"HEAD_IMGS": 16, "HEAD_LO": 4, "HEAD_KC": 16, "HEAD_NS": 6, "HEAD_RB": 2},
      {"HEAD_IMGS": 16, "HEAD_LO": 4, "HEAD_KC": 32, "HEAD_NS": 2, "HEAD_RB": 2},
      {"HEAD_IMGS": 16, "HEAD_LO": 8, "HEAD_KC": 32, "HEAD_NS": 3, "HEAD_RB": 2},
      {"HEAD_IMGS": 8, "HEAD_LO": 4, "HEAD_KC": 32, "HEAD_NS": 6, "HEAD_RB": 2},
      {"HEAD_IMGS": 32, "HEAD_LO": 8, "HEAD_KC": 16, "HEAD_NS": 3, "HEAD_RB": 1},
      {"HEAD_IMGS": 16, "HEAD_LO": 4, "HEAD_KC": 32, "HEAD_NS": 4, "HEAD_RB": 1},
      {"HEAD_IMGS": 16, "HEAD_LO": 4, "HEAD_KC": 16, "HEAD_NS": 8, "HEAD_RB": 1}]


def v4_name(d: dict[str, int]) -> str:
    return (f"v4 i{d['HEAD_IMGS']} lo{d['HEAD_LO']} kc{d['HEAD_KC']} ns{d['HEAD_NS']} "
            f"rb{d['HEAD_RB']}")


def candidates(extra: list[Path]) -> list[tuple[str, Path, dict[str, int], str]]:
    rows = [("v2 (committed 78272ff)", HERE / "head_candidates" / "v2_shared_tiles.cu", {}, "v2"),
            ("v3 lane=image", HERE / "head_candidates" / "v3_lane_image.cu", {}, "v2")]
    rows += [(v4_name(d), kernel_path(gnet.HEAD_KERNEL_FILE), d, "v4") for d in V4]
    rows += [(p.stem, p, {}, "v2") for p in extra]
    return rows


def reference(feat: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    f = {k: v.astype(np.float64) for k, v in p.items()}
    h = np.maximum(feat.astype(np.float64) @ f["w5"].T + f["b5"], 0)
    z = h @ f["w6"].T + f["b6"]
    z = np.exp(z - z.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def time_launches(cp: Any, fn: Callable[[], None], reps: int, flush: Any | None) -> Stats:
    """CUDA events around fn only; flush (a big buffer) is overwritten before each launch."""
    for _ in range(3):
        fn()
    cp.cuda.get_current_stream().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(reps):
        if flush is not None:
            flush.fill(1)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop))
    return Stats.of(samples)


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--network", action="store_true")
    ap.add_argument("--network-only", action="store_true")
    args = ap.parse_args()
    if os.environ.get("CUPY_TF32", "0") != "0":
        raise SystemExit("CUPY_TF32 is set: the cuBLAS yardstick must be plain fp32")
    rng = np.random.default_rng()
    p = {"w5": (rng.standard_normal((32, 1024)) * 0.05).astype(np.float32),
         "b5": (rng.standard_normal(32) * 0.1).astype(np.float32),
         "w6": (rng.standard_normal((10, 32)) * 0.3).astype(np.float32),
         "b6": (rng.standard_normal(10) * 0.1).astype(np.float32)}
    d = {k: cp.asarray(v) for k, v in p.items()}
    w5t = cp.ascontiguousarray(d["w5"].T)
    n_sm = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    data = {}
    for b in BATCHES:
        feat = np.abs(rng.standard_normal((b, 1024))).astype(np.float32)
        feat[: b // 3] *= 3  # some larger logits: the softmax's max subtraction matters
        data[b] = (cp.asarray(feat), reference(feat, p))
    flush = cp.empty(32 * 1024 * 1024, cp.float32)  # 128 MB > the 50 MB L2
    opts = ("-std=c++17", *(f"-I{i}" for i in cuda_include_dirs()))
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    doc: dict[str, Any] = {"device": device, "batch": BENCH_B, "sms": n_sm, "tol": TOL,
                           "rows": [], "network": []}

    def save() -> None:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "head.json").write_text(json.dumps(doc, indent=1))

    rows = [] if args.network_only else candidates(args.sources)
    for name, path, defines, geometry in rows:
        row: dict[str, Any] = {"name": name, "source": path.name, "defines": defines}
        try:
            t0 = time.perf_counter()
            mod = cp.RawModule(code=path.read_text(), options=(*opts, *define_flags(defines)))
            kern = mod.get_function("lenet_head")
            smem = gnet.head_smem_bytes(defines) if geometry == "v4" else 0
            if smem:
                kern.max_dynamic_shared_size_bytes = smem
            row.update(regs=int(kern.num_regs), local_bytes=int(kern.local_size_bytes),
                       static_smem=int(kern.shared_size_bytes), dynamic_smem=smem,
                       compile_s=round(time.perf_counter() - t0, 2))

            def launch(fd: Any, probs: Any, b: int, kern: Any = kern, smem: int = smem,
                       geometry: str = geometry, defines: dict = defines) -> None:
                grid = gnet.head_grid(b, defines, n_sm) if geometry == "v4" else -(-b // 32)
                kern((grid,), (256,), (fd, w5t, d["b5"], d["w6"], d["b6"], probs, np.int32(b)),
                     shared_mem=smem)

            errs, ok = {}, True
            for b, (fd, ref) in data.items():
                probs = cp.full((b + SENTINEL, 10), cp.nan, cp.float32)
                launch(fd, probs, b)
                got = probs.get().astype(np.float64)
                err = float(np.abs(got[:b] - ref).max())
                errs[str(b)] = err
                ok &= bool(np.isfinite(got[:b]).all() and err <= TOL
                           and np.isnan(got[b:]).all())
            fd = data[BENCH_B][0]
            probs = cp.empty((BENCH_B, 10), cp.float32)
            launch(fd, probs, BENCH_B)
            again = cp.empty_like(probs)
            launch(fd, again, BENCH_B)
            row["deterministic"] = bool((probs == again).all())
            def bench(launch: Callable = launch, fd: Any = fd, probs: Any = probs) -> None:
                launch(fd, probs, BENCH_B)

            hot = time_launches(cp, bench, args.reps, None)
            cold = time_launches(cp, bench, args.reps, flush)
            row.update(ok=ok, max_abs_err=errs, hot=hot.as_dict(), cold=cold.as_dict())
            print(f"{name:28s} ok={ok!s:5s} err={max(errs.values()):.1e} regs={row['regs']:3d} "
                  f"hot {hot.median_ms:.4f} ms ({hot.spread_pct:.0f}%) "
                  f"cold {cold.median_ms:.4f} ms ({cold.spread_pct:.0f}%)", flush=True)
        except Exception as err:  # one broken candidate must not cost the others
            row["error"] = f"{type(err).__name__}: {err}"[:800]
            print(f"{name:28s} ERROR {row['error']}", flush=True)
        doc["rows"].append(row)
        save()

    if not args.network_only:  # yardstick: cuBLAS F5 (fp32, TF32 off), CuPy for the rest
        fd, ref = data[BENCH_B]

        def cupy_head() -> Any:
            h = cp.maximum(fd @ w5t + d["b5"], 0)
            z = h @ d["w6"].T + d["b6"]
            z = cp.exp(z - z.max(axis=1, keepdims=True))
            return z / z.sum(axis=1, keepdims=True)

        err = float(np.abs(cupy_head().get() - ref).max())
        for name, fn in (("cuBLAS F5 matmul only", lambda: fd @ w5t),
                         ("CuPy head (cuBLAS F5 + 8 kernels)", cupy_head)):
            hot = time_launches(cp, fn, args.reps, None)
            cold = time_launches(cp, fn, args.reps, flush)
            doc["rows"].append({"name": name, "hot": hot.as_dict(), "cold": cold.as_dict(),
                                "max_abs_err": {str(BENCH_B): err}})
            print(f"{name:28s} err={err:.1e} hot {hot.median_ms:.4f} ms "
                  f"cold {cold.median_ms:.4f} ms", flush=True)
        save()

    if args.network or args.network_only:
        params = gnet.random_params(0)
        x = cp.asarray(rng.random((BENCH_B, 1, 86, 86), dtype=np.float32))
        for mode in ("fp16", "exact"):
            net = gnet.FusedLeNet(params, mode=mode)
            st = time_launches(cp, lambda net=net: net(x), max(10, args.reps // 2), None)
            doc["network"].append({"mode": mode, "head": net._head.defines, **st.as_dict()})
            print(f"FusedLeNet {mode:5s} B={BENCH_B} forward {st.median_ms:.4f} ms", flush=True)
            save()


if __name__ == "__main__":
    main()
