"""The one description of a convolution problem that every implementation is asked about."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.errors import InputError, InputTypeError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def positive_int(value: Any, label: str) -> int:
    """`value` as an int, refusing what int() would silently truncate (1.9 -> 1), bools and
    anything below 1, with one message naming `label`."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise InputTypeError(f"{label} must be a positive int, got {value!r}")
    if value < 1:
        raise InputError(f"{label} must be a positive int, got {value!r}")
    return int(value)


def check_stride(stride: Any) -> int:
    return positive_int(stride, "stride")


@dataclass(frozen=True)
class ConvShape:
    """Y[b,m,h,w] = sum_c sum_p sum_q X[b,c,h*S+p,w*S+q] * W[m,c,p,q] ("valid", no flip)."""

    B: int
    C: int
    H: int
    W: int
    M: int
    K: int
    S: int = 1

    def __post_init__(self) -> None:
        for field in ("B", "C", "H", "W", "M", "K", "S"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"ConvShape.{field} must be a positive int, got {value!r}")
        if self.K > self.H or self.K > self.W:
            raise InputError(f"kernel K={self.K} is larger than the input {self.H}x{self.W}")

    @property
    def H_out(self) -> int:
        return (self.H - self.K) // self.S + 1

    @property
    def W_out(self) -> int:
        return (self.W - self.K) // self.S + 1

    @property
    def x_shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.C, self.H, self.W)

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.M, self.C, self.K, self.K)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.M, self.H_out, self.W_out)

    @property
    def flops(self) -> int:
        """Multiply-adds counted as two operations; bias not counted."""
        return 2 * self.B * self.M * self.H_out * self.W_out * self.C * self.K * self.K

    def min_bytes(self, itemsize: int = 4) -> int:
        """Each input, weight and output element moved once: the memory floor."""
        n = self.B * self.C * self.H * self.W + self.M * self.C * self.K * self.K + self.M
        return itemsize * (n + self.B * self.M * self.H_out * self.W_out)

    def with_batch(self, B: int) -> ConvShape:
        return ConvShape(B, self.C, self.H, self.W, self.M, self.K, self.S)

    @classmethod
    def of(cls, x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int = 1) -> ConvShape:
        """Build from array shapes, checking that they agree."""
        stride = check_stride(stride)
        if len(x_shape) != 4:
            raise InputError(f"input must be 4-D (B, C, H, W), got shape {tuple(x_shape)}")
        if len(w_shape) != 4 or w_shape[2] != w_shape[3]:
            raise InputError(f"weights must be 4-D (M, C, K, K), got shape {tuple(w_shape)}")
        if x_shape[1] != w_shape[1]:
            raise InputError(
                f"input has {x_shape[1]} channels but weights expect {w_shape[1]} "
                f"(x {tuple(x_shape)}, w {tuple(w_shape)})"
            )
        B, C, H, W = (int(v) for v in x_shape)
        return cls(B, C, H, W, int(w_shape[0]), int(w_shape[2]), stride)

    def __str__(self) -> str:
        return (
            f"B={self.B} C={self.C} H={self.H} W={self.W} M={self.M} K={self.K} S={self.S}"
        )


# The course's self-test cases (docs/spec.md, Correctness): (B, M, C, H, W, K, S).
COURSE_SELF_TESTS: tuple[ConvShape, ...] = tuple(
    ConvShape(B=b, C=c, H=h, W=w, M=m, K=k, S=s)
    for (b, m, c, h, w, k, s) in (
        (1, 3, 3, 224, 224, 3, 1),
        (2, 3, 3, 301, 301, 3, 2),
        (3, 3, 3, 196, 196, 3, 3),
        (4, 3, 3, 239, 239, 3, 4),
    )
)
