"""The fused LeNet's fp16 channels-last path (rung 19, gpu/fused_cl.py): fcp_mma_toe_cl and
fcp_mma_cl, and FusedLeNet mode 'fp16' built on them.

CPU tests replay fcp_mma_cl's index arithmetic in NumPy: cp.async staging (and which rows are
visible when), the per-lane B loads of both k orders, the PTX m16n8k16 fragment layouts, the
pool over registers and shuffles, the shared-memory feature tile. A wrong mapping fails here
without a GPU. GPU tests compare against fp64 on fresh random inputs with NaN-poisoned outputs.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import numpy as np
import pytest
from test_gpu_fused import lenet_params

from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool, reference_forward
from convolab.gpu import fused_cl, fused_ffma, fused_mma
from convolab.models import conv_blocks
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape

C1, C3 = (block.shape for block in conv_blocks("ece408"))  # batch set per test
IMAGE = C1.x_shape[1:]
ODD = [ConvShape(1, 4, 26, 35, 11, 5), ConvShape(1, 4, 18, 20, 16, 3)]  # K 5 / 3, M < 16
VARIANTS: list[dict[str, int]] = [
    {}, {"korder": 0}, {"split": 1}, {"nv": 2}, {"nv": 4, "split": 1},
    {"warps": 3, "nv": 2, "split": 1, "korder": 0}, {"warps": 8, "minb": 3},
    {"warps": 2, "minb": 12},
]

# ---------------------------------------------------------------------------------------------
# NumPy replay of fcp_mma_cl
# ---------------------------------------------------------------------------------------------

_G, _T = fused_mma.LANE_G, fused_mma.LANE_T


def _halves(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two fp16 values of 32-bit words: (low half = lower k, high half)."""
    words = np.asarray(words, np.uint32)
    lo = (words & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (words >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _a_matrix(regs: np.ndarray) -> np.ndarray:
    a = np.zeros((16, 16))
    for r, (row, col) in enumerate(((_G, 2 * _T), (_G + 8, 2 * _T), (_G, 2 * _T + 8),
                                    (_G + 8, 2 * _T + 8))):
        a[row, col], a[row, col + 1] = _halves(regs[:, r])
    return a


def _b_matrix(b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    b = np.zeros((16, 8))
    b[2 * _T, _G], b[2 * _T + 1, _G] = _halves(b0)
    b[2 * _T + 8, _G], b[2 * _T + 9, _G] = _halves(b1)
    return b


def _c_fragments(d: np.ndarray) -> np.ndarray:
    return np.stack([d[_G, 2 * _T], d[_G, 2 * _T + 1], d[_G + 8, 2 * _T],
                     d[_G + 8, 2 * _T + 1]], 1)


def emulate_cl(x_cl: np.ndarray, w: np.ndarray, bias: np.ndarray,
               params: dict[str, int] | None = None, frag_korder: int | None = None) -> np.ndarray:
    """fcp_mma_cl on fp16 channels-last x_cl (B, H, W, 4): fp32 features (B, M, Hp, Wp).
    frag_korder builds the weight fragments with another k order (to show a mismatch fails)."""
    B, H, W, C = x_cl.shape
    M, _, K, _ = w.shape
    d = fused_cl.cl_plan(ConvShape(B, C, H, W, M, K), params).defines
    warps, korder, split, nv = d["CL_WARPS"], d["CL_KORDER"], d["CL_SPLIT"], d["CL_NV"]
    hp, wp = (H - K + 1) // 4, (W - K + 1) // 4
    ks, nt = (K + 3) // 4, 2 * nv
    rows, windows = hp * 4 - 1 + K, hp * wp
    units = windows // nv
    afrag = fused_cl.cl_fragments(w, korder if frag_korder is None else frag_korder)
    amats = [_a_matrix(afrag[s]) for s in range(K * ks)]
    b_lo = np.where(_G < M, bias[np.minimum(_G, M - 1)], 0.0)
    b_hi = np.where(_G + 8 < M, bias[np.minimum(_G + 8, M - 1)], 0.0)
    if split:
        half_ph = hp // 2 // nv * nv
        units_a = half_ph // nv * wp
        phases = [(0, units_a, (half_ph * 4 - 1 + K) * W // 2), (units_a, units, rows * W // 2)]
    else:
        phases = [(0, units, rows * W // 2)]
    y = np.full((B, M, hp, wp), np.nan)
    for b in range(B):
        image = np.ascontiguousarray(x_cl[b], np.float16).reshape(-1).view(np.uint32)
        smem = image[: rows * W * 2]  # in_s: rows x W pixels, 2 words each
        out_s = np.full(M * windows, np.nan)
        for start, end, staged_chunks in phases:
            visible = staged_chunks * 4  # words the cp.async groups waited for so far

            def load(word: np.ndarray, visible: int = visible,
                     smem: np.ndarray = smem) -> np.ndarray:
                assert word.min() >= 0 and word.max() < visible, "reads unstaged shared memory"
                return smem[word]

            for warp in range(warps):
                for u in range(start + warp, end, warps):
                    ph0, pw = (u // wp) * nv, u % wp
                    base = (ph0 * 4 + (_G >> 2)) * W + pw * 4 + (_G & 3) + _T  # pixel per lane
                    acc = np.zeros((nt, 32, 4))
                    for r in range(2 * (nt - 1) + K):
                        for h in range(ks):
                            if korder == 1:
                                pix = base + r * W + 4 * h
                                b0, b1 = load(2 * pix), load(2 * pix + 1)
                            else:
                                word = 2 * (base - _T + r * W + 4 * h) + _T
                                b0, b1 = load(word), load(word + 4)
                            bmat = _b_matrix(b0, b1)
                            for j in range(nt):
                                if 0 <= r - 2 * j < K:
                                    acc[j] += _c_fragments(amats[(r - 2 * j) * ks + h] @ bmat)
                    for v in range(nv):
                        a, c = acc[2 * v], acc[2 * v + 1]
                        lo = np.maximum(np.maximum(a[:, 0], a[:, 1]), np.maximum(c[:, 0], c[:, 1]))
                        hi = np.maximum(np.maximum(a[:, 2], a[:, 3]), np.maximum(c[:, 2], c[:, 3]))
                        for mask in (1, 2):
                            lo = np.maximum(lo, lo[fused_mma.LANE ^ mask])
                            hi = np.maximum(hi, hi[fused_mma.LANE ^ mask])
                        wi = (ph0 + v) * wp + pw
                        for ln in fused_mma.LANE[_T == 0]:
                            g = _G[ln]
                            if g < M:
                                out_s[g * windows + wi] = max(lo[ln] + b_lo[ln], 0.0)
                            if g + 8 < M:
                                out_s[(g + 8) * windows + wi] = max(hi[ln] + b_hi[ln], 0.0)
        y[b] = out_s.reshape(M, hp, wp)
    return y


def _problem(rng: np.random.Generator, shape: ConvShape) -> tuple[np.ndarray, ...]:
    """A ReLU-like fp16 channels-last input (the pooled C1 map) and mixed-sign weights."""
    x_cl = np.abs(rng.standard_normal((shape.B, shape.H, shape.W, 4))).astype(np.float16)
    w = (rng.standard_normal(shape.w_shape) * 0.1).astype(np.float32)
    b = (rng.standard_normal(shape.M) * 0.1).astype(np.float32)
    return x_cl, w, b


def _refs(x_cl: np.ndarray, w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp64 answer with the weights rounded to fp16 as the kernel feeds them, exact fp64)."""
    x = np.asarray(x_cl, np.float64).transpose(0, 3, 1, 2)
    w16 = w.astype(np.float16).astype(np.float64)
    return reference_conv_relu_pool(x, w16, b, 1, 4), reference_conv_relu_pool(x, w, b, 1, 4)


@pytest.mark.parametrize("params", VARIANTS, ids=str)
def test_cl_emulation_matches_fp64(params: dict[str, int], rng: np.random.Generator) -> None:
    x_cl, w, b = _problem(rng, C3)
    got = emulate_cl(x_cl, w, b, params)
    rounded, exact = _refs(x_cl, w, b)
    assert rel_l2(got, rounded) <= 1e-6  # only the fp32-vs-fp64 accumulation differs
    assert rel_l2(got, exact) <= TOLERANCE["fp16"]


@pytest.mark.parametrize("shape", ODD, ids=str)
def test_cl_emulation_odd_shapes(shape: ConvShape, rng: np.random.Generator) -> None:
    assert fused_cl.cl_supports(shape, 4)
    x_cl, w, b = _problem(rng, shape.with_batch(2))
    hp = fused_ffma.pooled_hw(shape, 4)[0]
    for params in ({}, {"korder": 0, "split": 1, "warps": 3}, {"nv": 2 if hp % 2 == 0 else hp}):
        got = emulate_cl(x_cl, w, b, params)
        assert rel_l2(got, _refs(x_cl, w, b)[0]) <= 1e-6, params


def test_cl_emulation_catches_a_wrong_k_order(rng: np.random.Generator) -> None:
    x_cl, w, b = _problem(rng, C3)
    got = emulate_cl(x_cl, w, b, {"korder": 1}, frag_korder=0)
    assert rel_l2(got, _refs(x_cl, w, b)[1]) > 0.1


@pytest.mark.parametrize("korder", fused_cl.KORDERS)
def test_cl_a_matrices_hold_every_tap_once(korder: int, rng: np.random.Generator) -> None:
    w = rng.standard_normal((11, 4, 7, 7)).astype(np.float32)
    a = fused_cl.cl_a_matrices(w, korder)  # (7 rows x 2 steps, 16, 16)
    assert a.shape == (14, 16, 16)
    assert not a[:, 11:].any()  # rows past M
    q, c = fused_cl.cl_taps(korder)
    assert sorted(zip(q.tolist(), c.tolist(), strict=True)) == [(i, j) for i in range(4)
                                                                for j in range(4)]
    for s in range(14):
        p, h = divmod(s, 2)
        for kk in range(16):
            col = 4 * h + q[kk]
            want = w[:, c[kk], p, col] if col < 7 else 0.0
            np.testing.assert_array_equal(a[s, :11, kk], want)


def test_cl_plan_and_supports() -> None:
    c3 = C3.with_batch(10000)
    assert fused_cl.cl_supports(c3, 4)
    assert not fused_cl.cl_supports(c3, 2)
    assert not fused_cl.cl_supports(ConvShape(1, 1, 40, 40, 16, 7), 4)  # C != 4
    assert not fused_cl.cl_supports(ConvShape(1, 4, 40, 40, 17, 7), 4)  # M > 16
    assert not fused_cl.cl_supports(ConvShape(1, 4, 26, 34, 16, 5), 4)  # padding taps past W
    d = fused_cl.cl_plan(c3).defines
    assert (d["CL_H"], d["CL_W"], d["CL_K"], d["CL_M"]) == (40, 40, 7, 16)
    assert fused_cl._cl_smem(c3) == 38 * 40 * 8 + 16 * 64 * 4  # 12160 B of map + 4 KB features
    with pytest.raises(ValueError, match="unknown"):
        fused_cl.cl_plan(c3, {"tph": 4})
    with pytest.raises(ValueError):
        fused_cl.cl_plan(c3, {"korder": 2})
    with pytest.raises(ValueError, match="pooled rows"):
        fused_cl.cl_plan(c3, {"nv": 3})  # 8 pooled rows: nv must divide them
    with pytest.raises(ValueError, match="support"):
        fused_cl.cl_plan(ConvShape(1, 3, 40, 40, 16, 7))


def test_toe_cl_plan_and_compile_jobs() -> None:
    defines, tiles_h, warps = fused_cl.toe_cl_plan(C1.with_batch(10000), {"tph": 0})
    base = fused_mma.tc_plan(C1.with_batch(10000), 2, "fp16")
    assert defines == base.defines  # tph 0: rung 17's plan
    assert (tiles_h, warps) == (base.tiles_h, base.warps)
    defines, tiles_h, warps = fused_cl.toe_cl_plan(C1)  # default: a block per image
    assert (defines["TC_TPH"], tiles_h, warps) == (40, 1, 2)
    defines, tiles_h, _ = fused_cl.toe_cl_plan(C1, {"tph": 40, "warps": 4})
    assert (defines["TC_TPH"], defines["TC_WARPS"], tiles_h) == (40, 4, 1)
    jobs = fused_cl.compile_jobs()
    files = {f for variants in jobs.values() for f, _ in variants}
    assert files == {fused_cl.KERNEL_FILE}
    assert all(d["TC_PREC"] == 0 for d in (d for _, d in next(iter(jobs.values()))))


def test_fused_lenet_rejects_a_bad_head(seed: int) -> None:
    from convolab.gpu.network import FusedLeNet

    with pytest.raises(ValueError, match="head imgs"):
        FusedLeNet(lenet_params(seed), mode="fp16", kernel_params={"head": {"imgs": 8}})


def test_cl_defaults_fall_back_where_nv_does_not_divide() -> None:
    assert fused_cl.cl_plan(C3).defines["CL_NV"] == fused_cl.CL_DEFAULTS["nv"]
    assert fused_cl.cl_plan(ODD[0]).defines["CL_NV"] == 1  # 5 pooled rows


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("shape", ODD, ids=str)
def test_cl_odd_shapes_compile(shape: ConvShape) -> None:
    """The shapes the GPU tests use beyond the network's (compile_jobs covers those)."""
    from convolab.gpu.compile import KERNEL_DIR, define_flags

    for params in ({}, {"korder": 0, "split": 1, "warps": 3}):
        flags = define_flags(fused_cl.cl_plan(shape, params).defines)
        proc = subprocess.run([str(shutil.which("nvcc")), "-arch=sm_90", "-std=c++17", "-cubin",
                               "-o", "/dev/null", *flags, str(KERNEL_DIR / fused_cl.KERNEL_FILE)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _nan_like(cp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    y = cp.empty(shape, dtype)
    y.fill(np.nan)
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("params", VARIANTS, ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_conv2_cl_matches_fp64(params: dict[str, int], batch: int,
                               rng: np.random.Generator) -> None:
    import cupy as cp

    shape = C3.with_batch(batch)
    x_cl, w, b = _problem(rng, shape)
    run = fused_cl.prepare_conv2_cl(shape, w, b, params)
    y = _nan_like(cp, (batch, 16, 8, 8), cp.float32)
    run(cp.asarray(x_cl), y)
    rounded, exact = _refs(x_cl, w, b)
    assert rel_l2(y, rounded) <= 1e-5
    assert rel_l2(y, exact) <= TOLERANCE["fp16"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD, ids=str)
def test_conv2_cl_odd_shapes(shape: ConvShape, rng: np.random.Generator) -> None:
    import cupy as cp

    shape = shape.with_batch(5)
    x_cl, w, b = _problem(rng, shape)
    hp, wp = fused_ffma.pooled_hw(shape, 4)
    for params in ({}, {"korder": 0, "split": 1, "warps": 3}, {"nv": 2 if hp % 2 == 0 else hp}):
        y = _nan_like(cp, (5, shape.M, hp, wp), cp.float32)
        fused_cl.prepare_conv2_cl(shape, w, b, params)(cp.asarray(x_cl), y)
        assert rel_l2(y, _refs(x_cl, w, b)[0]) <= 1e-5, params


@pytest.mark.gpu
@pytest.mark.parametrize("params", [{}, {"warps": 1}, {"warps": 4}, {"tph": 10}, {"tph": 0}],
                         ids=str)
def test_conv1_channels_last_output(params: dict[str, int], rng: np.random.Generator) -> None:
    import cupy as cp

    shape = C1.with_batch(3)
    x = rng.random(shape.x_shape).astype(np.float32)
    w = (rng.standard_normal(shape.w_shape) * 0.2).astype(np.float32)
    b = (rng.standard_normal(4) * 0.1).astype(np.float32)
    hp, wp = fused_ffma.pooled_hw(shape, 2)
    y = _nan_like(cp, (3, hp, wp, shape.M), cp.float16)
    fused_cl.prepare_conv1_cl(shape, w, b, params)(cp.asarray(x), y)
    got = y.get().astype(np.float64).transpose(0, 3, 1, 2)
    x16, w16 = (a.astype(np.float16).astype(np.float64) for a in (x, w))
    # fp32 accumulation of the rounded inputs, then one fp16 rounding of the output (2^-11)
    assert rel_l2(got, reference_conv_relu_pool(x16, w16, b, 1, 2)) <= 1e-3
    assert rel_l2(got, reference_conv_relu_pool(x, w, b, 1, 2)) <= TOLERANCE["fp16"]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 7, 333, 1000])
def test_fused_lenet_fp16_channels_last(batch: int, rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = lenet_params(int(rng.integers(1 << 30)))
    x = rng.random((batch, *IMAGE)).astype(np.float32)
    ref = reference_forward(params, x)
    net = FusedLeNet(params, mode="fp16")
    assert net.channels_last
    probs = net(cp.asarray(x)).get()
    assert np.all(np.isfinite(probs))
    assert rel_l2(probs, ref) <= TOLERANCE["fp16"]
    assert np.abs(probs - ref).max() <= 0.05
    top2 = np.sort(ref, 1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05  # argmax must agree wherever it is not a near-tie
    np.testing.assert_array_equal(probs.argmax(1)[clear], ref.argmax(1)[clear])
    # Rungs 17/18 with an fp32 NCHW intermediate round the same fp32 C1 values to fp16 (in
    # conv2's staging instead of conv1's store): the two differ only in fp32 summation order.
    nchw = FusedLeNet(params, mode="fp16")
    nchw.channels_last = False
    assert np.abs(nchw(cp.asarray(x)).get() - probs).max() <= 1e-4


@pytest.mark.gpu
def test_fused_lenet_fp16_chunks_and_tuning(rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = lenet_params(int(rng.integers(1 << 30)))
    x = rng.random((517, *IMAGE)).astype(np.float32)
    net = FusedLeNet(params, mode="fp16")
    single = net(cp.asarray(x)).get()
    np.testing.assert_array_equal(net.forward_chunks(x, chunk=200, streams=2), single)
    tuned = FusedLeNet(params, mode="fp16", kernel_params={
        "c1": {"tph": 0, "warps": 4}, "c3": {"korder": 0, "nv": 1, "warps": 4},
        "head": {"imgs": 16}})
    assert np.abs(tuned(cp.asarray(x)).get() - single).max() <= 1e-5
    np.testing.assert_array_equal(tuned.forward_chunks(x, chunk=100), tuned(cp.asarray(x)).get())
