"""`convolab verify`: every implementation usable here against the fp64 reference.

Cases: the course's self-tests (docs/spec.md, Correctness) and the ece408 conv layers at a
small batch.
Each case draws fresh random inputs, poisons the output with NaN before the checked run (so
an element an implementation forgets to write fails), and compares the relative L2 error
with the tolerance the implementation promises.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab import models, registry
from convolab.backend import gpu_available, to_device, xp_of
from convolab.check import poison, rel_l2
from convolab.conv_cpu import conv_reference
from convolab.errors import ConvolabError
from convolab.registry import ConvImpl
from convolab.shapes import COURSE_SELF_TESTS, ConvShape

# The ece408 model's conv layers, at a batch small enough for the slowest implementation
# (cpu-loops) to finish in moments.
ECE408_VERIFY_BATCH = 4
ECE408_LAYERS: tuple[tuple[str, ConvShape], ...] = tuple(
    (f"ece408-{block.name}", block.shape)
    for block in models.conv_blocks("ece408", ECE408_VERIFY_BATCH)
)


def verify_cases() -> list[tuple[str, ConvShape]]:
    course = [(f"course-{i + 1}", s) for i, s in enumerate(COURSE_SELF_TESTS)]
    return course + list(ECE408_LAYERS)


@dataclass(frozen=True)
class Inputs:
    x: np.ndarray
    w: np.ndarray
    b: np.ndarray
    ref: np.ndarray  # float64 conv output (no pooling)


def random_inputs(shape: ConvShape, rng: np.random.Generator) -> Inputs:
    """Uniform [-1, 1] input, weights and bias, with the fp64 reference output."""
    x = rng.uniform(-1.0, 1.0, shape.x_shape).astype(np.float32)
    w = rng.uniform(-1.0, 1.0, shape.w_shape).astype(np.float32)
    b = rng.uniform(-1.0, 1.0, (shape.M,)).astype(np.float32)
    return Inputs(x, w, b, conv_reference(x, w, b, shape.S))


def expected_output(impl: ConvImpl, ref: np.ndarray) -> np.ndarray:
    """The reference for what `impl` computes: the conv, or maxpool(relu(conv)) for the
    fused rungs (pool window = pool stride, floor)."""
    P = impl.pool
    if not P:
        return ref
    B, M, H, W = ref.shape
    Hp, Wp = H // P, W // P
    cropped = np.maximum(ref[:, :, : Hp * P, : Wp * P], 0.0)
    return cropped.reshape(B, M, Hp, P, Wp, P).max(axis=(3, 5))


def supported(impl: ConvImpl, shape: ConvShape) -> bool:
    if impl.pool and (shape.H_out < impl.pool or shape.W_out < impl.pool):
        return False
    return bool(impl.supports(shape))


def _synchronize(xp: Any) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def run_checked(impl: ConvImpl, shape: ConvShape, inputs: Inputs) -> tuple[float, float]:
    """(rel L2 error, milliseconds of the checked run) for one implementation on one case.

    One unchecked run first absorbs JIT/NVRTC compilation, so the time shown is the kernel's.
    """
    x = to_device(inputs.x, impl.device)
    w = to_device(inputs.w, impl.device)
    b = to_device(inputs.b, impl.device)
    registry.check_inputs(impl, shape, x, w, b)
    xp = xp_of(x)
    run = impl.prepare(shape, w, b, impl.params_for(None))
    y = xp.empty(impl.out_shape(shape), dtype=np.float32)
    run(x, y)
    poison(y)
    _synchronize(xp)
    t0 = time.perf_counter()
    run(x, y)
    _synchronize(xp)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    return rel_l2(y, expected_output(impl, inputs.ref)), elapsed_ms


def check_impl(impl: ConvImpl, shape: ConvShape, rng: np.random.Generator) -> float:
    """Relative L2 error of `impl` on fresh random inputs of `shape` (output poisoned first).

    Raises ValueError if the implementation does not support the shape.
    """
    if not supported(impl, shape):
        raise ValueError(f"implementation {impl.name!r} does not support shape {shape}")
    return run_checked(impl, shape, random_inputs(shape, rng))[0]


def _named_impls(device: str | None, names: Sequence[str], have_gpu: bool) -> list[ConvImpl]:
    """The named implementations, in order, once each: all must exist, be for `device`
    (when given) and be usable on this machine."""
    known = {i.name: i for i in registry.all_impls()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConvolabError(
            f"unknown implementation(s): {', '.join(unknown)}; known: {', '.join(known)}"
        )
    chosen = [known[n] for n in dict.fromkeys(names)]
    wrong_device = [i.name for i in chosen if device is not None and i.device != device]
    if wrong_device:
        raise ConvolabError(f"not {device} implementation(s): {', '.join(wrong_device)}")
    need_gpu = [i.name for i in chosen if i.device == "gpu" and not have_gpu]
    if need_gpu:
        raise ConvolabError(f"{', '.join(need_gpu)} need(s) a CUDA GPU, and none is usable here")
    return chosen


def select_impls(device: str | None, names: Sequence[str] | None) -> list[ConvImpl]:
    """The implementations to verify: named ones (all must exist and be usable here), else
    every contender for `device` (None: both) that this machine can run."""
    if device not in (None, "cpu", "gpu"):
        raise ValueError(f"device must be 'cpu', 'gpu' or None, not {device!r}")
    have_gpu = gpu_available()
    if device == "gpu" and not have_gpu:
        raise ConvolabError("--device gpu: no CUDA GPU is usable here (CuPy missing or no device)")
    if names:
        return _named_impls(device, names, have_gpu)
    return [
        i
        for i in registry.all_impls(device, include_reference=False)
        if i.device == "cpu" or have_gpu
    ]


@dataclass(frozen=True)
class Result:
    impl: str
    case: str
    shape: ConvShape
    status: str  # PASS, FAIL, UNSUPPORTED, ERROR
    error: float | None
    tolerance: float
    time_ms: float | None
    message: str = ""


def verify(
    impls: Sequence[ConvImpl], rng: np.random.Generator | None = None
) -> list[Result]:
    """Every implementation on every case; inputs drawn once per case and shared."""
    rng = rng if rng is not None else np.random.default_rng()
    results: list[Result] = []
    for case, shape in verify_cases():
        inputs = random_inputs(shape, rng)
        for impl in impls:
            if not supported(impl, shape):
                results.append(
                    Result(impl.name, case, shape, "UNSUPPORTED", None, impl.tolerance, None)
                )
                continue
            try:
                err, ms = run_checked(impl, shape, inputs)
            except Exception as exc:  # one broken rung must not hide the others' results
                results.append(
                    Result(impl.name, case, shape, "ERROR", None, impl.tolerance, None,
                           f"{type(exc).__name__}: {exc}")
                )
                continue
            # NaN compares False, so `err <= tol` also rejects it; rel_l2 maps NaN to inf anyway.
            status = "PASS" if err <= impl.tolerance else "FAIL"
            results.append(Result(impl.name, case, shape, status, err, impl.tolerance, ms))
    return results


def compact(s: ConvShape) -> str:
    return f"{s.B}x{s.C}x{s.H}x{s.W} M{s.M} K{s.K} S{s.S}"


_STYLE = {"PASS": "green", "FAIL": "bold red", "ERROR": "bold red", "UNSUPPORTED": "yellow"}


def _row(r: Result) -> tuple[str, ...]:
    from rich.markup import escape

    error = "" if r.error is None else f"{r.error:.2e}"
    status = f"[{_STYLE[r.status]}]{r.status}[/]"
    if r.message:
        status += f" {escape(r.message)}"
    ms = "" if r.time_ms is None else f"{r.time_ms:.2f}"
    return (r.impl, r.case, compact(r.shape), error, f"{r.tolerance:.0e}", status, ms)


def skipped_gpu(device: str | None, names: Sequence[str] | None) -> int:
    """How many GPU implementations `select_impls` left out because no GPU is usable here."""
    if names or device == "cpu" or gpu_available():
        return 0
    return sum(i.device == "gpu" for i in registry.all_impls("gpu", include_reference=False))


def print_results(results: Sequence[Result], skipped: int = 0) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="convolab verify: rel L2 error vs fp64 cpu-ref (output NaN-poisoned)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col, justify in (("impl", "left"), ("case", "left"), ("shape", "left"),
                         ("error", "right"), ("tol", "right"), ("result", "left"),
                         ("ms", "right")):
        # Only the shape may wrap, so narrow terminals never truncate verdicts or numbers.
        table.add_column(col, justify=justify, no_wrap=col != "shape")  # type: ignore[arg-type]
    order = {name: i for i, name in enumerate(dict.fromkeys(r.impl for r in results))}
    for r in sorted(results, key=lambda r: order[r.impl]):
        table.add_row(*_row(r))
    console = Console()
    console.print(table)
    console.print(summary(results, skipped))


def summary(results: Sequence[Result], skipped: int = 0) -> str:
    """The verdict line: checks run, and what was not checked and why."""
    bad = [r for r in results if r.status in ("FAIL", "ERROR")]
    checked = sum(r.status != "UNSUPPORTED" for r in results)
    unsupported = len(results) - checked
    line = (f"[bold red]{len(bad)} of {checked} checks FAILED[/]" if bad
            else f"[green]all {checked} checks PASSED[/]")
    if unsupported:
        line += f"; {unsupported} case(s) UNSUPPORTED by their implementation, not run"
    if skipped:
        line += f"; {skipped} GPU implementations skipped: no CUDA GPU usable here"
    return line


def main(device: str | None = None, names: list[str] | None = None) -> bool:
    """Verify the selected implementations, print the table; True iff every check passed."""
    impls = select_impls(device, names)
    if not impls:
        raise ConvolabError("no implementation to verify here")
    results = verify(impls)
    print_results(results, skipped_gpu(device, names))
    return all(r.status in ("PASS", "UNSUPPORTED") for r in results)
