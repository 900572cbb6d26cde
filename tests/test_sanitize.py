"""benchmarks/sanitize.py on the CPU: its listing covers every registered GPU implementation
without CuPy or Numba, its fp64 references of the training kernels agree with the CPU layers
(float64), and the sanitizer summary reads compute-sanitizer's counts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convolab.layers import AvgPool2d, Conv2d, MaxPool2d
from convolab.registry import all_impls

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "sanitize.py"


@pytest.fixture(scope="module")
def sanitize():
    spec = importlib.util.spec_from_file_location("sanitize_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_list_names_every_gpu_impl_without_cupy_or_numba() -> None:
    probe = (f"import sys, runpy; sys.argv=['sanitize.py','--list']\n"
             f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
             f"except SystemExit as e:\n    assert not e.code, e.code\n"
             f"assert 'numba' not in sys.modules and 'cupy' not in sys.modules, 'heavy import'\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    gpu = all_impls("gpu")
    assert gpu, "no GPU implementations registered"
    assert {f"conv:{i.name}" for i in gpu} <= names
    from convolab.models import MODELS
    from convolab.precision import NETWORK_MODES

    required = {f"network:ece408:{mode}{raw}" for mode in NETWORK_MODES for raw in ("", ":raw")}
    required |= {f"network:{model}:{mode}:raw" for model in MODELS for mode in NETWORK_MODES}
    required |= {"head:imgs16", "resize_u8"}
    from convolab.precision import TRAIN_MODES

    required |= {f"trainer:{mode}:{what}" for mode in TRAIN_MODES
                 for what in ("forward", "adam", "sgd")}
    assert required <= names, required - names
    assert any(n.startswith("backward:conv") for n in names)
    assert any(n.startswith("backward:pool") for n in names)


def test_only_selects_launches_by_name(sanitize) -> None:
    chosen = sanitize.selected("^network:|resize")
    assert chosen and all(c.name.startswith("network:") or "resize" in c.name for c in chosen)
    assert len(sanitize.selected(None)) > len(chosen)
    assert all(c.name.startswith("trainer") for c in sanitize.selected("^trainer"))
    with pytest.raises(ValueError, match="no launch name matches"):
        sanitize.selected("no-launch-is-called-this")


def test_every_gpu_impl_gets_a_shape_it_supports(sanitize) -> None:
    for impl in all_impls("gpu"):
        shape = sanitize.shape_for(impl)
        assert shape is not None and impl.supports(shape), impl.name


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv_backward_reference_matches_cpu_layer(sanitize, rng, stride: int) -> None:
    x = rng.standard_normal((3, 2, 11, 9))
    conv = Conv2d(2, 4, 3, stride=stride)
    conv.weight = rng.standard_normal((4, 2, 3, 3))
    conv.bias = rng.standard_normal(4)
    y = conv.train().forward(x)
    dy = rng.standard_normal(y.shape)
    dx = conv.backward(dy)
    rdx, rdw, rdb = sanitize.conv_backward_reference(x, conv.weight, dy, stride)
    np.testing.assert_allclose(rdx, dx, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(rdw, conv.grads()["weight"], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(rdb, conv.grads()["bias"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("k, s", [(2, 2), (3, 2), (2, 1)])
def test_pool_references_match_cpu_layers(sanitize, rng, k: int, s: int) -> None:
    x = rng.standard_normal((2, 3, 11, 10))
    coef, bias = rng.standard_normal(3), rng.standard_normal(3)
    mp = MaxPool2d(k, s).train()
    y = mp.forward(x)
    dy = rng.standard_normal(y.shape)
    ref = sanitize.pool_references(x, dy, coef, bias, k, s)
    np.testing.assert_allclose(ref["maxpool_y"], y)
    np.testing.assert_allclose(ref["maxpool_dx"], mp.backward(dy), atol=1e-12)
    sub = AvgPool2d(k, s, subsample=True, channels=3)
    sub.weight, sub.bias = coef, bias
    np.testing.assert_allclose(ref["subsample_y"], sub.forward(x), rtol=1e-12)
    np.testing.assert_allclose(ref["subsample_dx"], sub.backward(dy), atol=1e-12)
    np.testing.assert_allclose(ref["subsample_dcoef"], sub.grads()["weight"], rtol=1e-10)
    np.testing.assert_allclose(ref["subsample_dbias"], sub.grads()["bias"], rtol=1e-10)
    avg = AvgPool2d(k, s)
    avg.forward(x)
    np.testing.assert_allclose(ref["avgpool_dx"], avg.backward(dy), atol=1e-12)


def test_summary_reads_each_tools_counts(sanitize, tmp_path: Path) -> None:
    done = "sanitize: 51 launches, 0 failed (seed 0)\n"
    (tmp_path / "sanitize_memcheck.txt").write_text(done + "========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "sanitize_racecheck.txt").write_text(
        done + "========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)\n"
        "========= ERROR SUMMARY: 3 errors\n")
    (tmp_path / "sanitize_initcheck.txt").write_text("Killed\n")
    text = sanitize.write_summary(tmp_path).read_text()
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "errors 0" in lines["memcheck"] and "launches 51" in lines["memcheck"]
    assert "hazards 3" in lines["racecheck"] and "errors 3" in lines["racecheck"]
    assert "did not finish" in lines["initcheck"]
    assert "not run" in lines["synccheck"]
    # what racecheck really prints (no ERROR SUMMARY line): its errors are still read
    (tmp_path / "sanitize_racecheck.txt").write_text(
        done + "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    text = sanitize.write_summary(tmp_path).read_text()
    racecheck = next(line for line in text.splitlines() if line.startswith("racecheck"))
    assert "errors 0" in racecheck and "hazards 0" in racecheck
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
