"""GPU backward passes for training: convolution, max-pool and the textbook's subsampling.

Plain functions on CuPy float32 arrays; the kernels are kernels/22_conv_backward_direct.cu,
23_conv_backward_gemm.cu, 21_pool_forward.cu and 24_pool_backward.cu, compiled through
`convolab.gpu.compile`.

- `conv2d_backward(x, w, dy, stride, method)` -> (dx, dw, db). Two methods:
  'direct' (gather kernels straight from the definition) and 'gemm' (im2col + cuBLAS + col2im).
  `DEFAULT_METHOD` is the one measured faster on the training shapes (docs/training.md).
- `maxpool2d_forward` / `maxpool2d_backward`: the argmax is recomputed from the input in the
  backward, so the forward stores no indices.
- `subsample_forward` / `subsample_backward`: sigmoid(coef * mean(window) + bias) per channel.

Nothing here synchronises with the host: every function only enqueues work on the current
stream, so a training step can run ahead of Python. No kernel uses atomics, and every reduction
has a fixed order, so the same inputs give the same bits on the same GPU and software stack.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from convolab.backend import require_cupy
from convolab.gpu.compile import get_kernel
from convolab.shapes import ceil_div

Array = Any  # cupy.ndarray

POOL_FORWARD_FILE = "21_pool_forward.cu"
DIRECT_FILE = "22_conv_backward_direct.cu"
GEMM_FILE = "23_conv_backward_gemm.cu"
POOL_FILE = "24_pool_backward.cu"
# A NULL pointer argument passed as 8 zero bytes (not None, whose handling differs between
# CuPy versions).
NULL = np.uint64(0)
BLOCK = 256  # matches the kernels' *_BLOCK defaults
METHODS = ("gemm", "direct")
# Measured on an H100 (docs/training.md): direct is faster for
# every zoo conv layer, e.g. ece408 C1 backward at batch 4096 1.7 ms vs 11.9 ms (the GEMM
# method writes and reads a 5 GB unrolled input), C3 14.3 vs 14.7 ms.
DEFAULT_METHOD = "direct"
# conv_bwd_dw_taps keeps K*K sums in registers; beyond this K the per-weight kernel is used.
MAX_TAPS_K = 9
# The unrolled matrix of one GEMM chunk stays below this many floats (256 MiB): big enough
# that cuBLAS runs long GEMMs, small enough that batch 4096 does not need gigabytes of scratch.
GEMM_WORKSPACE_FLOATS = 64 * 1024 * 1024


@functools.cache
def _sm_count(device_id: int) -> int:
    cp = require_cupy()
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _grid_for(per_image: int, images: int) -> tuple[int, int]:
    """2-D grid: grid.y walks the images, grid.x covers one image's elements (the kernels
    grid-stride past both limits, so any size works)."""
    cp = require_cupy()
    sms = _sm_count(cp.cuda.runtime.getDevice())
    return max(1, min(ceil_div(per_image, BLOCK), sms * 8)), max(1, min(images, 65535))


def _as_f32(a: Array, what: str) -> Array:
    cp = require_cupy()
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{what} must be a CuPy array on the GPU, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{what} must be float32, got {a.dtype}")
    return cp.ascontiguousarray(a)


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def _channel_sum(a: Array) -> Array:
    """(B, C, H, W) -> (C,) sums, in two contiguous stages. One `a.sum(axis=(0, 2, 3))` makes
    CuPy give each of the few outputs one block, which took milliseconds at batch 4096 (more
    than the whole dW kernel). Both stages have a fixed order, so the result is reproducible."""
    b, c = a.shape[:2]
    return a.reshape(b, c, -1).sum(axis=2).sum(axis=0)


# --------------------------------------------------------------------------- convolution


def conv2d_backward(x: Array, w: Array, dy: Array, stride: int = 1,
                    method: str | None = None, need_dx: bool = True,
                    ) -> tuple[Array | None, Array, Array]:
    """Gradients of Y = conv(X, W) + b (valid, no flip) given dY: returns (dX, dW, db).

    x (B, C, H, W), w (M, C, K, K), dy (B, M, H_out, W_out). dX is None when need_dx is False
    (the first layer of a network never needs it)."""
    require_cupy()  # one clear error where there is no usable GPU
    method = DEFAULT_METHOD if method is None else method
    if method not in METHODS:
        raise ValueError(f"conv2d_backward: method must be one of {METHODS}, not {method!r}")
    stride = _positive_int(stride, "conv2d_backward stride")
    x, w, dy = _as_f32(x, "x"), _as_f32(w, "w"), _as_f32(dy, "dy")
    if x.ndim != 4 or w.ndim != 4 or w.shape[2] != w.shape[3] or x.shape[1] != w.shape[1]:
        raise ValueError(f"conv2d_backward: x {x.shape} and w {w.shape} do not fit "
                         "(want x (B, C, H, W) and w (M, C, K, K))")
    b, c, h, wd = x.shape
    m, k = w.shape[0], w.shape[2]
    if k > h or k > wd:
        raise ValueError(f"conv2d_backward: kernel {k} is larger than the input {h}x{wd}")
    h_out, w_out = (h - k) // stride + 1, (wd - k) // stride + 1
    if dy.shape != (b, m, h_out, w_out):
        raise ValueError(f"conv2d_backward: dy has shape {dy.shape}, expected "
                         f"{(b, m, h_out, w_out)} for x {x.shape}, w {w.shape}, stride {stride}")
    dims = (b, c, h, wd, k, stride, h_out, w_out)
    if method == "direct":
        dx = _conv_dx_direct(dy, w, dims) if need_dx else None
        dw = _conv_dw_direct(x, dy, w.shape, dims)
    else:
        dx, dw = _conv_backward_gemm(x, w, dy, dims, need_dx)
    return dx, dw, _channel_sum(dy)


def _conv_dx_direct(dy: Array, w: Array, dims: tuple[int, ...]) -> Array:
    cp = require_cupy()
    b, c, h, wd, k, s, h_out, w_out = dims
    m = w.shape[0]
    dx = cp.empty((b, c, h, wd), dtype=cp.float32)
    kernel = get_kernel(DIRECT_FILE, "conv_bwd_dx_direct")
    kernel(_grid_for(c * h * wd, b), (BLOCK,),
           (dy, w, dx, np.int32(b), np.int32(m), np.int32(c), np.int32(h), np.int32(wd),
            np.int32(k), np.int32(s), np.int32(h_out), np.int32(w_out)))
    return dx


def _conv_dw_direct(x: Array, dy: Array, w_shape: tuple[int, ...], dims: tuple[int, ...]) -> Array:
    cp = require_cupy()
    b, c, h, wd, k, s, h_out, w_out = dims
    m = w_shape[0]
    n_weights = m * c * k * k
    per_tap = k <= MAX_TAPS_K  # one block per (m, c) slice with K*K register sums
    blocks_x = m * c if per_tap else n_weights
    # Few filters give too few blocks; split the batch so the grid holds about 8 blocks per
    # SM, then add the slices' partial sums (a fixed-order reduction).
    target_blocks = 8 * _sm_count(cp.cuda.runtime.getDevice())
    slices = max(1, min(b, ceil_div(target_blocks, blocks_x)))
    per_slice = ceil_div(b, slices)
    slices = ceil_div(b, per_slice)
    partial = cp.empty((slices, n_weights), dtype=cp.float32)
    shape_args = (np.int32(b), np.int32(m), np.int32(c), np.int32(h), np.int32(wd))
    tail = (np.int32(s), np.int32(h_out), np.int32(w_out), np.int32(per_slice))
    if per_tap:
        kernel = get_kernel(DIRECT_FILE, "conv_bwd_dw_taps", {"KSIZE": k})
        kernel((blocks_x, slices), (BLOCK,), (x, dy, partial, *shape_args, *tail))
    else:
        kernel = get_kernel(DIRECT_FILE, "conv_bwd_dw_direct")
        kernel((blocks_x, slices), (BLOCK,),
               (x, dy, partial, *shape_args, np.int32(k), *tail))
    return partial.sum(axis=0).reshape(w_shape)


def _conv_backward_gemm(x: Array, w: Array, dy: Array, dims: tuple[int, ...],
                        need_dx: bool) -> tuple[Array | None, Array]:
    cp = require_cupy()
    b, c, h, wd, k, s, h_out, w_out = dims
    m = w.shape[0]
    taps, plane = c * k * k, h_out * w_out
    chunk = max(1, min(b, GEMM_WORKSPACE_FLOATS // (taps * plane)))
    unroll = get_kernel(GEMM_FILE, "im2col_rows")
    fold = get_kernel(GEMM_FILE, "col2im_gather")
    w_t = cp.ascontiguousarray(w.reshape(m, taps).T)  # (taps, M), tiny
    dw = cp.zeros((m, taps), dtype=cp.float32)
    dx = cp.empty((b, c, h, wd), dtype=cp.float32) if need_dx else None
    for b0 in range(0, b, chunk):
        b1 = min(b, b0 + chunk)
        n = b1 - b0
        x_c = x[b0:b1]
        dy_c = dy[b0:b1].reshape(n, m, plane)
        cols = cp.empty((n, plane, taps), dtype=cp.float32)
        unroll(_grid_for(plane * taps, n), (BLOCK,),
               (x_c, cols, np.int32(n), np.int32(c), np.int32(h), np.int32(wd), np.int32(k),
                np.int32(s), np.int32(h_out), np.int32(w_out)))
        dw += cp.matmul(dy_c, cols).sum(axis=0)  # (n, M, L) @ (n, L, taps), summed over images
        del cols  # give the workspace back to the pool before dCols takes as much again
        if need_dx:
            dcols = cp.matmul(w_t, dy_c)  # (taps, M) @ (n, M, L) -> (n, taps, L)
            fold(_grid_for(c * h * wd, n), (BLOCK,),
                 (dcols, dx[b0:b1], np.int32(n), np.int32(c), np.int32(h), np.int32(wd),
                  np.int32(k), np.int32(s), np.int32(h_out), np.int32(w_out)))
    return dx, dw.reshape(w.shape)


def conv2d_layer_backward(layer: Any, grad: Array) -> Array | None:
    """Backward of a `convolab.layers.Conv2d` on the GPU (the layer's dispatch hook calls this):
    stores the weight and bias gradients on the layer and returns dE/dX (None for a first layer).
    Needs the input the layer's training-mode forward kept (`layer.pop_input()`)."""
    x = layer.pop_input()  # freed on the layer as soon as it is used
    if x is None:
        raise RuntimeError(f"{layer.name}: backward without a training-mode forward on the GPU")
    method = getattr(layer, "backward_method", None)
    dx, dw, db = conv2d_backward(x, layer.weight, grad, layer.stride, method,
                                 need_dx=layer.needs_input_grad)
    layer.set_grads({"weight": dw} if layer.bias is None else {"weight": dw, "bias": db})
    return dx


# --------------------------------------------------------------------------- pooling


def _pool_dims(x: Array, kernel: int, stride: int | None, what: str) -> tuple[int, ...]:
    kernel = _positive_int(kernel, f"{what} kernel")
    stride = kernel if stride is None else _positive_int(stride, f"{what} stride")
    if x.ndim != 4:
        raise ValueError(f"{what}: input must be 4-D (B, C, H, W), got shape {x.shape}")
    b, c, h, w = x.shape
    if kernel > h or kernel > w:
        raise ValueError(f"{what}: the {kernel}x{kernel} window is larger than the input {h}x{w}")
    return b, c, h, w, kernel, stride, (h - kernel) // stride + 1, (w - kernel) // stride + 1


def _check_out(a: Array, dims: tuple[int, ...], what: str) -> None:
    b, c, _, _, _, _, h_out, w_out = dims
    if a.shape != (b, c, h_out, w_out):
        raise ValueError(f"{what} has shape {a.shape}, expected {(b, c, h_out, w_out)}")


def _pool_args(dims: tuple[int, ...]) -> tuple[Any, ...]:
    return tuple(np.int32(v) for v in dims)


def _pool_grid(dims: tuple[int, ...], per_input: bool) -> tuple[int, int]:
    """One thread per input element (per_input) or per output element, images on grid.y."""
    b, c, h, w, _, _, h_out, w_out = dims
    return _grid_for(c * h * w if per_input else c * h_out * w_out, b)


def maxpool2d_forward(x: Array, kernel: int, stride: int | None = None) -> Array:
    """Max over each kernel x kernel window (floor mode), NaN-propagating like NumPy."""
    cp = require_cupy()
    x = _as_f32(x, "x")
    dims = _pool_dims(x, kernel, stride, "maxpool2d_forward")
    b, c, _, _, _, _, h_out, w_out = dims
    y = cp.empty((b, c, h_out, w_out), dtype=cp.float32)
    get_kernel(POOL_FORWARD_FILE, "maxpool_forward")(_pool_grid(dims, False), (BLOCK,),
                                             (x, y, *_pool_args(dims)))
    return y


def maxpool2d_backward(x: Array, y: Array | None, dy: Array, kernel: int,
                       stride: int | None = None) -> Array:
    """dE/dX of a max-pool: each window's gradient goes to its first maximum in x.
    `y` (the pooled output) is optional; with it the argmax search stops early."""
    cp = require_cupy()
    x, dy = _as_f32(x, "x"), _as_f32(dy, "dy")
    dims = _pool_dims(x, kernel, stride, "maxpool2d_backward")
    _check_out(dy, dims, "maxpool2d_backward: dy")
    if y is not None:
        y = _as_f32(y, "y")
        _check_out(y, dims, "maxpool2d_backward: y")
    dx = cp.empty(x.shape, dtype=cp.float32)
    get_kernel(POOL_FILE, "maxpool_backward_gather")(
        _pool_grid(dims, True), (BLOCK,), (x, NULL if y is None else y, dy, dx, *_pool_args(dims)))
    return dx


def _subsample_params(coef: Array, bias: Array, channels: int) -> tuple[Array, Array]:
    coef, bias = _as_f32(coef, "coef"), _as_f32(bias, "bias")
    if coef.shape != (channels,) or bias.shape != (channels,):
        raise ValueError(f"subsample: coef {coef.shape} and bias {bias.shape} must both be "
                         f"({channels},), one per channel")
    return coef, bias


def subsample_forward(x: Array, coef: Array, bias: Array, kernel: int,
                      stride: int | None = None) -> Array:
    """The textbook's subsampling: sigmoid(coef[c] * mean(window) + bias[c])."""
    cp = require_cupy()
    x = _as_f32(x, "x")
    dims = _pool_dims(x, kernel, stride, "subsample_forward")
    coef, bias = _subsample_params(coef, bias, dims[1])
    b, c, _, _, _, _, h_out, w_out = dims
    s = cp.empty((b, c, h_out, w_out), dtype=cp.float32)
    get_kernel(POOL_FORWARD_FILE, "subsample_forward")(
        _pool_grid(dims, False), (BLOCK,), (x, coef, bias, s, *_pool_args(dims)))
    return s


def subsample_backward(x: Array, s: Array | None, ds: Array, coef: Array, bias: Array,
                       kernel: int, stride: int | None = None) -> tuple[Array, Array, Array]:
    """Gradients of subsample_forward given dE/ds: returns (dX, dcoef, dbias).
    `s` (the forward's output) is optional; without it the sigmoid is recomputed from x."""
    cp = require_cupy()
    x, ds = _as_f32(x, "x"), _as_f32(ds, "ds")
    dims = _pool_dims(x, kernel, stride, "subsample_backward")
    coef, bias = _subsample_params(coef, bias, dims[1])
    _check_out(ds, dims, "subsample_backward: ds")
    if s is not None:
        s = _as_f32(s, "s")
        _check_out(s, dims, "subsample_backward: s")
    dz = cp.empty(ds.shape, dtype=cp.float32)
    dz_mean = cp.empty(ds.shape, dtype=cp.float32)
    args = _pool_args(dims)
    get_kernel(POOL_FILE, "subsample_dz")(
        _pool_grid(dims, False), (BLOCK,),
        (x, NULL if s is None else s, ds, coef, bias, dz, dz_mean, *args))
    dx = cp.empty(x.shape, dtype=cp.float32)
    get_kernel(POOL_FILE, "pool_spread_gather")(
        _pool_grid(dims, True), (BLOCK,), (dz, coef, dx, *args))
    return dx, _channel_sum(dz_mean), _channel_sum(dz)


def avgpool2d_backward(dy: Array, x_shape: tuple[int, ...], kernel: int,
                       stride: int | None = None) -> Array:
    """dE/dX of a plain average pool: each window's gradient spread evenly over it."""
    cp = require_cupy()
    dy = _as_f32(dy, "dy")
    dims = _pool_dims(_Shape(x_shape), kernel, stride, "avgpool2d_backward")
    _check_out(dy, dims, "avgpool2d_backward: dy")
    dx = cp.empty(tuple(x_shape), dtype=cp.float32)
    get_kernel(POOL_FILE, "pool_spread_gather")(
        _pool_grid(dims, True), (BLOCK,), (dy, NULL, dx, *_pool_args(dims)))
    return dx


class _Shape:
    """Stands in for an array where only the shape is known (avgpool2d_backward)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(int(v) for v in shape)
        self.ndim = len(self.shape)
