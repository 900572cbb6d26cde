"""`convolab verify`: passes correct implementations, catches broken ones."""

from __future__ import annotations

import numpy as np
import pytest

from convolab import registry, verify
from convolab.conv_cpu import conv_relu_pool_cpu
from convolab.errors import ConvolabError
from convolab.registry import ConvImpl
from convolab.shapes import ConvShape


def _im2col_then(damage):
    """A test implementation: cpu-im2col's result, then `damage(y)` applied to it."""
    good = registry.get_impl("cpu-im2col")

    def prepare(shape, w, b, params):
        run_good = good.prepare(shape, w, b, good.params_for(None))

        def run(x, y):
            full = np.empty_like(y)
            run_good(x, full)
            damage(full, y)

        return run

    return prepare


def _leave_last_row(full, y):
    y[:, :, :-1, :] = full[:, :, :-1, :]  # the last output row is never written


def _slightly_off(full, y):
    y[...] = full * np.float32(1 + 1e-3)


@pytest.fixture
def add_impl(monkeypatch):
    """Register a test implementation for one test only (the registry entry is removed after)."""
    registry.all_impls()  # load the real providers first

    def add(impl: ConvImpl) -> ConvImpl:
        monkeypatch.setitem(registry._REGISTRY, impl.name, impl)
        return impl

    return add


def test_main_cpu_passes(capsys) -> None:
    assert verify.main(device="cpu", names=None) is True
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out
    for name in ("cpu-loops", "cpu-im2col", "cpu-fused"):
        assert name in out
    for case in ("course-1", "course-4", "ece408-c1", "ece408-c3"):
        assert case in out


@pytest.mark.parametrize("damage", [_leave_last_row, _slightly_off], ids=["last-row", "off"])
def test_broken_impl_is_reported(add_impl, capsys, damage) -> None:
    add_impl(ConvImpl(name="test-broken", demonstrates="a bug", device="cpu",
                      prepare=_im2col_then(damage)))
    assert verify.main(device="cpu", names=["test-broken", "cpu-fused"]) is False
    out = capsys.readouterr().out
    assert "FAIL" in out
    results = verify.verify([registry.get_impl("test-broken")])
    assert results and all(r.status == "FAIL" for r in results)


def test_raising_impl_is_an_error_not_a_crash(add_impl) -> None:
    def prepare(shape, w, b, params):
        raise RuntimeError("compile failed")

    impl = add_impl(ConvImpl(name="test-raises", demonstrates="a crash", device="cpu",
                             prepare=prepare))
    results = verify.verify([impl])
    assert {r.status for r in results} == {"ERROR"}
    assert "compile failed" in results[0].message


def test_unsupported_shapes_are_skipped(add_impl) -> None:
    good = registry.get_impl("cpu-fused")
    impl = add_impl(ConvImpl(name="test-k7-only", demonstrates="narrow", device="cpu",
                             prepare=good.prepare, supports=lambda s: s.K == 7))
    results = verify.verify([impl])
    assert {r.status for r in results if r.shape.K == 7} == {"PASS"}
    assert {r.status for r in results if r.shape.K != 7} == {"UNSUPPORTED"}


def test_pooled_impl_checked_against_pooled_reference(add_impl, rng) -> None:
    def prepare(shape, w, b, params):
        def run(x, y):
            y[...] = conv_relu_pool_cpu(x, w, b, shape.S, 2)

        return run

    impl = add_impl(ConvImpl(name="test-pool2", demonstrates="fused pool", device="cpu",
                             prepare=prepare, pool=2))
    shape = ConvShape(B=2, C=4, H=40, W=40, M=16, K=7, S=1)
    assert verify.check_impl(impl, shape, rng) <= 1e-5


def test_check_impl(rng) -> None:
    impl = registry.get_impl("cpu-fused")
    shape = ConvShape(B=2, C=3, H=20, W=17, M=4, K=5, S=2)
    assert 0 < verify.check_impl(impl, shape, rng) <= impl.tolerance


def test_check_impl_detects_unwritten_row(add_impl, rng) -> None:
    impl = add_impl(ConvImpl(name="test-broken", demonstrates="a bug", device="cpu",
                             prepare=_im2col_then(_leave_last_row)))
    assert verify.check_impl(impl, ConvShape(B=1, C=1, H=9, W=9, M=1, K=3), rng) == float("inf")


def test_bad_selection_is_a_clear_error() -> None:
    with pytest.raises(ConvolabError, match="unknown implementation"):
        verify.main(device="cpu", names=["no-such-impl"])
    with pytest.raises(ValueError, match="device"):
        verify.select_impls("tpu", None)
