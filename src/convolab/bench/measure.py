"""Measuring one contender on one layer, the course's way:

1. correctness first, on a small batch: fresh random inputs, the output poisoned with NaN,
   relative L2 error against the fp64 reference (`conv_cpu.reference_conv_relu_pool`); a
   contender that fails is reported and not timed, because a wrong kernel's speed means nothing;
2. Op Time: prepared once, CUDA events around `run` alone after warm-up, inputs rotated among
   enough buffers that together they exceed twice the L2 cache (a single small input would
   otherwise be served from L2 and flatter the kernel);
3. Layer Time for GPU contenders: host input in, device allocation, H2D, run, D2H;
4. GFLOP/s, GB/s and % of the roofline floor from ceilings measured in the same run.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none, to_numpy
from convolab.bench.cases import LayerCase, cpu_batch
from convolab.bench.contenders import Contender, out_shape
from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.roofline import Ceilings
from convolab.shapes import ConvShape
from convolab.timing import Stats, time_cpu, time_gpu, time_host_gpu

# A slow CPU contender gets fewer repetitions (never fewer than 3): the JSON records how many.
CPU_TIME_BUDGET_MS = 20_000.0
CPU_MIN_REPS = 3
# The correctness check runs on this many images (1 where one image is already > 1 GFLOP).
CHECK_BATCH = 4
CHECK_FLOPS_PER_RUN = 2e9
# Above this much work the fp64 reference costs seconds: one random problem per layer and
# bench run is then shared by all contenders (still fresh each run; outputs still poisoned).
CHECK_SHARED_FLOPS = 0.5e9
# Rotated input buffers must together exceed this many times the L2 size (50 MB on an H100).
L2_ROTATE_FACTOR = 2
MAX_ROTATE_BUFFERS = 256  # tiny inputs (VGG classifier rows) need many to fill 2 x L2
WARMUP = 3


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
    params: dict[str, Any] | None = None
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


def random_problem(shape: ConvShape, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    # Weights scaled by 1/sqrt(fan-in) keep outputs O(1) at every shape, so rel_l2 is meaningful.
    x = rng.standard_normal(shape.x_shape, dtype=np.float32)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32)
    w *= np.float32(1.0 / math.sqrt(shape.C * shape.K * shape.K))
    b = rng.standard_normal(shape.M, dtype=np.float32)
    return x, w, b


def _to(device: str, a: np.ndarray) -> Any:
    return a if device == "cpu" else cupy_or_none().asarray(a)


_shared_problems: dict[tuple[ConvShape, int], tuple[np.ndarray, ...]] = {}


def _check_problem(small: ConvShape, pool: int, rng: np.random.Generator
                   ) -> tuple[np.ndarray, ...]:
    if small.flops <= CHECK_SHARED_FLOPS:
        x, w, b = random_problem(small, rng)
        return x, w, b, reference_conv_relu_pool(x, w, b, small.S, pool)
    if (small, pool) not in _shared_problems:
        x, w, b = random_problem(small, rng)
        _shared_problems.clear()  # keep only the current layer's (they can be large)
        _shared_problems[(small, pool)] = (x, w, b, reference_conv_relu_pool(x, w, b, small.S,
                                                                             pool))
    return _shared_problems[(small, pool)]


def _raw_problem(small: ConvShape, pool: int, rng: np.random.Generator,
                 raw_hw: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Raw uint8 images, weights, bias and the fp64 reference on their resize (data's rule)."""
    from convolab.data import resize_bilinear

    raw = rng.integers(0, 256, (small.B, *raw_hw), dtype=np.uint8)
    _, w, b = random_problem(small.with_batch(1), rng)
    x = resize_bilinear(raw, small.H)
    return raw, w, b, reference_conv_relu_pool(x, w, b, small.S, pool)


def check_batch(c: Contender, shape: ConvShape) -> int:
    """The batch the check runs at: CHECK_BATCH images, or 1 where one image is already big,
    raised to the first batch the contender supports (one that pairs images needs 2)."""
    per_image = shape.with_batch(1).flops
    n = 1 if per_image * CHECK_BATCH > CHECK_FLOPS_PER_RUN else min(shape.B, CHECK_BATCH)
    return next((b for b in range(n, shape.B) if c.supports(shape.with_batch(b))), shape.B)


def check_contender(c: Contender, shape: ConvShape, pool: int, rng: np.random.Generator) -> float:
    """rel L2 error of one run on fresh inputs against the fp64 reference (output poisoned)."""
    small = shape.with_batch(check_batch(c, shape))
    x, w, b, ref = (_raw_problem(small, pool, rng, c.raw_hw) if c.raw_hw
                    else _check_problem(small, pool, rng))
    prepared = c.prepare(small, _to(c.device, w), _to(c.device, b))
    prepared.poison()
    prepared.op(_to(c.device, x))
    return rel_l2(prepared.fetch(), ref)


def _input_bytes(shape: ConvShape, raw_hw: tuple[int, int] | None) -> int:
    return shape.B * raw_hw[0] * raw_hw[1] if raw_hw else 4 * math.prod(shape.x_shape)


def _gpu_buffers(shape: ConvShape, raw_hw: tuple[int, int] | None = None) -> list[Any]:
    """Enough input buffers that cycling through them never finds the input in L2 (raw uint8
    images (B, *raw_hw) where given, else float32 ones)."""
    cp = cupy_or_none()
    l2 = int(cp.cuda.Device().attributes.get("L2CacheSize", 50 * 2**20))
    nbytes = _input_bytes(shape, raw_hw)
    count = min(MAX_ROTATE_BUFFERS, max(1, math.ceil(L2_ROTATE_FACTOR * l2 / nbytes)))
    if raw_hw:
        return [cp.random.randint(0, 256, (shape.B, *raw_hw)).astype(cp.uint8)
                for _ in range(count)]
    return [cp.random.standard_normal(shape.x_shape, dtype=np.float32) for _ in range(count)]


def torch_timer(fn: Callable[[], object], reps: int, warmup: int) -> list[float]:
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


def free_gpu_memory() -> None:
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
                + math.prod(shape.w_shape) + 2 * math.prod(out_shape(shape, pool)))
    return need < 0.8 * free


def _time_cpu_contender(c: Contender, shape: ConvShape, reps: int, w: np.ndarray, b: np.ndarray,
                        rng: np.random.Generator) -> list[float]:
    xs = [rng.standard_normal(shape.x_shape, dtype=np.float32) for _ in range(2)]
    prepared = c.prepare(shape, w, b)
    rotation = itertools.cycle(xs)
    # The warm-up run (JIT compilation included) also sizes the run to the time budget.
    first_ms = time_cpu(lambda: prepared.op(next(rotation)))[0]
    cpu_reps = min(reps, max(CPU_MIN_REPS, int(CPU_TIME_BUDGET_MS // max(first_ms, 1e-3))))
    return time_cpu(lambda: prepared.op(next(rotation)), reps=cpu_reps)


def time_contender(c: Contender, shape: ConvShape, reps: int,
                   rng: np.random.Generator) -> tuple[list[float], list[float] | None]:
    """Op Time samples (ms) and, on the GPU, Layer Time samples."""
    _, w, b = random_problem(shape.with_batch(1), rng)  # weights; inputs are made per device
    if c.device == "cpu":
        return _time_cpu_contender(c, shape, reps, w, b, rng), None
    prepared = c.prepare(shape, _to("gpu", w), _to("gpu", b))
    xs = _gpu_buffers(shape, c.raw_hw)
    # Once on every rotated buffer before timing: contenders that convert an input the first
    # time they see it (cuDNN's fp16 channels-last, a channels-last rung) do so here, untimed;
    # with more buffers than warm-up runs that conversion otherwise lands in the samples.
    for x in xs:
        prepared.op(x)
    rotation = {"inputs": itertools.cycle(xs)}
    timer = torch_timer if c.name.startswith("torch") else time_gpu
    op_samples = timer(lambda: prepared.op(next(rotation["inputs"])), reps=reps, warmup=WARMUP)
    if prepared.layer is None:
        return op_samples, None
    x_host = to_numpy(xs[0])
    del xs
    rotation.clear()  # the cycle holds every buffer: free them before Layer Time allocates
    free_gpu_memory()
    layer_samples = time_host_gpu(lambda: prepared.layer(x_host),
                                  reps=max(3, min(reps // 4, 10)), warmup=1)
    return op_samples, layer_samples


def _skip_reason(c: Contender, shape: ConvShape, n: int) -> str | None:
    """Why this contender is not run on this shape ('' = drop the row), or None to run it."""
    if n < 1:
        return "one image exceeds the CPU work budget"
    try:
        supported = bool(c.supports(shape))
    except Exception as err:  # a rung's own check must not end the whole benchmark
        return f"supports() raised {type(err).__name__}: {err}"[:300]
    if not supported:
        return "" if c.anchor else "shape not supported"  # e.g. the GEMM anchor on a real conv
    if c.device == "gpu" and not _fits_gpu(shape, c.pool):
        return "does not fit in free GPU memory"
    return None


def _fill_timings(row: Row, case: LayerCase, shape: ConvShape, c: Contender,
                  samples: tuple[list[float], list[float] | None], ceil: Ceilings) -> None:
    op_samples, layer_samples = samples
    op = Stats.of(op_samples)
    row.op, row.op_samples_ms = op.as_dict(), op_samples
    if layer_samples:
        row.layer, row.layer_samples_ms = Stats.of(layer_samples).as_dict(), layer_samples
    nbytes = _input_bytes(shape, c.raw_hw) + 4 * (math.prod(shape.w_shape) + shape.M
                                                  + math.prod(out_shape(shape, c.pool)))
    row.gflops = shape.flops / (op.median_ms * 1e6)
    row.gbps = nbytes / (op.median_ms * 1e6)
    row.floor_ms = ceil.floor_ms(shape.flops, nbytes, c.precision)
    row.roofline_pct = 100.0 * row.floor_ms / op.median_ms


def bench_one(case: LayerCase, c: Contender, reps: int, ceilings: dict[str, Ceilings],
              rng: np.random.Generator, progress: Callable[[str], None]) -> Row | None:
    """One contender on one layer: checked, then timed (None: the row does not apply)."""
    if c.pool and c.pool != case.pool:
        return None  # a fused conv+pool rung only applies where that pool follows the conv
    n = cpu_batch(case.shape, c.impl.name if c.impl else c.name) if c.device == "cpu" \
        else case.shape.B
    shape = case.shape.with_batch(max(n, 1))
    row = Row(case.label, c.name, c.device, c.rung, c.anchor, str(shape), shape.B, c.precision,
              params=c.params, tolerance=c.tolerance)
    reason = _skip_reason(c, shape, n)
    if reason is not None:
        if not reason:
            return None
        row.status, row.detail = "skipped", reason
        return row
    progress(f"{case.label}: {c.name} (B={shape.B})")
    try:
        row.rel_l2 = check_contender(c, shape, c.pool, rng)
        if not row.rel_l2 <= c.tolerance:
            row.status = "wrong"
            row.detail = f"rel L2 {row.rel_l2:.2e} > tolerance {c.tolerance:.0e}: not timed"
            return row
        samples = time_contender(c, shape, reps, rng)
    except Exception as err:  # one broken rung must not end the whole benchmark
        row.status, row.detail = "error", f"{type(err).__name__}: {err}"[:300]
        return row
    finally:
        free_gpu_memory()
    _fill_timings(row, case, shape, c, samples, ceilings[c.device])
    return row


def bench_case(case: LayerCase, contenders: Sequence[Contender], reps: int,
               ceilings: dict[str, Ceilings], rng: np.random.Generator,
               progress: Callable[[str], None]) -> list[Row]:
    rows = [bench_one(case, c, reps, ceilings, rng, progress) for c in contenders]
    out = [r for r in rows if r is not None]
    add_speedups(out)
    return out


def add_speedups(rows: list[Row]) -> None:
    """Speed-up against cuDNN fp32 (GPU rows) or torch-CPU (CPU rows) at the same batch."""
    anchors = {r.device: r for r in rows if r.impl in ("torch-cudnn-fp32", "torch-cpu") and r.op}
    for r in rows:
        a = anchors.get(r.device)
        if a is None or not r.op or a.batch != r.batch:
            continue
        r.speedup_vs_anchor = a.op["median_ms"] / r.op["median_ms"]
        r.anchor_name = a.impl
