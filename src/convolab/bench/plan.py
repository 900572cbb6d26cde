"""A bench run's configuration, from command-line flags or from a TOML plan file.

A plan holds one or more runs. Top-level keys are defaults for every `[[run]]` table (a plan
with no `[[run]]` is one run). Keys of a run:

    label = "conv1"                 # names the run in the results (default: run1, run2, ...)
    model = "ece408"                # zoo model of `shapes = "model"` and `--network`
    shapes = "model"                # model | seeds | vgg | all (default: model unless `shape`)
    shape = ["10000,1,86,86,4,7,1,2"]   # B,C,H,W,M,K,S[,P], as --shape
    batch = 10000
    reps = 20
    impls = ["fused-conv-pool2:pipe=1"] # as --impl
    anchors = true                  # PyTorch/cuBLAS rows (default: only when no impl is named)
    plot = true                     # plot.png in the results folder
    network = false                 # whole-network rows instead of per-layer ones
    device = "cpu"                  # network runs: cpu (vs ONNX Runtime) or gpu (default)
    variants = ["exact", "fp16:head.imgs=32"]   # as --variant (network runs)
    per_layer = true                # network runs: the unfused rung-per-layer rows
    torch = true                    # network runs: the PyTorch rows
    input = "raw"                   # GPU runs: raw uint8 bytes or float (default); per layer,
                                    # the first blocks (C = 1) from Fashion-MNIST-sized bytes

    [run.impl."fused-conv-pool2"]   # a parameter grid: one row per point of the product
    pipe = [-1, 1]
    bps = [0, 2, 4]

A plan expands into exactly the runs the equivalent flags give (`RunConfig` either way).
"""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convolab.bench.cases import SHAPE_SETS, parse_shape
from convolab.bench.specs import ImplSpec, VariantSpec, parse_impl, parse_variant
from convolab.errors import ConvolabError

DEFAULT_BATCH = 10_000
DEFAULT_REPS = 20
MAX_BATCH = 1_000_000


@dataclass(frozen=True)
class RunConfig:
    label: str = "bench"
    model: str = "ece408"
    shapes: str | None = None  # None: the model's layers unless custom shapes are given
    custom_shapes: tuple[str, ...] = ()
    batch: int = DEFAULT_BATCH
    reps: int = DEFAULT_REPS
    impls: tuple[ImplSpec, ...] = ()
    anchors: bool | None = None
    plot: bool = False
    network: bool = False
    device: str | None = None  # network runs: "cpu" or "gpu"; None is the GPU
    variants: tuple[VariantSpec, ...] = ()
    per_layer: bool = True
    torch: bool = True
    inputs: str | None = None  # GPU runs: "float" (default) or "raw" uint8 bytes
    notes: tuple[str, ...] = field(default=(), compare=False)

    def check(self) -> None:
        """One clear error for a value no run can use (shared by flags and plans)."""
        if not 1 <= self.batch <= MAX_BATCH:
            raise ConvolabError(f"batch must be in 1..{MAX_BATCH}, got {self.batch}")
        if self.reps < 1:
            raise ConvolabError(f"reps must be positive, got {self.reps}")
        if self.shapes is not None and self.shapes not in SHAPE_SETS:
            raise ConvolabError(f"shapes must be one of {', '.join(SHAPE_SETS)}, "
                                f"not {self.shapes!r}")
        for text in self.custom_shapes:
            parse_shape(text)
        self._check_network_options()

    def _check_network_options(self) -> None:
        """The options that only whole-network runs (or only GPU ones) take."""
        if self.variants and not self.network:
            raise ConvolabError("--variant describes whole-network rows: add --network")
        if self.device not in (None, "cpu", "gpu"):
            raise ConvolabError(f"device must be 'cpu' or 'gpu', not {self.device!r}")
        if self.device is not None and not self.network:
            raise ConvolabError("--device picks the whole-network forward's device: add "
                                "--network (per-layer runs time every usable implementation)")
        if self.device == "cpu" and self.variants:
            raise ConvolabError("--variant selects GPU network variants; the CPU network has one")
        if self.inputs is not None and self.device == "cpu":
            raise ConvolabError("--input picks a GPU run's input: leave --device gpu")
        if self.inputs not in (None, "float", "raw"):
            raise ConvolabError(f"input must be 'float' or 'raw', not {self.inputs!r}")
        if self.network and (self.impls or self.custom_shapes or self.shapes):
            raise ConvolabError("--network times the whole forward: --impl/--shape/--shapes "
                                "do not apply (use --variant)")


# Plan keys -> the type their value must have.
RUN_KEYS: dict[str, type | tuple[type, ...]] = {
    "label": str, "model": str, "shapes": str, "shape": list, "batch": int, "reps": int,
    "impls": list, "impl": dict, "anchors": bool, "plot": bool, "network": bool,
    "device": str, "variants": list, "per_layer": bool, "torch": bool, "input": str,
}


def impl_grid(name: str, grid: Mapping[str, Any]) -> list[ImplSpec]:
    """{'pipe': [-1, 1], 'bps': [0, 2]} -> four ImplSpecs, in product order (a scalar is a
    one-value axis)."""
    axes = [(k, v if isinstance(v, list) else [v]) for k, v in grid.items()]
    return [ImplSpec(name, tuple(zip([k for k, _ in axes], point, strict=True)))
            for point in itertools.product(*[vals for _, vals in axes])]


class _PlanError:
    def __init__(self, path: Path, where: str) -> None:
        self.prefix = f"plan {path}: {where}"

    def __call__(self, message: str) -> ConvolabError:
        return ConvolabError(f"{self.prefix}{message}")


def _check_types(table: Mapping[str, Any], err: _PlanError) -> None:
    for key, value in table.items():
        if key not in RUN_KEYS:
            raise err(f"unknown key {key!r} (known: {', '.join(RUN_KEYS)})")
        want = RUN_KEYS[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise err(f"key {key!r} must be a {getattr(want, '__name__', want)}, "
                      f"got {value!r}")
        if key in ("shape", "impls", "variants") and not all(isinstance(v, str) for v in value):
            raise err(f"key {key!r} must be a list of strings, got {value!r}")


def _impls_of(table: Mapping[str, Any], err: _PlanError) -> tuple[ImplSpec, ...]:
    specs = [parse_impl(text) for text in table.get("impls", [])]
    for name, grid in table.get("impl", {}).items():
        if not isinstance(grid, dict):
            raise err(f"impl.{name!r} must be a table of parameter = value or [values]")
        specs += impl_grid(name, grid)
    return tuple(specs)


def _run_from_table(table: Mapping[str, Any], label: str, err: _PlanError) -> RunConfig:
    _check_types(table, err)
    try:
        config = RunConfig(
            label=table.get("label", label), model=table.get("model", "ece408"),
            shapes=table.get("shapes"), custom_shapes=tuple(table.get("shape", [])),
            batch=table.get("batch", DEFAULT_BATCH), reps=table.get("reps", DEFAULT_REPS),
            impls=_impls_of(table, err), anchors=table.get("anchors"),
            plot=table.get("plot", False), network=table.get("network", False),
            device=table.get("device"),
            variants=tuple(parse_variant(v) for v in table.get("variants", [])),
            per_layer=table.get("per_layer", True), torch=table.get("torch", True),
            inputs=table.get("input"))
        config.check()
    except ConvolabError as e:
        raise err(str(e)) from None
    return config


def load_plan(path: Path) -> list[RunConfig]:
    """The runs a TOML plan file describes; one clear error naming the file and key."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConvolabError(f"plan {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConvolabError(f"plan {path}: not valid TOML: {e}") from None
    runs = data.pop("run", [{}])
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise ConvolabError(f"plan {path}: 'run' must be an array of tables ([[run]])")
    _check_types(data, _PlanError(path, "top level: "))
    configs = []
    for i, run in enumerate(runs, 1):
        err = _PlanError(path, f"run {i}: ")
        _check_types(run, err)
        label = "bench" if len(runs) == 1 else f"run{i}"
        configs.append(_run_from_table({**data, **run}, label, err))
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ConvolabError(f"plan {path}: run labels must differ, got {labels}")
    return configs


def from_flags(model: str, batch: int, reps: int, impls: Sequence[str] = (),
               shapes: str | None = None, custom_shapes: Sequence[str] = (),
               network: bool = False, variants: Sequence[str] = (), plot: bool = False,
               device: str | None = None, inputs: str | None = None) -> RunConfig:
    """The one run the command-line flags describe."""
    config = RunConfig(model=model, shapes=shapes, custom_shapes=tuple(custom_shapes),
                       batch=batch, reps=reps, impls=tuple(parse_impl(s) for s in impls),
                       plot=plot, network=network, device=device,
                       variants=tuple(parse_variant(v) for v in variants), inputs=inputs)
    config.check()
    return config
