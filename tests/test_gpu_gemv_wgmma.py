"""Kernel 49 (`gemv-wg-fp16`, `gemv-wg-bf16`): classifier layers at batch 16-64 on the
warpgroup MMA, fed by a producer warpgroup (weights and x by the bulk copy engine, x converted in
shared memory).

CPU tests: every weight is found where the kernel's descriptors read it (addresses computed
here from the layout the kernel states: a block's chunk of KT k-tiles, each 2 MT tiles of 64
rows x 128 bytes, piece j of row r at j ^ (r mod 8), row 16 w + r of tile (g, mi) being kernel
42's m-tile mi of warp 4 g + w), everything else zero; the launch plan's slices cover k in
whole chunks and rings that do not fit are refused; bad parameters name the problem. GPU
tests: every mode against the fp64 reference on fresh random shapes (B 1-64, C and M off the
tile multiples), outputs poisoned, at the defaults and at random points of the space, each run
twice (bit-identical); VGG's fc6 and fc7 at B = 16, 33, 64.
"""

from __future__ import annotations

import numpy as np
import pytest
from conv_cases import check_classifier_layers, make_case, outputs_of_two_runs

from convolab.check import rel_l2
from convolab.gpu import gemv_mma, gemv_wgmma
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = list(gemv_wgmma.MODES)
NAMES = [f"gemv-wg-{m}" for m in MODES]


def random_point(rng: np.random.Generator) -> dict[str, int]:
    return {k: v[int(rng.integers(len(v)))] for k, v in gemv_wgmma.SPACE.items()}


def sixteen_bits(a: np.ndarray, mode: str) -> np.ndarray:
    """The operand's bit patterns, uint16, independently of the packer: fp16 by NumPy's cast,
    bf16 by rounding the fp32 bits to nearest even in fp64 arithmetic."""
    if mode == "fp16":
        return a.astype(np.float16).view(np.uint16)
    u = a.astype(np.float32).view(np.uint32).astype(np.int64)
    return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)


def weight_offsets(M: int, C: int, d: dict[str, int]) -> np.ndarray:
    """(M, C) element offsets of each weight in the packed buffer, from the kernel's reads."""
    mt, kt = d["TM_MT"], d["GW_KT"]
    rows = 128 * mt
    chunks = ceil_div(C, 64 * kt)
    m, k = np.meshgrid(np.arange(M), np.arange(C), indexing="ij")
    tile, in_tile = m // rows, m % rows
    warp, mi, r = in_tile // 16 // mt, in_tile // 16 % mt, in_tile % 16
    group, w = warp // 4, warp % 4
    chunk, ktile, j, e = k // (64 * kt), k // 64 % kt, k % 64 // 8, k % 8
    a_tile = (((tile * chunks + chunk) * kt + ktile) * 2 + group) * mt + mi
    row = 16 * w + r
    return (a_tile * 64 + row) * 64 + (j ^ (row % 8)) * 8 + e


@pytest.mark.parametrize("mode", MODES)
def test_weights_sit_where_the_descriptors_read_them(mode: str, rng: np.random.Generator) -> None:
    for _ in range(3):
        M, C = int(rng.integers(1, 600)), 8 * int(rng.integers(1, 40))
        d = gemv_wgmma.defines(mode, 8, random_point(rng))
        w = rng.standard_normal((M, C)).astype(np.float32)
        packed = gemv_wgmma.pack_weights(w, mode, d).view(np.uint16)
        tiles, chunks = ceil_div(M, 128 * d["TM_MT"]), ceil_div(C, 64 * d["GW_KT"])
        assert packed.size * 2 == tiles * chunks * gemv_wgmma.a_bytes(d)
        at = weight_offsets(M, C, d)
        np.testing.assert_array_equal(packed[at], sixteen_bits(w, mode), err_msg=str((M, C, d)))
        rest = np.ones(packed.size, bool)
        rest[at.reshape(-1)] = False
        assert not packed[rest].any(), "padding is not zero"


@pytest.mark.parametrize("mode", MODES)
def test_launch_plan_covers_k_in_whole_chunks(mode: str, rng: np.random.Generator) -> None:
    for _ in range(50):
        shape = ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 4000)), 1, 1,
                          int(rng.integers(1, 5000)), 1)
        params = random_point(rng)
        d = gemv_wgmma.defines(mode, shape.B, params)
        if gemv_wgmma.smem_bytes(d) > gemv_mma.SMEM_LIMIT:
            with pytest.raises(ValueError, match="shared memory"):
                gemv_wgmma.launch_plan(shape, mode, params)
            continue
        plan = gemv_wgmma.launch_plan(shape, mode, params, sms=int(rng.integers(1, 140)))
        assert plan.chunks * 64 * d["GW_KT"] >= shape.C > (plan.chunks - 1) * 64 * d["GW_KT"]
        per = plan.slice_chunks
        assert (plan.slices - 1) * per < plan.chunks <= plan.slices * per
        assert plan.tiles * 128 * d["TM_MT"] >= shape.M
        if params["SPLIT"]:
            assert plan.slices == ceil_div(plan.chunks, ceil_div(plan.chunks, min(
                params["SPLIT"], plan.chunks)))


def test_bad_parameters_name_the_problem() -> None:
    with pytest.raises(ValueError, match="MT, KT, STAGES and MINB"):
        gemv_wgmma.defines("fp16", 8, {**gemv_wgmma.DEFAULTS, "STAGES": 7})
    with pytest.raises(ValueError, match="unknown mode"):
        gemv_wgmma.defines("tf32", 8, gemv_wgmma.DEFAULTS)
    with pytest.raises(ValueError, match="batch 65"):
        gemv_wgmma.defines("fp16", 65, gemv_wgmma.DEFAULTS)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv_wgmma.pack_weights(np.zeros((4, 12), np.float32), "fp16",
                                gemv_wgmma.defines("fp16", 8, gemv_wgmma.DEFAULTS))
    assert not gemv_wgmma.supports(ConvShape(65, 64, 1, 1, 8, 1))
    assert not gemv_wgmma.supports(ConvShape(4, 64, 3, 3, 8, 1))


def test_compiled_define_sets_cover_every_value() -> None:
    compiled = gemv_wgmma.compile_variants("fp16")()
    for key, name in (("MT", "TM_MT"), ("KT", "GW_KT"), ("STAGES", "GW_STAGES")):
        assert {d[name] for d in compiled} == set(gemv_wgmma.SPACE[key])
    assert {d["TM_NT"] for d in gemv_wgmma.compile_variants("bf16")()} == {1, 8}


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_mode_on_random_shapes(name: str, rng: np.random.Generator) -> None:
    import cupy as cp

    mode = name.split("-")[-1]
    for i in range(8):
        shape = ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 600)), 1, 1,
                          int(rng.integers(1, 900)), 1)
        params = None if i < 2 else random_point(rng)
        while params is not None and gemv_wgmma.smem_bytes(
                gemv_wgmma.defines(mode, shape.B, params)) > gemv_mma.SMEM_LIMIT:
            params = random_point(rng)  # a ring that does not fit is refused by prepare
        case = make_case(rng, shape)
        outs = outputs_of_two_runs(name, case, params)
        err = rel_l2(outs[0], case.ref)
        assert err <= TOLERANCE[mode], (shape, params, err)
        assert bool(cp.array_equal(outs[0], outs[1])), (shape, params, "runs differ")


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [16, 33, 64])
def test_vgg_classifier_layers(name: str, batch: int, rng: np.random.Generator) -> None:
    assert get_impl(name).supports(ConvShape(batch, 4096, 1, 1, 1024, 1))
    check_classifier_layers(name, batch, rng, TOLERANCE[name.split("-")[-1]])


def test_auto_takes_kernel_49_for_fc6_in_fp16_from_batch_17() -> None:
    """fc6 in FP16 from AUTO_FROM_BATCH with AUTO_TILES' parameters; kernel 42/43 where kernel
    49 is not eligible (a GPU without wgmma), at smaller batch, in other modes, and on fc7."""
    from convolab.bench.cases import VGG_SWEEP_BATCHES
    from convolab.gpu import auto
    from convolab.registry import all_impls

    names = {i.name for i in all_impls("gpu")}
    fc6, fc7 = ConvShape(1, 25088, 1, 1, 4096, 1), ConvShape(1, 4096, 1, 1, 1024, 1)
    for batch in VGG_SWEEP_BATCHES:
        for mode in auto.GEMM_FAMILY:
            choice = auto.default_choice(fc6.with_batch(batch), names, mode)
            if mode == "fp16" and batch >= gemv_wgmma.AUTO_FROM_BATCH:
                assert choice.impl == "gemv-wg-fp16", (batch, choice)
                want = next(p for up_to, p in gemv_wgmma.AUTO_TILES if up_to >= batch)
                assert choice.params == want
                plan = gemv_wgmma.launch_plan(fc6.with_batch(batch), mode,
                                              get_impl(choice.impl).params_for(choice.params))
                assert plan.smem <= gemv_mma.SMEM_LIMIT
                fallback = auto.default_choice(fc6.with_batch(batch), names - {choice.impl}, mode)
                assert fallback.impl.startswith(("gemv-mma-", "gemv-bulk-")), fallback
            else:
                assert not choice.impl.startswith("gemv-wg"), (batch, mode, choice)
            assert not auto.default_choice(fc7.with_batch(batch), names,
                                           mode).impl.startswith("gemv-wg")
