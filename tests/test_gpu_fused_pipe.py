"""fcp_exact_pipe (kernels/15): persistent, double-buffered fused conv+pool,
and fcp_exact_cw (kernels/16): the weights as a by-value kernel parameter.

CPU tests check the plan (single-chunk rule, fallback, shared memory, occupancy arithmetic)
and replay the kernel's tile and task arithmetic in NumPy, so a host/kernel geometry mismatch
fails without a GPU. GPU tests compare against fp64 on fresh random data with NaN-poisoned
outputs, including batches smaller than the persistent grid and not a multiple of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from conv_cases import make_case

from convolab.check import poison, rel_l2
from convolab.gpu import device, fused, fused_ffma
from convolab.models import conv_blocks
from convolab.shapes import ConvShape

CONV1, CONV2 = ((block.shape, block.pool) for block in conv_blocks("ece408", 3))
MXNET1, MXNET2 = (block.shape for block in conv_blocks("ece408-mxnet", 4))
WREG4 = {**fused_ffma.PIPE_WREG_TILE, "mg": 4}  # 1 channel x 8 columns per thread, weights in regs
PIPE_CONFIGS = {  # (layer, params): what the device benchmark times, at small batches here
    "conv1-wreg-rpt5-bps2": (CONV1, {**WREG4, "rpt": 5, "bps": 2}),
    "conv1-auto": (CONV1, {"pipe": 1}),
    "conv1-rpt1": (CONV1, {"pipe": 1, "rpt": 1}),
    "conv1-rpt2": (CONV1, {"pipe": 1, "rpt": 2}),  # partial last tile (48 rows for 40)
    "conv1-wreg-rpt1": (CONV1, {**WREG4, "rpt": 1}),
    "conv1-wreg-pw8": (CONV1, {**WREG4, "pw": 8}),
    "conv1-wreg-pw2-ty2": (CONV1, {**WREG4, "pw": 2, "ty": 2, "rpt": 10}),
    "conv2-default": (CONV2, {}),
    "conv2-mg2": (CONV2, {"pipe": 1, "mg": 2}),
    "conv2-ty4": (CONV2, {"pipe": 1, "ty": 4, "rpt": 1}),
}


def pooled_ref(case, pool: int) -> np.ndarray:  # noqa: ANN001
    """relu(conv + b) max-pooled pool x pool (floor), fp64, from the case's fp64 conv."""
    y = np.maximum(case.ref, 0.0)
    hp, wp = y.shape[2] // pool, y.shape[3] // pool
    y = y[:, :, : hp * pool, : wp * pool].reshape(*y.shape[:2], hp, pool, wp, pool)
    return y.max(axis=(3, 5))


def single_chunk_shape(rng: np.random.Generator) -> tuple[ConvShape, int]:
    """A random shape whose fcp_exact tiling is single-chunk (so the pipe takes it)."""
    while True:
        P = int(rng.choice([2, 3, 4]))
        K = int(rng.integers(1, 8))
        S = int(rng.integers(1, 3))
        H = int(rng.integers(K + (P - 1) * S, K + 60))
        W = int(rng.integers(K + (P - 1) * S, K + 60))
        shape = ConvShape(int(rng.integers(1, 5)), int(rng.integers(1, 5)), H, W,
                          int(rng.integers(1, 21)), K, S)
        plan = (fused_ffma.exact_plan(shape, P, {"pipe": 1})
                if fused_ffma.supports_pool(shape, P) else None)
        if plan is not None and plan.kernel == "fcp_exact_pipe":
            return shape, P


# ---------------------------------------------------------------------------------------------
# CPU: plan and a NumPy replay of the kernel's arithmetic
# ---------------------------------------------------------------------------------------------


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def emulate_pipe(case, pool: int, params: dict[str, int], grid: int) -> np.ndarray:  # noqa: ANN001
    """fcp_exact_pipe step by step: persistent blocks walk tasks t = block, += grid; each task
    stages its tile into a buffer (zero outside the image) laid out with the .cu file's
    macros, then every thread reads its rows at the kernel's offsets. (Sequential, so the
    second buffer changes nothing here: the barriers around it are the GPU tests' job.)"""
    shape, x, w, bias = case.shape, case.x, case.w, case.b
    plan = fused_ffma.exact_plan(shape, pool, params)
    assert plan is not None and plan.kernel == "fcp_exact_pipe"
    d = plan.defines
    K, S, P, MT, PW = d["FCP_K"], d["FCP_S"], d["FCP_P"], d["FCP_MT"], d["FCP_PW"]
    TX, TY, MG, RPT, CC = d["FCP_TX"], d["FCP_TY"], d["FCP_MG"], d["FCP_RPT"], d["FCP_CC"]
    COLS = PW * P
    SPAN4 = _ceil((COLS - 1) * S + K, 4) * 4
    ROWS_T = (P - 1) * S + K
    IN_ROWS = (TY * RPT * P - 1) * S + K
    COL_STEP = COLS * S
    IN_STRIDE = _ceil((TX - 1) * COL_STEP + SPAN4, 4) * 4
    MB = MT * MG
    w_floats = 0 if d["FCP_WREG"] else CC * K * K * MB
    assert plan.smem_dynamic == 4 * (2 * CC * IN_ROWS * IN_STRIDE + w_floats)
    hp, wp = fused_ffma.pooled_hw(shape, pool)
    B, C, M = shape.B, shape.C, shape.M
    tasks = B * plan.tiles_per_image
    y = np.full((B, M, hp, wp), np.nan)
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    for gy_blk in range(plan.channel_groups):
        for blk in range(grid):
            for t in range(blk, tasks, grid):
                tile, b = t % plan.tiles_per_image, t // plan.tiles_per_image
                tile_y, tile_x = tile // plan.tiles_w, tile % plan.tiles_w
                iy0, ix0 = tile_y * TY * RPT * P * S, tile_x * TX * COL_STEP
                buf = np.zeros((CC, IN_ROWS, IN_STRIDE))
                src = xd[b, :, iy0:iy0 + IN_ROWS, ix0:ix0 + IN_STRIDE]
                buf[:C, : src.shape[1], : src.shape[2]] = src
                for tz in range(MG):
                    m0 = gy_blk * MB + tz * MT
                    for ty in range(TY):
                        for tx in range(TX):
                            pw0 = (tile_x * TX + tx) * PW
                            for rr in range(RPT):
                                r0 = (rr * TY + ty) * P * S
                                c0 = tx * COL_STEP
                                win = buf[:C, r0:r0 + ROWS_T, c0:c0 + SPAN4]
                                assert win.shape == (C, ROWS_T, SPAN4), "read past the buffer"
                                ph = tile_y * TY * RPT + rr * TY + ty
                                if ph >= hp:
                                    continue
                                for m in range(m0, min(m0 + MT, M)):
                                    for kk in range(PW):
                                        if pw0 + kk >= wp:
                                            break
                                        best = -np.inf
                                        for dy in range(P):
                                            for dx in range(P):
                                                j = kk * P + dx
                                                patch = win[:, dy * S:dy * S + K,
                                                            j * S:j * S + K]
                                                best = max(best, float((patch * wd[m]).sum()))
                                        y[b, m, ph, pw0 + kk] = max(best + float(bias[m]), 0.0)
    return y


@pytest.mark.parametrize("name", ["conv1-wreg-rpt5-bps2", "conv1-auto", "conv1-rpt1", "conv1-rpt2",
                                  "conv1-wreg-pw8", "conv1-wreg-pw2-ty2", "conv2-ty4"])
def test_pipe_replay_matches_fp64(name: str, rng: np.random.Generator) -> None:
    (shape, pool), params = PIPE_CONFIGS[name]
    shape = ConvShape(2, shape.C, shape.H, shape.W, shape.M, shape.K, shape.S)
    case = make_case(rng, shape)
    plan = fused_ffma.exact_plan(shape, pool, params)
    grid = 3 if plan.tiles_per_image > 1 else 1  # B * tiles not a multiple of the grid
    got = emulate_pipe(case, pool, params, grid)
    assert rel_l2(got, pooled_ref(case, pool)) <= 1e-12


def test_pipe_replay_random_single_chunk_shape(rng: np.random.Generator) -> None:
    shape, pool = single_chunk_shape(rng)
    shape = ConvShape(2, shape.C, min(shape.H, 30), min(shape.W, 30), min(shape.M, 6),
                      shape.K, shape.S)
    if not fused_ffma.supports_pool(shape, pool) or fused_ffma.exact_plan(
            shape, pool, {"pipe": 1}).kernel != "fcp_exact_pipe":
        pytest.skip(f"{shape} pool {pool} shrank out of the pipe's range")
    case = make_case(rng, shape)
    got = emulate_pipe(case, pool, {"pipe": 1}, grid=2)
    assert rel_l2(got, pooled_ref(case, pool)) <= 1e-12


def test_pipe_plans_of_the_ece408_layers() -> None:
    for (shape, pool), expect_rpt in ((CONV1, 5), (CONV2, 1)):
        plan = fused_ffma.exact_plan(shape, pool, {"pipe": 1})
        assert plan.kernel == "fcp_exact_pipe" and plan.kernel_file.startswith("15_")
        assert plan.defines["FCP_CC"] == shape.C  # single chunk: every channel in one buffer
        assert plan.defines["FCP_RPT"] == expect_rpt and plan.tiles_per_image == 1
        # needs the opt-in above 48 KB
        assert 48 * 1024 < plan.smem_dynamic <= device.SMEM_DYNAMIC_TWO_BLOCKS
        assert device.resident_blocks(1, plan.threads, plan.smem_dynamic) >= 2
    rpt1 = fused_ffma.exact_plan(CONV1[0], 2, {"pipe": 1, "rpt": 1})
    assert rpt1.tiles_h == 5 and rpt1.smem_dynamic < 48 * 1024


def test_pipe_off_keeps_the_fcp_exact_plan() -> None:
    """pipe=-1 is fcp_exact's plan (docs/fused.md has the tile's story)."""
    plan = fused_ffma.exact_plan(CONV1[0], 2, {"pipe": -1})
    assert plan.kernel == "fcp_exact" and plan.smem_dynamic == 0
    assert plan.defines == {"FCP_K": 7, "FCP_S": 1, "FCP_P": 2, "FCP_MT": 4, "FCP_PW": 2,
                            "FCP_TX": 20, "FCP_TY": 8, "FCP_CC": 1, "FCP_MINB": 2,
                            "FCP_MG": 1, "FCP_RPT": 5}


def test_multi_chunk_shapes_fall_back_to_fcp_exact() -> None:
    shape = MXNET2  # 12 channels do not fit one buffer
    plan = fused_ffma.exact_plan(shape, 2, {"pipe": 1})
    assert plan.kernel == "fcp_exact" and plan.defines["FCP_CC"] < shape.C
    assert fused_ffma.exact_plan(ConvShape(1, 1, 40, 40, 2, 3), 9, {"pipe": 1}) is None  # simple


def test_defaults_follow_the_documented_rule() -> None:
    """The documented rule (fused_ffma.with_measured_defaults): fcp_exact_cw where cw_fits,
    else the register-weight pipe where C*K*K fits the register budget, else the pipe with
    fcp_exact's tile for single-chunk shapes, fcp_exact for multi-chunk shapes."""
    got = fused_ffma.exact_plan(CONV1[0], 2, {})
    assert fused_ffma.cw_fits(CONV1[0], 4) and got.kernel == "fcp_exact_cw"
    assert got.block == (20, 8, 1) and got.defines["FCP_RPT"] == 5 and got.channel_groups == 1
    measured = {**WREG4, "rpt": 5, "bps": 2}
    twelve = MXNET1  # 12 channels: cw does not fit
    got = fused_ffma.exact_plan(twelve, 2, {})
    assert got.defines == fused_ffma.exact_plan(twelve, 2, WREG4).defines
    assert not fused_ffma.cw_fits(twelve, 4) and got.defines["FCP_WREG"] == 1
    assert twelve.C * twelve.K * twelve.K <= fused_ffma.WREG_BUDGET
    assert fused_ffma.exact_plan(CONV1[0], 2, measured).threads == 320
    assert device.resident_blocks(96, 320, 60544) == 2  # device: 96 regs
    conv2 = fused_ffma.exact_plan(CONV2[0], 4, {})
    assert conv2.defines == fused_ffma.exact_plan(CONV2[0], 4, {"pipe": 1}).defines
    assert conv2.defines["FCP_WREG"] == 0 and conv2.kernel == "fcp_exact_pipe"
    assert fused_ffma.exact_plan(MXNET2, 2, {}).kernel == "fcp_exact"
    # an explicit tiling keeps fcp_exact's weights-in-shared-memory tile
    assert fused_ffma.exact_plan(CONV1[0], 2, {"mt": 2}).defines["FCP_WREG"] == 0
    impl = fused.fused_conv_pool_impl(2)
    assert fused_ffma.exact_plan(CONV1[0], 2, impl.params_for()).kernel == "fcp_exact_cw"
    assert fused_ffma.exact_plan(CONV1[0], 2, {"cw": -1, "pipe": -1}).kernel == "fcp_exact"


def test_cw_only_where_every_weight_index_is_a_constant() -> None:
    assert fused_ffma.cw_fits(CONV1[0], 4)
    assert not fused_ffma.cw_fits(ConvShape(1, 1, 86, 86, 5, 7), 4)  # 5 channels: two groups
    assert not fused_ffma.cw_fits(ConvShape(1, 5, 40, 40, 4, 7), 4)  # 5*49*4 floats > 4 KB
    assert fused_ffma.cw_fits(ConvShape(1, 3, 40, 40, 4, 5), 4)  # 3*25*4 floats
    # forced on where it does not fit: silently another exact kernel
    assert fused_ffma.exact_plan(CONV2[0], 4, {"cw": 1}).kernel != "fcp_exact_cw"


def test_cw_weights_struct_layout(rng: np.random.Generator) -> None:
    """The by-value struct is float w[C][K*K][mt]: w[m, c, p, q] at [c][p*K+q][m], channels
    past M zero; one element, so CuPy passes it by value."""
    w = rng.standard_normal((3, 2, 5, 5)).astype(np.float32)
    arg = fused_ffma.cw_weights(w, 2, 5, 4)
    assert arg.shape == (1,) and arg.dtype.itemsize == 4 * 2 * 25 * 4
    packed = arg[0]["w"]
    for m, c, p, q in ((0, 0, 0, 0), (2, 1, 4, 3), (1, 0, 2, 4)):
        assert packed[c, p * 5 + q, m] == w[m, c, p, q]
    assert not packed[:, :, 3].any()


def test_wreg_only_within_the_register_budget() -> None:
    assert fused_ffma.exact_plan(CONV1[0], 2, WREG4).defines["FCP_WREG"] == 1
    # 4 channels x 49 weights per thread would not fit: silently the shared-memory weights
    assert fused_ffma.exact_plan(CONV1[0], 2, {"pipe": 1, "wreg": 1}).defines["FCP_WREG"] == 0
    assert fused_ffma.exact_plan(CONV2[0], 4, {"pipe": 1, "wreg": 1, "mt": 1}).defines[
        "FCP_WREG"] == 0


@pytest.mark.parametrize("case", range(20))
def test_random_pipe_plans_fit_and_cover(case: int, rng: np.random.Generator) -> None:
    shape, pool = single_chunk_shape(rng)
    plan = fused_ffma.exact_plan(shape, pool, {"pipe": 1})
    d = plan.defines
    hp, wp = fused_ffma.pooled_hw(shape, pool)
    assert plan.tiles_h * d["FCP_TY"] * d["FCP_RPT"] >= hp
    assert plan.tiles_w * d["FCP_TX"] * d["FCP_PW"] >= wp
    assert plan.channel_groups * d["FCP_MT"] * d["FCP_MG"] >= shape.M
    assert plan.smem_dynamic <= device.SMEM_DYNAMIC_TWO_BLOCKS
    assert 1 <= d["FCP_MINB"] <= 16 and plan.threads <= 1024


def test_resident_blocks_matches_the_h100_occupancy_rules() -> None:
    assert device.resident_blocks(93, 160, 31056) == 4  # fcp_exact conv1 (ptxas: 93 regs)
    assert device.resident_blocks(111, 160, 61328) == 3  # pipe conv1, whole image
    assert device.resident_blocks(95, 160, 16272) == 4  # pipe conv1, one row tile
    assert device.resident_blocks(195, 256, 61184) == 1  # pipe conv2
    assert device.resident_blocks(32, 1024, 0) == 2  # thread limit
    assert device.resident_blocks(16, 32, 0) == 32  # block limit


def test_registry_exposes_pipe_parameters() -> None:
    impl = fused.fused_conv_pool_impl(2)
    assert {"pipe", "bps", "wreg"} <= set(impl.space) and impl.defaults["pipe"] == 0
    assert impl.params_for({"pipe": 1, "bps": 3})["bps"] == 3
    plans = fused_ffma.compile_plans()
    pipes = [p.defines for p in plans if p.kernel == "fcp_exact_pipe"]
    assert any(d["FCP_WREG"] == 1 for d in pipes) and any(d["FCP_P"] == 4 for d in pipes)
    assert all(p.kernel_file == fused_ffma.KERNEL_FILES[p.kernel] for p in plans)
    jobs = fused_ffma.compile_jobs()
    assert set(jobs) == {"fcp_exact", "fcp_simple", "fcp_exact_pipe", "fcp_exact_cw"}


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _run(shape: ConvShape, pool: int, params: dict[str, int], case):  # noqa: ANN001, ANN202
    import cupy as cp

    impl = fused.fused_conv_pool_impl(pool)
    run = impl.prepare(shape, cp.asarray(case.w), cp.asarray(case.b), impl.params_for(params))
    y = cp.empty(impl.out_shape(shape), cp.float32)
    poison(y)
    run(cp.asarray(case.x), y)
    return y, run


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PIPE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 5])
def test_pipe_ece408_configs(name: str, batch: int, rng: np.random.Generator) -> None:
    (shape, pool), params = PIPE_CONFIGS[name]
    shape = ConvShape(batch, shape.C, shape.H, shape.W, shape.M, shape.K, shape.S)
    case = make_case(rng, shape)
    y, _ = _run(shape, pool, params, case)
    err = rel_l2(y, pooled_ref(case, pool))
    assert err <= 1e-5, f"{name} B={batch}: rel err {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("bps", [1, 2])
def test_pipe_batch_not_a_multiple_of_the_grid(bps: int, rng: np.random.Generator) -> None:
    """grid = n_SM * bps blocks, 300 images: blocks do 2 or 3 tasks, every buffer parity."""
    shape = conv_blocks("ece408", 300)[0].shape
    case = make_case(rng, shape)
    y, run = _run(shape, 2, {"pipe": 1, "bps": bps}, case)
    assert shape.B % run.grid[0] != 0 and run.grid[0] < shape.B
    assert rel_l2(y, pooled_ref(case, 2)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case_no", range(8))
def test_cw_random_shapes(case_no: int, rng: np.random.Generator) -> None:
    """fcp_exact_cw forced on random small filter banks (M <= 4, C <= 3), odd sizes."""
    for _ in range(100):
        K = int(rng.integers(1, 8))
        C, M, pool = int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
        H, W = int(rng.integers(K + pool - 1, 60)), int(rng.integers(K + pool - 1, 60))
        shape = ConvShape(int(rng.integers(1, 6)), C, H, W, M, K, 1)
        if fused_ffma.supports_pool(shape, pool) and fused_ffma.exact_plan(
                shape, pool, {"cw": 1}).kernel == "fcp_exact_cw":
            break
    else:
        pytest.skip("no cw-eligible shape drawn")
    case = make_case(rng, shape)
    y, _ = _run(shape, pool, {"cw": 1}, case)
    err = rel_l2(y, pooled_ref(case, pool))
    assert err <= 1e-5, f"{shape} pool {pool}: rel err {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("case_no", range(10))
def test_pipe_random_shapes(case_no: int, rng: np.random.Generator) -> None:
    shape, pool = single_chunk_shape(rng)
    case = make_case(rng, shape)
    y, _ = _run(shape, pool, {"pipe": 1}, case)
    err = rel_l2(y, pooled_ref(case, pool))
    assert err <= 1e-5, f"{shape} pool {pool}: rel err {err}"


def test_zoo_defaults_follow_the_documented_rule() -> None:
    """with_measured_defaults: cw where cw_fits, else the register-weight pipe where C*K*K fits
    the register budget, else the pipe for single-chunk shapes, else fcp_exact."""
    for shape, pool in fused_ffma.zoo_fused_layers():
        plan = fused_ffma.exact_plan(shape, pool, {})
        mt = 4 if shape.M >= 3 else shape.M
        if fused_ffma.cw_fits(shape, mt):
            assert plan.kernel == "fcp_exact_cw", shape
        elif plan.defines["FCP_CC"] < shape.C:
            assert plan.kernel == "fcp_exact", shape
        else:
            assert plan.kernel == "fcp_exact_pipe", shape
            wreg = shape.C * shape.K * shape.K <= fused_ffma.WREG_BUDGET
            assert plan.defines["FCP_WREG"] == int(wreg), shape


@pytest.mark.parametrize("case", range(40))
def test_random_plans_keep_the_limits(case: int, rng: np.random.Generator) -> None:
    """Any parameters on any shape: shared memory within the kernel's limit, cw only where
    every weight index is a constant, the grid covers the pooled output, the file matches."""
    shape, pool = single_chunk_shape(rng)
    if rng.random() < 0.5:  # multi-chunk shapes too
        shape = ConvShape(shape.B, int(rng.integers(1, 33)), shape.H, shape.W, shape.M,
                          shape.K, shape.S)
    space = {"mt": [0, 1, 2, 4], "pw": [0, 1, 2, 4], "ty": [0, 4, 8], "mg": [0, 1, 2, 4],
             "rpt": [0, 1, 2, 5], "pipe": [0, -1, 1], "wreg": [0, 1], "cw": [0, -1, 1]}
    params = {k: int(rng.choice(v)) for k, v in space.items()}
    plan = fused_ffma.exact_plan(shape, pool, params)
    if plan is None:
        return
    d = plan.defines
    assert plan.kernel_file == fused_ffma.KERNEL_FILES[plan.kernel]
    hp, wp = fused_ffma.pooled_hw(shape, pool)
    assert plan.tiles_h * d["FCP_TY"] * d["FCP_RPT"] >= hp
    assert plan.tiles_w * d["FCP_TX"] * d["FCP_PW"] >= wp
    assert plan.channel_groups * d["FCP_MT"] * d["FCP_MG"] >= shape.M
    if plan.kernel == "fcp_exact_pipe":
        assert plan.smem_dynamic <= device.SMEM_DYNAMIC_TWO_BLOCKS and d["FCP_CC"] == shape.C
    else:
        rows = d["FCP_TY"] * d["FCP_RPT"]
        mb = 0 if plan.kernel == "fcp_exact_cw" else d["FCP_MT"] * d["FCP_MG"]
        smem = fused_ffma.smem_bytes(shape.K, shape.S, pool, mb, d["FCP_PW"], d["FCP_TX"],
                                     rows, d["FCP_CC"])
        assert smem <= device.SMEM_STATIC_LIMIT
    if plan.kernel == "fcp_exact_cw":
        assert fused_ffma.cw_fits(shape, d["FCP_MT"]) and d["FCP_CC"] == shape.C
