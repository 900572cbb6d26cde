"""Rung 39 (implicit GEMM on wgmma, sm_90a).

GPU tests: every precision against the fp64 reference on fresh random shapes (C and M off the
tile multiples, K 1 and 3, stride 1 and 2), outputs poisoned with NaN, at the defaults and at
a random point of the tunable space; a 4608-term conv5_x-like sum in 3xTF32; `auto` taking the
rung on Hopper. CPU tests: the host's define rules and the kernel's index arithmetic replayed in
NumPy — the swizzled copies cover each stage piece once and land where the descriptor's
k-steps read them under the 128-byte swizzle, and the accumulator layout covers a
warpgroup's tile once.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conv_cases import Case, make_case
from test_gpu_implicit_gemm import random_shape, run_impl

from convolab.conv_cpu import conv_reference
from convolab.gpu import implicit_gemm as ig
from convolab.gpu import implicit_gemm_wgmma as wg
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape

MODES = ("3xtf32", "tf32", "fp16", "bf16")
NAMES = [f"igemm-wg-{m}" for m in MODES]
N_SHAPES = 10

# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", MODES)
def test_defaults_and_space_are_valid(mode: str) -> None:
    impl = get_impl(f"igemm-wg-{mode}")
    assert impl.tolerance == TOLERANCE[mode] and impl.rung == 39
    wg.wgmma_defines(mode, impl.defaults)
    variants = impl.compile_variants()
    assert variants
    for d in variants:
        assert d["IG_MODE"] == ig.MODES[mode]
        assert wg.smem_bytes(mode, d["BM"], d["BN"], d["STAGES"]) <= ig.SMEM_LIMIT
        assert wg.warpgroup_n(d["BM"], d["BN"]) in wg.WG_N
    for params in (ig.WGMMA_NARROW[mode], *ig.WGMMA_WIDE[mode]):
        wg.wgmma_defines(mode, impl.params_for(params))


@pytest.mark.parametrize(("mode", "bad"), [
    ("fp16", {"BM": 96, "BN": 128, "STAGES": 3}),               # BM is 64 or 128
    ("fp16", {"BM": 64, "BN": 64, "STAGES": 3}),                # warpgroup N of 32
    ("fp16", {"BM": 128, "BN": 512, "STAGES": 3}),              # warpgroup N of 512
    ("3xtf32", {"BM": 128, "BN": 256, "STAGES": 2}),            # 256 accumulators a thread
    ("fp16", {"BM": 128, "BN": 128, "STAGES": 2, "PIPE": 1}),   # no slot for the one in flight
    ("tf32", {"BM": 128, "BN": 256, "STAGES": 5, "PIPE": 1}),   # over shared memory
])
def test_bad_defines_are_refused(mode: str, bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="igemm-wg"):
        wg.wgmma_defines(mode, bad)


def test_plan_takes_wgmma_where_the_output_fills_the_gpu() -> None:
    conv5 = ConvShape(64, 512, 16, 16, 512, 3)
    conv1 = ConvShape(16, 64, 226, 226, 64, 3)
    fc6 = ConvShape(64, 25088, 1, 1, 4096, 1)
    for mode in MODES:
        name, params = ig.plan(conv5, mode, wgmma=True)
        assert name == f"igemm-wg-{mode}" and params in ig.WGMMA_WIDE[mode]
        assert ig.plan(conv1, mode, wgmma=True)[1] == ig.WGMMA_NARROW[mode]
        assert ig.plan(conv5, mode)[0] == f"igemm-{mode}"  # no wgmma: rung 26
        assert ig.plan(fc6, mode, wgmma=True)[0] == f"igemm-splitk-{mode}"


@pytest.mark.parametrize(("mode", "batch", "tile"), [
    # What the H100 sweeps measured fastest on conv5_x (docs/vgg.md).
    ("fp16", 64, (128, 192)), ("fp16", 32, (128, 192)), ("fp16", 16, (128, 128)),
    ("tf32", 64, (256, 192)), ("tf32", 32, (128, 192)), ("tf32", 12, (128, 128)),
    ("3xtf32", 64, (128, 192)), ("3xtf32", 32, (128, 192)), ("3xtf32", 16, (128, 128)),
])
def test_wave_model_picks_the_measured_tiles(mode: str, batch: int,
                                             tile: tuple[int, int]) -> None:
    got = ig.wgmma_tiles(ConvShape(batch, 512, 16, 16, 512, 3), mode, sms=132)
    assert (got["BM"], got["BN"]) == tile


def swizzle(offset: np.ndarray) -> np.ndarray:
    """The 128-byte swizzle on shared-memory byte offsets (1024-byte aligned base): address
    bits 4-6 (the 16-byte piece) XOR bits 7-9 (the row within 8 rows of 128 bytes)."""
    return offset ^ (((offset >> 7) & 7) << 4)


@pytest.mark.parametrize(("bm", "bn"), [(64, 128), (64, 256), (128, 64), (128, 128), (128, 256)])
def test_swizzled_copies_are_what_the_descriptors_read(bm: int, bn: int) -> None:
    """WgLoader: thread t copies piece kc = t % 8 of rows t/8 + 32 i to row*128 + ((kc ^ row%8)
    << 4). The wgmma reading row r, k-step s, half h at start + 32 s (+ r*128 + 16 h, then
    swizzled) must find logical piece 2s + h of row r, and the copies must cover every piece
    of the stage once."""
    for rows in (bm, bn):
        dst = {}
        for t, i in itertools.product(range(wg.THREADS), range(rows // wg.COPY_ROWS)):
            row, kc = t // 8 + wg.COPY_ROWS * i, t % 8
            dst[(row, kc)] = row * wg.ROW_BYTES + ((kc ^ ((t // 8) % 8)) << 4)
        assert sorted(dst.values()) == list(range(0, rows * wg.ROW_BYTES, 16))
        r = np.arange(rows)
        for s, h in itertools.product(range(wg.ROW_BYTES // 32), range(2)):
            read = swizzle(r * wg.ROW_BYTES + 32 * s + 16 * h)
            assert all(dst[(row, 2 * s + h)] == at for row, at in zip(r, read, strict=True))


@pytest.mark.parametrize("n", wg.WG_N)
def test_accumulators_cover_the_warpgroup_tile_once(n: int) -> None:
    """wg_store's map: register r of lane l of warp w is row 16 w + l/4 + 8 ((r/2) % 2),
    column 8 (r/4) + 2 (l % 4) + r % 2."""
    seen = [(16 * w + lane // 4 + 8 * ((r // 2) % 2), 8 * (r // 4) + 2 * (lane % 4) + r % 2)
            for w, lane, r in itertools.product(range(4), range(32), range(n // 2))]
    assert sorted(seen) == sorted(itertools.product(range(64), range(n)))


def test_host_tf32_rounding_matches_the_device_rule(rng: np.random.Generator) -> None:
    from convolab.gpu.fused_mma import tf32_bits

    a = (rng.standard_normal(4096) * 10.0 ** rng.integers(-20, 20, 4096)).astype(np.float32)
    assert np.array_equal(wg.tf32_round(a).view(np.uint32), tf32_bits(a))
    big = wg.tf32_round(a)
    small = wg.tf32_round(a - big)
    assert np.all(np.abs(big.astype(np.float64) + small - a) <= 2.0**-21 * np.abs(a))


def test_supported_unless_the_gpu_rules_wgmma_out() -> None:
    shape = ConvShape(1, 64, 18, 18, 64, 3)
    assert get_impl("igemm-wg-fp16").supports(shape) == (not wg.wgmma_ruled_out())
    assert not get_impl("igemm-wg-fp16").supports(ConvShape(70000, 3, 1, 1, 4, 1))


# ------------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def cases(module_seed: int) -> list[Case]:
    rng = np.random.default_rng(module_seed)
    return [make_case(rng, random_shape(rng)) for _ in range(N_SHAPES)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_precision_on_random_shapes(name: str, cases: list[Case],
                                          rng: np.random.Generator) -> None:
    impl = get_impl(name)
    keys = sorted(impl.space)
    valid = impl.compile_variants()
    failures = []
    for case in cases:
        assert impl.supports(case.shape)
        d = valid[int(rng.integers(len(valid)))]
        point = {k: d[k] for k in keys}
        for params in (None, point):
            err = run_impl(name, case, params)
            if not err <= impl.tolerance:
                failures.append(f"{case.shape} {params}: rel_l2 {err:.3g}")
    assert not failures, f"{name} (tol {impl.tolerance}):\n" + "\n".join(failures[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_conv5_like_deep_k(mode: str, rng: np.random.Generator) -> None:
    """conv5_x's 4608-term sums (C = 512, 3x3) at batch 2, on both tile kinds and the largest
    tile: the 3xTF32 per-k-tile fp32 adds must keep the long sum at fp32 accuracy."""
    shape = ConvShape(2, 512, 16, 16, 512, 3)
    x = rng.standard_normal(shape.x_shape, dtype=np.float32)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32) / np.float32(48)
    b = rng.standard_normal(shape.M, dtype=np.float32)
    case = Case(shape, x, w, b, conv_reference(x, w, b))
    impl = get_impl(f"igemm-wg-{mode}")
    largest = ({"BM": 128, "BN": 192, "STAGES": 2} if mode == "3xtf32" else
               {"BM": 256, "BN": 192, "STAGES": 3, "PIPE": 1})
    for params in (ig.WGMMA_NARROW[mode], *ig.WGMMA_WIDE[mode], largest):
        err = run_impl(impl.name, case, params)
        assert err <= impl.tolerance, f"{impl.name} {params}: {err:.3g}"


@pytest.mark.gpu
def test_auto_takes_wgmma_on_hopper() -> None:
    from convolab.gpu import auto

    conv5 = ConvShape(64, 512, 16, 16, 512, 3)
    eligible = auto.eligible_impls(conv5, "fp16")
    choice = auto.default_choice(conv5, eligible, "fp16")
    assert choice.impl == ("igemm-fp16" if wg.wgmma_ruled_out() else "igemm-wg-fp16")
