"""CPU convolutions against the fp64 reference, and the reference against a direct loop."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from convolab import registry
from convolab.check import poison, rel_l2
from convolab.conv_cpu import conv_reference, conv_relu_pool_cpu
from convolab.models import conv_blocks
from convolab.shapes import COURSE_SELF_TESTS, ConvShape

CPU_IMPLS = registry.all_impls("cpu", include_reference=False)
IMPL_IDS = [impl.name for impl in CPU_IMPLS]

# K values kept to a few: every (K, unit stride) pair is one Numba compile of cpu-fused.
_KS = (1, 2, 3, 5, 7)


# The parametrized shapes are drawn at collection time, before any test's seed exists: from
# this fixed seed, so a failure names a reproducible case; the data comes from `rng`.
SHAPES_SEED = 408


def _random_shapes(count: int, seed: int = SHAPES_SEED) -> list[ConvShape]:
    rng = np.random.default_rng(seed)
    shapes = [
        # K == H == W: one output pixel a map. Six maps, not one: the relative L2 error of a
        # single fp32 sum of 49 products exceeds 1e-5 on ~0.5 % of draws (when the sum nearly
        # cancels), which made this test fail now and then on a fresh seed.
        ConvShape(B=2, C=1, H=7, W=7, M=3, K=7, S=1),
        ConvShape(B=3, C=2, H=5, W=9, M=3, K=5, S=2),  # K == H, wide input
        ConvShape(B=2, C=1, H=13, W=11, M=2, K=1, S=1),  # K = 1
        ConvShape(B=2, C=3, H=21, W=19, M=4, K=3, S=4),  # odd sizes, stride 4
        conv_blocks("ece408", 1)[1].shape,  # the ece408 model's second conv layer
    ]
    while len(shapes) < count:
        K = int(rng.choice(_KS))
        H = K + int(rng.integers(0, 24))
        W = K + int(rng.integers(0, 24))
        shapes.append(
            ConvShape(
                B=int(rng.integers(1, 4)), C=int(rng.integers(1, 5)), H=H, W=W,
                M=int(rng.integers(1, 6)), K=K, S=int(rng.integers(1, 5)),
            )
        )
    return shapes


RANDOM_SHAPES = _random_shapes(50)


def _inputs(shape: ConvShape, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    x = rng.uniform(-1, 1, shape.x_shape).astype(np.float32)
    w = rng.uniform(-1, 1, shape.w_shape).astype(np.float32)
    b = rng.uniform(-1, 1, shape.M).astype(np.float32)
    return x, w, b


def _run_poisoned(impl: registry.ConvImpl, shape: ConvShape, x, w, b, **params) -> np.ndarray:
    run = impl.prepare(shape, w, b, impl.params_for(params))
    y = np.empty(impl.out_shape(shape), dtype=np.float32)
    poison(y)
    run(x, y)
    return y


def _direct_loop(x: np.ndarray, w: np.ndarray, b: np.ndarray, S: int) -> np.ndarray:
    """The definition, written out independently of conv_reference (float64, tiny shapes)."""
    B, C, H, W = x.shape
    M, _, K, _ = w.shape
    Ho, Wo = (H - K) // S + 1, (W - K) // S + 1
    y = np.zeros((B, M, Ho, Wo))
    for n in range(B):
        for m in range(M):
            for h in range(Ho):
                for v in range(Wo):
                    total = float(b[m])
                    for c in range(C):
                        for p in range(K):
                            for q in range(K):
                                total += float(x[n, c, h * S + p, v * S + q]) * float(w[m, c, p, q])
                    y[n, m, h, v] = total
    return y


def test_cpu_impls_registered() -> None:
    names = {i.name for i in registry.all_impls("cpu")}
    assert {"cpu-ref", "cpu-loops", "cpu-im2col", "cpu-fused"} <= names
    assert registry.get_impl("cpu-ref").reference_only


def test_import_does_not_load_numba() -> None:
    # GPU hosts must be able to import the registry without Numba ever loading.
    code = "import sys, convolab.conv_cpu; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("impl", CPU_IMPLS, ids=IMPL_IDS)
def test_random_shapes_match_reference(impl: registry.ConvImpl, rng: np.random.Generator) -> None:
    failures = []
    for shape in RANDOM_SHAPES:
        assert impl.supports(shape), f"{impl.name} should support {shape}"
        x, w, b = _inputs(shape, rng)
        err = rel_l2(_run_poisoned(impl, shape, x, w, b), conv_reference(x, w, b, shape.S))
        if not err <= impl.tolerance:
            failures.append(f"{shape}: rel L2 {err:.3e}")
    assert not failures, f"{impl.name} exceeds {impl.tolerance:g} on:\n" + "\n".join(failures)


@pytest.mark.parametrize("shape", COURSE_SELF_TESTS, ids=str)
@pytest.mark.parametrize("impl", CPU_IMPLS, ids=IMPL_IDS)
def test_course_self_tests(
    impl: registry.ConvImpl, shape: ConvShape, rng: np.random.Generator
) -> None:
    x, w, b = _inputs(shape, rng)
    err = rel_l2(_run_poisoned(impl, shape, x, w, b), conv_reference(x, w, b, shape.S))
    assert err <= impl.tolerance


def test_loops_parallel_variant_matches(rng: np.random.Generator) -> None:
    impl = registry.get_impl("cpu-loops")
    shape = ConvShape(B=3, C=2, H=15, W=12, M=3, K=3, S=2)
    x, w, b = _inputs(shape, rng)
    ref = conv_reference(x, w, b, shape.S)
    assert rel_l2(_run_poisoned(impl, shape, x, w, b, parallel=True), ref) <= impl.tolerance


def test_im2col_many_chunks(rng: np.random.Generator) -> None:
    # 1 MB of workspace holds less than one image here: every image is its own chunk.
    impl = registry.get_impl("cpu-im2col")
    shape = ConvShape(B=3, C=3, H=100, W=100, M=4, K=5, S=1)
    x, w, b = _inputs(shape, rng)
    y = _run_poisoned(impl, shape, x, w, b, workspace_mb=1)
    assert rel_l2(y, conv_reference(x, w, b, 1)) <= impl.tolerance


@pytest.mark.parametrize(
    "shape",
    [
        ConvShape(B=2, C=1, H=3, W=4, M=2, K=2, S=1),
        ConvShape(B=1, C=2, H=6, W=5, M=3, K=3, S=2),
        ConvShape(B=2, C=3, H=5, W=5, M=1, K=5, S=3),
        ConvShape(B=1, C=1, H=9, W=7, M=2, K=1, S=4),
    ],
    ids=str,
)
def test_reference_matches_direct_loop(shape: ConvShape, rng: np.random.Generator) -> None:
    x, w, b = (a.astype(np.float64) for a in _inputs(shape, rng))
    ref = conv_reference(x, w, b, shape.S)
    assert ref.dtype == np.float64 and ref.shape == shape.y_shape
    np.testing.assert_allclose(ref, _direct_loop(x, w, b, shape.S), rtol=1e-12, atol=1e-12)


def test_reference_chunks_over_batch(rng: np.random.Generator, monkeypatch) -> None:
    import convolab.conv_cpu as conv_cpu

    shape = ConvShape(B=5, C=2, H=9, W=8, M=3, K=3, S=1)
    x, w, b = _inputs(shape, rng)
    whole = conv_reference(x, w, b, 1)
    monkeypatch.setattr(conv_cpu, "_REF_CHUNK_BYTES", 1)  # one image per chunk
    np.testing.assert_array_equal(conv_reference(x, w, b, 1), whole)


@pytest.mark.parametrize("impl", CPU_IMPLS, ids=IMPL_IDS)
def test_bias_is_added_per_output_channel(
    impl: registry.ConvImpl, rng: np.random.Generator
) -> None:
    shape = ConvShape(B=2, C=2, H=10, W=9, M=3, K=3, S=1)
    x, w, b = _inputs(shape, rng)
    with_bias = impl.forward(x, w, b)
    without = impl.forward(x, w)  # b=None means zeros
    np.testing.assert_allclose(without, conv_reference(x, w, None, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(with_bias - without, np.broadcast_to(b[None, :, None, None],
                               with_bias.shape), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "shape,pool",
    [
        (ConvShape(B=3, C=1, H=86, W=86, M=4, K=7, S=1), 2),  # ece408 C1
        (ConvShape(B=2, C=4, H=40, W=40, M=16, K=7, S=1), 4),  # ece408 C3 (34 -> 8: floor)
        (ConvShape(B=2, C=2, H=13, W=11, M=3, K=3, S=2), 2),  # odd sizes, stride 2
    ],
    ids=str,
)
def test_conv_relu_pool_matches_reference(
    shape: ConvShape, pool: int, rng: np.random.Generator
) -> None:
    x, w, b = _inputs(shape, rng)
    y = conv_relu_pool_cpu(x, w, b, shape.S, pool)
    ref = np.maximum(conv_reference(x, w, b, shape.S), 0)
    Hp, Wp = shape.H_out // pool, shape.W_out // pool
    ref = ref[:, :, : Hp * pool, : Wp * pool].reshape(shape.B, shape.M, Hp, pool, Wp, pool)
    ref = ref.max(axis=(3, 5))
    assert y.shape == ref.shape
    assert rel_l2(y, ref) <= 1e-5
    assert (y >= 0).all()


# --------------------------------------------------------------------------- input errors


@pytest.mark.parametrize("impl", CPU_IMPLS, ids=IMPL_IDS)
def test_forward_rejects_bad_inputs(impl: registry.ConvImpl) -> None:
    x = np.zeros((1, 2, 8, 8), np.float32)
    w = np.zeros((3, 2, 3, 3), np.float32)
    with pytest.raises(TypeError, match="float32"):
        impl.forward(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="channels"):
        impl.forward(x, np.zeros((3, 1, 3, 3), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        impl.forward(np.zeros((1, 2, 8, 16), np.float32)[:, :, :, ::2], w)
    with pytest.raises(ValueError, match="larger than the input"):
        impl.forward(np.zeros((1, 2, 2, 2), np.float32), w)
    with pytest.raises(ValueError, match="bias"):
        impl.forward(x, w, np.zeros(4, np.float32))


@pytest.mark.parametrize("impl", CPU_IMPLS, ids=IMPL_IDS)
def test_prepared_run_rejects_wrong_arrays(impl: registry.ConvImpl) -> None:
    # Numba does no bounds checks: a wrong-sized array must be refused, not read past.
    shape = ConvShape(B=2, C=1, H=8, W=8, M=2, K=3, S=1)
    run = impl.prepare(shape, np.zeros(shape.w_shape, np.float32),
                       np.zeros(shape.M, np.float32), impl.params_for(None))
    y = np.empty(shape.y_shape, np.float32)
    with pytest.raises(ValueError, match="input must have shape"):
        run(np.zeros((3, 1, 8, 8), np.float32), y)
    with pytest.raises(ValueError, match="output must have shape"):
        run(np.zeros(shape.x_shape, np.float32), np.empty((2, 2, 5, 5), np.float32))
    with pytest.raises(TypeError, match="float32"):
        run(np.zeros(shape.x_shape, np.float64), y)
    with pytest.raises(ValueError, match="weights must have shape"):
        impl.prepare(shape, np.zeros((2, 1, 5, 5), np.float32), np.zeros(2, np.float32), {})


def test_public_functions_validate() -> None:
    x = np.zeros((1, 2, 8, 8), np.float32)
    w = np.zeros((3, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match="channels"):
        conv_reference(x, np.zeros((3, 1, 3, 3)), None, 1)
    with pytest.raises(ValueError, match="larger than the input"):
        conv_reference(x, np.zeros((3, 2, 9, 9)), None, 1)
    with pytest.raises(ValueError, match="positive int"):
        conv_reference(x, w, None, 0)
    with pytest.raises(TypeError, match="float32"):
        conv_relu_pool_cpu(x.astype(np.float64), w, None, 1, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        conv_relu_pool_cpu(np.asfortranarray(x), w, None, 1, 2)
    with pytest.raises(ValueError, match="pool"):
        conv_relu_pool_cpu(x, w, None, 1, 0)
    with pytest.raises(ValueError, match="larger than the conv output"):
        conv_relu_pool_cpu(x, w, None, 1, 7)
