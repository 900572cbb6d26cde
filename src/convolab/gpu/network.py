"""A zoo LeNet's whole forward on the GPU, fused: the fastest path (docs/spec.md, docs/fused.md).

Built from the model's layer list (models.conv_blocks, models.head_layers): one fused
conv + bias + ReLU + max-pool launch per conv block, then the linear head in one launch.
For ece408:

    C1 conv 1->4 K7 + ReLU + pool 2   a fused conv+pool rung (13/16 fp32 FFMA, 17 tf32;
    C3 conv 4->16 K7 + ReLU + pool 4   15 fp32, 18 tf32; 19 in mode 'fp16')
    F5 + ReLU, F6, softmax            kernel 20, kernels/20_lenet_head.cu: 10 floats out

and kernel 30 (gpu/dense_head.py) is the head of the other models. The wider models' first
block (one input channel, 12 output channels) runs rung 29 (gpu/fused_first.py: fp16
tensor cores, 3xfp16 in exact/tf32; on Hopper the 3xfp16 runs on rung 45, its wgmma form).
The only full-size intermediates are the pooled maps between blocks (ece408: 25.6 KB an
image in fp32 NCHW; in mode 'fp16' ece408's pair passes it as fp16 channels-last, 12.8 KB:
gpu/fused_cl.py). A prepared run that reads fp16 says so
(`run.in_dtype = "float16"`); the plan then allocates the map before it in fp16, which rung 29
writes directly (elsewhere a cast follows the block that writes it).
Rung 28 (gpu/fused_wide.py) runs the blocks rungs 17/18 do not take (the wider models' conv2)
in every mode (3xfp16 in 'exact'), reading the map before it in fp16 in mode 'fp16'; on Hopper
its wgmma form, rung 44 (gpu/fused_wgmma.py), takes them in 'fp16' and 'exact', fed by a
producer warpgroup (rung 46) where its buffers fit; in 'exact', where conv1 runs on rung 45
with K >= 6, conv1 writes rung 46's staged records instead of fp32 maps (`_staged_pair`).

Input: float images (B, C, S, S) as the model expects them, or raw uint8 images (B, h, w) —
784 bytes a Fashion-MNIST image instead of 29,584 — which the first conv kernel resizes on chip
while it stages its tile (kernels/resize.cuh, the rule of data.resize_bilinear, so the exact
mode's output is the same bits either way). A first layer whose kernel has no raw variant gets
rung 25's standalone resize in front of it.

Repeated calls replay a CUDA graph: the second forward of one batch size whose input and output
lie where they lay before is captured (on a private stream) and from then on launched as one
graph, so the host's per-kernel launch work no longer runs ahead of the GPU (0.01-0.06 ms a
forward on the H100, docs/raw.md). A graph reads its input where it was captured, so a replay
is exact whatever the array there holds; it is dropped with the buffers it was captured on
(`graphs=False` launches every kernel from the host every time). `net(x)` returns a new output
array, except that the one it returned last time (same batch size and stream) is handed out
again once the caller has dropped every reference to it and its memory: what CuPy's pool would
do, without the pool's allocation and free in front of the launch, and the graph's output
address stays put.

`FusedLeNet` takes a plain dict {name: array} (see models.param_shapes) so it does not depend on
the framework's classes; `from_network(net)` adapts anything with a `params()` mapping. Nothing
imports CuPy at module import time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from convolab.backend import to_numpy
from convolab.errors import ConvolabError, InputError, InputTypeError
from convolab.gpu.lenet_head import HEAD_DEFAULT_IMGS, head_defines, prepare_head
from convolab.models import MODELS, ConvBlock, conv_blocks, head_layers, param_shapes, spec
from convolab.precision import NETWORK_MODES
from convolab.shapes import positive_int

MODEL = "ece408"  # the default model (the course network)
# Share of the free device memory one forward's buffers may take: the rest is left for the
# memory pool's rounding and fragmentation, the conv rungs' own workspaces and other processes.
DEVICE_MEMORY_SHARE = 0.8
# Largest raw image a fused first layer stages whole in shared memory (as floats, 4 B a pixel):
# 96x96 leaves room for the layer's own tile in the 48 KB a block may take statically.
MAX_RAW_PIXELS = 96 * 96
# Images per streamed step and steps in flight: 60,000 raw images host -> host in fp16 measured
# 13.2M img/s at 20,000 x 3 against 10.4M at 10,000 x 3 and 8.7M at 3,000 x 3 (H100; fewer,
# larger steps spend less of the job filling and draining the pipeline).
STREAM_CHUNK = 20_000
STREAM_SLOTS = 3
# Graphs kept per plan (one per input and output address pair): a caller whose arrays move
# around gets a few, not one per call.
GRAPHS_PER_PLAN = 4


def image_shape(model: str = MODEL) -> tuple[int, int, int]:
    """(C, H, W) of one float input image: the first conv block's input."""
    shape = conv_blocks(model)[0].shape
    return (shape.C, shape.H, shape.W)


def _pooled_elems(block: ConvBlock) -> int:
    s = block.shape
    return s.M * (s.H_out // block.pool) * (s.W_out // block.pool)


def bytes_per_image(mode: str, with_input: bool = True, model: str = MODEL,
                    raw_hw: tuple[int, int] | None = None) -> int:
    """Device bytes one image needs in a forward: its input (when the forward allocates it:
    raw bytes or floats), a resized copy where the first layer cannot resize on chip, every
    pooled map between blocks (fp16 where mode 'fp16' runs the channels-last pair), the last
    block's features and the probabilities."""
    blocks = conv_blocks(model, 1)
    inner = sum(_pooled_elems(b) for b in blocks[:-1]) * (2 if mode == "fp16" else 4)
    floats = int(np.prod(image_shape(model)))
    x = (raw_hw[0] * raw_hw[1] + 4 * floats if raw_hw else 4 * floats) if with_input else 0
    return inner + 4 * (_pooled_elems(blocks[-1]) + _classes(model)) + x


def _classes(model: str) -> int:
    return head_layers(model)[-1].out_features


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


def check_params(params: Mapping[str, Any], model: str = MODEL) -> None:
    want_shapes = param_shapes(model)
    missing = [k for k in want_shapes if k not in params]
    if missing:
        raise ValueError(f"FusedLeNet: missing parameters {missing} (need {list(want_shapes)})")
    for name, want in want_shapes.items():
        got = tuple(params[name].shape)
        if got != want:
            raise ValueError(f"FusedLeNet: {name} has shape {got}, the {model} model needs {want}")


def from_network(net: Any, mode: str = "exact") -> FusedLeNet:
    """Adapter for the framework's Network (anything with params() -> {name: array})."""
    params = net.params() if callable(getattr(net, "params", None)) else net
    model = getattr(net, "name", None) or MODEL
    return FusedLeNet(dict(params), mode=mode, model=model if model in MODELS else MODEL)


def _uses_lenet_head(model: str) -> bool:
    """Kernel 20 is built for ece408's head (F5 1024 -> 32 + ReLU, F6 32 -> 10)."""
    def sizes(name: str) -> list[tuple[int, int, bool]]:
        return [(d.in_features, d.out_features, d.relu) for d in head_layers(name)]

    return sizes(model) == sizes(MODEL)


def _channels_last_pair(model: str, mode: str) -> bool:
    """Mode 'fp16' of a two-block model whose blocks the channels-last pair takes (ece408)."""
    if mode != "fp16":
        return False
    blocks = conv_blocks(model, 1)
    from convolab.gpu import fused_cl

    return (len(blocks) == 2 and blocks[0].pool == 2 and blocks[0].shape.C == 1
            and fused_cl.cl_supports(blocks[1].shape, blocks[1].pool))


def _kind_of(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return "a NumPy array"
    if type(x).__module__.split(".")[0] == "cupy":
        return "a CuPy array"
    return f"a {type(x).__name__}"


def not_device_array(x: Any) -> str:
    """Why `net(x)` refuses x (not a CuPy array), and what to call instead."""
    return (f"FusedLeNet(x) takes a device (CuPy) array, got {_kind_of(x)}: for a host batch call "
            "net.forward_chunks(x) (host in, host out, streamed in chunks), or copy it to the "
            "GPU first with net(cupy.asarray(x))")


def check_batch(shape: tuple[int, ...], dtype: Any, image_shape: tuple[int, int, int],
                model: str = MODEL) -> None:
    """A batch FusedLeNet takes: float32 images (B, *image_shape), or raw uint8 images
    (B, h, w) of 1..MAX_RAW_PIXELS pixels each. Anything else: one InputError (shape) or
    InputTypeError (dtype) naming the problem and the fix."""
    # Every forward passes here: the accepted batches return before any message is built.
    if len(shape) == 3 and dtype == np.uint8:
        if 0 not in shape[1:] and shape[1] * shape[2] <= MAX_RAW_PIXELS:
            return
    elif len(shape) == 4 and dtype == np.float32 and tuple(shape[1:]) == tuple(image_shape):
        return
    raise _batch_error(tuple(shape), np.dtype(dtype), image_shape, model)


def _batch_error(shape: tuple[int, ...], dtype: np.dtype, image_shape: tuple[int, int, int],
                 model: str) -> ConvolabError:
    floats = f"(B, {', '.join(map(str, image_shape))}) float32"
    takes = f"FusedLeNet ({model}) takes float images {floats} or raw uint8 images (B, H, W)"
    ndim = len(shape)
    if ndim == 3 and dtype != np.uint8:
        return InputTypeError(f"FusedLeNet: 3-D input is read as raw images (B, H, W) and must "
                              f"be uint8 (the bytes of the image file), got {dtype}; float "
                              f"images are {floats}")
    if ndim == 3:
        return InputError(f"FusedLeNet: raw images must have 1..{MAX_RAW_PIXELS} pixels each, "
                          f"got shape {shape}")
    if ndim == 4 and dtype == np.uint8:
        hint = " (drop the channel axis: x[:, 0])" if shape[1] == 1 else ""
        return InputError(f"FusedLeNet: uint8 input is read as raw images (B, H, W), got 4-D "
                          f"shape {shape}{hint}")
    if ndim == 2 and dtype == np.uint8:
        return InputError(f"{takes}, got shape {shape}: one raw image needs its batch axis "
                          f"(x[None])")
    if ndim != 4 or tuple(shape[1:]) != tuple(image_shape):
        return InputError(f"{takes}, got {dtype} of shape {shape}")
    return InputTypeError(f"FusedLeNet: float images must be float32, got {dtype}; cast them "
                          f"with x.astype(numpy.float32) (cupy.float32 on the device)")


class FusedLeNet:
    """A zoo LeNet's forward on the GPU: probabilities (B, classes) for float images
    (B, C, S, S) or raw uint8 images (B, h, w), which the first conv kernel resizes on chip.

    model: a zoo model (models.MODELS); its conv+ReLU+pool blocks and linear head come from
    the model's layer list. mode: 'exact' (fp32 FFMA, or 3xfp16 on rung 28 for the wide
    layers: matches an fp64 forward to ~1e-6), 'tf32' or 'fp16' (tensor cores where a block's
    shape takes them, fp32 accumulate; the head stays fp32). For ece408, mode 'fp16' hands the
    pooled C1 map to conv2 as fp16 channels-last (gpu/fused_cl.py).
    kernel_params: per-kernel parameters {"c1": {...}, "c3": {...}, "head": {"imgs": n}} (the
    head: kernel 20's imgs, or kernel 30's imgs, kc, ti and to) for benchmarks; what is left
    out is each kernel's measured default.
    graphs: replay a captured CUDA graph from the second forward with the same batch size and
    input/output addresses (see the module docstring); False launches each kernel every time.
    """

    def __init__(self, params: Mapping[str, Any], mode: str = "exact",
                 kernel_params: Mapping[str, Mapping[str, Any]] | None = None,
                 model: str = MODEL, graphs: bool = True) -> None:
        if mode not in NETWORK_MODES:
            raise ValueError(f"FusedLeNet: mode must be one of {tuple(NETWORK_MODES)}, "
                             f"got {mode!r}")
        spec(model)  # one clear error for an unknown model
        check_params(params, model)
        self._kernel_params = {k: dict(v) for k, v in (kernel_params or {}).items()}
        self._lenet_head = None
        if _uses_lenet_head(model):  # raises on a head size the kernel was not tuned for
            imgs = int(self._kernel_params.get("head", {}).get("imgs", HEAD_DEFAULT_IMGS))
            self._lenet_head = head_defines(imgs)
        from convolab.backend import require_cupy

        self._cp = cp = require_cupy()
        self.model, self.mode = model, mode
        self.channels_last = _channels_last_pair(model, mode)
        want = param_shapes(model)
        self.params = {k: cp.ascontiguousarray(cp.asarray(to_numpy(v), cp.float32))
                       for k, v in params.items() if k in want}
        self.classes = _classes(model)
        # Once here, not per call: the model's layer list is built to read it (~65 us of host
        # time a forward, in front of its first launch).
        self.image_shape = image_shape(model)
        self._plans: dict[tuple[Any, ...], tuple[list[Callable], list[Any]]] = {}
        self.graphs = graphs
        self.graph_error: str | None = None  # why capturing failed, where it did
        # per plan key: {(input address, output address): captured graph, or None once seen}
        self._graphs: dict[tuple[Any, ...], dict[tuple[int, int], Any]] = {}
        self._capture_stream: Any = None
        # per (batch, raw_hw, stream): the last output `__call__` returned, and its reference
        # counts while only this cache held it (see _output)
        self._outputs: dict[tuple[Any, ...], tuple[Any, tuple[int, int, int]]] = {}
        self._head = self._prepare_head()

    def _prepare_head(self) -> Callable[[Any, Any], None]:
        """head(features, probs): kernel 20 for ece408's head, kernel 30 for any other."""
        p = self.params
        if self._lenet_head is not None:
            run = prepare_head(self._lenet_head)
            w5t = self._cp.ascontiguousarray(p["f5.weight"].T)
            return lambda feat, probs: run(feat, w5t, p["f5.bias"], p["f6.weight"],
                                           p["f6.bias"], probs)
        from convolab.gpu.dense_head import prepare_dense_head

        head = {k: int(v) for k, v in self._kernel_params.get("head", {}).items()}
        return prepare_dense_head(self.model, p, head.get("imgs"), head.get("kc"), head.get("ti"),
                                  head.get("to"))

    # ---- device forward -------------------------------------------------------------------
    def _plan(self, batch: int, slot: int = 0,
              raw_hw: tuple[int, int] | None = None) -> tuple[list[Callable], list[Any]]:
        """The cached plan of one batch size, stream slot and input kind; one ConvolabError
        where its buffers do not fit on the device."""
        key = (batch, slot, raw_hw)
        if key not in self._plans:
            try:
                self._plans[key] = self._new_plan(batch, raw_hw)
            except self._cp.cuda.memory.OutOfMemoryError:
                self._drop_plans()  # cached buffers of other sizes go first
                self._cp.get_default_memory_pool().free_all_blocks()
                raise _out_of_memory("the intermediates", batch, batch * bytes_per_image(
                    self.mode, False, self.model, raw_hw)) from None
        return self._plans[key]

    def _new_plan(self, batch: int,
                  raw_hw: tuple[int, int] | None) -> tuple[list[Callable], list[Any]]:
        """Prepared conv runs and the buffers between them, for one batch size: runs[i] reads
        buffers[i] (buffers[0] is the input, given per call) and writes buffers[i + 1].

        The later blocks are prepared first: what each reads (`in_dtype`, fp32 unless its run
        declares fp16) is what the block before it writes, where that block can (rung 29);
        where it cannot, a cast follows it."""
        cp = self._cp
        blocks = conv_blocks(self.model, batch)
        merged = self._merged_pair(blocks, raw_hw)
        if merged is not None:  # kernel 47 runs the first two blocks, writing the second's maps
            blocks = blocks[1:]
        later = [self._float_run(i, block) for i, block in enumerate(blocks) if i > 0]
        reads = [_in_dtype(run) for run in later] + ["float32"]  # the head reads fp32
        runs: list[Callable] = []
        buffers: list[Any] = [None]
        pair = None if merged is not None else self._staged_pair(blocks, raw_hw)
        if merged is not None:
            first = merged
        elif pair is not None:
            first, later[0] = pair
            reads[0] = _in_dtype(later[0])
        else:
            first = self._first_run(blocks[0], raw_hw, reads[0])
        if first is None and raw_hw is not None:
            first = self._raw_first_block(blocks[0], raw_hw)
            if first is None:  # no on-chip resize there: rung 25 first
                from convolab.gpu.resize import resize_u8

                size = blocks[0].shape.H
                runs.append(lambda raw, out: resize_u8(raw, size, out=out))
                buffers.append(cp.empty(blocks[0].shape.x_shape, cp.float32))
        if first is None:
            first = self._float_run(0, blocks[0])
        for i, (block, run) in enumerate(zip(blocks, [first, *later], strict=True)):
            b = block.shape
            hp, wp = b.H_out // block.pool, b.W_out // block.pool
            runs.append(run)
            if self.channels_last and i == 0:  # fp16 channels-last pooled C1 map
                buffers.append(cp.empty((batch, hp, wp, b.M), cp.float16))
                continue
            if pair is not None and i == 0:  # staged records: padding and slack stay zero
                buffers.append(cp.zeros((batch, *run.out_tail), cp.uint16))
                continue
            writes = str(getattr(run, "out_dtype", "float32"))
            buffers.append(cp.empty((batch, b.M, hp, wp), writes))
            if writes != reads[i]:
                runs.append(cast_into)
                buffers.append(cp.empty((batch, b.M, hp, wp), reads[i]))
        return runs, buffers

    def _first_run(self, block: ConvBlock, raw_hw: tuple[int, int] | None,
                   out_dtype: str, staged: Mapping[str, int] | None = None) -> Callable | None:
        """Rung 29 for the first block, from raw bytes or floats, writing `out_dtype` (in
        the precision fused_first.NETWORK_PRECISION gives the mode), or the next block's
        staged records (`staged`, their layout): where it takes the shape and measured faster
        than the block's other kernels (or the block's kernel parameters ask for it: first =
        1; first = -1 turns it off); None elsewhere."""
        from convolab.gpu import fused_first

        kp = self._kernel_params.get(block.name, {})
        choice = int(kp.get("first") or 0)
        precision = fused_first.NETWORK_PRECISION[NETWORK_MODES[self.mode]]
        if (self.channels_last or choice < 0
                or not fused_first.supports(block.shape, block.pool, raw_hw)
                or (choice == 0 and not fused_first.preferred(block.shape, block.pool))
                or (staged is not None and (precision != "3xfp16" or not fused_first
                                            .staged_takes(block.shape, block.pool, kp, raw_hw)))):
            return None
        p = self.params
        return fused_first.prepare(block.shape, block.pool, p[f"{block.name}.weight"],
                                   p[f"{block.name}.bias"], kp, raw_hw, out_dtype, precision,
                                   staged)

    def _merged_pair(self, blocks: list[ConvBlock],
                     raw_hw: tuple[int, int] | None) -> Callable | None:
        """The first two blocks as one kernel (47: rung 45's conv1 and rung 46's conv2 on one
        SM, the staged records kept in shared memory), from float input, where the staged pair
        would run them, the first block has no kernel parameters, the second none but
        fused_pair.KEYS, `merge` and `staged`, and its `merge` is 1 (0: fused_pair.NETWORK,
        -1: never); else None."""
        from convolab.gpu import fused_first, fused_pair, fused_wgmma, fused_wide

        if self.channels_last or raw_hw is not None or len(blocks) < 2:
            return None
        first, second = blocks[0], blocks[1]
        kp1 = self._kernel_params.get(first.name, {})
        kp2 = self._kernel_params.get(second.name, {})
        merge = int(kp2.get("merge") or 0)
        own = {k: v for k, v in kp2.items() if k in fused_pair.KEYS}
        if merge < 0 or (merge == 0 and not fused_pair.NETWORK) or kp1 \
                or set(kp2) - {*fused_pair.KEYS, *fused_wgmma.PAIR_KEYS}:
            return None
        precision = NETWORK_MODES[self.mode]
        wide = fused_wide.network_precision(second.shape, second.pool, precision)
        if (wide != "3xfp16" or fused_first.NETWORK_PRECISION[precision] != "3xfp16"
                or not fused_wgmma.staged_takes(second.shape, second.pool, wide, kp2)
                or fused_pair.pair_why_not(first.shape, second.shape, first.pool, second.pool,
                                           own) is not None):
            return None
        p = self.params
        return fused_pair.prepare_pair(first.shape, p[f"{first.name}.weight"],
                                       p[f"{first.name}.bias"], second.shape,
                                       p[f"{second.name}.weight"], p[f"{second.name}.bias"], own)

    def _staged_pair(self, blocks: list[ConvBlock],
                     raw_hw: tuple[int, int] | None) -> tuple[Callable, Callable] | None:
        """The first two blocks as rung 45 writing rung 46's staged records (exact mode:
        conv1's fp32 maps never reach memory, and rung 46's producer only copies), where both
        take their block and `staged` (a kernel parameter of the second) is not -1; else
        None."""
        from convolab.gpu import fused_wgmma, fused_wide

        if self.channels_last or len(blocks) < 2:
            return None
        second = blocks[1]
        kp = self._kernel_params.get(second.name, {})
        wide = fused_wide.network_precision(second.shape, second.pool, NETWORK_MODES[self.mode])
        if wide is None or not fused_wgmma.staged_takes(second.shape, second.pool, wide, kp):
            return None
        p = self.params
        run = fused_wgmma.prepare(second.shape, p[f"{second.name}.weight"],
                                  p[f"{second.name}.bias"], kp, wide, fused_wgmma.STAGED)
        first = self._first_run(blocks[0], raw_hw, "float32", run.staged)
        return None if first is None else (first, run)

    def _float_run(self, i: int, block: ConvBlock) -> Callable:
        """Block i's run on float input (fp16 channels-last for ece408's fp16 pair; rung 28
        declares the input it reads, fp16 in mode 'fp16')."""
        p, kp = self.params, self._kernel_params.get(block.name, {})
        w, bias = p[f"{block.name}.weight"], p[f"{block.name}.bias"]
        if self.channels_last:
            from convolab.gpu import fused_cl

            prepare = fused_cl.prepare_conv1_cl if i == 0 else fused_cl.prepare_conv2_cl
            return prepare(block.shape, w, bias, kp)
        from convolab.gpu import fused_wgmma, fused_wide

        wide = fused_wide.network_precision(block.shape, block.pool, NETWORK_MODES[self.mode])
        if wide is not None:
            in_dtype = fused_wide.network_in_dtype(wide)
            if fused_wgmma.network_takes(block.shape, block.pool, wide, kp):
                return fused_wgmma.prepare(block.shape, w, bias, kp, wide, in_dtype)
            return fused_wide.prepare(block.shape, w, bias, kp, wide, in_dtype, pool=block.pool)
        return self._block_impl(block).prepare(block.shape, w, bias, kp)

    def _block_impl(self, block: ConvBlock) -> Any:
        """The mode's fused rung for a block: rung 44 or 28 where they take the block
        (fused_wgmma.network_takes, fused_wide.network_precision), else the mode's rung
        13/17/18, or the exact one where the mode's kernels do not take its shape."""
        from convolab.gpu import fused_wgmma, fused_wide
        from convolab.gpu.fused import fused_conv_pool_impl

        precision = NETWORK_MODES[self.mode]
        wide = fused_wide.network_precision(block.shape, block.pool, precision)
        if wide is not None:
            kp = getattr(self, "_kernel_params", {}).get(block.name, {})
            if fused_wgmma.network_takes(block.shape, block.pool, wide, kp):
                return fused_wgmma.wgmma_impl(wide)
            return fused_wide.wide_impl(block.pool, wide)
        impl = fused_conv_pool_impl(block.pool, precision)
        return impl if impl.supports(block.shape) else fused_conv_pool_impl(block.pool, "fp32")

    def _raw_first_block(self, block: ConvBlock, raw_hw: tuple[int, int]) -> Callable | None:
        """The first block's run reading raw bytes (resize fused into its staging), or None
        where its kernel has no raw variant."""
        p, kp = self.params, self._kernel_params.get(block.name, {})
        w, bias = p[f"{block.name}.weight"], p[f"{block.name}.bias"]
        if self.channels_last:
            from convolab.gpu import fused_cl

            return fused_cl.prepare_conv1_cl(block.shape, w, bias, kp, raw_hw=raw_hw)
        if self._block_impl(block).name.endswith(("-tc", "-tf32")):
            from convolab.gpu import fused_mma

            if block.pool != 2:
                return None
            return fused_mma.prepare_toe_raw(block.shape, w, bias, NETWORK_MODES[self.mode], kp,
                                             raw_hw)
        from convolab.gpu import fused_ffma

        return fused_ffma.prepare_exact_raw(block.shape, block.pool, w, bias, kp, raw_hw)

    def _drop_plans(self, key: tuple[Any, ...] | None = None) -> None:
        """Forget one plan (or all) and the graphs captured on its buffers."""
        for k in list(self._plans) if key is None else [key]:
            self._plans.pop(k, None)
            self._graphs.pop(k, None)
        self._outputs = {k: v for k, v in self._outputs.items()
                         if key is not None and k[:2] != (key[0], key[2])}

    def forward_into(self, x: Any, probs: Any, slot: int = 0) -> None:
        """Enqueue the forward of device batch x (float images, or raw uint8 images) on the
        current stream, writing probs: as a captured graph where x and probs lie where they
        lay in an earlier call with this plan (see the module docstring)."""
        key = (int(x.shape[0]), slot, _raw_hw(x))
        runs, buffers = self._plan(*key)
        if not self.graphs:
            self._launch(runs, buffers, x, probs)
            return
        graphs = self._graphs.setdefault(key, {})
        where = (int(x.data.ptr), int(probs.data.ptr))
        graph = graphs.get(where)
        if graph is None and where in graphs:  # the second time here: capture
            graph = graphs[where] = self._capture(runs, buffers, x, probs)
        if graph is None or not self.graphs:
            if len(graphs) >= GRAPHS_PER_PLAN:
                graphs.pop(next(iter(graphs)))
            graphs[where] = None
            self._launch(runs, buffers, x, probs)
        else:
            graph.launch(self._cp.cuda.get_current_stream())

    def _launch(self, runs: list[Callable], buffers: list[Any], x: Any, probs: Any) -> None:
        source = x
        for run, out in zip(runs, buffers[1:], strict=True):
            run(source, out)
            source = out
        self._head(source, probs)

    def _capture(self, runs: list[Callable], buffers: list[Any], x: Any, probs: Any) -> Any:
        """The forward's launches as a CUDA graph, captured on a private stream (capture
        cannot run on the default stream); nothing runs until it is launched. Every kernel
        ran once before (the first call), so nothing compiles or allocates during capture."""
        cp = self._cp
        if self._capture_stream is None:
            self._capture_stream = cp.cuda.Stream(non_blocking=True)
        stream = self._capture_stream
        cuda_errors = (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError)
        with stream:
            stream.begin_capture()
            ended = False
            try:
                self._launch(runs, buffers, x, probs)
                ended = True
                return stream.end_capture()
            except cuda_errors as err:
                # Something in the forward cannot be captured: say why, launch from the host.
                self.graphs, self.graph_error = False, f"{type(err).__name__}: {err}"
                return None
            finally:
                if not ended:  # a run raised mid-capture: end it, keep the run's error
                    with contextlib.suppress(*cuda_errors):
                        stream.end_capture()

    def __call__(self, x: Any) -> Any:
        """Probabilities (B, classes) on the device for a device (CuPy) batch. A host batch
        is refused, naming forward_chunks (host in, host out): what this returns is a device
        array handed out again on later calls, and its graph replays from device addresses."""
        cp = self._cp
        if not isinstance(x, cp.ndarray):
            raise InputTypeError(not_device_array(x))
        self._check_batch(x)
        n, raw_hw = int(x.shape[0]), _raw_hw(x)
        try:
            probs = self._output(n, raw_hw)
            x = cp.ascontiguousarray(x)
        except cp.cuda.memory.OutOfMemoryError:
            raise _out_of_memory("the input and output", n, n * (4 * self.classes + int(
                x.nbytes // max(n, 1)))) from None
        step = n if (n, 0, raw_hw) in self._plans else chunk_for(
            n, device_free_bytes(), bytes_per_image(self.mode, False, self.model, raw_hw))
        if step >= n:
            if n:
                self.forward_into(x, probs)
            return probs
        # Too large for the device at once: a chunk at a time. The chunk's buffers go back to
        # the pool before the last, shorter chunk plans its own, and neither stays cached.
        full, rest = divmod(n, step)
        for i in range(full):
            self.forward_into(x[i * step:(i + 1) * step], probs[i * step:(i + 1) * step])
        self._drop_plans((step, 0, raw_hw))
        if rest:
            self.forward_into(x[full * step:], probs[full * step:])
            self._drop_plans((rest, 0, raw_hw))
        return probs

    def _output(self, n: int, raw_hw: tuple[int, int] | None) -> Any:
        """A new (n, classes) float32 output, or the one this returned last time for this batch
        size and stream once nothing outside this cache refers to it or to its memory (no
        array, view or memory pointer of it is left): the caller dropped it, so its memory is
        free on this stream as it would be in CuPy's pool, without the pool's allocation and
        free in front of the forward's launch (4-14 us of host time a call on the H100's
        host, docs/raw.md). Reusing it also keeps the output where the graph was captured."""
        cp = self._cp
        key = (n, raw_hw, cp.cuda.get_current_stream().ptr)
        cached = self._outputs.get(key)
        if cached is not None:
            out, refs = cached
            if _refcounts(out) == refs:
                return out
        out = cp.empty((n, self.classes), cp.float32)
        self._outputs[key] = (out, _refcounts(out))
        return out

    def _check_batch(self, x: Any) -> None:
        check_batch(x.shape, x.dtype, self.image_shape, self.model)

    # ---- host batches of any size ---------------------------------------------------------
    def forward_chunks(self, x_host: np.ndarray, chunk: int = STREAM_CHUNK,
                       streams: int = STREAM_SLOTS,
                       out: np.ndarray | None = None, labels: bool = False) -> np.ndarray:
        """Probabilities (N, classes), or with `labels` the predicted classes (N,) int64, for a
        host batch of any size (it need not fit on the GPU): float images or raw uint8 images
        (N, h, w), which travel as bytes and are resized on the GPU.

        A `chunk` whose device buffers do not fit in the free memory is reduced until they do
        (chunk_for); where not even one image fits, one ConvolabError says so.

        Chunks rotate through `streams` slots, each with its own device buffers and CUDA
        stream, so chunk i's host->device copy, chunk i-1's kernels and chunk i-2's
        device->host copy overlap. A source in page-locked memory (`pinned_empty`,
        any array CUDA has registered) is copied straight from where it lies; any other is first
        copied into a pinned staging buffer per slot, while the GPU works on the other slots.
        """
        cp = self._cp
        if not isinstance(x_host, np.ndarray):
            raise InputTypeError(f"FusedLeNet.forward_chunks takes a host (NumPy) array, got "
                                 f"{_kind_of(x_host)}: call net(x) for a device array")
        self._check_batch(x_host)
        if chunk < 1 or streams < 1:
            raise InputError(f"FusedLeNet.forward_chunks: chunk and streams must be >= 1, got "
                             f"chunk={chunk}, streams={streams}")
        n = x_host.shape[0]
        if out is None:
            out = np.empty((n,) if labels else (n, self.classes),
                           np.int64 if labels else np.float32)
        if n == 0:
            return out
        x_host = np.ascontiguousarray(x_host)
        raw_hw = _raw_hw(x_host)
        chunk = min(chunk, n)
        if (chunk, 0, raw_hw) not in self._plans:  # a chunk that does not fit becomes smaller
            # one step more than the streams: the last, shorter chunk plans buffers of its own
            chunk = chunk_for(chunk, device_free_bytes(),
                              bytes_per_image(self.mode, True, self.model, raw_hw), streams + 1)
        slots = min(streams, -(-n // chunk))
        try:
            return _Streamer(self, x_host, out, chunk, slots, labels).run()
        except cp.cuda.memory.OutOfMemoryError:
            raise _out_of_memory("the streaming buffers", chunk, slots * chunk * bytes_per_image(
                self.mode, True, self.model, raw_hw)) from None

    def throughput(self, x_host: np.ndarray, chunk: int = STREAM_CHUNK,
                   streams: int = STREAM_SLOTS, labels: bool = False,
                   repeats: int = 1) -> tuple[np.ndarray, float]:
        """(probabilities or labels, images per second) for a host batch, host to host, wall
        clock, the median over `repeats` passes; compiling and first allocations happen
        before the clock starts."""
        positive_int(repeats, "repeats")
        # Warm every slot (its plan, device and pinned buffers), not just the first.
        warm = x_host[: min(len(x_host), chunk * streams)]
        self.forward_chunks(warm, chunk=chunk, streams=streams, labels=labels)
        self._cp.cuda.Device().synchronize()
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = self.forward_chunks(x_host, chunk=chunk, streams=streams, labels=labels)
            seconds.append(time.perf_counter() - t0)
        median = float(np.median(seconds))
        return result, len(x_host) / median if median > 0 else float("inf")


class _Streamer:
    """One forward_chunks call: per-slot buffers and streams, and the chunk loop."""

    def __init__(self, net: FusedLeNet, x_host: np.ndarray, out: np.ndarray, chunk: int,
                 slots: int, labels: bool) -> None:
        cp = self.cp = net._cp
        self.net, self.x_host, self.out, self.chunk, self.labels = net, x_host, out, chunk, labels
        self.item_bytes = x_host.nbytes // max(len(x_host), 1)
        self.direct = is_pinned(x_host)  # else: staged through pinned buffers
        img = x_host.shape[1:]
        self.pin_in = [] if self.direct else [pinned_empty((chunk, *img), x_host.dtype)
                                              for _ in range(slots)]
        self.pin_out = [pinned_empty((chunk, *out.shape[1:]), out.dtype) for _ in range(slots)]
        self.dev_in = [cp.empty((chunk, *img), x_host.dtype) for _ in range(slots)]
        self.dev_probs = [cp.empty((chunk, net.classes), cp.float32) for _ in range(slots)]
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(slots)]
        self.done: list[Any] = [None] * slots
        self.pending: list[tuple[int, int, Any]] = [(0, 0, None)] * slots

    def collect(self, s: int) -> None:
        """Wait for slot s's chunk and move its results into `out`."""
        if self.done[s] is None:
            return
        self.done[s].synchronize()
        start, count, _ = self.pending[s]
        self.out[start:start + count] = self.pin_out[s][:count]
        self.done[s] = None

    def run(self) -> np.ndarray:
        cp, runtime, n = self.cp, self.cp.cuda.runtime, len(self.x_host)
        slots = len(self.streams)
        for i, start in enumerate(range(0, n, self.chunk)):
            s = i % slots
            self.collect(s)  # slot s's previous chunk is finished: its buffers are free
            count = min(self.chunk, n - start)
            source = self.x_host[start:start + count]
            if not self.direct:
                parallel_copy(self.pin_in[s][:count], source)
                source = self.pin_in[s][:count]
            stream = self.streams[s]
            with stream:
                runtime.memcpyAsync(self.dev_in[s].data.ptr, source.ctypes.data,
                                    count * self.item_bytes, runtime.memcpyHostToDevice,
                                    stream.ptr)
                probs = self.dev_probs[s][:count]
                self.net.forward_into(self.dev_in[s][:count], probs, slot=s)
                result = cp.argmax(probs, axis=1) if self.labels else probs
                runtime.memcpyAsync(self.pin_out[s].ctypes.data, result.data.ptr,
                                    result.nbytes, runtime.memcpyDeviceToHost, stream.ptr)
                self.done[s] = stream.record()
            self.pending[s] = (start, count, result)  # keeps `result` alive until collected
        for s in range(slots):
            self.collect(s)
        return self.out


# Host copies into the pinned staging buffers: one thread copies ~5-10 GB/s, less than PCIe
# takes, so a large copy is split across threads (NumPy releases the GIL while it copies).
COPY_THREADS = min(8, os.cpu_count() or 1)
COPY_SLICE_BYTES = 1 << 20  # below this a slice is not worth a thread
_copy_pool: ThreadPoolExecutor | None = None


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src (same shape, both C-contiguous), split across COPY_THREADS threads."""
    global _copy_pool
    parts = min(COPY_THREADS, src.nbytes // COPY_SLICE_BYTES, len(src))
    if parts <= 1:
        np.copyto(dst, src)
        return
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="convolab-copy")
    bounds = np.linspace(0, len(src), parts + 1).astype(int)
    jobs = [_copy_pool.submit(np.copyto, dst[lo:hi], src[lo:hi])
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    for job in jobs:
        job.result()


def _in_dtype(run: Callable) -> str:
    """What a prepared conv run reads: the dtype it declares (`run.in_dtype`, e.g. a kernel
    that reads fp16 activations), else float32."""
    return str(getattr(run, "in_dtype", "float32"))


def cast_into(src: Any, out: Any) -> None:
    """out[...] = src in out's dtype: between a block that writes fp32 and one that reads
    fp16 (rounded to nearest even, what the reading kernel would do itself)."""
    out[...] = src


def _refcounts(a: Any) -> tuple[int, int, int]:
    """References to an array, its memory pointer and its memory (views share the latter two,
    DLPack exports and CUDA-array-interface consumers hold the array)."""
    return sys.getrefcount(a), sys.getrefcount(a.data), sys.getrefcount(a.data.mem)


def _raw_hw(x: Any) -> tuple[int, int] | None:
    """(h, w) of raw uint8 images (B, h, w); None for float images."""
    return (int(x.shape[1]), int(x.shape[2])) if x.ndim == 3 else None


def pinned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A NumPy array in page-locked host memory: the GPU copies it without a staging copy."""
    from convolab.backend import require_cupy

    require_cupy()
    import cupyx

    return cupyx.empty_pinned(shape, dtype)


def is_pinned(a: np.ndarray) -> bool:
    """Whether `a` lies in page-locked host memory that CUDA knows (pinned_empty's arrays)."""
    from convolab.backend import require_cupy

    cp = require_cupy()
    if a.size == 0:
        return False
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(a.ctypes.data)
    except cp.cuda.runtime.CUDARuntimeError:
        return False
    return int(attrs.type) == 1  # cudaMemoryTypeHost
