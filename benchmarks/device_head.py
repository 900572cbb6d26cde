"""Device check + timing of the LeNet head kernel (kernels/15): the committed version against
candidate sources given on the command line (one call, ~30 s).

    PYTHONPATH=src python3 benchmarks/device_head.py [candidate.cu ...] --out DIR

Prediction for v3 (lane = image, warps split k, broadcast weight loads, no barriers in the
k loop) against v2 (0.098 ms at B=10000 in the tc_cl run): 0.02-0.03 ms, bound by the
load/store unit (8 broadcast float4 loads per 32 FMAs), not by the 41 MB of features.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from convolab.gpu.compile import cuda_include_dirs, kernel_path  # noqa: E402
from convolab.timing import Stats, time_gpu  # noqa: E402


def reference(feat: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    f = {k: v.astype(np.float64) for k, v in p.items()}
    h = np.maximum(feat.astype(np.float64) @ f["w5"].T + f["b5"], 0)
    z = h @ f["w6"].T + f["b6"]
    z = np.exp(z - z.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng()
    p = {"w5": (rng.standard_normal((32, 1024)) * 0.05).astype(np.float32),
         "b5": (rng.standard_normal(32) * 0.1).astype(np.float32),
         "w6": (rng.standard_normal((10, 32)) * 0.3).astype(np.float32),
         "b6": (rng.standard_normal(10) * 0.1).astype(np.float32)}
    d = {k: cp.asarray(v) for k, v in p.items()}
    w5t = cp.ascontiguousarray(d["w5"].T)
    opts = ("-std=c++17", *(f"-I{i}" for i in cuda_include_dirs()))
    sources = [("committed", kernel_path("15_lenet_fused.cu"))]
    sources += [(s.stem, s) for s in args.sources]
    rows = []
    for name, path in sources:
        kern = cp.RawModule(code=path.read_text(), options=opts).get_function("lenet_head")
        ok = True
        for batch in (1, 31, 33, 1000, 10000):
            feat = np.abs(rng.standard_normal((batch, 1024))).astype(np.float32)
            fd = cp.asarray(feat)
            probs = cp.full((batch, 10), cp.nan, cp.float32)
            kern(((batch + 31) // 32,), (256,), (fd, w5t, d["b5"], d["w6"], d["b6"], probs,
                                                np.int32(batch)))
            got = probs.get().astype(np.float64)
            ref = reference(feat, p)
            err = float(np.abs(got - ref).max())
            ok &= bool(np.isfinite(got).all() and err < 1e-5)
            print(f"{name:12s} B={batch:5d} max abs err {err:.2e}")
        launch_args = (fd, w5t, d["b5"], d["w6"], d["b6"], probs, np.int32(10000))
        samples = time_gpu(lambda kern=kern, a=launch_args: kern((313,), (256,), a),
                           reps=args.reps, warmup=3)
        st = Stats.of(samples)
        rows.append({"name": name, "ok": ok, **st.as_dict()})
        print(f"{name:12s} ok={ok} median {st.median_ms:.4f} ms spread {st.spread_pct:.1f} %")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        doc = {"device": device, "batch": 10000, "rows": rows}
        (args.out / "head.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
