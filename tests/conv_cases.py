"""A convolution problem with fresh random data and its fp64 answer, shared by the GPU tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convolab.check import poison, rel_l2
from convolab.conv_cpu import conv_reference
from convolab.registry import get_impl
from convolab.shapes import ConvShape

# VGG16's classifier layers (seed 003) at batch 1: fc6 25088 -> 4096, fc7 4096 -> 1024.
FC6, FC7 = ConvShape(1, 25088, 1, 1, 4096, 1), ConvShape(1, 4096, 1, 1, 1024, 1)


@dataclass
class Case:
    shape: ConvShape
    x: np.ndarray
    w: np.ndarray
    b: np.ndarray
    ref: np.ndarray


def make_case(rng: np.random.Generator, shape: ConvShape) -> Case:
    x = rng.standard_normal(shape.x_shape, dtype=np.float32)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32)
    b = rng.standard_normal((shape.M,), dtype=np.float32)
    return Case(shape, x, w, b, conv_reference(x, w, b, shape.S))


def outputs_of_two_runs(name: str, case: Case, params: dict | None = None) -> list:
    """Two runs of one prepared layer, each into an output poisoned with NaN first."""
    import cupy as cp

    impl = get_impl(name)
    run = impl.prepare(case.shape, cp.asarray(case.w), cp.asarray(case.b),
                       impl.params_for(params))
    x = cp.asarray(case.x)
    outs = []
    for _ in range(2):
        y = cp.empty(case.shape.y_shape, dtype=cp.float32)
        poison(y)
        run(x, y)
        outs.append(y)
    return outs


def check_two_runs(name: str, case: Case, params: dict | None, tolerance: float) -> None:
    """Two runs of one prepared layer, outputs poisoned first: the first within `tolerance` of
    the fp64 reference, the second bit-identical to it."""
    import cupy as cp

    outs = outputs_of_two_runs(name, case, params)
    err = rel_l2(outs[0], case.ref)
    assert err <= tolerance, (case.shape, params, err)
    assert bool(cp.array_equal(outs[0], outs[1])), (case.shape, params, "runs differ")


def check_classifier_layers(name: str, batch: int, rng: np.random.Generator,
                            tolerance: float) -> None:
    """fc6 and fc7 at this batch, fresh random data, against the fp64 reference."""
    for base in (FC6, FC7):
        case = make_case(rng, base.with_batch(batch))
        outs = outputs_of_two_runs(name, case)
        assert rel_l2(outs[0], case.ref) <= tolerance, (name, base, batch)
