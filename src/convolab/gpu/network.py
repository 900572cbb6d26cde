"""The whole ece408 LeNet forward on the GPU, fused: the fastest path (docs/spec.md).

    C1 conv 1->4 K7 + ReLU + pool 2   a fused conv+pool rung (13/16 fp32 FFMA, 17 tf32;
    C3 conv 4->16 K7 + ReLU + pool 4   15 fp32, 18 tf32; 19 in mode 'fp16')
    F5 + ReLU, F6, softmax            kernel 20, kernels/20_lenet_head.cu: 10 floats out

Three launches per batch; the only full-size intermediate is the pooled C1 map (25.6 KB an
image in fp32 NCHW). Mode 'fp16' passes it as fp16 channels-last instead (12.8 KB an image):
kernel 19's fcp_mma_toe_cl then fcp_mma_cl (gpu/fused_cl.py), which stages it with plain 16-byte
copies. docs/fused.md records why this split and not one kernel per image.

`FusedLeNet` takes a plain dict {name: array} (the ece408 model's parameters, see
models.param_shapes) so it does not depend on the framework's classes; `from_network(net)`
adapts anything with a `params()` mapping. Nothing imports CuPy at module import time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convolab.backend import to_numpy
from convolab.gpu.lenet_head import HEAD_DEFAULT_IMGS, head_defines, prepare_head
from convolab.models import conv_blocks, param_shapes
from convolab.precision import NETWORK_MODES

MODEL = "ece408"
PARAM_SHAPES = param_shapes(MODEL)


def image_shape() -> tuple[int, int, int]:
    """(C, H, W) of one input image: the first conv block's input."""
    shape = conv_blocks(MODEL)[0].shape
    return (shape.C, shape.H, shape.W)


def check_params(params: Mapping[str, Any]) -> None:
    missing = [k for k in PARAM_SHAPES if k not in params]
    if missing:
        raise ValueError(f"FusedLeNet: missing parameters {missing} (need {list(PARAM_SHAPES)})")
    for name, want in PARAM_SHAPES.items():
        got = tuple(params[name].shape)
        if got != want:
            raise ValueError(f"FusedLeNet: {name} has shape {got}, the ece408 model needs {want}")


def from_network(net: Any, mode: str = "exact") -> FusedLeNet:
    """Adapter for the framework's Network (anything with params() -> {name: array})."""
    params = net.params() if callable(getattr(net, "params", None)) else net
    return FusedLeNet(dict(params), mode=mode)


class FusedLeNet:
    """ece408 LeNet forward on the GPU: probabilities (B, 10) for inputs (B, 1, 86, 86).

    mode: 'exact' (fp32 FFMA, matches an fp64 forward to ~1e-6), 'tf32' or 'fp16'
    (tensor cores for both conv layers, fp32 accumulate; F5/F6/softmax stay fp32). Mode
    'fp16' hands the pooled C1 map from conv1 to conv2 as fp16 channels-last (gpu/fused_cl.py).
    kernel_params: per-kernel parameters {"c1": {...}, "c3": {...}, "head": {"imgs": n}}
    (benchmarks); what is left out is each kernel's measured default.
    """

    def __init__(self, params: Mapping[str, Any], mode: str = "exact",
                 kernel_params: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        if mode not in NETWORK_MODES:
            raise ValueError(f"FusedLeNet: mode must be one of {tuple(NETWORK_MODES)}, "
                             f"got {mode!r}")
        check_params(params)
        self._kernel_params = {k: dict(v) for k, v in (kernel_params or {}).items()}
        head_imgs = int(self._kernel_params.get("head", {}).get("imgs", HEAD_DEFAULT_IMGS))
        head_d = head_defines(head_imgs)  # raises on a size the kernel was not tuned for
        from convolab.backend import require_cupy

        self._cp = cp = require_cupy()
        self.mode = mode
        self.channels_last = mode == "fp16"
        self.params = {k: cp.ascontiguousarray(cp.asarray(to_numpy(v), cp.float32))
                       for k, v in params.items() if k in PARAM_SHAPES}
        self._w5t = cp.ascontiguousarray(self.params["f5.weight"].T)
        self._plans: dict[tuple[int, int], tuple[Callable, Callable, Any, Any]] = {}
        self._head = prepare_head(head_d)

    # ---- device forward -------------------------------------------------------------------
    def _plan(self, batch: int, slot: int = 0) -> tuple[Callable, Callable, Any, Any]:
        """Prepared conv runs and intermediate buffers for one batch size (per stream slot)."""
        key = (batch, slot)
        if key not in self._plans:
            cp, p = self._cp, self.params
            c1p, c3p = self._kernel_params.get("c1", {}), self._kernel_params.get("c3", {})
            b1, b3 = conv_blocks(MODEL, batch)
            hp1, wp1 = b1.shape.H_out // b1.pool, b1.shape.W_out // b1.pool
            hp3, wp3 = b3.shape.H_out // b3.pool, b3.shape.W_out // b3.pool
            if self.channels_last:
                from convolab.gpu import fused_cl

                c1 = fused_cl.prepare_conv1_cl(b1.shape, p["c1.weight"], p["c1.bias"], c1p)
                c3 = fused_cl.prepare_conv2_cl(b3.shape, p["c3.weight"], p["c3.bias"], c3p)
                a1 = cp.empty((batch, hp1, wp1, b1.shape.M), cp.float16)  # fp16 channels-last
            else:
                from convolab.gpu.fused import fused_conv_pool_impl

                prec = NETWORK_MODES[self.mode]
                c1 = fused_conv_pool_impl(b1.pool, prec).prepare(
                    b1.shape, p["c1.weight"], p["c1.bias"], c1p)
                c3 = fused_conv_pool_impl(b3.pool, prec).prepare(
                    b3.shape, p["c3.weight"], p["c3.bias"], c3p)
                a1 = cp.empty((batch, b1.shape.M, hp1, wp1), cp.float32)
            # == the head's (batch, 1024) features
            a3 = cp.empty((batch, b3.shape.M, hp3, wp3), cp.float32)
            self._plans[key] = (c1, c3, a1, a3)
        return self._plans[key]

    def forward_into(self, x: Any, probs: Any, slot: int = 0) -> None:
        """Enqueue the forward of device batch x on the current stream, writing probs."""
        batch = int(x.shape[0])
        c1, c3, a1, a3 = self._plan(batch, slot)
        c1(x, a1)
        c3(a1, a3)
        p = self.params
        self._head(a3, self._w5t, p["f5.bias"], p["f6.weight"], p["f6.bias"], probs)

    def __call__(self, x: Any) -> Any:
        cp = self._cp
        if not isinstance(x, cp.ndarray):
            raise TypeError("FusedLeNet(x): x must be a CuPy array (use forward_chunks for host)")
        self._check_batch(x)
        probs = cp.empty((x.shape[0], 10), cp.float32)
        if x.shape[0]:
            self.forward_into(cp.ascontiguousarray(x), probs)
        return probs

    @staticmethod
    def _check_batch(x: Any) -> None:
        if x.ndim != 4 or tuple(x.shape[1:]) != image_shape():
            raise ValueError(f"expected input (B, {', '.join(map(str, image_shape()))}), "
                             f"got shape {tuple(x.shape)}")
        if x.dtype != np.float32:
            raise TypeError(f"expected float32 input, got {x.dtype}")

    # ---- host batches of any size ---------------------------------------------------------
    def forward_chunks(self, x_host: np.ndarray, chunk: int = 8192, streams: int = 2,
                       out: np.ndarray | None = None) -> np.ndarray:
        """Probabilities for a host batch of any size (it need not fit on the GPU).

        Chunks rotate through `streams` slots, each with its own pinned staging buffers,
        device buffers and CUDA stream, so chunk i's host->device copy, chunk i-1's kernels
        and chunk i-2's device->host copy overlap. The host copies into the pinned buffers
        happen while the GPU works on the other slots.
        """
        cp = self._cp
        if not isinstance(x_host, np.ndarray):
            raise TypeError("forward_chunks: x_host must be a NumPy array")
        self._check_batch(x_host)
        if chunk < 1 or streams < 1:
            raise ValueError("forward_chunks: chunk and streams must be >= 1")
        n = x_host.shape[0]
        if out is None:
            out = np.empty((n, 10), np.float32)
        if n == 0:
            return out
        chunk = min(chunk, n)
        slots = min(streams, -(-n // chunk))
        img = image_shape()
        img_bytes = 4 * int(np.prod(img))
        pin_in = [_pinned(cp, (chunk, *img)) for _ in range(slots)]
        pin_out = [_pinned(cp, (chunk, 10)) for _ in range(slots)]
        dev_in = [cp.empty((chunk, *img), cp.float32) for _ in range(slots)]
        dev_out = [cp.empty((chunk, 10), cp.float32) for _ in range(slots)]
        cuda_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(slots)]
        done: list[Any] = [None] * slots
        pending: list[tuple[int, int] | None] = [None] * slots
        runtime = cp.cuda.runtime

        def collect(s: int) -> None:
            if done[s] is None:
                return
            done[s].synchronize()
            start, count = pending[s]  # type: ignore[misc]
            out[start:start + count] = pin_out[s][:count]
            done[s] = None

        for i, start in enumerate(range(0, n, chunk)):
            s = i % slots
            collect(s)  # slot s's previous chunk is finished: its buffers are free
            count = min(chunk, n - start)
            np.copyto(pin_in[s][:count], x_host[start:start + count])
            stream = cuda_streams[s]
            with stream:
                runtime.memcpyAsync(dev_in[s].data.ptr, pin_in[s].ctypes.data,
                                    count * img_bytes, runtime.memcpyHostToDevice, stream.ptr)
                self.forward_into(dev_in[s][:count], dev_out[s][:count], slot=s)
                runtime.memcpyAsync(pin_out[s].ctypes.data, dev_out[s].data.ptr, count * 40,
                                    runtime.memcpyDeviceToHost, stream.ptr)
                done[s] = stream.record()
            pending[s] = (start, count)
        for s in range(slots):
            collect(s)
        return out

    def throughput(self, x_host: np.ndarray, chunk: int = 8192,
                   streams: int = 2) -> tuple[np.ndarray, float]:
        """(probabilities, images per second) for a host batch, host to host, wall clock."""
        warm = x_host[: min(len(x_host), chunk)]
        self.forward_chunks(warm, chunk=chunk, streams=streams)  # compile + allocate outside
        self._cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        probs = self.forward_chunks(x_host, chunk=chunk, streams=streams)
        seconds = time.perf_counter() - t0
        return probs, len(x_host) / seconds if seconds > 0 else float("inf")


def _pinned(cp: Any, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    mem = cp.cuda.alloc_pinned_memory(4 * count)
    return np.frombuffer(mem, np.float32, count).reshape(shape)
