"""convolab: a measured ladder of convolution kernels, running LeNet-5 on Fashion-MNIST.

The library API (docs/library.md) is imported on first use, so `import convolab` stays
cheap and never imports Numba, CuPy or torch."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_API: dict[str, str] = {
    "conv2d": "convolab.api",
    "conv2d_relu_pool": "convolab.api",
    "load_model": "convolab.api",
    "list_impls": "convolab.api",
    "Model": "convolab.api",
    "ImplInfo": "convolab.api",
    "ConvolabError": "convolab.errors",
    "InputError": "convolab.errors",
    "InputTypeError": "convolab.errors",
    "WeightsError": "convolab.errors",
    "DataError": "convolab.errors",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'convolab' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
