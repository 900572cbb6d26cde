"""`convolab bench` and `convolab profile`: a real CPU run written to its results folder and
read back, the plot, clear errors, the ceilings fallback, the GPU path with a fake CuPy."""

from __future__ import annotations

import csv
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convolab import bench, environment, roofline
from convolab.bench import contenders as contenders_mod
from convolab.bench import measure, report
from convolab.bench import run as bench_run
from convolab.bench.cases import (
    CPU_BATCH_CAP,
    VGG_BATCH_224,
    LayerCase,
    cpu_batch,
    model_cases,
    vgg_cases,
)
from convolab.bench.contenders import select_contenders
from convolab.bench.specs import ImplSpec
from convolab.errors import ConvolabError
from convolab.gpu import device, profile
from convolab.models import conv_blocks
from convolab.registry import all_impls
from convolab.shapes import ConvShape


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the CPU path even on a GPU host, and keep the optional torch anchor out of it."""
    monkeypatch.setattr(bench_run, "gpu_available", lambda: False)
    monkeypatch.setattr(contenders_mod, "torch_contenders", lambda gpu: [])


def _tiny_shape(seed: int) -> str:
    """A small random conv + pool shape, B,C,H,W,M,K,S,P (fast enough for every CPU impl)."""
    r = np.random.default_rng(seed)
    k = int(r.integers(2, 4))
    h = int(r.integers(k + 4, k + 9))
    return f"2,{int(r.integers(1, 4))},{h},{h + 1},{int(r.integers(2, 5))},{k},1,2"


def test_cpu_bench_results_folder_holds_what_was_run(cpu_only: None, tmp_path: Path,
                                                     seed: int) -> None:
    shape = _tiny_shape(seed)
    impls = ["cpu-im2col", "cpu-im2col"] if "cpu-im2col" in {i.name for i in all_impls("cpu")} \
        else [all_impls("cpu", include_reference=False)[0].name] * 2
    config = bench.from_flags("ece408", 2, 3, impls=impls, custom_shapes=[shape], plot=True)
    got = bench.main([config], out=tmp_path / "run")
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    assert data["command"] == "bench" and data["device"].startswith("cpu")
    assert data["versions"]["numpy"] == np.__version__ and data["date"]
    (run,) = data["runs"]
    assert [c["shape"] for c in run["cases"]] == [str(ConvShape(*map(int, shape.split(",")[:7])))]
    assert run["cases"][0]["pool"] == 2
    rows = run["rows"]
    assert [r["impl"] for r in rows] == impls  # the same impl twice: two rows
    for r, mine in zip(rows, got["runs"][0]["rows"], strict=True):
        assert r["status"] == "ok", r
        assert r["op_samples_ms"] == mine.op_samples_ms and len(r["op_samples_ms"]) == 3
        assert r["rel_l2"] <= r["tolerance"] and r["gflops"] > 0
    with (tmp_path / "run" / "results.csv").open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert [(c["run"], c["impl"]) for c in csv_rows] == [("bench", i) for i in impls]
    assert [float(c["op_median_ms"]) for c in csv_rows] == pytest.approx(
        [r["op"]["median_ms"] for r in rows])
    if (tmp_path / "run" / "plot.png").exists() or _has_matplotlib():
        assert (tmp_path / "run" / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_impl_parameters_reach_the_row(cpu_only: None, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path, seed: int) -> None:
    """Two parameter sets of one implementation: two rows, each prepared with its own."""
    from convolab import registry

    seen: list[dict] = []
    base = all_impls("cpu", include_reference=False)[0]

    def prepare(shape: ConvShape, w: Any, b: Any, params: Any) -> Any:
        seen.append(dict(params))
        return base.prepare(shape, w, b, base.params_for())

    registry.all_impls()
    fake = registry.ConvImpl("param-cpu", "test double", "cpu", prepare,
                             space={"t": [1, 2]}, defaults={"t": 1}, supports=base.supports)
    monkeypatch.setitem(registry._REGISTRY, "param-cpu", fake)
    config = bench.from_flags("ece408", 2, 1, impls=["param-cpu", "param-cpu:t=2"],
                              custom_shapes=[_tiny_shape(seed)])
    rows = bench.main([config], out=tmp_path)["runs"][0]["rows"]
    assert [r.impl for r in rows] == ["param-cpu", "param-cpu[t=2]"]
    assert [r.params for r in rows] == [{"t": 1}, {"t": 2}]
    assert {p["t"] for p in seen} == {1, 2}


def test_unknown_impl_is_a_clear_error(cpu_only: None) -> None:
    with pytest.raises(ConvolabError, match="no-such-rung"):
        select_contenders([ImplSpec("no-such-rung")], gpu=False)


def test_unknown_impl_parameter_is_a_clear_error(cpu_only: None) -> None:
    name = all_impls("cpu", include_reference=False)[0].name
    with pytest.raises(ConvolabError, match="unknown parameter 'nope'"):
        select_contenders([ImplSpec.of(name, {"nope": 1})], gpu=False)


def test_gpu_impl_without_gpu_is_a_clear_error(cpu_only: None) -> None:
    gpu_impls = all_impls("gpu")
    if not gpu_impls:
        pytest.skip("no GPU implementation registered yet")
    with pytest.raises(ConvolabError, match="GPU"):
        select_contenders([ImplSpec(gpu_impls[0].name)], gpu=False)


def test_network_without_gpu_is_a_clear_error(cpu_only: None, tmp_path: Path) -> None:
    with pytest.raises(ConvolabError, match="--network"):
        bench.main([bench.from_flags("ece408", 2, 1, network=True)], out=tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_raw_input_without_a_gpu_contender_writes_nothing(
        cpu_only: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--input raw times GPU contenders only: with none (no GPU, or only CPU implementations
    named), one error before the results folder exists, not an empty results folder."""
    out = tmp_path / "results"
    with pytest.raises(ConvolabError, match="--input raw.*no CUDA GPU"):
        bench.main([bench.from_flags("ece408", 2, 1, inputs="raw")], out=out)
    assert not out.exists()
    monkeypatch.setattr(bench_run, "gpu_available", lambda: True)
    with pytest.raises(ConvolabError, match="--input raw.*none of this run's"):
        bench.main([bench.from_flags("ece408", 2, 1, impls=["cpu-loops"], inputs="raw")],
                   out=out)
    assert not out.exists()


def test_network_run_writes_its_rows(cpu_only: None, monkeypatch: pytest.MonkeyPatch,
                                     tmp_path: Path) -> None:
    from convolab.bench import network

    calls = []

    def fake_bench_network(batch: int, reps: int, variants: Any, per_layer: bool,
                           torch_rows: bool, model: str, inputs: str) -> list[dict]:
        calls.append((batch, reps, [v.label for v in variants], per_layer, torch_rows, model,
                      inputs))
        return [{"name": v.label, "median_ms": 1.5, "batch": batch} for v in variants]

    monkeypatch.setattr(bench_run, "gpu_available", lambda: True)
    monkeypatch.setattr(network, "bench_network", fake_bench_network)
    config = bench.from_flags("eecs498", 7, 3, network=True,
                              variants=["exact", "fp16:head.imgs=32"], inputs="raw")
    bench.main([config], out=tmp_path)
    assert calls == [(7, 3, ["fused exact", "fused fp16 [head.imgs=32]"], True, True,
                      "eecs498", "raw")]
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in data["runs"][0]["rows"]] == calls[0][2]
    with (tmp_path / "results.csv").open() as fh:
        assert [r["name"] for r in csv.DictReader(fh)] == calls[0][2]


def test_plot_without_matplotlib_is_a_clear_error(
    cpu_only: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(ConvolabError, match="matplotlib"):
        bench.main([bench.from_flags("ece408", 2, 1, plot=True)], out=tmp_path)


def test_plot_from_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    cases = model_cases("ece408", 4)
    rows = []
    for i, case in enumerate(cases):
        for name, ms in (("fast", 1.0 + i), ("torch-cpu", 3.0)):
            row = measure.Row(case.label, name, "cpu", None, name == "torch-cpu",
                              str(case.shape), 4, "fp32", tolerance=1e-5)
            row.op = timing_stats([ms, ms * 1.1])
            rows.append(row)
    out = tmp_path / "plot.png"
    report.plot_rows(out, cases, rows)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def timing_stats(samples: list[float]) -> dict[str, float]:
    from convolab.timing import Stats

    return Stats.of(samples).as_dict()


def test_model_cases_are_the_models_conv_blocks() -> None:
    cases = model_cases("ece408", 5)
    blocks = conv_blocks("ece408", 5)
    assert [(c.shape, c.pool) for c in cases] == [(b.shape, b.pool) for b in blocks]
    assert [c.label for c in cases] == [f"ece408/{b.name}" for b in blocks]


def test_vgg_cases_keep_the_output_size() -> None:
    conv1, conv5, fc6, fc7 = vgg_cases(10_000)
    assert conv1.shape.H_out == 224 and conv5.shape.H_out == 14
    assert fc6.shape.y_shape[1:] == (4096, 1, 1) and fc7.shape.C == 4096
    assert conv1.shape.B <= VGG_BATCH_224


def test_cpu_batch_respects_caps() -> None:
    shape = model_cases("ece408", 10_000)[1].shape
    assert cpu_batch(shape, "cpu-im2col") == CPU_BATCH_CAP
    assert cpu_batch(shape, "cpu-loops") <= 100
    huge = vgg_cases(16)[0].shape  # ~3.7 GFLOP per image
    assert cpu_batch(huge, "cpu-loops") == 0


def test_results_dir_is_dated_and_names_device_and_plan(tmp_path: Path) -> None:
    import datetime as dt

    day = dt.date(2026, 11, 23)
    assert report.results_dir("NVIDIA H100 80GB HBM3", "closing", day, tmp_path) == \
        tmp_path / "2026-11-23_h100_closing"
    assert report.results_dir("cpu: AMD EPYC (2 logical CPUs)", None, day, tmp_path).name == \
        "2026-11-23_cpu_bench"


def test_gpu_ceilings_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roofline, "cupy_or_none", lambda: None)
    ceil = roofline.measure_gpu_ceilings()
    assert ceil.copy_gbps == roofline.FALLBACK_GPU_COPY_GBPS
    assert ceil.fp32_gflops == roofline.FALLBACK_GPU_FP32_GFLOPS
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
    config = bench.from_flags("ece408", 64, 3, impls=gpu_impls)
    bench.main([config], out=tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())["runs"][0]["rows"]
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
    rng = np.random.default_rng(0)  # the fake device's own random inputs: any values do
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


def test_gpu_path_with_a_fake_cupy(monkeypatch: pytest.MonkeyPatch,
                                   rng: np.random.Generator) -> None:
    """Op Time, Layer Time, rotation, the cuBLAS anchor and the report, without a GPU."""
    from convolab import registry, timing
    from convolab.conv_cpu import conv_reference

    fake = _fake_cupy()
    for module in (measure, contenders_mod, roofline, device, environment):
        monkeypatch.setattr(module, "cupy_or_none", lambda: fake)
    monkeypatch.setattr(timing, "require_cupy", lambda: fake)

    def prepare(shape: ConvShape, w: Any, b: Any, params: Any) -> Any:
        def run(x: Any, y: Any) -> None:
            y[...] = conv_reference(np.asarray(x), np.asarray(w), np.asarray(b), shape.S)

        return run

    registry.all_impls()  # load the real providers first so the fake is not overwritten
    fake_impl = registry.ConvImpl("fake-gpu", "test double", "gpu", prepare, rung=99)
    monkeypatch.setitem(registry._REGISTRY, "fake-gpu", fake_impl)

    contenders, _ = select_contenders([ImplSpec("fake-gpu")], gpu=True)
    contenders.append(contenders_mod.cublas_contender())
    ceilings = {"cpu": roofline.measure_cpu_ceilings(n=128, copy_mb=4),
                "gpu": roofline.measure_gpu_ceilings()}
    assert "fallback" in ceilings["gpu"].source["copy_gbps"]  # the fake has no real copy
    cases = [model_cases("ece408", 3)[1], LayerCase("fc", ConvShape(5, 64, 1, 1, 16, 1))]
    rows = [r for case in cases
            for r in measure.bench_case(case, contenders, 4, ceilings, rng, lambda _: None)]
    by_key = {(r.case, r.impl): r for r in rows}
    conv = by_key[(cases[0].label, "fake-gpu")]
    assert conv.status == "ok", conv.detail
    assert conv.rel_l2 <= 1e-5 and len(conv.op_samples_ms) == 4
    assert conv.layer is not None and conv.layer["median_ms"] > 0
    assert (cases[0].label, "cublas-sgemm") not in by_key  # a real conv: no GEMM anchor row
    gemm = by_key[("fc", "cublas-sgemm")]
    assert gemm.status == "ok", gemm.detail
    assert gemm.rel_l2 <= 1e-5
    assert gemm.precision == "fp32" and conv.gflops > 0 and conv.roofline_pct > 0


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
    labels = [c.label for c in model_cases("ece408", 4)]
    assert [(r["layer"], r["kernel"], r["gpu__time_duration.sum"]) for r in rows] == [
        (labels[0], "k1", 3000.0), (labels[1], "k2", 900.0)]
    report = json.loads(out.read_text())
    assert report["rows"] == rows and report["failures"] == {}


def test_an_input_is_converted_once_per_buffer() -> None:
    """The contenders that take their input in another form (channels-last, fp16) convert each
    rotated buffer once, then reuse it: a new buffer is converted, a seen one is not."""
    from convolab.bench.contenders import _once_per_buffer

    calls: list[int] = []

    def convert(x: np.ndarray) -> np.ndarray:
        calls.append(id(x))
        return x * 2

    converted = _once_per_buffer(convert)
    a, b = np.ones(3), np.zeros(3)
    first = converted(a)
    assert converted(a) is first and converted(b) is not first
    assert calls == [id(a), id(b)]
    assert np.array_equal(first, 2 * a)


@pytest.mark.parametrize("batch", [2, 6])
def test_a_contender_is_checked_at_a_batch_it_supports(monkeypatch: pytest.MonkeyPatch,
                                                       rng: np.random.Generator,
                                                       batch: int) -> None:
    """A check that would run one image runs the first batch the contender supports (here
    pairs of images), and the result is still compared against the fp64 reference."""
    from convolab.conv_cpu import conv_reference

    monkeypatch.setattr(measure, "CHECK_FLOPS_PER_RUN", 0)  # every shape checks one image
    shape = ConvShape(B=batch, C=2, H=7, W=7, M=3, K=3, S=1)
    checked: list[int] = []

    def prepare(small: ConvShape, w: np.ndarray, b: np.ndarray) -> contenders_mod.Prepared:
        checked.append(small.B)
        out: dict[str, np.ndarray] = {}

        def op(x: np.ndarray) -> None:
            assert x.shape[0] % 2 == 0, "a pairing contender got an odd batch"
            out["y"] = conv_reference(x, w, b).astype(np.float32)

        return contenders_mod.Prepared(op=op, fetch=lambda: out["y"])

    pairs = contenders_mod.Contender("pairs", "cpu", "fp32", 1e-5, prepare,
                                     supports=lambda s: s.B % 2 == 0)
    assert measure.check_batch(pairs, shape) == 2
    assert measure.check_contender(pairs, shape, 0, rng) <= 1e-6
    assert checked == [2]
    anyone = contenders_mod.Contender("any", "cpu", "fp32", 1e-5, prepare)
    assert measure.check_batch(anyone, shape) == 1
