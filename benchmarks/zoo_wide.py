"""Rung 28 (fused-conv-pool*-wide-*) on the conv blocks of the wide zoo models that the narrow
tensor-core rungs 17/18 leave to the FFMA rung (their conv2): every precision and tile against
the FFMA rung, timed by `convolab bench` (fp64 check first, CUDA events, median of --reps),
then, with --network, the whole forward of each model in every mode.

The layer shapes come from models.conv_blocks (as `bench --shape` strings), so the sweep times
only those layers; the per-layer rows of every block are `benchmarks/plans/zoo_tc.toml`. With
--network the whole forward runs each mode at rung 28's defaults and, where the sweep found a
faster correct point for the mode's precision, with that point too (as `MODE:LAYER.k=v`).

    PYTHONPATH=src python3 benchmarks/zoo_wide.py [--sweep quick|full] [--network] \
        [--torch] [--reps N] --out DIR      (DIR/layers, DIR/network: results.json, .csv)
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from convolab.bench.plan import RunConfig
from convolab.bench.run import main as bench_main
from convolab.bench.specs import ImplSpec, parse_variant
from convolab.gpu import fused_mma
from convolab.models import conv_blocks

MODELS = ("ece408-mxnet", "eecs498")
BATCH = 10_000
# Parameter points per rung suffix (the measured defaults, all 0, always come first).
def _grid(**axes: list[int]) -> list[dict[str, int]]:
    return [dict(zip(axes, point, strict=True)) for point in itertools.product(*axes.values())]


SWEEPS: dict[str, dict[str, list[dict[str, int]]]] = {
    "quick": {"tc": [], "tf32": [], "3xtf32": [{"split": 2}, {"split": 3}]},
    "full": {
        "tc": _grid(rows=[1, 2], prefetch=[-1, 1]) + [{"rows": 1, "prefetch": -1, "units": 1}],
        "tf32": _grid(rows=[1, 2], prefetch=[-1, 1]),
        "3xtf32": _grid(split=[3, 2], rows=[1, 2], prefetch=[-1]) + _grid(split=[3, 2],
                                                                         prefetch=[1]),
    },
}
MODE_SUFFIX = {"exact": "3xtf32", "tf32": "tf32", "fp16": "tc"}  # network mode -> rung suffix


def wide_shapes(model: str) -> tuple[str, ...]:
    """`B,C,H,W,M,K,S,P` of the model's blocks that rungs 17/18 do not take."""
    return tuple(f"{s.B},{s.C},{s.H},{s.W},{s.M},{s.K},{s.S},{b.pool}"
                 for b in conv_blocks(model, BATCH) for s in [b.shape]
                 if fused_mma.tc_kind(s, b.pool) is None)


def impls(pool: int, sweep: str) -> tuple[ImplSpec, ...]:
    out = [ImplSpec(f"fused-conv-pool{pool}")]
    for suffix, points in SWEEPS[sweep].items():
        name = f"fused-conv-pool{pool}-wide-{suffix}"
        out += [ImplSpec(name)] + [ImplSpec.of(name, p) for p in points]
    return tuple(out)


def layer_runs(sweep: str, reps: int) -> list[RunConfig]:
    configs = []
    for model in MODELS:
        pools = {b.pool for b in conv_blocks(model) if fused_mma.tc_kind(b.shape, b.pool) is None}
        configs += [RunConfig(label=f"{model}-pool{pool}", model=model, batch=BATCH, reps=reps,
                              custom_shapes=wide_shapes(model), impls=impls(pool, sweep),
                              anchors=False) for pool in sorted(pools)]
    return configs


def fastest(layers: dict[str, Any], model: str) -> dict[str, dict[str, Any]]:
    """Per rung suffix, the parameters of the model's fastest correct rung-28 row."""
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    for run in layers["runs"]:
        if not run["label"].startswith(f"{model}-pool"):
            continue
        for row in run["rows"]:
            impl = row.get("impl", "")
            ok = row.get("status") == "ok" and row.get("op") and row.get("rel_l2") is not None \
                and row["rel_l2"] <= row["tolerance"]
            if "-wide-" not in impl or not ok:
                continue
            suffix = impl.split("-wide-")[1].split("[")[0]
            ms = row["op"]["median_ms"]
            if suffix not in best or ms < best[suffix][0]:
                best[suffix] = (ms, {k: v for k, v in row["params"].items() if v})
    return {suffix: params for suffix, (_, params) in best.items()}


def network_runs(layers: dict[str, Any] | None, torch: bool, reps: int) -> list[RunConfig]:
    configs = []
    for model in MODELS:
        block = next(b.name for b in conv_blocks(model)
                     if fused_mma.tc_kind(b.shape, b.pool) is None)
        variants = list(MODE_SUFFIX)
        picked = fastest(layers, model) if layers else {}
        for mode, suffix in MODE_SUFFIX.items():
            if picked.get(suffix):
                variants.append(f"{mode}:" + ",".join(f"{block}.{k}={v}"
                                                      for k, v in picked[suffix].items()))
        configs.append(RunConfig(
            label=f"{model}-network", model=model, batch=BATCH, reps=reps, network=True,
            variants=tuple(parse_variant(v) for v in variants), per_layer=False, torch=torch,
            inputs="float"))
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", choices=tuple(SWEEPS), default="quick")
    ap.add_argument("--network", action="store_true", help="also the whole forward, per mode")
    ap.add_argument("--torch", action="store_true", help="PyTorch rows in the network runs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    configs = layer_runs(args.sweep, args.reps)
    for config in configs:
        config.check()
    command = f"benchmarks/zoo_wide.py --sweep {args.sweep}"
    bench_main(configs, args.out / "layers", command=command)
    if args.network:
        layers = json.loads((args.out / "layers" / "results.json").read_text())
        bench_main(network_runs(layers, args.torch, args.reps), args.out / "network",
                   command=command + " --network")


if __name__ == "__main__":
    main()
