"""The tuner's cache and auto's choice logic: pure Python, no GPU (runs in CI)."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import pytest

from convolab.gpu import auto, tune
from convolab.gpu.tune import CacheWarning, TuneEntry
from convolab.models import conv_blocks
from convolab.precision import TOLERANCE, TUNE_MODES
from convolab.shapes import ConvShape, ceil_div

CONV1, CONV2 = (block.shape for block in conv_blocks("ece408", 10_000))
GPU = "NVIDIA H100 80GB HBM3"


def entry(
    shape: ConvShape = CONV2,
    impl: str = "channel-tree",
    mode: str = "fp32",
    gpu: str = GPU,
    **params: int,
) -> TuneEntry:
    return TuneEntry(gpu, shape, mode, impl, dict(params), 1.25, 3e-7, "2026-11-23")


@pytest.fixture
def cache_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVOLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tune.json"


def test_cache_location_env_override_and_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONVOLAB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tune.cache_path() == tmp_path / "xdg" / "convolab" / "tune.json"
    monkeypatch.setenv("CONVOLAB_CACHE", str(tmp_path / "mine"))
    assert tune.cache_path() == tmp_path / "mine" / "tune.json"


def test_round_trip(cache_file: Path) -> None:
    entries = [
        entry(CONV1, "tensor-core-3xtf32", NFRAG=2, BK=32),
        entry(CONV2, "fp16", "fp16", TILE=16),
    ]
    written = tune.save_cache(entries)
    assert written == cache_file
    assert json.loads(cache_file.read_text())["version"] == tune.CACHE_VERSION
    assert tune.load_cache() == entries


def test_missing_cache_is_empty_without_warning(
    cache_file: Path, recwarn: pytest.WarningsRecorder
) -> None:
    assert tune.load_cache() == []
    assert not [w for w in recwarn if issubclass(w.category, CacheWarning)]


def test_version_mismatch_is_ignored_with_warning(cache_file: Path) -> None:
    tune.save_cache([entry()])
    data = json.loads(cache_file.read_text())
    data["version"] = tune.CACHE_VERSION + 1
    cache_file.write_text(json.dumps(data))
    with pytest.warns(CacheWarning, match="version"):
        assert tune.load_cache() == []


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"version": 1}', "\xff\xfe"])
def test_corrupt_cache_is_ignored_with_warning(cache_file: Path, text: str) -> None:
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text(text, encoding="latin-1")
    with pytest.warns(CacheWarning):
        assert tune.load_cache() == []


def test_bad_entry_is_dropped_good_ones_kept(cache_file: Path) -> None:
    tune.save_cache([entry()])
    data = json.loads(cache_file.read_text())
    data["entries"].append({"gpu": GPU, "mode": "fp64", "impl": "x", "shape": {}})
    cache_file.write_text(json.dumps(data))
    with pytest.warns(CacheWarning, match="entry 1"):
        assert tune.load_cache() == [entry()]


def test_atomic_write_leaves_no_temp_files(cache_file: Path) -> None:
    tune.save_cache([entry()])
    tune.save_cache([entry(), entry(CONV1)])
    assert sorted(p.name for p in cache_file.parent.iterdir()) == ["tune.json"]


def test_failed_write_keeps_old_cache_and_no_temp(
    cache_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tune.save_cache([entry()])
    before = cache_file.read_bytes()

    def explode(*_: object, **__: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", explode)
    with pytest.raises(OSError, match="disk full"):
        tune.save_cache([entry(CONV1)])
    assert cache_file.read_bytes() == before
    assert sorted(p.name for p in cache_file.parent.iterdir()) == ["tune.json"]


def test_merge_replaces_same_key_only() -> None:
    old = [entry(CONV1, "basic"), entry(CONV2, "basic")]
    merged = tune.merge(old, [entry(CONV2, "fp16")])
    assert {(e.shape, e.impl) for e in merged} == {(CONV1, "basic"), (CONV2, "fp16")}


def test_lookup_exact_then_nearest_batch_then_none() -> None:
    entries = [
        entry(CONV2.with_batch(1000), "channel-tree"),
        entry(CONV2.with_batch(10_000), "fp16"),
        entry(CONV2, "tensor-core-tf32", "tf32"),
    ]
    assert tune.lookup(entries, GPU, CONV2, "fp32").impl == "fp16"
    assert tune.lookup(entries, GPU, CONV2.with_batch(2000), "fp32").impl == "channel-tree"
    assert tune.lookup(entries, GPU, CONV2.with_batch(8000), "fp32").impl == "fp16"
    assert tune.lookup(entries, GPU, CONV2, "tf32").impl == "tensor-core-tf32"
    assert tune.lookup(entries, "NVIDIA A100", CONV2, "fp32") is None
    assert tune.lookup(entries, GPU, CONV1, "fp32") is None
    with pytest.raises(ValueError, match="mode"):
        tune.lookup(entries, GPU, CONV2, "fp8")


def test_mode_of_tolerances() -> None:
    assert [tune.mode_of(TOLERANCE[m]) for m in TUNE_MODES] == list(TUNE_MODES)
    assert tune.mode_of(TOLERANCE["3xtf32"]) == "fp32"
    assert tune.mode_of(TOLERANCE["bf16"]) == "fp16"
    assert tune.mode_of(TOLERANCE["fp32"] * 2) == "tf32"
    with pytest.raises(ValueError):
        tune.mode_of(0.5)


def test_candidates_start_with_defaults_and_respect_cap() -> None:
    space = {"A": (1, 2, 3, 4), "B": (8, 16, 32)}
    defaults = {"A": 2, "B": 16, "fixed": 7}
    got = tune.candidates(space, defaults, cap=5)
    assert got[0] == defaults and len(got) == 5
    assert all(c["fixed"] == 7 for c in got)
    assert len({tuple(sorted(c.items())) for c in got}) == 5
    assert len(tune.candidates(space, defaults, cap=100)) == 12
    with pytest.raises(ValueError):
        tune.candidates(space, defaults, cap=0)


def test_winners_respect_mode_tolerance() -> None:
    trials = [
        tune.Trial("conv2", "channel-tree", "fp32", {}, True, 1e-7, 2.0),
        tune.Trial("conv2", "tensor-core-tf32", "tf32", {}, True, 3e-4, 1.0),
        tune.Trial("conv2", "fp16", "fp16", {}, True, 2e-3, 0.5),
        tune.Trial("conv2", "broken", "fp32", {}, False, float("inf"), 0.1),
    ]
    best = {e.mode: e.impl for e in tune.winners(trials, GPU, {"conv2": CONV2}, "d")}
    assert best == {"fp32": "channel-tree", "tf32": "tensor-core-tf32", "fp16": "fp16"}


def test_model_conv_shapes_are_the_models() -> None:
    got = tune.model_conv_shapes("ece408", 64)
    assert got == [(b.name, b.shape) for b in conv_blocks("ece408", 64)]
    assert [shape.with_batch(10_000) for _, shape in got] == [CONV1, CONV2]
    with pytest.raises(ValueError, match="unknown model"):
        tune.model_conv_shapes("no-such-model", 1)


# ---- auto's choice logic --------------------------------------------------------------

ALL = {"basic", "register-tiled", "channel-tree", "channel-atomic", "fp16", "tensor-core-tf32"}


def test_auto_uses_cached_entry_when_present() -> None:
    entries = [entry(CONV2, "tensor-core-3xtf32", NFRAG=4)]
    choice = auto.resolve(entries, GPU, CONV2, "fp32", ALL | {"tensor-core-3xtf32"})
    assert choice == auto.Choice("tensor-core-3xtf32", {"NFRAG": 4}, "cache")


def test_auto_ignores_cached_entry_it_cannot_run() -> None:
    entries = [entry(CONV2, "no-such-rung")]
    choice = auto.resolve(entries, GPU, CONV2, "fp32", ALL)
    assert choice.source == "default" and choice.impl == "register-tiled"


def test_auto_default_heuristic() -> None:
    assert auto.default_choice(CONV1, ALL).impl == "register-tiled"
    assert auto.default_choice(CONV1, ALL - {"register-tiled"}) == auto.Choice(
        "channel-tree", {"CSPLIT": 1}
    )
    deep = ConvShape(256, 256, 16, 16, 256, 3, 1)
    assert auto.default_choice(deep, ALL).impl == "channel-tree"
    tiny = ConvShape(1, 512, 14, 14, 512, 3, 1)
    assert auto.default_choice(tiny, ALL).impl == "channel-atomic"
    with pytest.raises(ValueError, match="no GPU implementation"):
        auto.default_choice(CONV1, set())


def test_auto_eligibility_filters_by_mode() -> None:
    fp32 = set(auto.eligible_impls(CONV2, "fp32"))
    fp16 = set(auto.eligible_impls(CONV2, "fp16"))
    assert "tensor-core-tf32" not in fp32 and "fp16" not in fp32
    assert "channel-tree" in fp32 and fp32 <= fp16 and "fp16" in fp16
    assert "auto" not in fp16 and "streams" not in fp16


# ---- the search -----------------------------------------------------------------------

BIG_SPACE = {"A": (1, 2, 3, 4), "B": (1, 2, 3, 4), "C": (1, 2, 3, 4), "D": (1, 2)}
BIG_DEFAULTS = {"A": 1, "B": 1, "C": 1, "D": 1, "fixed": "x"}


def test_coordinate_descent_finds_separable_optimum_within_budget() -> None:
    target = {"A": 3, "B": 4, "C": 2, "D": 2}
    calls: list[dict] = []

    def measure(p: dict) -> float:
        calls.append(p)
        assert p["fixed"] == "x"
        return 1.0 + sum((p[k] - target[k]) ** 2 for k in target)

    best, value = tune.coordinate_descent(BIG_SPACE, BIG_DEFAULTS, measure, max_trials=16)
    assert {k: best[k] for k in target} == target and value == 1.0
    assert len(calls) <= 16
    # Nothing measured twice.
    assert len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls)


def test_coordinate_descent_respects_max_trials_and_rejections() -> None:
    calls = []

    def measure(p: dict) -> float:
        calls.append(p)
        return float("inf") if p["A"] == 1 else float(p["A"] + p["B"])

    best, value = tune.coordinate_descent(BIG_SPACE, BIG_DEFAULTS, measure, max_trials=5)
    assert len(calls) == 5 and best["A"] != 1 and value < float("inf")
    best, _ = tune.coordinate_descent(BIG_SPACE, BIG_DEFAULTS, measure, max_trials=1)
    assert best == BIG_DEFAULTS


def test_small_space_is_swept_exhaustively() -> None:
    space = {"A": (1, 2, 3), "B": (5, 6)}
    seen = []

    def measure(p: dict) -> float:
        seen.append((p["A"], p["B"]))
        return 10.0 - p["A"] * p["B"]

    best, value = tune.coordinate_descent(space, {"A": 1, "B": 5}, measure, max_trials=6)
    assert sorted(seen) == [(a, b) for a in (1, 2, 3) for b in (5, 6)]
    assert (best["A"], best["B"]) == (3, 6) and value == -8.0


def test_first_round_is_whole_space_or_one_parameter_moves() -> None:
    assert len(tune.first_round({"A": (1, 2), "B": (3, 4)}, {"A": 1, "B": 3}, 8)) == 4
    moves = tune.first_round(BIG_SPACE, BIG_DEFAULTS, 100)
    assert moves[0] == BIG_DEFAULTS and len(moves) == 1 + 3 + 3 + 3 + 1
    assert all(sum(m[k] != BIG_DEFAULTS[k] for k in BIG_SPACE) == 1 for m in moves[1:])


def test_main_flow_without_gpu(cache_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's bookkeeping (search, budget, winners, cache, table) with a fake GPU:
    trials are synthetic, everything else is the real code."""
    import types

    import numpy as np

    from convolab import backend
    from convolab.registry import ConvImpl

    def fake_impl(name: str, tol: float) -> ConvImpl:
        return ConvImpl(
            name=name,
            demonstrates="",
            device="gpu",
            prepare=lambda *a: None,
            space={"T": (1, 2, 3, 4, 5), "U": (1, 2, 3, 4)},
            defaults={"T": 1, "U": 1},
            tolerance=tol,
        )

    # "slow" is exact too, but its defaults run 10x slower than exact's: screened, not searched.
    impls = [fake_impl("exact", 1e-5), fake_impl("half", 1e-2), fake_impl("slow", 1e-5)]
    calls: dict[str, int] = {}

    def fake_trial(impl, layer, shape, params, data, reps, limit_ms=math.inf):  # noqa: ANN001, ANN202
        calls[impl.name] = calls.get(impl.name, 0) + 1
        speed = {"exact": 1.0, "half": 0.5, "slow": 50.0}[impl.name] + abs(params["T"] - 4) + \
            params["U"]
        mode = tune.mode_of(impl.tolerance)
        if speed > limit_ms:  # the real trial stops after one run
            return tune.Trial(layer, impl.name, mode, params, False, 1e-7, note="too slow")
        return tune.Trial(layer, impl.name, mode, params, True, 1e-7, speed)

    fake_cp = types.SimpleNamespace(asarray=np.asarray, zeros=np.zeros)
    monkeypatch.setattr(backend, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(tune, "gpu_name", lambda: GPU)  # tune's own import of device.gpu_name
    monkeypatch.setattr(tune, "tunable_impls", lambda: impls)
    monkeypatch.setattr(tune, "_trial", fake_trial)
    monkeypatch.setattr(tune, "reference_conv", lambda *a: None)
    monkeypatch.setattr(tune, "precompile", lambda plan, progress: None)
    monkeypatch.setenv("CONVOLAB_TUNE_MAX_CANDIDATES", "12")
    found = tune.main("ece408", batch=2, reps=1)
    best = {(e.shape.C, e.mode): (e.impl, e.params) for e in found}
    assert best[(1, "fp32")] == ("exact", {"T": 4, "U": 1})
    assert best[(4, "fp16")] == ("half", {"T": 4, "U": 1})
    assert tune.load_cache() == found
    layers = len(tune.model_conv_shapes("ece408", 2))
    assert calls["slow"] == layers  # its defaults only, once per layer
    assert calls["exact"] > layers and calls["half"] > layers  # searched


def test_advanced_rung_defaults_are_valid_and_tree_split_adapts() -> None:
    from convolab.gpu import ladder_advanced as adv

    assert [adv.tree_split(c) for c in (1, 4, 15, 16, 31, 32, 512)] == [1, 1, 1, 4, 4, 8, 8]
    for c in (1, 16, 64):
        adv.tree_defines(dict(adv.TREE_DEFAULTS, CSPLIT=adv.tree_split(c)))
    adv.atomic_defines(adv.ATOMIC_DEFAULTS)
    adv.fp16_defines(adv.FP16_DEFAULTS)
    for mode in adv.TC_MODES:
        adv.tc_defines(mode, adv.TC_DEFAULTS)
    with pytest.raises(ValueError, match="power of two"):
        adv.tree_defines(dict(adv.TREE_DEFAULTS, CSPLIT=3))


def test_auto_model_sends_gemm_shaped_layers_to_the_implicit_gemm() -> None:
    """VGG's layers (C, M >= 32): the mode's implicit-GEMM family; split-K exactly where the
    output has fewer 128 x 128 tiles than half the SMs; LeNet's small C keeps its rungs."""
    from convolab.bench.cases import VGG_SWEEP_BATCHES, vgg_cases
    from convolab.gpu import implicit_gemm as ig

    names = {f"igemm-{s}{m}" for s in ("", "splitk-") for m in ig.MODES}
    for mode, family in auto.GEMM_FAMILY.items():
        for case, batch in itertools.product(vgg_cases(64), VGG_SWEEP_BATCHES):
            shape = case.shape.with_batch(batch)
            choice = auto.default_choice(shape, ALL | names, mode)
            M, N, _ = ig.gemm_dims(shape)
            few = ceil_div(M, 128) * ceil_div(N, 128) < ig.SPLIT_BELOW_WAVES * 132
            assert choice.impl == f"igemm-{'splitk-' if few else ''}{family}"
            ig.igemm_defines(family, choice.params)
            rows = ig.split_rows(shape, choice.params["BN"], choice.params["BK"]) if few else (
                64 if M <= 64 else 128)
            assert choice.params["BM"] == rows
        # Without the family registered the old heuristic still answers.
        assert auto.default_choice(ConvShape(1, 512, 16, 16, 512, 3), ALL, mode).impl == \
            "channel-atomic"
    assert auto.default_choice(CONV2, ALL | names, "fp16").impl == "register-tiled"


def test_tuner_takes_the_vgg_layer_set() -> None:
    from convolab.bench.cases import vgg_cases

    got = tune.model_conv_shapes(tune.VGG_LAYERS, 8)
    assert [name for name, _ in got] == ["conv1_2", "conv5_x", "fc6", "fc7"]
    assert [shape for _, shape in got] == [c.shape for c in vgg_cases(8)]
    from convolab.gpu import implicit_gemm as ig

    for _, shape in got:  # every layer has the implicit-GEMM rungs to race
        assert ig.supports(shape)


def test_search_order_ranks_every_layers_leaders_first() -> None:
    """Rungs within SEARCH_WITHIN of the fastest defaults they compete with, by that ratio:
    each layer's leaders (ratio 1) before anyone's runners-up; the slow and the failed never."""
    def t(layer: str, name: str, tol: float, ms: float, ok: bool = True) -> tune.Trial:
        return tune.Trial(layer, name, tune.mode_of(tol), {}, ok, 1e-7, ms)

    screened = {
        "a": {"x": t("a", "x", 1e-5, 2.0), "y": t("a", "y", 1e-5, 3.0),
              "h": t("a", "h", 1e-2, 1.0), "slow": t("a", "slow", 1e-5, 10.0)},
        "b": {"x": t("b", "x", 1e-5, 5.0), "bad": t("b", "bad", 1e-5, 1.0, ok=False)},
    }
    order = tune.search_order(screened)
    assert order[:3] == [("a", "h"), ("a", "x"), ("b", "x")]  # ratio 1 each, then by name
    assert order[3:] == [("a", "y")]  # 1.5x the fp32 leader
    assert ("a", "slow") not in order and ("b", "bad") not in order


def test_screen_starts_from_the_shape_models_tiles() -> None:
    """The implicit GEMMs start where auto's model would run them (conv1_2's 64-row tiles,
    conv5_x's wave-picked tiles), other rungs at their defaults."""
    from convolab.bench.cases import vgg_cases
    from convolab.gpu import implicit_gemm as ig
    from convolab.registry import get_impl

    conv1, conv5 = (c.shape for c in vgg_cases(64)[:2])
    wg = get_impl("igemm-wg-tf32")
    assert tune.start_params(wg, conv1) == wg.params_for(ig.WGMMA_NARROW["tf32"])
    assert tune.start_params(wg, conv5) == wg.params_for(ig.wgmma_tiles(conv5, "tf32"))
    basic = get_impl("basic")
    assert tune.start_params(basic, conv1) == basic.params_for(None)


def test_auto_sends_classifier_layers_to_kernel_42_where_it_was_measured_fastest() -> None:
    """fc6/fc7: TF32 from B = 8 (fc7 only up to 16; fc6 from 32 on kernel 43), FP16 up to 32
    (fc6 up to 64, on kernel 43 at 64), exact on fc6 only, on kernel 43 in 3xTF32 at every
    batch; fc6 with its own tiles (two blocks an SM), fc7 with 64-row tiles from B = 12;
    elsewhere kernel 41 or the GEMMs."""
    from convolab.bench.cases import VGG_SWEEP_BATCHES
    from convolab.gpu import gemv_mma
    from convolab.registry import get_impl

    names = ({f"gemv-{k}-{m}" for k in ("mma", "bulk") for m in gemv_mma.MODES}
             | {"gemv-fp32", "gemv-tf32", "gemv-fp16"})
    fc6, fc7 = ConvShape(1, 25088, 1, 1, 4096, 1), ConvShape(1, 4096, 1, 1, 1024, 1)
    for base, batch in itertools.product((fc6, fc7), VGG_SWEEP_BATCHES):
        shape = base.with_batch(batch)
        small = base is fc7
        want = {"fp32": None if small else "gemv-bulk-3xtf32",
                "tf32": ("gemv-bulk-tf32" if not small and batch >= 32 else "gemv-mma-tf32")
                if batch >= 8 and (batch <= 16 or not small) else None,
                "fp16": ("gemv-bulk-fp16" if batch == 64 else "gemv-mma-fp16")
                if batch <= 32 or not small else None}
        for mode, takes in want.items():
            choice = auto.default_choice(shape, ALL | names, mode)
            if takes is None:
                assert not choice.impl.startswith("gemv-mma") and not choice.impl.startswith(
                    "gemv-bulk"), (shape, mode, choice)
                continue
            assert choice.impl == takes, (shape, mode, choice)
            tiles = small and batch >= gemv_mma.SMALL_TILE_BATCH
            big = [p for up_to, p in gemv_mma.BIG_LAYER_TILES.get(mode, ()) if batch <= up_to]
            want_params = (gemv_mma.SMALL_TILES if tiles else {} if small or takes.startswith(
                "gemv-bulk") else big[0])
            assert choice.params == want_params, (shape, mode)
            assert small or takes.startswith("gemv-bulk") or choice.params["MINB"] == 2
            get_impl(choice.impl).params_for(choice.params)
    # A conv layer never, whatever its batch.
    conv = ConvShape(8, 512, 14, 14, 512, 3)
    assert not auto.default_choice(conv, ALL | names, "fp16").impl.startswith("gemv")
