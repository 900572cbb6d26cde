"""The whole ece408 LeNet forward on the GPU, fused: the fastest path (SPEC section 5, 7).

    C1 conv 1->4 K7 + ReLU + pool 2   rung 13 kernel (fp32 FFMA, or mma.sync in tc modes)
    C3 conv 4->16 K7 + ReLU + pool 4  rung 13 kernel
    F5 + ReLU, F6, softmax            kernels/15_lenet_fused.cu: one kernel, 10 floats out

Three launches per batch; the only full-size intermediate is the pooled C1 map (25.6 KB an
image in fp32 NCHW). Mode 'fp16' passes it as fp16 channels-last instead (12.8 KB an image):
rung 13's fcp_mma_toe with TC_OUT_CL=1, then kernels/16 fcp_mma_cl (gpu/tc_cl.py), which
stages it with plain 16-byte copies. `FusedLeNet(..., fp16_layout="nchw")` keeps the rung-13
fp16 pair for comparison. docs/fused.md records why this split and not one kernel per image.

`FusedLeNet` takes a plain dict {name: array} (c1.weight, c1.bias, c3.weight, c3.bias,
f5.weight, f5.bias, f6.weight, f6.bias) so it does not depend on the framework's classes;
`from_network(net)` adapts anything with a `params()` mapping. Nothing imports CuPy at
module import time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convolab.shapes import ConvShape

MODES = ("exact", "tf32", "fp16")
PARAM_SHAPES: dict[str, tuple[int, ...]] = {
    "c1.weight": (4, 1, 7, 7),
    "c1.bias": (4,),
    "c3.weight": (16, 4, 7, 7),
    "c3.bias": (16,),
    "f5.weight": (32, 1024),
    "f5.bias": (32,),
    "f6.weight": (10, 32),
    "f6.bias": (10,),
}
IMAGE_SHAPE = (1, 86, 86)
HEAD_KERNEL_FILE = "15_lenet_fused.cu"
# kernels/15 `lenet_head` defines per tile size (images a block finishes at a time). 16: 625
# tiles at B=10000 spread over 132 SMs within 5 %, 0.032 ms on the H100 (the earlier
# non-persistent head: 0.093); 32 halves the feature loads per FMA but leaves 2.4 tiles a SM
# (0.038 ms); its partial sums get one buffer (two would pass 227 KB).
HEAD_VARIANTS: dict[int, dict[str, int]] = {
    16: {"HEAD_IMGS": 16, "HEAD_LO": 4, "HEAD_KC": 32, "HEAD_NS": 3, "HEAD_RB": 2},
    32: {"HEAD_IMGS": 32, "HEAD_LO": 4, "HEAD_KC": 16, "HEAD_NS": 3, "HEAD_RB": 1},
}
HEAD_IMGS_CHOICES = tuple(HEAD_VARIANTS)
HEAD_DEFAULT_IMGS = 16
HEAD_THREADS = 256  # HEAD_THREADS in the kernel: 8 warps, one 128-k slice each
_HEAD_KERNEL_DEFAULTS = HEAD_VARIANTS[HEAD_DEFAULT_IMGS]  # what kernels/15 builds with no -D
_PRECISION_OF_MODE = {"exact": "fp32", "tf32": "tf32", "fp16": "fp16"}
FP16_LAYOUTS = ("cl", "nchw")  # mode 'fp16': intermediate as fp16 channels-last, or fp32 NCHW


def _c1_shape(batch: int) -> ConvShape:
    return ConvShape(batch, 1, 86, 86, 4, 7)


def _c3_shape(batch: int) -> ConvShape:
    return ConvShape(batch, 4, 40, 40, 16, 7)


def head_defines(imgs: int = HEAD_DEFAULT_IMGS) -> dict[str, int]:
    """The kernels/15 define set for tiles of `imgs` images (a HEAD_VARIANTS key)."""
    if imgs not in HEAD_VARIANTS:
        raise ValueError(f"FusedLeNet: head imgs must be one of {HEAD_IMGS_CHOICES}, got {imgs}")
    return dict(HEAD_VARIANTS[imgs])


def head_smem_bytes(defines: Mapping[str, int]) -> int:
    """Dynamic shared memory of `lenet_head` (HEAD_SMEM_BYTES in the kernel): the F5 weights,
    each warp's ring of HEAD_NS padded feature chunks, HEAD_RB partial-sum buffers."""
    d = {**_HEAD_KERNEL_DEFAULTS, **defines}
    warps, imgs = HEAD_THREADS // 32, d["HEAD_IMGS"]
    ring = warps * d["HEAD_NS"] * imgs * (d["HEAD_KC"] + 4)
    return 4 * (1024 * 32 + ring + d["HEAD_RB"] * warps * imgs * 32)


def head_grid(batch: int, defines: Mapping[str, int], n_sm: int) -> int:
    """Persistent launch: one block per SM (the shared memory allows no second), never more
    blocks than tiles."""
    imgs = {**_HEAD_KERNEL_DEFAULTS, **defines}["HEAD_IMGS"]
    return max(1, min(n_sm, -(-batch // imgs)))


def prepare_head(defines: Mapping[str, int] | None = None) -> Callable[..., None]:
    """kernels/15 `lenet_head` ready to launch: run(feat, w5t, b5, w6, b6, probs).

    feat: (B, 1024) or (B, 16, 8, 8) fp32, C-contiguous, 16-byte aligned (cp.async); w5t the
    F5 weight transposed to (1024, 32), contiguous; probs (B, 10) fp32, written. defines:
    a define set (default: head_defines()).
    """
    from convolab.backend import require_cupy
    from convolab.gpu.compile import get_kernel

    cp = require_cupy()
    d = dict(head_defines() if defines is None else defines)
    kernel = get_kernel(HEAD_KERNEL_FILE, "lenet_head", d)
    smem = head_smem_bytes(d)
    kernel.max_dynamic_shared_size_bytes = smem
    n_sm = int(cp.cuda.Device().attributes["MultiProcessorCount"])

    def run(feat: Any, w5t: Any, b5: Any, w6: Any, b6: Any, probs: Any) -> None:
        batch = int(feat.shape[0])
        if batch == 0:
            return
        if not feat.flags.c_contiguous or feat.data.ptr % 16 or feat.size != batch * 1024:
            raise ValueError("lenet_head: feat must be contiguous (B, 1024) fp32, 16-byte aligned")
        kernel((head_grid(batch, d, n_sm),), (HEAD_THREADS,),
               (feat, w5t, b5, w6, b6, probs, np.int32(batch)), shared_mem=smem)

    run.defines = d  # type: ignore[attr-defined]  # for tests and benchmarks
    return run


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


def conv_relu_pool_numpy(x: np.ndarray, w: np.ndarray, b: np.ndarray, pool: int,
                         chunk: int = 128) -> np.ndarray:
    """fp64 maxpool(relu(conv(x, w) + b)), stride 1, pool window = pool stride, floor.

    im2col + BLAS matmul over chunks of images, so 10000 images stay within a few hundred MB.
    """
    from numpy.lib.stride_tricks import sliding_window_view

    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    B, C, H, W = x.shape
    M, _, K, _ = w.shape
    ho, wo = H - K + 1, W - K + 1
    hp, wp = ho // pool, wo // pool
    wmat = w.reshape(M, C * K * K).T
    out = np.empty((B, M, hp, wp))
    for s in range(0, B, chunk):
        xs = x[s:s + chunk]
        n = xs.shape[0]
        win = sliding_window_view(xs, (K, K), axis=(2, 3))  # n, C, ho, wo, K, K
        cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, C * K * K)
        y = (cols @ wmat).reshape(n, ho, wo, M).transpose(0, 3, 1, 2)
        y = np.maximum(y + np.asarray(b, np.float64)[None, :, None, None], 0.0)
        y = y[:, :, : hp * pool, : wp * pool].reshape(n, M, hp, pool, wp, pool)
        out[s:s + n] = y.max(axis=(3, 5))
    return out


def numpy_forward(params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    """fp64 NumPy forward of the whole network: the yardstick of the tests and benchmarks."""
    p = {k: np.asarray(_host(v), np.float64) for k, v in params.items()}
    a = conv_relu_pool_numpy(x, p["c1.weight"], p["c1.bias"], 2)
    a = conv_relu_pool_numpy(a, p["c3.weight"], p["c3.bias"], 4)
    h = np.maximum(a.reshape(a.shape[0], -1) @ p["f5.weight"].T + p["f5.bias"], 0.0)
    z = h @ p["f6.weight"].T + p["f6.bias"]
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def _host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else np.asarray(a.get() if hasattr(a, "get") else a)


class FusedLeNet:
    """ece408 LeNet forward on the GPU: probabilities (B, 10) for inputs (B, 1, 86, 86).

    mode: 'exact' (fp32 FFMA, matches an fp64 forward to ~1e-6), 'tf32' or 'fp16'
    (tensor cores for both conv layers, fp32 accumulate; F5/F6/softmax stay fp32).
    fp16_layout (mode 'fp16' only): 'cl' (default) hands the pooled C1 map from conv1 to
    conv2 as fp16 channels-last (gpu/tc_cl.py); 'nchw' runs the rung-13 tc pair through an
    fp32 NCHW map (the previous path, kept for comparison).
    kernel_params: per-kernel parameters {"c1": {...}, "c3": {...}, "head": {"imgs": n}}
    (benchmarks); what is left out is each kernel's measured default.
    """

    def __init__(self, params: Mapping[str, Any], mode: str = "exact", fp16_layout: str = "cl",
                 kernel_params: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"FusedLeNet: mode must be one of {MODES}, got {mode!r}")
        if fp16_layout not in FP16_LAYOUTS:
            raise ValueError(f"FusedLeNet: fp16_layout must be one of {FP16_LAYOUTS}, "
                             f"got {fp16_layout!r}")
        check_params(params)
        self._kernel_params = {k: dict(v) for k, v in (kernel_params or {}).items()}
        head_imgs = int(self._kernel_params.get("head", {}).get("imgs", HEAD_DEFAULT_IMGS))
        head_d = head_defines(head_imgs)  # raises on a size the kernel was not tuned for
        from convolab.backend import require_cupy

        self._cp = cp = require_cupy()
        self.mode = mode
        self.channels_last = mode == "fp16" and fp16_layout == "cl"
        self.params = {k: cp.ascontiguousarray(cp.asarray(_host(v), cp.float32))
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
            if self.channels_last:
                from convolab.gpu import tc_cl

                c1 = tc_cl.prepare_conv1_cl(_c1_shape(batch), p["c1.weight"], p["c1.bias"], c1p)
                c3 = tc_cl.prepare_conv2_cl(_c3_shape(batch), p["c3.weight"], p["c3.bias"], c3p)
                a1 = cp.empty((batch, 40, 40, 4), cp.float16)  # fp16 channels-last
            else:
                from convolab.gpu.fused import fused_conv_pool_impl

                prec = _PRECISION_OF_MODE[self.mode]
                c1 = fused_conv_pool_impl(2, prec).prepare(
                    _c1_shape(batch), p["c1.weight"], p["c1.bias"], c1p)
                c3 = fused_conv_pool_impl(4, prec).prepare(
                    _c3_shape(batch), p["c3.weight"], p["c3.bias"], c3p)
                a1 = cp.empty((batch, 4, 40, 40), cp.float32)
            a3 = cp.empty((batch, 16, 8, 8), cp.float32)  # == the head's (batch, 1024) features
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
        if x.ndim != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
            raise ValueError(f"expected input (B, 1, 86, 86), got shape {tuple(x.shape)}")
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
        img_bytes = 4 * int(np.prod(IMAGE_SHAPE))
        pin_in = [_pinned(cp, (chunk, *IMAGE_SHAPE)) for _ in range(slots)]
        pin_out = [_pinned(cp, (chunk, 10)) for _ in range(slots)]
        dev_in = [cp.empty((chunk, *IMAGE_SHAPE), cp.float32) for _ in range(slots)]
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


def random_params(seed: int = 0) -> dict[str, np.ndarray]:
    """He-scaled random weights with the ece408 shapes (benchmarks and tests)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in PARAM_SHAPES.items():
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        scale = np.sqrt(2.0 / fan_in) if name.endswith("weight") else 0.1
        out[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out
