"""`convolab bench`: runs (from flags or a plan), measured and written to one results folder.

CPU contenders run at a CPU-sized batch (see `cases.cpu_batch`); Numba-compiled ones are
skipped on GPU hosts (conv_cpu's rule: Numba must not load there) unless named with --impl.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convolab.backend import gpu_available
from convolab.bench.cases import LayerCase, layer_cases
from convolab.bench.contenders import Contender, select_contenders
from convolab.bench.measure import Row, bench_case
from convolab.bench.plan import RunConfig
from convolab.bench.report import (
    csv_row,
    plot_rows,
    print_generic,
    print_tables,
    require_matplotlib,
    results_dir,
    write_results,
)
from convolab.environment import describe
from convolab.errors import ConvolabError
from convolab.outputs import check_dir
from convolab.roofline import Ceilings, measure_cpu_ceilings, measure_gpu_ceilings


@dataclasses.dataclass
class Prepared:
    """A run resolved before anything is measured: its cases and contenders (or none)."""

    config: RunConfig
    cases: list[LayerCase]
    contenders: list[Contender]
    notes: list[str]


def _console() -> Any:
    from rich.console import Console

    console = Console()
    # Logs and CI: rich would squeeze the tables into 80 columns.
    return console if console.is_terminal else Console(width=170)


def prepare_run(config: RunConfig, gpu: bool) -> Prepared:
    """Resolve shapes and contenders: every input error surfaces before minutes of measuring."""
    if config.plot:
        require_matplotlib()
    if config.network and config.device == "cpu":
        return Prepared(config, [], [], [])
    if config.network:
        if not gpu:
            raise ConvolabError("--network times the whole-network GPU forward: no CUDA GPU is "
                                "usable here (CuPy missing or no device)")
        return Prepared(config, [], [], [])
    if config.inputs == "raw" and not gpu:  # every contender would be dropped: an empty run
        raise ConvolabError("--input raw times GPU implementations reading raw uint8 images: "
                            "no CUDA GPU is usable here (CuPy missing or no device)")
    cases = layer_cases(config.shapes, config.model, config.batch, config.custom_shapes)
    contenders, notes = select_contenders(config.impls, gpu, config.anchors)
    if config.inputs == "raw":
        cases, contenders = _raw_layers(cases, contenders, notes)
    if config.reps < 20:
        notes.append(f"reps={config.reps} < 20: medians are indicative only")
    return Prepared(config, cases, contenders, notes)


def _raw_layers(cases: list[LayerCase], contenders: list[Contender], notes: list[str]
                ) -> tuple[list[LayerCase], list[Contender]]:
    """Per-layer rows from raw bytes: the first blocks (one input channel) only, every GPU
    contender reading Fashion-MNIST-sized uint8 images (its own raw entry, or rung 25 first)."""
    from convolab.bench.contenders import raw_contender
    from convolab.data import IMAGE_SIDE

    raw_hw = (IMAGE_SIDE, IMAGE_SIDE)
    firsts = [c for c in cases if c.shape.C == 1]
    if not firsts:
        raise ConvolabError("--input raw times first blocks (one input channel): no layer of "
                            "this run has one")
    gpu = [c for c in contenders if c.device == "gpu"]
    if not gpu:
        raise ConvolabError("--input raw times GPU implementations reading raw uint8 images: "
                            "none of this run's implementations runs on the GPU")
    notes.append(f"raw input: {raw_hw[0]}x{raw_hw[1]} uint8 images resized on the GPU; "
                 f"layers with C > 1 and CPU contenders left out")
    return firsts, [raw_contender(c, raw_hw) for c in gpu]


def measure_ceilings(gpu: bool, console: Any) -> dict[str, Ceilings]:
    with console.status("measuring ceilings"):
        ceilings = {"cpu": measure_cpu_ceilings()}
        if gpu:
            ceilings["gpu"] = measure_gpu_ceilings()
    for dev, ceil in ceilings.items():
        console.print(f"ceilings {dev} ({ceil.device}): copy {ceil.copy_gbps:,.0f} GB/s, "
                      f"fp32 {ceil.fp32_gflops:,.0f} / tf32 {ceil.tf32_gflops:,.0f} / "
                      f"fp16 {ceil.fp16_gflops:,.0f} GFLOP/s")
    return ceilings


def _progress(console: Any, status: Any) -> Callable[[str], None]:
    def progress(message: str) -> None:
        status.update(f"benchmarking {message}")
        if not console.is_terminal:  # a log shows where a long run is, or where it stopped
            print(f"bench: {message}", file=sys.stderr, flush=True)

    return progress


def run_layers(p: Prepared, ceilings: dict[str, Ceilings], rng: np.random.Generator,
               console: Any, save: Callable[[], None], result: dict[str, Any]) -> list[Row]:
    """Every contender on every case of one run; `save()` after each case (partial results
    survive an interrupted run)."""
    rows: list[Row] = []
    result["rows"] = rows
    with console.status("benchmarking") as status:
        for case in p.cases:
            rows += bench_case(case, p.contenders, p.config.reps, ceilings, rng,
                               _progress(console, status))
            save()
    print_tables(p.cases, rows, console)
    return rows


def run_network(config: RunConfig, console: Any, device: str) -> list[dict[str, Any]]:
    from convolab.bench.network import DEFAULT_VARIANTS, bench_network

    if config.device == "cpu":
        from convolab.bench.cpu_network import bench_network_cpu

        with console.status(f"whole-network CPU forward, B={config.batch}"):
            rows = bench_network_cpu(config.model, config.batch, config.reps)
        print_generic(f"whole-network CPU forward, {config.model}, B={config.batch}", rows,
                      console)
        return rows
    inputs = config.inputs or "float"
    with console.status(f"whole-network forward, {config.model}, {inputs} input, "
                        f"B={config.batch}"):
        rows = bench_network(config.batch, config.reps, config.variants or DEFAULT_VARIANTS,
                             per_layer=config.per_layer, torch_rows=config.torch,
                             model=config.model, inputs=inputs)
    print_generic(f"whole-network forward, {config.model}, {inputs} input, B={config.batch}, "
                  f"{device}", rows, console)
    return rows


def _run_record(p: Prepared) -> dict[str, Any]:
    return {"label": p.config.label, "config": dataclasses.asdict(p.config), "notes": p.notes,
            "cases": [{"label": c.label, "shape": str(c.shape), "pool": c.pool, "note": c.note,
                       "flops": c.shape.flops, "min_bytes": c.shape.min_bytes()}
                      for c in p.cases],
            "rows": []}


def _flat_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    flat = []
    for run in report["runs"]:
        for r in run["rows"]:
            d = csv_row(r) if isinstance(r, Row) else dict(r)
            flat.append({"run": run["label"], **d})
    return flat


def _report_json(report: dict[str, Any]) -> dict[str, Any]:
    runs = [{**run, "rows": [r.__dict__ if isinstance(r, Row) else r for r in run["rows"]]}
            for run in report["runs"]]
    return {**report, "runs": runs}


def main(runs: Sequence[RunConfig], out: Path | None = None, plan: str | None = None,
         command: str = "bench") -> dict[str, Any]:
    """Measure every run and write out/results.json, results.csv (and plot*.png where asked).
    Returns the report (rows as `Row` objects or dicts), also for the tests."""
    if not runs:
        raise ConvolabError("nothing to run: the plan has no runs")
    console = _console()
    gpu = gpu_available()
    prepared = [prepare_run(config, gpu) for config in runs]
    for p in prepared:
        for note in p.notes:
            console.print(f"[yellow]note:[/yellow] {p.config.label}: {note}")
    report = {**describe(gpu, command), "plan": plan, "ceilings": {},
              "runs": [_run_record(p) for p in prepared]}
    out_dir = check_dir(out if out is not None else results_dir(report["device"], plan), "--out")

    def save() -> None:
        write_results(out_dir, _report_json(report), _flat_rows(report))

    if any(not p.config.network for p in prepared):
        ceilings = measure_ceilings(gpu, console)
        report["ceilings"] = {k: v.as_dict() for k, v in ceilings.items()}
    rng = np.random.default_rng()
    written = ["results.json", "results.csv"]
    for p, record in zip(prepared, report["runs"], strict=True):
        if p.config.network:
            record["rows"] = run_network(p.config, console, report["device"])
        else:
            run_layers(p, ceilings, rng, console, save, record)
        save()
        if p.config.plot and not p.config.network:
            name = "plot.png" if len(prepared) == 1 else f"plot_{p.config.label}.png"
            files = plot_rows(out_dir / name, p.cases, record["rows"], report["ceilings"])
            written += [f.name for f in files]
    console.print(f"wrote {', '.join(str(out_dir / name) for name in written)}")
    return report
