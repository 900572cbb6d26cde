"""The registry of convolution-forward implementations: the CPU ones and every GPU rung.

An implementation is prepared once per (shape, weights, parameters) — compiling kernels,
copying weights to constant memory, allocating workspace — and the prepared `run(x, y)`
then launches only the convolution itself into a preallocated output. That split is what
lets Op Time (the launches alone) and Layer Time (everything a caller pays) be measured
the course's way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convolab.backend import vector_aligned, xp_of
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape

Array = Any  # numpy.ndarray or cupy.ndarray
Run = Callable[[Array, Array], None]
Prepare = Callable[[ConvShape, Array, Array, Mapping[str, Any]], Run]

# Modules whose import registers implementations, in ladder order. GPU modules must
# import without CuPy: they touch it only inside `prepare`.
_PROVIDERS: tuple[str, ...] = (
    "convolab.conv_cpu",
    "convolab.gpu.ladder",
    "convolab.gpu.ladder_advanced",
    "convolab.gpu.fused",
    "convolab.gpu.fused_wide",
    "convolab.gpu.fused_wgmma",
    "convolab.gpu.fused_first",
    "convolab.gpu.implicit_gemm",
    "convolab.gpu.implicit_gemm_wgmma",
    "convolab.gpu.gemv",
    "convolab.gpu.gemv_mma",
    "convolab.gpu.gemv_cluster",
    "convolab.gpu.gemv_wgmma",
    "convolab.gpu.gemv_wgmma_cluster",
    "convolab.gpu.direct_conv",
    "convolab.gpu.direct_wgmma",
    "convolab.gpu.direct_image",
    "convolab.gpu.auto",
)

_REGISTRY: dict[str, ConvImpl] = {}


def _always(_: ConvShape) -> bool:
    return True


@dataclass(frozen=True)
class ConvImpl:
    """One rung of the ladder (or one CPU implementation)."""

    name: str
    demonstrates: str
    device: str  # "cpu" or "gpu"
    prepare: Prepare
    supports: Callable[[ConvShape], bool] = _always
    # Tunable parameters: name -> candidate values (the tuner's search space) and defaults.
    space: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # Max relative L2 error against cpu-ref that this rung promises (precision.TOLERANCE).
    tolerance: float = TOLERANCE["fp32"]
    rung: int | None = None  # position in the GPU ladder (docs/spec.md, Ladder; GPU only)
    kernel_file: str | None = None  # kernels/NN_name.cu
    # Every set of -D defines the host code compiles kernel_file with (CI's nvcc check).
    compile_variants: Callable[[], list[dict[str, int]]] = lambda: [{}]
    pool: int = 0  # >0: output is maxpool(relu(conv + b), pool) — the fused rungs
    reference_only: bool = False  # cpu-ref: the yardstick, not a contender

    def out_shape(self, shape: ConvShape) -> tuple[int, int, int, int]:
        if self.pool:
            return (shape.B, shape.M, shape.H_out // self.pool, shape.W_out // self.pool)
        return shape.y_shape

    def params_for(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        params = dict(self.defaults)
        for key, value in (overrides or {}).items():
            if key not in self.space and key not in self.defaults:
                raise ValueError(
                    f"{self.name}: unknown parameter {key!r} "
                    f"(known: {', '.join(sorted(set(self.space) | set(self.defaults))) or 'none'})"
                )
            params[key] = value
        return params

    def check(self, shape: ConvShape) -> None:
        if not self.supports(shape):
            raise ValueError(f"implementation {self.name!r} does not support shape {shape}")

    def forward(
        self,
        x: Array,
        w: Array,
        b: Array | None = None,
        stride: int = 1,
        **params: Any,
    ) -> Array:
        """Convenience: prepare, allocate the output and run once. (A prepared run takes x as
        CuPy allocates it: on a 16-byte boundary; here a view off one is copied first.)"""
        xp = xp_of(x)
        shape = ConvShape.of(x.shape, w.shape, stride)
        check_inputs(self, shape, x, w, b)
        if b is None:
            b = xp.zeros((shape.M,), dtype=np.float32)
        run = self.prepare(shape, w, b, self.params_for(params))
        y = xp.empty(self.out_shape(shape), dtype=np.float32)
        run(vector_aligned(x), y)
        return y


def check_inputs(impl: ConvImpl, shape: ConvShape, x: Array, w: Array, b: Array | None) -> None:
    """One clear message for the first thing wrong with a call."""
    xp = xp_of(x)
    want = np if impl.device == "cpu" else None
    if want is np and xp is not np:
        raise TypeError(f"{impl.name} runs on the CPU: pass NumPy arrays, got a CuPy array")
    if impl.device == "gpu" and xp is np:
        raise TypeError(f"{impl.name} runs on the GPU: pass CuPy arrays, got a NumPy array")
    for label, a in (("input", x), ("weights", w), ("bias", b)):
        if a is None:
            continue
        if xp_of(a) is not xp:
            raise TypeError(f"{impl.name}: {label} is on a different device than the input")
        if a.dtype != np.float32:
            raise TypeError(f"{impl.name}: {label} must be float32, got {a.dtype}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{impl.name}: {label} must be C-contiguous")
    if b is not None and tuple(b.shape) != (shape.M,):
        raise ValueError(f"{impl.name}: bias must have shape ({shape.M},), got {tuple(b.shape)}")
    impl.check(shape)


def register(impl: ConvImpl) -> ConvImpl:
    if impl.name in _REGISTRY:
        raise ValueError(f"implementation {impl.name!r} is registered twice")
    if impl.device not in ("cpu", "gpu"):
        raise ValueError(f"{impl.name}: device must be 'cpu' or 'gpu', not {impl.device!r}")
    _REGISTRY[impl.name] = impl
    return impl


def _load_providers() -> None:
    for module in _PROVIDERS:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # a provider that exists but is broken must fail loudly
                raise


def all_impls(device: str | None = None, include_reference: bool = True) -> list[ConvImpl]:
    """Every registered implementation, CPU first, then the GPU ladder in rung order."""
    _load_providers()
    impls = [
        i
        for i in _REGISTRY.values()
        if (device is None or i.device == device) and (include_reference or not i.reference_only)
    ]
    return sorted(impls, key=lambda i: (i.device != "cpu", i.rung or 0))


def get_impl(name: str) -> ConvImpl:
    _load_providers()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(i.name for i in all_impls())
        raise KeyError(f"unknown implementation {name!r}; known: {known}") from None
