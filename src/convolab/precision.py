"""The precision vocabulary, defined once: what each precision promises and what the network
modes and CLI spellings mean.

Tolerances are the relative L2 error against an fp64 reference on fresh random inputs
(docs/spec.md, "Correctness"). TF32 keeps 10 mantissa bits on both operands: on 49-196-term
sums with mixed-sign weights its error reaches 5e-4 on a few percent of random draws, so
every TF32 path promises 1e-3; a 3xTF32 split recovers fp32 accuracy.
"""

from __future__ import annotations

PRECISIONS: tuple[str, ...] = ("fp32", "3xtf32", "3xfp16", "tf32", "fp16", "bf16")

TOLERANCE: dict[str, float] = {
    "fp32": 1e-5,
    "3xtf32": 1e-5,
    "3xfp16": 1e-5,
    "tf32": 1e-3,
    "fp16": 1e-2,
    "bf16": 1e-2,
}

# Whole-network modes: 'exact' is fp32-accurate end to end (FFMA, and 3xTF32 on the tensor
# cores for the wide layers rung 28 takes: gpu/fused_wide.EXACT_PRECISION); the others put the
# convolutions on tensor cores in that input precision (fp32 accumulate, fp32 head).
NETWORK_MODES: dict[str, str] = {"exact": "fp32", "tf32": "tf32", "fp16": "fp16"}

# The accuracy classes `convolab tune` and `auto` key their winners by, tightest first: a class
# admits every rung whose tolerance is at most TOLERANCE[class] (3xtf32 rungs join fp32, bf16
# rungs join fp16).
TUNE_MODES: tuple[str, ...] = ("fp32", "tf32", "fp16")

# Modes of the fused trainer (`convolab train --mode`, `Trainer(mode=...)`): 'exact' is fp32
# FFMA throughout; 'tf32' and 'bf16' run both convolution forwards on tensor cores with operands
# rounded to that precision (fp32 accumulate). The head, the backward kernels and the optimizer
# stay fp32, and the master weights are fp32 in every mode (docs/training.md says why).
TRAIN_MODES: dict[str, str] = {"exact": "fp32", "tf32": "tf32", "bf16": "bf16"}

# What `--mode` accepts on the command line: the network modes plus one friendly alias.
MODE_ALIASES: dict[str, str] = {**{m: m for m in NETWORK_MODES}, "tensor-core": "fp16"}


def tolerance(precision: str) -> float:
    try:
        return TOLERANCE[precision]
    except KeyError:
        raise ValueError(
            f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}"
        ) from None


def network_mode(name: str) -> str:
    """A `--mode` spelling -> the network mode it means (raises ValueError naming the options)."""
    try:
        return MODE_ALIASES[name]
    except KeyError:
        raise ValueError(f"mode must be one of {', '.join(MODE_ALIASES)}, not {name!r}") from None


def train_mode(name: str) -> str:
    """A trainer `--mode` -> the same name, checked (raises ValueError naming the options)."""
    if name not in TRAIN_MODES:
        raise ValueError(f"mode must be one of {', '.join(TRAIN_MODES)}, not {name!r}")
    return name
