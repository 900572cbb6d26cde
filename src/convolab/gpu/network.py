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
from convolab.errors import ConvolabError
from convolab.gpu.lenet_head import HEAD_DEFAULT_IMGS, head_defines, prepare_head
from convolab.models import conv_blocks, param_shapes
from convolab.precision import NETWORK_MODES

MODEL = "ece408"
PARAM_SHAPES = param_shapes(MODEL)
# Share of the free device memory one forward's buffers may take: the rest is left for the
# memory pool's rounding and fragmentation, the conv rungs' own workspaces and other processes.
DEVICE_MEMORY_SHARE = 0.8


def image_shape() -> tuple[int, int, int]:
    """(C, H, W) of one input image: the first conv block's input."""
    shape = conv_blocks(MODEL)[0].shape
    return (shape.C, shape.H, shape.W)


def bytes_per_image(mode: str, with_input: bool = True) -> int:
    """Device bytes one image needs in a forward: its input (when the forward allocates it),
    the pooled C1 map (fp16 in mode 'fp16'), the pooled C3 features and 10 probabilities."""
    b1, b3 = conv_blocks(MODEL, 1)
    a1 = b1.shape.M * (b1.shape.H_out // b1.pool) * (b1.shape.W_out // b1.pool)
    a3 = b3.shape.M * (b3.shape.H_out // b3.pool) * (b3.shape.W_out // b3.pool)
    x = int(np.prod(image_shape())) if with_input else 0
    return a1 * (2 if mode == "fp16" else 4) + 4 * (a3 + 10 + x)


def chunk_for(batch: int, free_bytes: int, per_image: int, slots: int = 1) -> int:
    """Images per device step so that `slots` steps' buffers fit in DEVICE_MEMORY_SHARE of
    `free_bytes`: `batch` itself when it fits, else the largest chunk that does. Raises
    ConvolabError when not even one image fits."""
    if batch < 1:
        return batch
    budget = int(free_bytes * DEVICE_MEMORY_SHARE)
    fit = budget // (per_image * slots)
    if fit < 1:
        raise ConvolabError(
            f"FusedLeNet: a batch of {batch} images needs {per_image * slots:,} bytes of GPU "
            f"memory for even one image per step ({per_image:,} per image x {slots} streams); "
            f"{budget:,} of {free_bytes:,} free bytes are usable")
    return min(batch, fit)


def device_free_bytes() -> int:
    """Free device memory, counting blocks CuPy's pool holds but does not use."""
    from convolab.backend import require_cupy

    cp = require_cupy()
    return int(cp.cuda.runtime.memGetInfo()[0]) + int(cp.get_default_memory_pool().free_bytes())


def _out_of_memory(what: str, batch: int, need: int) -> ConvolabError:
    free = device_free_bytes()
    return ConvolabError(f"FusedLeNet: out of GPU memory for {what} of a batch of {batch} images "
                         f"(about {need:,} bytes needed, {free:,} free)")


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
        """The cached plan of one batch size and stream slot; one ConvolabError where its
        buffers do not fit on the device."""
        key = (batch, slot)
        if key not in self._plans:
            try:
                self._plans[key] = self._new_plan(batch)
            except self._cp.cuda.memory.OutOfMemoryError:
                self._plans.clear()  # cached buffers of other sizes go first
                self._cp.get_default_memory_pool().free_all_blocks()
                raise _out_of_memory("the intermediates", batch,
                                     batch * bytes_per_image(self.mode, False)) from None
        return self._plans[key]

    def _new_plan(self, batch: int) -> tuple[Callable, Callable, Any, Any]:
        """Prepared conv runs and intermediate buffers for one batch size (per stream slot)."""
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
        return (c1, c3, a1, a3)

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
        n = int(x.shape[0])
        try:
            probs = cp.empty((n, 10), cp.float32)
            x = cp.ascontiguousarray(x)
        except cp.cuda.memory.OutOfMemoryError:
            raise _out_of_memory("the input and output", n,
                                 n * 4 * (10 + int(np.prod(image_shape())))) from None
        step = n if (n, 0) in self._plans else chunk_for(
            n, device_free_bytes(), bytes_per_image(self.mode, with_input=False))
        if step >= n:
            if n:
                self.forward_into(x, probs)
            return probs
        # Too large for the device at once: a chunk at a time. The chunk's buffers go back to
        # the pool before the last, shorter chunk plans its own, and neither stays cached.
        full, rest = divmod(n, step)
        for i in range(full):
            self.forward_into(x[i * step:(i + 1) * step], probs[i * step:(i + 1) * step])
        self._plans.pop((step, 0), None)
        if rest:
            self.forward_into(x[full * step:], probs[full * step:])
            self._plans.pop((rest, 0), None)
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

        A `chunk` whose device buffers do not fit in the free memory is reduced until they do
        (chunk_for); where not even one image fits, one ConvolabError says so.

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
        if (chunk, 0) not in self._plans:  # a chunk that does not fit becomes smaller chunks
            # one step more than the streams: the last, shorter chunk plans buffers of its own
            chunk = chunk_for(chunk, device_free_bytes(), bytes_per_image(self.mode), streams + 1)
        slots = min(streams, -(-n // chunk))
        try:
            return self._stream_chunks(x_host, out, chunk, slots)
        except cp.cuda.memory.OutOfMemoryError:
            raise _out_of_memory("the streaming buffers", chunk,
                                 slots * chunk * bytes_per_image(self.mode)) from None

    def _stream_chunks(self, x_host: np.ndarray, out: np.ndarray, chunk: int,
                       slots: int) -> np.ndarray:
        cp, n = self._cp, x_host.shape[0]
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
