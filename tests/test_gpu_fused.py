"""Rung 13 (fused-conv-pool, exact and tensor-core) and the whole-network FusedLeNet.

GPU tests compare against fp64 NumPy on fresh random data with NaN-poisoned outputs. The
CPU tests replay the tensor-core kernels' fragment index arithmetic in NumPy (the PTX
m16n8k16 / m16n8k8 register layouts), so a wrong mapping fails here before any GPU run.
"""

from __future__ import annotations

import numpy as np
import pytest

from convolab.check import poison, rel_l2
from convolab.conv_cpu import reference_conv_relu_pool, reference_forward
from convolab.gpu import fused, fused_ffma, fused_mma
from convolab.models import build, conv_blocks, param_shapes
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape

# ---------------------------------------------------------------------------------------------
# fp64 reference
# ---------------------------------------------------------------------------------------------


def lenet_params(seed: int) -> dict[str, np.ndarray]:
    """The ece408 model's parameters, float32: models.build's init plus random biases (build
    zeroes them, and a zero bias would hide a bias bug)."""
    rng = np.random.default_rng(seed)
    params = {k: np.asarray(v, np.float32) for k, v in build("ece408", seed).params().items()}
    for name in params:
        if name.endswith(".bias"):
            params[name] = (0.1 * rng.standard_normal(params[name].shape)).astype(np.float32)
    return params


def random_shape(rng: np.random.Generator, tc: bool = False) -> tuple[ConvShape, int]:
    """A shape whose pooled output exists (and, for tc, one the mma kernels take)."""
    while True:
        if tc:
            P = int(rng.choice([2, 4]))
            K = int(rng.integers(1, 9))
            C = int(rng.integers(1, max(2, 32 // K + 1)))
            M = int(rng.integers(1, 17))
            S = 1
        else:
            P = int(rng.choice([1, 2, 3, 4, 5, 9]))
            K = int(rng.integers(1, 10))
            C = int(rng.integers(1, 7))
            M = int(rng.integers(1, 21))
            S = int(rng.integers(1, 4))
        H = int(rng.integers(K + (P - 1) * S, K + 45))
        W = int(rng.integers(K + (P - 1) * S, K + 45))
        shape = ConvShape(int(rng.integers(1, 4)), C, H, W, M, K, S)
        if fused_ffma.supports_pool(shape, P) and (
                not tc or fused_mma.tc_kind(shape, P) is not None):
            return shape, P


ECE408 = [(block.shape, block.pool) for block in conv_blocks("ece408", 5)]
C1, C3 = (block.shape for block in conv_blocks("ece408"))
IMAGE = C1.x_shape[1:]

# ---------------------------------------------------------------------------------------------
# CPU: NumPy replay of the tensor-core kernels' index arithmetic
# ---------------------------------------------------------------------------------------------


def _unpack(regs: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    if precision == "fp16":
        lo = (regs & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
        hi = (regs >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
        return lo, hi
    return regs.astype(np.uint32).view(np.float32).astype(np.float64)


def _round(v: np.ndarray, precision: str) -> np.ndarray:
    if precision == "fp16":
        return np.asarray(v, np.float32).astype(np.float16).astype(np.float64)
    return fused_mma.tf32_bits(np.asarray(v, np.float32)).view(np.float32).astype(np.float64)


def _a_matrix(regs: np.ndarray, precision: str) -> np.ndarray:
    """16 x k matrix from per-lane A registers (32, 4), PTX row-major fragment layout."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    if precision == "fp16":
        a = np.zeros((16, 16))
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                        (g + 8, 2 * t + 8))):
            lo, hi = _unpack(regs[:, r], precision)
            a[row, col], a[row, col + 1] = lo, hi
        return a
    a = np.zeros((16, 8))
    v = _unpack(regs, precision)
    a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4] = v[:, 0], v[:, 1], v[:, 2], v[:, 3]
    return a


def _b_matrix(b0: np.ndarray, b1: np.ndarray, precision: str) -> np.ndarray:
    """k x 8 matrix from per-lane B values; fp16 b0/b1 are (32, 2) pairs, tf32 (32,)."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    if precision == "fp16":
        b = np.zeros((16, 8))
        b[2 * t, g], b[2 * t + 1, g] = b0[:, 0], b0[:, 1]
        b[2 * t + 8, g], b[2 * t + 9, g] = b1[:, 0], b1[:, 1]
        return b
    b = np.zeros((8, 8))
    b[t, g], b[t + 4, g] = b0, b1
    return b


def _c_fragments(d: np.ndarray) -> np.ndarray:
    g, t = np.arange(32) // 4, np.arange(32) % 4
    return np.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]], 1)


def emulate_wa(
    x: np.ndarray, w: np.ndarray, bias: np.ndarray, P: int, precision: str
) -> np.ndarray:
    shape = ConvShape.of(x.shape, w.shape)
    plan = fused_mma.tc_plan(shape, P, precision)
    d = plan.defines
    C, K, TPH, TPW = d["TC_C"], d["TC_K"], d["TC_TPH"], d["TC_TPW"]
    M = shape.M
    hp, wp = fused_ffma.pooled_hw(shape, P)
    IR, RS = TPH * P - 1 + K, ((TPW * P - 1 + 8) + 1) // 2 * 2 + 2
    TILE, R = C * IR * RS, C * K
    fp16 = precision == "fp16"
    steps = (R + 1) // 2 if fp16 else R
    afrag = fused_mma.wa_fragments(w, precision)
    amats = [_a_matrix(afrag[s], precision) for s in range(steps)]
    windows = TPH * TPW
    units = windows if P == 4 else (windows + 1) // 2
    nj = 2 if P == 4 else 1
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    y = np.full((shape.B, M, hp, wp), np.nan)

    def row_off(r: int) -> int:
        rr = r if r < R else 0
        return ((rr // K) * IR + rr % K) * RS

    for b in range(shape.B):
        for tile in range(plan.tiles_w * plan.tiles_h):
            ty_, tx_ = tile // plan.tiles_w, tile % plan.tiles_w
            iy0, ix0 = ty_ * TPH * P, tx_ * TPW * P
            padded = np.zeros((C, IR, RS + 1))
            src = x[b, :, iy0:iy0 + IR, ix0:ix0 + RS + 1]
            padded[:, : src.shape[1], : src.shape[2]] = src
            sm = np.concatenate([_round(padded[:, :, :RS], precision).ravel(),
                                 _round(padded[:, :, 1:], precision).ravel()])
            for u in range(units):
                vlo, vhi = np.full(32, -np.inf), np.full(32, -np.inf)
                for j in range(nj):
                    if P == 4:
                        wi, dy, dx = np.full(32, u), 2 * j + (g >> 2), g & 3
                    else:
                        wi = np.minimum(2 * u + (g >> 2), windows - 1)
                        dy, dx = (g >> 1) & 1, g & 1
                    oh, ow = (wi // TPW) * P + dy, (wi % TPW) * P + dx
                    acc = np.zeros((32, 4))
                    for s in range(steps):
                        if fp16:
                            base = (ow & 1) * TILE + oh * RS + (ow & ~1) + 2 * t
                            i0, i1 = base + row_off(2 * s), base + row_off(2 * s + 1)
                            b0 = np.stack([sm[i0], sm[i0 + 1]], 1)
                            b1 = np.stack([sm[i1], sm[i1 + 1]], 1)
                        else:
                            base = oh * RS + ow + t
                            b0, b1 = sm[base + row_off(s)], sm[base + row_off(s) + 4]
                        acc += _c_fragments(amats[s] @ _b_matrix(b0, b1, precision))
                    vlo = np.maximum(vlo, np.maximum(acc[:, 0], acc[:, 1]))
                    vhi = np.maximum(vhi, np.maximum(acc[:, 2], acc[:, 3]))
                for mask in (1, 2) if P == 4 else (1,):
                    vlo, vhi = np.maximum(vlo, vlo[lane ^ mask]), np.maximum(vhi, vhi[lane ^ mask])
                writer = t == 0 if P == 4 else (t & 1) == 0
                wi_w = np.full(32, u) if P == 4 else 2 * u + (t >> 1)
                for ln in lane[writer]:
                    ph = ty_ * TPH + wi_w[ln] // TPW
                    pw = tx_ * TPW + wi_w[ln] % TPW
                    if wi_w[ln] < windows and ph < hp and pw < wp:
                        for m, v in ((g[ln], vlo[ln]), (g[ln] + 8, vhi[ln])):
                            if m < M:
                                y[b, m, ph, pw] = max(v + bias[m], 0.0)
    return y


def emulate_toe(x: np.ndarray, w: np.ndarray, bias: np.ndarray, precision: str) -> np.ndarray:
    shape = ConvShape.of(x.shape, w.shape)
    plan = fused_mma.tc_plan(shape, 2, precision)
    d = plan.defines
    C, K, M, TPH, TPW = d["TC_C"], d["TC_K"], d["TC_M"], d["TC_TPH"], d["TC_TPW"]
    hp, wp = fused_ffma.pooled_hw(shape, 2)
    NG = (2 * TPW + 7) // 8
    IR, RS = (TPH * 2 - 1) + K, NG * 8 + 8
    combos, R = TPH * NG, C * K
    fp16 = precision == "fp16"
    ksteps = 1 if fp16 else 2
    bfrag = fused_mma.toeplitz_fragments(w, precision)  # (R, ksteps, M, 32, 2)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    y = np.full((shape.B, M, hp, wp), np.nan)
    for b in range(shape.B):
        for tile_y in range(plan.tiles_h):
            padded = np.zeros((C, IR, RS))
            src = x[b, :, tile_y * TPH * 2:tile_y * TPH * 2 + IR, :RS]
            padded[:, : src.shape[1], : src.shape[2]] = src
            sm = _round(padded, precision).ravel()
            for mt in range((combos + 7) // 8):
                combo = np.minimum(mt * 8 + g, combos - 1)
                ph_l, ow0 = combo // NG, (combo % NG) * 8
                acc = np.zeros((M, 32, 4))
                for r in range(R):
                    c, p = r // K, r % K
                    row0 = (c * IR + 2 * ph_l + p) * RS + ow0
                    row1 = row0 + RS
                    for h in range(ksteps):
                        if fp16:
                            a = np.zeros((16, 16))
                            for rows, off in ((row0, 0), (row1, 0), (row0, 8), (row1, 8)):
                                rr = g + (8 if rows is row1 else 0)
                                a[rr, 2 * t + off] = sm[rows + 2 * t + off]
                                a[rr, 2 * t + off + 1] = sm[rows + 2 * t + off + 1]
                        else:
                            a = np.zeros((16, 8))
                            a[g, t], a[g + 8, t] = sm[row0 + 8 * h + t], sm[row1 + 8 * h + t]
                            a[g, t + 4] = sm[row0 + 8 * h + t + 4]
                            a[g + 8, t + 4] = sm[row1 + 8 * h + t + 4]
                        for n in range(M):
                            regs = bfrag[r, h, n]
                            if fp16:
                                lo0, hi0 = _unpack(regs[:, 0], precision)
                                lo1, hi1 = _unpack(regs[:, 1], precision)
                                bm = _b_matrix(np.stack([lo0, hi0], 1), np.stack([lo1, hi1], 1),
                                               precision)
                            else:
                                v = _unpack(regs, precision)
                                bm = _b_matrix(v[:, 0], v[:, 1], precision)
                            acc[n] += _c_fragments(a @ bm)
                ph, pw = tile_y * TPH + ph_l, ow0 // 2 + t
                ok = (mt * 8 + g < combos) & (ph_l < TPH) & (ph < hp) & (pw < wp)
                for ln in lane[ok]:
                    for n in range(M):
                        y[b, n, ph[ln], pw[ln]] = max(acc[n, ln].max() + bias[n], 0.0)
    return y


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_tc_fragment_mapping_conv2_emulated(precision: str, rng: np.random.Generator) -> None:
    x = rng.random(C3.x_shape).astype(np.float32)
    w = (rng.standard_normal(C3.w_shape) * 0.1).astype(np.float32)
    b = (rng.standard_normal(C3.M) * 0.1).astype(np.float32)
    got = emulate_wa(x, w, b, 4, precision)
    assert rel_l2(got, reference_conv_relu_pool(x, w, b, 1, 4)) < TOLERANCE[precision]


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_tc_fragment_mapping_pool2_odd_shape_emulated(precision: str,
                                                     rng: np.random.Generator) -> None:
    x = rng.random((1, 3, 23, 27)).astype(np.float32)
    w = (rng.standard_normal((11, 3, 5, 5)) * 0.1).astype(np.float32)
    b = (rng.standard_normal(11) * 0.1).astype(np.float32)
    got = emulate_wa(x, w, b, 2, precision)
    assert rel_l2(got, reference_conv_relu_pool(x, w, b, 1, 2)) < TOLERANCE[precision]


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_tc_fragment_mapping_conv1_emulated(precision: str, rng: np.random.Generator) -> None:
    x = rng.random((1, 1, 40, 38)).astype(np.float32)  # conv1's filters on an odd-sized image
    shapes = param_shapes("ece408")
    w = (rng.standard_normal(shapes["c1.weight"]) * 0.2).astype(np.float32)
    b = (rng.standard_normal(shapes["c1.bias"]) * 0.1).astype(np.float32)
    got = emulate_toe(x, w, b, precision)
    assert rel_l2(got, reference_conv_relu_pool(x, w, b, 1, 2)) < TOLERANCE[precision]


def test_plans_cover_ece408_and_reject_nothing_defined() -> None:
    for shape, pool in ECE408:
        assert fused_ffma.exact_plan(shape, pool, {}) is not None
        assert fused_mma.tc_kind(shape, pool) is not None
    assert fused_ffma.exact_plan(ConvShape(1, 1, 40, 40, 2, 3), 9, {}) is None  # -> fcp_simple
    assert not fused_ffma.supports_pool(ConvShape(1, 1, 8, 8, 1, 7), 4)  # 2x2 output, no 4x4 window


def test_registry_names_and_pool_field() -> None:
    from convolab.registry import get_impl

    for pool in (2, 4):
        assert get_impl(f"fused-conv-pool{pool}").pool == pool
        assert get_impl(f"fused-conv-pool{pool}-tc").pool == pool
    assert fused.fused_conv_pool_impl(3).out_shape(ConvShape(2, 1, 20, 20, 5, 3)) == (2, 5, 6, 6)
    with pytest.raises(ValueError, match="pool"):
        fused.fused_conv_pool_impl(0)


def test_reference_forward_matches_the_cpu_network(rng: np.random.Generator) -> None:
    seed = int(rng.integers(1 << 30))
    params = lenet_params(seed)
    assert {k: v.shape for k, v in params.items()} == param_shapes("ece408")
    x = rng.random((3, *conv_blocks("ece408")[0].shape.x_shape[1:])).astype(np.float32)
    probs = reference_forward(params, x)
    assert probs.shape == (3, 10)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-12)
    net = build("ece408", seed)
    for name, value in params.items():
        net.set_param(name, value)
    np.testing.assert_allclose(probs, np.asarray(net.forward(x), np.float64), rtol=1e-4,
                               atol=1e-6)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _run_impl(impl, shape: ConvShape, x, w, b):  # noqa: ANN001, ANN202
    import cupy as cp

    run = impl.prepare(shape, cp.asarray(w), cp.asarray(b), impl.params_for())
    y = cp.empty(impl.out_shape(shape), cp.float32)
    poison(y)
    run(cp.asarray(x), y)
    return y


def _random_problem(rng: np.random.Generator, shape: ConvShape):  # noqa: ANN202
    x = rng.standard_normal(shape.x_shape).astype(np.float32)
    w = rng.standard_normal(shape.w_shape).astype(np.float32)
    b = rng.standard_normal(shape.M).astype(np.float32)
    return x, w, b


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(50))
def test_fused_conv_pool_exact_random_shapes(case: int, rng: np.random.Generator) -> None:
    shape, pool = ECE408[case] if case < len(ECE408) else random_shape(rng)
    x, w, b = _random_problem(rng, shape)
    y = _run_impl(fused.fused_conv_pool_impl(pool), shape, x, w, b)
    err = rel_l2(y, reference_conv_relu_pool(x, w, b, shape.S, pool))
    assert err <= 1e-5, f"{shape} pool {pool}: rel err {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "tf32"])
@pytest.mark.parametrize("case", range(12))
def test_fused_conv_pool_tc_random_shapes(case: int, precision: str,
                                          rng: np.random.Generator) -> None:
    shape, pool = ECE408[case] if case < len(ECE408) else random_shape(rng, tc=True)
    x, w, b = _random_problem(rng, shape)
    x = np.abs(x)  # mixed signs at unit scale: relative error stays meaningful after ReLU
    impl = fused.fused_conv_pool_impl(pool, precision)
    y = _run_impl(impl, shape, x, w, b)
    # The kernel's own arithmetic: exact (fp32 accumulation) on the inputs it rounds itself.
    rounded = reference_conv_relu_pool(round_like_tc(x, precision), round_like_tc(w, precision),
                                       b, 1, pool)
    err_kernel = rel_l2(y, rounded)
    assert err_kernel <= 1e-5, f"{shape} pool {pool} {precision}: kernel err {err_kernel}"
    # The promise against the true result holds on the layers it exists for. On small random
    # shapes the input rounding alone can exceed any fixed bound (a B=1, M=1, K=2 output of
    # 44 values: 4.5e-3 in tf32 on the device, 2026-11-23), so there the check above, the
    # kernel against its own rounded inputs, is the whole statement.
    if case < len(ECE408):
        err = rel_l2(y, reference_conv_relu_pool(x, w, b, 1, pool))
        assert err <= impl.tolerance, f"{shape} pool {pool} {precision}: rel err {err}"


def round_like_tc(a: np.ndarray, precision: str) -> np.ndarray:
    """What the tensor-core kernels feed the MMA: fp16 round-to-nearest-even, or tf32 rounded
    to nearest with ties away from zero (cvt.rna.tf32.f32: 10 mantissa bits)."""
    if precision == "fp16":
        return a.astype(np.float16).astype(np.float32)
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def test_round_like_tc_keeps_ten_mantissa_bits() -> None:
    a = np.array([1 + 2**-11, 1 + 2**-12, -(1 + 3 * 2**-11), 1.0], np.float32)
    assert list(round_like_tc(a, "tf32")) == [1 + 2**-10, 1.0, -(1 + 2 * 2**-10), 1.0]
    assert round_like_tc(np.array([1 + 2**-11], np.float32), "fp16")[0] == 1.0  # ties to even


@pytest.mark.gpu
def test_fcp_simple_fallback_large_pool(rng: np.random.Generator) -> None:
    shape = ConvShape(2, 3, 30, 31, 5, 3, 1)
    x, w, b = _random_problem(rng, shape)
    y = _run_impl(fused.fused_conv_pool_impl(9), shape, x, w, b)
    assert rel_l2(y, reference_conv_relu_pool(x, w, b, 1, 9)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 7, 1000])
def test_fused_lenet_exact_matches_fp64(batch: int, rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = lenet_params(int(rng.integers(1 << 30)))
    x = rng.random((batch, *IMAGE)).astype(np.float32)
    ref = reference_forward(params, x)
    net = FusedLeNet(params, mode="exact")
    probs = net(cp.asarray(x)).get()
    assert np.all(np.isfinite(probs))
    assert np.abs(probs - ref).max() <= 1e-5 * max(1.0, float(np.abs(ref).max()))
    assert rel_l2(probs, ref) <= 1e-5
    np.testing.assert_array_equal(probs.argmax(1), ref.argmax(1))
    # per-layer intermediates too
    net(cp.asarray(x))
    _, (_, a1, a3) = net._plan(batch)
    n = min(batch, 50)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    r1 = reference_conv_relu_pool(x[:n], p64["c1.weight"], p64["c1.bias"], 1, ECE408[0][1])
    assert rel_l2(a1[:n], r1) <= 1e-5
    r3 = reference_conv_relu_pool(a1[:n].get(), p64["c3.weight"], p64["c3.bias"], 1,
                                  ECE408[1][1])
    assert rel_l2(a3[:n], r3) <= 1e-5


@pytest.mark.gpu
# whole network: two tensor-core layers, so tf32 gets twice its per-layer promise
@pytest.mark.parametrize("mode,tol", [("fp16", TOLERANCE["fp16"]), ("tf32", 2 * TOLERANCE["tf32"])])
def test_fused_lenet_tensor_core_modes(mode: str, tol: float, rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = lenet_params(int(rng.integers(1 << 30)))
    x = rng.random((1000, *IMAGE)).astype(np.float32)
    ref = reference_forward(params, x)
    probs = FusedLeNet(params, mode=mode)(cp.asarray(x)).get()
    assert rel_l2(probs, ref) <= tol
    assert (probs.argmax(1) == ref.argmax(1)).mean() >= 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,streams", [(300, 2), (128, 3), (1000, 2)])
def test_forward_chunks_equals_single_shot(chunk: int, streams: int,
                                           rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    net = FusedLeNet(lenet_params(int(rng.integers(1 << 30))), mode="exact")
    x = rng.random((1000, *IMAGE)).astype(np.float32)
    single = net(cp.asarray(x)).get()
    streamed = net.forward_chunks(x, chunk=chunk, streams=streams)
    np.testing.assert_array_equal(streamed, single)
    probs, rate = net.throughput(x[:257], chunk=100)
    np.testing.assert_array_equal(probs, single[:257])
    assert rate > 0


@pytest.mark.gpu
def test_fused_lenet_rejects_bad_input() -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = lenet_params(0)
    with pytest.raises(ValueError, match="mode"):
        FusedLeNet(params, mode="int8")
    bad = dict(params)
    bad["f5.weight"] = bad["f5.weight"][:, :10]
    with pytest.raises(ValueError, match="f5.weight"):
        FusedLeNet(bad)
    net = FusedLeNet(params)
    with pytest.raises(ValueError, match="86"):
        net(cp.zeros((2, 1, 28, 28), cp.float32))
    with pytest.raises(TypeError):
        net(np.zeros((2, *IMAGE), np.float32))
