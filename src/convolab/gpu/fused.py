"""Registry entries of the fused conv + bias + ReLU + max-pool rungs.

Pool size is a field of `ConvImpl` (it decides `out_shape`), so one registry entry cannot
serve two pool sizes. Rather than registering a name per imaginable window, a factory
`fused_conv_pool_impl(pool, precision)` builds (and caches) the entry for any pool size;
the ones the zoo needs are registered by name at import:

    fused-conv-pool2, fused-conv-pool4            fp32 FFMA (rungs 13, 15, 16: gpu/fused_ffma.py)
    fused-conv-pool2-tc, fused-conv-pool4-tc      tensor cores, fp16 in (rungs 17, 18:
    fused-conv-pool2-tf32, fused-conv-pool4-tf32  tensor cores, TF32 in  gpu/fused_mma.py)

Nothing here imports CuPy at module import time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from convolab.gpu import fused_ffma, fused_mma
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, register

PRECISIONS = ("fp32", "fp16", "tf32")

_EXACT_SPACE: Mapping[str, list[int]] = {
    "mt": [1, 2, 4, 8],
    "pw": [1, 2, 4],
    "ty": [4, 8, 16],
    "mg": [1, 2, 4],
    "rpt": [1, 2, 5],
    "minb": [1, 2, 4, 6, 8],
    "pipe": [-1, 1],  # fcp_exact / fcp_exact_pipe (0 = fused_ffma.with_measured_defaults)
    "bps": [0, 2, 3, 4],  # pipe: persistent blocks per SM (0 = as many as fit)
    "wreg": [0, 1],  # pipe: weights in registers (with mt=1)
    "cw": [-1, 1],  # fcp_exact_cw: weights as a by-value kernel parameter (constant bank)
}


def _exact_variants() -> list[dict[str, int]]:
    """fcp_exact's define sets (the pipe and cw kernels live in other files:
    fused_ffma.compile_jobs lists every file's)."""
    return [p.defines for p in fused_ffma.compile_plans() if p.kernel == "fcp_exact"]


def _tc_file(pool: int) -> str:
    """The zoo's layers with this pool run toeplitz (pool 2, conv1) or wa (pool 4)."""
    return fused_mma.KERNEL_FILES["fcp_mma_toe" if pool == 2 else "fcp_mma_wa"]


def _tc_variants(pool: int) -> list[dict[str, int]]:
    return [p.defines for p in fused_mma.compile_plans() if p.kernel_file == _tc_file(pool)]


@functools.cache
def fused_conv_pool_impl(pool: int, precision: str = "fp32") -> ConvImpl:
    """The fused implementation for a pool window `pool` (stride = window, floor)."""
    if not isinstance(pool, int) or pool < 1:
        raise ValueError(f"pool must be a positive int, got {pool!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return ConvImpl(
            name=f"fused-conv-pool{pool}",
            demonstrates=(
                f"conv + bias + ReLU + max-pool {pool}x{pool} in one kernel: pool windows kept "
                "in registers, only pooled values written; register-tiled FFMA"
            ),
            device="gpu",
            prepare=fused_ffma.prepare_exact(pool),
            supports=lambda s: fused_ffma.supports_pool(s, pool),
            space=_EXACT_SPACE,
            defaults={"mt": 0, "pw": 0, "tx": 0, "ty": 0, "mg": 0, "rpt": 0, "minb": 0,
                      "pipe": 0, "bps": 0, "wreg": 0, "cw": 0},
            tolerance=TOLERANCE["fp32"],
            rung=13,
            kernel_file=fused_ffma.KERNEL_FILE,
            compile_variants=_exact_variants,
            pool=pool,
        )
    suffix = "tc" if precision == "fp16" else precision
    return ConvImpl(
        name=f"fused-conv-pool{pool}-{suffix}",
        demonstrates=(
            f"fused conv + ReLU + max-pool {pool} on tensor cores (mma.sync, {precision} "
            "inputs, fp32 accumulate); pooling done on the accumulator fragments"
        ),
        device="gpu",
        prepare=fused_mma.prepare_tc(pool, precision),
        supports=lambda s: fused_mma.tc_kind(s, pool) is not None,
        space={"warps": [2, 4, 5, 8], "minb": [1, 2, 3, 4]},
        defaults={"warps": 0, "minb": 0},
        tolerance=TOLERANCE[precision],
        rung=13,
        kernel_file=_tc_file(pool),
        compile_variants=lambda: _tc_variants(pool),
        pool=pool,
    )


for _pool in (2, 4):
    for _precision in PRECISIONS:
        register(fused_conv_pool_impl(_pool, _precision))
