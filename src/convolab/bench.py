"""`convolab bench`: every implementation x layer shape, timed the course's way (SPEC §4, §6).

For each layer shape and each contender (registered implementations plus the PyTorch/cuDNN and
cuBLAS anchors) the benchmark

1. checks correctness first, on a small batch: fresh random inputs, the output poisoned with
   NaN, relative L2 error against the fp64 reference (`conv_cpu.conv_reference`); a contender
   that fails is reported and not timed, because a wrong kernel's speed means nothing;
2. times Op Time: prepared once, CUDA events around `run` alone after warm-up, inputs rotated
   among enough buffers that together they exceed twice the L2 cache (a single small input
   would otherwise be served from L2 and flatter the kernel);
3. times Layer Time for GPU contenders: host input in, device allocation, H2D, run, D2H;
4. derives GFLOP/s, GB/s and % of the roofline floor from ceilings measured in the same run.

CPU contenders run at a CPU-sized batch (see `cpu_batch`); Numba-compiled ones are skipped on
GPU hosts (conv_cpu's rule: Numba must not load there) unless named explicitly with --impl.
"""

from __future__ import annotations

import csv
import datetime as dt
import importlib
import itertools
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none, gpu_available, to_numpy
from convolab.check import poison, rel_l2
from convolab.errors import ConvolabError
from convolab.roofline import Ceilings, measure_cpu_ceilings, measure_gpu_ceilings
from convolab.shapes import ConvShape
from convolab.timing import Stats, time_cpu, time_gpu, time_host_gpu

SHAPE_SETS = ("model", "seeds", "vgg", "all")

# CPU contenders run at most this many images (the SPEC's CPU anchor is 1000 images) and at
# most this much work per run, so a CPU pass over the VGG shapes stays minutes, not hours.
CPU_BATCH_CAP = 1000
CPU_FLOP_BUDGET = 20e9
# A slow CPU contender gets fewer repetitions (never fewer than 3): the JSON records how many.
CPU_TIME_BUDGET_MS = 20_000.0
CPU_MIN_REPS = 3
# The 7-loop algorithm is ~100x slower than BLAS: 100 images, 1 GFLOP per run at most.
SLOW_CPU_IMPLS = {"cpu-loops": (100, 1e9)}
# Compiled with Numba, which must not be loaded on the GPU hosts (see conv_cpu's docstring).
NUMBA_IMPLS = frozenset({"cpu-loops", "cpu-fused"})
# The correctness check runs on this many images (1 where one image is already > 1 GFLOP).
CHECK_BATCH = 4
CHECK_FLOPS_PER_RUN = 2e9
# Above this much work the fp64 reference costs seconds: one random problem per layer and
# bench run is then shared by all contenders (still fresh each run; outputs still poisoned).
CHECK_SHARED_FLOPS = 0.5e9
# VGG16 layers run at a batch that fits in memory next to the rotation buffers.
VGG_BATCH_224 = 16
VGG_BATCH_SMALL = 64
# Rotated input buffers must together exceed this many times the L2 size (50 MB on an H100).
L2_ROTATE_FACTOR = 2
MAX_ROTATE_BUFFERS = 256  # tiny inputs (VGG classifier rows) need many to fill 2 x L2
WARMUP = 3


# --------------------------------------------------------------------------- shape sets


@dataclass(frozen=True)
class LayerCase:
    """One conv layer to benchmark; `pool` is the max-pool that follows it (fused rungs)."""

    label: str
    shape: ConvShape
    pool: int = 0
    note: str = ""


# Used only while convolab.models is unavailable: (model, layer, C, H, M, K, pool after).
_FALLBACK_LAYERS: dict[str, list[tuple[str, int, int, int, int, int]]] = {
    "ece408": [("c1", 1, 86, 4, 7, 2), ("c3", 4, 40, 16, 7, 4)],
    "ece408-mxnet": [("c1", 1, 70, 12, 5, 2), ("c3", 12, 33, 24, 5, 2)],
    "eecs498": [("c1", 1, 64, 12, 7, 2), ("c3", 12, 29, 24, 7, 2)],
}


def model_cases(model: str, batch: int) -> list[LayerCase]:
    """The model's conv layers at `batch`, walked from convolab.models (input size, pools)."""
    try:
        from convolab import models
        from convolab.layers import Conv2d, MaxPool2d, ReLU
    except ImportError:
        if model not in _FALLBACK_LAYERS:
            known = ", ".join(_FALLBACK_LAYERS)
            raise ValueError(f"unknown model {model!r}; known: {known}") from None
        return [
            LayerCase(f"{model}/{name}", ConvShape(batch, C, H, H, M, K), pool)
            for name, C, H, M, K, pool in _FALLBACK_LAYERS[model]
        ]
    spec = models.spec(model)
    layers = spec.layers()
    cases: list[LayerCase] = []
    channels, size = 1, spec.input_size
    for i, layer in enumerate(layers):
        if isinstance(layer, Conv2d):
            shape = ConvShape(batch, channels, size, size, layer.out_channels,
                              layer.kernel_size, layer.stride)
            rest = layers[i + 1 : i + 3]
            pool = 0
            if (len(rest) == 2 and isinstance(rest[0], ReLU) and isinstance(rest[1], MaxPool2d)
                    and rest[1].stride == rest[1].kernel_size):
                pool = rest[1].kernel_size
            cases.append(LayerCase(f"{model}/{layer.name}", shape, pool))
            channels, size = layer.out_channels, shape.H_out
        elif hasattr(layer, "kernel_size") and hasattr(layer, "stride"):  # pooling
            size = (size - layer.kernel_size) // layer.stride + 1
    if not cases:
        raise ValueError(f"model {model!r} has no conv layers to benchmark")
    return cases


def vgg_cases(batch: int) -> list[LayerCase]:
    """DianNao's VGG16 layers (seed 003). Convs take a 1-pixel halo so the output keeps 224/14."""
    b224, bsmall = min(batch, VGG_BATCH_224), min(batch, VGG_BATCH_SMALL)
    return [
        LayerCase("vgg/conv1_2", ConvShape(b224, 64, 226, 226, 64, 3),
                  note=f"3x3 64->64, input 226x226 (224 + halo), output 224x224, B={b224}"),
        LayerCase("vgg/conv5_x", ConvShape(bsmall, 512, 16, 16, 512, 3),
                  note=f"3x3 512->512, input 16x16 (14 + halo), output 14x14, B={bsmall}"),
        LayerCase("vgg/fc6", ConvShape(bsmall, 25088, 1, 1, 4096, 1),
                  note=f"classifier 25088->4096 as a 1x1 conv over Bx25088x1x1, B={bsmall}"),
        LayerCase("vgg/fc7", ConvShape(bsmall, 4096, 1, 1, 1024, 1),
                  note=f"classifier 4096->1024 as a 1x1 conv over Bx4096x1x1, B={bsmall}"),
    ]


def layer_cases(shapes: str, model: str, batch: int) -> list[LayerCase]:
    if shapes not in SHAPE_SETS:
        raise ValueError(f"--shapes must be one of {', '.join(SHAPE_SETS)}, not {shapes!r}")
    cases: list[LayerCase] = []
    if shapes in ("model", "all"):
        cases += model_cases(model, batch)
    if shapes in ("seeds", "all"):
        for seed_model in ("ece408-mxnet", "eecs498"):
            if shapes == "all" and seed_model == model:
                continue
            cases += model_cases(seed_model, batch)
    if shapes in ("vgg", "all"):
        cases += vgg_cases(batch)
    return cases


def cpu_batch(shape: ConvShape, impl_name: str) -> int:
    """Images a CPU contender runs on: capped by count and by work per run (0: skip)."""
    cap, budget = SLOW_CPU_IMPLS.get(impl_name, (CPU_BATCH_CAP, CPU_FLOP_BUDGET))
    per_image = shape.with_batch(1).flops
    return min(shape.B, cap, int(budget // per_image))


# --------------------------------------------------------------------------- contenders


@dataclass
class Prepared:
    """A contender bound to one shape and weights: `op(x)` launches, `fetch()` reads the output."""

    op: Callable[[Any], None]
    fetch: Callable[[], np.ndarray]
    poison: Callable[[], None] = lambda: None
    layer: Callable[[np.ndarray], np.ndarray] | None = None  # host in -> host out (GPU only)


@dataclass
class Contender:
    name: str
    device: str  # "cpu" or "gpu"
    precision: str  # which compute ceiling bounds it: fp32, tf32 or fp16
    tolerance: float
    prepare: Callable[[ConvShape, Any, Any], Prepared]
    supports: Callable[[ConvShape], bool] = lambda _: True
    rung: int | None = None
    pool: int = 0
    anchor: bool = False  # PyTorch/cuBLAS: the yardsticks the speed-ups are against
    impl: Any = None  # the registry entry behind it (None for the anchors)


def _precision_of(name: str, tolerance: float) -> str:
    """Which compute ceiling bounds a rung. SPEC section 4's tolerances say what arithmetic it
    uses; a tensor-core rung that recovers fp32 accuracy (3xTF32) is still bounded by TF32."""
    if tolerance > 5e-4:
        return "fp16"
    if tolerance > 1e-5 or "tf32" in name or "tensor-core" in name:
        return "tf32"
    return "fp32"


def _out_shape(shape: ConvShape, pool: int) -> tuple[int, int, int, int]:
    if pool:
        return (shape.B, shape.M, shape.H_out // pool, shape.W_out // pool)
    return shape.y_shape


def _from_impl(impl: Any) -> Contender:
    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        run = impl.prepare(shape, w, b, impl.params_for())
        out_shape = impl.out_shape(shape)
        if impl.device == "cpu":
            y = np.empty(out_shape, np.float32)
            return Prepared(lambda x: run(x, y), lambda: y.copy(), lambda: poison(y))
        cp = cupy_or_none()
        y = cp.empty(out_shape, dtype=np.float32)

        def layer(x_host: np.ndarray) -> np.ndarray:
            x_dev = cp.asarray(x_host)
            y_dev = cp.empty(out_shape, dtype=np.float32)
            run(x_dev, y_dev)
            return y_dev.get()

        if impl.name == "streams":  # its whole point is the overlapped host<->device path
            from convolab.gpu.ladder_advanced import layer_forward_streams

            def layer(x_host: np.ndarray) -> np.ndarray:  # noqa: F811
                return layer_forward_streams(x_host, w, b, shape.S, impl.params_for())

        return Prepared(lambda x: run(x, y), lambda: y.get(), lambda: poison(y), layer)

    return Contender(impl.name, impl.device, _precision_of(impl.name, impl.tolerance),
                     impl.tolerance, prepare, impl.supports, impl.rung, impl.pool, impl=impl)


def _torch_contenders(gpu: bool) -> list[Contender]:
    try:
        import torch
        import torch.nn.functional as F
    except Exception:  # torch is an optional extra: no anchor rows without it
        return []

    def make(device: str, tf32: bool) -> Callable[[ConvShape, Any, Any], Prepared]:
        def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
            def to_torch(a: Any) -> Any:
                return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)

            w_t, b_t = to_torch(w), to_torch(b)
            inputs: dict[int, Any] = {}  # converted once per buffer, outside the timed region
            out: dict[str, Any] = {}

            def op(x: Any) -> None:
                # The flags are process-wide: set them on every call so TF32 never leaks.
                torch.backends.cudnn.allow_tf32 = tf32
                x_t = inputs.get(id(x))
                if x_t is None:
                    x_t = inputs[id(x)] = to_torch(x)
                out["y"] = F.conv2d(x_t, w_t, b_t, stride=shape.S)

            def layer(x_host: np.ndarray) -> np.ndarray:
                torch.backends.cudnn.allow_tf32 = tf32
                x_t = torch.from_numpy(x_host).to("cuda")
                return F.conv2d(x_t, w_t, b_t, stride=shape.S).cpu().numpy()

            return Prepared(op, lambda: out["y"].cpu().numpy(),
                            layer=layer if device == "gpu" else None)

        return prepare

    torch.backends.cudnn.benchmark = True  # cuDNN gets to pick its fastest algorithm: a fair anchor
    rows = [Contender("torch-cpu", "cpu", "fp32", 1e-5, make("cpu", False), anchor=True)]
    if gpu and torch.cuda.is_available():
        rows += [
            Contender("torch-cudnn-fp32", "gpu", "fp32", 1e-5, make("gpu", False), anchor=True),
            Contender("torch-cudnn-tf32", "gpu", "tf32", 5e-4, make("gpu", True), anchor=True),
        ]
    return rows


def _cublas_contender() -> Contender:
    """The VGG classifier layers are GEMMs: cuBLAS SGEMM (cupy.matmul, fp32) is their anchor.

    Op Time is the GEMM alone; the bias is added outside the timed region for the check.
    """
    cp = cupy_or_none()

    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        w_t = w.reshape(shape.M, shape.C).T
        out: dict[str, Any] = {}

        def op(x: Any) -> None:
            out["y"] = cp.matmul(x.reshape(shape.B, shape.C), w_t)

        def fetch() -> np.ndarray:
            y = out["y"] + b[None, :]
            return y.reshape(shape.y_shape).get()

        return Prepared(op, fetch)

    def supports(shape: ConvShape) -> bool:
        return shape.K == 1 and shape.H == 1 and shape.W == 1

    return Contender("cublas-sgemm", "gpu", "fp32", 1e-5, prepare, supports, anchor=True)


def select_contenders(names: Sequence[str] | None, gpu: bool) -> tuple[list[Contender], list[str]]:
    """Registered implementations usable here (+ anchors); also the reasons some were left out."""
    from convolab.registry import all_impls, get_impl

    notes: list[str] = []
    if names:
        impls = []
        for name in names:
            try:
                impls.append(get_impl(name))
            except KeyError as err:
                raise ConvolabError(err.args[0]) from None
            if impls[-1].reference_only:
                raise ConvolabError(f"{name!r} is the reference, not a contender: it is not timed")
            if impls[-1].device == "gpu" and not gpu:
                raise ConvolabError(f"{name!r} runs on the GPU, and no CUDA GPU is usable here")
    else:
        impls = [i for i in all_impls(include_reference=False) if gpu or i.device == "cpu"]
        if gpu:
            skipped = [i.name for i in impls if i.name in NUMBA_IMPLS]
            impls = [i for i in impls if i.name not in NUMBA_IMPLS]
            if skipped:
                notes.append(f"skipped {', '.join(skipped)}: Numba is not loaded on GPU hosts "
                             "(name them with --impl to force)")
    contenders = [_from_impl(i) for i in impls]
    if not names:
        contenders += _torch_contenders(gpu)
        if not any(c.name.startswith("torch") for c in contenders):
            notes.append("PyTorch is not installed: no cuDNN/torch-CPU anchor rows")
        if gpu:
            contenders.append(_cublas_contender())
    if not contenders:
        raise ConvolabError("no implementation is available to benchmark here")
    return contenders, notes


# --------------------------------------------------------------------------- measuring


def _reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, pool: int) -> np.ndarray:
    from convolab.conv_cpu import conv_reference

    y = conv_reference(x, w, b, stride)
    if pool:
        y = np.maximum(y, 0.0)
        B, M, H, W = y.shape
        Hp, Wp = H // pool, W // pool
        y = y[:, :, : Hp * pool, : Wp * pool].reshape(B, M, Hp, pool, Wp, pool).max(axis=(3, 5))
    return y


def _random_problem(shape: ConvShape, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    # Weights scaled by 1/sqrt(fan-in) keep outputs O(1) at every shape, so rel_l2 is meaningful.
    x = rng.standard_normal(shape.x_shape, dtype=np.float32)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32)
    w *= np.float32(1.0 / math.sqrt(shape.C * shape.K * shape.K))
    b = rng.standard_normal(shape.M, dtype=np.float32)
    return x, w, b


def _to(device: str, a: np.ndarray) -> Any:
    return a if device == "cpu" else cupy_or_none().asarray(a)


_shared_problems: dict[tuple[ConvShape, int], tuple[np.ndarray, ...]] = {}


def check_contender(c: Contender, shape: ConvShape, pool: int, rng: np.random.Generator) -> float:
    """rel L2 error of one run on fresh inputs against the fp64 reference (output poisoned)."""
    per_image = shape.with_batch(1).flops
    n = 1 if per_image * CHECK_BATCH > CHECK_FLOPS_PER_RUN else min(shape.B, CHECK_BATCH)
    small = shape.with_batch(n)
    shared = small.flops > CHECK_SHARED_FLOPS
    if c.impl is not None and not shared:
        try:
            from convolab.verify import check_impl
        except ImportError:
            pass
        else:  # the same check `convolab verify` makes, so the two never disagree
            return check_impl(c.impl, small, rng)
    if shared:
        if (small, pool) not in _shared_problems:
            x, w, b = _random_problem(small, rng)
            _shared_problems.clear()  # keep only the current layer's (they can be large)
            _shared_problems[(small, pool)] = (x, w, b, _reference(x, w, b, shape.S, pool))
        x, w, b, ref = _shared_problems[(small, pool)]
    else:
        x, w, b = _random_problem(small, rng)
        ref = _reference(x, w, b, shape.S, pool)
    prepared = c.prepare(small, _to(c.device, w), _to(c.device, b))
    prepared.poison()
    prepared.op(_to(c.device, x))
    return rel_l2(prepared.fetch(), ref)


def _gpu_buffers(shape: ConvShape) -> list[Any]:
    """Enough input buffers that cycling through them never finds the input in L2."""
    cp = cupy_or_none()
    l2 = int(cp.cuda.Device().attributes.get("L2CacheSize", 50 * 2**20))
    nbytes = 4 * math.prod(shape.x_shape)
    count = min(MAX_ROTATE_BUFFERS, max(1, math.ceil(L2_ROTATE_FACTOR * l2 / nbytes)))
    return [cp.random.standard_normal(shape.x_shape, dtype=np.float32) for _ in range(count)]


def _torch_timer(fn: Callable[[], object], reps: int, warmup: int) -> list[float]:
    """CUDA events on torch's own current stream, for the torch anchors."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return samples


def _free_gpu_memory() -> None:
    cp = cupy_or_none()
    if cp is not None:
        cp.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _fits_gpu(shape: ConvShape, pool: int) -> bool:
    cp = cupy_or_none()
    free, _ = cp.cuda.runtime.memGetInfo()
    need = 4 * (max(math.prod(shape.x_shape), math.ceil(L2_ROTATE_FACTOR * 50 * 2**20 / 4)) * 2
                + math.prod(shape.w_shape) + 2 * math.prod(_out_shape(shape, pool)))
    return need < 0.8 * free


def time_contender(c: Contender, shape: ConvShape, reps: int,
                   rng: np.random.Generator) -> tuple[list[float], list[float] | None]:
    """Op Time samples (ms) and, on the GPU, Layer Time samples."""
    _, w, b = _random_problem(shape.with_batch(1), rng)  # weights; inputs are made per device
    if c.device == "cpu":
        xs = [rng.standard_normal(shape.x_shape, dtype=np.float32) for _ in range(2)]
        prepared = c.prepare(shape, w, b)
        rotation = itertools.cycle(xs)
        # The warm-up run (JIT compilation included) also sizes the run to the time budget.
        first_ms = time_cpu(lambda: prepared.op(next(rotation)))[0]
        cpu_reps = min(reps, max(CPU_MIN_REPS, int(CPU_TIME_BUDGET_MS // max(first_ms, 1e-3))))
        op_samples = time_cpu(lambda: prepared.op(next(rotation)), reps=cpu_reps)
        return op_samples, None
    w_d, b_d = _to("gpu", w), _to("gpu", b)
    prepared = c.prepare(shape, w_d, b_d)
    xs = _gpu_buffers(shape)
    rotation = itertools.cycle(xs)
    timer = _torch_timer if c.name.startswith("torch") else time_gpu
    op_samples = timer(lambda: prepared.op(next(rotation)), reps=reps, warmup=WARMUP)
    layer_samples = None
    if prepared.layer is not None:
        x_host = to_numpy(xs[0])
        del xs, rotation
        _free_gpu_memory()
        layer_samples = time_host_gpu(lambda: prepared.layer(x_host),
                                      reps=max(3, min(reps // 4, 10)), warmup=1)
    return op_samples, layer_samples


@dataclass
class Row:
    case: str
    impl: str
    device: str
    rung: int | None
    anchor: bool
    shape: str
    batch: int
    precision: str
    status: str = "ok"  # ok | wrong | error | skipped
    detail: str = ""
    rel_l2: float | None = None
    tolerance: float | None = None
    op: dict[str, float] | None = None
    op_samples_ms: list[float] = field(default_factory=list)
    layer: dict[str, float] | None = None
    layer_samples_ms: list[float] = field(default_factory=list)
    gflops: float | None = None
    gbps: float | None = None
    roofline_pct: float | None = None
    floor_ms: float | None = None
    speedup_vs_anchor: float | None = None
    anchor_name: str | None = None


def bench_case(case: LayerCase, contenders: Sequence[Contender], reps: int,
               ceilings: dict[str, Ceilings], rng: np.random.Generator,
               progress: Callable[[str], None]) -> list[Row]:
    rows: list[Row] = []
    for c in contenders:
        if c.pool and c.pool != case.pool:
            continue  # a fused conv+pool rung only applies where that pool follows the conv
        if c.device == "cpu":
            n = cpu_batch(case.shape, c.name)
            shape = case.shape.with_batch(max(n, 1))
        else:
            n, shape = case.shape.B, case.shape
        row = Row(case.label, c.name, c.device, c.rung, c.anchor, str(shape), shape.B,
                  c.precision, tolerance=c.tolerance)
        rows.append(row)
        if n < 1:
            row.status, row.detail = "skipped", "one image exceeds the CPU work budget"
            continue
        try:
            supported = bool(c.supports(shape))
        except Exception as err:  # a rung's own check must not end the whole benchmark
            supported = False
            row.detail = f"supports() raised {type(err).__name__}: {err}"[:300]
        if not supported:
            if c.anchor and not row.detail:  # e.g. the GEMM anchor on a real conv: no row
                rows.pop()
                continue
            row.status, row.detail = "skipped", row.detail or "shape not supported"
            continue
        if c.device == "gpu" and not _fits_gpu(shape, c.pool):
            row.status, row.detail = "skipped", "does not fit in free GPU memory"
            continue
        progress(f"{case.label}: {c.name} (B={shape.B})")
        try:
            row.rel_l2 = check_contender(c, shape, c.pool, rng)
            if not row.rel_l2 <= c.tolerance:
                row.status = "wrong"
                row.detail = f"rel L2 {row.rel_l2:.2e} > tolerance {c.tolerance:.0e}: not timed"
                continue
            op_samples, layer_samples = time_contender(c, shape, reps, rng)
        except Exception as err:  # one broken rung must not end the whole benchmark
            row.status, row.detail = "error", f"{type(err).__name__}: {err}"[:300]
            continue
        finally:
            _free_gpu_memory()
        op = Stats.of(op_samples)
        row.op, row.op_samples_ms = op.as_dict(), op_samples
        if layer_samples:
            row.layer, row.layer_samples_ms = Stats.of(layer_samples).as_dict(), layer_samples
        out = _out_shape(shape, c.pool)
        nbytes = 4 * (math.prod(shape.x_shape) + math.prod(shape.w_shape) + shape.M
                      + math.prod(out))
        row.gflops = shape.flops / (op.median_ms * 1e6)
        row.gbps = nbytes / (op.median_ms * 1e6)
        ceil = ceilings[c.device]
        row.floor_ms = ceil.floor_ms(shape.flops, nbytes, c.precision)
        row.roofline_pct = 100.0 * row.floor_ms / op.median_ms
    _add_speedups(rows)
    return rows


def _add_speedups(rows: list[Row]) -> None:
    """Speed-up against cuDNN fp32 (GPU rows) or torch-CPU (CPU rows) at the same batch."""
    anchors = {r.device: r for r in rows if r.impl in ("torch-cudnn-fp32", "torch-cpu") and r.op}
    for r in rows:
        a = anchors.get(r.device)
        if a is None or not r.op or a.batch != r.batch:
            continue
        r.speedup_vs_anchor = a.op["median_ms"] / r.op["median_ms"]
        r.anchor_name = a.impl


# --------------------------------------------------------------------------- reporting


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    cp = cupy_or_none()
    if cp is not None:
        versions["cupy"] = cp.__version__
        versions["cuda_runtime"] = str(cp.cuda.runtime.runtimeGetVersion())
        versions["cuda_driver"] = str(cp.cuda.runtime.driverGetVersion())
    if "torch" in sys.modules:
        import torch

        versions["torch"] = torch.__version__
        if torch.backends.cudnn.is_available():
            versions["cudnn"] = str(torch.backends.cudnn.version())
    return versions


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(cases: Sequence[LayerCase], rows: Sequence[Row], console: Any) -> None:
    from rich.table import Table

    for case in cases:
        table = Table(title=f"{case.label}  {case.shape}"
                            + (f"  (+relu+pool {case.pool})" if case.pool else "")
                            + (f"\n{case.note}" if case.note else ""), title_justify="left")
        for col in ("impl", "rung", "B", "Op ms", "spread %", "GFLOP/s", "GB/s", "% roof",
                    "Layer ms", "x torch", "rel L2"):
            table.add_column(col, justify="left" if col == "impl" else "right")
        for r in (r for r in rows if r.case == case.label):
            if r.status != "ok":
                short = r.detail.splitlines()[0][:24] if r.detail else ""
                table.add_row(r.impl, _fmt(r.rung, "d"), str(r.batch),
                              f"[red]{r.status}[/red]", short, *[""] * 5,
                              _fmt(r.rel_l2, ".1e"))
                continue
            table.add_row(
                r.impl, _fmt(r.rung, "d"), str(r.batch), f"{r.op['median_ms']:.3f}",
                f"{r.op['spread_pct']:.1f}", f"{r.gflops:,.0f}", f"{r.gbps:,.0f}",
                f"{r.roofline_pct:.1f}",
                _fmt(r.layer["median_ms"] if r.layer else None, ".2f"),
                _fmt(r.speedup_vs_anchor, ".2f"), _fmt(r.rel_l2, ".1e"),
            )
        console.print(table)
        for r in (r for r in rows if r.case == case.label and r.status in ("error", "wrong")):
            console.print(f"  {r.impl}: {r.status}: {r.detail}", markup=False, highlight=False)
    console.print(
        "Op ms: median of CUDA-event (GPU) or wall-clock (CPU) times; spread: (p90-p10)/median; "
        "% roof: roofline floor max(flops/peak, bytes/bandwidth) over Op ms (weights that stay "
        "in cache can beat the DRAM floor); x torch: speed-up over torch-cudnn-fp32 (GPU rows) "
        "or torch-cpu (CPU rows) at the same batch"
    )


CSV_FIELDS = ("case", "impl", "device", "rung", "anchor", "shape", "batch", "precision", "status",
              "detail", "rel_l2", "tolerance", "op_median_ms", "op_p10_ms", "op_p90_ms",
              "op_spread_pct", "op_reps", "gflops", "gbps", "floor_ms", "roofline_pct",
              "layer_median_ms", "layer_spread_pct", "speedup_vs_anchor", "anchor_name")


def _csv_row(r: Row) -> dict[str, Any]:
    d = {k: getattr(r, k) for k in CSV_FIELDS if hasattr(r, k)}
    if r.op:
        d |= {"op_median_ms": r.op["median_ms"], "op_p10_ms": r.op["p10_ms"],
              "op_p90_ms": r.op["p90_ms"], "op_spread_pct": r.op["spread_pct"],
              "op_reps": r.op["reps"]}
    if r.layer:
        d |= {"layer_median_ms": r.layer["median_ms"], "layer_spread_pct": r.layer["spread_pct"]}
    return d


def write_results(json_out: Path, report: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Path:
    """The JSON report and a CSV with the same stem beside it; returns the CSV's path."""
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(report, indent=1, default=str))
    csv_out = json_out.with_suffix(".csv")
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with csv_out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return csv_out


def _require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConvolabError(
            "--plot needs matplotlib, which is not installed: pip install 'convolab[bench]'"
        ) from None
    return plt


def plot_rows(path: Path, cases: Sequence[LayerCase], rows: Sequence[Row]) -> None:
    """One panel per layer: horizontal bars of Op Time per implementation (log scale), in
    ladder order, the cuDNN fp32 (or torch-CPU) time as a dashed line to beat."""
    plt = _require_matplotlib()
    from matplotlib.ticker import NullFormatter

    timed = [r for r in rows if r.op]
    device = "gpu" if any(r.device == "gpu" for r in timed) else "cpu"
    timed = [r for r in timed if r.device == device]
    labels = [c.label for c in cases if any(r.case == c.label for r in timed)]
    if not labels:
        raise ConvolabError("--plot: no timed rows to plot")
    anchor = "torch-cudnn-fp32" if device == "gpu" else "torch-cpu"
    most = max(sum(r.case == label for r in timed) for label in labels)
    fig, axes = plt.subplots(1, len(labels), figsize=(5.5 * len(labels), 1.0 + 0.28 * most),
                             squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        mine = [r for r in timed if r.case == label]
        names = [r.impl for r in mine]
        times = [r.op["median_ms"] for r in mine]
        colors = ["0.55" if r.anchor else "tab:orange" if (r.tolerance or 0) > 1e-5 else "tab:blue"
                  for r in mine]
        ax.barh(range(len(mine)), times, color=colors)
        ax.set_yticks(range(len(mine)), names, fontsize="small")
        ax.invert_yaxis()  # ladder order reads top to bottom
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on short spans
        ax.set_xlabel("Op Time, ms (median, log scale)")
        ax.set_title(f"{label}  B={mine[0].batch}", fontsize="medium")
        ref = next((r for r in mine if r.impl == anchor), None)
        if ref is not None:
            ax.axvline(ref.op["median_ms"], color="black", linestyle="--", linewidth=1,
                       label=f"{anchor} {ref.op['median_ms']:.2f} ms")
            ax.legend(fontsize="small", loc="lower right")
    fig.suptitle(f"convolab bench ({device}): blue fp32-accurate, orange TF32/FP16 accuracy, "
                 "grey anchors")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- network


def bench_network_rows(batch: int, reps: int) -> list[dict[str, Any]]:
    if not gpu_available():
        raise ConvolabError("--network times the whole-network GPU forward: no CUDA GPU is usable "
                            "here (CuPy missing or no device)")
    try:
        network = importlib.import_module("convolab.gpu.network")
    except ModuleNotFoundError as err:
        if err.name != "convolab.gpu.network":
            raise
        raise ConvolabError("--network is not available in this build: convolab.gpu.network "
                            "(the whole-network forward) is missing") from None
    if not hasattr(network, "bench_network"):
        raise ConvolabError("--network: convolab.gpu.network has no bench_network(batch, reps)")
    return list(network.bench_network(batch, reps))


def _print_generic(title: str, rows: Sequence[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    if not rows:
        console.print(f"{title}: no rows")
        return
    table = Table(title=title, title_justify="left")
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if not any(isinstance(r.get(k), (list, dict)) for r in rows)]
    for k in keys:
        table.add_column(k)
    for r in rows:
        table.add_row(*[format(r[k], ".4g") if isinstance(r.get(k), float) else str(r.get(k, ""))
                        for k in keys])
    console.print(table)


# --------------------------------------------------------------------------- entry point


def main(model: str, batch: int, names: Sequence[str] | None, reps: int, network: bool,
         shapes: str, json_out: Path | None, plot: Path | None) -> list[Row] | list[dict]:
    from rich.console import Console

    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    if reps < 1:
        raise ValueError(f"reps must be positive, got {reps}")
    console = Console()
    if not console.is_terminal:  # logs and CI: rich would squeeze the tables into 80 columns
        console = Console(width=170)
    gpu = gpu_available()
    date = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    device_name = _device_name(gpu)
    if network:
        net_rows = bench_network_rows(batch, reps)
        _print_generic(f"whole-network forward, B={batch}, {device_name}", net_rows, console)
        if json_out is not None:
            report = {"command": "bench --network", "date": date, "device": device_name,
                      "batch": batch, "reps": reps, "versions": _versions(), "rows": net_rows}
            csv_out = write_results(json_out, report, net_rows)
            console.print(f"wrote {json_out} and {csv_out}")
        return net_rows

    if plot is not None:
        _require_matplotlib()  # fail before minutes of measuring, not after
    cases = layer_cases(shapes, model, batch)
    contenders, notes = select_contenders(names, gpu)
    if reps < 20:
        notes.append(f"reps={reps} < 20: medians are indicative only")
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    with console.status("measuring ceilings"):
        ceilings = {"cpu": measure_cpu_ceilings()}
        if gpu:
            ceilings["gpu"] = measure_gpu_ceilings()
    for dev, ceil in ceilings.items():
        console.print(f"ceilings {dev} ({ceil.device}): copy {ceil.copy_gbps:,.0f} GB/s, "
                      f"fp32 {ceil.fp32_gflops:,.0f} / tf32 {ceil.tf32_gflops:,.0f} / "
                      f"fp16 {ceil.fp16_gflops:,.0f} GFLOP/s")
    rng = np.random.default_rng()
    rows: list[Row] = []

    def report() -> dict[str, Any]:
        return {
            "command": "bench", "date": date, "device": device_name, "cpu": _cpu_name(),
            "model": model, "shapes": shapes, "batch": batch, "reps": reps,
            "versions": _versions(), "notes": notes,
            "ceilings": {k: v.as_dict() for k, v in ceilings.items()},
            "cases": [{"label": c.label, "shape": str(c.shape), "pool": c.pool, "note": c.note,
                       "flops": c.shape.flops, "min_bytes": c.shape.min_bytes()} for c in cases],
            "rows": [r.__dict__ for r in rows],
        }

    with console.status("benchmarking") as status:

        def progress(message: str) -> None:
            status.update(f"benchmarking {message}")
            if not console.is_terminal:  # a log shows where a long run is, or where it stopped
                print(f"bench: {message}", file=sys.stderr, flush=True)

        for case in cases:
            rows += bench_case(case, contenders, reps, ceilings, rng, progress)
            if json_out is not None:  # partial results survive an interrupted run
                write_results(json_out, report(), [_csv_row(r) for r in rows])
    print_tables(cases, rows, console)
    if json_out is not None:
        csv_out = write_results(json_out, report(), [_csv_row(r) for r in rows])
        console.print(f"wrote {json_out} and {csv_out}")
    if plot is not None:
        plot_rows(plot, cases, rows)
        console.print(f"wrote {plot}")
    return rows


def _cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} logical CPUs)"


def _device_name(gpu: bool) -> str:
    if not gpu:
        return f"cpu: {_cpu_name()}"
    from convolab.roofline import gpu_device_name

    return gpu_device_name()
