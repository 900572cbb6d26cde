"""What `convolab bench` measures: conv layers (`LayerCase`) from the zoo, the VGG16 set, or
`--shape B,C,H,W,M,K,S[,P]` on the command line."""

from __future__ import annotations

from dataclasses import dataclass

from convolab.errors import ConvolabError
from convolab.models import conv_blocks
from convolab.shapes import ConvShape

SHAPE_SETS = ("model", "seeds", "vgg", "all")
SEED_MODELS = ("ece408-mxnet", "eecs498")

# CPU contenders run at most this many images (the course's CPU anchor is 1000 images) and at
# most this much work per run, so a CPU pass over the VGG shapes stays minutes, not hours.
CPU_BATCH_CAP = 1000
CPU_FLOP_BUDGET = 20e9
# The 7-loop algorithm is ~100x slower than BLAS: 100 images, 1 GFLOP per run at most.
SLOW_CPU_IMPLS = {"cpu-loops": (100, 1e9)}
# VGG16 layers run at most at these batches (DianNao's sweep goes to 64 on every layer;
# conv1_2 at 64 is 0.8 GB of input and 0.8 GB of output, one rotation buffer).
VGG_BATCH_224 = 64
VGG_BATCH_SMALL = 64
# Seed 003's batch sweep (benchmarks/plans/vgg_sweep.toml).
VGG_SWEEP_BATCHES = (1, 2, 3, 4, 8, 12, 16, 32, 64)


@dataclass(frozen=True)
class LayerCase:
    """One conv layer to benchmark; `pool` is the max-pool that follows it (fused rungs)."""

    label: str
    shape: ConvShape
    pool: int = 0
    note: str = ""


def model_cases(model: str, batch: int) -> list[LayerCase]:
    """The model's conv layers at `batch` (convolab.models.conv_blocks)."""
    return [LayerCase(f"{model}/{b.name}", b.shape, b.pool) for b in conv_blocks(model, batch)]


def vgg_cases(batch: int) -> list[LayerCase]:
    """DianNao's VGG16 layers. Convs take a 1-pixel halo so the output keeps 224/14."""
    b224, bsmall = min(batch, VGG_BATCH_224), min(batch, VGG_BATCH_SMALL)
    return [
        LayerCase("vgg/conv1_2", ConvShape(b224, 64, 226, 226, 64, 3),
                  note=f"3x3 64->64, input 226x226 (224 + halo), output 224x224, B={b224}"),
        LayerCase("vgg/conv5_x", ConvShape(bsmall, 512, 16, 16, 512, 3),
                  note=f"3x3 512->512, input 16x16 (14 + halo), output 14x14, B={bsmall}"),
        LayerCase("vgg/fc6", ConvShape(bsmall, 25088, 1, 1, 4096, 1),
                  note=f"classifier 25088->4096 as a 1x1 conv over Bx25088x1x1, B={bsmall}"),
        LayerCase("vgg/fc7", ConvShape(bsmall, 4096, 1, 1, 1024, 1),
                  note=f"classifier 4096->1024 as a 1x1 conv over Bx4096x1x1, B={bsmall}"),
    ]


def shape_set_cases(shapes: str, model: str, batch: int) -> list[LayerCase]:
    """`--shapes`: the model's layers, the seed models' layers, the VGG16 layers, or all."""
    if shapes not in SHAPE_SETS:
        raise ConvolabError(f"--shapes must be one of {', '.join(SHAPE_SETS)}, not {shapes!r}")
    cases: list[LayerCase] = []
    if shapes in ("model", "all"):
        cases += model_cases(model, batch)
    if shapes in ("seeds", "all"):
        cases += [c for m in SEED_MODELS if not (shapes == "all" and m == model)
                  for c in model_cases(m, batch)]
    if shapes in ("vgg", "all"):
        cases += vgg_cases(batch)
    return cases


def parse_shape(text: str) -> LayerCase:
    """`B,C,H,W,M,K,S[,P]` -> a case; P is the pool window after ReLU (0 or absent: none)."""
    usage = f"--shape {text!r}: expected B,C,H,W,M,K,S[,P] as positive integers (P may be 0)"
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConvolabError(usage) from None
    if len(values) not in (7, 8) or min(values[:7]) < 1 or (len(values) == 8 and values[7] < 0):
        raise ConvolabError(usage)
    B, C, H, W, M, K, S = values[:7]
    pool = values[7] if len(values) == 8 else 0
    try:
        shape = ConvShape(B, C, H, W, M, K, S)
    except ValueError as err:
        raise ConvolabError(f"--shape {text!r}: {err}") from None
    if pool and (shape.H_out < pool or shape.W_out < pool):
        raise ConvolabError(f"--shape {text!r}: pool {pool} exceeds the {shape.H_out}x"
                            f"{shape.W_out} output")
    label = f"shape/{B}x{C}x{H}x{W}-M{M}K{K}S{S}" + (f"P{pool}" if pool else "")
    return LayerCase(label, shape, pool)


def layer_cases(shapes: str | None, model: str, batch: int,
                custom: tuple[str, ...] = ()) -> list[LayerCase]:
    """The set's cases (none when `shapes` is None and shapes are given) then the custom ones."""
    cases = [parse_shape(s) for s in custom]
    if shapes is None and not cases:
        shapes = "model"
    return (shape_set_cases(shapes, model, batch) if shapes else []) + cases


def cpu_batch(shape: ConvShape, impl_name: str) -> int:
    """Images a CPU contender runs on: capped by count and by work per run (0: skip)."""
    cap, budget = SLOW_CPU_IMPLS.get(impl_name, (CPU_BATCH_CAP, CPU_FLOP_BUDGET))
    per_image = shape.with_batch(1).flops
    return min(shape.B, cap, int(budget // per_image))
