"""`convolab bench` and `convolab profile`: CPU runs end to end, clear errors, ceilings fallback."""

from __future__ import annotations

import csv
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convolab import bench, roofline
from convolab.errors import ConvolabError
from convolab.gpu import profile
from convolab.registry import all_impls


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the CPU path even on a GPU host, and keep the optional torch anchor out of it."""
    monkeypatch.setattr(bench, "gpu_available", lambda: False)
    monkeypatch.setattr(bench, "_torch_contenders", lambda gpu: [])


def test_cpu_bench_writes_json_and_csv_rows(cpu_only: None, tmp_path: Path) -> None:
    batch, reps = 8, 2
    out = tmp_path / "bench.json"
    bench.main(model="ece408", batch=batch, names=None, reps=reps, network=False,
               shapes="model", json_out=out, plot=None)
    report = json.loads(out.read_text())
    expected_impls = {i.name for i in all_impls("cpu", include_reference=False)}
    layers = [c.label for c in bench.model_cases("ece408", batch)]
    assert [c["label"] for c in report["cases"]] == layers
    rows = report["rows"]
    expected = {(case, impl) for case in layers for impl in expected_impls}
    assert {(r["case"], r["impl"]) for r in rows} == expected
    for r in rows:
        assert r["status"] == "ok", r
        assert r["batch"] == batch
        assert len(r["op_samples_ms"]) == reps and all(t > 0 for t in r["op_samples_ms"])
        assert r["op"]["median_ms"] > 0 and r["gflops"] > 0 and r["roofline_pct"] > 0
        assert r["rel_l2"] <= r["tolerance"]
    assert report["ceilings"]["cpu"]["fp32_gflops"] > 0
    with out.with_suffix(".csv").open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert len(csv_rows) == len(rows)
    assert all(float(r["op_median_ms"]) > 0 for r in csv_rows)


def test_unknown_impl_is_a_clear_error(cpu_only: None) -> None:
    with pytest.raises(ConvolabError, match="no-such-rung"):
        bench.main(model="ece408", batch=2, names=["no-such-rung"], reps=1, network=False,
                   shapes="model", json_out=None, plot=None)


def test_gpu_impl_without_gpu_is_a_clear_error(cpu_only: None) -> None:
    gpu_impls = all_impls("gpu")
    if not gpu_impls:
        pytest.skip("no GPU implementation registered yet")
    with pytest.raises(ConvolabError, match="GPU"):
        bench.select_contenders([gpu_impls[0].name], gpu=False)


def test_bad_shape_set_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="--shapes"):
        bench.layer_cases("everything", "ece408", 4)


def test_network_without_gpu_is_a_clear_error(cpu_only: None) -> None:
    with pytest.raises(ConvolabError, match="--network"):
        bench.main(model="ece408", batch=2, names=None, reps=1, network=True,
                   shapes="model", json_out=None, plot=None)


def test_network_delegates_to_gpu_network(
    cpu_only: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = []

    def fake_bench_network(batch: int, reps: int) -> list[dict]:
        calls.append((batch, reps))
        return [{"name": "fused exact", "median_ms": 1.5, "batch": batch}]

    monkeypatch.setattr(bench, "gpu_available", lambda: True)
    monkeypatch.setitem(sys.modules, "convolab.gpu.network",
                        types.SimpleNamespace(bench_network=fake_bench_network))
    out = tmp_path / "net.json"
    bench.main(model="ece408", batch=7, names=None, reps=3, network=True,
               shapes="model", json_out=out, plot=None)
    assert calls == [(7, 3)]
    assert json.loads(out.read_text())["rows"] == fake_bench_network(7, 3)
    assert out.with_suffix(".csv").is_file()


def test_network_module_missing_is_a_clear_error(
    cpu_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "gpu_available", lambda: True)
    monkeypatch.setitem(sys.modules, "convolab.gpu.network", None)  # import now fails
    with pytest.raises(ConvolabError, match="convolab.gpu.network"):
        bench.bench_network_rows(10, 2)


def test_plot_without_matplotlib_is_a_clear_error(
    cpu_only: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(ConvolabError, match="matplotlib"):
        bench.main(model="ece408", batch=2, names=None, reps=1, network=False,
                   shapes="model", json_out=None, plot=tmp_path / "p.png")


def test_plot_from_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    cases = bench.model_cases("ece408", 4)
    rows = []
    for i, case in enumerate(cases):
        for name, ms in (("fast", 1.0 + i), ("torch-cpu", 3.0)):
            row = bench.Row(case.label, name, "cpu", None, name == "torch-cpu", str(case.shape),
                            4, "fp32", tolerance=1e-5)
            row.op = timing_stats([ms, ms * 1.1])
            rows.append(row)
    out = tmp_path / "plot.png"
    bench.plot_rows(out, cases, rows)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def timing_stats(samples: list[float]) -> dict[str, float]:
    from convolab.timing import Stats

    return Stats.of(samples).as_dict()


def test_model_cases_follow_the_network() -> None:
    c1, c3 = bench.model_cases("ece408", 5)
    got = (c1.shape.B, c1.shape.C, c1.shape.H, c1.shape.M, c1.shape.K, c1.pool)
    assert got == (5, 1, 86, 4, 7, 2)
    # C3 sees C1's pooled output: (86 - 7 + 1) // 2 = 40.
    assert (c3.shape.C, c3.shape.H, c3.shape.M, c3.shape.K, c3.pool) == (4, 40, 16, 7, 4)


def test_vgg_cases_keep_the_output_size() -> None:
    conv1, conv5, fc6, fc7 = bench.vgg_cases(10_000)
    assert conv1.shape.H_out == 224 and conv5.shape.H_out == 14
    assert fc6.shape.y_shape[1:] == (4096, 1, 1) and fc7.shape.C == 4096
    assert conv1.shape.B <= bench.VGG_BATCH_224


def test_cpu_batch_respects_caps() -> None:
    shape = bench.model_cases("ece408", 10_000)[1].shape
    assert bench.cpu_batch(shape, "cpu-im2col") == bench.CPU_BATCH_CAP
    assert bench.cpu_batch(shape, "cpu-loops") <= 100
    huge = bench.vgg_cases(16)[0].shape  # ~3.7 GFLOP per image
    assert bench.cpu_batch(huge, "cpu-loops") == 0


def test_reference_with_pool_matches_a_direct_computation(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, 11, 11)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    y = bench._reference(x, w, b, 1, 2)
    conv = np.zeros((2, 4, 9, 9))
    for p in range(3):
        for q in range(3):
            conv += np.einsum("bchw,mc->bmhw", x[:, :, p : p + 9, q : q + 9].astype(np.float64),
                              w[:, :, p, q].astype(np.float64))
    conv = np.maximum(conv + b[None, :, None, None], 0)
    expected = np.array([[[[conv[i, m, 2 * h : 2 * h + 2, 2 * v : 2 * v + 2].max()
                            for v in range(4)] for h in range(4)] for m in range(4)]
                         for i in range(2)])
    np.testing.assert_allclose(y, expected, rtol=1e-12)


def test_gpu_ceilings_fall_back_to_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roofline, "cupy_or_none", lambda: None)
    ceil = roofline.measure_gpu_ceilings()
    assert ceil.copy_gbps == roofline.SPEC_GPU_COPY_GBPS
    assert ceil.fp32_gflops == roofline.SPEC_GPU_FP32_GFLOPS
    assert all("fallback" in how for how in ceil.source.values())


def test_roofline_floor_is_the_slower_bound() -> None:
    ceil = roofline.Ceilings("x", copy_gbps=1000.0, fp32_gflops=10_000.0, tf32_gflops=80_000.0,
                             fp16_gflops=160_000.0)
    compute_bound = ceil.floor_ms(flops=1e12, nbytes=1e6)  # 100 ms compute vs 0.001 ms traffic
    assert compute_bound == pytest.approx(1e12 / 10_000e6)
    memory_bound = ceil.floor_ms(flops=1e6, nbytes=1e9, precision="tf32")
    assert memory_bound == pytest.approx(1e9 / 1000e6)
    with pytest.raises(ValueError, match="precision"):
        ceil.floor_ms(1, 1, "fp8")


def test_profile_without_ncu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile.shutil, "which", lambda _: None)
    monkeypatch.setattr(profile, "_install_candidates", lambda: [])
    with pytest.raises(ConvolabError, match="ncu"):
        profile.main(model="ece408", batch=10, names=None, json_out=None)


def test_ncu_csv_is_split_by_layer_markers() -> None:
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
              '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
              '"Metric Value"')

    def rec(kid: int, kernel: str, metric: str, unit: str, value: str) -> str:
        return (f'"{kid}","1","python","h","{kernel}","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0",'
                f'"Command line profiler metrics","{metric}","{unit}","{value}"')

    text = "\n".join([
        "==PROF== Connected to process 1",
        header,
        rec(0, "setup_fill", "gpu__time_duration.sum", "nsecond", "5"),
        rec(1, f"{profile.MARKER_PREFIX}0", "gpu__time_duration.sum", "nsecond", "1"),
        rec(2, "conv_kernel(float*)", "gpu__time_duration.sum", "usecond", "2.5"),
        rec(2, "conv_kernel(float*)", "launch__registers_per_thread", "register/thread", "40"),
        rec(3, f"{profile.MARKER_PREFIX}1", "gpu__time_duration.sum", "nsecond", "1"),
        rec(4, "unroll", "dram__bytes.sum", "byte", "1,024"),
        rec(5, "gemm", "gpu__time_duration.sum", "nsecond", "7"),
        "profiled basic: 2 layer(s)",
    ])
    rows = profile.assign_layers(profile.parse_ncu_csv(text), ["net/c1", "net/c3"])
    assert [(r["layer"], r["kernel"]) for r in rows] == [
        ("net/c1", "conv_kernel(float*)"), ("net/c3", "unroll"), ("net/c3", "gemm")]
    assert rows[0]["gpu__time_duration.sum"] == pytest.approx(2500.0)  # usecond -> ns
    assert rows[0]["launch__registers_per_thread"] == 40.0
    assert rows[1]["dram__bytes.sum"] == 1024.0


@pytest.mark.gpu
def test_gpu_bench_small_batch(tmp_path: Path) -> None:
    gpu_impls = [i.name for i in all_impls("gpu")][:3]
    if not gpu_impls:
        pytest.skip("no GPU implementation registered yet")
    out = tmp_path / "bench.json"
    bench.main(model="ece408", batch=64, names=gpu_impls, reps=3, network=False,
               shapes="model", json_out=out, plot=None)
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == set(gpu_impls)
    for r in rows:
        if r["status"] == "ok":
            assert r["op"]["median_ms"] > 0 and r["layer"]["median_ms"] > 0


# --------------------------------------------------------------------------- GPU path, faked


class _FakeDeviceArray(np.ndarray):
    """Stands in for cupy.ndarray: a NumPy array with .get()."""

    def get(self) -> np.ndarray:
        return np.array(self)


def _fake_cupy() -> types.SimpleNamespace:
    """Just enough of CuPy's surface for bench's GPU path to run on the CPU (host timers)."""
    import time

    def as_device(a: np.ndarray) -> _FakeDeviceArray:
        return np.array(a, dtype=np.float32).view(_FakeDeviceArray)

    class Event:
        def record(self) -> None:
            self.t = time.perf_counter()

        def synchronize(self) -> None:
            pass

    class Device:
        attributes = {"L2CacheSize": 1 << 20}

        def synchronize(self) -> None:
            pass

    stream = types.SimpleNamespace(synchronize=lambda: None)
    runtime = types.SimpleNamespace(
        memGetInfo=lambda: (8 << 30, 16 << 30), getDevice=lambda: 0,
        getDeviceProperties=lambda _: {"name": b"Fake GPU"},
        runtimeGetVersion=lambda: 13000, driverGetVersion=lambda: 13000)
    rng = np.random.default_rng()
    return types.SimpleNamespace(
        __version__="fake", ndarray=_FakeDeviceArray,
        asarray=as_device,
        empty=lambda shape, dtype=np.float32: np.empty(shape, dtype).view(_FakeDeviceArray),
        matmul=lambda a, b: as_device(np.matmul(a, b)),
        random=types.SimpleNamespace(standard_normal=lambda shape, dtype=np.float32:
                                     as_device(rng.standard_normal(shape, dtype=dtype))),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None),
        cuda=types.SimpleNamespace(
            Event=Event, Device=Device, runtime=runtime,
            get_current_stream=lambda: stream,
            get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3),
    )


def test_gpu_path_with_a_fake_cupy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Op Time, Layer Time, rotation, the cuBLAS anchor and the report, without a GPU."""
    from convolab import registry, timing
    from convolab.conv_cpu import conv_reference

    fake = _fake_cupy()
    for module in (bench, roofline):
        monkeypatch.setattr(module, "cupy_or_none", lambda: fake)
    monkeypatch.setattr(bench, "gpu_available", lambda: True)
    monkeypatch.setattr(timing, "require_cupy", lambda: fake)
    monkeypatch.setattr(bench, "_torch_contenders", lambda gpu: [])
    monkeypatch.setitem(sys.modules, "convolab.verify", None)  # its check wants real CuPy

    def prepare(shape: bench.ConvShape, w: Any, b: Any, params: Any) -> Any:
        def run(x: Any, y: Any) -> None:
            y[...] = conv_reference(np.asarray(x), np.asarray(w), np.asarray(b), shape.S)

        return run

    registry.all_impls()  # load the real providers first so the fake is not overwritten
    fake_impl = registry.ConvImpl("fake-gpu", "test double", "gpu", prepare, rung=99)
    monkeypatch.setitem(registry._REGISTRY, "fake-gpu", fake_impl)

    contenders, _ = bench.select_contenders(["fake-gpu"], gpu=True)
    contenders.append(bench._cublas_contender())
    ceilings = {"cpu": roofline.measure_cpu_ceilings(n=128, copy_mb=4),
                "gpu": roofline.measure_gpu_ceilings()}
    assert "fallback" in ceilings["gpu"].source["copy_gbps"]  # the fake has no real copy
    rng = np.random.default_rng()
    cases = [bench.model_cases("ece408", 3)[1],
             bench.LayerCase("fc", bench.ConvShape(5, 64, 1, 1, 16, 1))]
    rows = [r for case in cases
            for r in bench.bench_case(case, contenders, 4, ceilings, rng, lambda _: None)]
    by_key = {(r.case, r.impl): r for r in rows}
    conv = by_key[(cases[0].label, "fake-gpu")]
    assert conv.status == "ok", conv.detail
    assert conv.rel_l2 <= 1e-5 and len(conv.op_samples_ms) == 4
    assert conv.layer is not None and conv.layer["median_ms"] > 0
    assert (cases[0].label, "cublas-sgemm") not in by_key  # a real conv: no GEMM anchor row
    gemm = by_key[("fc", "cublas-sgemm")]
    assert gemm.status == "ok", gemm.detail
    assert gemm.rel_l2 <= 1e-5
    out = tmp_path / "r.json"
    report = {"rows": [r.__dict__ for r in rows]}
    bench.write_results(out, report, [bench._csv_row(r) for r in rows])
    assert len(json.loads(out.read_text())["rows"]) == len(rows)


def test_profile_end_to_end_with_a_fake_ncu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """profile.main drives ncu, splits its CSV by layer and writes the JSON (ncu faked)."""
    gpu_impls = all_impls("gpu")
    if not gpu_impls:
        pytest.skip("no GPU implementation registered yet")
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir()
    # Writes, to the --log-file it is given, two layers' worth of records around the markers.
    fake.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
assert "--metrics" in args and "--csv" in args, args
log = args[args.index("--log-file") + 1]
head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
recs = [(0, "{profile.MARKER_PREFIX}0", "nsecond", "1"), (1, "k1", "usecond", "3"),
        (2, "{profile.MARKER_PREFIX}1", "nsecond", "1"), (3, "k2", "nsecond", "900")]
with open(log, "w") as fh:
    fh.write(head + "\\n")
    for kid, name, unit, value in recs:
        fh.write(f'"{{kid}}","{{name}}","gpu__time_duration.sum","{{unit}}","{{value}}"\\n')
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{Path(sys.executable).parent}")
    out = tmp_path / "profile.json"
    rows = profile.main(model="ece408", batch=4, names=[gpu_impls[0].name], json_out=out)
    labels = [c.label for c in bench.model_cases("ece408", 4)]
    assert [(r["layer"], r["kernel"], r["gpu__time_duration.sum"]) for r in rows] == [
        (labels[0], "k1", 3000.0), (labels[1], "k2", 900.0)]
    report = json.loads(out.read_text())
    assert report["rows"] == rows and report["failures"] == {}
