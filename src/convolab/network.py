"""A network is an ordered list of named layers; training uses its logits and CrossEntropyLoss."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from convolab.backend import to_device, to_numpy, xp_of
from convolab.errors import CallOrderError, InputError, InputTypeError
from convolab.layers import Conv2d, Layer, MaxPool2d, ReLU, Softmax

Array = Any


# Images a forward at a time by default: bounds memory, and keeps the BLAS and Numba thread
# pools from switching often (docs/cpu.md).
PREDICT_BATCH = 10_000


class Network:
    def __init__(self, layers: Sequence[Layer], name: str) -> None:
        if not layers:
            raise ValueError("a Network needs at least one layer")
        names = [layer.name for layer in layers if layer.param_names]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"network {name!r}: layer names must be unique, repeated {duplicates}")
        self.layers = list(layers)
        self.name = name
        self._ran: list[Layer] = []
        # Nothing upstream of the first layer wants dE/dX: skip that (large) computation.
        if hasattr(self.layers[0], "needs_input_grad"):
            self.layers[0].needs_input_grad = False

    def _run(self, x: Array, layers: list[Layer]) -> Array:
        _check_float_images(x, self.name)
        if _cpu_fusable(layers, x):
            self._ran = []  # an inference forward keeps nothing a backward could use
            return _cpu_inference(layers, x)
        self._ran = layers
        for layer in layers:
            x = layer.forward(x)
        return x

    def forward(self, x: Array) -> Array:
        """Class probabilities (the whole network, softmax head included)."""
        return self._run(x, self.layers)

    __call__ = forward

    def logits(self, x: Array) -> Array:
        """The network without a trailing Softmax: what CrossEntropyLoss wants."""
        body = self.layers[:-1] if isinstance(self.layers[-1], Softmax) else self.layers
        return self._run(x, body)

    def backward(self, grad: Array) -> None:
        """Back-propagate dE/d(output of the last forward/logits call); fills layers' grads."""
        if not self._ran:
            raise CallOrderError(f"network {self.name!r}: backward called before forward")
        for layer in reversed(self._ran):
            grad = layer.backward(grad)

    def params(self) -> dict[str, Array]:
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.params().items()}

    def grads(self) -> dict[str, Array]:
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.grads().items()}

    def set_param(self, full_name: str, value: Array) -> None:
        layer_name, _, param = full_name.rpartition(".")
        for layer in self.layers:
            if layer.name == layer_name:
                layer.set_param(param, value)
                return
        raise KeyError(f"network {self.name!r} has no parameter {full_name!r}")

    def train(self, mode: bool = True) -> Network:
        for layer in self.layers:
            layer.train(mode)
        return self

    def eval(self) -> Network:
        return self.train(False)

    def to(self, device: str) -> Network:
        """Move every parameter to 'cpu' (NumPy) or 'gpu' (CuPy), float32, contiguous."""
        for full_name, value in self.params().items():
            moved = to_device(value, device)
            xp = xp_of(moved)
            self.set_param(full_name, xp.ascontiguousarray(moved, dtype=np.float32))
        return self

    def predict(self, x: Array, batch: int = PREDICT_BATCH) -> np.ndarray:
        """Predicted class of every image, in eval mode, `batch` images at a time (NumPy out).

        The images must be floating point scaled to [0, 1] (what `data.load_images` and
        `data.resize_bilinear` return): raw 0..255 pixels would run, and give confident
        nonsense, so they are refused here. Memory is bounded by `batch`, not by len(x)."""
        if isinstance(batch, bool) or not isinstance(batch, int | np.integer) or batch < 1:
            raise InputError(f"predict: batch must be a positive int, got {batch!r}")
        _check_float_images(x, self.name)
        low, high = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
        if not (low >= 0.0 and high <= 1.0):  # NaN fails too; reductions, no temporary array
            raise InputError(
                f"predict: network {self.name!r} expects pixels scaled to [0, 1], got values "
                f"in [{low:g}, {high:g}]; divide 0..255 pixels by 255 "
                "(convolab.data.resize_bilinear scales and resizes)"
            )
        batch = int(batch)
        was_training = self.layers[0].training
        self.eval()
        try:
            out = [to_numpy(self.logits(x[i:i + batch]).argmax(axis=1))
                   for i in range(0, x.shape[0], batch)]
        finally:
            self.train(was_training)
        return np.concatenate(out) if out else np.zeros((0,), np.int64)

    def __repr__(self) -> str:
        return f"Network({self.name!r}, {[repr(layer) for layer in self.layers]})"


# The fused CPU forward runs this many bytes of the widest activation at a time: memory
# stays bounded for any batch, and each chunk still gives every thread many images.
CPU_CHUNK_BYTES = 64 * 2**20


def _cpu_fusable(layers: Sequence[Layer], x: Array) -> bool:
    """Inference on NumPy float32: the CPU fused path applies (training needs the layers'
    saved values, other dtypes their own unroll)."""
    return (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 4
            and not any(layer.training for layer in layers))


def _fused_block(layers: Sequence[Layer], i: int) -> tuple[int, int]:
    """(pool, layers consumed) when layers[i:] starts Conv2d + ReLU [+ MaxPool2d with
    stride = window] on float32 NumPy weights and no chosen impl; (0, 0) otherwise."""
    conv = layers[i]
    if not (isinstance(conv, Conv2d) and conv.impl is None and i + 1 < len(layers)
            and isinstance(layers[i + 1], ReLU)):
        return 0, 0
    for a in (conv.weight, conv.bias):
        if a is not None and not (isinstance(a, np.ndarray) and a.dtype == np.float32):
            return 0, 0
    nxt = layers[i + 2] if i + 2 < len(layers) else None
    if isinstance(nxt, MaxPool2d) and nxt.stride == nxt.kernel_size:
        return nxt.kernel_size, 3
    return 1, 2


def _cpu_steps(layers: Sequence[Layer]) -> list[Callable[[np.ndarray], np.ndarray]]:
    """Each conv + ReLU + max-pool block as one fused kernel (conv_relu_pool_cpu: the conv
    output never reaches memory); every other layer (Flatten, Linear: a BLAS GEMM, Softmax)
    as its own eval-mode forward."""
    from convolab.conv_cpu import conv_relu_pool_cpu

    steps: list[Callable[[np.ndarray], np.ndarray]] = []
    i = 0
    while i < len(layers):
        pool, used = _fused_block(layers, i)
        if used:
            conv = layers[i]
            weight = np.ascontiguousarray(conv.weight)
            steps.append(functools.partial(_conv_block, conv_relu_pool_cpu, weight, conv.bias,
                                           conv.stride, pool))
            i += used
        else:
            steps.append(layers[i].forward)
            i += 1
    return steps


def _conv_block(kernel: Callable, w: np.ndarray, b: np.ndarray | None, stride: int, pool: int,
                x: np.ndarray) -> np.ndarray:
    return kernel(np.ascontiguousarray(x), w, b, stride, pool)


def _cpu_inference(layers: Sequence[Layer], x: np.ndarray) -> np.ndarray:
    """The fused CPU forward: the conv blocks CPU_CHUNK_BYTES of activations at a time, then
    the head once over every image's features.

    Why the head waits: its GEMMs run on BLAS's own thread pool, whose threads keep spinning
    for a while after each call; interleaved with the conv kernels (Numba's pool) chunk after
    chunk, the two pools fight over the cores (10,000 test images on 2 cores: 1.70 s
    interleaved, 0.97 s head-once; docs/cpu.md). The features are smaller than the images the
    caller already holds (ece408: 1,024 floats an image against 7,396), so memory stays bounded
    by the input."""
    steps = _cpu_steps(layers)
    n_conv = next((i for i, s in enumerate(steps) if not isinstance(s, functools.partial)),
                  len(steps))
    convs, head = steps[:n_conv], steps[n_conv:]
    if x.shape[0] == 0:
        return _run_steps(head, _run_steps(convs, x))
    # The first block's output is the widest activation of a LeNet; its size per image is
    # estimated from the input (conv channels x input pixels bounds it from above).
    first = layers[0]
    channels = first.out_channels if isinstance(first, Conv2d) else x.shape[1]
    per_image = max(1, channels * x.shape[2] * x.shape[3] * 4)
    chunk = max(1, CPU_CHUNK_BYTES // per_image)
    if not convs:  # nothing fused leads the network: chunk every step alike
        convs, head = steps, []
    parts = [_run_steps(convs, x[i:i + chunk]) for i in range(0, x.shape[0], chunk)]
    features = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return _run_steps(head, features)


def _run_steps(steps: Sequence[Callable[[np.ndarray], np.ndarray]], x: np.ndarray
               ) -> np.ndarray:
    for step in steps:
        x = step(x)
    return x


def _check_float_images(x: Array, name: str) -> None:
    """Refuse integer pixels (0..255) at the network's door: a cheap dtype test, no pass over x."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not np.issubdtype(dtype, np.floating):
        shown = dtype if dtype is not None else type(x).__name__
        raise InputTypeError(
            f"network {name!r} takes floating-point images scaled to [0, 1], got {shown}; "
            "scale 0..255 pixels by 1/255 and resize them first (convolab.data.resize_bilinear)"
        )


def _check_loss_inputs(logits: Array, labels: Array) -> None:
    """One clear error for labels the loss cannot index with, before any arithmetic."""
    xp = xp_of(logits)
    shape = getattr(labels, "shape", None)
    if logits.ndim != 2 or shape != (logits.shape[0],):
        raise InputError(f"CrossEntropyLoss: logits (B, classes) and labels (B,), "
                         f"got {logits.shape} and {shape}")
    if logits.shape[0] == 0:
        raise InputError("CrossEntropyLoss: empty batch (no images, so no mean loss)")
    if not np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_:
        raise InputTypeError(f"CrossEntropyLoss: labels must be integer class indices, "
                             f"got dtype {labels.dtype}")
    classes = logits.shape[1]
    low, high = int(xp.min(labels)), int(xp.max(labels))
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise InputError(f"CrossEntropyLoss: label {bad} is outside [0, {classes}) "
                         f"for {classes} classes")


class CrossEntropyLoss:
    """Mean negative log-likelihood of softmax(logits), fused (log-sum-exp) for stability."""

    def __call__(self, logits: Array, labels: Array) -> tuple[float, Array]:
        xp = xp_of(logits)
        _check_loss_inputs(logits, labels)
        n = logits.shape[0]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_z = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        log_p = shifted - log_z
        rows = xp.arange(n)
        loss = -float(log_p[rows, labels].mean())
        grad = xp.exp(log_p)
        grad[rows, labels] -= 1
        return loss, grad / n
