"""Training throughput: images/s of one training step, convolab on the GPU vs PyTorch.

One step = forward (logits) + softmax cross-entropy + backward + Adam update, on a batch that
already lies on the GPU. convolab's step is `convolab.train.main`'s inner loop exactly (its
loss is read back to the host every step, as train does); PyTorch's is the same network in
torch.nn, fp32 with TF32 off, cuDNN autotuning on, no host read-back. Both are timed with CUDA
events around each step after warm-up; the median of `--reps` steps is reported with its
spread. The conv backward of each convolab layer is also timed alone, for both methods
(direct and gemm), which is what `convolab.gpu.backward.DEFAULT_METHOD` is chosen from.

    PYTHONPATH=src python3 benchmarks/train_throughput.py --json $OUT/train_throughput.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np


def method_is_correct(method: str) -> bool:
    """The method's conv backward against a float64 scatter reference (textbook figs. 16.8/16.9)
    at a small C3-like shape, strides 1 and 2: a method that fails is neither timed nor picked."""
    import cupy as cp

    from convolab.check import rel_l2
    from convolab.gpu.backward import conv2d_backward

    rng = np.random.default_rng(2)
    for stride in (1, 2):
        x = rng.standard_normal((3, 4, 20, 19))
        w = rng.standard_normal((5, 4, 7, 7))
        ho, wo = (20 - 7) // stride + 1, (19 - 7) // stride + 1
        dy = rng.standard_normal((3, 5, ho, wo))
        dx_ref, dw_ref = np.zeros_like(x), np.zeros_like(w)
        for p in range(7):
            for q in range(7):
                rows = slice(p, p + stride * (ho - 1) + 1, stride)
                cols = slice(q, q + stride * (wo - 1) + 1, stride)
                dx_ref[:, :, rows, cols] += np.einsum("bmhw,mc->bchw", dy, w[:, :, p, q])
                dw_ref[:, :, p, q] = np.einsum("bmhw,bchw->mc", dy, x[:, :, rows, cols])
        dx, dw, _ = conv2d_backward(*(cp.asarray(a, dtype=cp.float32) for a in (x, w, dy)),
                                    stride, method)
        if rel_l2(dx, dx_ref) > 1e-5 or rel_l2(dw, dw_ref) > 1e-5:
            return False
    return True


def convolab_step_ms(model: str, batch: int, reps: int, method: str) -> dict[str, Any]:
    import cupy as cp

    from convolab import models
    from convolab.gpu import backward
    from convolab.network import CrossEntropyLoss
    from convolab.optim import Adam
    from convolab.timing import Stats, time_gpu

    backward.DEFAULT_METHOD = method
    size = models.spec(model).input_size
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.uniform(0, 1, (batch, 1, size, size)).astype(np.float32))
    y = cp.asarray(rng.integers(0, 10, batch))
    net = models.build(model, seed=0).to("gpu").train()
    opt, loss_fn = Adam(net, lr=1e-3), CrossEntropyLoss()

    def step() -> None:
        loss, grad = loss_fn(net.logits(x), y)
        net.backward(grad)
        opt.step()

    stats = Stats.of(time_gpu(step, reps=reps, warmup=3))

    # Where a step's device time goes: events between the phases (the loss read-back inside
    # CrossEntropyLoss synchronises, so "loss" includes waiting for the forward's kernels).
    names = ("forward", "loss", "backward", "optimizer")
    phases: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        events = [cp.cuda.Event() for _ in range(len(names) + 1)]
        events[0].record()
        logits = net.logits(x)
        events[1].record()
        loss, grad = loss_fn(logits, y)
        events[2].record()
        net.backward(grad)
        events[3].record()
        opt.step()
        events[4].record()
        events[4].synchronize()
        for i, name in enumerate(names):
            phases[name].append(cp.cuda.get_elapsed_time(events[i], events[i + 1]))
    return {"median_ms": stats.median_ms, "spread_pct": stats.spread_pct,
            "images_per_s": batch / stats.median_ms * 1e3, "stats": stats.as_dict(),
            "phases_median_ms": {k: float(np.median(v)) for k, v in phases.items()}}


def backward_layers_ms(model: str, batch: int, reps: int,
                       methods: list[str]) -> list[dict[str, Any]]:
    """Each conv layer's backward alone (dX skipped for the first layer, as in training)."""
    import cupy as cp

    from convolab import models
    from convolab.gpu.backward import _channel_sum, conv2d_backward
    from convolab.layers import Conv2d
    from convolab.timing import Stats, time_gpu

    net = models.build(model, seed=0)
    size = models.spec(model).input_size
    rng = np.random.default_rng(1)
    x = cp.asarray(rng.uniform(0, 1, (batch, 1, size, size)).astype(np.float32))
    rows = []
    first = True
    for layer in net.layers:
        if isinstance(layer, Conv2d):
            w = cp.asarray(layer.weight)
            layer_x = x
            h_out = (x.shape[2] - layer.kernel_size) // layer.stride + 1
            dy = cp.asarray(rng.standard_normal((batch, w.shape[0], h_out, h_out),
                                                dtype=np.float32))
            row: dict[str, Any] = {"layer": layer.name, "x": list(x.shape), "w": list(w.shape),
                                   "need_dx": not first}
            for method in methods:
                def run(m: str = method, lx: Any = layer_x, dy: Any = dy, w: Any = w,
                        s: int = layer.stride, dx: bool = not first) -> None:
                    conv2d_backward(lx, w, dy, s, m, need_dx=dx)

                stats = Stats.of(time_gpu(run, reps=reps, warmup=2))
                row[f"{method}_ms"] = stats.median_ms
                row[f"{method}_spread_pct"] = stats.spread_pct
            # The bias gradient alone: CuPy's one-call reduction vs the two-stage one used.
            one_pass = Stats.of(time_gpu(lambda dy=dy: dy.sum(axis=(0, 2, 3)), reps=reps))
            two_stage = Stats.of(time_gpu(lambda dy=dy: _channel_sum(dy), reps=reps))
            row["db_one_pass_ms"], row["db_two_stage_ms"] = one_pass.median_ms, two_stage.median_ms
            rows.append(row)
            first = False
            x = cp.asarray(rng.uniform(0, 1, (batch, w.shape[0], h_out, h_out)).astype(np.float32))
        elif hasattr(layer, "kernel_size"):  # pooling: shrink the stand-in activations
            k, s = layer.kernel_size, layer.stride
            h = (x.shape[2] - k) // s + 1
            x = cp.asarray(rng.uniform(0, 1, (batch, x.shape[1], h, h)).astype(np.float32))
    return rows


def torch_step_ms(model: str, batch: int, reps: int) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    from convolab import models
    from convolab.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    mods: list[Any] = []
    for layer in models.build(model).layers:  # the same architecture, layer for layer
        if isinstance(layer, Conv2d):
            mods.append(torch.nn.Conv2d(layer.in_channels, layer.out_channels,
                                        layer.kernel_size, layer.stride))
        elif isinstance(layer, ReLU):
            mods.append(torch.nn.ReLU())
        elif isinstance(layer, MaxPool2d):
            mods.append(torch.nn.MaxPool2d(layer.kernel_size, layer.stride))
        elif isinstance(layer, Flatten):
            mods.append(torch.nn.Flatten())
        elif isinstance(layer, Linear):
            mods.append(torch.nn.Linear(layer.in_features, layer.out_features))
    net = torch.nn.Sequential(*mods).cuda()
    size = models.spec(model).input_size
    x = torch.rand(batch, 1, size, size, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    from convolab.timing import Stats

    stats = Stats.of(samples)
    return {"median_ms": stats.median_ms, "spread_pct": stats.spread_pct,
            "images_per_s": batch / stats.median_ms * 1e3, "stats": stats.as_dict(),
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ece408")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import cupy as cp

    from convolab.gpu.backward import METHODS

    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    correct = {method: method_is_correct(method) for method in METHODS}
    methods = [m for m in METHODS if correct[m]]
    print(f"conv backward correct: {correct}", flush=True)
    result: dict[str, Any] = {"model": args.model, "device": name,
                              "date": dt.date.today().isoformat(), "reps": args.reps,
                              "cupy": cp.__version__, "methods_correct": correct, "rows": []}
    for batch in args.batches:
        row: dict[str, Any] = {"batch": batch}
        for method in methods:
            row[f"convolab_{method}"] = convolab_step_ms(args.model, batch, args.reps, method)
        row["torch"] = torch_step_ms(args.model, batch, args.reps)
        row["backward_layers"] = backward_layers_ms(args.model, batch, args.reps, methods)
        result["rows"].append(row)
        cp.get_default_memory_pool().free_all_blocks()
        if methods:
            fastest = min(methods, key=lambda m: row[f"convolab_{m}"]["median_ms"])
            result.setdefault("fastest_method", {})[str(batch)] = fastest
        line = "  ".join(f"{m} {row[f'convolab_{m}']['images_per_s']:,.0f} img/s "
                         f"({row[f'convolab_{m}']['median_ms']:.2f} ms)" for m in methods)
        torch_part = (f"torch {row['torch']['images_per_s']:,.0f} img/s "
                      f"({row['torch']['median_ms']:.2f} ms)" if row["torch"] else "torch n/a")
        print(f"batch {batch}: {line}  {torch_part}", flush=True)
        for m in methods:
            phases = row[f"convolab_{m}"]["phases_median_ms"]
            print(f"   {m} phases: " + "  ".join(f"{k} {v:.2f} ms" for k, v in phases.items()),
                  flush=True)
        for layer in row["backward_layers"]:
            print(f"   backward {layer['layer']} x{tuple(layer['x'])}: "
                  + "  ".join(f"{m} {layer[f'{m}_ms']:.3f} ms" for m in methods)
                  + f"  (db: one-pass sum {layer['db_one_pass_ms']:.3f} ms, two-stage "
                  f"{layer['db_two_stage_ms']:.3f} ms)", flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
