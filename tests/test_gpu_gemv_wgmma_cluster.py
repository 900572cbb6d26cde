"""Kernel 54 (`gemv-wg-cluster-tf32`): a classifier layer in TF32 on the warpgroup MMA, x copied
straight into its swizzled operand, a row tile's k slices one cluster.

CPU tests: every weight sits where the kernel's descriptors read it (offsets computed here from
the layout the kernel states: row tile, chunk, wgmma tile mi, row r, piece j ^ (r mod 8)), TF32
rounded, everything else zero; the plan's slices cover k in whole chunks with none empty and at
most 8 (the cluster is exactly the slices); bad parameters and shapes are refused by name; and
the kernel source run on the CPU by an emulator (a cluster's blocks at once as std::threads,
each with its own shared memory poisoned with NaN, block barrier and mbarriers, so that the
producers and the consumer warpgroup really wait on each other; the wgmma reading its operands
through the descriptors and the 128-byte swizzle; the sums read across the cluster, rank 0
running ahead of the others at each cluster barrier: cuda_emulator's CLUSTER_SHIM) with B, M
and C off the tiles, slices of more chunks than the ring holds, MT 1 and 2, N 16, 48 and 64,
one block or a cluster of 2, 3 or 8, the clusters in a random order and the launch run twice:
bit-identical, nothing written past the output, TF32-accurate, and fp32-accurate against the
TF32-rounded operands.
GPU tests: fresh random shapes (B 1-64, C and M off the tiles) at the defaults and at random
points of the space, outputs poisoned, two runs bit-identical; fc6 / fc7 at B = 1, 13, 64; fp32
accuracy against its TF32-rounded operands (x rounded as the weights, not truncated).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conv_cases import check_classifier_layers, check_two_runs, make_case, outputs_of_two_runs
from cuda_emulator import (
    ASAN_OPTIONS,
    BLOCK_SHIM,
    CLUSTER_RUN_SHIM,
    CLUSTER_SHIM,
    CUDA_SHIM,
    GEMV_SHIM,
    LAG_SHIM,
    MBARRIER_SHIM,
    MMA_SHIM,
    WGMMA_SS_SHIM,
    build_emulator,
    cluster_sum_source,
    run_gemv_emulator,
)
from test_gpu_direct_conv import emulated_source as wgmma_emulated_source

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import gemv_wgmma_cluster as gt
from convolab.gpu.compile import define_flags
from convolab.gpu.implicit_gemm_wgmma import tf32_round
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape, ceil_div

NAME = gt.NAME
GXX = shutil.which("g++")


def random_shape(rng: np.random.Generator) -> ConvShape:
    """A linear layer: C a multiple of 8 (not of a chunk), M anything, B 1..64."""
    return ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 500)), 1, 1,
                     int(rng.integers(1, 700)), 1)


def fitting_point(rng: np.random.Generator, shape: ConvShape) -> dict[str, int]:
    """A random point whose ring fits in shared memory (prepare refuses the others)."""
    while True:
        point = {k: v[int(rng.integers(len(v)))] for k, v in gt.SPACE.items()}
        try:
            gt.launch_plan(shape, point)
        except ValueError:
            continue
        return point


# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mt", gt.SPACE["MT"])
def test_weights_sit_where_the_descriptors_read_them(mt: int, rng: np.random.Generator) -> None:
    M, C = int(rng.integers(1, 300)), 8 * int(rng.integers(1, 30))
    w = rng.standard_normal((M, C)).astype(np.float32)
    packed = gt.pack_weights(w, mt).view(np.float32)
    rows = 64 * mt
    tiles, chunks = ceil_div(M, rows), ceil_div(C, 32)
    assert packed.size * 4 == tiles * chunks * rows * 128
    m, k = np.meshgrid(np.arange(M), np.arange(C), indexing="ij")
    tile, mi, r = m // rows, m % rows // 64, m % 64
    chunk, j, e = k // 32, k % 32 // 4, k % 4
    a_tile = (tile * chunks + chunk) * mt + mi  # the block's chunk: MT tiles of 64 rows
    at = (a_tile * 64 + r) * 32 + (j ^ (r % 8)) * 4 + e
    np.testing.assert_array_equal(packed[at], tf32_round(w))
    rest = np.ones(packed.size, bool)
    rest[at.reshape(-1)] = False
    assert not packed[rest].any(), "padding is not zero"


def test_slices_cover_k_in_whole_chunks(rng: np.random.Generator) -> None:
    for _ in range(100):
        shape = random_shape(rng)
        point = fitting_point(rng, shape)
        sms = int(rng.integers(1, 200))
        plan = gt.launch_plan(shape, point, sms)
        chunks, split = ceil_div(shape.C, 32), plan.split
        assert plan.chunks == chunks and 1 <= split <= 8
        assert (split - 1) * plan.slice_chunks < chunks <= split * plan.slice_chunks, plan
        if point["SPLIT"]:
            assert split <= point["SPLIT"]
        else:
            assert plan.tiles * split <= max(sms, plan.tiles), (plan, sms)  # one wave
        assert plan.defines["DW_N"] % 16 == 0 and shape.B <= plan.defines["DW_N"] < shape.B + 16
        assert plan.smem == gt.smem_bytes(shape.B, point["MT"], point["STAGES"])
    fc7 = gt.launch_plan(ConvShape(64, 4096, 1, 1, 1024, 1), gt.DEFAULTS, 132)
    assert (fc7.grid, fc7.slice_chunks) == ((8, 8), 16)  # 64 blocks of 128 rows, 16 chunks


def test_bad_parameters_and_shapes_are_named() -> None:
    fc7 = ConvShape(64, 4096, 1, 1, 1024, 1)
    with pytest.raises(ValueError, match="STAGES must be one of"):
        gt.launch_plan(fc7, {**gt.DEFAULTS, "STAGES": 3})
    with pytest.raises(ValueError, match="shared memory"):
        gt.launch_plan(fc7, {**gt.DEFAULTS, "MT": 2, "STAGES": 12})
    with pytest.raises(ValueError, match="does not support shape"):
        gt.launch_plan(ConvShape(65, 4096, 1, 1, 1024, 1), gt.DEFAULTS)
    with pytest.raises(ValueError, match="does not support shape"):
        gt.launch_plan(ConvShape(2, 512, 14, 14, 512, 3), gt.DEFAULTS)


def test_auto_takes_kernel_54_for_small_layers_in_tf32() -> None:
    from convolab.gpu import auto

    for batch in (1, 13, 64):
        fc7 = ConvShape(batch, 4096, 1, 1, 1024, 1)
        choice = auto.default_choice(fc7, auto.eligible_impls(fc7, "tf32"), "tf32")
        assert (choice.impl, choice.params) == (NAME, {}), batch
        for mode in ("fp16", "fp32"):
            assert auto.default_choice(fc7, auto.eligible_impls(fc7, mode), mode).impl != NAME
        fc6 = ConvShape(batch, 25088, 1, 1, 4096, 1)  # the weight stream: not kernel 54's
        assert auto.default_choice(fc6, auto.eligible_impls(fc6, "tf32"), "tf32").impl != NAME


# ------------------------------------------------------------------------- CPU emulator

# Kernel 54's cluster on the CPU: cuda_emulator's CLUSTER_SHIM (the rank blockIdx.x; only the
# consumer warpgroup issues wgmmas; the dynamic shared memory starts EMU_DYN_PAD bytes in, so
# that the ring's 1 KB alignment takes some of the slack), its LAG_SHIM, and run_cluster for
# each row tile's cluster. argv as run_gemv_emulator passes it (dir, B, M, K, chunks, chunks a
# slice, tiles, slices = 1, launches, w bytes, seed): run_launches' units are the clusters, one
# a row tile, in a random order.
GT_MAIN = ASAN_OPTIONS + r"""
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), M = atoi(argv[3]), K = atoi(argv[4]);
  const int chunks_total = atoi(argv[5]), slice_chunks = atoi(argv[6]), tiles = atoi(argv[7]);
  if (atoi(argv[8]) != 1) std::abort();
  const GemvIo io = read_gemv_io(dir, B, M, K, tiles, 1, atol(argv[10]));
  run_launches(dir, io, tiles, 1, atoi(argv[9]), atoi(argv[11]), [&](int tile, int) {
    gridDim.x = GT_SPLIT, gridDim.y = tiles;
    run_cluster(GT_THREADS, [&](int r) {
      blockIdx.x = r, blockIdx.y = tile;
      gemv_wgmma_tf32(io.x, io.w, io.bias, io.y, B, M, K, chunks_total, slice_chunks);
    });
  });
}
"""


def emulated_source() -> str:
    """Kernel 54 as test_gpu_direct_conv leaves a wgmma kernel for the emulator (its PTX to the
    shims, dw_mma on wgss_mma, wgmma_core.cuh's descriptor functions kept: the encoding the
    kernel really uses; its dynamic shared memory `emu_smem`), cluster.cuh's primitives left
    to CLUSTER_SHIM."""
    source = wgmma_emulated_source(gt.KERNEL_FILE).replace('#include "cluster.cuh"',
                                                           cluster_sum_source())
    assert "asm" not in source, "inline PTX the emulator does not know"
    assert "#include" not in source and "__shared__" not in source
    return source


EMULATED = [  # (shape, params, slices, N): M and C off the tiles and the chunk, B off 16 or on
    # it, slices of more chunks than the ring's stages (its phases wrap), MT 1 and 2, one block
    # or a cluster
    (ConvShape(5, 200, 1, 1, 70, 1), {"MT": 1, "STAGES": 2, "SPLIT": 1}, 1, 16),  # 7 chunks
    (ConvShape(37, 264, 1, 1, 150, 1), {"MT": 2, "STAGES": 2, "SPLIT": 4}, 3, 48),  # 9 chunks
    (ConvShape(50, 760, 1, 1, 100, 1), {"MT": 1, "STAGES": 2, "SPLIT": 8}, 8, 64),  # 24 chunks
    (ConvShape(16, 648, 1, 1, 200, 1), {"MT": 2, "STAGES": 4, "SPLIT": 2}, 2, 16),  # 21 chunks
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("shape,params,slices,n", EMULATED)
def test_kernel_emulated_on_cpu(shape: ConvShape, params: dict[str, int], slices: int, n: int,
                                tmp_path: Path, rng: np.random.Generator) -> None:
    plan = gt.launch_plan(shape, {**gt.DEFAULTS, **params}, sms=132)
    d = plan.defines
    assert (plan.split, d["DW_N"]) == (slices, n)
    assert plan.slice_chunks > d["GT_STAGES"] and shape.C % 32 and shape.M % (64 * d["GT_MT"])
    dyn = 16 * int(rng.integers(1, 64))  # where dynamic shared memory starts: not on 1 KB
    main = (CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + GEMV_SHIM + CLUSTER_SHIM + MBARRIER_SHIM
            + WGMMA_SS_SHIM + LAG_SHIM + CLUSTER_RUN_SHIM + '#include "kernel.inc"\n' + GT_MAIN)
    exe = build_emulator(tmp_path, main, emulated_source(),
                         [*define_flags(d), "-DEMU_RANK=blockIdx.x", f"-DEMU_CLUSTER={slices}",
                          f"-DEMU_DYN_PAD={dyn}", f"-DEMU_SMEM_BYTES={plan.smem}"])
    case = make_case(rng, shape)
    packed = np.ascontiguousarray(gt.pack_weights(case.w.reshape(shape.M, -1), d["GT_MT"]))
    got = run_gemv_emulator(exe, tmp_path, case, packed, (plan.chunks, plan.slice_chunks),
                            plan.tiles, 1, int(rng.integers(2**31)))
    assert rel_l2(got, case.ref) <= TOLERANCE["tf32"], rel_l2(got, case.ref)
    # against the products of the TF32-rounded operands (x rounded, not truncated): only the
    # fp32 sums' error is left (the emulator sums each wgmma in fp64)
    ref = conv_reference(tf32_round(case.x), tf32_round(case.w), case.b)
    assert rel_l2(got, ref) <= TOLERANCE["fp32"], rel_l2(got, ref)


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_random_shapes_and_points(rng: np.random.Generator) -> None:
    for i in range(10):
        shape = random_shape(rng)
        params = None if i < 3 else fitting_point(rng, shape)
        check_two_runs(NAME, make_case(rng, shape), params, TOLERANCE["tf32"])


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_cluster_size_gives_the_layer(split: int, rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(37, 1000, 1, 1, 200, 1))  # M past a tile, C past a chunk
    outs = outputs_of_two_runs(NAME, case, {"SPLIT": split, "STAGES": 2})
    assert rel_l2(outs[0], case.ref) <= TOLERANCE["tf32"], split


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 13, 64])
def test_vgg_classifier_layers(batch: int, rng: np.random.Generator) -> None:
    check_classifier_layers(NAME, batch, rng, TOLERANCE["tf32"])


@pytest.mark.gpu
def test_fp32_accurate_against_its_rounded_operands(rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(24, 4096, 1, 1, 300, 1))
    got = outputs_of_two_runs(NAME, case)[0].get()
    ref = conv_reference(tf32_round(case.x), tf32_round(case.w), case.b)
    assert rel_l2(got, ref) <= TOLERANCE["fp32"], rel_l2(got, ref)
