"""Kernel 48 (`gemv-cluster-fp16`, `-bf16`, `-tf32`): a classifier layer in one launch, its k
slices one thread-block cluster summed through distributed shared memory; and the bound launch
(`launch.BoundLaunch`) it runs through.

CPU tests: the launch plan's slices cover k in whole chunks with at most 8 (a portable cluster),
one wave where the shape allows; the shared memory holds the ring and the tile of sums; the
packed TF32 weights are the TF32 rounding of kernel 42's fp32 fragments; bad parameters are
refused by name. GPU tests: every mode against the fp64 reference on fresh random shapes (B 1-64,
C and M off the tile multiples), outputs poisoned, at the defaults and at random points of the
space including each SPLIT, two runs bit-identical (the cluster adds in rank order); fc6 / fc7 at
B = 1, 13, 64; TF32 at fp32 accuracy against its rounded operands; BoundLaunch against CuPy's
own call of the same kernel, and its refusal of an argument it cannot bind.
"""

from __future__ import annotations

import numpy as np
import pytest
from conv_cases import check_classifier_layers, make_case, outputs_of_two_runs

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import gemv_cluster, gemv_mma
from convolab.gpu.implicit_gemm_wgmma import tf32_round
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = list(gemv_cluster.MODES)
NAMES = [f"gemv-cluster-{m}" for m in MODES]


def random_shape(rng: np.random.Generator) -> ConvShape:
    """A linear layer: C a multiple of 8 (not of a chunk), M anything, B 1..64."""
    return ConvShape(int(rng.integers(1, gemv_cluster.MAX_BATCH + 1)),
                     8 * int(rng.integers(1, 500)), 1, 1, int(rng.integers(1, 700)), 1)


def random_point(rng: np.random.Generator) -> dict[str, int]:
    return {k: v[int(rng.integers(len(v)))] for k, v in gemv_cluster.SPACE.items()}


def fitting_point(rng: np.random.Generator, mode: str, shape: ConvShape) -> dict[str, int]:
    """A random point whose ring fits in shared memory (prepare refuses the others)."""
    while True:
        point = random_point(rng)
        params = {**gemv_cluster.DEFAULTS, **point}
        try:
            gemv_cluster.launch_plan(shape, mode, params)
        except ValueError:
            continue
        return point


# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", MODES)
def test_slices_cover_k_in_whole_chunks(mode: str, rng: np.random.Generator) -> None:
    for _ in range(50):
        shape = random_shape(rng)
        params = {**gemv_cluster.DEFAULTS, **fitting_point(rng, mode, shape)}
        plan = gemv_cluster.launch_plan(shape, mode, params, sms=132)
        pk, cp_ = gemv_cluster.piece_k(mode), params["CP"]
        assert plan.pieces == ceil_div(shape.C, pk)
        assert plan.slice_pieces % cp_ == 0
        assert 1 <= plan.split <= gemv_cluster.MAX_SPLIT
        assert plan.split * plan.slice_pieces >= plan.pieces  # every piece in a slice
        assert plan.tiles == ceil_div(ceil_div(shape.M, 16), params["WARPS"])
        nsplit = plan.defines["TC_NSPLIT"]
        assert nsplit == min(params["NSPLIT"], plan.defines["TC_NT"])
        assert plan.defines["TC_NT"] % nsplit == 0  # the kernel's static_assert
        assert plan.threads == 32 * params["WARPS"] * nsplit <= 1024
        if params["SPLIT"]:
            assert plan.split == params["SPLIT"]  # (empty slices where chunks are fewer)
        else:  # no empty slice
            assert (plan.split - 1) * plan.slice_pieces < plan.pieces


def test_auto_split_fills_one_wave() -> None:
    plan = gemv_cluster.launch_plan(ConvShape(64, 4096, 1, 1, 1024, 1), "fp16",
                                    gemv_cluster.DEFAULTS, sms=132)
    assert (plan.split, plan.tiles) == (8, 16)  # fc7: 128 blocks on 132 SMs
    plan = gemv_cluster.launch_plan(ConvShape(64, 25088, 1, 1, 4096, 1), "fp16",
                                    gemv_cluster.DEFAULTS, sms=132)
    assert plan.split * plan.tiles <= 132 and plan.split == 2
    assert gemv_cluster.auto_split(tiles=1, chunks=3, sms=132) == 2  # a slice holds a chunk


@pytest.mark.parametrize("mode", MODES)
def test_shared_memory_holds_ring_and_sums(mode: str) -> None:
    for warps, cp_ in ((4, 2), (8, 8)):
        xrow = gemv_cluster.x_row(mode, cp_)
        # the bank rule the kernel asserts, and room for a chunk
        assert xrow % 32 == (4 if mode == "tf32" else 8)
        assert xrow >= cp_ * gemv_cluster.piece_k(mode)
        orow = gemv_cluster.operand_row(mode, cp_)
        assert orow % 8 == 4  # the kernel's static_assert
        assert orow >= cp_ * gemv_cluster.piece_k(mode) // (1 if mode == "tf32" else 2)
        d = {"TC_NT": 8, "TC_WARPS": warps, "TC_CP": cp_, "TC_XROW": xrow, "TC_OROW": orow,
             "TC_STAGES": 2}
        stage = warps * cp_ * 512 + 64 * xrow * 4
        assert gemv_cluster.smem_bytes(mode, {**d, "TC_XONCE": 0}) == max(2 * stage,
                                                                           64 * 16 * warps * 4)
        assert gemv_cluster.smem_bytes(mode, {**d, "TC_XONCE": 1}) == max(
            2 * stage + 64 * orow * 4, 64 * 16 * warps * 4)


def test_tf32_weights_are_rounded_fp32_fragments(rng: np.random.Generator) -> None:
    w2 = rng.standard_normal((40, 72)).astype(np.float32)
    packed = gemv_cluster.pack_weights(w2, "tf32")
    fragments = gemv_mma.operand_values(w2, "3xtf32")
    assert packed.shape == fragments.shape
    np.testing.assert_array_equal(packed, tf32_round(fragments))
    assert not np.array_equal(packed, fragments)  # the rounding did something
    np.testing.assert_array_equal(gemv_cluster.pack_weights(w2, "fp16"),
                                  gemv_mma.operand_values(w2, "fp16"))


def test_bad_parameters_name_the_problem() -> None:
    shape = ConvShape(8, 64, 1, 1, 32, 1)
    with pytest.raises(ValueError, match="SPLIT"):
        gemv_cluster.launch_plan(shape, "fp16", {**gemv_cluster.DEFAULTS, "SPLIT": 3})
    with pytest.raises(ValueError, match="mode"):
        gemv_cluster.launch_plan(shape, "3xtf32", gemv_cluster.DEFAULTS)
    with pytest.raises(ValueError, match="does not support"):
        gemv_cluster.launch_plan(ConvShape(65, 64, 1, 1, 32, 1), "fp16", gemv_cluster.DEFAULTS)
    with pytest.raises(ValueError, match="shared memory"):
        gemv_cluster.launch_plan(ConvShape(64, 64, 1, 1, 32, 1), "fp16",
                                 {**gemv_cluster.DEFAULTS, "CP": 8, "WARPS": 8, "STAGES": 6})


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_mode_on_random_shapes(name: str, rng: np.random.Generator) -> None:
    import cupy as cp

    mode = name.split("-")[-1]
    for i in range(8):
        shape = random_shape(rng)
        case = make_case(rng, shape)
        params = None if i < 2 else fitting_point(rng, mode, shape)
        outs = outputs_of_two_runs(name, case, params)
        err = rel_l2(outs[0], case.ref)
        assert err <= TOLERANCE[mode], (case.shape, params, err)
        assert bool(cp.array_equal(outs[0], outs[1])), (case.shape, params, "runs differ")


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_cluster_size_gives_the_layer(split: int, rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(37, 1000, 1, 1, 200, 1))  # M past a tile, C past a chunk
    outs = outputs_of_two_runs("gemv-cluster-fp16", case, {"SPLIT": split})
    assert rel_l2(outs[0], case.ref) <= TOLERANCE["fp16"], split


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 13, 64])
def test_vgg_classifier_layers(name: str, batch: int, rng: np.random.Generator) -> None:
    check_classifier_layers(name, batch, rng, TOLERANCE[name.split("-")[-1]])


@pytest.mark.gpu
def test_tf32_is_fp32_accurate_against_its_rounded_operands(rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(24, 4096, 1, 1, 300, 1))
    got = outputs_of_two_runs("gemv-cluster-tf32", case)[0].get()
    ref = conv_reference(tf32_round(case.x), tf32_round(case.w), case.b)
    assert rel_l2(got, ref) < rel_l2(got, case.ref) / 10


@pytest.mark.gpu
def test_bound_launch_is_cupys_call(rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.launch import BoundLaunch

    kernel = cp.RawKernel(r"""
    extern "C" __global__ void axpb(const float* x, float* y, float a, int n, long long shift) {
      const int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) y[i] = a * x[i] + (float)shift;
    }""", "axpb")
    n = 1000
    args = (None, None, np.float32(rng.standard_normal()), np.int32(n), np.int64(3))
    launch = BoundLaunch(kernel, (8,), (128,), args, per_call=(0, 1))
    for _ in range(2):  # new arrays each call: only their slots change
        x = cp.asarray(rng.standard_normal(n, dtype=np.float32))
        got, want = cp.full(n, cp.nan, cp.float32), cp.full(n, cp.nan, cp.float32)
        launch(x, got)
        kernel((8,), (128,), (x, want, *args[2:]))
        assert bool(cp.array_equal(got, want))
    with pytest.raises(TypeError, match="argument 2"):
        BoundLaunch(kernel, (8,), (128,), (None, None, 1.5, np.int32(n), np.int64(3)),
                    per_call=(0, 1))


def test_auto_takes_kernel_48_on_small_layers_only() -> None:
    from convolab.gpu import auto

    for batch in (1, 13, 64):
        fc7 = ConvShape(batch, 4096, 1, 1, 1024, 1)
        for mode in ("fp16", "tf32"):
            choice = auto.default_choice(fc7, auto.eligible_impls(fc7, mode), mode)
            assert choice.impl == f"gemv-cluster-{mode}", (batch, mode, choice)
            assert choice.params == gemv_cluster.auto_params(mode, batch)
            assert get_impl(choice.impl).params_for(choice.params)  # known parameters
        exact = auto.default_choice(fc7, auto.eligible_impls(fc7, "fp32"), "fp32")
        assert not exact.impl.startswith("gemv-cluster")  # no fp32-accurate mode
        fc6 = ConvShape(batch, 25088, 1, 1, 4096, 1)
        for mode in ("fp16", "tf32"):
            choice = auto.default_choice(fc6, auto.eligible_impls(fc6, mode), mode)
            assert not choice.impl.startswith("gemv-cluster"), (batch, mode, choice)
