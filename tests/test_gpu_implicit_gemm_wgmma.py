"""Rungs 39 and 40 (implicit GEMM on wgmma, sm_90a; 40 with a producer warpgroup and
mbarriers).

GPU tests: every precision of both rungs against the fp64 reference on fresh random shapes (C and M
off the tile multiples, K 1 and 3, stride 1 and 2), outputs poisoned with NaN, at the defaults and
at a random point of the tunable space; a 4608-term conv5_x-like sum; the channels-last form
(`layout=nhwc`, with and without ReLU) against the same reference, converted for the comparison
only; split-K (SPLIT 2, 3, 4 and the shape's own, 0) in both layouts against the reference and
against the unsplit run, bit-identical when repeated; `auto` taking the rung on Hopper; 3xfp16 on
operands far from fp16's range (its powers-of-two scales). CPU tests: the host's define rules (the
unsplit define sets pinned: split-K adds sets, never renames one), the split rule and auto's model
around it, and the kernels' index arithmetic replayed in NumPy — the k-slices cover the k-tiles
once, the swizzled copies cover each stage piece once and land where the descriptor's k-steps read
them under the 128-byte swizzle, the accumulator layout covers a warpgroup's tile once, the NHWC
epilogue's staging and 16-byte stores cover the block's tile once, and rung 40's full/empty parities
never let the producer refill a slot still being read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import numpy as np
import pytest
from conv_cases import Case, make_case
from test_gpu_implicit_gemm import random_shape, run_impl

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import implicit_gemm as ig
from convolab.gpu import implicit_gemm_wgmma as wg
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = ("3xtf32", "tf32", "fp16", "bf16")  # with a channels-last form
ALL_MODES = (*MODES, "3xfp16")  # 3xfp16: NCHW input only (its x scale is made per call)
RUNGS = {39: wg.RUNG39, 40: wg.RUNG40}
NAMES = [r.prefix + m for r in RUNGS.values() for m in ALL_MODES]
NHWC_NAMES = [r.prefix + m for r in RUNGS.values() for m in MODES]
N_SHAPES = 10

# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("mode", MODES)
def test_defaults_and_space_are_valid(mode: str, rung: int) -> None:
    r = RUNGS[rung]
    impl = get_impl(r.prefix + mode)
    assert impl.tolerance == TOLERANCE[mode] and impl.rung == rung
    assert impl.defaults["layout"] == "nchw" and "layout" not in impl.space  # never tuned
    wg.wgmma_defines(mode, impl.defaults, r)
    variants = impl.compile_variants()
    tiled = [d for d in variants if "BM" in d]
    assert tiled and any(d.get("WG_NHWC") and d.get("WG_RELU") for d in tiled)
    sliced = [d for d in tiled if d.get("WG_KSLICED")]
    assert {bool(d.get("WG_NHWC")) for d in sliced} == {False, True}  # CI compiles both
    assert impl.defaults["SPLIT"] == 1 and impl.space["SPLIT"] == wg.SPLITS
    assert (wg.layout_defines(mode) in variants) == (rung == 39)  # 40 uses 39's layout pass
    for d in tiled:
        assert d["IG_MODE"] == ig.MODES[mode]
        assert wg.smem_bytes(mode, d["BM"], d["BN"], d["STAGES"], "WG_NHWC" in d) <= \
            ig.SMEM_LIMIT
        assert wg.warpgroup_n(d["BM"], d["BN"]) in wg.WG_N
    for params in wg.tiles(mode, r):
        wg.wgmma_defines(mode, impl.params_for(params), r)
    if rung == 39:
        wg.wgmma_defines(mode, impl.params_for(ig.WGMMA_NARROW[mode]))


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("mode", MODES)
def test_ci_compiles_every_pair_of_tile_values(mode: str, rung: int) -> None:
    """CI's nvcc list (the registry's compile_variants) is a subset of every tile's sets that
    still holds each pair of tile values a valid tile has, and the same extra sets."""
    r = RUNGS[rung]
    ci = get_impl(r.prefix + mode).compile_variants()
    every = wg.define_sets(mode, r)
    assert all(d in every for d in ci) and len(ci) < len(every)
    names = {"BM": "BM", "BN": "BN", "STAGES": "STAGES", "PIPE": "PIPE", "TMA": "WP_TMA"}
    keys = [names[k] for k in wg.space(mode, r) if k != "SPLIT"]
    plain = [d for d in every if "BM" in d and not (set(d) - {"IG_MODE", "PIPE", *keys})]
    assert plain
    for d in plain:
        for a, b in itertools.combinations(keys, 2):
            assert any(c.get(a) == d.get(a) and c.get(b) == d.get(b) for c in ci), (a, b, d)
    assert [d for d in every if d not in plain] == [d for d in ci if d not in plain]


@pytest.mark.parametrize(("mode", "bad", "rung"), [
    ("fp16", {"BM": 96, "BN": 128, "STAGES": 3}, 39),               # BM is 64 or 128
    ("fp16", {"BM": 64, "BN": 64, "STAGES": 3}, 39),                # warpgroup N of 32
    ("fp16", {"BM": 128, "BN": 512, "STAGES": 3}, 39),              # warpgroup N of 512
    ("3xtf32", {"BM": 128, "BN": 256, "STAGES": 2}, 39),            # 256 accumulators a thread
    ("fp16", {"BM": 128, "BN": 128, "STAGES": 2, "PIPE": 1}, 39),   # no slot for the one in flight
    ("tf32", {"BM": 128, "BN": 256, "STAGES": 5, "PIPE": 1}, 39),   # over shared memory
    ("fp16", {"BM": 64, "BN": 128, "STAGES": 3}, 40),               # one block an SM: no 64 rows
    ("fp16", {"BM": 128, "BN": 128, "STAGES": 3, "layout": "nwhc"}, 39),  # no such layout
    ("fp16", {"BM": 128, "BN": 128, "STAGES": 3, "relu": 2}, 40),
    ("fp16", {"BM": 128, "BN": 128, "STAGES": 3, "TMA": 1}, 39),   # rung 39 has no TMA path
    ("tf32", {"BM": 128, "BN": 128, "STAGES": 3, "SPLIT": -1}, 40),  # 0, 1 or the slices
    ("3xfp16", {"BM": 128, "BN": 128, "STAGES": 3, "layout": "nhwc"}, 39),  # NCHW only
])
def test_bad_defines_are_refused(mode: str, bad: dict[str, int], rung: int) -> None:
    with pytest.raises(ValueError, match="igemm-wg"):
        wg.wgmma_defines(mode, bad, RUNGS[rung])


@pytest.mark.parametrize("rung", RUNGS)
def test_3xfp16_builds_nchw_sets_only(rung: int) -> None:
    """3xfp16's define sets: its own IG_MODE, two planes (3xTF32's ring and accumulators at
    twice the k a stage), PIPE 0, no channels-last set; its tiles are 3xTF32's."""
    r = RUNGS[rung]
    impl = get_impl(r.prefix + "3xfp16")
    assert impl.tolerance == TOLERANCE["3xfp16"] and impl.space == wg.space("3xtf32", r)
    sets = impl.compile_variants()
    assert sets and all(d["IG_MODE"] == 4 and d["PIPE"] == 0 and "WG_NHWC" not in d
                        for d in sets)
    assert any(d.get("WG_KSLICED") for d in sets)
    assert (wg.layout_defines("3xfp16") in sets) == (rung == 39)
    assert wg.tiles("3xfp16", r) == wg.tiles("3xtf32", r)
    assert wg.planes("3xfp16") == 2 and wg.operand_dtype("3xfp16") == np.float16
    assert wg.smem_bytes("3xfp16", 128, 192, 2) == wg.smem_bytes("3xtf32", 128, 192, 2)
    assert ig.wgmma_k_tiles(CONV5[64], "3xfp16") * 2 == ig.wgmma_k_tiles(CONV5[64], "3xtf32")
    with pytest.raises(ValueError, match="3xfp16 takes NCHW"):
        wg.wgmma_defines("3xfp16", {**impl.defaults, "layout": "nhwc"}, r)
    with pytest.raises(ValueError, match="igemm: unknown mode"):  # rung 26 has none
        ig.igemm_defines("3xfp16", {"BM": 128, "BN": 128, "BK": 64, "STAGES": 3})


def test_fp16_split_keeps_22_bits(rng: np.random.Generator) -> None:
    """hi + lo of a value scaled into fp16's top binades is within 2^-22 of it (what makes
    3xfp16 exact, precision.py), and the weights' exponent is the kernels' rule (max |w| 2^e
    in [2^14, 2^15))."""
    for magnitude in (1e-20, 1e-3, 1.0, 3e4, 1e20):
        w = (rng.standard_normal(4096) * magnitude).astype(np.float32)
        e = wg.weight_exponent(w)
        assert 2.0**14 <= np.abs(w).max() * 2.0**e < 2.0**15, (magnitude, e)
        scaled = np.ldexp(w, e).astype(np.float32)
        hi, lo = wg.split_fp16(scaled)
        assert hi.dtype == lo.dtype == np.float16
        back = hi.astype(np.float64) + lo.astype(np.float64)
        big = np.abs(scaled) >= 2.0**-3  # lo a normal fp16 there
        assert np.all(np.abs(back - scaled)[big] <= np.abs(scaled[big]) * 2.0**-22), magnitude
        assert np.all(np.abs(back - scaled) <= np.maximum(np.abs(scaled) * 2.0**-22, 2.0**-25))
    assert wg.weight_exponent(np.zeros(3, np.float32)) == 126


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bm", [128, 256])
def test_tensor_map_box_is_a_stage_a_section(mode: str, bm: int) -> None:
    """Rung 40's TMA box: one 128-byte k-tile (the 128-byte swizzle's span, which the driver
    requires the inner box to fit) of BM rows in every plane, which the kernel's expect_tx
    counts as WG_A_ROWS * 128 bytes; strides a multiple of 16 bytes, box dims at most 256."""
    esize = np.dtype(wg.operand_dtype(mode)).itemsize
    planes = wg.planes(mode)
    kd = ig.gemm_dims(ConvShape(2, 500, 16, 16, 300, 3))[2]
    dims, strides, box = wg.tensor_map_geometry(planes, 300, kd, esize, bm)
    assert dims == (kd, 300, planes) and box[1:] == (bm, planes)
    assert box[0] * esize == wg.ROW_BYTES and max(box) <= 256
    assert all(s % 16 == 0 for s in strides) and strides == (kd * esize, 300 * kd * esize)
    assert box[0] * box[1] * box[2] * esize == bm * planes * wg.ROW_BYTES


def test_nhwc_staging_can_outgrow_the_ring() -> None:
    ring = wg.smem_bytes("fp16", 128, 192, 2)
    staged = wg.smem_bytes("fp16", 128, 192, 2, nhwc=True)
    assert staged - wg.ALIGN_SLACK == 192 * (128 + wg.EPILOGUE_PAD) * 4 > ring - wg.ALIGN_SLACK
    assert wg.smem_bytes("fp16", 256, 192, 4, nhwc=True) == wg.smem_bytes("fp16", 256, 192, 4)


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
    # What the sweeps measured fastest on conv5_x (docs/vgg.md; B = 16 TF32 / FP16: 128 x 96,
    # 132 tiles in one wave, on the H200; the others the H100).
    ("fp16", 64, (128, 192)), ("fp16", 32, (128, 192)), ("fp16", 16, (128, 96)),
    ("tf32", 64, (256, 192)), ("tf32", 32, (128, 192)), ("tf32", 16, (128, 96)),
    ("3xtf32", 64, (128, 192)), ("3xtf32", 32, (128, 192)), ("3xtf32", 16, (128, 128)),
])
def test_wave_model_picks_the_measured_tiles(mode: str, batch: int,
                                             tile: tuple[int, int]) -> None:
    """(Unsplit runs: the sweeps predate split-K.)"""
    got = ig.wgmma_tiles(ConvShape(batch, 512, 16, 16, 512, 3), mode, sms=132, split=False)
    assert (got["BM"], got["BN"]) == tile and "SPLIT" not in got


# The unsplit define sets of both rungs other than BN = 96's (155, sorted JSON lines), pinned:
# the cubin cache and every measured tile name them, so a new option adds sets (BN = 96: 18)
# and leaves these alone.
UNSPLIT_SETS_SHA256 = "7c24248edb08eeb91be9aba844467a6a0ab6ca6feaf2f6d10115194d45d6a7d2"


def test_unsplit_define_sets_stay_pinned() -> None:
    sets = [d for r in RUNGS.values() for m in MODES for d in wg.define_sets(m, r)
            if "WG_KSLICED" not in d]
    assert sum(d.get("BN") == 96 for d in sets) == 18
    lines = sorted(json.dumps(d, sort_keys=True) for d in sets if d.get("BN") != 96)
    assert len(lines) == 155
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == UNSPLIT_SETS_SHA256
    tile = {"BM": 128, "BN": 128, "STAGES": 4}
    assert wg.wgmma_defines("fp16", {**tile, "SPLIT": 1}) == wg.wgmma_defines("fp16", tile)
    for split in (0, 2, 3, 7):  # one set for every factor: the slices are gridDim.z
        assert wg.wgmma_defines("fp16", {**tile, "SPLIT": split}) == \
            {**wg.wgmma_defines("fp16", tile), "WG_KSLICED": 1}


CONV5 = {b: ConvShape(b, 512, 16, 16, 512, 3) for b in (1, 2, 3, 4, 8, 12, 16, 20, 24, 32, 64)}


@pytest.mark.parametrize(("mode", "tile", "batch", "want"), [
    ("fp16", (128, 192), 8, 3),    # 36 tiles: 108 blocks of 24 k-tiles
    ("fp16", (128, 128), 8, 2),    # 52 tiles: 104 blocks
    ("fp16", (256, 192), 8, 6),    # 18 tiles: WG_MAX_SPLIT
    ("tf32", (128, 128), 3, 6),    # 20 tiles: 120 blocks of 24 k-tiles
    ("tf32", (128, 96), 4, 3),     # 36 tiles: 4 slices would make 144 blocks
    ("fp16", (256, 192), 16, 3),   # 34 tiles: 102 blocks
    ("tf32", (128, 192), 12, 2),
    ("fp16", (128, 128), 16, 1),   # 100 tiles: a second slice each would make two waves
    ("fp16", (128, 192), 32, 1),   # 132 tiles fill the SMs
])
def test_split_rule_fills_one_wave(mode: str, tile: tuple[int, int], batch: int,
                                   want: int) -> None:
    t = {"BM": tile[0], "BN": tile[1]}
    assert ig.wgmma_split(CONV5[batch], mode, t, sms=132) == want
    assert wg.split_of(CONV5[batch], mode, {**t, "SPLIT": 0}, sms=132) == want


def test_split_rule_keeps_k_tiles_in_each_slice() -> None:
    one_tile = {"BM": 128, "BN": 128}
    # 8 k-tiles of fp16 (Kd = 512): two slices of 4; 7 k-tiles: no split
    assert ig.wgmma_split(ConvShape(1, 512, 4, 4, 100, 1), "fp16", one_tile) == 2
    assert ig.wgmma_split(ConvShape(1, 448, 4, 4, 100, 1), "fp16", one_tile) == 1
    assert ig.wgmma_split(ConvShape(1, 448, 4, 4, 100, 1), "tf32", one_tile) == 3  # 14 k-tiles
    shape = ConvShape(1, 3, 8, 8, 100, 1)  # one k-tile
    assert wg.split_of(shape, "fp16", {**one_tile, "SPLIT": 1}) == 1
    with pytest.raises(ValueError, match="SPLIT=2 k-slices need 1 to 1"):
        wg.split_of(shape, "fp16", {**one_tile, "SPLIT": 2})


@pytest.mark.parametrize("mode", MODES)
def test_split_rule_counts_one_block_an_sm(mode: str) -> None:
    """The split rule fills one wave of one block an SM. Every wide tile but 128 x 96 takes
    over half an SM's shared memory, so one is all an SM holds; 128 x 96 fits two, and the
    rule still counts one (a second block on an SM finishes last, docs/vgg.md)."""
    from convolab.gpu.device import resident_blocks

    for r in RUNGS.values():
        for t in wg.tiles(mode, r):
            smem = wg.smem_bytes(mode, t["BM"], t["BN"], t["STAGES"])
            assert resident_blocks(1, r.threads, smem) == (2 if t["BN"] == 96 else 1), t
            for shape in CONV5.values():
                M, N, _ = ig.gemm_dims(shape)
                tiles = ceil_div(M, t["BM"]) * ceil_div(N, t["BN"])
                split = ig.wgmma_split(shape, mode, t, sms=132)
                assert split == 1 or tiles * split <= 132, (t, shape.B)


def _auto(shape: ConvShape, mode: str, wgmma_family: bool = False) -> tuple[str, dict[str, Any]]:
    """auto's shape model among the implicit GEMMs (kernel 41 left out), wgmma available;
    for fp32 the 3xTF32 rungs only, or with `wgmma_family` also the wgmma rungs' 3xfp16."""
    from convolab.gpu import auto

    family = {"fp32": "3xtf32", "tf32": "tf32", "fp16": "fp16"}[mode]
    names = {f"igemm-{family}", f"igemm-splitk-{family}", f"igemm-wg-{family}",
             f"igemm-wgp-{family}"}
    if wgmma_family:
        names |= {r.prefix + auto.WGMMA_FAMILY[mode] for r in RUNGS.values()}
    choice = auto.default_choice(shape, names, mode)
    return choice.impl, choice.params


@pytest.mark.parametrize("batch", sorted(CONV5))
def test_auto_runs_fp32_as_3xfp16_on_the_wgmma_rungs(batch: int) -> None:
    """fp32 on conv5_x and conv1_2: where the 3xTF32 model picks a wgmma rung, the same tiles
    in 3xfp16, on rung 40 where they are 128 x 192 unsplit (conv5_x B >= 24), else rung 39;
    rung 27's split-K keeps B <= 2; without 3xfp16 eligible, 3xTF32 as before."""
    conv5 = CONV5[batch]
    plain = _auto(conv5, "fp32")
    name, params = _auto(conv5, "fp32", wgmma_family=True)
    if plain[0].startswith("igemm-splitk"):
        assert (name, params) == plain and batch <= 2
    else:
        assert params == plain[1] or name == "igemm-wgp-3xfp16"
        wide = params["BN"] == 192 and "SPLIT" not in params
        assert name == ("igemm-wgp-3xfp16" if wide else "igemm-wg-3xfp16"), (batch, params)
        assert wide == (batch >= 24), batch
    conv1_2 = ConvShape(batch, 64, 226, 226, 64, 3)
    assert _auto(conv1_2, "fp32", wgmma_family=True) == ("igemm-wg-3xfp16",
                                                         ig.WGMMA_NARROW["3xtf32"])


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16"])
def test_auto_splits_rung_39_on_conv5_x_where_its_tiles_fill_under_half_the_sms(mode: str
                                                                                ) -> None:
    """B <= 2 (N < 512): rung 27's narrow split-K tiles; B = 3-12 (128 x 128 tiles under 0.6
    of 132 SMs): rung 39 split into one wave of 67-132 blocks; from B = 16 whole tiles (rung
    40's split ran slower for NCHW callers, and whole tiles won, docs/vgg.md)."""
    family = {"fp32": "3xtf32", "tf32": "tf32", "fp16": "fp16"}[mode]
    for batch, shape in CONV5.items():
        name, params = _auto(shape, mode)
        tiles = ceil_div(shape.B * 196, 128) * 4
        if batch <= 2:
            assert name == f"igemm-splitk-{family}", batch
        elif tiles < 0.6 * 132:
            assert name == f"igemm-wg-{family}" and params["SPLIT"] == 0, batch
            split = wg.split_of(shape, family, params)
            blocks = ceil_div(shape.B * 196, params["BN"]) * (512 // params["BM"]) * split
            assert 2 <= split <= ig.WG_MAX_SPLIT and 66 < blocks <= 132, (batch, blocks)
        else:
            assert params.get("SPLIT", 1) == 1 and name.startswith("igemm-wg"), batch
    assert all(_auto(CONV5[b], mode)[1]["SPLIT"] == 0 for b in (3, 4, 8, 12))
    assert _auto(CONV5[16], mode)[1].get("SPLIT", 1) == 1


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16"])
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64])
def test_auto_keeps_fc_layers_and_conv1_2_unsplit(mode: str, batch: int) -> None:
    """fc6/fc7 (N = B) stay on rung 27 (kernel 41 is left out here), conv1_2 on rung 39's
    64-row tiles, none of them split in the wgmma rungs."""
    family = {"fp32": "3xtf32", "tf32": "tf32", "fp16": "fp16"}[mode]
    for fc in (ConvShape(batch, 25088, 1, 1, 4096, 1), ConvShape(batch, 4096, 1, 1, 1024, 1)):
        assert _auto(fc, mode)[0] == f"igemm-splitk-{family}"
    name, params = _auto(ConvShape(batch, 64, 226, 226, 64, 3), mode)
    assert (name, params) == (f"igemm-wg-{family}", ig.WGMMA_NARROW[family])


def test_plans_are_valid_for_every_vgg_batch() -> None:
    """What auto's model gives the wgmma rungs on every VGG layer and sweep batch builds, and
    its split resolves to a factor the shape has k-tiles for."""
    from convolab.bench.cases import VGG_SWEEP_BATCHES, vgg_cases

    for family, case, batch in itertools.product(("3xtf32", "tf32", "fp16"), vgg_cases(64),
                                                 VGG_SWEEP_BATCHES):
        shape = case.shape.with_batch(batch)
        name, params = ig.plan(shape, family, wgmma=True)
        plans = [(name, params), wg.pipelined_plan(shape, family)]
        for name, params in (pl for pl in plans if pl and pl[0].startswith("igemm-wg")):
            impl, rung = get_impl(name), RUNGS[get_impl(name).rung]
            full = impl.params_for(params)
            wg.wgmma_defines(family, full, rung)
            assert 1 <= wg.split_of(shape, family, full) <= ig.WG_MAX_SPLIT


def test_k_slices_cover_the_k_tiles_once() -> None:
    """wg_k_range: slice z of n is [z t / n, (z + 1) t / n): together every k-tile once, none
    empty while n <= t, lengths within one of each other."""
    for tiles, slices in itertools.product(range(1, 80), range(1, 9)):
        if slices > tiles:
            continue
        bounds = [(z * tiles // slices, (z + 1) * tiles // slices) for z in range(slices)]
        assert [k for a, b in bounds for k in range(a, b)] == list(range(tiles))
        lengths = {b - a for a, b in bounds}
        assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize("elem", [2, 4])
def test_split_reduce_reads_the_slabs_in_the_output_order(elem: int) -> None:
    """The slab of partial sums holds the output's elements in its order: wg_splitk_reduce's
    channel of element i is (i / pix) % M (NCHW) or i % Mp (channels-last, OV = 16 / elem
    channels a thread, Mp a multiple of OV), which is where the epilogues put channel m."""
    b, m, pix = 3, 13, 10
    nchw = np.arange(b * m * pix).reshape(b, m, pix)
    assert np.array_equal((nchw // pix) % m, np.broadcast_to(np.arange(m)[:, None], nchw.shape))
    mp, ov = ig.padded_channels(m), 16 // elem
    assert mp % ov == 0
    at = np.arange(0, b * pix * mp, ov)
    chans = [(a % mp) + j for a in at for j in range(ov)]
    assert chans == list(np.arange(mp)) * (b * pix)
    assert wg.slab_elements(ConvShape(b, 8, 5, 2, m, 1), nhwc=False) == b * m * pix
    assert wg.slab_elements(ConvShape(b, 8, 5, 2, m, 1), nhwc=True) == b * mp * pix


def swizzle(offset: np.ndarray) -> np.ndarray:
    """The 128-byte swizzle on shared-memory byte offsets (1024-byte aligned base): address
    bits 4-6 (the 16-byte piece) XOR bits 7-9 (the row within 8 rows of 128 bytes)."""
    return offset ^ (((offset >> 7) & 7) << 4)


@pytest.mark.parametrize("loaders", [wg.RUNG39.loaders, wg.RUNG40.loaders])
@pytest.mark.parametrize(("bm", "bn"), [(64, 128), (64, 256), (128, 64), (128, 128), (128, 256),
                                        (256, 192)])
def test_swizzled_copies_are_what_the_descriptors_read(bm: int, bn: int, loaders: int) -> None:
    """WgLoader<LT>: thread t copies piece kc = t % 8 of rows t/8 + (LT/8) i to row*128 +
    ((kc ^ row%8) << 4). The wgmma reading row r, k-step s, half h at start + 32 s (+ r*128 +
    16 h, then swizzled) must find logical piece 2s + h of row r, and the copies must cover
    every piece of the stage once."""
    pass_rows = loaders // 8
    for rows in (bm, bn):
        dst = {}
        for t, i in itertools.product(range(loaders), range(rows // pass_rows)):
            row, kc = t // 8 + pass_rows * i, t % 8
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


def _block_map(bm: int, bn: int) -> list[tuple[int, int, int, int, int]]:
    """(ctid, register index over mi and r, m, n) of every accumulator of a block: warpgroup g
    = ctid / 128 takes rows a_row.. and columns b_row.. (BM = 64: side by side along n)."""
    groups_n = 2 if bm == 64 else 1
    wn, mi_count = bn // groups_n, 2 if bm == 256 else 1
    out = []
    for ctid, mi, r in itertools.product(range(256), range(mi_count), range(wn // 2)):
        g, warp, lane = ctid // 128, (ctid // 32) % 4, ctid % 32
        a_row, b_row = (g // groups_n) * 64 * mi_count, (g % groups_n) * wn
        m = a_row + 64 * mi + 16 * warp + lane // 4 + 8 * ((r // 2) % 2)
        n = b_row + 8 * (r // 4) + 2 * (lane % 4) + r % 2
        out.append((ctid, mi * wn // 2 + r, m, n))
    return out


@pytest.mark.parametrize(("bm", "bn"), [(64, 128), (128, 128), (128, 192), (256, 192)])
@pytest.mark.parametrize("elem", [2, 4])
def test_nhwc_epilogue_covers_the_tile_once(bm: int, bn: int, elem: int) -> None:
    """wg_store_nhwc: every accumulator lands at stage[n * (BM + 4) + m], once, with the 32
    lanes of one store in 32 different banks; then 16-byte runs of OV = 16 / elem channels of
    one pixel, vector v at (n, m) = (v / (BM / OV), (v % (BM / OV)) OV), cover the tile once."""
    ld = bm + wg.EPILOGUE_PAD
    acc = _block_map(bm, bn)
    assert sorted((m, n) for _, _, m, n in acc) == sorted(itertools.product(range(bm), range(bn)))
    by_store: dict[tuple[int, int], list[int]] = {}
    for ctid, reg, m, n in acc:
        by_store.setdefault((ctid // 32, reg), []).append((n * ld + m) % 32)
    assert all(len(set(banks)) == 32 for banks in by_store.values())
    ov = 16 // elem
    per_row = bm // ov
    out = [(v // per_row, (v % per_row) * ov + j) for v in range(bn * per_row) for j in range(ov)]
    assert sorted(out) == sorted(itertools.product(range(bn), range(bm)))


def _simulate_ring(stages: int, pipe: int, tiles: int, rng: np.random.Generator) -> None:
    """Rung 40's protocol with the kernel's parities, in a random interleaving of the producer
    and the two consumer warpgroups. mbarrier.try_wait.parity(P) passes once the barrier's
    current phase k has k % 2 != P; a phase completes when its expected arrivals came."""
    phase = {("full", s): 0 for s in range(stages)} | {("empty", s): 0 for s in range(stages)}
    arrived = dict.fromkeys(phase, 0)
    need = {("full", s): 1 for s in range(stages)} | {("empty", s): 2 for s in range(stages)}
    slot = [-1] * stages  # the k-tile each slot holds
    in_flight: list[set[int]] = [set(), set()]  # k-tiles each consumer's wgmmas still read
    nxt = [0, 0, 0]  # producer, consumer 0, consumer 1

    def passes(bar: tuple[str, int], parity: int) -> bool:
        return phase[bar] % 2 != parity

    def arrive(bar: tuple[str, int]) -> None:
        arrived[bar] += 1
        if arrived[bar] == need[bar]:
            phase[bar], arrived[bar] = phase[bar] + 1, 0

    stalled = 0
    while min(nxt) < tiles:
        stalled += 1
        assert stalled < 1000, f"deadlock at k-tiles {nxt}"
        who = int(rng.integers(3))
        t = nxt[who]
        if t >= tiles:
            continue
        s = t % stages
        if who == 0:
            if t >= stages and not passes(("empty", s), ((t // stages) & 1) ^ 1):
                continue
            assert not any(k % stages == s for f in in_flight for k in f), "refilled while read"
            slot[s] = t
            arrive(("full", s))
        else:
            c = who - 1
            if not passes(("full", s), (t // stages) & 1):
                continue
            assert slot[s] == t, "read a slot before its k-tile landed"
            in_flight[c] = {k for k in in_flight[c] | {t} if k > t - pipe}  # wait<PIPE>
            if t >= pipe:
                arrive(("empty", (t - pipe) % stages))
        nxt[who] += 1
        stalled = 0


@pytest.mark.parametrize(("stages", "pipe"), [(2, 0), (3, 0), (3, 1), (4, 1)])
def test_ring_parities_never_refill_a_slot_in_use(stages: int, pipe: int,
                                                  rng: np.random.Generator) -> None:
    for tiles in (1, 2, stages, 9, 40):
        for _ in range(20):
            _simulate_ring(stages, pipe, tiles, rng)


@pytest.mark.parametrize("mode", MODES)
def test_from_operand_undoes_the_channels_last_layout(mode: str,
                                                      rng: np.random.Generator) -> None:
    b, c, h, w = 2, 13, 5, 7
    x = rng.standard_normal((b, c, h, w)).astype(np.float32)
    x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # exact in every type
    a = np.zeros(wg.operand_shape(mode, b, h, w, c), dtype=np.float32)
    a[0, ..., :c] = x.transpose(0, 2, 3, 1)
    if mode == "3xtf32":  # v = big + small
        a[1] = a[0] / 4
        a[0] -= a[1]
    elif mode == "bf16":
        a = (a.view(np.uint32) >> 16).astype(np.uint16)
    a = a.astype(wg.operand_dtype(mode)) if mode != "bf16" else a
    assert a.shape[-1] == ig.padded_channels(c)
    np.testing.assert_array_equal(wg.from_operand(a, c, mode), x)


# Batch 16: rung 39's 128 x 128 tiles, whole (rung 40 is never split for auto); batch 8: rung
# 39 split.
@pytest.mark.parametrize(("batch", "rung"), [(64, 40), (128, 40), (32, 39), (16, 39), (8, 39)])
@pytest.mark.parametrize("mode", ["tf32", "fp16"])
def test_auto_takes_rung_40_where_its_256_row_tiles_fill_the_sms(batch: int, rung: int,
                                                                 mode: str) -> None:
    from convolab.gpu import auto

    conv5 = ConvShape(batch, 512, 16, 16, 512, 3)
    names = {RUNGS[r].prefix + mode for r in RUNGS} | {f"igemm-{mode}"}
    choice = auto.default_choice(conv5, names, mode)
    assert choice.impl == RUNGS[rung].prefix + mode
    if rung == 40:
        assert (choice.params["BM"], choice.params["BN"], choice.params["TMA"]) == (256, 192, 1)
        assert choice.params.get("SPLIT", 1) == 1
    # without rung 40 (not registered, or not eligible) rung 39 keeps the shape
    assert auto.default_choice(conv5, names - {wg.RUNG40.prefix + mode}, mode).impl == \
        wg.RUNG39.prefix + mode
    assert wg.pipelined_plan(ConvShape(batch, 64, 226, 226, 64, 3), mode) is None  # conv1_2
    assert wg.pipelined_plan(conv5, "3xtf32") is None  # no 256-row tiles: 3xTF32 stays on 39


def test_auto_ignores_a_channels_last_cache_entry() -> None:
    from convolab.gpu import auto, tune

    conv5 = ConvShape(64, 512, 16, 16, 512, 3)
    eligible = {"igemm-wg-fp16", "igemm-fp16", "igemm-splitk-fp16"}
    params = {**wg.defaults("fp16"), "BN": 128}
    for layout, source in (("nchw", "cache"), ("nhwc", "default")):
        entry = tune.TuneEntry("H100", conv5, "fp16", "igemm-wg-fp16", {**params, "layout": layout})
        assert auto.resolve([entry], "H100", conv5, "fp16", eligible).source == source


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


def _points(impl: ConvImpl, nhwc: bool = False, split: bool = False) -> list[dict[str, Any]]:
    """Parameters of every registered define set (NCHW, or NHWC with its ReLU flag; unsplit,
    or split-K's with SPLIT = 0, for the caller to set): what CI compiles and
    benchmarks/wgmma_warm.py builds ahead of the GPU tests."""
    valid = [d for d in impl.compile_variants() if "BM" in d and ("WG_NHWC" in d) == nhwc
             and ("WG_KSLICED" in d) == split]
    named = {"TMA": "WP_TMA"}  # parameters whose define has another name (and is 0 if absent)
    return [{**{k: d.get(named.get(k, k), 0) for k in impl.space}, "SPLIT": 0 if split else 1,
             **({"relu": d.get("WG_RELU", 0), "layout": "nhwc"} if nhwc else {})}
            for d in valid]


def _random_point(impl: ConvImpl, rng: np.random.Generator) -> dict[str, int]:
    points = _points(impl)
    return points[int(rng.integers(len(points)))]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_precision_on_random_shapes(name: str, cases: list[Case],
                                          rng: np.random.Generator) -> None:
    impl = get_impl(name)
    failures = []
    for case in cases:
        assert impl.supports(case.shape)
        for params in (None, _random_point(impl, rng)):
            err = run_impl(name, case, params)
            if not err <= impl.tolerance:
                failures.append(f"{case.shape} {params}: rel_l2 {err:.3g}")
    assert not failures, f"{name} (tol {impl.tolerance}):\n" + "\n".join(failures[:10])


def _run(name: str, case: Case, params: dict[str, Any]) -> tuple[float, Any, Any]:
    """rel_l2 of a run against the reference, ReLU'd where asked; its output as NCHW fp32
    (layout=nhwc: input made channels-last outside, output converted back for the comparison
    only); and the raw output, poisoned with NaN before the run."""
    import cupy as cp

    from convolab.check import poison

    impl = get_impl(name)
    mode = wg.MODE_OF[name]
    run = impl.prepare(case.shape, cp.asarray(case.w), cp.asarray(case.b),
                       impl.params_for(params))
    if params.get("layout") == "nhwc":
        x = wg.to_operand(cp.asarray(case.x), mode)
        y = wg.output_buffer(case.shape, mode)
        wg.poison_operand(y, mode)
    else:
        x = cp.asarray(case.x)
        y = cp.empty(case.shape.y_shape, dtype=cp.float32)
        poison(y)
    run(x, y)
    out = wg.from_operand(y, case.shape.M, mode) if params.get("layout") == "nhwc" else y
    ref = np.maximum(case.ref, 0) if params.get("relu") else case.ref
    return rel_l2(out, ref), out, y


def _run_nhwc(name: str, case: Case, params: dict[str, Any]) -> tuple[float, Any]:
    """rel_l2 of a layout=nhwc run against the reference, and the raw output."""
    err, _, y = _run(name, case, {**params, "layout": "nhwc"})
    return err, y


@pytest.mark.gpu
@pytest.mark.parametrize("name", NHWC_NAMES)
def test_channels_last_form_on_random_shapes(name: str, cases: list[Case],
                                             rng: np.random.Generator) -> None:
    """layout=nhwc (with ReLU where the drawn define set has it): the same function as the NCHW
    run; the padded output channels M..Mp-1 are written as zeros (the next layer reads them)."""
    impl = get_impl(name)
    failures = []
    points = _points(impl, nhwc=True)
    first = int(rng.integers(len(points)))
    for i, case in enumerate(cases[:max(6, len(points))]):  # every NHWC set, ReLU's included
        params = points[(first + i) % len(points)]
        err, y = _run_nhwc(name, case, params)
        pad = y[..., case.shape.M:].get().astype(np.float32)
        if not err <= impl.tolerance or np.any(pad != 0):
            failures.append(f"{case.shape} {params}: rel_l2 {err:.3g}, pad {np.unique(pad)}")
    assert not failures, f"{name} (tol {impl.tolerance}):\n" + "\n".join(failures[:10])


@pytest.mark.gpu
def test_channels_last_run_refuses_an_nchw_input(rng: np.random.Generator) -> None:
    import cupy as cp

    shape = ConvShape(1, 64, 18, 18, 64, 3)
    case = make_case(rng, shape)
    impl = get_impl("igemm-wgp-fp16")
    run = impl.prepare(shape, cp.asarray(case.w), cp.asarray(case.b),
                       impl.params_for({"layout": "nhwc"}))
    with pytest.raises(ValueError, match="channels-last operand"):
        run(cp.asarray(case.x), wg.output_buffer(shape, "fp16"))


def _split_shape(rng: np.random.Generator) -> ConvShape:
    """A random layer with 10-40 k-tiles (a k-slice length the k-tiles rarely divide, the last
    k-tile partial where Kd is not a multiple of 32/64), C and M off the tile multiples."""
    while True:
        k = int(rng.choice([1, 3]))
        c = int(rng.choice([100, 200, 300])) if k == 3 else int(rng.integers(600, 2500))
        shape = ConvShape(int(rng.integers(1, 4)), c, int(rng.integers(k + 4, k + 14)),
                          int(rng.integers(k + 4, k + 14)), int(rng.choice([70, 130, 200])), k,
                          int(rng.choice([1, 2])))
        if shape.flops < 3e8:
            return shape


@pytest.fixture(scope="module")
def split_cases(module_seed: int) -> list[Case]:
    rng = np.random.default_rng(module_seed + 1)
    return [make_case(rng, _split_shape(rng)) for _ in range(4)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_split_k_on_random_shapes(name: str, split_cases: list[Case],
                                  rng: np.random.Generator) -> None:
    """SPLIT 2, 3, 4 and the shape's own (0) at every split-K define set (NCHW, NHWC with
    ReLU, NHWC): against the fp64 reference, against the unsplit run of the same tile within
    the tolerance, and bit-identical when run again (the slices are added in a fixed order).
    NHWC's padded channels come out zero, as the unsplit epilogue writes them."""
    impl = get_impl(name)
    mode = wg.MODE_OF[name]
    failures = []
    points = _points(impl, split=True) + _points(impl, nhwc=True, split=True)
    assert len(points) >= (1 if mode == "3xfp16" else 3)
    for case in split_cases:
        for point in points:
            _, whole, _ = _run(name, case, {**point, "SPLIT": 1})
            for split in (2, 3, 4, 0):
                params = {**point, "SPLIT": split}
                label = f"{case.shape} {params} ({wg.split_of(case.shape, mode, params)} slices)"
                err, out, y = _run(name, case, params)
                agree = rel_l2(out, whole)
                if not (err <= impl.tolerance and agree <= impl.tolerance):
                    failures.append(f"{label}: rel_l2 {err:.3g}, against unsplit {agree:.3g}")
                if point.get("layout") == "nhwc":
                    pad = y[..., case.shape.M:].get().astype(np.float32)
                    if np.any(pad != 0):
                        failures.append(f"{label}: padded channels {np.unique(pad)}")
                if split == 3 and not bool((_run(name, case, params)[2] == y).all()):
                    failures.append(f"{label}: a second run differs")
    assert not failures, f"{name} (tol {impl.tolerance}):\n" + "\n".join(failures[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("mode", ALL_MODES)
def test_conv5_like_deep_k(mode: str, rung: int, rng: np.random.Generator) -> None:
    """conv5_x's 4608-term sums (C = 512, 3x3) at batch 2, on the rung's tile kinds and the
    largest tile, NCHW and NHWC (3xfp16: NCHW only): the 3x modes' per-k-tile fp32 adds must
    keep the long sum at fp32 accuracy."""
    shape = ConvShape(2, 512, 16, 16, 512, 3)
    x = rng.standard_normal(shape.x_shape, dtype=np.float32)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32) / np.float32(48)
    b = rng.standard_normal(shape.M, dtype=np.float32)
    case = Case(shape, x, w, b, conv_reference(x, w, b))
    r = RUNGS[rung]
    impl = get_impl(r.prefix + mode)
    largest = ({"BM": 128, "BN": 192, "STAGES": 2} if mode in wg.SPLIT_MODES else
               {"BM": 256, "BN": 192, "STAGES": 3, "PIPE": 1})
    narrow = [ig.WGMMA_NARROW[mode]] if rung == 39 else [{**wg.tiles(mode, r)[0], "TMA": 1}]
    for params in (*narrow, *wg.tiles(mode, r), largest):
        err = run_impl(impl.name, case, params)
        assert err <= impl.tolerance, f"{impl.name} {params}: {err:.3g}"
    nhwc = mode in MODES
    for params in (*wg.tiles(mode, r)[:2], *narrow) if nhwc else ():
        err, _ = _run_nhwc(impl.name, case, params)
        assert err <= impl.tolerance, f"{impl.name} {params} nhwc: {err:.3g}"
    # split-K: 4 slices NCHW, 3 channels-last with ReLU (72 or 144 k-tiles: 18/36 and 24/48 a
    # slice), at define sets CI compiles
    tma = {"TMA": 1} if r.tma else {}
    for params in ({**wg.tiles(mode, r)[0], "SPLIT": 4},
                   *([{**wg.tiles(mode, r)[1], **tma, "SPLIT": 3, "layout": "nhwc", "relu": 1}]
                     if nhwc else [])):
        err, _, _ = _run(impl.name, case, params)
        assert err <= impl.tolerance, f"{impl.name} {params}: {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
def test_3xfp16_scales_operands_far_from_fp16s_range(rung: int,
                                                     rng: np.random.Generator) -> None:
    """3xfp16 where unscaled fp16 would overflow (|x| ~ 1e6, |w| ~ 1e5), lose everything to
    zero (1e-12, 1e-9) or keep only the hi parts (1e-4), an all-zero input, and a NaN in x
    (it reaches the outputs that read it, as on the reference; the scale ignores it): every
    output within fp32's tolerance, and each call's scale its own (calls alternate
    magnitudes on one prepared layer)."""
    import cupy as cp

    shape = ConvShape(2, 70, 9, 9, 130, 3)
    name = RUNGS[rung].prefix + "3xfp16"
    impl = get_impl(name)
    for x_mag, w_mag in ((1e6, 1e5), (1e-12, 1e-9), (1e-4, 1.0), (1.0, 1e-30), (0.0, 1.0)):
        w = (rng.standard_normal(shape.w_shape) * w_mag).astype(np.float32)
        b = (rng.standard_normal(shape.M) * (x_mag * w_mag * 10 or 1.0)).astype(np.float32)
        run = impl.prepare(shape, cp.asarray(w), cp.asarray(b), impl.params_for(None))
        for scale in (x_mag, 1.0, x_mag):
            x = (rng.standard_normal(shape.x_shape) * scale).astype(np.float32)
            ref = conv_reference(x, w, b)
            y = cp.full(shape.y_shape, np.nan, dtype=cp.float32)
            run(cp.asarray(x), y)
            err = rel_l2(y, ref)
            assert err <= impl.tolerance, f"{name} x ~ {scale:g}, w ~ {w_mag:g}: {err:.3g}"
    x = rng.standard_normal(shape.x_shape).astype(np.float32)
    x[1, 5, 4, 4] = np.nan  # read by outputs (2..4, 2..4) of image 1 (no padding)
    y = cp.zeros(shape.y_shape, dtype=cp.float32)
    run(cp.asarray(x), y)
    out = cp.asnumpy(y)
    hit = np.zeros(shape.y_shape, dtype=bool)
    hit[1, :, 2:5, 2:5] = True
    assert np.isnan(out[hit]).all() and np.isfinite(out[~hit]).all()


@pytest.mark.gpu
def test_auto_takes_wgmma_on_hopper() -> None:
    from convolab.gpu import auto

    # (FP16 from B = 4 is kernel 52's on Hopper, tests/test_gpu_direct_conv.py: without it)
    conv5 = ConvShape(64, 512, 16, 16, 512, 3)
    eligible = set(auto.eligible_impls(conv5, "fp16")) - {"direct-img-fp16"}
    choice = auto.default_choice(conv5, eligible, "fp16")
    assert choice.impl == ("igemm-fp16" if wg.wgmma_ruled_out() else "igemm-wgp-fp16")
    assert choice.params.get("layout", "nchw") == "nchw"
    conv5_b8 = ConvShape(8, 512, 16, 16, 512, 3)
    eligible = set(auto.eligible_impls(conv5_b8, "fp16")) - {"direct-img-fp16"}
    choice = auto.default_choice(conv5_b8, eligible, "fp16")
    if not wg.wgmma_ruled_out():  # rung 39 split-K (rung 27's where there is no wgmma)
        assert (choice.impl, choice.params["SPLIT"]) == ("igemm-wg-fp16", 0)


def test_layout_tile_is_the_kernels_default() -> None:
    """LAYOUT_TILE names the tile the kernel builds without -D (the layout pass's define set,
    pinned above, carries none), and any other tile comes with its defines; ABSMAX_BLOCKS is
    the kernel's count of 3xfp16's partial maxima."""
    from convolab.gpu.compile import KERNEL_DIR

    text = (KERNEL_DIR / wg.FILE).read_text()
    for name, value in zip(("WG_LAYOUT_C", "WG_LAYOUT_Q"), wg.LAYOUT_TILE, strict=True):
        assert f"#define {name} {value}" in text
    assert f"#define WG_ABSMAX_BLOCKS {wg.ABSMAX_BLOCKS}" in text  # 3xfp16's partial maxima
    assert "WG_LAYOUT_C" not in wg.layout_defines("fp16")
    assert wg.layout_defines("fp16", (64, 64)) == {**wg.layout_defines("fp16"),
                                                   "WG_LAYOUT_C": 64, "WG_LAYOUT_Q": 64}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ALL_MODES)
def test_layout_pass_writes_the_operand_at_every_tile(mode: str,
                                                      rng: np.random.Generator) -> None:
    """Each layout tile gives the exact operand (cast, tf32-rounded, 3xTF32's two planes, or
    3xfp16's two planes of x scaled by 2^e, e written where asked) with zero pad channels:
    maps whose pixel count the lane's vector does not divide (15 x 15), a partial last pixel
    tile, channels off the tile and piece multiples (C = 20, 37)."""
    import cupy as cp

    for c, h, tile in itertools.product((20, 37), (15, 16), wg_layout_tiles()):
        magnitude = rng.choice([1e-6, 1.0, 1e5]) if mode == "3xfp16" else 1.0
        x = (rng.standard_normal((2, c, h, h)) * magnitude).astype(np.float32)
        shape = ConvShape(2, c, h, h, 8, 1)
        exponent = cp.full(1, np.nan, dtype=cp.float32)
        got = cp.asnumpy(wg.layout_pass(shape, mode, tile, exponent if mode == "3xfp16" else None)(
            cp.asarray(x)))
        want = np.zeros_like(got)
        nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        if mode == "3xfp16":
            e = wg.weight_exponent(x)  # the same rule for x, over the whole input
            assert float(exponent.get()[0]) == e
            want[..., :c] = wg.split_fp16(np.ldexp(nhwc, e).astype(np.float32))
        elif mode == "fp16":
            want[0, ..., :c] = nhwc.astype(np.float16)
        elif mode == "bf16":  # round to nearest even, as bits
            u = nhwc.view(np.uint32)
            want[0, ..., :c] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        else:
            big = wg.tf32_round(nhwc)
            want[0, ..., :c] = big
            if mode == "3xtf32":
                want[1, ..., :c] = wg.tf32_round(nhwc - big)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (mode, c, h, tile)


def wg_layout_tiles() -> list[tuple[int, int]]:
    """The default tile and one of each other lane width (1, 2 and 4 pixels a lane)."""
    return [wg.LAYOUT_TILE, (32, 32), (64, 64)]
