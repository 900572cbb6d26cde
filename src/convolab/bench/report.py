"""Results of a bench run: the console tables, one folder per dated run (results.json with the
rows and the environment, results.csv), and the PNG plot."""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from convolab.bench.cases import LayerCase
from convolab.bench.measure import Row
from convolab.errors import ConvolabError
from convolab.outputs import write_atomic

RESULTS_ROOT = Path("benchmarks/results")
CSV_FIELDS = ("case", "impl", "device", "rung", "anchor", "shape", "batch", "precision",
              "params", "status", "detail", "rel_l2", "tolerance", "op_median_ms", "op_p10_ms",
              "op_p90_ms", "op_spread_pct", "op_reps", "gflops", "gbps", "floor_ms",
              "roofline_pct", "layer_median_ms", "layer_spread_pct", "speedup_vs_anchor",
              "anchor_name")


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_slug(device: str) -> str:
    """The folder name's device part: the GPU's model ('h100'), or 'cpu'."""
    if device.startswith("cpu"):
        return "cpu"
    model = re.search(r"\b([A-Z]+\d+[A-Z]?)\b", device.upper())
    return slug(model.group(1)) if model else slug(device)


def results_dir(device: str, plan: str | None, date: dt.date | None = None,
                root: Path = RESULTS_ROOT) -> Path:
    """benchmarks/results/<YYYY-MM-DD>_<gpu-or-cpu>_<plan or 'bench'>/"""
    day = (date or dt.date.today()).isoformat()
    return root / f"{day}_{device_slug(device)}_{slug(plan) if plan else 'bench'}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table_row(r: Row) -> list[str]:
    if r.status != "ok":
        short = r.detail.splitlines()[0][:24] if r.detail else ""
        return [r.impl, _fmt(r.rung, "d"), str(r.batch), f"[red]{r.status}[/red]", short,
                *[""] * 5, _fmt(r.rel_l2, ".1e")]
    return [r.impl, _fmt(r.rung, "d"), str(r.batch), f"{r.op['median_ms']:.3f}",
            f"{r.op['spread_pct']:.1f}", f"{r.gflops:,.0f}", f"{r.gbps:,.0f}",
            f"{r.roofline_pct:.1f}", _fmt(r.layer["median_ms"] if r.layer else None, ".2f"),
            _fmt(r.speedup_vs_anchor, ".2f"), _fmt(r.rel_l2, ".1e")]


def print_tables(cases: Sequence[LayerCase], rows: Sequence[Row], console: Any) -> None:
    from rich.table import Table

    for case in cases:
        table = Table(title=f"{case.label}  {case.shape}"
                            + (f"  (+relu+pool {case.pool})" if case.pool else "")
                            + (f"\n{case.note}" if case.note else ""), title_justify="left")
        for col in ("impl", "rung", "B", "Op ms", "spread %", "GFLOP/s", "GB/s", "% roof",
                    "Layer ms", "x torch", "rel L2"):
            table.add_column(col, justify="left" if col == "impl" else "right")
        for r in (r for r in rows if r.case == case.label):
            table.add_row(*_table_row(r))
        console.print(table)
        for r in (r for r in rows if r.case == case.label and r.status in ("error", "wrong")):
            console.print(f"  {r.impl}: {r.status}: {r.detail}", markup=False, highlight=False)
    console.print(
        "Op ms: median of CUDA-event (GPU) or wall-clock (CPU) times; spread: (p90-p10)/median; "
        "% roof: roofline floor max(flops/peak, bytes/bandwidth) over Op ms (weights that stay "
        "in cache can beat the DRAM floor); x torch: speed-up over torch-cudnn-fp32 (GPU rows) "
        "or torch-cpu (CPU rows) at the same batch"
    )


SCREEN_COLUMNS = ("name", "mode", "median_ms", "spread_pct", "back_to_back_ms",
                  "images_per_s", "argmax_agree_vs_fp64", "max_abs_prob_diff_vs_fp64",
                  "speedup_vs_torch_eager_fp32", "threads", "time_vs_onnxruntime")


def print_generic(title: str, rows: Sequence[dict[str, Any]], console: Any) -> None:
    """A table of flat dict rows (the network rows)."""
    from rich.table import Table

    if not rows:
        console.print(f"{title}: no rows")
        return
    table = Table(title=title, title_justify="left")
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if not any(isinstance(r.get(k), (list, dict)) for r in rows)]
    # A terminal holds about eight columns; every field stays in the JSON and CSV.
    shown = [k for k in SCREEN_COLUMNS if k in keys]
    keys = shown or keys
    for k in keys:
        table.add_column(k)
    for r in rows:
        table.add_row(*[format(r[k], ".4g") if isinstance(r.get(k), float) else str(r.get(k, ""))
                        for k in keys])
    console.print(table)


def csv_row(r: Row) -> dict[str, Any]:
    d = {k: getattr(r, k) for k in CSV_FIELDS if hasattr(r, k)}
    d["params"] = ",".join(f"{k}={v}" for k, v in (r.params or {}).items())
    if r.op:
        d |= {"op_median_ms": r.op["median_ms"], "op_p10_ms": r.op["p10_ms"],
              "op_p90_ms": r.op["p90_ms"], "op_spread_pct": r.op["spread_pct"],
              "op_reps": r.op["reps"]}
    if r.layer:
        d |= {"layer_median_ms": r.layer["median_ms"], "layer_spread_pct": r.layer["spread_pct"]}
    return d


def write_results(out_dir: Path, report: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Path:
    """out_dir/results.json (the report) and out_dir/results.csv (flat rows), each replaced
    whole; returns the dir."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConvolabError(f"cannot create results folder {out_dir}: {err.strerror}") from None
    write_atomic(out_dir / "results.json", json.dumps(report, indent=1, default=str))
    fields = list(dict.fromkeys(k for row in rows for k in row))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(out_dir / "results.csv", text.getvalue())
    return out_dir


def require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConvolabError(
            "--plot needs matplotlib, which is not installed: pip install 'convolab[bench]'"
        ) from None
    return plt


def _plot_panel(ax: Any, label: str, mine: Sequence[Row], anchor: str) -> None:
    from matplotlib.ticker import NullFormatter

    colors = ["0.55" if r.anchor else "tab:orange" if (r.tolerance or 0) > 1e-5 else "tab:blue"
              for r in mine]
    ax.barh(range(len(mine)), [r.op["median_ms"] for r in mine], color=colors)
    ax.set_yticks(range(len(mine)), [r.impl for r in mine], fontsize="small")
    ax.invert_yaxis()  # ladder order reads top to bottom
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on short spans
    ax.set_xlabel("Op Time, ms (median, log scale)")
    ax.set_title(f"{label}  B={mine[0].batch}", fontsize="medium")
    ref = next((r for r in mine if r.impl == anchor), None)
    if ref is not None:
        ax.axvline(ref.op["median_ms"], color="black", linestyle="--", linewidth=1,
                   label=f"{anchor} {ref.op['median_ms']:.2f} ms")
        ax.legend(fontsize="small", loc="lower right")


def _as_row(r: Row | dict[str, Any]) -> Row:
    """A row as measured, or as read back from results.json."""
    if isinstance(r, Row):
        return r
    known = {f.name for f in dataclasses.fields(Row)}
    return Row(**{k: v for k, v in r.items() if k in known})


def _save_figure(plt: Any, fig: Any, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda fh: fig.savefig(fh, dpi=110, format="png"))
    finally:
        plt.close(fig)


def roofline_path(plot_path: Path) -> Path:
    """Where the roofline goes beside a ladder chart: plot.png -> roofline.png,
    plot_LABEL.png -> roofline_LABEL.png."""
    name = plot_path.name
    return plot_path.with_name("roofline" + name[4:] if name.startswith("plot") else
                               f"roofline_{name}")


def plot_rows(path: Path, cases: Sequence[LayerCase | Any], rows: Sequence[Row | dict[str, Any]],
              ceilings: dict[str, Any] | None = None) -> list[Path]:
    """One panel per layer: horizontal bars of Op Time per implementation (log scale), in
    ladder order, the cuDNN fp32 (or torch-CPU) time as a dashed line to beat. With the run's
    measured `ceilings` ({'gpu': {...}, 'cpu': {...}}) also the roofline, beside it
    (`roofline_path`). Returns the files written."""
    plt = require_matplotlib()
    rows = [_as_row(r) for r in rows]
    timed = [r for r in rows if r.op]
    device = "gpu" if any(r.device == "gpu" for r in timed) else "cpu"
    timed = [r for r in timed if r.device == device]
    labels = [c.label for c in cases if any(r.case == c.label for r in timed)]
    if not labels:
        raise ConvolabError("--plot: no timed rows to plot")
    anchor = "torch-cudnn-fp32" if device == "gpu" else "torch-cpu"
    most = max(sum(r.case == label for r in timed) for label in labels)
    fig, axes = plt.subplots(1, len(labels), figsize=(5.5 * len(labels), 1.0 + 0.28 * most),
                             squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        _plot_panel(ax, label, [r for r in timed if r.case == label], anchor)
    fig.suptitle(f"convolab bench ({device}): blue fp32-accurate, orange TF32/FP16 accuracy, "
                 "grey anchors")
    fig.tight_layout()
    _save_figure(plt, fig, path)
    written = [path]
    if ceilings and ceilings.get(device):
        written.append(plot_roofline(roofline_path(path), timed, ceilings[device], labels))
    return written


# ----------------------------------------------------------------------------- roofline


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity, FLOP per byte of compulsory DRAM traffic."""
    return flops / nbytes


def attainable_gflops(intensity_: float, peak_gflops: float, copy_gbps: float) -> float:
    """The roofline: the slower of the compute peak and bandwidth x intensity."""
    return min(peak_gflops, copy_gbps * intensity_)


def _row_intensity(r: Row) -> float | None:
    # gflops = flops / t and gbps = min_bytes / t for the row's own batch: their ratio is the
    # layer's flops / min_bytes at that batch, whatever batch the case was declared with.
    if not r.gflops or not r.gbps:
        return None
    return r.gflops / r.gbps


_PEAKS = (("fp32", "fp32_gflops", "tab:blue"), ("tf32", "tf32_gflops", "tab:orange"),
          ("fp16", "fp16_gflops", "tab:red"))
_MARKERS = "osD^v<>"


def _roof_lines(ax: Any, ceilings: dict[str, Any], span: tuple[float, float]) -> None:
    import numpy as np

    xs = np.geomspace(span[0], span[1], 200)
    bw = float(ceilings["copy_gbps"])
    drawn: set[float] = set()
    for label, key, color in _PEAKS:
        peak = float(ceilings[key])
        if peak in drawn:  # the CPU measures one GEMM peak for every precision
            continue
        drawn.add(peak)
        ys = [attainable_gflops(x, peak, bw) for x in xs]
        ax.plot(xs, ys, color=color, linewidth=1.5,
                label=f"{label} peak {peak / 1e3:,.1f} TFLOP/s")
    ax.plot([], [], " ", label=f"copy bandwidth {bw:,.0f} GB/s")


def _roof_points(ax: Any, points: list[tuple[Row, float]], labels: Sequence[str]) -> None:
    colors = {label: color for label, _, color in _PEAKS}
    for n, label in enumerate(labels):
        mine = [(r, i) for r, i in points if r.case == label]
        for precision in dict.fromkeys(r.precision for r, _ in mine):
            sel = [(r, i) for r, i in mine if r.precision == precision]
            ax.scatter([i for _, i in sel], [r.gflops for r, _ in sel],
                       marker=_MARKERS[n % len(_MARKERS)], color=colors.get(precision, "0.3"),
                       edgecolor="black", linewidth=0.5, zorder=3,
                       label=f"{label} ({precision})")


def plot_roofline(path: Path, rows: Sequence[Row | dict[str, Any]], ceilings: dict[str, Any],
                  labels: Sequence[str] | None = None) -> Path:
    """Log-log roofline: the measured copy bandwidth and GEMM peaks as ceilings, every timed
    row as a point (intensity = flops / min_bytes, achieved GFLOP/s), a marker per layer and
    a colour per precision."""
    plt = require_matplotlib()
    points = [(r, _row_intensity(r)) for r in map(_as_row, rows) if r.op]
    device = "cpu" if ceilings["device"] == "cpu" else "gpu"
    points = [(r, i) for r, i in points if i is not None and r.device == device]
    if not points:
        raise ConvolabError(f"roofline: no timed rows on {ceilings['device']} to plot")
    labels = list(labels or dict.fromkeys(r.case for r, _ in points))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [i for _, i in points]
    _roof_lines(ax, ceilings, (min(xs) / 4, max(xs) * 8))
    _roof_points(ax, points, labels)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP / byte (flops / compulsory bytes)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"convolab roofline: {ceilings['device']}, each rung a point", fontsize="medium")
    ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    _save_figure(plt, fig, path)
    return path


def _sweep_case(label: str) -> str:
    """A layer's label without its batch: an explicit shape's label ("shape/16x4096x1x1-…")
    names the batch, a named layer's ("vgg/fc7") does not."""
    return re.sub(r"^shape/\d+x", "shape/Bx", label)


def _sweep_lines(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, Row]]]]:
    """case label -> implementation -> [(batch, row)] over every run, timed GPU rows only; where
    two runs time the same (case, implementation, batch), the later run's row is kept."""
    points: dict[str, dict[str, dict[int, Row]]] = {}
    for run in runs:
        for r in (_as_row(d) for d in run.get("rows", [])):
            if r.op and r.gflops and r.device == "gpu":
                points.setdefault(_sweep_case(r.case), {}).setdefault(r.impl, {})[r.batch] = r
    return {case: {impl: sorted(by_batch.items(), key=lambda p: p[0])
                   for impl, by_batch in impls.items()}
            for case, impls in points.items()}


def plot_batch_sweep(out_dir: Path, runs: Sequence[dict[str, Any]]) -> list[Path]:
    """One figure per layer over a batch sweep (runs that differ in batch): GFLOP/s against
    batch, a line per implementation, the cuDNN/cuBLAS anchors dashed. Returns the files."""
    plt = require_matplotlib()
    written = []
    for case, impls in _sweep_lines(runs).items():
        if max(len({b for b, _ in pts}) for pts in impls.values()) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        # One colour per precision, so each line sits beside its own anchor; markers tell
        # apart several lines of one precision.
        colours = {p: f"C{i}" for i, p in enumerate(sorted({pts[0][1].precision
                                                             for pts in impls.values()}))}
        seen: dict[str, int] = {}
        for impl, pts in sorted(impls.items()):
            anchor, precision = pts[0][1].anchor, pts[0][1].precision
            marker = "osD^v"[seen.get(precision, 0) % 5]
            seen[precision] = seen.get(precision, 0) + 1
            ax.plot([b for b, _ in pts], [r.gflops for _, r in pts], marker=marker,
                    color=colours[precision], linestyle="--" if anchor else "-",
                    linewidth=1.2 if anchor else 1.8, label=f"{impl} ({precision})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("GFLOP/s (Op Time median)")
        ax.set_title(f"{case}: GFLOP/s vs batch (dashed: cuDNN/cuBLAS anchors)",
                     fontsize="medium")
        ax.legend(fontsize="x-small", ncol=2)
        ax.grid(True, which="major", alpha=0.3)
        fig.tight_layout()
        path = Path(out_dir) / f"sweep_{slug(case)}.png"
        _save_figure(plt, fig, path)
        written.append(path)
    return written


def _load_runs(json_path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A results file's per-layer runs and its measured ceilings (a bench results.json, with
    runs, or a flat one with cases and rows); one clear error for anything else."""
    try:
        record = json.loads(Path(json_path).read_text(encoding="utf-8"))
        runs = record["runs"] if "runs" in record else [
            {"label": "bench", "cases": record["cases"], "rows": record["rows"]}]
        ceilings = record.get("ceilings") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConvolabError(f"{json_path}: not a convolab bench results file ({err})") from None
    return [run for run in runs if run.get("cases")], ceilings


def plot_sweeps(json_paths: Sequence[Path], out_dir: Path) -> list[Path]:
    """One batch-sweep figure per layer (sweep_<layer>.png) over the runs of several results
    files — a sweep measured in several plans — into out_dir. Where files time the same
    (layer, implementation, batch), the file named later wins. Returns the files written."""
    if not json_paths:
        raise ConvolabError("plot_sweeps: no results files given")
    runs = [run for path in json_paths for run in _load_runs(path)[0]]
    if len({row.get("batch") for run in runs for row in run.get("rows", [])}) < 2:
        raise ConvolabError(f"{', '.join(map(str, json_paths))}: fewer than two batch sizes, "
                            "no sweep to plot")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    written = plot_batch_sweep(Path(out_dir), runs)
    if not written:
        raise ConvolabError(f"{', '.join(map(str, json_paths))}: no layer was timed at two or "
                            "more batch sizes")
    return written


def plot_results(json_path: Path, out_dir: Path) -> list[Path]:
    """Redraw the ladder chart (plot*.png) and the roofline (roofline*.png) of an existing
    results file (a bench results.json, with runs, or a flat one with cases and rows) into
    out_dir; returns the files written."""
    layer_runs, ceilings = _load_runs(json_path)
    written: list[Path] = []
    for run in layer_runs:
        name = "plot.png" if len(layer_runs) == 1 else f"plot_{slug(run['label'])}.png"
        cases = [SimpleNamespace(label=c["label"]) for c in run["cases"]]
        written += plot_rows(Path(out_dir) / name, cases, run["rows"], ceilings)
    # A sweep is runs at several batches, whether set per run or written into explicit shapes.
    if len({row.get("batch") for run in layer_runs for row in run.get("rows", [])}) > 1:
        written += plot_batch_sweep(Path(out_dir), layer_runs)
    if not written:
        raise ConvolabError(f"{json_path}: no per-layer runs to plot")
    return written
