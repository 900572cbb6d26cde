"""Every fused training kernel (31-36) launched at a small size, for compute-sanitizer:

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_trainer.py
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize_trainer.py

One gradient step (odd batch: partial slices and head chunks), one captured epoch with Adam
and the mirror augmentation, one SGD epoch, one evaluation with a partial last batch. Exit
status 1 when a result is not finite.
"""

from __future__ import annotations

import sys

import numpy as np

from convolab.gpu.trainer import Recipe, Trainer


def main() -> int:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(70, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=70).astype(np.uint8)
    ok = True
    for recipe in (Recipe(batch=13, epochs=1, mirror=True, smoothing=0.1),
                   Recipe(batch=13, epochs=1, optimizer="sgd", lr=0.01)):
        t = Trainer(raw, labels, recipe, seed=1)
        loss, grads = t.gradients(rng.choice(70, size=13, replace=False))
        t.run_epoch()
        stats = t.epoch_stats()
        held = t.upload(raw[:9], labels[:9])
        ev = t.evaluate(*held)
        finite = all(np.isfinite(g).all() for g in grads.values()) and np.isfinite(
            [loss, stats.loss, ev.loss]).all()
        print(f"{recipe.optimizer}: loss {loss:.4f}, epoch loss {stats.loss:.4f}, eval "
              f"{ev.loss:.4f} / {ev.accuracy:.3f}, finite {finite}")
        ok &= bool(finite)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
