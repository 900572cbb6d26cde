"""Host side of kernel 20, `lenet_head` (kernels/20_lenet_head.cu): the fused LeNet's F5 + ReLU +
F6 + softmax in one persistent kernel. Define sets, shared memory, grid, and run(). Nothing
here imports CuPy at module import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convolab.shapes import ceil_div

KERNEL_FILE = "20_lenet_head.cu"
# Define sets per tile size (images a block finishes at a time). 16: 625 tiles at B=10000
# spread over 132 SMs within 5 %, 0.032 ms on the H100; 32 halves the feature loads per FMA
# but leaves 2.4 tiles a SM (0.038 ms); its partial sums get one buffer (two would pass 227 KB).
HEAD_VARIANTS: dict[int, dict[str, int]] = {
    16: {"HEAD_IMGS": 16, "HEAD_LO": 4, "HEAD_KC": 32, "HEAD_NS": 3, "HEAD_RB": 2},
    32: {"HEAD_IMGS": 32, "HEAD_LO": 4, "HEAD_KC": 16, "HEAD_NS": 3, "HEAD_RB": 1},
}
HEAD_IMGS_CHOICES = tuple(HEAD_VARIANTS)
HEAD_DEFAULT_IMGS = 16
HEAD_THREADS = 256  # HEAD_THREADS in the kernel: 8 warps, one 128-k slice each
_KERNEL_DEFAULTS = HEAD_VARIANTS[HEAD_DEFAULT_IMGS]  # what the kernel builds with no -D


def head_defines(imgs: int = HEAD_DEFAULT_IMGS) -> dict[str, int]:
    """The kernel's define set for tiles of `imgs` images (a HEAD_VARIANTS key)."""
    if imgs not in HEAD_VARIANTS:
        raise ValueError(f"FusedLeNet: head imgs must be one of {HEAD_IMGS_CHOICES}, got {imgs}")
    return dict(HEAD_VARIANTS[imgs])


def head_smem_bytes(defines: Mapping[str, int]) -> int:
    """Dynamic shared memory of `lenet_head` (HEAD_SMEM_BYTES in the kernel): the F5 weights,
    each warp's ring of HEAD_NS padded feature chunks, HEAD_RB partial-sum buffers."""
    d = {**_KERNEL_DEFAULTS, **defines}
    warps, imgs = HEAD_THREADS // 32, d["HEAD_IMGS"]
    ring = warps * d["HEAD_NS"] * imgs * (d["HEAD_KC"] + 4)
    return 4 * (1024 * 32 + ring + d["HEAD_RB"] * warps * imgs * 32)


def head_grid(batch: int, defines: Mapping[str, int], n_sm: int) -> int:
    """Persistent launch: one block per SM (the shared memory allows no second), never more
    blocks than tiles."""
    imgs = {**_KERNEL_DEFAULTS, **defines}["HEAD_IMGS"]
    return max(1, min(n_sm, ceil_div(batch, imgs)))


def prepare_head(defines: Mapping[str, int] | None = None) -> Callable[..., None]:
    """`lenet_head` ready to launch: run(feat, w5t, b5, w6, b6, probs).

    feat: (B, 1024) or (B, 16, 8, 8) fp32, C-contiguous, 16-byte aligned (cp.async); w5t the
    F5 weight transposed to (1024, 32), contiguous; probs (B, 10) fp32, written. defines:
    a define set (default: head_defines()).
    """
    from convolab.backend import require_cupy
    from convolab.gpu.compile import get_kernel

    cp = require_cupy()
    d = dict(head_defines() if defines is None else defines)
    kernel = get_kernel(KERNEL_FILE, "lenet_head", d)
    smem = head_smem_bytes(d)
    kernel.max_dynamic_shared_size_bytes = smem
    n_sm = int(cp.cuda.Device().attributes["MultiProcessorCount"])

    def run(feat: Any, w5t: Any, b5: Any, w6: Any, b6: Any, probs: Any) -> None:
        batch = int(feat.shape[0])
        if batch == 0:
            return
        if not feat.flags.c_contiguous or feat.data.ptr % 16 or feat.size != batch * 1024:
            raise ValueError("lenet_head: feat must be contiguous (B, 1024) fp32, 16-byte aligned")
        kernel((head_grid(batch, d, n_sm),), (HEAD_THREADS,),
               (feat, w5t, b5, w6, b6, probs, np.int32(batch)), shared_mem=smem)

    run.defines = d  # type: ignore[attr-defined]  # for tests and benchmarks
    return run


def compile_jobs() -> dict[str, list[tuple[str, dict[str, int]]]]:
    """Every (kernel file, defines) the head compiles (tests/test_nvcc_compile.py)."""
    return {"lenet-head (lenet_head)": [(KERNEL_FILE, dict(d)) for d in HEAD_VARIANTS.values()]}
