"""Kernel 30 (dense_head) per zoo model, and PyTorch's whole-job rows, at B=10000.

    python benchmarks/dense_head_torch.py --out DIR [--reps 30] [--torch-compile]

1. dense_head: every zoo model's head on random features (B, F) with random weights, checked
   against the fp64 head on the first 256 images, then timed (CUDA events, warm-up, median of
   --reps) for each (imgs, kc) define set, writing probabilities, labels, or both; kernel 20
   (ece408 only) beside it. Achieved feature bandwidth = B * F * 4 / time.
2. PyTorch: bench.torch_network.torch_rows for every zoo model on random raw images, raw input
   host -> host and float input device -> device (torch.compile only with --torch-compile).
Writes DIR/dense_head.json and DIR/torch_rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 10000
CHECK = 256


def _write(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _head_fp64(feat: np.ndarray, layers: list, p: dict[str, np.ndarray]) -> np.ndarray:
    a = feat.astype(np.float64)
    for layer in layers:
        a = a @ p[f"{layer.name}.weight"].astype(np.float64).T + p[f"{layer.name}.bias"]
        a = np.maximum(a, 0) if layer.relu else a
    z = np.exp(a - a.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def _params(model: str, seed: int) -> dict[str, np.ndarray]:
    from convolab.models import build

    rng = np.random.default_rng(seed)
    p = {k: np.asarray(v, np.float32) for k, v in build(model, seed).params().items()}
    for k in p:
        if k.endswith(".bias"):
            p[k] = (0.3 * rng.standard_normal(p[k].shape)).astype(np.float32)
    return p


def dense_head_rows(reps: int) -> list[dict[str, Any]]:
    import cupy as cp

    from convolab.gpu import dense_head as dh
    from convolab.gpu import lenet_head
    from convolab.models import MODELS, head_layers
    from convolab.timing import Stats, time_gpu

    rows = []
    for model in MODELS:
        layers, p = head_layers(model), _params(model, 1)
        n = layers[0].in_features
        feat_h = np.abs(np.random.default_rng(2).standard_normal((BATCH, n))).astype(np.float32)
        ref = _head_fp64(feat_h[:CHECK], layers, p)
        feat = cp.asarray(feat_h)
        probs, labels = cp.empty((BATCH, 10), cp.float32), cp.empty(BATCH, cp.uint8)
        for imgs in dh.IMGS_CHOICES:
            for kc in dh.KC_CHOICES:
                head = dh.prepare_dense_head(model, p, imgs, kc)
                probs.fill(cp.nan)
                head(feat, probs, labels)
                err = float(np.abs(probs[:CHECK].get() - ref).max())
                agree = float((labels[:CHECK].get() == ref.argmax(1)).mean())
                for what, args in (("probs+labels", (probs, labels)), ("probs", (probs,)),
                                   ("labels", (None, labels))):
                    ms = Stats.of(time_gpu(lambda a=args, h=head, f=feat: h(f, *a), reps=reps,
                                           warmup=5)).median_ms
                    rows.append({"kernel": "30 dense_head", "model": model, "imgs": imgs,
                                 "kc": kc, "outputs": what, "batch": BATCH, "median_ms": ms,
                                 "feature_GBps": BATCH * n * 4 / ms / 1e6,
                                 "max_abs_diff_vs_fp64": err, "argmax_agree": agree})
                    print(json.dumps(rows[-1]), flush=True)
        if model == "ece408":
            run = lenet_head.prepare_head()
            w = (cp.ascontiguousarray(cp.asarray(p["f5.weight"]).T), cp.asarray(p["f5.bias"]),
                 cp.asarray(p["f6.weight"]), cp.asarray(p["f6.bias"]), probs)
            ms = Stats.of(time_gpu(lambda r=run, f=feat, a=w: r(f, *a), reps=reps,
                                   warmup=5)).median_ms
            rows.append({"kernel": "20 lenet_head", "model": model, "outputs": "probs",
                         "batch": BATCH, "median_ms": ms,
                         "feature_GBps": BATCH * n * 4 / ms / 1e6,
                         "max_abs_diff_vs_fp64": float(np.abs(probs[:CHECK].get() - ref).max())})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def torch_bench_rows(reps: int, compiled: bool) -> list[dict[str, Any]]:
    from convolab.bench.torch_network import torch_rows
    from convolab.conv_cpu import reference_forward
    from convolab.data import resize_bilinear
    from convolab.models import MODELS, spec

    raw = np.random.default_rng(3).integers(0, 256, (BATCH, 28, 28), dtype=np.uint8)
    rows = []
    for model in MODELS:
        p = _params(model, 1)
        ref = reference_forward(p, resize_bilinear(raw[:CHECK], spec(model).input_size),
                                model=model)
        for inputs, io in (("raw", "host"), ("float", "device")):
            for r in torch_rows(model, p, raw, reps, ref, inputs=inputs, io=io,
                                compile=compiled):
                rows.append(r)
                print(json.dumps(r, default=str), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--torch-compile", action="store_true")
    ap.add_argument("--skip", choices=("head", "torch"), action="append", default=[])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if "head" not in args.skip:
        _write(args.out / "dense_head.json", dense_head_rows(args.reps))
    if "torch" not in args.skip:
        _write(args.out / "torch_rows.json", torch_bench_rows(args.reps, args.torch_compile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
