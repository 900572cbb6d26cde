"""The `convolab` command line. Each command parses and checks its options here and hands the
work to the module that owns it; heavy imports (Numba, CuPy, PyTorch) happen only inside."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from convolab.data import SPLIT_SIZES
from convolab.errors import ConvolabError
from convolab.precision import MODE_ALIASES, TRAIN_MODES

app = typer.Typer(
    name="convolab",
    help="A measured ladder of convolution kernels, running LeNet-5 on Fashion-MNIST.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)

MAX_TEST_IMAGES = SPLIT_SIZES["test"]
BENCH_BATCH, BENCH_REPS = 10_000, 20  # bench's defaults (a plan file sets its own)

ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="zoo model: ece408, ece408-mxnet, eecs498")
]
DeviceOpt = Annotated[
    str, typer.Option("--device", "-d", help="cpu or gpu (default: gpu if usable)")
]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="folder with the four IDX .gz files")
]
JsonOpt = Annotated[
    Path | None, typer.Option("--json", help="also write the results as JSON to this file")
]


def fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def resolve_device(device: str | None) -> str:
    from convolab.backend import gpu_available

    if device is None:
        return "gpu" if gpu_available() else "cpu"
    if device not in ("cpu", "gpu"):
        fail(f"--device must be 'cpu' or 'gpu', not {device!r}")
    if device == "gpu" and not gpu_available():
        fail("--device gpu: no CUDA GPU is usable here (CuPy missing or no device)")
    return device


def check_batch(batch: int, limit: int = MAX_TEST_IMAGES, flag: str = "--batch") -> None:
    if batch <= 0 or batch > limit:
        fail(f"{flag} must be between 1 and {limit}, got {batch}")


def _print_version(value: bool) -> None:
    if value:
        from convolab import __version__

        typer.echo(f"convolab {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True,
                           help="print the version and exit")
    ] = False,
) -> None:
    """A measured ladder of convolution kernels, running LeNet-5 on Fashion-MNIST."""


def images_option(images: int | None, batch: int | None, device: str) -> int:
    """classify's number of test images: --images, or the deprecated --batch spelling."""
    if batch is not None:
        if images is not None:
            fail("--batch is the old spelling of --images: give only --images")
        typer.secho("note: classify --batch is now --images (the number of test images)",
                    err=True)
        images = batch
    n = images if images is not None else (MAX_TEST_IMAGES if device == "gpu" else 1000)
    check_batch(n, flag="--images")
    return n


@app.command()
def classify(
    model: ModelOpt = "ece408",
    images: Annotated[
        int | None, typer.Option("--images", "-n", help="how many test images to classify "
                                 "(the first N; default 10000 on the GPU, 1000 on the CPU)")
    ] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", "-b", hidden=True, help="old name of --images")
    ] = None,
    impl: Annotated[
        str | None, typer.Option("--impl", "-i", help="conv implementation or 'auto'")
    ] = None,
    device: DeviceOpt = None,
    weights: Annotated[
        Path | None, typer.Option("--weights", help="safetensors file, or a PyTorch state_dict "
                                   "(.pt/.pth, needs torch) with the zoo model's tensor names")
    ] = None,
    data_dir: DataDirOpt = None,
    per_layer: Annotated[
        bool, typer.Option("--per-layer",
                           help="time each conv layer with its implementation, not the fused "
                           "network")
    ] = False,
    mode: Annotated[
        str | None,
        typer.Option("--mode", help=f"GPU fused network only: {', '.join(MODE_ALIASES)} "
                     "(tensor-core = fp16; default exact); refused where no fused network runs"),
    ] = None,
    throughput: Annotated[
        int | None,
        typer.Option("--throughput", help="also stream N images (1 to 10,000,000: the test "
                     "images repeated, in chunks) through the same path; images/s and accuracy "
                     "over those N"),
    ] = None,
    no_self_test: Annotated[
        bool, typer.Option("--no-self-test", help="skip the course self-tests")
    ] = False,
    json_out: JsonOpt = None,
    onnx: Annotated[
        Path | None,
        typer.Option("--onnx", help="classify with this ONNX graph (LeNet-class) instead of "
                     "--model/--weights; CPU, or the fused GPU path for an ece408-shaped graph"),
    ] = None,
) -> None:
    """Run the first N test images: per conv layer Op Time and Layer Time, then Test Accuracy
    (default N: 10000 on the GPU, 1000 on the CPU)."""
    from convolab import classify as run

    run.check_throughput(throughput)  # its own message, also where --device gpu has no GPU
    dev = resolve_device(device)
    n = images_option(images, batch, dev)
    if onnx is not None:
        _classify_onnx(onnx, n, dev, data_dir, mode, json_out, impl=impl, weights=weights,
                       per_layer=per_layer, throughput=throughput)
        return
    run.main(
        model=model,
        batch=n,
        impl=impl,
        device=dev,
        weights=weights,
        data_dir=data_dir,
        per_layer=per_layer,
        mode=mode,
        throughput=throughput,
        self_test=not no_self_test,
        json_out=json_out,
    )


def _classify_onnx(path: Path, n: int, device: str, data_dir: Path | None, mode: str | None,
                   json_out: Path | None, **ignored: object) -> None:
    from convolab import onnx_io

    given = [f"--{k.replace('_', '-')}" for k, v in ignored.items() if v not in (None, False)]
    given += [flag for flag in ("--model", "-m") if flag in sys.argv]
    if given:
        fail(f"--onnx names the network: {', '.join(given)} cannot be used with it")
    onnx_io.classify_command(path, images=n, device=device, data_dir=data_dir, mode=mode,
                             json_out=json_out)


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="the .onnx file to write")],
    model: ModelOpt = "ece408",
    weights: Annotated[
        Path | None, typer.Option("--weights", help="safetensors file (default: shipped)")
    ] = None,
    opset: Annotated[int, typer.Option(help="ONNX opset version")] = 17,
) -> None:
    """Write a zoo model (with its shipped or your weights) as an ONNX graph, checked by
    onnx.checker (needs the onnx extra: pip install 'convolab[onnx]')."""
    from convolab import onnx_io

    written = onnx_io.export_command(model, weights, out, opset)
    typer.echo(f"wrote {written}")


@app.command()
def verify(
    device: Annotated[
        str | None,
        typer.Option("--device", "-d", help="cpu or gpu (default: every implementation this "
                     "machine can run)"),
    ] = None,
    impl: Annotated[
        list[str] | None, typer.Option("--impl", "-i", help="only these (repeatable)")
    ] = None,
) -> None:
    """The course self-test cases against the fp64 reference, for every implementation here."""
    from convolab import verify as run

    if device is not None and device not in ("cpu", "gpu"):
        fail(f"--device must be 'cpu' or 'gpu', not {device!r}")
    if not run.main(device=device, names=impl or None):
        raise typer.Exit(1)


@app.command(name="list")
def list_impls() -> None:
    """The registry: every implementation, what it demonstrates, its parameters."""
    from convolab import info as run

    run.print_registry()


@app.command()
def info(data_dir: DataDirOpt = None) -> None:
    """Versions, devices, toolchain, dataset location, weights, tuner cache."""
    from convolab import info as run

    run.main(data_dir=data_dir)


@app.command()
def train(
    model: ModelOpt = "ece408",
    epochs: Annotated[int | None, typer.Option(
        help="passes over the 60,000 training images (default 3; the fused engine's recipe: 8)"
    )] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", "-b", help="mini-batch: images per optimizer step "
                                 "(1 to 4096; default 64; the fused engine's recipe: 256)")
    ] = None,
    lr: Annotated[float | None, typer.Option(
        help="learning rate (positive, finite; default 1e-3; the fused recipe's peak: 8e-3)"
    )] = None,
    optimizer: Annotated[str, typer.Option(help="adam or sgd")] = "adam",
    seed: Annotated[int, typer.Option(help="random seed, 0 or more (deterministic on the CPU)")
                    ] = 0,
    device: Annotated[
        str, typer.Option("--device", "-d", help="cpu or gpu (default: cpu, deterministic)")
    ] = "cpu",
    engine: Annotated[str | None, typer.Option(
        help="on the GPU: fused (ece408's fused training kernels, the default there) or "
             "framework (the layers with CuPy arrays)")] = None,
    speedrun: Annotated[bool, typer.Option(
        "--speedrun", help="fused engine: evaluate the test set once, at the end, and print "
                           "the time to 0.91 test accuracy")] = False,
    seeds: Annotated[int, typer.Option(
        help="--speedrun: train seeds SEED..SEED+N-1 and print the mean, min and max of time "
             "and accuracy (N > 1 writes no weights)")] = 1,
    json_out: JsonOpt = None,
    mode: Annotated[str | None, typer.Option(
        "--mode", help=f"fused engine: {', '.join(TRAIN_MODES)} (the conv forwards on tensor "
                       "cores for tf32/bf16; fp32 master weights; default exact)")] = None,
    smoothing: Annotated[float | None, typer.Option(
        help="fused engine: label smoothing of the cross-entropy, in [0, 1) (recipe: 0.1)")] = None,
    mirror: Annotated[bool | None, typer.Option(
        "--mirror/--no-mirror", help="fused engine: flip a random half of each batch left to "
                                     "right (recipe: off)")] = None,
    limit: Annotated[int | None, typer.Option(help="use only the first N training images")] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="safetensors file to write (default: ./MODEL.safetensors"
                     "); its JSON record goes beside it as the same name with .json"),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="allow replacing convolab's shipped weights, or a "
                           "file at the sidecar's path that convolab train did not write")
    ] = False,
    data_dir: DataDirOpt = None,
) -> None:
    """Train a zoo model with convolab's own forward and backward; then classify with
    --weights OUT."""
    from convolab import models
    from convolab import train as run

    models.spec(model)
    dev = resolve_device(device)
    chosen = run.pick_engine(engine, dev, model)
    run.check_options(*run.resolve_options(chosen, epochs, batch, lr), optimizer, seed, limit)
    run.check_recipe_options(chosen, smoothing, mirror, mode)
    run.check_speedrun_options(chosen, speedrun, seeds, json_out, out if seeds > 1 else None)
    out_path = out if out is not None else (None if seeds > 1 else run.default_out(model))
    if out_path is not None:
        run.plan_files(out_path, force)
    run.main(
        model=model,
        epochs=epochs,
        batch=batch,
        lr=lr,
        optimizer=optimizer,
        seed=seed,
        device=dev,
        limit=limit,
        out=out_path,
        data_dir=data_dir,
        force=force,
        engine=chosen,
        speedrun=speedrun,
        smoothing=smoothing,
        mirror=mirror,
        mode=mode,
        seeds=seeds,
        json_out=json_out,
    )


@app.command()
def bench(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="zoo model: ece408 (default), "
                                 "ece408-mxnet, eecs498")
    ] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", "-b", help="images per conv call: the B of every "
                                 f"layer shape timed (1 to 1,000,000; default {BENCH_BATCH:,})")
    ] = None,
    impl: Annotated[
        list[str] | None,
        typer.Option("--impl", "-i", help="NAME[:key=value,...], repeatable: only these"),
    ] = None,
    shape: Annotated[
        list[str] | None, typer.Option("--shape", help="B,C,H,W,M,K,S[,P], repeatable")
    ] = None,
    reps: Annotated[
        int | None, typer.Option(help="timed repetitions (>= 20 for a median worth quoting; "
                                 f"default {BENCH_REPS})")
    ] = None,
    network: Annotated[
        bool, typer.Option("--network", help="whole-network forward instead of per layer")
    ] = False,
    train: Annotated[
        bool, typer.Option("--train", help="training-step throughput of the GPU training "
                           "engines against PyTorch eager and torch.compile (batch 256 and 4096)")
    ] = False,
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", help="--train: fused or framework, repeatable (default both)"),
    ] = None,
    variant: Annotated[
        list[str] | None,
        typer.Option("--variant", help="--network: MODE[:layer.key=value,...]; --train: a "
                     "trainer mode (exact, tf32, bf16); repeatable"),
    ] = None,
    shapes: Annotated[
        str | None, typer.Option(help="model, seeds, vgg or all (default: model)")
    ] = None,
    plan: Annotated[
        Path | None, typer.Option("--plan", help="TOML plan of one or more runs (a sweep)")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="results folder (default benchmarks/results/DATE_DEVICE_PLAN)"),
    ] = None,
    plot: Annotated[bool, typer.Option("--plot", help="also write plot.png")] = False,
    replot: Annotated[
        list[Path] | None,
        typer.Option("--replot", help="redraw figures from results.json files into --out, "
                     "times nothing: one file -> its ladder, roofline and sweep charts; several "
                     "-> one batch-sweep figure per layer over all of them (later files win)"),
    ] = None,
    input_kind: Annotated[
        str | None,
        typer.Option("--input", help="GPU runs: raw (uint8 bytes, resized on chip; with "
                     "--network adds host->host and 60,000-image streaming rows; per layer, the "
                     "first blocks only) or float (default)"),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option("--device", "-d", help="--network: cpu (against ONNX Runtime when "
                     "installed) or gpu (default)"),
    ] = None,
) -> None:
    """Time implementations on conv layers (or the whole network) against PyTorch/cuDNN."""
    from convolab import bench as run

    command = "convolab " + " ".join(sys.argv[1:])
    if replot:
        _replot(replot, out, others=plan is not None or train or network)
        return
    if train:
        _bench_train(batch, reps, out, variant, engine, conflicts=plan is not None or network)
        return
    if engine:
        fail("--engine picks the training engines of --train")
    if plan is not None:
        given = [flag for flag, value in (("--impl", impl), ("--shape", shape),
                                          ("--variant", variant), ("--shapes", shapes),
                                          ("--network", network), ("--plot", plot),
                                          ("--device", device), ("--input", input_kind),
                                          ("--model", model is not None),
                                          ("--batch", batch is not None),
                                          ("--reps", reps is not None)) if value]
        if given:
            fail(f"--plan describes the runs: {', '.join(given)} belong in the plan file")
        run.main(run.load_plan(plan), out=out, plan=plan.stem, command=command)
        return
    model = model if model is not None else "ece408"
    batch = batch if batch is not None else BENCH_BATCH
    reps = reps if reps is not None else BENCH_REPS
    check_batch(batch, limit=1_000_000)
    config = run.from_flags(model, batch, reps, impl or (), shapes, shape or (), network,
                            variant or (), plot, device, input_kind)
    run.main([config], out=out, command=command)


def _bench_train(batch: int | None, reps: int | None, out: Path | None,
                 variant: list[str] | None, engine: list[str] | None, conflicts: bool) -> None:
    from convolab.bench import train as train_bench

    if conflicts:
        fail("--train times training steps: it takes no --plan or --network")
    modes, engines = variant or tuple(TRAIN_MODES), engine or train_bench.ENGINES
    train_bench.check_choices(modes, engines)
    resolve_device("gpu")
    if batch is not None:
        check_batch(batch, limit=4096)
    train_bench.main((batch,) if batch is not None else train_bench.BATCHES,
                     reps if reps is not None else BENCH_REPS, out, modes=tuple(modes),
                     engines=tuple(engines))


def _replot(files: list[Path], out: Path | None, others: bool) -> None:
    from convolab import outputs
    from convolab.bench import report

    if others:
        fail("--replot times nothing: it takes no --plan, --train or --network")
    if out is None:
        fail("--replot needs --out DIR (where the figures go)")
    out = outputs.check_dir(out, "--out")
    for f in files:
        if not f.is_file():
            fail(f"--replot: no results file {f}")
    written = (report.plot_results(files[0], out) if len(files) == 1
               else report.plot_sweeps(files, out))
    for path in written:
        print(f"wrote {path}")


@app.command()
def tune(
    model: ModelOpt = "ece408",
    batch: Annotated[
        int, typer.Option("--batch", "-b", help="images per conv call the candidates are "
                          "timed and cached at (1 to 1,000,000)")
    ] = 10_000,
    reps: Annotated[int, typer.Option(help="timed repetitions per candidate")] = 10,
) -> None:
    """Sweep every GPU rung's parameters on this GPU; cache the winner per layer shape."""
    from convolab.gpu import tune as run

    resolve_device("gpu")
    check_batch(batch, limit=1_000_000)
    run.main(model=model, batch=batch, reps=reps)


@app.command()
def profile(
    model: ModelOpt = "ece408",
    batch: Annotated[
        int, typer.Option("--batch", "-b", help="images per conv call profiled (1 to 10000)")
    ] = 1000,
    impl: Annotated[list[str] | None, typer.Option("--impl", "-i")] = None,
    json_out: JsonOpt = None,
) -> None:
    """Nsight Compute metrics per kernel (needs `ncu` on PATH)."""
    from convolab.gpu import profile as run
    from convolab.outputs import check_file

    resolve_device("gpu")
    check_batch(batch)
    if json_out is not None:
        json_out = check_file(json_out, "--json")
    run.main(model=model, batch=batch, names=impl or None, json_out=json_out)


def main() -> None:
    debug = bool(os.environ.get("CONVOLAB_DEBUG"))
    try:
        app()
    except (ConvolabError, ValueError, KeyError, OSError, TypeError) as err:
        if debug:
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
