"""The fused GPU training path of the ece408 LeNet (kernels 31-36, docs/training.md).

The raw uint8 training set (47 MB) and labels stay on the GPU; a step is six launches into
preallocated buffers:

    31 conv1 forward from raw bytes (resize on chip) + ReLU + pool, argmax bytes kept
    32 conv2 forward + ReLU + pool, argmax bytes kept
    33 head: f5, ReLU, f6, softmax cross-entropy, and its whole backward (one kernel)
    34 conv2 backward (dX and dW2) through its pool and ReLU
    35 conv1 backward (dW1) through its pool and ReLU, input re-resized from raw bytes
    36 Adam / SGD over the flat parameter buffer, summing the slices' gradient partials

In the tf32 and bf16 modes 37 and 38 replace 31 and 32: the same outputs, the convolutions on
tensor cores with operands in that precision (fp32 accumulate, fp32 master weights).

A whole epoch (every step, then a counter update) is captured once as a CUDA graph and
replayed; the learning rate and Adam's bias corrections come from a per-step table on the
device, so nothing crosses to the host inside an epoch. The loss and correct count are
summed on the device and read once per epoch.

The host-side plan (`Recipe`, `step_table`, `plan_layout`) needs no GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from convolab import models
from convolab.errors import ConvolabError
from convolab.precision import TRAIN_MODES, train_mode
from convolab.shapes import ceil_div

Array = Any  # cupy.ndarray

MODEL = "ece408"  # the one model whose layer pattern the kernels implement
KERNELS = {
    "conv1_fwd": ("31_train_conv1_fwd.cu", "train_conv1_fwd"),
    "conv2_fwd": ("32_train_conv2_fwd.cu", "train_conv2_fwd"),
    "head": ("33_train_head.cu", "train_head"),
    "conv2_bwd": ("34_train_conv2_bwd.cu", "train_conv2_bwd"),
    "conv1_bwd": ("35_train_conv1_bwd.cu", "train_conv1_bwd"),
    "optim": ("36_train_optim.cu", "train_optim"),
    "advance": ("36_train_optim.cu", "train_advance"),
    "clear": ("36_train_optim.cu", "train_clear"),
}
# The tensor-core forwards of the tf32 and bf16 modes: 31 and 32's arguments and outputs.
MMA_FORWARD = {
    "conv1_fwd": ("37_train_conv1_fwd_mma.cu", "train_conv1_fwd_mma"),
    "conv2_fwd": ("38_train_conv2_fwd_mma.cu", "train_conv2_fwd_mma"),
}
MMA_PREC = {"tf32": 1, "bf16": 2}  # kernels 37 and 38's TRAIN_PREC
# Threads per block of each kernel, as the .cu files fix them for ece408's shapes.
THREADS = {"conv1_fwd": 256, "conv2_fwd": 256, "head": 256, "conv2_bwd": 448,
           "conv1_bwd": 256, "optim": 256}
MMA_THREADS = {"conv1_fwd": 128, "conv2_fwd": 256}
HEAD_CHUNK = 8  # images per pass of the head kernel (one warp each)
MODES = {"adam": 0, "sgd": 1, "grad": 2}  # train_optim's `mode`
SCHEDULES = ("onecycle", "cosine")
EVAL_BATCH = 1000
# The backward kernels and the optimizer are fp32 in every mode: each gradient against a float64
# backward (routed through the same pool argmax bytes) within this rel. L2, through four layers
# and sums over up to 1024 terms and a whole batch.
GRADIENT_TOLERANCE = 1e-4
RAW_SIDE = 28


@dataclass(frozen=True)
class Recipe:
    """Everything that decides a run besides the seed (chosen on a validation split:
    docs/training.md). lr is the peak; `warmup` the fraction of steps it ramps up linearly;
    then 'onecycle' decays linearly to 0 and 'cosine' along a half cosine."""

    epochs: int = 8
    batch: int = 256
    lr: float = 8e-3
    optimizer: str = "adam"
    schedule: str = "onecycle"
    warmup: float = 0.2
    smoothing: float = 0.1  # label smoothing of the cross-entropy
    weight_decay: float = 0.0
    mirror: bool = False  # random left-right mirroring of training images
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9  # SGD only

    def check(self) -> Recipe:
        if self.epochs < 1 or self.batch < 1:
            raise ConvolabError(f"epochs and batch must be positive, got {self.epochs}, "
                                f"{self.batch}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConvolabError(f"lr must be a positive finite number, got {self.lr}")
        if self.optimizer not in ("adam", "sgd"):
            raise ConvolabError(f"optimizer must be 'adam' or 'sgd', not {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ConvolabError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if not 0 <= self.warmup < 1 or not 0 <= self.smoothing < 1 or self.weight_decay < 0:
            raise ConvolabError("warmup and smoothing must be in [0, 1), weight_decay >= 0")
        return self

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# The default recipe of `convolab train --device gpu` (chosen on a validation split carved
# from the training set, never on the test set: docs/training.md).
RECIPE = Recipe()


def lr_schedule(recipe: Recipe, total_steps: int) -> np.ndarray:
    """The learning rate of every step (float64): linear warm-up, then the decay."""
    steps = np.arange(total_steps, dtype=np.float64)
    warm = max(1, round(recipe.warmup * total_steps)) if recipe.warmup > 0 else 0
    ramp = (steps + 1) / max(warm, 1)
    progress = np.clip((steps - warm + 1) / max(1, total_steps - warm), 0.0, 1.0)
    decay = 1 - progress if recipe.schedule == "onecycle" else 0.5 * (1 + np.cos(np.pi * progress))
    return recipe.lr * np.where(steps < warm, ramp, decay)


def step_table(recipe: Recipe, total_steps: int) -> np.ndarray:
    """(total_steps, 2) float32 for kernel 36: Adam's (lr / (1 - beta1^t), 1 / (1 - beta2^t))
    with t = step + 1, computed in float64 as optim.Adam does; SGD's (lr, 1)."""
    lr = lr_schedule(recipe, total_steps)
    t = np.arange(1, total_steps + 1, dtype=np.float64)
    if recipe.optimizer == "adam":
        b1, b2 = recipe.betas
        table = np.stack([lr / (1 - b1**t), 1 / (1 - b2**t)], axis=1)
    else:
        table = np.stack([lr, np.ones_like(lr)], axis=1)
    return table.astype(np.float32)


@dataclass(frozen=True)
class Segment:
    """One layer's parameters (weights then bias) in the flat buffer and its gradient
    partials: `slices` blocks each write `size` floats from `part_off`."""

    layer: str
    param_off: int
    size: int
    part_off: int
    slices: int
    per_block: int  # images per slice


@dataclass(frozen=True)
class Layout:
    batch: int
    params: dict[str, tuple[int, tuple[int, ...]]]  # name -> (offset, shape)
    segments: tuple[Segment, ...]
    n_params: int
    n_partials: int

    def segment(self, layer: str) -> Segment:
        return next(s for s in self.segments if s.layer == layer)

    def table(self) -> np.ndarray:
        """The segments as kernel 36's `Segment` structs (int32 x 4 each)."""
        return np.array([(s.param_off, s.size, s.part_off, s.slices) for s in self.segments],
                        dtype=np.int32)


def _slices(batch: int, blocks: int, multiple: int = 1) -> tuple[int, int]:
    """(slices, images per slice) splitting `batch` into about `blocks` slices whose size is
    a multiple of `multiple`."""
    per = ceil_div(max(1, ceil_div(batch, blocks)), multiple) * multiple
    return ceil_div(batch, per), per


def plan_layout(batch: int, sm_count: int, model: str = MODEL) -> Layout:
    """Where every parameter and gradient partial lives, for `batch` images on a GPU with
    `sm_count` SMs. Conv backward slices aim at four blocks per SM (their images are the
    work); the head's at one block per SM (its registers allow one) in whole chunks."""
    check_model(model)
    shapes = models.param_shapes(model)
    layers = list(dict.fromkeys(name.split(".")[0] for name in shapes))
    blocks = {layers[0]: _slices(batch, 4 * sm_count), layers[1]: _slices(batch, 4 * sm_count)}
    head = _slices(batch, sm_count, HEAD_CHUNK)
    blocks.update({layer: head for layer in layers[2:]})
    params: dict[str, tuple[int, tuple[int, ...]]] = {}
    segments: list[Segment] = []
    offset = part = 0
    for layer in layers:
        start = offset
        for name in (f"{layer}.weight", f"{layer}.bias"):
            params[name] = (offset, shapes[name])
            offset += math.prod(shapes[name])
        slices, per = blocks[layer]
        segments.append(Segment(layer, start, offset - start, part, slices, per))
        part += slices * (offset - start)
    if params[f"{layers[2]}.weight"][0] % 4:
        raise ConvolabError("kernel 33 reads f5's weights as float4: its offset must be a "
                            "multiple of 4")
    return Layout(batch, params, tuple(segments), offset, part)


def check_model(model: str) -> None:
    """The fused kernels implement ece408's layer pattern; other models train through the
    framework engine."""
    if model != MODEL:
        raise ConvolabError(f"the fused GPU trainer implements the {MODEL} network only; train "
                            f"{model} with --engine framework")


def kernel_defines(model: str = MODEL) -> dict[str, int]:
    """The -D shape defines of kernels 31-35, from models.conv_blocks / param_shapes."""
    check_model(model)
    c1, c2 = models.conv_blocks(model, 1)
    shapes = models.param_shapes(model)
    return {"IN_S": c1.shape.H, "C1_M": c1.shape.M, "C1_K": c1.shape.K, "C1_P": c1.pool,
            "C2_M": c2.shape.M, "C2_K": c2.shape.K, "C2_P": c2.pool,
            "HID": shapes["f5.weight"][0], "CLS": shapes["f6.weight"][0],
            "RAW_H": RAW_SIDE, "RAW_W": RAW_SIDE}


def check_mode(mode: str) -> str:
    try:
        return train_mode(mode)
    except ValueError as err:
        raise ConvolabError(str(err)) from None


def kernel_files(mode: str) -> dict[str, tuple[str, str]]:
    """Each launch's (kernel file, entry point) in `mode` (precision.TRAIN_MODES)."""
    return KERNELS if check_mode(mode) == "exact" else {**KERNELS, **MMA_FORWARD}


def mode_defines(mode: str) -> dict[str, int]:
    """The -D defines of `mode`'s tensor-core forwards (with kernel_defines)."""
    return {"TRAIN_PREC": MMA_PREC[mode]} if check_mode(mode) != "exact" else {}


def threads(key: str, mode: str) -> int:
    """Threads per block of launch `key` in `mode`."""
    return MMA_THREADS[key] if check_mode(mode) != "exact" and key in MMA_THREADS else THREADS[key]


def compile_jobs() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """Every compile this module launches (tests/test_nvcc_compile.py's hook)."""
    files = sorted({f for f, _ in KERNELS.values()})
    jobs = {f"trainer:{f}": [(f, kernel_defines())] for f in files}
    for f, _ in MMA_FORWARD.values():
        jobs[f"trainer:{f}"] = [(f, {**kernel_defines(), **mode_defines(m)})
                                for m in TRAIN_MODES if m != "exact"]
    return jobs


@dataclass
class EpochStats:
    loss: float
    accuracy: float
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def _pool_side(model: str) -> tuple[int, int]:
    """(conv2 input elements, f5 input elements) per image."""
    c1, c2 = models.conv_blocks(model, 1)
    pooled1 = c1.shape.M * (c1.shape.H_out // c1.pool) ** 2
    return pooled1, c2.shape.M * (c2.shape.H_out // c2.pool) ** 2


class Trainer:
    """The fused training loop on the current GPU. `raw` (N, 28, 28) uint8 and `labels` are
    uploaded once; `run_epoch` replays the captured epoch graph. `mode` (precision.TRAIN_MODES)
    picks the conv forwards' arithmetic; the weights stay fp32 masters in every mode."""

    def __init__(self, raw: np.ndarray, labels: np.ndarray, recipe: Recipe, seed: int = 0,
                 model: str = MODEL, graph: bool = True, mode: str = "exact") -> None:
        from convolab.backend import require_cupy
        from convolab.gpu.device import sm_count
        from convolab.gpu.resize import check_raw, device_taps

        cp = require_cupy()
        check_raw(raw, "training images")
        self.recipe, self.model, self.mode = recipe.check(), model, check_mode(mode)
        if recipe.batch > len(raw):
            raise ConvolabError(f"batch {recipe.batch} is larger than the {len(raw)} "
                                "training images")
        self.n = len(raw)
        self.steps = self.n // recipe.batch  # the partial last batch is dropped each epoch
        self.layout = plan_layout(recipe.batch, sm_count(), model)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.kernels = self._compile()
        self.graph = graph  # False: every step launched from Python (same kernels, same bits)
        self._graph: Any = None
        with self.stream:
            self.raw, self.labels = cp.asarray(raw), cp.asarray(labels.astype(np.uint8))
            self.taps = device_taps(RAW_SIDE, RAW_SIDE, models.spec(model).input_size,
                                    models.spec(model).input_size)
            self._allocate(max(recipe.batch, EVAL_BATCH))
            self._init_params(seed)
            self.rng = cp.random.RandomState(seed)

    # ------------------------------------------------------------------ set-up

    def _compile(self) -> dict[str, Any]:
        from convolab.gpu.compile import get_kernel

        defines = kernel_defines(self.model)
        mma = mode_defines(self.mode)
        return {key: get_kernel(f, name, {**defines, **(mma if key in MMA_FORWARD else {})})
                for key, (f, name) in kernel_files(self.mode).items()}

    def _allocate(self, rows: int) -> None:
        import cupy as cp

        pooled1, feat = _pool_side(self.model)
        lay, steps = self.layout, self.steps * self.recipe.epochs
        self.pool1 = cp.empty((rows, pooled1), cp.float32)
        self.arg1 = cp.empty((rows, pooled1), cp.uint8)
        self.feat = cp.empty((rows, feat), cp.float32)
        self.arg2 = cp.empty((rows, feat), cp.uint8)
        self.dfeat = cp.empty((self.recipe.batch, feat), cp.float32)
        self.dpool1 = cp.empty((self.recipe.batch, pooled1), cp.float32)
        self.params = cp.empty(lay.n_params, cp.float32)
        self.mom1 = cp.zeros(lay.n_params, cp.float32)
        self.mom2 = cp.zeros(lay.n_params, cp.float32)
        self.part = cp.zeros(lay.n_partials, cp.float32)
        self.segs = cp.asarray(lay.table())
        self.sched = cp.asarray(step_table(self.recipe, max(1, steps)))
        self.step_base = cp.zeros(1, cp.int32)
        self.salt = cp.full(1, 0x9E3779B1 if self.recipe.mirror else 0, cp.uint32)
        # [train loss, train correct, eval loss, eval correct]; the losses are float bits
        self.stats = cp.zeros(4, cp.uint32)
        self.perm = cp.arange(self.n, dtype=cp.int64)

    def _init_params(self, seed: int) -> None:
        network = models.build(self.model, seed)
        self.load_params(network.params())

    def load_params(self, values: dict[str, np.ndarray]) -> None:
        """Set every parameter from host arrays (names as models.param_shapes)."""
        flat = np.empty(self.layout.n_params, np.float32)
        for name, (off, shape) in self.layout.params.items():
            value = np.asarray(values[name], np.float32)
            if value.shape != shape:
                raise ConvolabError(f"{name}: shape {value.shape}, expected {shape}")
            flat[off:off + value.size] = value.ravel()
        with self.stream:
            self.params.set(flat, stream=self.stream)
            self.mom1.fill(0)
            self.mom2.fill(0)
            self.step_base.fill(0)
        self.stream.synchronize()

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as host arrays, by name (the weights file's layout)."""
        flat = self.params.get(stream=self.stream)
        self.stream.synchronize()
        return {name: flat[off:off + math.prod(shape)].reshape(shape).copy()
                for name, (off, shape) in self.layout.params.items()}

    def _view(self, name: str) -> Array:
        off, shape = self.layout.params[name]
        return self.params[off:off + math.prod(shape)]

    # ------------------------------------------------------------------ the step

    def _forward(self, raw: Array, index: Array | None, rows: int, salt: Array | None) -> None:
        null = np.uint64(0)
        k = self.kernels
        k["conv1_fwd"]((rows,), (threads("conv1_fwd", self.mode),),
                       (raw, index if index is not None else null, self.taps,
                        salt if salt is not None else null, self._view("c1.weight"),
                        self._view("c1.bias"), self.pool1, self.arg1))
        k["conv2_fwd"]((rows,), (threads("conv2_fwd", self.mode),),
                       (self.pool1, self._view("c3.weight"), self._view("c3.bias"), self.feat,
                        self.arg2))

    def _head(self, labels: Array, index: Array | None, rows: int, train: bool,
              stats_at: int) -> None:
        null = np.uint64(0)
        seg5, seg6 = self.layout.segment("f5"), self.layout.segment("f6")
        slices, per = (seg5.slices, seg5.per_block) if train else _slices(rows, 1 << 16,
                                                                           HEAD_CHUNK)
        stats_f = self.stats.view(np.float32)
        self.kernels["head"](
            (slices,), (THREADS["head"],),
            (self.feat, labels, index if index is not None else null, self._view("f5.weight"),
             self._view("f6.weight"), self.dfeat if train else null,
             self.part[seg5.part_off:] if train else null,
             self.part[seg6.part_off:] if train else null,
             stats_f[stats_at:stats_at + 1], self.stats[stats_at + 1:stats_at + 2],
             np.int32(rows), np.int32(per), np.float32(self.recipe.smoothing if train else 0.0),
             np.float32(1.0 / rows)))

    def _backward(self, index: Array) -> None:
        k, lay, b = self.kernels, self.layout, self.recipe.batch
        seg1, seg3 = lay.segment("c1"), lay.segment("c3")
        k["conv2_bwd"]((seg3.slices,), (THREADS["conv2_bwd"],),
                       (self.pool1, self._view("c3.weight"), self.dfeat, self.arg2, self.dpool1,
                        self.part[seg3.part_off:], np.int32(b), np.int32(seg3.per_block)))
        k["conv1_bwd"]((seg1.slices,), (THREADS["conv1_bwd"],),
                       (self.raw, index, self.taps, self.salt, self.dpool1, self.arg1,
                        self.part[seg1.part_off:], np.int32(b), np.int32(seg1.per_block)))

    def _update(self, step: int, mode: str, grad_out: Array | None = None) -> None:
        r, n = self.recipe, self.layout.n_params
        beta1 = r.betas[0] if r.optimizer == "adam" else r.momentum
        self.kernels["optim"](
            (ceil_div(n, THREADS["optim"]),), (THREADS["optim"],),
            (self.params, self.mom1, self.mom2, self.part, self.segs,
             np.int32(len(self.layout.segments)), np.int32(n), self.sched, self.step_base,
             np.int32(step), np.int32(MODES[mode]), np.float32(beta1), np.float32(r.betas[1]),
             np.float32(r.eps), np.float32(r.weight_decay),
             grad_out if grad_out is not None else np.uint64(0)))

    def launch_step(self, index: Array, step: int, mode: str | None = None,
                    grad_out: Array | None = None) -> None:
        """Enqueue one training step on the batch raw[index] (step: within the epoch)."""
        b = self.recipe.batch
        self._forward(self.raw, index, b, self.salt)
        self._head(self.labels, index, b, True, 0)
        self._backward(index)
        self._update(step, mode or self.recipe.optimizer, grad_out)

    def stages(self, index: Array) -> dict[str, Any]:
        """The step's launches in groups, each a callable (timed alone by bench --train)."""
        b = self.recipe.batch
        forward = "+".join(kernel_files(self.mode)[k][0][:2] for k in ("conv1_fwd", "conv2_fwd"))
        return {f"{forward} conv forwards": lambda: self._forward(self.raw, index, b, self.salt),
                "33 head fwd+loss+bwd": lambda: self._head(self.labels, index, b, True, 0),
                "34+35 conv backwards": lambda: self._backward(index),
                "36 optimizer": lambda: self._update(0, "grad")}

    def gradients(self, index: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """(mean loss, the gradient of every parameter) of one batch, without an update
        (for the tests)."""
        import cupy as cp

        if len(index) != self.recipe.batch:
            raise ConvolabError(f"index must hold {self.recipe.batch} images")
        with self.stream:
            idx = cp.asarray(index, dtype=cp.int64)
            grads = cp.full(self.layout.n_params, np.nan, cp.float32)
            self._clear()
            self.launch_step(idx, 0, "grad", grads)
            flat, stats = grads.get(stream=self.stream), self.stats.get(stream=self.stream)
        self.stream.synchronize()
        loss = float(stats[:1].view(np.float32)[0]) / self.recipe.batch
        return loss, {name: flat[off:off + math.prod(s)].reshape(s)
                      for name, (off, s) in self.layout.params.items()}

    def _clear(self, first: int = 0, count: int = 2) -> None:
        self.kernels["clear"]((1,), (32,), (self.stats[first:], np.int32(count)))

    # ------------------------------------------------------------------ epochs

    def _capture(self) -> Any:
        self.stream.begin_capture()
        try:
            self._eager_epoch()
        finally:
            graph = self.stream.end_capture()
        return graph

    def _eager_epoch(self) -> None:
        b = self.recipe.batch
        self._clear()
        for s in range(self.steps):
            self.launch_step(self.perm[s * b:(s + 1) * b], s)
        self.kernels["advance"]((1,), (1,), (self.step_base, self.salt, np.int32(self.steps)))

    def run_epoch(self) -> None:
        """Enqueue one epoch: a fresh shuffle, then the captured graph (no host wait)."""
        with self.stream:
            self.perm[...] = self.rng.permutation(self.n)
            if not self.graph:
                self._eager_epoch()
                return
            if self._graph is None:
                self._graph = self._capture()
            self._graph.launch(self.stream)

    def epoch_stats(self) -> EpochStats:
        """The last epoch's mean loss and accuracy (waits for the GPU)."""
        stats = self.stats.get(stream=self.stream)
        self.stream.synchronize()
        seen = self.steps * self.recipe.batch
        return EpochStats(float(stats[:1].view(np.float32)[0]) / seen, int(stats[1]) / seen)

    def eval_batches(self, n: int) -> Iterator[tuple[int, int]]:
        for first in range(0, n, EVAL_BATCH):
            yield first, min(EVAL_BATCH, n - first)

    def evaluate(self, raw: Array, labels: Array) -> EpochStats:
        """Loss and accuracy of the current weights on device-resident raw images."""
        with self.stream:
            self._clear(2, 2)
            for first, rows in self.eval_batches(len(raw)):
                self._forward(raw[first:], None, rows, None)
                self._head(labels[first:], None, rows, False, 2)
            stats = self.stats.get(stream=self.stream)
        self.stream.synchronize()
        return EpochStats(float(stats[2:3].view(np.float32)[0]) / len(raw),
                          int(stats[3]) / len(raw))

    def upload(self, raw: np.ndarray, labels: np.ndarray) -> tuple[Array, Array]:
        """An evaluation set on the device (uint8 images, uint8 labels)."""
        import cupy as cp

        from convolab.gpu.resize import check_raw

        check_raw(raw, "evaluation images")
        with self.stream:
            out = cp.asarray(raw), cp.asarray(labels.astype(np.uint8))
        self.stream.synchronize()
        return out
