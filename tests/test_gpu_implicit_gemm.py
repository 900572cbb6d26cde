"""Rungs 26-27 (implicit GEMM on mma.sync, and its split-K form).

GPU tests: every precision of both rungs against the fp64 reference on fresh random shapes
(odd sizes, C and M off the tile multiples, stride 1 and 2, K 1 and 3, batch 1), outputs
poisoned with NaN, at the defaults and at random points of the tunable space. CPU tests: the
host's planning rules (defines, split factor, k slices, supports) and the kernels' index
arithmetic replayed in NumPy — the channels-last gather of igemm.cuh as one GEMM equals the
fp64 convolution, and the ldmatrix addresses deliver exactly the mma.sync fragments.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
from conv_cases import Case, make_case

from convolab.check import poison, rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import implicit_gemm as ig
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = ("3xtf32", "tf32", "fp16", "bf16")
NAMES = [f"igemm-{m}" for m in MODES] + [f"igemm-splitk-{m}" for m in MODES]
N_SHAPES = 12
MIN_OUT = 2048  # reduced precisions: rel L2 is a statistic, so enough outputs (see advanced)


def random_shape(rng: np.random.Generator) -> ConvShape:
    """C and M off the multiples of 8/64/128, K 1 or 3, stride 1 or 2, batch 1..3."""
    while True:
        k, s = int(rng.choice([1, 3])), int(rng.choice([1, 2]))
        shape = ConvShape(int(rng.integers(1, 4)), int(rng.choice([3, 13, 64, 100, 200])),
                          int(rng.integers(k + 4, k + 24)), int(rng.integers(k + 4, k + 24)),
                          int(rng.choice([5, 70, 130, 200])), k, s)
        if shape.B * shape.M * shape.H_out * shape.W_out >= MIN_OUT and shape.flops < 2e8:
            return shape


# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [False, True])
def test_defaults_and_space_are_valid(mode: str, split: bool) -> None:
    impl = get_impl(f"igemm-{'splitk-' if split else ''}{mode}")
    assert impl.tolerance == TOLERANCE[mode]
    ig.igemm_defines(mode, impl.defaults)
    tiles = {k: v for k, v in impl.space.items() if k != "SPLIT"}
    points = [dict(zip(tiles, c, strict=True)) for c in itertools.product(*tiles.values())]
    # CI compiles every pair of tile values that a valid point has (compile.pairwise_points).
    compiled = impl.compile_variants()
    for point in points:
        d = ig.igemm_defines(mode, point)
        assert d["IG_MODE"] == ig.MODES[mode]
        assert ig.smem_bytes(mode, d["BM"], d["BN"], d["BK"], d["STAGES"]) <= ig.SMEM_LIMIT
        for a, b in itertools.combinations(tiles, 2):
            assert any(c[a] == d[a] and c[b] == d[b] for c in compiled), (a, b, point)
    assert len(compiled) < len(points)


def test_pairwise_points_cover_every_valid_pair(rng: np.random.Generator) -> None:
    """compile.pairwise_points on random spaces with a random refusal rule: every pair of
    values two valid points share is in a chosen point, only valid points are chosen, the
    answer is the same twice, and it is smaller than the product once the space is big."""
    from convolab.gpu.compile import pairwise_points

    for _ in range(20):
        space = {f"P{i}": tuple(range(int(rng.integers(1, 4)))) for i in range(
            int(rng.integers(2, 5)))}
        banned = int(rng.integers(0, 3))

        def define(point: dict, banned: int = banned) -> dict:
            if sum(point.values()) % 3 == banned and len(point) > 2:
                raise ValueError("refused")
            return {k: int(v) for k, v in point.items()}

        chosen = pairwise_points(space, define)
        assert chosen == pairwise_points(space, define)
        keys = sorted(space)
        valid = []
        for combo in itertools.product(*(space[k] for k in keys)):
            with contextlib.suppress(ValueError):
                valid.append(define(dict(zip(keys, combo, strict=True))))
        assert all(c in valid for c in chosen)
        for v in valid:
            for a, b in itertools.combinations(keys, 2):
                assert any(c[a] == v[a] and c[b] == v[b] for c in chosen), (space, v, a, b)


@pytest.mark.parametrize("bad", [
    {"BM": 48, "BN": 64, "BK": 32, "STAGES": 3},     # BM not a multiple of 32
    {"BM": 128, "BN": 128, "BK": 8, "STAGES": 3},    # 16-byte rows: no whole k-step
    {"BM": 128, "BN": 128, "BK": 32, "STAGES": 1},   # no pipeline
    {"BM": 256, "BN": 256, "BK": 128, "STAGES": 8},  # far over shared memory
])
def test_bad_defines_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="igemm"):
        ig.igemm_defines("fp16", bad)


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        ig.igemm_defines("fp8", {"BM": 128, "BN": 128, "BK": 32, "STAGES": 3})


def test_split_factor_rule(rng: np.random.Generator) -> None:
    fc6 = ConvShape(64, 25088, 1, 1, 4096, 1)
    conv1 = ConvShape(16, 64, 226, 226, 64, 3)
    assert ig.split_factor(conv1, 128, 128, 32) == 1  # 6272 tiles already fill the GPU
    assert ig.split_factor(fc6, 128, 64, 32) > 1  # 32 tiles for 132 SMs
    for _ in range(200):
        shape = ConvShape(int(rng.integers(1, 65)), int(rng.integers(1, 5000)), 1, 1,
                          int(rng.integers(1, 5000)), 1)
        bm, bn, bk = (int(rng.choice(v)) for v in ((64, 128), (32, 64), (16, 32)))
        f = ig.split_factor(shape, bm, bn, bk)
        M, N, Kd = ig.gemm_dims(shape)
        assert f >= 1 and f & (f - 1) == 0 and f <= ig.MAX_SPLIT
        if f > 1:  # every slice keeps >= 4 k-tiles, and splitting never overshoots 2 waves
            assert ceil_div(Kd, f) >= 4 * bk
            assert ceil_div(M, bm) * ceil_div(N, bn) * f <= 2 * ig.DEFAULT_SMS


def test_k_slices_cover_k_exactly(rng: np.random.Generator) -> None:
    for _ in range(500):
        kd, split, bk = (int(rng.integers(1, 30000)), int(rng.integers(1, 40)),
                         int(rng.choice([16, 32, 64])))
        k_slice, slices = ig.k_slices(kd, split, bk)
        assert k_slice % bk == 0 and slices <= max(split, 1)
        assert (slices - 1) * k_slice < kd <= slices * k_slice


def test_supports_and_layout_pass() -> None:
    fc7 = ConvShape(4, 4096, 1, 1, 1024, 1)
    assert ig.supports(fc7) and ig.supports(ConvShape(16, 64, 226, 226, 64, 3))
    assert not ig.needs_layout_pass(fc7, "3xtf32")  # NCHW of a 1x1 image is channels-last
    assert ig.needs_layout_pass(fc7, "fp16")  # the operand type still differs
    assert ig.needs_layout_pass(ConvShape(4, 4095, 1, 1, 8, 1), "tf32")  # C needs padding
    assert not ig.supports(ConvShape(70000, 3, 1, 1, 4, 1))  # grid.z of the layout pass


def gather_gemm(x: np.ndarray, w: np.ndarray, b: np.ndarray, shape: ConvShape) -> np.ndarray:
    """igemm.cuh's addressing in NumPy: weights (M, K, K, Cp), x channels-last (B, H, W, Cp),
    B[k, n] read at pixel base + ((p*W + q)*Cp + c) with tap = k / Cp, p = tap / K."""
    cp_ = ig.padded_channels(shape.C)
    M, N, Kd = ig.gemm_dims(shape)
    a = np.zeros((M, shape.K, shape.K, cp_))
    a[..., :shape.C] = w.transpose(0, 2, 3, 1)
    xcl = np.zeros((shape.B, shape.H, shape.W, cp_))
    xcl[..., :shape.C] = x.transpose(0, 2, 3, 1)
    flat = xcl.ravel()
    n = np.arange(N)
    bb, r = n // (shape.H_out * shape.W_out), n % (shape.H_out * shape.W_out)
    ho, wo = r // shape.W_out, r % shape.W_out
    base = ((bb * shape.H + ho * shape.S) * shape.W + wo * shape.S) * cp_
    k = np.arange(Kd)
    tap, c = k // cp_, k % cp_
    p, q = tap // shape.K, tap % shape.K
    koff = (p * shape.W + q) * cp_ + c
    gemm = a.reshape(M, Kd) @ flat[koff[:, None] + base[None, :]] + b[:, None]
    y = gemm.reshape(M, shape.B, shape.H_out * shape.W_out).transpose(1, 0, 2)
    return y.reshape(shape.y_shape)


def test_gather_arithmetic_is_the_convolution(rng: np.random.Generator) -> None:
    for _ in range(6):
        shape = random_shape(rng)
        case = make_case(rng, shape)
        assert rel_l2(gather_gemm(case.x, case.w, case.b, shape), case.ref) < 1e-12


def test_loader_pieces_address_the_gather(rng: np.random.Generator) -> None:
    """IgLoader replayed: a B piece is b_ptr (the pixel) + b_off (tap and channel of its first
    k); its IG_VEC elements must be the channels-last elements of k, k+1, ... of that pixel."""
    for _ in range(4):
        shape = random_shape(rng)
        cp_ = ig.padded_channels(shape.C)
        _, N, Kd = ig.gemm_dims(shape)
        for esize in (2, 4):
            vec = 16 // esize
            n = rng.integers(0, N, 64)
            bb, r = n // (shape.H_out * shape.W_out), n % (shape.H_out * shape.W_out)
            ho, wo = r // shape.W_out, r % shape.W_out
            b_ptr = ((bb * shape.H + ho * shape.S) * shape.W + wo * shape.S) * cp_
            k = rng.integers(0, Kd // vec, 64) * vec  # first element of a piece
            tap = k // cp_
            p, q = tap // shape.K, tap % shape.K
            b_off = (p * shape.W + q) * cp_ + k - tap * cp_
            for e in range(vec):
                ke = k + e
                want = ((bb * shape.H + ho * shape.S + (ke // cp_) // shape.K) * shape.W
                        + wo * shape.S + (ke // cp_) % shape.K) * cp_ + ke % cp_
                assert np.array_equal(b_ptr + b_off + e, want)


def ldmatrix_x4(rows: np.ndarray, addr: list[tuple[int, int]]) -> np.ndarray:
    """What each lane receives: matrix j is addressed by lanes 8j..8j+7 (row, byte offset);
    lane l gets 4 bytes of row l/4 of each matrix at byte 4*(l%4)."""
    out = np.zeros((32, 4, 4), dtype=np.uint8)
    for lane, j in itertools.product(range(32), range(4)):
        row, byte = addr[8 * j + lane // 4]
        out[lane, j] = rows[row, byte + 4 * (lane % 4): byte + 4 * (lane % 4) + 4]
    return out


@pytest.mark.parametrize("esize", [2, 4])
def test_ldmatrix_addresses_give_mma_fragments(esize: int) -> None:
    """A 16 x k-step and B 16 x k-step tiles with element (r, k) = r*100 + k: the registers
    each lane gets must hold the m16n8k16 (fp16) / m16n8k8 (tf32) fragment elements."""
    kstep = 32 // esize
    dtype = np.uint16 if esize == 2 else np.uint32
    tile = (np.arange(16)[:, None] * 100 + np.arange(kstep)[None, :]).astype(dtype)
    rows = tile.view(np.uint8)
    a = ldmatrix_x4(rows, [(lane % 16, (lane // 16) * 16) for lane in range(32)]).view(dtype)
    b = ldmatrix_x4(rows, [((lane % 8) + (lane // 16) * 8, ((lane // 8) % 2) * 16)
                           for lane in range(32)]).view(dtype)
    per = 4 // esize  # elements per register
    for lane in range(32):
        g, t = lane // 4, lane % 4
        # A: a0 (g, k0), a1 (g+8, k0), a2 (g, k0+kstep/2), a3 (g+8, k0+kstep/2), k0 = per*t.
        for reg, (dr, dk) in enumerate([(0, 0), (8, 0), (0, kstep // 2), (8, kstep // 2)]):
            want = [(g + dr) * 100 + per * t + dk + e for e in range(per)]
            assert list(a[lane, reg]) == want
        # B (n8 blocks 0 and 1): b0 (k0, n g), b1 (k0 + kstep/2, n g).
        for reg, (dn, dk) in enumerate([(0, 0), (0, kstep // 2), (8, 0), (8, kstep // 2)]):
            want = [(g + dn) * 100 + per * t + dk + e for e in range(per)]
            assert list(b[lane, reg]) == want


@pytest.mark.parametrize("row_bytes", [32, 64, 128])
def test_padded_rows_are_free_of_bank_conflicts(row_bytes: int) -> None:
    pitch = row_bytes + 16  # IG_ROWB
    for rows in (range(8), range(8, 16)):
        groups = {(r * pitch // 16) % 8 for r in rows}
        assert len(groups) == 8  # 8 rows x 16 bytes land on all 32 banks once


@pytest.mark.parametrize("mode", MODES)
def test_loader_covers_each_stage_piece_once(mode: str) -> None:
    """At every tile point of both rungs' spaces."""
    variants = []
    for name in (f"igemm-{mode}", f"igemm-splitk-{mode}"):
        tiles = {k: v for k, v in get_impl(name).space.items() if k != "SPLIT"}
        variants += [ig.igemm_defines(mode, dict(zip(tiles, c, strict=True)))
                     for c in itertools.product(*tiles.values())]
    for d in variants:
        threads = 32 * d["WARPS_M"] * d["WARPS_N"]
        chunks = d["BK"] * ig.elem_bytes(mode) // 16
        for rows in (d["BM"], d["BN"]):
            seen = [(t // chunks + i * (threads // chunks), t % chunks)
                    for t in range(threads) for i in range(rows * chunks // threads)]
            assert sorted(seen) == sorted(itertools.product(range(rows), range(chunks)))


# ------------------------------------------------------------------------------- GPU


def run_impl(name: str, case: Case, params: dict | None = None) -> float:
    import cupy as cp

    impl = get_impl(name)
    run = impl.prepare(case.shape, cp.asarray(case.w), cp.asarray(case.b),
                       impl.params_for(params))
    y = cp.empty(case.shape.y_shape, dtype=cp.float32)
    poison(y)
    run(cp.asarray(case.x), y)
    return rel_l2(y, case.ref)


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
    failures = []
    for case in cases:
        assert impl.supports(case.shape)
        point = {k: impl.space[k][int(rng.integers(len(impl.space[k])))] for k in keys}
        for params in (None, point):
            err = run_impl(name, case, params)
            if not err <= impl.tolerance:
                failures.append(f"{case.shape} {params}: rel_l2 {err:.3g}")
    assert not failures, f"{name} (tol {impl.tolerance}):\n" + "\n".join(failures[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["3xtf32", "fp16"])
def test_classifier_layer_deep_k(mode: str, rng: np.random.Generator) -> None:
    """fc7's 4096-term sums at batch 1, 3 and 16 (split-K with its automatic factor and forced
    ones, 16- and 64-column tiles): the 3xtf32 per-tile fp32 adds must keep the long sum at
    fp32 accuracy."""
    for batch, split, bn in ((1, 0, 16), (3, 8, 64), (16, 4, 16)):
        shape = ConvShape(batch, 4096, 1, 1, 1024, 1)
        x = rng.standard_normal(shape.x_shape, dtype=np.float32)
        w = rng.standard_normal(shape.w_shape, dtype=np.float32) / np.float32(64)
        b = rng.standard_normal(shape.M, dtype=np.float32)
        case = Case(shape, x, w, b, conv_reference(x, w, b))
        for name, params in ((f"igemm-{mode}", None),
                             (f"igemm-splitk-{mode}", {"SPLIT": split, "BN": bn})):
            err = run_impl(name, case, params)
            assert err <= TOLERANCE[mode], f"{name} B={batch}: {err:.3g}"


def test_plan_picks_valid_tiles_for_every_vgg_batch() -> None:
    from convolab.bench.cases import VGG_SWEEP_BATCHES, vgg_cases

    for mode in MODES:
        for case, batch in itertools.product(vgg_cases(64), VGG_SWEEP_BATCHES):
            name, params = ig.plan(case.shape.with_batch(batch), mode)
            impl = get_impl(name)
            assert impl.supports(case.shape.with_batch(batch))
            ig.igemm_defines(mode, impl.params_for(params))
            assert all(v in impl.space[k] for k, v in params.items())
    with pytest.raises(ValueError, match="unknown mode"):
        ig.plan(ConvShape(1, 64, 8, 8, 64, 3), "fp8")
