"""Host side of kernel 30, `dense_head` (kernels/30_dense_head.cu): any zoo model's layers after
its last conv block (Linear [+ReLU] ... Linear, softmax, argmax) in one launch, generated from
the model's layer list (`models.head_layers`). Define sets, weight packing, shared memory, and
run(). Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from convolab.models import DenseLayer, head_layers
from convolab.shapes import ceil_div

KERNEL_FILE = "30_dense_head.cu"
THREADS = 256  # DH_THREADS
MAX_LAYERS = 4  # DH_N1 .. DH_N4
# Outputs a thread in the first layer (default; DH_TI x MAX_TO accumulators at most): 10 puts
# the zoo's 10 classes in one group, each feature read from shared memory serving all of them.
# Nsight Compute (H200, B = 10,000, 2026-11-28): eecs498 49.0 vs 52.1 us with 8 (two groups of
# 5), mxnet 75.4 vs 79.5; 128 registers instead of 100, the same 2 blocks an SM.
MAX_TO = 10
TO_LIMIT = 16  # the most a head's `to` parameter may ask for
MAX_SMEM = 227 * 1024
NAN_LABEL = 255  # DH_NAN_LABEL: the label of an image whose probabilities are NaN
# Default tiles (images, k a chunk, images a thread), the first that fits a head: 40 images, 5
# a thread, k chunks of 128 make 250 tiles at B = 10,000, 1.9 an SM on 132 SMs, where 32-image
# tiles made 313 (2.4: the SMs with 3 finished last). Nsight Compute (H100, 2026-11-28): 80.7 vs
# 89.7 us (mxnet), 53.0 vs 58.8 (eecs498). 32 / 64 / 4 needs half the shared memory (wide
# first layers).
DEFAULT_TILES = ((40, 128, 5), (32, 64, 4))
TI_CHOICES = (2, 4, 5, 8)  # 8: 13 shared-memory reads for 40 FMAs a k, but slower (docs/raw.md)
IMGS_CHOICES = (16, 32, 40, 64)
KC_CHOICES = (64, 128)  # k a chunk: 128 doubles the feature bytes in flight a thread


def head_defines(layers: Sequence[DenseLayer], imgs: int | None = None, vec: int = 4,
                 kc: int | None = None, ti: int | None = None,
                 to: int | None = None) -> dict[str, int]:
    """The kernel's define set for a head: layer widths, ReLU bits, and the first layer's
    register tile (`ti` images by N1 outputs as OG groups of TO: the fewest groups with
    TO <= `to` (default MAX_TO), a power of two so that they divide the 256 threads). What is
    not given comes from the first of DEFAULT_TILES that fits with what is."""
    max_to = to or MAX_TO
    if not 1 <= max_to <= TO_LIMIT:
        raise ValueError(f"dense head: to (outputs a thread) must be in 1..{TO_LIMIT}, got {to}")
    for default in DEFAULT_TILES[:-1]:
        tile = [given or d for given, d in zip((imgs, kc, ti), default, strict=True)]
        try:
            return _defines(layers, tile[0], vec, tile[1], tile[2], max_to)
        except ValueError:
            continue
    last = DEFAULT_TILES[-1]
    return _defines(layers, imgs or last[0], vec, kc or last[1], ti or last[2], max_to)


def _defines(layers: Sequence[DenseLayer], imgs: int, vec: int, kc: int,
             ti: int, max_to: int = MAX_TO) -> dict[str, int]:
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"dense head: 1..{MAX_LAYERS} linear layers, got {len(layers)}")
    if imgs not in IMGS_CHOICES or kc not in KC_CHOICES or ti not in TI_CHOICES:
        raise ValueError(f"dense head: imgs must be one of {IMGS_CHOICES}, kc one of "
                         f"{KC_CHOICES} and ti one of {TI_CHOICES}, got {imgs}, {kc}, {ti}")
    if imgs % ti != 0 or THREADS % (imgs // ti) != 0:
        raise ValueError(f"dense head: a tile of {imgs} images, {ti} a thread, needs ti to "
                         f"divide imgs and imgs / ti to divide {THREADS}")
    n1 = layers[0].out_features
    og = 1
    while ceil_div(n1, og) > max_to:
        og *= 2
    if og * imgs // ti > THREADS:
        raise ValueError(f"dense head: {n1} outputs in the first layer is over the "
                         f"{THREADS // (imgs // ti) * max_to} a tile of {imgs} images allows")
    if kc % (THREADS // (og * imgs // ti)) != 0:
        raise ValueError(f"dense head: a tile of {imgs} images, {ti} a thread, splits k in "
                         f"{THREADS // (og * imgs // ti)} groups, which kc = {kc} does not fill")
    vec = 4 if vec == 4 and layers[0].in_features % 4 == 0 else 1
    if (imgs * kc) % (vec * THREADS) != 0:
        raise ValueError(f"dense head: a chunk of {imgs} images x {kc} features does not split "
                         f"evenly into {THREADS} threads' {vec}-wide loads")
    widths = [layer.out_features for layer in layers] + [0] * (MAX_LAYERS - len(layers))
    d = {"DH_F": layers[0].in_features, "DH_L": len(layers),
         **{f"DH_N{i + 1}": w for i, w in enumerate(widths)},
         "DH_RELU": sum(1 << i for i, layer in enumerate(layers) if layer.relu),
         "DH_IMGS": imgs, "DH_TI": ti, "DH_TO": ceil_div(n1, og), "DH_OG": og, "DH_KC": kc,
         "DH_VEC": vec}
    smem = smem_bytes(d)
    if smem > MAX_SMEM:
        raise ValueError(f"dense head: {smem} bytes of shared memory (widest layer "
                         f"{max(widths)}) is over the {MAX_SMEM} a block may have")
    return d


def smem_bytes(d: Mapping[str, int]) -> int:
    """Dynamic shared memory of `dense_head` (DH_SMEM_BYTES): two staging buffers of features
    and first-layer weights (or, after the k loop, the k groups' partial sums), and two
    activation buffers as wide as the widest layer."""
    imgs, n1p = d["DH_IMGS"], d["DH_OG"] * d["DH_TO"]
    ks = THREADS // (imgs // d["DH_TI"] * d["DH_OG"])
    stage = 2 * (imgs * (d["DH_KC"] + 4) + d["DH_KC"] * n1p)  # rows of KC + 4 (DH_XS)
    widest = max(d[f"DH_N{i + 1}"] for i in range(MAX_LAYERS))
    return 4 * (max(stage, ks * imgs * n1p) + 2 * imgs * widest)


def pack_weights(layers: Sequence[DenseLayer], params: Mapping[str, Any],
                 d: Mapping[str, int]) -> tuple[np.ndarray, ...]:
    """(w1t, b1, wtail, btail) as the kernel reads them: the first layer's weight transposed to
    (in, out), zero-padded to whole k chunks and OG x TO columns; the later layers' weights
    (out, in) and biases concatenated in order (one zero when there are none)."""
    def get(layer: DenseLayer, what: str, shape: tuple[int, ...]) -> np.ndarray:
        key = f"{layer.name}.{what}"
        if key not in params:
            if what == "bias":
                return np.zeros(shape, np.float32)
            raise ValueError(f"dense head: missing parameter {key!r}")
        value = np.asarray(params[key].get() if hasattr(params[key], "get") else params[key],
                           np.float32)
        if value.shape != shape:
            raise ValueError(f"dense head: {key} has shape {value.shape}, expected {shape}")
        return value

    first = layers[0]
    w1 = get(first, "weight", (first.out_features, first.in_features))
    w1t = np.zeros((ceil_div(first.in_features, d["DH_KC"]) * d["DH_KC"],
                    d["DH_OG"] * d["DH_TO"]), np.float32)
    w1t[: first.in_features, : first.out_features] = w1.T
    b1 = get(first, "bias", (first.out_features,))
    rest = layers[1:]
    ws = [get(x, "weight", (x.out_features, x.in_features)).ravel() for x in rest]
    bs = [get(x, "bias", (x.out_features,)) for x in rest]
    wtail = np.concatenate(ws) if ws else np.zeros(1, np.float32)
    btail = np.concatenate(bs) if bs else np.zeros(1, np.float32)
    return w1t, b1, wtail, btail


def _check(name: str, a: Any, shape: tuple[int, ...], dtype: Any) -> None:
    if a is None:
        return
    if tuple(a.shape) != shape or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"dense head: {name} must be a contiguous {np.dtype(dtype).name} "
                         f"device array of shape {shape}, got {getattr(a, 'dtype', '?')} "
                         f"{tuple(getattr(a, 'shape', ()))}")


def prepare_layers(layers: Sequence[DenseLayer], params: Mapping[str, Any],
                   imgs: int | None = None, kc: int | None = None,
                   ti: int | None = None, to: int | None = None) -> Callable[..., None]:
    """`dense_head` for these layers, weights packed and uploaded once:
    run(features, probs=None, labels=None).

    features: (B, F) fp32 device array (or any C-contiguous (B, ...) holding F values an image,
    e.g. the last conv block's pooled (B, C, H, W) output as is); probs: (B, classes) fp32 and
    labels: (B,) uint8, device arrays, written (at least one). A label is the first index of
    the largest probability, or NAN_LABEL where the probabilities are NaN.
    """
    from convolab.backend import require_cupy
    from convolab.gpu.compile import get_kernel

    cp = require_cupy()
    layers = list(layers)
    base = head_defines(layers, imgs, kc=kc, ti=ti, to=to)
    packed = [cp.asarray(a) for a in pack_weights(layers, params, base)]
    n_in, n_classes = layers[0].in_features, layers[-1].out_features
    kernels: dict[int, Any] = {}

    def kernel(vec: int) -> Any:  # the float4 variant for aligned rows, else the scalar one
        if vec not in kernels:
            d = head_defines(layers, base["DH_IMGS"], vec, base["DH_KC"], base["DH_TI"],
                             base["DH_TO"])
            kernels[vec] = get_kernel(KERNEL_FILE, "dense_head", d)
            kernels[vec].max_dynamic_shared_size_bytes = smem_bytes(d)
        return kernels[vec]

    smem = smem_bytes(base)
    dummy_probs, dummy_labels = cp.empty(1, cp.float32), cp.empty(1, cp.uint8)

    def run(features: Any, probs: Any = None, labels: Any = None) -> None:
        if probs is None and labels is None:
            raise ValueError("dense head: ask for probs, labels or both")
        batch = int(features.shape[0]) if features.ndim else -1
        if (features.dtype != cp.float32 or not features.flags.c_contiguous or batch < 0
                or features.size != batch * n_in):
            raise ValueError(f"dense head: features must be a contiguous float32 device array "
                             f"of shape (B, {n_in}), got {features.dtype} {features.shape}")
        _check("probs", probs, (batch, n_classes), cp.float32)
        _check("labels", labels, (batch,), cp.uint8)
        if labels is not None and n_classes > NAN_LABEL:
            raise ValueError(f"dense head: uint8 labels hold at most {NAN_LABEL} classes")
        if batch == 0:
            return
        vec = base["DH_VEC"] if features.data.ptr % 16 == 0 else 1
        flags = (probs is not None) | (labels is not None) << 1
        kernel(vec)((ceil_div(batch, base["DH_IMGS"]),), (THREADS,),
                    (features, *packed, dummy_probs if probs is None else probs,
                     dummy_labels if labels is None else labels, np.int32(batch),
                     np.int32(flags)), shared_mem=smem)

    run.defines = base  # type: ignore[attr-defined]  # for tests and benchmarks
    return run


def prepare_dense_head(model: str, params: Mapping[str, Any], imgs: int | None = None,
                       kc: int | None = None, ti: int | None = None,
                       to: int | None = None) -> Callable[..., None]:
    """The zoo model's head (`models.head_layers(model)`) on its parameters (Network.params()
    names, host or device arrays): run(features, probs=None, labels=None), see prepare_layers."""
    return prepare_layers(head_layers(model), params, imgs, kc, ti, to)


def compile_jobs() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """Every zoo model's head, float4 and scalar loads, the 8-image register tile and 16
    outputs a thread (tests/test_nvcc_compile.py)."""
    from convolab.models import MODELS

    tiles = ((4, None, None), (1, None, None), (4, 8, None), (4, None, TO_LIMIT))
    return {f"dense-head {m} (dense_head)": [(KERNEL_FILE, head_defines(head_layers(m), vec=v,
                                                                      ti=ti, to=to))
                                             for v, ti, to in tiles]
            for m in MODELS}
