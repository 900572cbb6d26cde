"""Rung 28 (fused-conv-pool*-wide-*) on the conv blocks of the wide zoo models that the narrow
tensor-core rungs 17/18 leave to the FFMA rung (their conv2): every precision and tile against
the FFMA rung, timed by `convolab bench` (fp64 check first, CUDA events, median of --reps),
then, with --network, the whole forward of each model in every mode.

The layer shapes come from models.conv_blocks (as `bench --shape` strings), so the sweep times
only those layers; the per-layer rows of every block are `benchmarks/plans/zoo_tc.toml`.

    PYTHONPATH=src python3 benchmarks/zoo_wide.py [--sweep quick|full] [--network] \
        [--torch] [--reps N] --out DIR
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

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
        "tc": _grid(rows=[1, 2], prefetch=[-1, 1], units=[1, 2]),
        "tf32": _grid(rows=[1, 2], prefetch=[-1, 1]),
        "3xtf32": _grid(rows=[1, 2], split=[3, 2]) + [{"prefetch": 1, "split": 2},
                                                      {"prefetch": 1, "split": 3}],
    },
}


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


def runs(sweep: str, network: bool, torch: bool, reps: int) -> list[RunConfig]:
    configs = []
    for model in MODELS:
        pools = {b.pool for b in conv_blocks(model) if fused_mma.tc_kind(b.shape, b.pool) is None}
        for pool in sorted(pools):
            configs.append(RunConfig(label=f"{model}-pool{pool}", model=model, batch=BATCH,
                                     reps=reps, custom_shapes=wide_shapes(model),
                                     impls=impls(pool, sweep), anchors=False))
        if network:
            configs.append(RunConfig(
                label=f"{model}-network", model=model, batch=BATCH, reps=reps, network=True,
                variants=tuple(parse_variant(m) for m in ("exact", "tf32", "fp16")),
                per_layer=False, torch=torch, inputs="float"))
    for config in configs:
        config.check()
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", choices=tuple(SWEEPS), default="quick")
    ap.add_argument("--network", action="store_true", help="also the whole forward, per mode")
    ap.add_argument("--torch", action="store_true", help="PyTorch rows in the network runs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    bench_main(runs(args.sweep, args.network, args.torch, args.reps), args.out,
               command=f"benchmarks/zoo_wide.py --sweep {args.sweep}")


if __name__ == "__main__":
    main()
