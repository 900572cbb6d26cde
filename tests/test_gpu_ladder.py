"""GPU rungs 1-7 against the fp64 reference on fresh random shapes and the course self-tests.

Every output buffer is poisoned with NaN before the run, so an element a kernel forgets to
write fails (rel_l2 of a non-finite output is inf). Kernels are prepared (compiled) in parallel
threads, then run one by one.
"""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conv_cases import Case, make_case

from convolab.check import poison, rel_l2
from convolab.gpu import ladder
from convolab.models import ConvBlock, conv_blocks
from convolab.registry import ConvImpl
from convolab.shapes import COURSE_SELF_TESTS, ConvShape

pytestmark = pytest.mark.gpu

N_RANDOM_SHAPES = 120
MAX_REF_FLOPS = 6e7  # keeps the fp64 reference (and the whole file) fast
LADDER = {impl.name: impl for impl in ladder.LADDER}


def random_shape(rng: np.random.Generator) -> ConvShape:
    """Strides 1-4, K 1-7, odd and even sizes, C and M up to 64 (small ones more often)."""
    while True:
        k, s = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        c = int(rng.choice([1, 2, 3, 4, 5, 7, 16, 31, 64])) if rng.random() < 0.7 else int(
            rng.integers(1, 65)
        )
        m = int(rng.choice([1, 3, 4, 6, 8, 12, 16, 17, 33, 64])) if rng.random() < 0.7 else int(
            rng.integers(1, 65)
        )
        h = int(rng.integers(k, k + 45))
        w = int(rng.integers(k, k + 45))
        shape = ConvShape(int(rng.integers(1, 9)), c, h, w, m, k, s)
        if shape.flops <= MAX_REF_FLOPS:
            return shape


@pytest.fixture(scope="module")
def random_cases(module_seed: int) -> list[Case]:
    rng = np.random.default_rng(module_seed)
    return [make_case(rng, random_shape(rng)) for _ in range(N_RANDOM_SHAPES)]


@pytest.fixture(scope="module")
def course_cases(module_seed: int) -> list[Case]:
    rng = np.random.default_rng(module_seed + 1)
    return [make_case(rng, shape) for shape in COURSE_SELF_TESTS]


def run_cases(impl: ConvImpl, cases: list[Case], params: dict | None = None) -> list[str]:
    """Prepare every supported case (compiles in parallel threads), run each, list failures."""
    import cupy as cp

    todo = [c for c in cases if impl.supports(c.shape)]
    inputs = [(cp.asarray(c.w), cp.asarray(c.b)) for c in todo]
    merged = impl.params_for(params)

    def prepare(i: int):
        return impl.prepare(todo[i].shape, *inputs[i], merged)

    # Constant-memory rungs hand out slices of one bank: prepare those one at a time.
    workers = 1 if impl.name in ("constant", "restrict-unroll") else 8
    failures = []
    if workers == 1:
        prepared = None
    else:
        with ThreadPoolExecutor(workers) as pool:
            prepared = list(pool.map(prepare, range(len(todo))))
    for i, case in enumerate(todo):
        run = prepare(i) if prepared is None else prepared[i]
        y = cp.empty(impl.out_shape(case.shape), dtype=cp.float32)
        poison(y)
        run(cp.asarray(case.x), y)
        err = rel_l2(y, case.ref)
        if not err <= impl.tolerance:
            failures.append(f"{case.shape}: rel L2 {err:.3g}")
        # Release this case's workspace / constant-memory slice before preparing the next.
        del run
        if prepared is not None:
            prepared[i] = None
    return failures


@pytest.mark.parametrize("name", list(LADDER))
def test_random_shapes_match_reference(name: str, random_cases: list[Case]) -> None:
    impl = LADDER[name]
    covered = sum(impl.supports(c.shape) for c in random_cases)
    # Only the constant-memory rungs may refuse shapes (weights larger than the bank).
    floor = 30 if name in ("constant", "restrict-unroll") else len(random_cases)
    assert covered >= floor, f"{name} supports only {covered} of {len(random_cases)} shapes"
    failures = run_cases(impl, random_cases)
    assert not failures, f"{name}: {len(failures)} wrong of {covered}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", list(LADDER))
def test_course_self_tests(name: str, course_cases: list[Case]) -> None:
    impl = LADDER[name]
    assert all(impl.supports(c.shape) for c in course_cases)
    failures = run_cases(impl, course_cases)
    assert not failures, f"{name}: " + "\n".join(failures)


@pytest.mark.parametrize(
    ("name", "param", "value"),
    [
        (impl.name, key, value)
        for impl in ladder.LADDER
        for key, values in impl.space.items()
        for value in values
        if value != impl.defaults.get(key)
    ],
)
def test_every_search_space_value(
    name: str, param: str, value: int, random_cases: list[Case]
) -> None:
    """The tuner may pick any value in a rung's space: each must be correct on its own."""
    impl = LADDER[name]
    cases = [c for c in random_cases if impl.supports(c.shape)][:6]
    failures = run_cases(impl, cases, {param: value})
    assert not failures, f"{name} {param}={value}: " + "\n".join(failures)


def test_register_tiled_pipelined_random_shapes(random_cases: list[Case]) -> None:
    """The persistent, double-buffered variant walks many tiles and channel chunks per block."""
    failures = run_cases(ladder.REGISTER_TILED, random_cases, {"PIPE": 1})
    assert not failures, "register-tiled PIPE=1:\n" + "\n".join(failures)


def test_unroll_gemm_multiple_chunks(monkeypatch: pytest.MonkeyPatch, rng) -> None:
    """A workspace smaller than the batch forces several passes, the last one short."""
    shape = ConvShape(B=7, C=3, H=23, W=19, M=5, K=5, S=2)
    per_image = shape.C * shape.K * shape.K * shape.H_out * shape.W_out * 4
    monkeypatch.setattr(ladder, "UNROLL_WORKSPACE_BYTES", 2 * per_image)
    assert ladder.unroll_chunk(shape) == 2
    assert not run_cases(ladder.UNROLL_GEMM, [make_case(rng, shape)])


@pytest.mark.parametrize("block", conv_blocks("ece408", 10_000), ids=lambda b: b.name)
def test_ece408_layer_configs_pad_nothing_in_m(block: ConvBlock) -> None:
    """Each ece408 conv layer (M=4, M=16) gets a register tile whose M-extent is exactly M."""
    assert ladder.register_tiled_config(block.shape, {})["TM"] == block.shape.M


@pytest.mark.parametrize("name", ["constant", "restrict-unroll"])
def test_constant_rungs_refuse_weights_that_do_not_fit(name: str) -> None:
    import cupy as cp

    impl = LADDER[name]
    too_big = ConvShape(B=1, C=64, H=9, W=9, M=64, K=7)  # 200704 floats > the bank
    assert not impl.supports(too_big)
    w = cp.zeros(too_big.w_shape, dtype=cp.float32)
    b = cp.zeros((too_big.M,), dtype=cp.float32)
    with pytest.raises(ValueError, match="constant"):
        impl.prepare(too_big, w, b, impl.params_for())


@pytest.mark.parametrize("name", ["constant", "restrict-unroll"])
def test_constant_rungs_keep_layers_apart(name: str, rng) -> None:
    """Two layers prepared on one compiled module each keep their own weights; a full bank
    refuses cleanly and frees slices when prepared runs go away."""
    impl = LADDER[name]
    shape = ConvShape(B=2, C=4, H=20, W=20, M=16, K=7)  # 3136 floats: 4 fit, the 5th does not
    first, second = make_case(rng, shape), make_case(rng, shape)
    import cupy as cp

    def prep(case: Case):
        return impl.prepare(shape, cp.asarray(case.w), cp.asarray(case.b), impl.params_for())

    runs = [prep(first), prep(second)]
    for run, case in zip(runs, (first, second), strict=True):
        y = cp.empty(shape.y_shape, dtype=cp.float32)
        poison(y)
        run(cp.asarray(case.x), y)
        assert rel_l2(y, case.ref) <= impl.tolerance
    runs += [prep(first), prep(first)]
    with pytest.raises(ValueError, match="constant memory is full"):
        prep(first)
    del runs
    gc.collect()
    assert not run_cases(impl, [first])
