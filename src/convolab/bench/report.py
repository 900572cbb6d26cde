"""Results of a bench run: the console tables, one folder per dated run (results.json with the
rows and the environment, results.csv), and the PNG plot."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
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


def print_generic(title: str, rows: Sequence[dict[str, Any]], console: Any) -> None:
    """A table of flat dict rows (the network rows)."""
    from rich.table import Table

    if not rows:
        console.print(f"{title}: no rows")
        return
    table = Table(title=title, title_justify="left")
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if not any(isinstance(r.get(k), (list, dict)) for r in rows)]
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


def plot_rows(path: Path, cases: Sequence[LayerCase], rows: Sequence[Row]) -> None:
    """One panel per layer: horizontal bars of Op Time per implementation (log scale), in
    ladder order, the cuDNN fp32 (or torch-CPU) time as a dashed line to beat."""
    plt = require_matplotlib()
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda fh: fig.savefig(fh, dpi=110, format="png"))
    finally:
        plt.close(fig)
