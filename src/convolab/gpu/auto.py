"""Rung 14: `auto` — per-layer choice among all rungs, from the tuner's cache or a heuristic.

`prepare` looks up the tune cache (gpu/tune.py) for (this GPU, the layer's shape, mode) and
delegates to the cached rung with its cached parameters. Mode is `fp32` by default (only
rungs that promise fp32's tolerance are eligible); `tf32` and `fp16` widen the field to rungs
that promise those precisions' tolerances (`precision.TOLERANCE`). A cache entry naming a
rung that is not registered here, that does not support the shape, that is not accurate
enough for the mode, or whose parameters the rung no longer knows, is not trusted: the
heuristic below is used instead.

Heuristic with no cache entry (`default_choice`), a model of the shape:
  * a small linear layer (under gemv_mma.BIG_LAYER weights: fc7, not fc6) in TF32 at B <= 64
    on Hopper: kernel 54, the warpgroup MMA with x copied straight into its operand and the k
    slices a thread-block cluster (`gemv_wgmma_cluster.auto_choice`, docs/vgg.md "Kernel
    54"); in FP16 (and TF32 without wgmma): kernel 48, one launch whose k slices are a
    thread-block cluster (`gemv_cluster.auto_choice`, docs/vgg.md "Kernel 48");
  * a large linear layer (fc6) in FP16 from B = 17 on Hopper: kernel 49, the GEMV on the
    warpgroup MMA fed by a producer warpgroup (`gemv_wgmma.auto_choice`, docs/vgg.md
    "Kernel 49");
  * a linear layer where kernel 42 (the tensor-core GEMV: weights streamed as the MMA's A, the
    batch as n) measured fastest: TF32 from B = 8 (up to 64 on fc6-sized layers, 16 on
    smaller), FP16 up to B = 32, with 64-row tiles on small layers from B = 12, and kernel
    43 (the same fed by the bulk copy engine) for TF32 on large layers from B = 32, and in
    3xTF32 for fp32 on large layers at every batch (`gemv_mma.auto_choice`, measured on
    fc6/fc7 at batch 1..64, docs/vgg.md);
  * a linear layer (1x1 images and kernel) at B <= GEMV_MAX_BATCH[mode]: kernel 41's
    weight-streaming GEMV (`gemv-fp32` for fp32 up to B=16: exact; `gemv-tf32` for tf32 up
    to B=16: the TF32 weights in 2.5 bytes; `gemv-fp16` for fp16 up to B=8: half the bytes,
    but at 16 its FFMA and shared-memory work per weight outruns the halved stream and
    split-K wins), measured on fc6/fc7 at batch 1..16 (docs/vgg.md);
  * a narrow convolution (C and M 32..64, output rows of 112 columns or more: VGG's conv1_2)
    in FP16 on Hopper: kernel 51, the direct convolution that converts each NCHW input row
    once into a channels-last ring in shared memory (`direct_wgmma.auto_choice`, docs/vgg.md
    "Kernels 50-51"): no layout pass, every filter tap a descriptor into the ring;
  * a wide convolution on small images (C and M >= 128, Ho x W rounded to 8 within 256
    pixels: VGG's conv5_x) in FP16 or TF32 on Hopper: kernel 52, the direct convolution
    over whole images in shared memory (`direct_image.auto_choice`, docs/vgg.md "Kernel 52",
    "Kernel 52 in TF32");
  * a GEMM big enough for tensor-core tiles (C >= 32 and M >= 32: VGG's convolutions and
    classifier layers): the implicit-GEMM rung of the mode's family (fp32: 3xtf32, on the
    wgmma rungs 3xfp16; tf32: tf32, fp16: fp16), split-K where the output has fewer 128 x 128
    tiles than half the SMs, else the wgmma rung 39 on Hopper (rung 26 elsewhere), tiles by M
    (`implicit_gemm.plan`); measured on the VGG layers at batch 1..64 against every tile
    configuration (docs/vgg.md); rung 40 instead where its 256-row tiles fill the SMs
    (`implicit_gemm_wgmma.pipelined_plan`, unsplit only). On Hopper, where the 128 x 128
    tiles fill less than 0.6 of the SMs and N >= 512 (conv5_x at B = 3..12), rung 39's own
    split-K (`SPLIT`, `implicit_gemm.wgmma_tiles`) takes the shape instead of rung 27
    (conv5_x B = 8 fp16 0.058 ms against rung 27's 0.060-0.080; B = 3 TF32 0.038 against
    0.080, docs/vgg.md);
  * C >= 16 and a small output (B*M*Ho*Wo < 2^18 elements): `channel-atomic` — the output
    alone cannot fill the GPU, so the channel sum is spread over blocks;
  * C >= 16 otherwise: `channel-tree` — channel slices per block, reduced on chip;
  * small C (LeNet's C=1 and C=4): `register-tiled` (rung 7: register + shared tiling and
    coarsening are what pays when each output's sum is short), else `channel-tree` with
    CSPLIT=1 (a direct kernel with output-channel coarsening), if rung 7 is missing.
The choice logic (`resolve`) is a pure function of (entries, gpu, shape, mode, eligible
rungs) so it is tested without a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from convolab.gpu import (
    direct_image,
    direct_wgmma,
    gemv,
    gemv_cluster,
    gemv_mma,
    gemv_wgmma,
    gemv_wgmma_cluster,
    implicit_gemm,
    tune,
)
from convolab.gpu import implicit_gemm_wgmma as wg
from convolab.gpu.device import gpu_name
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, all_impls, get_impl, register
from convolab.shapes import ConvShape

LARGE_C = 16
SMALL_OUTPUT = 1 << 18
# Below these channel counts an implicit GEMM pads most of each tensor-core tile with zeros.
GEMM_C = 32
GEMM_M = 32
# The implicit-GEMM family each mode runs: the fastest that meets the mode's tolerance. On
# Hopper the wgmma rungs run fp32 as 3xfp16 (rungs 26-27 have no 3xfp16): twice the k a
# k-tile at twice TF32's MMA rate, conv5_x B = 64 0.442 ms against 3xTF32's 0.753 and B = 8
# 0.103 against 0.151 (H200, docs/vgg.md "Rungs 39-40 in 3xfp16").
GEMM_FAMILY = {"fp32": "3xtf32", "tf32": "tf32", "fp16": "fp16"}
WGMMA_FAMILY = {**GEMM_FAMILY, "fp32": "3xfp16"}
# Kernel 41's weights per mode and the largest batch it takes (H100, docs/vgg.md): fc6 with
# gemv-fp32 0.166-0.188 ms at B=1-16 against split-K 3xTF32 0.216-0.226; gemv-tf32 (TF32
# weights in 2.5 bytes) 0.113-0.118 at B=1-4 against gemv-fp32's 0.161-0.171 and cuBLAS TF32's
# 0.152, and level with gemv-fp32 at 8-16 (0.17-0.18: there the kernel is bound by its x reads,
# not the weights); gemv-fp16 0.095-0.101 at B=1-4, 0.105-0.117 at 8 (split-K 0.104-0.105; fc7
# 0.020-0.023 against split-K's 0.026-0.033), 0.17 at 16 (split-K 0.10-0.11).
GEMV_FAMILY = {"fp32": "fp32", "tf32": "tf32", "fp16": "fp16"}
GEMV_MAX_BATCH = {"fp32": gemv.MAX_BATCH, "tf32": gemv.MAX_BATCH, "fp16": 8}


@dataclass(frozen=True)
class Choice:
    impl: str
    params: dict[str, Any] = field(default_factory=dict)
    source: str = "default"  # "cache" or "default"


def default_choice(shape: ConvShape, eligible: Collection[str], mode: str = "fp32") -> Choice:
    """The no-cache heuristic (see the module docstring); only names in `eligible`."""
    n_out = shape.B * shape.M * shape.H_out * shape.W_out
    wishes: list[Choice] = []
    for cluster in (gemv_wgmma_cluster.auto_choice(shape, mode),
                    gemv_cluster.auto_choice(shape, mode)):
        if cluster is not None:
            wishes.append(Choice(*cluster))
    wgmma_gemv = gemv_wgmma.auto_choice(shape, mode)
    if wgmma_gemv is not None:
        wishes.append(Choice(*wgmma_gemv))
    tensor_core_gemv = gemv_mma.auto_choice(shape, mode)
    if tensor_core_gemv is not None:
        wishes.append(Choice(*tensor_core_gemv))
    if gemv.supports(shape) and GEMV_MAX_BATCH[mode] >= shape.B:
        wishes.append(Choice(f"gemv-{GEMV_FAMILY[mode]}"))
    for direct in (direct_wgmma.auto_choice(shape, mode), direct_image.auto_choice(shape, mode)):
        if direct is not None:
            wishes.append(Choice(*direct))
    if shape.C >= GEMM_C and shape.M >= GEMM_M:
        for wgmma in (True, False):  # rungs 39-40 are eligible only where the GPU has wgmma
            name, params = implicit_gemm.plan(shape, GEMM_FAMILY[mode], wgmma=wgmma)
            if wgmma and name.startswith(wg.RUNG39.prefix):
                # The same tiles in the wgmma family (3xfp16 for fp32), then the mode's own
                # where that is not eligible.
                family = WGMMA_FAMILY[mode]
                pipelined = wg.pipelined_plan(shape, family)
                if pipelined:
                    wishes.append(Choice(*pipelined))
                wishes.append(Choice(wg.RUNG39.prefix + family, params))
            wishes.append(Choice(name, params))
    if shape.C >= LARGE_C and n_out < SMALL_OUTPUT:
        wishes.append(Choice("channel-atomic", {"CGROUP": 4}))
    if shape.C >= LARGE_C:
        wishes.append(Choice("channel-tree", {"CSPLIT": 8 if shape.C >= 64 else 4}))
    wishes += [Choice("register-tiled"), Choice("channel-tree", {"CSPLIT": 1}), Choice("basic")]
    for wish in wishes:
        if wish.impl in eligible:
            return wish
    if not eligible:
        raise ValueError(f"auto: no GPU implementation supports shape {shape}")
    return Choice(sorted(eligible)[0])


def resolve(
    entries: Sequence[tune.TuneEntry],
    gpu: str,
    shape: ConvShape,
    mode: str,
    eligible: Collection[str],
) -> Choice:
    """Cached winner for (gpu, shape, mode) if it is eligible here, else the heuristic."""
    entry = tune.lookup(entries, gpu, shape, mode)
    # `auto`'s callers pass NCHW fp32: an entry for a channels-last run (layout=nhwc, rungs
    # 39-40) is never theirs.
    if (entry is not None and entry.impl in eligible
            and entry.params.get("layout", "nchw") == "nchw"):
        return Choice(entry.impl, dict(entry.params), "cache")
    return default_choice(shape, eligible, mode)


def eligible_impls(shape: ConvShape, mode: str) -> dict[str, ConvImpl]:
    """Registered GPU rungs that support `shape` and are accurate enough for `mode`."""
    limit = tune.mode_tolerance(mode)
    return {
        i.name: i
        for i in all_impls("gpu")
        if i.name not in tune.NOT_TUNED
        and not i.pool
        and not i.reference_only
        and i.tolerance <= limit
        and i.supports(shape)
    }


def choose(shape: ConvShape, mode: str = "fp32", gpu: str | None = None) -> Choice:
    """What `auto` runs for this layer on this GPU (reads the cache)."""
    eligible = eligible_impls(shape, mode)
    return resolve(tune.load_cache(), gpu or gpu_name(), shape, mode, eligible)


def prepare_auto(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    mode = tune.check_mode(str(params.get("mode", "fp32")))
    choice = choose(shape, mode)
    impl = get_impl(choice.impl)
    try:
        chosen = impl.params_for(choice.params)
    except ValueError as err:
        warnings.warn(
            f"auto: cached parameters for {impl.name} rejected ({err}); using its defaults",
            tune.CacheWarning,
            stacklevel=2,
        )
        chosen = impl.params_for(None)
    return impl.prepare(shape, w, b, chosen)


register(
    ConvImpl(
        name="auto",
        rung=14,
        device="gpu",
        # No kernel of its own; this is the one it falls back to when rung 7 is absent.
        kernel_file="08_channel_tree.cu",
        demonstrates="per-layer choice among all rungs, from the tuner's on-disk cache",
        prepare=prepare_auto,
        defaults={"mode": "fp32"},
        space={},
        compile_variants=lambda: [{}],
        tolerance=TOLERANCE["fp32"],
    )
)
