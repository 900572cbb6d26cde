"""Train one zoo model on the GPU through `convolab.train.main` and record the run.

Writes <out-dir>/<model>.safetensors and its .json sidecar (train.main's) and adds to the sidecar
what train.main does not know: the wall-clock seconds of the whole run (data loading, training,
the per-epoch test evaluation, saving), the GPU's name and the backward method used.

    PYTHONPATH=src CONVOLAB_DATA=.data python3 benchmarks/device_train.py \
        --model ece408 --epochs 20 --batch 256 --lr 2e-3 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def gpu_name() -> str:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ece408")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--method", default=None, help="conv backward: direct or gemm")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()

    from convolab import train
    from convolab.gpu import backward

    if args.method is not None:
        if args.method not in backward.METHODS:
            parser.error(f"--method must be one of {backward.METHODS}")
        backward.DEFAULT_METHOD = args.method
    out = args.out_dir / f"{args.model}.safetensors"
    started = time.perf_counter()
    result = train.main(model=args.model, epochs=args.epochs, batch=args.batch, lr=args.lr,
                        optimizer=args.optimizer, seed=args.seed, device="gpu",
                        limit=args.limit, out=out, quiet=True)
    wall = time.perf_counter() - started
    result.update(
        wall_seconds=round(wall, 2),
        train_loop_seconds=round(sum(h["seconds"] for h in result["history"]), 2),
        gpu=gpu_name(),
        backward_method=backward.DEFAULT_METHOD,
        trained_by="benchmarks/device_train.py (convolab.train.main, device gpu)",
    )
    sidecar = out.with_suffix(".json")
    sidecar.write_text(json.dumps(result, indent=2) + "\n")
    for h in result["history"]:
        print(f"{args.model} epoch {h['epoch']:>2}: loss {h['train_loss']:.4f} "
              f"train {h['train_accuracy']:.4f} test {h['test_accuracy']:.4f} {h['seconds']:.2f} s")
    print(f"{args.model}: test accuracy {result['test_accuracy']:.4f}, wall {wall:.1f} s "
          f"(training loop {result['train_loop_seconds']:.1f} s) on {result['gpu']}")


if __name__ == "__main__":
    main()
