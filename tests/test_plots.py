"""The ladder chart and the roofline drawn from a results file, and the roofline's arithmetic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from convolab.bench import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLOSING = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-23_h100_closing"


def test_roofline_math_on_a_tiny_case():
    # 200 GFLOP over 10 GB: 20 FLOP/byte; with 100 GB/s the roof is 2000, under a 5000 peak.
    i = report.intensity(200e9, 10e9)
    assert i == pytest.approx(20.0)
    assert report.attainable_gflops(i, 5000.0, 100.0) == pytest.approx(2000.0)
    assert report.attainable_gflops(100.0, 5000.0, 100.0) == pytest.approx(5000.0)  # compute-bound
    row = report.Row("l", "x", "gpu", 1, False, "", 1, "fp32", gflops=400.0, gbps=20.0,
                     op={"median_ms": 1.0})
    assert report._row_intensity(row) == pytest.approx(20.0)


def _small_results(tmp_path: Path) -> Path:
    """The closing run's results, cut to its first rows per device: a real file, small."""
    record = json.loads((CLOSING / "bench.json").read_text())
    keep = []
    for device in ("gpu", "cpu"):
        keep += [r for r in record["rows"] if r["device"] == device][:4]
    record["rows"] = keep
    path = tmp_path / "results.json"
    path.write_text(json.dumps(record))
    return path


def test_plot_results_writes_ladder_and_roofline(tmp_path):
    pytest.importorskip("matplotlib")
    written = report.plot_results(_small_results(tmp_path), tmp_path / "out")
    assert [p.name for p in written] == ["plot.png", "roofline.png"]
    for p in written:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_roofline_path_names():
    assert report.roofline_path(Path("a/plot.png")) == Path("a/roofline.png")
    assert report.roofline_path(Path("a/plot_x.png")) == Path("a/roofline_x.png")


def test_plot_results_refuses_a_non_results_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(report.ConvolabError, match="not a convolab bench results file"):
        report.plot_results(bad, tmp_path)


def test_docs_images_come_from_the_closing_results(tmp_path):
    """docs/img/*.png are redrawn from the results the docs quote: same size as a fresh draw."""
    pytest.importorskip("matplotlib")
    shutil.copy(CLOSING / "bench.json", tmp_path / "bench.json")
    written = report.plot_results(tmp_path / "bench.json", tmp_path)
    docs = CLOSING.parents[2] / "docs/img"
    for fresh, doc in zip(written, ("ladder.png", "roofline.png"), strict=True):
        assert (docs / doc).read_bytes()[:8] == PNG_MAGIC
        assert abs(len(fresh.read_bytes()) - len((docs / doc).read_bytes())) < 0.02 * len(
            fresh.read_bytes())


def _sweep_file(path: Path, batches: tuple[int, ...], gflops: float) -> Path:
    """A results file of one run per batch, each with one timed GPU row of layer 'L'."""
    runs = [{"label": f"b{b}", "config": {"batch": b}, "cases": [{"label": "L"}],
             "rows": [{"case": "L", "impl": "mine", "device": "gpu", "batch": b, "rung": 1,
                       "shape": "1,1,8,8,1,3,1",
                       "anchor": False, "precision": "fp32", "gflops": gflops * b,
                       "op": {"median_ms": 1.0}}]} for b in batches]
    path.write_text(json.dumps({"runs": runs}))
    return path


def test_plot_sweeps_merges_files_and_the_later_file_wins(tmp_path):
    pytest.importorskip("matplotlib")
    early = _sweep_file(tmp_path / "a.json", (1, 2, 4), 10.0)
    late = _sweep_file(tmp_path / "b.json", (4, 8), 20.0)
    runs = [run for f in (early, late) for run in report._load_runs(f)[0]]
    line = report._sweep_lines(runs)["L"]["mine"]
    assert [b for b, _ in line] == [1, 2, 4, 8]
    assert [r.gflops for _, r in line] == [10.0, 20.0, 80.0, 160.0]  # batch 4 from b.json
    written = report.plot_sweeps([early, late], tmp_path / "out")
    assert [p.name for p in written] == ["sweep_l.png"]
    assert written[0].read_bytes()[:8] == PNG_MAGIC


def test_plot_sweeps_needs_two_batches(tmp_path):
    one = _sweep_file(tmp_path / "a.json", (4,), 1.0)
    with pytest.raises(report.ConvolabError, match="fewer than two batch sizes"):
        report.plot_sweeps([one, one], tmp_path)


def test_sweep_case_drops_an_explicit_shapes_batch():
    assert report._sweep_case("shape/16x4096x1x1-M1024K1S1") == "shape/Bx4096x1x1-M1024K1S1"
    assert report._sweep_case("vgg/fc7") == "vgg/fc7"


def test_one_file_of_explicit_shapes_at_several_batches_is_a_sweep(tmp_path):
    """Runs whose batches live in explicit shapes ("shape/8x…"), not in their config, still
    draw one sweep figure per layer from a single results file."""
    pytest.importorskip("matplotlib")
    path = _sweep_file(tmp_path / "a.json", (1, 8, 64), 10.0)
    record = json.loads(path.read_text())
    for run in record["runs"]:
        b = run["rows"][0]["batch"]
        run["config"] = {}
        run["cases"] = [{"label": f"shape/{b}x64x1x1-M32K1S1"}]
        run["rows"][0]["case"] = f"shape/{b}x64x1x1-M32K1S1"
    path.write_text(json.dumps(record))
    written = report.plot_results(path, tmp_path / "out")
    sweeps = [p for p in written if p.name.startswith("sweep_")]
    assert [p.name for p in sweeps] == ["sweep_shape-bx64x1x1-m32k1s1.png"]
    assert sweeps[0].read_bytes()[:8] == PNG_MAGIC
