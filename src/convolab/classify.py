"""`convolab classify`: the course's harness. Per conv layer it prints Op Time (the convolution
launches alone, data already on the device) and Layer Time (the layer called from host arrays:
allocation, copies in, kernels, copy out), then `Test Accuracy` over the first N test images.

On the GPU the default for `ece408` is the whole-network fused forward (one figure for the
whole network); `--per-layer` or `--impl NAME` runs layer by layer so the course's per-layer
times can be printed for any rung.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from convolab import data, models, precision
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


def say(message: str) -> None:
    console.print(message, markup=False)


@dataclass
class LayerTimes:
    name: str
    shape: str
    impl: str
    op_ms: float = 0.0
    layer_ms: float = 0.0


@dataclass
class Report:
    model: str
    device: str
    batch: int
    path: str
    accuracy: float = 0.0
    layers: list[LayerTimes] = field(default_factory=list)
    network_op_ms: float | None = None
    network_layer_ms: float | None = None
    images_per_s: float | None = None
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


def run_fused(network: Network, mode: str, x: np.ndarray, labels: np.ndarray,
              report: Report) -> None:
    from convolab.gpu.network import FusedLeNet

    cp = require_cupy()
    fused = FusedLeNet(network.params(), mode=mode)
    x_dev = cp.asarray(x)
    fused(x_dev)  # warm-up: compile and load outside the timed region
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    probs = fused(x_dev)
    stop.record()
    stop.synchronize()
    report.network_op_ms = float(cp.cuda.get_elapsed_time(start, stop))
    t0 = time.perf_counter()
    probs = fused(cp.asarray(x)).get()
    report.network_layer_ms = (time.perf_counter() - t0) * 1e3
    report.accuracy = float((probs.argmax(axis=1) == labels).mean())


def run_throughput(network: Network, device: str, n: int, x: np.ndarray, labels: np.ndarray,
                   mode: str, report: Report) -> None:
    """Stream n images (the test images repeated) through the fastest path; images/s."""
    reps = -(-n // len(x))
    big_x = np.ascontiguousarray(np.tile(x, (reps, 1, 1, 1))[:n])
    big_labels = np.tile(labels, reps)[:n]
    if device == "gpu" and network.name == "ece408":
        from convolab.gpu.network import FusedLeNet

        fused = FusedLeNet(network.params(), mode=mode)
        fused.throughput(big_x[: min(n, 1000)])  # warm-up
        probs, per_s = fused.throughput(big_x)
    else:
        t0 = time.perf_counter()
        probs = network.forward(big_x) if device == "cpu" else None
        per_s = n / (time.perf_counter() - t0)
        if probs is None:
            raise ConvolabError("--throughput on the GPU is available for the ece408 model")
    report.images_per_s = float(per_s)
    report.accuracy = float((to_numpy(probs).argmax(axis=1) == big_labels).mean())


def print_report(report: Report) -> None:
    for lt in report.layers:
        say(f"Conv layer {lt.name} [{lt.impl}] {lt.shape}, B={report.batch}")
        say(f"  Op Time: {lt.op_ms:.3f} ms")
        say(f"  Layer Time: {lt.layer_ms:.3f} ms")
    if report.network_op_ms is not None:
        say(f"Whole network [{report.path}], B={report.batch}")
        say(f"  Op Time: {report.network_op_ms:.3f} ms")
        say(f"  Layer Time: {report.network_layer_ms:.3f} ms")
    if report.images_per_s is not None:
        say(f"Throughput: {report.images_per_s:,.0f} images/s")
    say(f"Test Accuracy: {report.accuracy:.4f}")


def main(*, model: str, batch: int, impl: str | None, device: str, weights: Path | None,
         data_dir: Path | None, per_layer: bool, mode: str, throughput: int | None,
         self_test: bool, json_out: Path | None) -> None:
    spec = models.spec(model)
    try:
        network_mode = precision.network_mode(mode)
    except ValueError as err:
        raise ConvolabError(f"--{err}") from None
    if throughput is not None and throughput <= 0:
        raise ConvolabError(f"--throughput must be a positive number of images, got {throughput}")
    fused = (device == "gpu" and model == "ece408" and impl is None and not per_layer)
    chosen = None if fused else choose_impl(impl, device)  # cheap checks before any loading
    network = models.load(model, weights)
    x, labels = data.load_images("test", n=batch, size=spec.input_size, data_dir=data_dir)
    report = Report(model=model, device=device, batch=batch, path="")
    if device == "gpu":
        report.gpu = gpu_name()
        network.to("gpu")
    if chosen is None:
        report.path = f"fused network ({mode})"
        run_fused(network, network_mode, x, labels, report)
    else:
        if self_test:
            run_self_test(chosen)
        report.path = f"per layer ({chosen.name})"
        run_per_layer(network, chosen, device, x, labels, report)
    if throughput is not None:
        run_throughput(network, device, throughput, x, labels,
                       network_mode, report)
    print_report(report)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(asdict(report), indent=2))
