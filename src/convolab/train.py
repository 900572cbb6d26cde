"""`convolab train`: mini-batch training of a zoo model with convolab's own forward and backward.

Deterministic on the CPU for a given seed: the shuffle comes from a seeded generator and every
operation is a fixed sequence of NumPy/BLAS calls on the same shapes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from convolab import __version__, data, models, outputs, weights
from convolab.backend import to_device, to_numpy
from convolab.errors import ConvolabError
from convolab.network import CrossEntropyLoss, Network
from convolab.optim import SGD, Adam, Optimizer, cosine_lr

console = Console()

# A mini-batch's activations and gradients take about 1.5 MB per image on the CPU (ece408);
# this keeps one step within a few GB, far below where MemoryError would end the run.
MAX_BATCH = 4096
TRAIN_IMAGES = 60_000
ENGINES = ("fused", "framework")
# The framework engine's defaults (the CPU's): the fused engine's come from its recipe
# (gpu/trainer.py RECIPE, chosen on a validation split: docs/training.md).
FRAMEWORK_DEFAULTS = {"epochs": 3, "batch": 64, "lr": 1e-3}
SPEEDRUN_TARGET = 0.91
SPEEDRUN_FLOOR = 0.905  # what every seed of a multi-seed speedrun must reach (the bar)


def sidecar_path(out: Path) -> Path:
    """The JSON record written beside the weights."""
    return out.with_suffix(".json")


def check_options(epochs: int, batch: int, lr: float, optimizer: str, seed: int,
                  limit: int | None) -> None:
    """Every hyper-parameter, before any loading: one ConvolabError naming the option."""
    if epochs <= 0:
        raise ConvolabError(f"--epochs must be positive, got {epochs}")
    if not 1 <= batch <= MAX_BATCH:
        raise ConvolabError(f"--batch must be between 1 and {MAX_BATCH} (the limit keeps a "
                            f"training step's memory bounded), got {batch}")
    if not (math.isfinite(lr) and lr > 0):
        raise ConvolabError(f"--lr must be a positive finite number, got {lr}")
    if optimizer not in ("adam", "sgd"):
        raise ConvolabError(f"--optimizer must be 'adam' or 'sgd', not {optimizer!r}")
    if seed < 0:
        raise ConvolabError(f"--seed must be 0 or more, got {seed}")
    if limit is not None and not 1 <= limit <= TRAIN_IMAGES:
        raise ConvolabError(f"--limit must be between 1 and {TRAIN_IMAGES}, got {limit}")


def plan_files(out: Path | str, force: bool = False) -> tuple[Path, Path]:
    """(weights, sidecar) checked before training: usable paths, not one file, not the shipped
    weights, and no unrelated file replaced by the sidecar (unless `force`)."""
    out = outputs.check_file(out, "--out", force=force)
    if out.suffix == ".json":
        raise ConvolabError(f"--out {out}: the JSON sidecar goes beside the weights as "
                            f"{sidecar_path(out).name}; name a .safetensors file")
    files = outputs.plan_outputs({"--out": out, "sidecar": sidecar_path(out)}, force=force)
    sidecar = files["sidecar"]
    if sidecar.exists() and not force and not outputs.is_train_sidecar(sidecar):
        raise ConvolabError(f"--out {out}: the sidecar {sidecar} would replace an existing file "
                            "that convolab train did not write; pass --force to replace it")
    return files["--out"], sidecar


def command_line(model: str, epochs: int, batch: int, lr: float, optimizer: str, seed: int,
                 device: str, limit: int | None, out: Path, engine: str = "framework") -> str:
    """The canonical command that reproduces a run (written into the sidecar)."""
    parts = [f"convolab train --model {model} --epochs {epochs} --batch {batch} --lr {lr:g}",
             f"--optimizer {optimizer} --seed {seed} --device {device}"]
    if device == "gpu":
        parts.append(f"--engine {engine}")
    if limit is not None:
        parts.append(f"--limit {limit}")
    parts.append(f"--out {out}")
    return " ".join(parts)


def default_out(model: str) -> Path:
    """Where `convolab train` writes when no --out is given: the current folder."""
    return Path(f"{model}.safetensors")


def evaluate(network: Network, x: np.ndarray, y: np.ndarray, device: str,
             batch: int = 500) -> float:
    """Test accuracy over all of x (eval mode), moving `batch` images at a time to the device."""
    correct = 0
    for i in range(0, len(x), batch):
        pred = network.predict(to_device(x[i:i + batch], device), batch=batch)
        correct += int((pred == y[i:i + batch]).sum())
    return correct / len(x)


def make_optimizer(name: str, network: Network, lr: float) -> Optimizer:
    if name == "adam":
        return Adam(network, lr=lr)
    if name == "sgd":
        return SGD(network, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}: use 'adam' or 'sgd'")


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.4f} acc {task.fields[acc]:.4f}"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console,
    )


@dataclass
class _Loop:
    """What every training step shares: the network, its optimiser and loss, the training
    set (on the device, and its labels on the host) and the cosine schedule's length."""

    network: Network
    opt: Optimizer
    loss_fn: CrossEntropyLoss
    x: Any
    y: Any
    y_host: np.ndarray
    device: str
    batch: int
    lr: float
    total_steps: int
    log_every: int


def _train_epoch(loop: _Loop, epoch: int, epochs: int, order: np.ndarray, step: int,
                 quiet: bool) -> tuple[float, float, int]:
    """One pass over the training set in `order`: (mean loss, accuracy, steps done so far)."""
    n, batch = len(order), loop.batch
    steps_per_epoch = math.ceil(n / batch)
    started = time.perf_counter()
    loss_sum = correct = seen = 0.0
    with _progress() as bar:
        task = bar.add_task(f"epoch {epoch}/{epochs}", total=steps_per_epoch, loss=0.0,
                            acc=0.0, visible=not quiet)
        for first in range(0, n, batch):
            idx = order[first:first + batch]
            idx_dev = to_device(idx, loop.device)
            xb, yb = loop.x[idx_dev], loop.y[idx_dev]
            loop.opt.lr = cosine_lr(loop.lr, step, loop.total_steps)
            logits = loop.network.logits(xb)
            loss, grad = loop.loss_fn(logits, yb)
            if not math.isfinite(float(loss)):
                raise ConvolabError(
                    f"training diverged: the loss became {float(loss)} at epoch {epoch}, step "
                    f"{step + 1 - (epoch - 1) * steps_per_epoch}; nothing was written (try a "
                    f"smaller --lr than {loop.lr:g})")
            loop.network.backward(grad)
            loop.opt.step()
            step += 1
            loss_sum += loss * len(idx)
            correct += int((to_numpy(logits.argmax(axis=1)) == loop.y_host[idx]).sum())
            seen += len(idx)
            bar.update(task, advance=1, loss=loss_sum / seen, acc=correct / seen)
            if loop.log_every and step % loop.log_every == 0:
                print(f"epoch {epoch} step {step - (epoch - 1) * steps_per_epoch}/"
                      f"{steps_per_epoch}: loss {loss_sum / seen:.4f} acc {correct / seen:.4f} "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
    return loss_sum / seen, correct / seen, step


def _write_results(network: Network, out: Path, sidecar: Path, result: dict[str, Any],
                   command: str) -> None:
    """The weights, then the JSON sidecar beside them (each written atomically)."""
    weights.save(network.to("cpu"), out, {"test_accuracy": f"{result['test_accuracy']:.4f}",
                                          "command": command})
    outputs.write_json(sidecar, result)


def pick_engine(engine: str | None, device: str, model: str) -> str:
    """'fused' for ece408 on the GPU unless asked otherwise; 'framework' everywhere else."""
    from convolab.gpu.trainer import MODEL

    if engine is None:
        return "fused" if device == "gpu" and model == MODEL else "framework"
    if engine not in ENGINES:
        raise ConvolabError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "fused" and (device != "gpu" or model != MODEL):
        raise ConvolabError(f"--engine fused trains {MODEL} on the GPU only (--device gpu); "
                            "use --engine framework")
    return engine


def resolve_options(engine: str, epochs: int | None, batch: int | None, lr: float | None,
                    ) -> tuple[int, int, float]:
    """The options left unset take the engine's defaults."""
    if engine == "fused":
        from convolab.gpu.trainer import RECIPE
        defaults = {"epochs": RECIPE.epochs, "batch": RECIPE.batch, "lr": RECIPE.lr}
    else:
        defaults = FRAMEWORK_DEFAULTS
    return (defaults["epochs"] if epochs is None else epochs,
            defaults["batch"] if batch is None else batch,
            defaults["lr"] if lr is None else lr)


def check_recipe_options(engine: str, smoothing: float | None, mirror: bool | None,
                         mode: str | None = None) -> None:
    """Label smoothing, mirroring and the precision mode exist in the fused engine only."""
    from convolab.precision import train_mode

    if engine != "fused" and (smoothing is not None or mirror is not None or mode is not None):
        raise ConvolabError("--smoothing/--mirror/--mode are options of the fused engine "
                            "(ece408 on the GPU); the framework engine has none of them")
    if smoothing is not None and not (math.isfinite(smoothing) and 0.0 <= smoothing < 1.0):
        raise ConvolabError(f"--smoothing must be in [0, 1), got {smoothing}")
    if mode is not None:
        try:
            train_mode(mode)
        except ValueError as err:
            raise ConvolabError(f"--{err}") from None


def check_speedrun_options(engine: str, speedrun: bool, seeds: int, json_out: Path | None,
                           out: Path | str | None) -> Path | None:
    """--seeds and --json belong to --speedrun; several seeds measure and write no weights.
    Returns the checked --json path."""
    if speedrun and engine != "fused":
        raise ConvolabError("--speedrun needs the fused engine (--device gpu, model ece408)")
    if (seeds != 1 or json_out is not None) and not speedrun:
        raise ConvolabError("--seeds and --json report a speedrun: add --speedrun")
    if seeds < 1:
        raise ConvolabError(f"--seeds must be 1 or more, got {seeds}")
    if seeds > 1 and out is not None:
        raise ConvolabError("--seeds N measures N runs and writes no weights: --out does not "
                            "apply (the runs go to --json)")
    return outputs.check_file(json_out, "--json") if json_out is not None else None


def speedrun_summary(accuracy: Sequence[float], seconds: Sequence[float]) -> dict[str, Any]:
    """Mean, min and max of the runs' test accuracy and time, and how many reached the target
    (SPEEDRUN_TARGET) and the floor every seed must clear (SPEEDRUN_FLOOR)."""
    acc, sec = np.asarray(accuracy, np.float64), np.asarray(seconds, np.float64)
    if acc.size == 0 or acc.shape != sec.shape:
        raise ValueError("speedrun_summary needs one time per accuracy, at least one run")
    return {"runs": int(acc.size), "accuracy_mean": float(acc.mean()),
            "accuracy_min": float(acc.min()), "accuracy_max": float(acc.max()),
            "seconds_mean": float(sec.mean()), "seconds_min": float(sec.min()),
            "seconds_max": float(sec.max()), "reached": int((acc >= SPEEDRUN_TARGET).sum()),
            "above_floor": int((acc >= SPEEDRUN_FLOOR).sum())}


def summary_line(summary: dict[str, Any]) -> str:
    s = summary
    return (f"test accuracy mean {s['accuracy_mean']:.4f} (min {s['accuracy_min']:.4f}, max "
            f"{s['accuracy_max']:.4f}; {s['reached']}/{s['runs']} >= {SPEEDRUN_TARGET}, "
            f"{s['above_floor']}/{s['runs']} >= {SPEEDRUN_FLOOR}), seconds mean "
            f"{s['seconds_mean']:.2f} (min {s['seconds_min']:.2f}, max {s['seconds_max']:.2f})")


def main(model: str = "ece408", epochs: int | None = None, batch: int | None = None,
         lr: float | None = None, optimizer: str = "adam", seed: int = 0, device: str = "cpu",
         limit: int | None = None, out: Path | str | None = None,
         data_dir: Path | str | None = None, quiet: bool = False,
         test_limit: int | None = None, force: bool = False, engine: str | None = None,
         speedrun: bool = False, smoothing: float | None = None,
         mirror: bool | None = None, mode: str | None = None, seeds: int = 1,
         json_out: Path | None = None) -> dict[str, Any]:
    """Train, evaluate on the 10k test images after each epoch, write weights + JSON sidecar.

    `out` defaults to ./<model>.safetensors; the shipped weights are replaced only with
    `force`. `test_limit` evaluates on the first N test images only (fast tests); `quiet`
    prints nothing. Options and output paths are checked before anything is loaded. On the
    GPU, ece408 trains through the fused kernels (`engine` 'fused', gpu/trainer.py) unless
    `engine` is 'framework'; `speedrun` (fused only) evaluates the test set once, at the end,
    and reports the time to SPEEDRUN_TARGET; with `seeds` > 1 it trains seeds seed, seed + 1,
    ... and reports their mean, min and max (`speedrun_runs`), writing no weights. `mode`
    (fused only, precision.TRAIN_MODES) picks the conv forwards' arithmetic."""
    models.spec(model)
    engine = pick_engine(engine, device, model)
    epochs, batch, lr = resolve_options(engine, epochs, batch, lr)
    check_options(epochs, batch, lr, optimizer, seed, limit)
    check_recipe_options(engine, smoothing, mirror, mode)
    json_out = check_speedrun_options(engine, speedrun, seeds, json_out,
                                      out if seeds > 1 else None)
    if engine == "fused":
        recipe = fused_recipe(epochs, batch, lr, optimizer, smoothing, mirror)
        if seeds > 1:
            return speedrun_runs(recipe, seed, seeds, mode or "exact", limit, data_dir,
                                 test_limit, quiet, json_out)
    out, sidecar = plan_files(out if out is not None else default_out(model), force)
    command = command_line(model, epochs, batch, lr, optimizer, seed, device, limit, out, engine)
    if engine == "fused":
        command += recipe_flags(recipe, mode)
        result, state = _main_fused(model, recipe, seed, limit, data_dir, test_limit, quiet,
                                    speedrun, mode or "exact")
        result.update({"command": command, "device": device, "engine": engine})
        if json_out is not None:
            outputs.write_json(json_out, _speedrun_report([result], recipe, mode or "exact"))
        network = models.build(model, seed)
        for name, value in state.items():
            network.set_param(name, value)
        return _finish(network, out, sidecar, result, command, quiet)

    network, result = _main_framework(model, epochs, batch, lr, optimizer, seed, device, limit,
                                      data_dir, test_limit, quiet)
    result.update({"command": command, "engine": engine})
    return _finish(network, out, sidecar, result, command, quiet)


def _main_framework(model: str, epochs: int, batch: int, lr: float, optimizer: str, seed: int,
                    device: str, limit: int | None, data_dir: Path | str | None,
                    test_limit: int | None, quiet: bool) -> tuple[Network, dict[str, Any]]:
    """The framework engine (the layers on NumPy or CuPy arrays): (the trained network, the
    sidecar's record without its command)."""
    spec = models.spec(model)
    x_train, y_train = data.load_images("train", n=limit, size=spec.input_size, data_dir=data_dir)
    x_test, y_test = data.load_images("test", n=test_limit, size=spec.input_size,
                                      data_dir=data_dir)
    network = models.build(model, seed).to(device).train()
    rng = np.random.default_rng(seed)
    n = len(x_train)
    steps_per_epoch = math.ceil(n / batch)
    # On the GPU the whole training set is uploaded once and batches are gathered there:
    # a host gather + copy per step would cost as much as the step's kernels.
    loop = _Loop(network, make_optimizer(optimizer, network, lr), CrossEntropyLoss(),
                 to_device(x_train, device), to_device(y_train, device), y_train, device, batch,
                 lr, epochs * steps_per_epoch,
                 # A log file gets no live bar: a line every tenth of an epoch instead.
                 0 if quiet or console.is_terminal else max(1, steps_per_epoch // 10))
    history: list[dict[str, float]] = []
    if not quiet:
        console.print(f"training {model} on {n} images, {epochs} epochs, batch {batch}, "
                      f"{optimizer} lr {lr:g} (cosine), seed {seed}, device {device}")
    step = 0
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        loss, acc, step = _train_epoch(loop, epoch, epochs, rng.permutation(n), step, quiet)
        seconds = time.perf_counter() - started
        test_acc = evaluate(network, x_test, y_test, device)
        network.train()
        history.append({"epoch": epoch, "train_loss": loss, "train_accuracy": acc,
                        "test_accuracy": test_acc, "seconds": seconds})
        if not quiet:
            console.print(f"epoch {epoch}: loss {loss:.4f}, train acc {acc:.4f}, test acc "
                          f"{test_acc:.4f} ({len(x_test)} images), {seconds:.1f} s")
    return network, {
        "model": model, "seed": seed, "epochs": epochs, "batch": batch,
        "lr": lr, "optimizer": optimizer, "schedule": "cosine", "device": device,
        "train_images": n, "test_images": len(x_test),
        "test_accuracy": history[-1]["test_accuracy"], "history": history,
        "date": dt.date.today().isoformat(), "convolab_version": __version__,
        "cpu_threads": os.cpu_count(),
    }


def fused_recipe(epochs: int, batch: int, lr: float, optimizer: str, smoothing: float | None,
                 mirror: bool | None) -> Any:
    """gpu/trainer.py's RECIPE with the options given on the command line."""
    from convolab.gpu.trainer import RECIPE

    recipe = dataclasses.replace(RECIPE, epochs=epochs, batch=batch, lr=lr, optimizer=optimizer)
    if smoothing is not None:
        recipe = dataclasses.replace(recipe, smoothing=float(smoothing))
    if mirror is not None:
        recipe = dataclasses.replace(recipe, mirror=bool(mirror))
    return recipe


def recipe_flags(recipe: Any, mode: str | None) -> str:
    """The fused engine's flags of the canonical command line: smoothing and mirroring always
    (so that the command reproduces the run whatever the defaults become), the mode unless
    exact."""
    return "".join([f" --smoothing {recipe.smoothing:g}",
                    " --mirror" if recipe.mirror else " --no-mirror",
                    f" --mode {mode}" if mode not in (None, "exact") else ""])


def _speedrun_report(runs: list[dict[str, Any]], recipe: Any, mode: str) -> dict[str, Any]:
    from convolab.gpu.device import gpu_name

    return {"what": "speedrun", "device": gpu_name(), "date": dt.date.today().isoformat(),
            "convolab_version": __version__, "mode": mode, "recipe": recipe.as_dict(),
            "target": SPEEDRUN_TARGET, "floor": SPEEDRUN_FLOOR,
            "summary": speedrun_summary([r["test_accuracy"] for r in runs],
                                        [r["speedrun_seconds"] for r in runs]),
            "runs": runs}


def speedrun_runs(recipe: Any, first_seed: int, seeds: int, mode: str, limit: int | None,
                  data_dir: Path | str | None, test_limit: int | None, quiet: bool,
                  json_out: Path | None) -> dict[str, Any]:
    """`seeds` speedruns of one recipe (seeds first_seed, first_seed + 1, ...): each run's line,
    then the summary; the report (runs and summary) to `json_out` if given."""
    from convolab.gpu.trainer import MODEL

    runs = []
    for seed in range(first_seed, first_seed + seeds):
        result, _ = _main_fused(MODEL, recipe, seed, limit, data_dir, test_limit, True,
                                True, mode)
        runs.append(result)
        if not quiet:
            console.print(f"seed {seed}: test accuracy {result['test_accuracy']:.4f} in "
                          f"{result['speedrun_seconds']:.2f} s")
    report = _speedrun_report(runs, recipe, mode)
    if not quiet:
        console.print(f"speedrun, {seeds} seeds ({first_seed}-{first_seed + seeds - 1}), mode "
                      f"{mode}: {summary_line(report['summary'])}")
    if json_out is not None:
        outputs.write_json(json_out, report)
    return report


def _finish(network: Network, out: Path, sidecar: Path, result: dict[str, Any], command: str,
            quiet: bool) -> dict[str, Any]:
    _write_results(network, out, sidecar, result, command)
    if not quiet:
        console.print(f"test accuracy {result['test_accuracy']:.4f}; wrote {out} and {sidecar}")
    return result


def _main_fused(model: str, recipe: Any, seed: int, limit: int | None,
                data_dir: Path | str | None, test_limit: int | None, quiet: bool,
                speedrun: bool, mode: str = "exact"
                ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The fused GPU engine: (the sidecar's record, the trained parameters)."""
    from convolab.gpu.trainer import Trainer

    raw, labels = data.load_split("train", data_dir=data_dir, limit=limit)
    raw_test, labels_test = data.load_split("test", data_dir=data_dir, limit=test_limit)
    trainer = Trainer(raw, labels, recipe, seed, model, mode=mode)
    test = trainer.upload(raw_test, labels_test)
    if not quiet:
        console.print(f"training {model} on {len(raw)} images (fused GPU kernels, mode {mode}, "
                      f"{trainer.steps} steps an epoch), {recipe.epochs} epochs, batch "
                      f"{recipe.batch}, {recipe.optimizer} lr {recipe.lr:g} ({recipe.schedule}, "
                      f"warm-up {recipe.warmup:g}), seed {seed}")
    history: list[dict[str, float]] = []
    train_seconds = 0.0
    for epoch in range(1, recipe.epochs + 1):
        started = time.perf_counter()
        trainer.run_epoch()
        stats = trainer.epoch_stats()
        seconds = time.perf_counter() - started
        train_seconds += seconds
        entry = {"epoch": epoch, "train_loss": stats.loss, "train_accuracy": stats.accuracy,
                 "seconds": seconds}
        if not speedrun or epoch == recipe.epochs:
            started = time.perf_counter()
            entry["test_accuracy"] = trainer.evaluate(*test).accuracy
            entry["eval_seconds"] = time.perf_counter() - started
        history.append(entry)
        if not quiet:
            tested = (f", test acc {entry['test_accuracy']:.4f}" if "test_accuracy" in entry
                      else "")
            console.print(f"epoch {epoch}: loss {stats.loss:.4f}, train acc "
                          f"{stats.accuracy:.4f}{tested}, {seconds:.3f} s")
    final = history[-1]
    result = {
        "model": model, "seed": seed, "epochs": recipe.epochs, "batch": recipe.batch,
        "lr": recipe.lr, "optimizer": recipe.optimizer, "schedule": recipe.schedule,
        "recipe": recipe.as_dict(), "mode": mode, "train_images": len(raw),
        "test_images": len(raw_test),
        "test_accuracy": final["test_accuracy"], "history": history,
        "train_seconds": train_seconds,
        "date": dt.date.today().isoformat(), "convolab_version": __version__,
    }
    if speedrun:
        total = train_seconds + final["eval_seconds"]
        reached = final["test_accuracy"] >= SPEEDRUN_TARGET
        result["speedrun_seconds"] = total
        if not quiet:
            console.print(f"speedrun: test accuracy {final['test_accuracy']:.4f} "
                          f"({'reached' if reached else 'missed'} {SPEEDRUN_TARGET}) after "
                          f"{recipe.epochs} epochs in {total:.2f} s (training "
                          f"{train_seconds:.2f} s + one test evaluation "
                          f"{final['eval_seconds']:.3f} s; data resident on the GPU, kernels "
                          "compiled before the clock starts)")
    return result, trainer.state_dict()
