"""`convolab profile`: Nsight Compute metrics per kernel, per GPU implementation, per layer.

For each selected GPU implementation, `ncu` runs a small child process
(`python -m convolab.gpu.profile --run IMPL --model M --batch B`) that prepares the
implementation for every conv layer of the model, then launches each layer once. Before
each layer the child launches an empty marker kernel named after the layer's index, so the
parent can tell which kernels belong to which layer however many kernels a rung launches;
everything before the first marker (input generation, weight set-up, compilation probes) is
dropped. Where NVTX is available, ncu profiles only the marked region, which keeps the
replay cost of set-up kernels out of the run.

The metrics are a compact answer to "why is this kernel as fast as it is": time, SM and DRAM
throughput as % of peak, achieved occupancy, bytes through L1/L2/DRAM, registers and shared
memory per block (what limits occupancy), shared-memory bank conflicts and FFMA count.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convolab.errors import ConvolabError

METRICS: tuple[str, ...] = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "l1tex__t_bytes.sum",
    "lts__t_bytes.sum",
    "dram__bytes.sum",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_static",
    "launch__shared_mem_per_block_dynamic",
    "launch__block_size",
    "launch__grid_size",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum",
)
# If this ncu rejects a metric name (they differ between versions and GPUs), these remain.
CORE_METRICS: tuple[str, ...] = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
)
# Short column names for the table, in METRICS order.
COLUMNS: dict[str, str] = {
    "gpu__time_duration.sum": "time us",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occup %",
    "l1tex__t_bytes.sum": "L1 MB",
    "lts__t_bytes.sum": "L2 MB",
    "dram__bytes.sum": "DRAM MB",
    "launch__registers_per_thread": "regs",
    "launch__shared_mem_per_block_static": "smem st",
    "launch__shared_mem_per_block_dynamic": "smem dyn",
    "launch__block_size": "block",
    "launch__grid_size": "grid",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "bank confl",
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": "FFMA",
}
MARKER_PREFIX = "convolab_marker_"
NVTX_RANGE = "convolab"
NCU_TIMEOUT_S = 300

# Units ncu may print; values are normalised to ns for times and bytes for sizes.
_UNIT_SCALE = {
    "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "KB": 1e3, "MB": 1e6, "GB": 1e9,
}


def _install_candidates() -> list[Path]:
    roots = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    return [Path(root) / "bin" / "ncu" for root in roots if root]


def find_ncu() -> str:
    """ncu from PATH, else the usual CUDA install locations; a clear error if none."""
    found = shutil.which("ncu")
    if found:
        return found
    for candidate in _install_candidates():
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ConvolabError(
        "convolab profile needs Nsight Compute: `ncu` is not on PATH (nor in $CUDA_PATH/bin or "
        "/usr/local/cuda/bin); install Nsight Compute or add its folder to PATH"
    )


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """ncu --csv (details page, long format) -> one dict per kernel launch, in launch order.

    Each dict has `id`, `kernel`, and every metric as a float (times in ns, sizes in bytes).
    Lines that are not CSV records (ncu's ==PROF== messages, the program's own output) are
    ignored; a file with no header gives an empty list.
    """
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    header_at = next((i for i, ln in enumerate(lines) if '"Metric Name"' in ln), None)
    if header_at is None:
        return []
    reader = csv.DictReader(io.StringIO("\n".join(lines[header_at:])))
    kernels: dict[str, dict[str, Any]] = {}
    for record in reader:
        kid = record.get("ID", "")
        if kid == "ID":  # a repeated header (one per process with --target-processes all)
            continue
        entry = kernels.setdefault(kid, {"id": kid, "kernel": record.get("Kernel Name", "")})
        name = record.get("Metric Name")
        if not name:
            continue
        raw = (record.get("Metric Value") or "").replace(",", "")
        try:
            value: Any = float(raw) * _UNIT_SCALE.get(record.get("Metric Unit") or "", 1.0)
        except ValueError:
            value = raw
        entry[name] = value

    def order(kid: str) -> tuple[int, str]:
        return (int(kid), "") if kid.isdigit() else (1 << 62, kid)

    return [kernels[k] for k in sorted(kernels, key=order)]


def assign_layers(kernels: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[dict[str, Any]]:
    """Attribute each kernel to the layer whose marker precedes it; drop markers and set-up."""
    rows: list[dict[str, Any]] = []
    layer: str | None = None
    for k in kernels:
        name = str(k.get("kernel", ""))
        if name.startswith(MARKER_PREFIX):
            suffix = name[len(MARKER_PREFIX):].split("(")[0]
            layer = labels[int(suffix)] if suffix.isdigit() and int(suffix) < len(labels) else None
            continue
        if layer is not None:
            rows.append({"layer": layer, **k})
    return rows


def _model_shapes(model: str, batch: int) -> list[tuple[str, Any, int]]:
    from convolab.models import conv_blocks

    return [(f"{model}/{b.name}", b.shape, b.pool) for b in conv_blocks(model, batch)]


def run_child(impl_name: str, model: str, batch: int) -> None:
    """The profiled program: prepare every layer, then marker + one run per layer."""
    from convolab.backend import require_cupy
    from convolab.registry import get_impl

    cp = require_cupy()
    impl = get_impl(impl_name)
    prepared = []
    for i, (_label, shape, pool) in enumerate(_model_shapes(model, batch)):
        if not impl.supports(shape) or (impl.pool and impl.pool != pool):
            continue
        x = cp.random.standard_normal(shape.x_shape, dtype=np.float32)
        w = cp.random.standard_normal(shape.w_shape, dtype=np.float32) * np.float32(0.1)
        b = cp.zeros((shape.M,), dtype=np.float32)
        run = impl.prepare(shape, w, b, impl.params_for())
        y = cp.empty(impl.out_shape(shape), dtype=np.float32)
        marker = cp.RawKernel(f'extern "C" __global__ void {MARKER_PREFIX}{i}() {{}}',
                              f"{MARKER_PREFIX}{i}")
        prepared.append((marker, run, x, y))
    cp.cuda.Device().synchronize()
    nvtx = getattr(cp.cuda, "nvtx", None)
    if nvtx is not None and getattr(nvtx, "available", False):
        nvtx.RangePush(NVTX_RANGE)
    for marker, run, x, y in prepared:
        marker((1,), (1,), ())
        run(x, y)
    cp.cuda.Device().synchronize()
    if nvtx is not None and getattr(nvtx, "available", False):
        nvtx.RangePop()
    print(f"profiled {impl_name}: {len(prepared)} layer(s)")


def _nvtx_available() -> bool:
    try:
        import cupy

        return bool(getattr(cupy.cuda.nvtx, "available", False))
    except Exception:
        return False


def profile_impl(ncu: str, impl_name: str, model: str, batch: int,
                 labels: Sequence[str]) -> list[dict[str, Any]]:
    """ncu over the child for one implementation; only the marked region if NVTX works."""
    if _nvtx_available():
        rows = _run_ncu_metrics(ncu, impl_name, model, batch, labels, nvtx=True)
        if rows:
            return rows
    # No NVTX, or the range filter matched nothing: profile everything, markers still split.
    return _run_ncu_metrics(ncu, impl_name, model, batch, labels, nvtx=False)


_metrics_in_use: list[tuple[str, ...]] = [METRICS]


def _run_ncu_metrics(ncu: str, impl_name: str, model: str, batch: int, labels: Sequence[str],
                     nvtx: bool) -> list[dict[str, Any]]:
    """The full metric set; if this ncu rejects a name, the core set from then on."""
    try:
        return _run_ncu(ncu, impl_name, model, batch, labels, nvtx, _metrics_in_use[0])
    except ConvolabError as err:
        if _metrics_in_use[0] == CORE_METRICS or "metric" not in str(err).lower():
            raise
        print(f"warning: ncu rejected a metric, using the core set: {err}", file=sys.stderr)
        _metrics_in_use[0] = CORE_METRICS
        return _run_ncu(ncu, impl_name, model, batch, labels, nvtx, CORE_METRICS)


def _run_ncu(ncu: str, impl_name: str, model: str, batch: int, labels: Sequence[str],
             nvtx: bool, metrics: Sequence[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ncu.csv"
        cmd = [ncu, "--target-processes", "all", "--csv", "--print-units", "base",
               "--log-file", str(log), "--metrics", ",".join(metrics)]
        if nvtx:
            cmd += ["--nvtx", "--nvtx-include", f"{NVTX_RANGE}/"]
        cmd += [sys.executable, "-m", "convolab.gpu.profile", "--run", impl_name,
                "--model", model, "--batch", str(batch)]
        env = dict(os.environ)
        src_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=NCU_TIMEOUT_S, check=False)
        text = log.read_text() if log.is_file() else ""
    output = proc.stdout + proc.stderr + text
    if "ERR_NVGPUCTRPERM" in output:
        raise ConvolabError("ncu may not read the GPU performance counters here "
                            "(ERR_NVGPUCTRPERM): profiling needs admin rights on this machine")
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise ConvolabError(f"ncu failed for {impl_name} (exit {proc.returncode}):\n{tail}")
    # Depending on the ncu version the records go to the log file or to stdout.
    return assign_layers(parse_ncu_csv(text + "\n" + proc.stdout), labels)


def _cell(metric: str, value: Any) -> str:
    if not isinstance(value, float):
        return str(value) if value is not None else "-"
    if metric == "gpu__time_duration.sum":
        return f"{value / 1e3:,.1f}"
    if metric.endswith("bytes.sum"):
        return f"{value / 1e6:,.1f}"
    if "pct" in metric:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def print_table(rows: Sequence[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    table = Table(title=title, title_justify="left")
    for col in ("impl", "layer", "kernel", *COLUMNS.values()):
        table.add_column(col, justify="left" if col in ("impl", "layer", "kernel") else "right")
    for r in rows:
        kernel = str(r.get("kernel", "")).split("(")[0][:32]
        table.add_row(r["impl"], r["layer"], kernel, *(_cell(m, r.get(m)) for m in METRICS))
    console.print(table)


def main(model: str, batch: int, names: Sequence[str] | None, json_out: Path | None) -> list[dict]:
    from convolab.registry import all_impls, get_impl

    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    ncu = find_ncu()
    if names:
        impls = []
        for name in names:
            try:
                impl = get_impl(name)
            except KeyError as err:
                raise ConvolabError(err.args[0]) from None
            if impl.device != "gpu":
                raise ConvolabError(f"{name!r} runs on the CPU: ncu profiles GPU kernels only")
            impls.append(impl)
    else:
        impls = all_impls(device="gpu")
    if not impls:
        raise ConvolabError("no GPU implementation is registered to profile")
    labels = [label for label, _, _ in _model_shapes(model, batch)]
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for impl in impls:
        print(f"profile: {impl.name}", file=sys.stderr, flush=True)
        try:
            rows += [{"impl": impl.name, **r}
                     for r in profile_impl(ncu, impl.name, model, batch, labels)]
        except ConvolabError as err:
            if "ERR_NVGPUCTRPERM" in str(err):
                raise
            failures[impl.name] = str(err)
        except subprocess.TimeoutExpired:
            failures[impl.name] = f"ncu did not finish within {NCU_TIMEOUT_S} s"
        if json_out is not None:  # after every implementation: partial results survive
            _write_json(json_out, model, batch, ncu, rows, failures)
    print_table(rows, f"Nsight Compute, model {model}, B={batch}")
    for name, why in failures.items():
        print(f"warning: {name}: {why}", file=sys.stderr)
    if json_out is not None:
        print(f"wrote {json_out}")
    if not rows and failures:
        raise ConvolabError(f"ncu produced no metrics for any implementation ({len(failures)} "
                            "failed; see the warnings above)")
    return rows


def _write_json(json_out: Path, model: str, batch: int, ncu: str, rows: Sequence[dict],
                failures: dict[str, str]) -> None:
    from convolab.environment import describe

    report = {**describe(True, "profile"), "model": model, "batch": batch, "ncu": ncu,
              "metrics": list(_metrics_in_use[0]), "rows": list(rows), "failures": failures}
    from convolab.outputs import write_atomic

    write_atomic(json_out, json.dumps(report, indent=1, default=str))


def _child_main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m convolab.gpu.profile",
                                     description="internal: the program ncu profiles")
    parser.add_argument("--run", required=True, metavar="IMPL")
    parser.add_argument("--model", default="ece408")
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args(argv)
    run_child(args.run, args.model, args.batch)


if __name__ == "__main__":
    _child_main()
