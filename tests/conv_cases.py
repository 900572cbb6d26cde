"""A convolution problem with fresh random data and its fp64 answer, shared by the GPU tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convolab.conv_cpu import conv_reference
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
