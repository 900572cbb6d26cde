"""The layers of convolab's networks: forward and backward, for NumPy and CuPy arrays alike.

Every layer takes its array module from its input (`xp_of`), so the same objects run on the
CPU and the GPU. Convolution follows the textbook (PMPP ch. 16): no flip, "valid" only,
`Y[b,m,h,w] = sum_c,p,q X[b,c,h*S+p,w*S+q] W[m,c,p,q]`. Its backward unrolls the input
(im2col) so both dE/dW and dE/dX are GEMMs, which BLAS (or cuBLAS) does fast.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from convolab.backend import vector_aligned, xp_of
from convolab.errors import CallOrderError, InputError
from convolab.shapes import ConvShape, positive_int

Array = Any  # numpy.ndarray or cupy.ndarray


class Layer:
    """Base: `forward` caches what `backward` needs; `backward(dE/dY)` returns dE/dX."""

    param_names: tuple[str, ...] = ()

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__.lower()
        self.training = True
        self._grads: dict[str, Array] = {}

    def forward(self, x: Array) -> Array:
        raise NotImplementedError

    def backward(self, grad: Array) -> Array:
        raise NotImplementedError

    def __call__(self, x: Array) -> Array:
        return self.forward(x)

    def params(self) -> dict[str, Array]:
        return {n: getattr(self, n) for n in self.param_names if getattr(self, n) is not None}

    def grads(self) -> dict[str, Array]:
        return dict(self._grads)

    def set_grads(self, grads: dict[str, Array]) -> None:
        """Store gradients a backward computed elsewhere (the GPU kernels) as this layer's."""
        unknown = set(grads) - set(self.param_names)
        if unknown:
            raise KeyError(f"layer {self.name!r} has no parameter {', '.join(sorted(unknown))}")
        self._grads.update(grads)

    def set_param(self, name: str, value: Array) -> None:
        if name not in self.param_names:
            raise KeyError(f"layer {self.name!r} has no parameter {name!r}")
        setattr(self, name, value)

    def train(self, mode: bool = True) -> Layer:
        self.training = mode
        return self

    def eval(self) -> Layer:
        return self.train(False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def _saved(self, attr: str) -> Array:
        """What the last training-mode forward kept for the backward; one clear error if none
        (backward before any forward, or after an eval-mode forward or a consuming backward)."""
        value = getattr(self, attr, None)
        if value is None:
            raise CallOrderError(
                f"{self.name}: backward called before forward (it needs the values a "
                "training-mode forward keeps; none are kept in eval mode or after a backward)"
            )
        return value

    def _check_4d(self, x: Array) -> None:
        if getattr(x, "ndim", None) != 4:
            raise InputError(
                f"{self.name}: expected a 4-D input (B, C, H, W), got shape "
                f"{tuple(getattr(x, 'shape', ()))}"
            )


def _windows(n_out: int, start: int, stride: int) -> slice:
    """The input rows (or columns) that kernel offset `start` touches for n_out outputs."""
    return slice(start, start + stride * (n_out - 1) + 1, stride)


def im2col(x: Array, k: int, stride: int = 1) -> Array:
    """(B, C, H, W) -> (C*k*k, B*H_out*W_out): one column per output pixel of every image, rows
    in (c, p, q) order, so W.reshape(M, -1) @ cols is the whole batch's convolution as ONE GEMM
    (BLAS threads well on one large product, poorly on B small ones). k*k slice copies."""
    xp = xp_of(x)
    b, c, h, w = x.shape
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    channels_first = x.transpose(1, 0, 2, 3)
    cols = xp.empty((c, k, k, b, ho, wo), dtype=x.dtype)
    for p in range(k):
        for q in range(k):
            cols[:, p, q] = channels_first[:, :, _windows(ho, p, stride), _windows(wo, q, stride)]
    return cols.reshape(c * k * k, b * ho * wo)


def col2im(cols: Array, x_shape: tuple[int, ...], k: int, stride: int = 1) -> Array:
    """The adjoint of im2col: scatter-add each column entry back to the input pixel it came from."""
    xp = xp_of(cols)
    b, c, h, w = x_shape
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    per_offset = cols.reshape(c, k, k, b, ho, wo)
    dx = xp.zeros((c, b, h, w), dtype=cols.dtype)
    for p in range(k):
        for q in range(k):
            dx[:, :, _windows(ho, p, stride), _windows(wo, q, stride)] += per_offset[:, p, q]
    return dx.transpose(1, 0, 2, 3)


class Conv2d(Layer):
    """Valid convolution with stride. The forward comes from the registry (`impl`, default
    'cpu-im2col' on NumPy; on CuPy the caller names a GPU rung, else cuBLAS im2col here); this
    module's own unroll is the fallback (also for float64, which the registry does not take).

    Training calls `impl.forward` every step and keeps only x: the backward re-unrolls it a few
    images at a time (cache-sized) rather than holding a batch-sized unrolled matrix. Prepared
    plans are cached only in eval mode, when the weights are fixed."""

    param_names = ("weight", "bias")

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 bias: bool = True, impl: str | None = None, name: str | None = None) -> None:
        super().__init__(name)
        for label, v in (("in_channels", in_channels), ("out_channels", out_channels),
                         ("kernel_size", kernel_size), ("stride", stride)):
            positive_int(v, f"Conv2d {label}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.impl = kernel_size, stride, impl
        self.weight = np.zeros((out_channels, in_channels, kernel_size, kernel_size), np.float32)
        self.bias = np.zeros((out_channels,), np.float32) if bias else None
        self.needs_input_grad = True  # the first layer of a network skips dE/dX
        self._plans: dict[tuple, Any] = {}

    def _registry_impl(self, x: Array) -> Any | None:
        """The registered implementation to use for x, or None for this module's own im2col."""
        from convolab.registry import get_impl

        name = self.impl or ("cpu-im2col" if xp_of(x) is np else None)
        if name is None:
            return None
        try:
            impl = get_impl(name)
        except KeyError:
            if self.impl is not None:  # a name the caller asked for must exist
                raise
            return None  # default impl not written yet: fall back to the own unroll
        if impl.pool:
            raise ValueError(f"Conv2d: {name!r} fuses pooling; use it for a whole block, not here")
        return impl

    # On the CPU the unrolled matrix is built a few images at a time, small enough to stay in
    # cache: the GEMMs here are thin (M = 4 or 16 rows), so streaming a whole batch's 50-80 MB
    # matrix through DRAM cost more than the arithmetic (measured: 2x slower per step).
    _CPU_CHUNK_BYTES = 4 * 2**20

    def _chunk(self, s: ConvShape, xp: Any) -> int:
        if xp is not np:
            return s.B  # GPU memory bandwidth makes one big GEMM the better trade
        return max(1, self._CPU_CHUNK_BYTES // (s.C * s.K * s.K * s.H_out * s.W_out * 4))

    def _own_forward(self, x: Array) -> Array:
        if self.training:
            self._x, self._cols = x, None
        xp = xp_of(x)
        s = ConvShape.of(x.shape, self.weight.shape, self.stride)
        w2 = self.weight.reshape(s.M, -1)
        y = xp.empty(s.y_shape, dtype=xp.result_type(x, self.weight))
        n = self._chunk(s, xp)
        for i in range(0, s.B, n):
            part = (w2 @ im2col(x[i:i + n], self.kernel_size, self.stride))
            y[i:i + n] = part.reshape(s.M, -1, s.H_out, s.W_out).transpose(1, 0, 2, 3)
        if self.bias is not None:
            y += self.bias[:, None, None]
        return y

    def forward(self, x: Array) -> Array:
        shape = ConvShape.of(x.shape, self.weight.shape, self.stride)
        impl = None if x.dtype != np.float32 else self._registry_impl(x)
        if impl is None:
            return self._own_forward(x)
        if self.training:
            self._x, self._cols = x, None  # the backward re-unrolls x chunk by chunk
            return impl.forward(x, self.weight, self.bias, self.stride)
        xp = xp_of(x)
        bias = self.bias if self.bias is not None else xp.zeros((shape.M,), np.float32)
        key = (shape, impl.name, id(self.weight), id(self.bias))
        if key not in self._plans:
            self._plans = {key: impl.prepare(shape, self.weight, bias, impl.params_for())}
        y = xp.empty(impl.out_shape(shape), dtype=np.float32)
        self._plans[key](vector_aligned(xp.ascontiguousarray(x)), y)
        return y

    def pop_input(self) -> Array | None:
        """The input the last training-mode forward kept for the backward, handed over and
        forgotten so the activation is freed as soon as it is used (None if there is none)."""
        x, self._x, self._cols = getattr(self, "_x", None), None, None
        return x

    def backward(self, grad: Array) -> Array | None:
        xp = xp_of(grad)
        if xp is not np:  # GPU: hand-written backward kernels (convolab.gpu.backward)
            self._saved("_x")
            from convolab.gpu.backward import conv2d_layer_backward
            return conv2d_layer_backward(self, grad)
        x, k, stride = self._saved("_x"), self.kernel_size, self.stride
        s = ConvShape.of(x.shape, self.weight.shape, stride)
        w2 = self.weight.reshape(s.M, -1)
        dtype = xp.result_type(x, grad, self.weight)
        dw = xp.zeros(w2.shape, dtype=dtype)
        dx = xp.empty(x.shape, dtype=dtype) if self.needs_input_grad else None
        n = self._chunk(s, xp)
        for i in range(0, s.B, n):
            gy = xp.ascontiguousarray(grad[i:i + n].transpose(1, 0, 2, 3)).reshape(s.M, -1)
            # dE/dW = sum over images and output pixels of dY x unrolled input (fig. 16.7).
            dw += gy @ im2col(x[i:i + n], k, stride).T
            if dx is not None:
                # dE/dX: W^T spreads each dY over its receptive field (fig. 16.6), via col2im.
                dx[i:i + n] = col2im(w2.T @ gy, x[i:i + n].shape, k, stride)
        self._grads["weight"] = dw.reshape(self.weight.shape)
        if self.bias is not None:
            self._grads["bias"] = grad.sum(axis=(0, 2, 3))
        self._cols = self._x = None
        return dx

    def train(self, mode: bool = True) -> Layer:
        self._plans = {}  # weights may change in training: never reuse a prepared plan
        return super().train(mode)


class ReLU(Layer):
    def forward(self, x: Array) -> Array:
        self._mask = x > 0
        return x * self._mask

    def backward(self, grad: Array) -> Array:
        return grad * self._saved("_mask")


class _Pool(Layer):
    """Shared window bookkeeping for pooling; floor mode (a partial window is dropped)."""

    def __init__(self, kernel_size: int, stride: int | None = None, name: str | None = None):
        super().__init__(name)
        self.kernel_size = positive_int(kernel_size, "pool kernel_size")
        self.stride = self.kernel_size if stride is None else positive_int(stride, "pool stride")

    def _out_hw(self, x: Array) -> tuple[int, int]:
        self._check_4d(x)
        k, s = self.kernel_size, self.stride
        h, w = x.shape[2:]
        if h < k or w < k:
            raise InputError(f"{self.name}: input {h}x{w} is smaller than the {k}x{k} window")
        return (h - k) // s + 1, (w - k) // s + 1

    def _offsets(self, ho: int, wo: int) -> list[tuple[slice, slice]]:
        k, s = self.kernel_size, self.stride
        return [(_windows(ho, p, s), _windows(wo, q, s)) for p in range(k) for q in range(k)]


class MaxPool2d(_Pool):
    def forward(self, x: Array) -> Array:
        xp = xp_of(x)
        ho, wo = self._out_hw(x)
        if xp is not np:  # GPU: kernels that recompute the argmax in backward (gpu/backward.py)
            from convolab.gpu.backward import maxpool2d_forward
            self._x = x if self.training else None
            self._y = maxpool2d_forward(x, self.kernel_size, self.stride)
            return self._y
        # A running maximum over the k*k window offsets: k*k vectorised passes, no (.., k*k)
        # window copy and no argmax along a tiny last axis (both several times slower).
        (r0, c0), *rest = self._offsets(ho, wo)
        y = x[:, :, r0, c0].copy()
        for r, c in rest:
            xp.maximum(y, x[:, :, r, c], out=y)
        self._x, self._y = (x, y) if self.training else (None, None)
        return y

    def backward(self, grad: Array) -> Array:
        xp = xp_of(grad)
        if xp is not np:
            from convolab.gpu.backward import maxpool2d_backward
            dx = maxpool2d_backward(self._saved("_x"), self._y, grad, self.kernel_size, self.stride)
            self._x = self._y = None
            return dx
        x, y = self._saved("_x"), self._y
        dx = xp.zeros(x.shape, dtype=xp.result_type(x, grad))
        # The first maximum of each window (in offset order) gets the whole gradient: a valid
        # subgradient on ties, and a tie never counts twice.
        unclaimed = xp.ones(y.shape, dtype=bool)
        for r, c in self._offsets(*grad.shape[2:]):
            hit = (x[:, :, r, c] == y) & unclaimed
            dx[:, :, r, c] += grad * hit
            unclaimed &= ~hit
        self._x = self._y = None
        return dx


class AvgPool2d(_Pool):
    """Average pooling; with `subsample=True` the textbook's LeNet subsampling layer (fig. 16.5):
    sigmoid(weight[c] * mean(window) + bias[c]), a trainable coefficient and bias per channel."""

    param_names = ("weight", "bias")

    def __init__(self, kernel_size: int, stride: int | None = None, subsample: bool = False,
                 channels: int | None = None, name: str | None = None) -> None:
        super().__init__(kernel_size, stride, name)
        self.subsample = subsample
        self.weight = self.bias = None
        if subsample:
            if not isinstance(channels, int) or channels < 1:
                raise ValueError("AvgPool2d(subsample=True) needs channels=<number of channels>")
            self.weight = np.ones((channels,), np.float32)
            self.bias = np.zeros((channels,), np.float32)

    def forward(self, x: Array) -> Array:
        ho, wo = self._out_hw(x)
        self._x_shape = x.shape
        avg = sum(x[:, :, r, c] for r, c in self._offsets(ho, wo)) / self.kernel_size**2
        if not self.subsample:
            return avg
        xp = xp_of(x)
        self._avg = avg
        self._out = 1 / (1 + xp.exp(-(avg * self.weight[:, None, None] + self.bias[:, None, None])))
        return self._out

    def backward(self, grad: Array) -> Array:
        xp = xp_of(grad)
        x_shape = self._saved("_x_shape")
        if self.subsample:
            dz = grad * self._out * (1 - self._out)
            self._grads["weight"] = (dz * self._avg).sum(axis=(0, 2, 3))
            self._grads["bias"] = dz.sum(axis=(0, 2, 3))
            grad = dz * self.weight[:, None, None]
        share = grad / self.kernel_size**2
        dx = xp.zeros(x_shape, dtype=grad.dtype)
        for r, c in self._offsets(*grad.shape[2:]):
            dx[:, :, r, c] += share
        return dx


class Linear(Layer):
    """y = x @ W.T + b with W of shape (out, in)."""

    param_names = ("weight", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 name: str | None = None) -> None:
        super().__init__(name)
        if not (isinstance(in_features, int) and isinstance(out_features, int)
                and in_features > 0 and out_features > 0):
            raise ValueError(
                f"Linear sizes must be positive ints, got {in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = np.zeros((out_features, in_features), np.float32)
        self.bias = np.zeros((out_features,), np.float32) if bias else None
        self.needs_input_grad = True

    def forward(self, x: Array) -> Array:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise InputError(f"{self.name}: expected input (B, {self.in_features}), got {x.shape}")
        self._x = x if self.training else None
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y

    def backward(self, grad: Array) -> Array | None:
        self._grads["weight"] = grad.T @ self._saved("_x")
        if self.bias is not None:
            self._grads["bias"] = grad.sum(axis=0)
        self._x = None
        return grad @ self.weight if self.needs_input_grad else None


class Flatten(Layer):
    """(B, C, H, W) -> (B, C*H*W) in (C, H, W) order."""

    def forward(self, x: Array) -> Array:
        self._check_4d(x)
        self._x_shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, grad: Array) -> Array:
        return grad.reshape(self._saved("_x_shape"))


class Softmax(Layer):
    """Row-wise softmax (inference head; training uses logits and CrossEntropyLoss)."""

    def forward(self, x: Array) -> Array:
        xp = xp_of(x)
        e = xp.exp(x - x.max(axis=1, keepdims=True))
        self._y = e / e.sum(axis=1, keepdims=True)
        return self._y

    def backward(self, grad: Array) -> Array:
        y = self._saved("_y")
        return y * (grad - (grad * y).sum(axis=1, keepdims=True))
