"""`convolab classify`: the course's harness. Per conv layer it prints Op Time (the convolution
launches alone, data already on the device) and Layer Time (the layer called from host arrays:
allocation, copies in, kernels, copy out), then `Test Accuracy` over the first N test images.

On the GPU the default for every zoo model is the whole-network fused forward from the raw
image bytes (one figure for the whole network); `--per-layer` or `--impl NAME` runs layer by
layer so the course's per-layer times can be printed for any rung.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from convolab import data, models, outputs, precision
from convolab.backend import require_cupy, to_numpy
from convolab.errors import ConvolabError
from convolab.gpu.device import gpu_name
from convolab.layers import Conv2d
from convolab.network import Network
from convolab.registry import ConvImpl, all_impls, get_impl
from convolab.shapes import COURSE_SELF_TESTS, ConvShape

console = Console(highlight=False)
CPU_CHUNK = 500  # images per step on the CPU: bounded memory and a moving progress bar
GPU_CHUNK = 10_000
# --throughput streams its images in chunks (host memory stays bounded at any N); the limit
# only keeps a typo (an extra zero or three) from starting a run of days.
MAX_THROUGHPUT = 10_000_000
GPU_THROUGHPUT_CHUNK = 1 << 20  # raw host images per fused-network call: 822 MB of bytes
GPU_MIN_STEP = 2_500
# The fused network's streaming rate is the median of this many passes over each chunk: one
# pass spread 5.5-13M img/s across runs (the host side: Python's chunk loop, staging threads).
THROUGHPUT_REPEATS = 5


def say(message: str) -> None:
    console.print(message, markup=False, soft_wrap=True)


@dataclass
class LayerTimes:
    name: str
    shape: str
    impl: str
    op_ms: float = 0.0
    layer_ms: float = 0.0


@dataclass
class Throughput:
    """The --throughput run: its own images (the first `source_images` test images repeated
    to make `images`), its own speed and its own accuracy over those images."""

    images: int
    source_images: int
    path: str
    images_per_s: float = 0.0
    accuracy: float = 0.0


@dataclass
class Report:
    """`accuracy` and the times are over the first `batch` test images; `throughput` holds
    the separate streaming run, when asked for."""

    model: str
    device: str
    batch: int
    path: str
    accuracy: float = 0.0
    layers: list[LayerTimes] = field(default_factory=list)
    network_op_ms: float | None = None
    network_layer_ms: float | None = None
    throughput: Throughput | None = None
    gpu: str | None = None
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())


def default_impl(device: str) -> str:
    names = {i.name for i in all_impls(device, include_reference=False)}
    preferred = ("cpu-fused", "cpu-im2col") if device == "cpu" else ("auto", "register-tiled")
    for name in preferred:
        if name in names:
            return name
    if not names:
        raise ConvolabError(f"no convolution implementation is registered for device {device}")
    return sorted(names)[0]


def choose_impl(name: str | None, device: str) -> ConvImpl:
    impl = get_impl(name or default_impl(device))
    if impl.device != device:
        raise ConvolabError(
            f"implementation {impl.name!r} runs on the {impl.device.upper()}; "
            f"pass --device {impl.device} or pick a {device.upper()} implementation (convolab list)"
        )
    if impl.pool:
        raise ConvolabError(f"{impl.name!r} fuses pooling into the conv; classify per layer "
                            "needs a plain convolution implementation")
    return impl


def run_self_test(impl: ConvImpl) -> None:
    """The course harness checked the conv on fixed cases before classifying; so do we."""
    from convolab.verify import check_impl

    rng = np.random.default_rng()
    worst = 0.0
    for shape in COURSE_SELF_TESTS:
        if not impl.supports(shape):
            continue
        err = check_impl(impl, shape, rng)
        worst = max(worst, err)
        if not err <= impl.tolerance:
            raise ConvolabError(f"self-test failed for {impl.name} on {shape}: "
                                f"rel. error {err:.3g} > {impl.tolerance:g}")
    say(f"Self-test ({impl.name}): course cases passed, max rel. error {worst:.2e}")


class LayerRunner:
    """Runs a network layer by layer, timing each Conv2d with the chosen implementation."""

    def __init__(self, network: Network, impl: ConvImpl, device: str) -> None:
        self.network, self.impl, self.device = network, impl, device
        self.xp = np if device == "cpu" else require_cupy()
        self.convs = [layer for layer in network.layers if isinstance(layer, Conv2d)]
        self.times = {c.name: LayerTimes(c.name, "", impl.name) for c in self.convs}
        self._plans: dict[tuple[str, ConvShape], Any] = {}
        self._host_weights = {c.name: to_numpy(c.weight) for c in self.convs}

    def _plan(self, conv: Conv2d, shape: ConvShape) -> Any:
        key = (conv.name, shape)
        if key not in self._plans:
            self.impl.check(shape)
            bias = conv.bias if conv.bias is not None else self.xp.zeros((shape.M,), np.float32)
            self._plans[key] = self.impl.prepare(shape, conv.weight, bias, self.impl.params_for())
        return self._plans[key]

    def _warm_up(self, conv: Conv2d, a: Any) -> None:
        """One image through the layer first, so JIT compilation (Numba) and module loading
        (CUDA) stay out of the timed region, as the course's warm run did."""
        one = ConvShape.of(a[:1].shape, conv.weight.shape, conv.stride)
        self._plan(conv, one)(self.xp.ascontiguousarray(a[:1]),
                              self.xp.empty(self.impl.out_shape(one), np.float32))

    def _conv(self, conv: Conv2d, a: Any) -> Any:
        shape = ConvShape.of(a.shape, conv.weight.shape, conv.stride)
        self.times[conv.name].shape = str(shape.with_batch(1)).replace("B=1 ", "")
        if (conv.name, shape) not in self._plans:
            self._warm_up(conv, a)
        run = self._plan(conv, shape)
        if self.device == "cpu":
            t0 = time.perf_counter()
            y = np.empty(shape.y_shape, np.float32)  # allocation is part of the CPU layer
            t1 = time.perf_counter()
            run(a, y)
            t2 = time.perf_counter()
            self.times[conv.name].op_ms += (t2 - t1) * 1e3
            self.times[conv.name].layer_ms += (t2 - t0) * 1e3
            return y
        y = self.xp.empty(shape.y_shape, np.float32)
        self.times[conv.name].op_ms += self._gpu_op_ms(run, a, y)
        self.times[conv.name].layer_ms += self._gpu_layer_ms(conv, run, shape, to_numpy(a))
        return y

    def _gpu_op_ms(self, run: Any, a: Any, y: Any) -> float:
        cp = self.xp
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run(a, y)
        stop.record()
        stop.synchronize()
        return float(cp.cuda.get_elapsed_time(start, stop))

    def _gpu_layer_ms(self, conv: Conv2d, run: Any, shape: ConvShape, x_host: np.ndarray) -> float:
        """From host arrays to a host array: what a caller of the layer pays (kernels cached)."""
        cp = self.xp
        w_host = self._host_weights[conv.name]
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        x_dev = cp.asarray(x_host)
        cp.asarray(w_host)  # the weights travel too, as in the course
        y_dev = cp.empty(shape.y_shape, np.float32)
        run(x_dev, y_dev)
        y_dev.get()
        cp.cuda.Device().synchronize()
        return (time.perf_counter() - t0) * 1e3

    def forward(self, x: Any) -> Any:
        a = x
        for layer in self.network.layers:
            a = self._conv(layer, a) if isinstance(layer, Conv2d) else layer.forward(a)
        return a


def chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeRemainingColumn(),
                    console=console, transient=True)


def run_per_layer(network: Network, impl: ConvImpl, device: str, x: np.ndarray,
                  labels: np.ndarray, report: Report) -> None:
    runner = LayerRunner(network, impl, device)
    chunk = CPU_CHUNK if device == "cpu" else GPU_CHUNK
    correct = 0
    with progress() as bar:
        task = bar.add_task(f"classify ({impl.name})", total=len(x))
        for lo, hi in chunks(len(x), chunk):
            xb = x[lo:hi] if device == "cpu" else require_cupy().asarray(x[lo:hi])
            probs = to_numpy(runner.forward(xb))
            correct += int((probs.argmax(axis=1) == labels[lo:hi]).sum())
            bar.advance(task, hi - lo)
    report.layers = list(runner.times.values())
    report.accuracy = correct / len(x)


def run_fused(network: Network, mode: str, raw: np.ndarray, labels: np.ndarray,
              report: Report) -> None:
    """The fused GPU network from the raw test bytes (resized on chip). Op Time: the forward
    of raw images already on the GPU; Layer Time: host bytes in, predicted classes back."""
    from convolab.gpu.network import FusedLeNet, pinned_empty

    cp = require_cupy()
    fused = FusedLeNet(network.params(), mode=mode, model=network.name)
    pinned = pinned_empty(raw.shape, np.uint8)  # where a loader puts bytes bound for the GPU
    pinned[...] = raw
    raw = pinned
    raw_dev = cp.asarray(raw)
    fused(raw_dev)  # warm-up: compile and load outside the timed region
    fused.forward_chunks(raw, chunk=fused_chunk(len(raw)), labels=True)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fused(raw_dev)
    stop.record()
    stop.synchronize()
    report.network_op_ms = float(cp.cuda.get_elapsed_time(start, stop))
    t0 = time.perf_counter()
    predicted = fused.forward_chunks(raw, chunk=fused_chunk(len(raw)), labels=True)
    report.network_layer_ms = (time.perf_counter() - t0) * 1e3
    report.accuracy = float((predicted == labels).mean())


def fused_chunk(n: int) -> int:
    """Images per streamed step: four steps in flight hide the copies behind the kernels; a
    step below ~2,500 images leaves the GPU idle between launches."""
    return max(min(n, GPU_MIN_STEP), -(-n // 4))


def run_cpu_network(network: Network, x: np.ndarray, labels: np.ndarray,
                    report: Report) -> None:
    """The whole forward on the CPU. Op Time: the forward of images already in memory; Layer
    Time adds the class decision a caller of predict pays on top."""
    network.forward(x[:1])  # warm-up: load (or compile) the cached kernels outside the timing
    t0 = time.perf_counter()
    probs = network.forward(x)
    t1 = time.perf_counter()
    predicted = np.asarray(probs).argmax(axis=1)
    t2 = time.perf_counter()
    report.network_op_ms = (t1 - t0) * 1e3
    report.network_layer_ms = (t2 - t0) * 1e3
    report.accuracy = float((predicted == labels).mean())


def _throughput_cpu_network(network: Network, x: np.ndarray, labels: np.ndarray,
                            t: Throughput) -> None:
    network.forward(x[:1])
    seconds = correct = 0.0
    for xb, yb in streamed(x, labels, t.images, CPU_CHUNK):
        t0 = time.perf_counter()
        probs = network.forward(xb)
        seconds += time.perf_counter() - t0
        correct += int((np.asarray(probs).argmax(axis=1) == yb).sum())
    t.images_per_s = t.images / seconds if seconds > 0 else float("inf")
    t.accuracy = correct / t.images


def streamed(x: np.ndarray, labels: np.ndarray, n: int, chunk: int,
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """n images in chunks of at most `chunk`: x repeated, gathered chunk by chunk so memory
    never grows with n."""
    for lo, hi in chunks(n, chunk):
        idx = np.arange(lo, hi) % len(x)
        yield np.ascontiguousarray(x[idx]), labels[idx]


def _throughput_fused(network: Network, mode: str, raw: np.ndarray, labels: np.ndarray,
                      t: Throughput) -> None:
    """Raw bytes host -> predicted classes host, in chunks gathered outside the timing."""
    from convolab.gpu.network import FusedLeNet

    fused = FusedLeNet(network.params(), mode=mode, model=network.name)
    seconds = correct = 0.0
    for xb, yb in streamed(raw, labels, t.images, GPU_THROUGHPUT_CHUNK):
        predicted, per_s = fused.throughput(xb, labels=True, repeats=THROUGHPUT_REPEATS)
        seconds += len(xb) / per_s
        correct += int((predicted == yb).sum())
    t.images_per_s = t.images / seconds if seconds > 0 else float("inf")
    t.accuracy = correct / t.images


def _throughput_layers(network: Network, impl: ConvImpl, device: str, x: np.ndarray,
                       labels: np.ndarray, t: Throughput) -> None:
    runner = LayerRunner(network, impl, device)
    chunk = CPU_CHUNK if device == "cpu" else GPU_CHUNK
    seconds = correct = 0.0
    with progress() as bar:
        task = bar.add_task(f"throughput ({impl.name})", total=t.images)
        for xb, yb in streamed(x, labels, t.images, chunk):
            t0 = time.perf_counter()
            probs = to_numpy(runner.forward(xb if device == "cpu"
                                            else require_cupy().asarray(xb)))
            seconds += time.perf_counter() - t0
            correct += int((probs.argmax(axis=1) == yb).sum())
            bar.advance(task, len(xb))
    t.images_per_s = t.images / seconds if seconds > 0 else float("inf")
    t.accuracy = correct / t.images


def run_throughput(network: Network, impl: ConvImpl | None, device: str, n: int,
                   x: np.ndarray, labels: np.ndarray, mode: str) -> Throughput:
    """Stream n images (the test images repeated) host to host: the fused network on the
    GPU (impl None), else layer by layer with `impl`; images/s and accuracy over those n."""
    if impl is None and device == "cpu":
        t = Throughput(n, len(x), "fused CPU network")
        _throughput_cpu_network(network, x, labels, t)
    elif impl is None:
        t = Throughput(n, len(x), f"fused network ({mode})")
        _throughput_fused(network, mode, x, labels, t)
    else:
        t = Throughput(n, len(x), f"per layer ({impl.name})")
        _throughput_layers(network, impl, device, x, labels, t)
    return t


def print_report(report: Report) -> None:
    for lt in report.layers:
        say(f"Conv layer {lt.name} [{lt.impl}] {lt.shape}, B={report.batch}")
        say(f"  Op Time: {lt.op_ms:.3f} ms")
        say(f"  Layer Time: {lt.layer_ms:.3f} ms")
    if report.network_op_ms is not None:
        say(f"Whole network [{report.path}], B={report.batch}")
        say(f"  Op Time: {report.network_op_ms:.3f} ms")
        say(f"  Layer Time: {report.network_layer_ms:.3f} ms")
    say(f"Test Accuracy: {report.accuracy:.4f} (first {report.batch} test images)")
    t = report.throughput
    if t is not None:
        say(f"Throughput [{t.path}]: {t.images:,} images (the first {t.source_images} test "
            f"images repeated), {t.images_per_s:,.0f} images/s, accuracy {t.accuracy:.4f} "
            f"over those {t.images:,}")


def check_throughput(n: int | None) -> None:
    if n is not None and not 1 <= n <= MAX_THROUGHPUT:
        raise ConvolabError(f"--throughput must be between 1 and {MAX_THROUGHPUT:,} images "
                            f"(streamed in chunks), got {n}")


def resolve_mode(mode: str | None, device: str, model: str, fused: bool) -> str:
    """The fused network's precision mode; --mode given where no fused network runs (the CPU,
    --per-layer, --impl, other models) is refused rather than ignored."""
    try:
        network_mode = precision.network_mode(mode or "exact")
    except ValueError as err:
        raise ConvolabError(f"--{err}") from None
    if mode is not None and not fused:
        where = ("on the CPU every implementation computes in fp32" if device == "cpu" else
                 "--per-layer/--impl run the named fp32 implementation")
        raise ConvolabError(f"--mode selects the GPU fused network's precision; {where}")
    return network_mode


def main(*, model: str, batch: int, impl: str | None, device: str, weights: Path | None,
         data_dir: Path | None, per_layer: bool, mode: str | None, throughput: int | None,
         self_test: bool, json_out: Path | None) -> None:
    """Classify the first `batch` test images (and stream `throughput` more, if asked);
    every option and the --json path are checked before anything is loaded."""
    spec = models.spec(model)
    check_throughput(throughput)
    fused = device == "gpu" and impl is None and not per_layer
    network_mode = resolve_mode(mode, device, model, fused)
    # The CPU default is the framework's fused inference (one kernel per conv+ReLU+pool block,
    # docs/cpu.md), for every model; --per-layer or --impl times each conv layer instead.
    cpu_network = device == "cpu" and impl is None and not per_layer
    chosen = None if fused or cpu_network else choose_impl(impl, device)  # checked up front
    if json_out is not None:
        json_out = outputs.check_file(json_out, "--json")
    network = models.load(model, weights)
    if fused:  # the bytes of the image file go to the GPU: no float copy on the host
        x, labels = data.load_split("test", data_dir=data_dir, limit=batch)
    else:
        x, labels = data.load_images("test", n=batch, size=spec.input_size, data_dir=data_dir)
    report = Report(model=model, device=device, batch=batch, path="")
    if device == "gpu":
        report.gpu = gpu_name()
        network.to("gpu")
    if cpu_network:
        report.path = "fused CPU network"
        run_cpu_network(network, x, labels, report)
    elif chosen is None:
        report.path = f"fused network ({mode or 'exact'})"
        run_fused(network, network_mode, x, labels, report)
    else:
        if self_test:
            run_self_test(chosen)
        report.path = f"per layer ({chosen.name})"
        run_per_layer(network, chosen, device, x, labels, report)
    if throughput is not None:  # the same path as above: the fused network or `chosen`
        report.throughput = run_throughput(network, chosen, device, throughput, x, labels,
                                           network_mode)
    print_report(report)
    if json_out is not None:
        outputs.write_json(json_out, asdict(report))
        say(f"wrote {json_out}")
