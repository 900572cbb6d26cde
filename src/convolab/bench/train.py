"""`convolab bench --train`: training-step throughput (images/s) of convolab's two GPU
training engines against PyTorch eager and torch.compile on the same network, in the same run.

Rows per batch size:
  * the fused engine (gpu/trainer.py: kernels 31-38) in each precision mode, timed as it
    trains: an epoch's steps captured in one CUDA graph over resident raw bytes, CUDA events
    around each replay; with `stages`, each launch group of its step timed alone (where a step
    goes);
  * the framework engine (`train --engine framework`: the layers with CuPy arrays, the conv
    backward by each of gpu/backward.py's METHODS), one step per sample on a resident resized
    batch, its loss read back every step as `convolab train` does; with `stages`, its phases
    (forward, loss, backward, optimizer) by events between them;
  * PyTorch: torch.nn with Adam on a resident, already resized float batch (the usual way to
    feed it), fp32 with TF32 off and cuDNN autotuning on, timed with CUDA events over
    STEPS_PER_SAMPLE back-to-back steps. torch is optional: without it the rows say so.
Random images and labels: throughput does not depend on the values.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convolab import models, outputs
from convolab.bench.torch_network import events_ms
from convolab.errors import ConvolabError
from convolab.gpu.trainer import MODEL, RECIPE, Recipe, Trainer
from convolab.precision import TRAIN_MODES

BATCHES = (256, 4096)
ENGINES = ("fused", "framework")
IMAGES = 60_000  # one epoch of the training set
STEPS_PER_SAMPLE = 20  # PyTorch steps per timed sample


def _row(name: str, batch: int, step_ms: list[float]) -> dict[str, Any]:
    med = float(np.median(step_ms))
    return {"name": name, "batch": batch, "median_step_ms": med,
            "p10_step_ms": float(np.percentile(step_ms, 10)),
            "p90_step_ms": float(np.percentile(step_ms, 90)),
            "images_per_s": batch / med * 1e3, "samples": len(step_ms)}


def check_choices(modes: Sequence[str], engines: Sequence[str]) -> None:
    """One clear error for an unknown mode or engine (before any GPU work)."""
    for mode in modes:
        if mode not in TRAIN_MODES:
            raise ConvolabError(f"--train: mode must be one of {', '.join(TRAIN_MODES)}, "
                                f"not {mode!r}")
    for engine in engines:
        if engine not in ENGINES:
            raise ConvolabError(f"--train: engine must be one of {', '.join(ENGINES)}, "
                                f"not {engine!r}")
    if not engines:
        raise ConvolabError("--train: no engine to time")


@functools.cache
def _fashion_mnist() -> tuple[np.ndarray, np.ndarray] | None:
    from convolab import data
    from convolab.errors import DataError

    try:
        return data.load_split("train")
    except DataError:
        return None


def training_set(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    """The Fashion-MNIST training split when it is here, else random bytes and labels. The
    fused backward's cost follows the pool windows the ReLU kills (kernels 34, 35 skip them),
    so real images time the step as it trains; random ones still time it, a little apart."""
    real = _fashion_mnist()
    if real is not None:
        return real[0], real[1], "fashion-mnist"
    raw = rng.integers(0, 256, size=(IMAGES, 28, 28), dtype=np.uint8)
    return raw, rng.integers(0, 10, size=IMAGES).astype(np.uint8), "random"


def convolab_row(batch: int, reps: int, rng: np.random.Generator,
                 mode: str = "exact") -> dict[str, Any]:
    """The fused step: one epoch graph per sample, its time divided by its steps. Every sample
    starts from the same initial weights (the first epoch of training, in every mode alike)."""
    import cupy as cp

    raw, labels, source = training_set(rng)
    recipe = Recipe(**{**RECIPE.as_dict(), "batch": batch, "epochs": 1})
    trainer = Trainer(raw, labels, recipe, seed=0, mode=mode)
    init = trainer.state_dict()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for i in range(reps + 2):  # the first two: capture and warm-up
        trainer.load_params(init)
        start.record(trainer.stream)
        trainer.run_epoch()
        end.record(trainer.stream)
        end.synchronize()
        if i >= 2:
            samples.append(cp.cuda.get_elapsed_time(start, end) / trainer.steps)
    return {**_row(f"convolab fused {mode} (CUDA graph)", batch, samples), "engine": "fused",
            "mode": mode, "data": source}


def stage_rows(batch: int, reps: int, rng: np.random.Generator,
               mode: str = "exact") -> list[dict[str, Any]]:
    """Where the fused step goes: each launch group alone, STEPS_PER_SAMPLE launches captured
    in a CUDA graph (so no launch overhead; the groups add up to the step), on one batch at
    the initial weights; median of `reps` replays."""
    import cupy as cp

    raw, labels, _ = training_set(rng)
    trainer = Trainer(raw, labels, Recipe(**{**RECIPE.as_dict(), "batch": batch}), seed=0,
                      mode=mode)
    rows = []
    stream = trainer.stream
    with stream:
        index = cp.asarray(rng.permutation(len(raw))[:batch], dtype=cp.int64)
        trainer.launch_step(index, 0, "grad")
        start, end = cp.cuda.Event(), cp.cuda.Event()
        for name, launch in trainer.stages(index).items():
            stream.begin_capture()
            try:
                for _ in range(STEPS_PER_SAMPLE):
                    launch()
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            samples = []
            for _ in range(reps):
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                samples.append(cp.cuda.get_elapsed_time(start, end) / STEPS_PER_SAMPLE)
            rows.append({**_row(f"  {mode}: {name}", batch, samples), "engine": "fused",
                         "mode": mode, "stage": name})
    return rows


def framework_rows(batch: int, reps: int, rng: np.random.Generator, method: str,
                   stages: bool) -> list[dict[str, Any]]:
    """The framework engine's step (train.py's inner loop: logits, loss read back, backward,
    Adam) with the conv backward by `method`; with `stages`, its phases timed by events
    between them (the loss read-back synchronises, so "loss" includes waiting for the
    forward)."""
    import cupy as cp

    from convolab.layers import Conv2d
    from convolab.network import CrossEntropyLoss
    from convolab.optim import Adam
    from convolab.timing import time_gpu

    size = models.spec(MODEL).input_size
    x = cp.asarray(rng.uniform(0, 1, (batch, 1, size, size)).astype(np.float32))
    y = cp.asarray(rng.integers(0, 10, batch))
    net = models.build(MODEL, seed=0).to("gpu").train()
    for layer in net.layers:
        if isinstance(layer, Conv2d):
            layer.backward_method = method
    opt, loss_fn = Adam(net, lr=1e-3), CrossEntropyLoss()

    def step() -> None:
        loss, grad = loss_fn(net.logits(x), y)
        net.backward(grad)
        opt.step()

    name = f"convolab framework ({method} backward)"
    rows = [{**_row(name, batch, time_gpu(step, reps=reps, warmup=3)), "engine": "framework",
             "method": method}]
    if not stages:
        return rows
    samples: dict[str, list[float]] = {k: [] for k in ("forward", "loss", "backward", "optimizer")}
    for _ in range(reps):
        events = [cp.cuda.Event() for _ in range(5)]
        events[0].record()
        logits = net.logits(x)
        events[1].record()
        _, grad = loss_fn(logits, y)
        events[2].record()
        net.backward(grad)
        events[3].record()
        opt.step()
        events[4].record()
        events[4].synchronize()
        for i, phase in enumerate(samples):
            samples[phase].append(cp.cuda.get_elapsed_time(events[i], events[i + 1]))
    rows += [{**_row(f"  {method}: {phase}", batch, v), "engine": "framework", "method": method,
              "stage": phase} for phase, v in samples.items()]
    return rows


def _torch_model(torch: Any) -> Any:
    nn = torch.nn
    c1, c2 = models.conv_blocks(MODEL, 1)
    shapes = models.param_shapes(MODEL)
    return nn.Sequential(
        nn.Conv2d(c1.shape.C, c1.shape.M, c1.shape.K), nn.ReLU(), nn.MaxPool2d(c1.pool),
        nn.Conv2d(c2.shape.C, c2.shape.M, c2.shape.K), nn.ReLU(), nn.MaxPool2d(c2.pool),
        nn.Flatten(), nn.Linear(shapes["f5.weight"][1], shapes["f5.weight"][0]), nn.ReLU(),
        nn.Linear(shapes["f6.weight"][1], shapes["f6.weight"][0]))


def _torch_step(torch: Any, compiled: bool, batch: int) -> Callable[[], None]:
    dev = torch.device("cuda")
    model = _torch_model(torch).to(dev)
    size = models.spec(MODEL).input_size
    x = torch.rand(batch, 1, size, size, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    net = torch.compile(model) if compiled else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    return step


def torch_row(name: str, compiled: bool, batch: int, reps: int) -> dict[str, Any]:
    try:
        import torch

        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        step = _torch_step(torch, compiled, batch)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        samples = [events_ms(torch, step, STEPS_PER_SAMPLE) for _ in range(reps)]
        return _row(name, batch, samples)
    except Exception as err:  # noqa: BLE001 - torch is optional; one failing row must not sink the run
        return {"name": name, "batch": batch, "error": f"{type(err).__name__}: {err}"[:400]}


def _free_gpu_memory() -> None:
    """The framework step's workspaces (GBs at batch 4096) go back before the next row."""
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()


def print_table(report: dict[str, Any]) -> None:
    rows = report["rows"]
    print(f"training step, {MODEL}, {report['device']} (median of {report['reps']} samples)")
    for row in rows:
        if "error" in row:
            print(f"  B={row['batch']:<5} {row['name']:<34} {row['error']}")
            continue
        ref = next((r for r in rows if r["batch"] == row["batch"] and "eager" in r["name"]
                    and "error" not in r), None)
        whole = "stage" not in row  # not one launch group or phase alone
        ratio = (f"  {row['images_per_s'] / ref['images_per_s']:.2f}x eager" if ref and whole
                 else "")
        print(f"  B={row['batch']:<5} {row['name']:<34} {row['median_step_ms']:8.3f} ms "
              f"{row['images_per_s']:>12,.0f} img/s{ratio}")


def main(batches: Sequence[int] = BATCHES, reps: int = 20, out: Path | None = None,
         torch: bool = True, stages: bool = True, modes: Sequence[str] = tuple(TRAIN_MODES),
         engines: Sequence[str] = ENGINES) -> dict[str, Any]:
    """Every row at every batch size (the fused engine in each of `modes`, the framework
    engine with each backward method); a table on stdout, train.json in `out` if given."""
    from convolab.gpu.backward import METHODS
    from convolab.gpu.device import gpu_name

    check_choices(modes, engines)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for batch in batches:
        for mode in modes if "fused" in engines else ():
            rows.append(convolab_row(batch, reps, rng, mode))
            if stages:
                rows.extend(stage_rows(batch, reps, rng, mode))
        for method in METHODS if "framework" in engines else ():
            rows.extend(framework_rows(batch, reps, rng, method, stages))
            _free_gpu_memory()
        if torch:
            rows.append(torch_row("torch eager fp32", False, batch, reps))
            rows.append(torch_row("torch.compile fp32", True, batch, reps))
    report = {"what": "training-step throughput", "model": MODEL, "device": gpu_name(),
              "date": dt.date.today().isoformat(), "reps": reps, "modes": list(modes),
              "engines": list(engines), "rows": rows}
    print_table(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        outputs.write_json(out / "train.json", report)
    return report
