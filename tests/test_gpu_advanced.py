"""GPU rungs 8-12 and 14 against the fp64 reference (cpu-ref) on fresh random shapes.

Every output is poisoned with NaN before the run, so an element a kernel forgets to write
fails (rel_l2 of a non-finite output is inf). Each rung must pass at the tolerance its
registry entry promises. Reduced-precision rungs (tf32, fp16, bf16) are checked on outputs
of at least MIN_OUT_REDUCED elements: their relative L2 error is a statistical quantity
(~3e-4 for TF32/FP16 rounding on random data), and on a handful of outputs one unlucky
rounding can exceed the promise without anything being wrong.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conv_cases import Case, make_case

from convolab.check import poison, rel_l2
from convolab.gpu import auto, tune
from convolab.gpu import ladder_advanced as adv
from convolab.gpu.device import gpu_name
from convolab.models import conv_blocks
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, get_impl
from convolab.shapes import COURSE_SELF_TESTS, ConvShape

pytestmark = pytest.mark.gpu

N_SHAPES = 100
MAX_REF_FLOPS = 4e7
MIN_OUT_REDUCED = 2048
EXACT = ["channel-tree", "channel-atomic", "tensor-core-3xtf32", "streams", "fft", "auto"]
REDUCED = ["fp16", "tensor-core-tf32", "tensor-core-fp16", "tensor-core-bf16"]
TUNED = [
    "channel-tree",
    "channel-atomic",
    "fp16",
    "tensor-core-tf32",
    "tensor-core-fp16",
    "tensor-core-bf16",
    "tensor-core-3xtf32",
    "fft",
]


def conv2(batch: int) -> ConvShape:
    """The ece408 model's second conv layer (C=4 -> M=16, K=7) at `batch` images."""
    return conv_blocks("ece408", batch)[1].shape


def random_shape(rng: np.random.Generator, min_out: int = 1) -> ConvShape:
    """Strides 1-4, K 1-7, odd sizes, C and M up to 64, B up to 8."""
    while True:
        k, s = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        c = (
            int(rng.choice([1, 2, 3, 4, 7, 16, 31, 64]))
            if rng.random() < 0.6
            else int(rng.integers(1, 65))
        )
        m = (
            int(rng.choice([1, 3, 4, 5, 16, 17, 33, 64]))
            if rng.random() < 0.6
            else int(rng.integers(1, 65))
        )
        shape = ConvShape(
            int(rng.integers(1, 9)),
            c,
            int(rng.integers(k, k + 48)),
            int(rng.integers(k, k + 48)),
            m,
            k,
            s,
        )
        n_out = shape.B * shape.M * shape.H_out * shape.W_out
        if shape.flops <= MAX_REF_FLOPS and n_out >= min_out:
            return shape


@pytest.fixture(scope="module")
def cases(module_seed: int) -> list[Case]:
    rng = np.random.default_rng(module_seed)
    return [make_case(rng, random_shape(rng)) for _ in range(N_SHAPES)]


@pytest.fixture(scope="module")
def reduced_cases(module_seed: int) -> list[Case]:
    rng = np.random.default_rng(module_seed + 1)
    return [make_case(rng, random_shape(rng, MIN_OUT_REDUCED)) for _ in range(N_SHAPES)]


def run_impl(impl: ConvImpl, case: Case, params: dict | None = None) -> float:
    import cupy as cp

    run = impl.prepare(case.shape, cp.asarray(case.w), cp.asarray(case.b), impl.params_for(params))
    y = cp.empty(impl.out_shape(case.shape), dtype=cp.float32)
    poison(y)
    run(cp.asarray(case.x), y)
    return rel_l2(y, case.ref)


def check_all(impl: ConvImpl, cases: list[Case]) -> None:
    supported = [c for c in cases if impl.supports(c.shape)]
    assert len(supported) >= N_SHAPES, f"{impl.name} supports only {len(supported)} shapes"
    failures = []
    worst = 0.0
    for case in supported:
        err = run_impl(impl, case)
        worst = max(worst, err)
        if not err <= impl.tolerance:
            failures.append(f"{case.shape}: rel_l2 {err:.3g}")
    print(f"{impl.name}: {len(supported)} shapes, worst rel_l2 {worst:.3g} (tol {impl.tolerance})")
    assert not failures, f"{impl.name} (tol {impl.tolerance}):\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("name", EXACT)
def test_exact_rungs_on_random_shapes(
    name: str, cases: list[Case], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVOLAB_CACHE", str(tmp_path))  # auto: no cache -> its heuristic
    check_all(get_impl(name), cases)


@pytest.mark.parametrize("name", REDUCED)
def test_reduced_precision_rungs_on_random_shapes(name: str, reduced_cases: list[Case]) -> None:
    check_all(get_impl(name), reduced_cases)


@pytest.mark.parametrize("name", EXACT + REDUCED)
def test_course_self_tests(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    monkeypatch.setenv("CONVOLAB_CACHE", str(tmp_path))
    impl = get_impl(name)
    for shape in COURSE_SELF_TESTS:
        if impl.supports(shape):
            err = run_impl(impl, make_case(rng, shape))
            assert err <= impl.tolerance, f"{name} on {shape}: rel_l2 {err:.3g}"


@pytest.mark.parametrize("name", TUNED)
def test_every_tuner_candidate_is_correct(name: str, rng: np.random.Generator) -> None:
    """Every parameter set in the rung's space (what the tuner may pick), two shapes."""
    impl = get_impl(name)
    shapes = [conv2(2), ConvShape(3, 19, 23, 29, 21, 3, 2)]
    test_cases = [make_case(rng, s) for s in shapes]
    grid = tune.candidates(impl.space, impl.defaults, cap=10_000)

    def compile_one(params: dict) -> None:
        try:
            for case in test_cases:
                impl.prepare(case.shape, case.w, case.b, impl.params_for(params))
        except ValueError:
            pass  # a combination the rung rejects up front (e.g. too much shared memory)

    import cupy as cp

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: compile_one({**p}), grid))
    cp.cuda.Device().synchronize()
    bad = []
    for params in grid:
        for case in test_cases:
            try:
                err = run_impl(impl, case, params)
            except ValueError:
                continue
            if not err <= impl.tolerance:
                bad.append(f"{params} on {case.shape}: {err:.3g}")
    assert not bad, "\n".join(bad)


def test_3xtf32_meets_fp32_tolerance_and_beats_tf32(rng: np.random.Generator) -> None:
    case = make_case(rng, conv2(8))
    split, tf32 = get_impl("tensor-core-3xtf32"), get_impl("tensor-core-tf32")
    err3, err1 = run_impl(split, case), run_impl(tf32, case)
    print(f"conv2: tf32 rel_l2 {err1:.3g}, 3xtf32 rel_l2 {err3:.3g}")
    assert split.tolerance == TOLERANCE["fp32"] and err3 <= split.tolerance
    assert err1 <= tf32.tolerance
    assert err3 < err1 / 20  # the split really recovers the bits TF32 drops


@pytest.mark.parametrize(("batch", "chunks", "streams"), [(13, 4, 3), (8, 8, 2), (5, 16, 4)])
def test_streams_layer_path_equals_plain(
    batch: int, chunks: int, streams: int, rng: np.random.Generator
) -> None:
    case = make_case(rng, conv2(batch))
    params = {"chunks": chunks, "streams": streams}
    y_streams = adv.layer_forward_streams(case.x, case.w, case.b, 1, params)
    y_plain = adv.layer_forward_plain(case.x, case.w, case.b, 1, inner="channel-tree")
    assert isinstance(y_streams, np.ndarray) and y_streams.shape == case.ref.shape
    np.testing.assert_array_equal(y_streams, y_plain)  # same kernel, same chunks of work
    assert rel_l2(y_streams, case.ref) <= get_impl("streams").tolerance


def test_streams_layer_path_with_fft_inner_and_bad_input(rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(6, 3, 30, 31, 5, 5, 1))
    y = adv.layer_forward_streams(case.x, case.w, case.b, 1, {"inner": "fft", "chunks": 3})
    assert rel_l2(y, case.ref) <= get_impl("fft").tolerance
    with pytest.raises(TypeError, match="float32"):
        adv.layer_forward_streams(case.x.astype(np.float64), case.w, case.b)
    with pytest.raises(ValueError, match="inner"):
        adv.layer_forward_streams(case.x, case.w, case.b, 1, {"inner": "auto"})


def test_auto_picks_cached_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    monkeypatch.setenv("CONVOLAB_CACHE", str(tmp_path))
    shape = conv2(4)
    gpu = gpu_name()
    tune.save_cache([tune.TuneEntry(gpu, shape, "fp32", "channel-atomic", {"CGROUP": 1})])
    assert auto.choose(shape) == auto.Choice("channel-atomic", {"CGROUP": 1}, "cache")

    picked: list[str] = []
    real_get_impl = auto.get_impl

    def spy(name: str) -> ConvImpl:
        picked.append(name)
        return real_get_impl(name)

    monkeypatch.setattr(auto, "get_impl", spy)
    case = make_case(rng, shape)
    assert run_impl(get_impl("auto"), case) <= get_impl("channel-atomic").tolerance
    assert picked == ["channel-atomic"]

    # An fp16 winner must never serve an fp32 request.
    tune.save_cache([tune.TuneEntry(gpu, shape, "fp32", "fp16", {})])
    assert auto.choose(shape).source == "default"
