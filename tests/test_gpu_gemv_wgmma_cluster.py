"""Kernel 53 (`gemv-wgc-fp16`, `gemv-wgc-bf16`): classifier layers at batch 17-64 on the
warpgroup MMA, the row tiles of a k slice a thread-block cluster that converts the slice's x
once into global scratch before the weight stream needs it.

CPU tests: the launch plan (the cluster a power of two at most the layer's row tiles, the row
tiles whole clusters, the scratch one conversion of all of x a cluster of a slice, rings that do
not fit refused); the weights kernel 49's packing with zero rows up to the plan's row tiles;
bad parameters name the problem; CI's compile set covers every value. GPU tests: every mode
against the fp64 reference on fresh random shapes (B 1-64, C and M off the tile multiples),
outputs poisoned, at the defaults and at random points of the space, each run twice
(bit-identical); VGG's fc6 and fc7 at B = 17, 33, 64.
"""

from __future__ import annotations

import numpy as np
import pytest
from conv_cases import check_classifier_layers, check_two_runs, make_case

from convolab.gpu import gemv_mma, gemv_wgmma, gemv_wgmma_cluster
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = list(gemv_wgmma_cluster.MODES)
NAMES = [f"gemv-wgc-{m}" for m in MODES]
SPACE = gemv_wgmma_cluster.SPACE


def random_point(rng: np.random.Generator) -> dict[str, int]:
    return {k: v[int(rng.integers(len(v)))] for k, v in SPACE.items()}


def fits(mode: str, B: int, params: dict[str, int]) -> bool:
    d = gemv_wgmma_cluster.defines(mode, B, params)
    return gemv_wgmma_cluster.smem_bytes(d) <= gemv_mma.SMEM_LIMIT


@pytest.mark.parametrize("mode", MODES)
def test_launch_plan_takes_whole_clusters(mode: str, rng: np.random.Generator) -> None:
    for _ in range(60):
        shape = ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 4000)), 1, 1,
                          int(rng.integers(1, 5000)), 1)
        params = random_point(rng)
        if not fits(mode, shape.B, params):
            with pytest.raises(ValueError, match="shared memory"):
                gemv_wgmma_cluster.launch_plan(shape, mode, params)
            continue
        plan = gemv_wgmma_cluster.launch_plan(shape, mode, params, sms=int(rng.integers(1, 140)))
        d, rows = plan.defines, 128 * params["MT"]
        real = ceil_div(shape.M, rows)
        cluster = d["GC_CLUSTER"]
        assert cluster & (cluster - 1) == 0 and cluster <= min(params["CLUSTER"], real)
        assert cluster == params["CLUSTER"] or 2 * cluster > real  # only cut where tiles lack
        assert plan.tiles % cluster == 0 and real <= plan.tiles < real + cluster
        assert plan.chunks * 64 * d["GW_KT"] >= shape.C > (plan.chunks - 1) * 64 * d["GW_KT"]
        assert (plan.slices - 1) * plan.slice_chunks < plan.chunks
        assert plan.chunks <= plan.slices * plan.slice_chunks
        n = 8 * gemv_mma.n_tiles(shape.B)
        assert plan.scratch_bytes == plan.tiles // cluster * plan.chunks * d["GW_KT"] * n * 128
        assert plan.smem == d["GW_STAGES"] * d["GW_KT"] * (rows + n) * 128 + 1024


@pytest.mark.parametrize("mode", MODES)
def test_weights_are_kernel_49s_padded_to_whole_clusters(mode: str,
                                                         rng: np.random.Generator) -> None:
    shape = ConvShape(40, 8 * int(rng.integers(1, 30)), 1, 1, int(rng.integers(300, 900)), 1)
    params = {**gemv_wgmma_cluster.DEFAULTS, "MT": 1, "CLUSTER": 4}
    plan = gemv_wgmma_cluster.launch_plan(shape, mode, params, sms=8)
    w = rng.standard_normal((shape.M, shape.C)).astype(np.float32)
    packed = gemv_wgmma_cluster.pack_weights(w, mode, plan)
    tile = plan.chunks * gemv_wgmma.a_bytes(plan.defines)
    assert packed.size == plan.tiles * tile
    real = ceil_div(shape.M, 128)
    np.testing.assert_array_equal(packed[: real * tile],
                                  gemv_wgmma.pack_weights(w, mode, plan.defines))
    assert not packed[real * tile:].any(), "the padding tiles are not zero"


def test_bad_parameters_name_the_problem() -> None:
    with pytest.raises(ValueError, match="CLUSTER must be in"):
        gemv_wgmma_cluster.defines("fp16", 8, {**gemv_wgmma_cluster.DEFAULTS, "CLUSTER": 3})
    with pytest.raises(ValueError, match="STAGES"):
        gemv_wgmma_cluster.defines("fp16", 8, {**gemv_wgmma_cluster.DEFAULTS, "STAGES": 7})
    with pytest.raises(ValueError, match="unknown mode"):
        gemv_wgmma_cluster.defines("tf32", 8, gemv_wgmma_cluster.DEFAULTS)
    with pytest.raises(ValueError, match="shared memory"):
        gemv_wgmma_cluster.launch_plan(ConvShape(64, 25088, 1, 1, 4096, 1), "fp16",
                                       {**gemv_wgmma_cluster.DEFAULTS, "STAGES": 8, "KT": 2})
    assert not gemv_wgmma_cluster.supports(ConvShape(65, 64, 1, 1, 8, 1))
    assert not gemv_wgmma_cluster.supports(ConvShape(4, 64, 3, 3, 8, 1))


def test_compiled_define_sets_cover_every_value() -> None:
    compiled = gemv_wgmma_cluster.compile_variants("fp16")()
    for key, name in (("MT", "TM_MT"), ("KT", "GW_KT"), ("STAGES", "GW_STAGES"),
                      ("CLUSTER", "GC_CLUSTER")):
        assert {d[name] for d in compiled} == set(SPACE[key])
    assert {d["TM_NT"] for d in gemv_wgmma_cluster.compile_variants("bf16")()} == {1, 8}


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_mode_on_random_shapes(name: str, rng: np.random.Generator) -> None:
    mode = name.split("-")[-1]
    for i in range(8):
        shape = ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 600)), 1, 1,
                          int(rng.integers(1, 1500)), 1)
        params = None if i < 2 else random_point(rng)
        while params is not None and not fits(mode, shape.B, params):
            params = random_point(rng)  # a ring that does not fit is refused by prepare
        check_two_runs(name, make_case(rng, shape), params, TOLERANCE[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [17, 33, 64])
def test_vgg_classifier_layers(name: str, batch: int, rng: np.random.Generator) -> None:
    assert get_impl(name).supports(ConvShape(batch, 4096, 1, 1, 1024, 1))
    check_classifier_layers(name, batch, rng, TOLERANCE[name.split("-")[-1]])
