"""A convolution problem with fresh random data and its fp64 answer, shared by the GPU tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convolab.check import poison
from convolab.conv_cpu import conv_reference
from convolab.registry import get_impl
from convolab.shapes import ConvShape


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
