"""The model zoo: each entry's layers (named as in the LeNet table) and its shipped weights."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convolab.errors import WeightsError
from convolab.layers import Conv2d, Flatten, Layer, Linear, MaxPool2d, ReLU, Softmax
from convolab.network import Network
from convolab.shapes import ConvShape

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    input_size: int  # images are resized to input_size x input_size
    describe: str
    layers: Callable[[], list[Layer]]


def _ece408() -> list[Layer]:
    return [
        Conv2d(1, 4, 7, name="c1"), ReLU(), MaxPool2d(2),     # 4x80x80 -> 4x40x40
        Conv2d(4, 16, 7, name="c3"), ReLU(), MaxPool2d(4),    # 16x34x34 -> 16x8x8 (floor)
        Flatten(), Linear(1024, 32, name="f5"), ReLU(),
        Linear(32, 10, name="f6"), Softmax(),
    ]


def _ece408_mxnet() -> list[Layer]:
    return [
        Conv2d(1, 12, 5, name="c1"), ReLU(), MaxPool2d(2),    # 12x66x66 -> 12x33x33
        Conv2d(12, 24, 5, name="c3"), ReLU(), MaxPool2d(2),   # 24x29x29 -> 24x14x14 (floor)
        Flatten(), Linear(24 * 14 * 14, 10, name="f5"), Softmax(),
    ]


def _eecs498() -> list[Layer]:
    return [
        Conv2d(1, 12, 7, name="c1"), ReLU(), MaxPool2d(2),    # 12x58x58 -> 12x29x29
        Conv2d(12, 24, 7, name="c3"), ReLU(), MaxPool2d(2),   # 24x23x23 -> 24x11x11 (floor)
        Flatten(), Linear(24 * 11 * 11, 10, name="f5"), Softmax(),
    ]


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("ece408", 86, "the course LeNet-5 (docs/spec.md)", _ece408),
        ModelSpec("ece408-mxnet", 70, "a wider LeNet: conv K5 1->12, 12->24", _ece408_mxnet),
        ModelSpec("eecs498", 64, "a wider LeNet: conv K7 1->12, 12->24", _eecs498),
    )
}


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class ConvBlock:
    """One conv layer of a zoo model as the kernels see it: its shape at a batch size and the
    max-pool window that follows its ReLU (0 where none does)."""

    name: str  # the layer's parameter prefix: c1, c3
    shape: ConvShape
    pool: int


def conv_blocks(name: str, batch: int = 1) -> list[ConvBlock]:
    """The model's conv layers, in order, with their shapes at `batch` images: the one place
    layer shapes come from (benchmarks, the tuner, the fused network, the tests)."""
    model = spec(name)
    layers = model.layers()
    channels, size = 1, model.input_size
    blocks: list[ConvBlock] = []
    for i, layer in enumerate(layers):
        if isinstance(layer, Conv2d):
            shape = ConvShape(batch, channels, size, size, layer.out_channels,
                              layer.kernel_size, layer.stride)
            pool = next((p.kernel_size for p in layers[i + 1:i + 3]
                         if isinstance(p, MaxPool2d)), 0)
            blocks.append(ConvBlock(layer.name, shape, pool))
            channels, size = shape.M, shape.H_out
        elif isinstance(layer, MaxPool2d):
            size = (size - layer.kernel_size) // layer.stride + 1
    return blocks


@dataclass(frozen=True)
class DenseLayer:
    """One linear layer of a model's head (after Flatten): its parameter prefix, sizes, and
    whether a ReLU follows it."""

    name: str  # f5, f6
    in_features: int
    out_features: int
    relu: bool


def dense_layers(layers: Sequence[Layer]) -> list[DenseLayer]:
    """The head of a layer list: what follows its Flatten must be Linear [+ReLU] ... Linear,
    then Softmax (the shape every zoo model has and kernel 30 runs)."""
    if sum(isinstance(layer, Flatten) for layer in layers) != 1:
        raise ValueError("a head needs exactly one Flatten layer")
    tail = list(layers[next(i for i, x in enumerate(layers) if isinstance(x, Flatten)) + 1:])
    if not tail or not isinstance(tail[-1], Softmax):
        raise ValueError("a head must end with Softmax")
    head: list[DenseLayer] = []
    for i, layer in enumerate(tail[:-1]):
        if isinstance(layer, Linear):
            relu = isinstance(tail[i + 1], ReLU)
            head.append(DenseLayer(str(layer.name), layer.in_features, layer.out_features, relu))
        elif not (isinstance(layer, ReLU) and i > 0 and isinstance(tail[i - 1], Linear)):
            raise ValueError(f"a head holds Linear layers, each with at most one ReLU after it; "
                             f"got {type(layer).__name__} at position {i} after Flatten")
    if not head:
        raise ValueError("a head needs at least one Linear layer")
    for a, b in zip(head, head[1:], strict=False):
        if a.out_features != b.in_features:
            raise ValueError(f"head layers {a.name} -> {b.name}: {a.out_features} outputs feed "
                             f"{b.in_features} inputs")
    return head


def head_layers(name: str) -> list[DenseLayer]:
    """The zoo model's linear layers after its last conv block, with their ReLU flags."""
    return dense_layers(spec(name).layers())


def param_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model with its shape, e.g. {'c1.weight': (4, 1, 7, 7), ...}."""
    network = Network(spec(name).layers(), name)
    return {key: tuple(value.shape) for key, value in network.params().items()}


def build(name: str, seed: int = 0) -> Network:
    """A fresh network: He-normal init before ReLUs, Glorot-uniform for the last, zero bias."""
    network = Network(spec(name).layers(), name)
    rng = np.random.default_rng(seed)
    for i, layer in enumerate(network.layers):
        if not isinstance(layer, (Conv2d, Linear)):
            continue
        w = layer.weight
        fan_in = int(np.prod(w.shape[1:]))
        fan_out = w.shape[0] * int(np.prod(w.shape[2:]))
        followed_by_relu = i + 1 < len(network.layers) and isinstance(network.layers[i + 1], ReLU)
        if followed_by_relu:
            value = rng.standard_normal(w.shape) * np.sqrt(2.0 / fan_in)
        else:
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            value = rng.uniform(-limit, limit, w.shape)
        layer.weight = value.astype(np.float32)
        if layer.bias is not None:
            layer.bias = np.zeros_like(layer.bias)
    return network


def weights_path(name: str) -> Path:
    spec(name)
    return WEIGHTS_DIR / f"{name}.safetensors"


def load(name: str, path: str | os.PathLike | None = None) -> Network:
    """The model with trained weights: `path`, or the ones shipped with convolab."""
    from convolab import weights

    file = Path(path) if path is not None else weights_path(name)
    if not file.is_file():
        hint = (f"train them with `convolab train --model {name}` (writes ./{name}.safetensors) "
                f"and pass `--weights ./{name}.safetensors`" if path is None
                else "check the path")
        raise WeightsError(f"no weights for model {name!r} at {file}: {hint}")
    network = build(name)
    weights.load_into(network, file)
    return network.eval()
