"""The fused trainer's recipe search and speedrun (docs/training.md).

    search:   candidate recipes x seeds, trained on the first 55,000 training images and
              scored on the last 5,000 (a validation split: the test set is never looked at)
    speedrun: one recipe x seeds on all 60,000, the test set evaluated once at the end;
              wall time from the first epoch launch (graph capture included) to the final
              accuracy, with the data resident on the GPU and the kernels compiled

    PYTHONPATH=src python3 benchmarks/train_speedrun.py search --seeds 5 --out $OUT/search.json
    PYTHONPATH=src python3 benchmarks/train_speedrun.py speedrun --seeds 5 --out $OUT/run.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from convolab import data
from convolab.gpu.trainer import RECIPE, Recipe, Trainer

VALIDATION = 5_000  # the last images of the training split
TARGET = 0.91
# Each candidate: what it changes against the default recipe.
CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    "smooth": {"smoothing": 0.1},
    "mirror": {"mirror": True},
    "smooth+mirror": {"smoothing": 0.1, "mirror": True},
    "e6": {"epochs": 6},
    "e12": {"epochs": 12},
    "lr2e-3": {"lr": 2e-3},
    "lr8e-3": {"lr": 8e-3},
    "b128": {"batch": 128, "lr": 3e-3},
    "b512": {"batch": 512, "lr": 6e-3},
    "cosine": {"schedule": "cosine"},
    "warm0.1": {"warmup": 0.1},
}


def run_one(recipe: Recipe, seed: int, train: tuple[np.ndarray, np.ndarray],
            held: tuple[np.ndarray, np.ndarray], every_epoch: bool) -> dict[str, Any]:
    trainer = Trainer(*train, recipe, seed)
    held_dev = trainer.upload(*held)
    curve = []
    started = time.perf_counter()
    for _ in range(recipe.epochs):
        trainer.run_epoch()
        stats = trainer.epoch_stats()
        if every_epoch:
            curve.append(round(trainer.evaluate(*held_dev).accuracy, 4))
    train_s = time.perf_counter() - started
    final = trainer.evaluate(*held_dev)
    total_s = time.perf_counter() - started
    return {"seed": seed, "accuracy": final.accuracy, "loss": final.loss,
            "train_loss": stats.loss, "train_accuracy": stats.accuracy,
            "train_seconds": train_s, "seconds": total_s, "curve": curve}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    acc = [r["accuracy"] for r in runs]
    sec = [r["seconds"] for r in runs]
    return {"accuracy_mean": float(np.mean(acc)), "accuracy_min": min(acc),
            "accuracy_max": max(acc), "seconds_mean": float(np.mean(sec)),
            "seconds_min": min(sec), "seconds_max": max(sec),
            "reached": sum(a >= TARGET for a in acc)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=("search", "speedrun"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--recipe", default="{}", help="speedrun: JSON overrides of RECIPE")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    raw, labels = data.load_split("train")
    if args.what == "search":
        train = raw[:-VALIDATION], labels[:-VALIDATION]
        held = raw[-VALIDATION:], labels[-VALIDATION:]
        plans = {name: CANDIDATES[name] for name in args.candidates.split(",")}
    else:
        train, held = (raw, labels), data.load_split("test")
        plans = {"speedrun": json.loads(args.recipe)}
    report: dict[str, Any] = {"what": args.what, "date": dt.date.today().isoformat(),
                              "base": RECIPE.as_dict(), "results": {}}
    for name, change in plans.items():
        recipe = dataclasses.replace(RECIPE, **change)
        runs = [run_one(recipe, seed, train, held, args.what == "search")
                for seed in range(args.seeds)]
        report["results"][name] = {"change": change, "recipe": recipe.as_dict(),
                                   "summary": summary(runs), "runs": runs}
        s = summary(runs)
        print(f"{name:<16} acc {s['accuracy_mean']:.4f} [{s['accuracy_min']:.4f}, "
              f"{s['accuracy_max']:.4f}]  {s['seconds_mean']:.2f} s [{s['seconds_min']:.2f}, "
              f"{s['seconds_max']:.2f}]  >= {TARGET}: {s['reached']}/{len(runs)}  "
              f"curve {runs[0]['curve']}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
