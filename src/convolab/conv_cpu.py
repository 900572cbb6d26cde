"""CPU convolution implementations: the fp64 reference and three float32 contenders.

- ``cpu-ref``     fp64 NumPy over a strided sliding-window view: the yardstick every other
                  implementation (CPU and GPU) is checked against.
- ``cpu-loops``   the course's milestone-1 algorithm, seven nested loops (b, m, h, w, c, p, q),
                  compiled with Numba; optionally parallel over the batch.
- ``cpu-im2col``  unroll the input windows into a matrix (chunked over the batch so the
                  workspace stays bounded) and do one BLAS GEMM per chunk.
- ``cpu-fused``   a direct convolution compiled per (K, unit stride): output rows are built
                  in a small per-thread buffer so the innermost loop runs along the output row
                  (contiguous, SIMD) with the K taps unrolled; parallel over the batch.

``conv_relu_pool_cpu`` is the same direct kernel with bias + ReLU + max-pool fused in, for
inference: the conv output never reaches memory.

NaN policy: NaN propagates. A NaN anywhere in a pool window's conv outputs makes that pooled
output NaN, in every CPU path alike — the fused kernel, the unfused layers (``ReLU`` is
``x * (x > 0)``, ``MaxPool2d`` is ``np.maximum``) and the fp64 reference — so bad input is
never laundered into a finite, plausible answer. The GPU fused kernels follow the same policy
(their pooling max and ReLU are ``fmax_nan`` in kernels/common.cuh, IEEE maximum): every
output whose receptive field holds a NaN is NaN. The tensor-core variants (kernels 17-19) may
in addition turn a neighbouring output NaN, because their padded filter taps multiply the NaN
by a zero weight.

Numba is imported only inside the kernel builders, never at import time: this module is
imported by the registry on every machine, including GPU hosts where Numba must not load.

The cpu-fused kernels are generated source (one top-level function per (K, stride)
specialisation, each with its own name) written to the user cache and compiled with
``cache=True``: the multi-second compile happens once per machine, later processes load the
machine code (see ``_kernel_module``). cpu-loops (a teaching rung) is compiled per process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import string
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, positive_int

# The reference materialises windows chunk by chunk in float64; this bounds that copy.
_REF_CHUNK_BYTES = 64 * 2**20
# cpu-im2col's unrolled-matrix workspace: default and hard ceiling.
_IM2COL_DEFAULT_MB = 16
_IM2COL_MAX_BYTES = 2 * 2**30
# Kernel sizes the fused kernels are specialised for (taps unrolled at compile time). Other
# sizes use the same source with a run-time K: correct, just slower. Kept short because every
# specialisation is a separate Numba compile.
_SPECIALISED_K: tuple[int, ...] = (3, 5, 7)


# --------------------------------------------------------------------------- validation


def _check_array(label: str, a: Any, ndim: int) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{label} must be a NumPy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{label} must be {ndim}-D, got shape {a.shape}")
    if a.dtype != np.float32:
        raise TypeError(f"{label} must be float32, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{label} must be C-contiguous")


def _validate_call(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int, *, require_f32: bool = True
) -> ConvShape:
    """Shape + dtype + layout checks shared by the public functions; returns the shape."""
    if require_f32:
        _check_array("input", x, 4)
        _check_array("weights", w, 4)
    else:
        for label, a in (("input", x), ("weights", w)):
            if not isinstance(a, np.ndarray) or a.ndim != 4:
                raise ValueError(f"{label} must be a 4-D NumPy array")
    shape = ConvShape.of(x.shape, w.shape, stride)
    if b is not None:
        if require_f32:
            _check_array("bias", b, 1)
        if tuple(b.shape) != (shape.M,):
            raise ValueError(f"bias must have shape ({shape.M},), got {tuple(b.shape)}")
    return shape


def _run_checker(name: str, shape: ConvShape, out_shape: tuple[int, ...]) -> Callable:
    """A cheap guard for run(x, y): Numba kernels do no bounds checks, so a wrong-sized
    array would read or write out of bounds instead of raising."""

    def check(x: np.ndarray, y: np.ndarray) -> None:
        if not isinstance(x, np.ndarray) or x.shape != shape.x_shape:
            got = getattr(x, "shape", type(x).__name__)
            raise ValueError(f"{name}: input must have shape {shape.x_shape}, got {got}")
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise TypeError(f"{name}: input must be C-contiguous float32")
        if not isinstance(y, np.ndarray) or y.shape != out_shape:
            got = getattr(y, "shape", type(y).__name__)
            raise ValueError(f"{name}: output must have shape {out_shape}, got {got}")
        if y.dtype != np.float32 or not y.flags.c_contiguous or not y.flags.writeable:
            raise TypeError(f"{name}: output must be a writeable C-contiguous float32 array")

    return check


def _prepared_weights(name: str, shape: ConvShape, w: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    _check_array(f"{name}: weights", w, 4)
    if w.shape != shape.w_shape:
        raise ValueError(f"{name}: weights must have shape {shape.w_shape}, got {w.shape}")
    if b is None:
        b = np.zeros(shape.M, dtype=np.float32)
    _check_array(f"{name}: bias", b, 1)
    if b.shape != (shape.M,):
        raise ValueError(f"{name}: bias must have shape ({shape.M},), got {b.shape}")
    # Private copies: a caller mutating its weights after prepare must not change results.
    return np.array(w, copy=True), np.array(b, copy=True)


# --------------------------------------------------------------------------- cpu-ref


def _windows(x: np.ndarray, K: int, S: int) -> np.ndarray:
    """(B, C, H_out, W_out, K, K) strided view: window (h, w) starts at (h*S, w*S)."""
    return sliding_window_view(x, (K, K), axis=(2, 3))[:, :, ::S, ::S]


def conv_reference(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, stride: int = 1
) -> np.ndarray:
    """The fp64 reference: Y[b,m,h,w] = bias[m] + sum_{c,p,q} X[b,c,hS+p,wS+q] W[m,c,p,q].

    Accepts any real dtype (upcast to float64) so tests can feed it exact float64 data.
    """
    shape = _validate_call(x, w, b, stride, require_f32=False)
    K, S = shape.K, shape.S
    w64 = np.asarray(w, dtype=np.float64)
    y = np.empty(shape.y_shape, dtype=np.float64)
    # tensordot copies the window view; chunk over the batch so that copy stays bounded.
    per_image = shape.C * shape.H_out * shape.W_out * K * K * 8
    chunk = max(1, _REF_CHUNK_BYTES // per_image)
    for start in range(0, shape.B, chunk):
        xs = np.asarray(x[start : start + chunk], dtype=np.float64)
        # (n, C, Ho, Wo, K, K) . (M, C, K, K) over (C, p, q) -> (n, Ho, Wo, M)
        part = np.tensordot(_windows(xs, K, S), w64, axes=([1, 4, 5], [1, 2, 3]))
        y[start : start + chunk] = part.transpose(0, 3, 1, 2)
    if b is not None:
        y += np.asarray(b, dtype=np.float64)[None, :, None, None]
    return y


def reference_conv_relu_pool(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, stride: int = 1, pool: int = 0
) -> np.ndarray:
    """fp64 maxpool(relu(conv(x, w) + b)), pool window = pool stride, floor; pool 0 is the
    plain convolution (no ReLU). The one yardstick of every fused path: chunked over the
    batch so that 10,000 images never hold their full-resolution fp64 output at once."""
    if not pool:
        return conv_reference(x, w, b, stride)
    pool = positive_int(pool, "pool (or 0 for none)")
    B = x.shape[0]
    first = conv_reference(x[:1], w, b, stride)
    _, M, Ho, Wo = first.shape
    hp, wp = Ho // pool, Wo // pool
    out = np.empty((B, M, hp, wp), np.float64)
    chunk = max(1, _REF_CHUNK_BYTES // max(1, M * Ho * Wo * 8))
    for start in range(0, B, chunk):
        y = np.maximum(conv_reference(x[start:start + chunk], w, b, stride), 0.0)
        n = y.shape[0]
        y = y[:, :, : hp * pool, : wp * pool].reshape(n, M, hp, pool, wp, pool)
        out[start:start + n] = y.max(axis=(3, 5))
    return out



def reference_forward(params: Mapping[str, Any], x: np.ndarray,
                      model: str = "ece408") -> np.ndarray:
    """fp64 forward of a whole zoo model: its conv blocks (conv + ReLU + max-pool, from
    models.conv_blocks) then its linear layers (ReLU where the layer list has one), softmax.
    params: {name: array} as Network.params() (host or device arrays); x (B, C, H, W)."""
    from convolab.backend import to_numpy
    from convolab.layers import Linear, ReLU
    from convolab.models import conv_blocks, spec

    p = {k: np.asarray(to_numpy(v), np.float64) for k, v in params.items()}
    a = np.asarray(to_numpy(x), np.float64)
    for block in conv_blocks(model):
        a = reference_conv_relu_pool(a, p[f"{block.name}.weight"], p[f"{block.name}.bias"],
                                     block.shape.S, block.pool)
    a = a.reshape(a.shape[0], -1)
    layers = spec(model).layers()
    for i, layer in enumerate(layers):
        if isinstance(layer, Linear):
            a = a @ p[f"{layer.name}.weight"].T + p[f"{layer.name}.bias"]
            if i + 1 < len(layers) and isinstance(layers[i + 1], ReLU):
                a = np.maximum(a, 0.0)
    z = np.exp(a - a.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)

def _prepare_ref(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    w, b = _prepared_weights("cpu-ref", shape, w, b)
    check = _run_checker("cpu-ref", shape, shape.y_shape)

    def run(x: np.ndarray, y: np.ndarray) -> None:
        check(x, y)
        y[...] = conv_reference(x, w, b, shape.S)

    return run


# --------------------------------------------------------------------------- cpu-loops


@functools.cache
def _loops_kernel(parallel: bool) -> Callable:
    import numba

    loop_b = numba.prange if parallel else range

    @numba.njit(cache=False, parallel=parallel)
    def conv_loops(x, w, bias, S, y):  # noqa: N803 - the course's names
        B, C = x.shape[0], x.shape[1]
        M, K = w.shape[0], w.shape[2]
        H_out, W_out = y.shape[2], y.shape[3]
        for b in loop_b(B):
            for m in range(M):
                for h in range(H_out):
                    for ow in range(W_out):
                        acc = np.float32(0.0)
                        for c in range(C):
                            for p in range(K):
                                for q in range(K):
                                    acc += x[b, c, h * S + p, ow * S + q] * w[m, c, p, q]
                        y[b, m, h, ow] = acc + bias[m]

    return conv_loops


def _prepare_loops(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    w, b = _prepared_weights("cpu-loops", shape, w, b)
    check = _run_checker("cpu-loops", shape, shape.y_shape)
    kernel = _loops_kernel(bool(params.get("parallel", False)))
    S = shape.S

    def run(x: np.ndarray, y: np.ndarray) -> None:
        check(x, y)
        kernel(x, w, b, S, y)

    return run


# --------------------------------------------------------------------------- cpu-im2col


def _im2col_bytes_per_image(shape: ConvShape) -> int:
    return (shape.C * shape.K * shape.K + 1) * shape.H_out * shape.W_out * 4


def _supports_im2col(shape: ConvShape) -> bool:
    # One image's unrolled matrix must fit the workspace ceiling.
    return _im2col_bytes_per_image(shape) <= _IM2COL_MAX_BYTES


def _prepare_im2col(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    w, b = _prepared_weights("cpu-im2col", shape, w, b)
    check = _run_checker("cpu-im2col", shape, shape.y_shape)
    C, K, S, M = shape.C, shape.K, shape.S, shape.M
    Ho, Wo = shape.H_out, shape.W_out
    ckk = C * K * K
    budget = int(params.get("workspace_mb", _IM2COL_DEFAULT_MB)) * 2**20
    chunk = int(min(shape.B, max(1, budget // _im2col_bytes_per_image(shape))))
    # The bias rides along in the GEMM: a row of ones under the unrolled input and a bias
    # column beside the weights, so no separate pass over the output is needed.
    workspace = np.empty((chunk, ckk + 1, Ho * Wo), dtype=np.float32)
    workspace[:, ckk, :] = 1.0
    w_aug = np.concatenate([w.reshape(M, ckk), b[:, None]], axis=1)

    def run(x: np.ndarray, y: np.ndarray) -> None:
        check(x, y)
        for start in range(0, shape.B, chunk):
            n = min(chunk, shape.B - start)
            cols = workspace[:n, :ckk, :].reshape(n, C, K, K, Ho, Wo)
            # rows ordered (c, p, q) to match w.reshape(M, C*K*K); columns (h, w).
            np.copyto(cols, _windows(x[start : start + n], K, S).transpose(0, 1, 4, 5, 2, 3))
            np.matmul(w_aug, workspace[:n], out=y[start : start + n].reshape(n, M, Ho * Wo))

    return run


# --------------------------------------------------------------------------- cpu-fused

# Output rows are computed in whole SIMD vectors (16 float32 lanes = one AVX-512 register);
# the few extra columns land in the row buffer and are never stored. Without this the
# W_out % 16 leftover columns run scalar and, at W_out = 34, cost as much as the rest.
_LANES = 16

# The direct kernels' source, instantiated once per (K, unit stride) as top-level functions
# with distinct names (see _kernel_module). $K and $S are compile-time constants where
# specialised (the K taps unroll, S == 1 makes the innermost loop contiguous) and run-time
# values otherwise; $TAG makes every function name unique.
_KERNEL_TEMPLATE = string.Template('''
@numba.njit(cache=True, fastmath={"contract"})
def conv_row_$TAG(x, w, bias, stride, b, h, n_cols, xpad, acc):
    # acc[m, :n_cols] = bias[m] + sum_{c,p,q} w[m,c,p,q] * x[b, c, h*S+p, ow*S+q]. Each input
    # row used is first copied into a zero-padded per-thread row so the innermost loop (along
    # the output row: SIMD FMAs when S == 1) runs whole vectors without reading past the input.
    C, W = x.shape[1], x.shape[3]
    M = w.shape[0]
    K = $K
    S = $S
    for m in range(M):
        bm = bias[m]
        for ow in range(n_cols):
            acc[m, ow] = bm
    for c in range(C):
        for p in range(K):
            xrow = x[b, c, h * S + p]
            for i in range(W):
                xpad[i] = xrow[i]
            for m in range(M):
                wrow = w[m, c, p]
                arow = acc[m]
                for ow in range(n_cols):
                    s = arow[ow]
                    for q in range(K):
                        s += wrow[q] * xpad[ow * S + q]
                    arow[ow] = s


@numba.njit(cache=True, parallel=True)
def conv_direct_$TAG(x, w, bias, stride, y):
    W = x.shape[3]
    M = w.shape[0]
    K = $K
    S = $S
    B, H_out, W_out = y.shape[0], y.shape[2], y.shape[3]
    n_cols = (W_out + LANES - 1) // LANES * LANES
    for b in numba.prange(B):
        acc = np.empty((M, n_cols), dtype=np.float32)
        xpad = np.zeros((n_cols - 1) * S + K + W, dtype=np.float32)
        for h in range(H_out):
            conv_row_$TAG(x, w, bias, stride, b, h, n_cols, xpad, acc)
            for m in range(M):
                for ow in range(W_out):
                    y[b, m, h, ow] = acc[m, ow]


@numba.njit(cache=True, parallel=True)
def conv_relu_pool_$TAG(x, w, bias, stride, P, y):
    # Each pooled row needs P conv rows: computed one after another into the same buffer and
    # folded into a running max, so the conv output never reaches memory. ReLU goes after
    # the max (they commute).
    W = x.shape[3]
    M = w.shape[0]
    K = $K
    S = $S
    B, Hp, Wp = y.shape[0], y.shape[2], y.shape[3]
    # Conv columns past the last full pool window are never needed (floor pooling).
    n_cols = (Wp * P + LANES - 1) // LANES * LANES
    for b in numba.prange(B):
        acc = np.empty((M, n_cols), dtype=np.float32)
        best = np.empty((M, Wp), dtype=np.float32)
        xpad = np.zeros((n_cols - 1) * S + K + W, dtype=np.float32)
        for ph in range(Hp):
            for m in range(M):
                for pw in range(Wp):
                    best[m, pw] = -np.inf
            for r in range(P):
                conv_row_$TAG(x, w, bias, stride, b, ph * P + r, n_cols, xpad, acc)
                for m in range(M):
                    for pw in range(Wp):
                        v = best[m, pw]
                        for j in range(P):
                            a = acc[m, pw * P + j]
                            # NaN propagates: once v is NaN, a > v stays False and v keeps it.
                            if a > v or a != a:
                                v = a
                        best[m, pw] = v
            for m in range(M):
                for pw in range(Wp):
                    v = best[m, pw]
                    y[b, m, ph, pw] = v if (v > 0 or v != v) else np.float32(0.0)
''')


# conv_relu_pool's channel-blocked kernels (unit stride, specialised K, M a multiple of
# _MB): each loaded input vector feeds _MB output channels' FMAs, with the _MB x K weights of
# one (c, p) hoisted as scalars. The per-thread accumulator rows sit _ROW floats apart in one
# array, so LLVM sees constant distances between them and vectorises without run-time alias
# checks (separate row arrays, or a run-time row stride, left the loop scalar).
_MB = 4
_ROW = 128

_BLOCKED_TEMPLATE = string.Template('''
@numba.njit(cache=True, fastmath={"contract"})
def conv_row_mb_$TAG(x, w, bias, b, h, n_cols, acc, xpad):
    # acc[m*ROW + ow] = bias[m] + sum_{c,p,q} w[m,c,p,q] * x[b, c, h+p, ow+q], ow < n_cols.
    C, W = x.shape[1], x.shape[3]
    M = w.shape[0]
    for m in range(M):
        bm = bias[m]
        o = m * ROW
        for i in range(n_cols):
            acc[o + i] = bm
    for c in range(C):
        for p in range($K):
            xrow = x[b, c, h + p]
            for i in range(W):
                xpad[i] = xrow[i]
            for g in range(M // MB):
$BODY


@numba.njit(cache=True, parallel=True)
def conv_relu_pool_mb_$TAG(x, w, bias, stride, P, y):
    # As conv_relu_pool_${TAG}_s1 (the fallback where M is not a multiple of MB or a row does
    # not fit ROW): P conv rows per pooled row folded into a running max (at full column
    # resolution, vectorised), then the horizontal max, then ReLU. NaN propagates.
    M = w.shape[0]
    B, Hp, Wp = y.shape[0], y.shape[2], y.shape[3]
    n_cols = (Wp * P + LANES - 1) // LANES * LANES
    if M % MB != 0 or n_cols + $K - 1 > ROW or x.shape[3] > ROW:
        conv_relu_pool_${TAG}_s1(x, w, bias, stride, P, y)
        return
    for b in numba.prange(B):
        acc = np.zeros(M * ROW, dtype=np.float32)
        xpad = np.zeros(ROW, dtype=np.float32)
        best = np.empty((M, n_cols), dtype=np.float32)
        for ph in range(Hp):
            for r in range(P):
                conv_row_mb_$TAG(x, w, bias, b, ph * P + r, n_cols, acc, xpad)
                fold_rows(acc, best, r == 0)
            for m in range(M):
                for pw in range(Wp):
                    v = best[m, pw * P]
                    for j in range(1, P):
                        a = best[m, pw * P + j]
                        if a > v or a != a:
                            v = a
                    y[b, m, ph, pw] = v if (v > 0 or v != v) else np.float32(0.0)
''')

_FOLD_SOURCE = '''
@numba.njit(cache=True)
def fold_rows(acc, best, first):
    # best[m, :] = acc row m (first conv row of a pool window) or the NaN-keeping max.
    M, n_cols = best.shape
    for m in range(M):
        o = m * ROW
        br = best[m]
        if first:
            for i in range(n_cols):
                br[i] = acc[o + i]
        else:
            for i in range(n_cols):
                u = br[i]
                v = acc[o + i]
                br[i] = v if (v > u or v != v) else u
'''


def _blocked_body(K: int) -> str:
    """The innermost loop of conv_row_mb for kernel size K, unrolled over the _MB channels
    of a block and the K taps: one input vector load feeds _MB FMAs."""
    ind = " " * 16
    lines = [f"{ind}m0 = g * MB"]
    lines += [f"{ind}w{j}_{q} = w[m0 + {j}, c, p, {q}]" for j in range(_MB) for q in range(K)]
    lines += [f"{ind}o = g * {_MB * _ROW}", f"{ind}for i in range(n_cols):"]
    ind += "    "
    lines += [f"{ind}s{j} = acc[o + {j * _ROW} + i]" for j in range(_MB)]
    for q in range(K):
        lines.append(f"{ind}v = xpad[{q} + i]")
        lines += [f"{ind}s{j} += w{j}_{q} * v" for j in range(_MB)]
    lines += [f"{ind}acc[o + {j * _ROW} + i] = s{j}" for j in range(_MB)]
    return "\n".join(lines)


def _kernel_tag(k_spec: int, unit_stride: bool) -> str:
    return f"k{k_spec or 'n'}_s{1 if unit_stride else 'n'}"


def kernel_source() -> str:
    """The generated kernel module: every (K, stride) specialisation as its own top-level
    function. Distinct names are what make Numba's on-disk cache safe: it indexes compiled
    code by qualified name, and same-named closures resolved to the wrong specialisation."""
    parts = ["import numba\nimport numpy as np\n",
             f"LANES = {_LANES}\nMB = {_MB}\nROW = {_ROW}\n", _FOLD_SOURCE]
    for k_spec in (*_SPECIALISED_K, 0):
        for unit in (True, False):
            parts.append(_KERNEL_TEMPLATE.substitute(
                TAG=_kernel_tag(k_spec, unit), K=str(k_spec) if k_spec else "w.shape[2]",
                S="1" if unit else "stride"))
    for k in _SPECIALISED_K:
        parts.append(_BLOCKED_TEMPLATE.substitute(TAG=f"k{k}", K=str(k), BODY=_blocked_body(k)))
    return "\n".join(parts)


def kernel_cache_dir() -> Path:
    """Where the generated kernels and Numba's compiled code for them live: the user cache
    ($CONVOLAB_CACHE, else $XDG_CACHE_HOME/convolab, else ~/.cache/convolab), /numba."""
    from convolab.gpu.tune import cache_dir  # the one definition of the user cache folder

    return cache_dir() / "numba"


def _write_once(path: Path, text: str) -> None:
    """Write `text` to `path` unless it is already there (whole: temp file + os.replace, so
    a concurrent process never imports half a module)."""
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@functools.cache
def _kernel_module() -> ModuleType:
    """Import the generated kernels from a file in the user cache, so Numba caches their
    machine code next to it (cache=True): compiled once per machine, not once per process.
    Where the cache cannot be written the kernels compile in a temporary folder instead
    (correct, just compiled again in every process). The file name holds a hash of the
    source and the Numba version, so a changed kernel is never matched with stale code."""
    import numba

    source = kernel_source()
    digest = hashlib.sha256(f"{numba.__version__}\n{source}".encode()).hexdigest()[:16]
    name = f"convolab_cpu_kernels_{digest}"
    try:
        path = kernel_cache_dir() / f"{name}.py"
        _write_once(path, source)
    except OSError:
        path = Path(tempfile.mkdtemp(prefix="convolab-numba-")) / f"{name}.py"
        _write_once(path, source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _spec_k(K: int) -> int:
    return K if K in _SPECIALISED_K else 0


def _direct_kernels(K: int, unit_stride: bool) -> tuple[Callable, Callable]:
    """(conv_direct, conv_relu_pool) for kernel size K, both parallel over the batch."""
    module = _kernel_module()
    tag = _kernel_tag(_spec_k(K), unit_stride)
    # conv_relu_pool: the channel-blocked kernel where one exists (it falls back itself).
    pool_tag = f"mb_k{K}" if unit_stride and _spec_k(K) else tag
    return getattr(module, f"conv_direct_{tag}"), getattr(module, f"conv_relu_pool_{pool_tag}")


def _prepare_fused(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    w, b = _prepared_weights("cpu-fused", shape, w, b)
    check = _run_checker("cpu-fused", shape, shape.y_shape)
    kernel = _direct_kernels(shape.K, shape.S == 1)[0]
    S = shape.S

    def run(x: np.ndarray, y: np.ndarray) -> None:
        check(x, y)
        kernel(x, w, b, S, y)

    return run


def conv_relu_pool_cpu(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int = 1, pool: int = 2
) -> np.ndarray:
    """maxpool(relu(conv(x, w) + b), pool) in one fused pass (pool window = pool stride,
    floor semantics). float32, C-contiguous NumPy inputs; returns a new float32 array."""
    shape = _validate_call(x, w, b, stride)
    pool = positive_int(pool, "pool")
    if shape.H_out < pool or shape.W_out < pool:
        raise ValueError(
            f"pool {pool} is larger than the conv output {shape.H_out}x{shape.W_out}"
        )
    if b is None:
        b = np.zeros(shape.M, dtype=np.float32)
    y = np.empty((shape.B, shape.M, shape.H_out // pool, shape.W_out // pool), dtype=np.float32)
    kernel = _direct_kernels(shape.K, shape.S == 1)[1]
    kernel(x, w, b, shape.S, pool, y)
    return y


# --------------------------------------------------------------------------- registration

register(
    ConvImpl(
        name="cpu-ref",
        demonstrates="fp64 NumPy reference over a strided sliding-window view (the yardstick)",
        device="cpu",
        prepare=_prepare_ref,
        tolerance=1e-7,  # its float32 output is the fp64 result rounded once
        reference_only=True,
    )
)
register(
    ConvImpl(
        name="cpu-loops",
        demonstrates="the course's 7-loop sequential algorithm (b, m, h, w, c, p, q), Numba",
        device="cpu",
        prepare=_prepare_loops,
        space={"parallel": (False, True)},
        defaults={"parallel": False},
    )
)
register(
    ConvImpl(
        name="cpu-im2col",
        demonstrates="unroll (im2col) chunked over the batch + one BLAS GEMM per image",
        device="cpu",
        prepare=_prepare_im2col,
        supports=_supports_im2col,
        space={"workspace_mb": (4, 16, 64, 256)},
        defaults={"workspace_mb": _IM2COL_DEFAULT_MB},
    )
)
register(
    ConvImpl(
        name="cpu-fused",
        demonstrates="direct conv specialised by K: row-buffer accumulation, SIMD along rows, "
        "parallel over the batch (conv_relu_pool_cpu adds bias+ReLU+max-pool)",
        device="cpu",
        prepare=_prepare_fused,
    )
)
