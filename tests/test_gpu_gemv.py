"""Kernel 41 (`gemv-fp32`, `gemv-tf32`, `gemv-fp16`, `gemv-bf16`): classifier layers at small
batch as a weight-streaming GEMV.

CPU tests: the host's launch plan (slices cover k exactly, shared memory, every define set a
prepare can ask for is among those CI compiles), the TF32 weights' two planes (unpacked, bit
for bit the TF32 rounding of every weight: signs, subnormals, carries into the next binade,
ties, overflow, inf and NaN), the kernel's warp reduce-scatter replayed in NumPy (every one of
a row slot's sums lands in exactly one lane, at the index the kernel writes it to), and the
kernel source itself run on the CPU by the emulator (tests/cuda_emulator.py: one std::thread a
CUDA thread) on small layers in every mode, with slices and row groups, launched twice with the
blocks in a random order each time. GPU tests: every mode against the fp64 reference on fresh
random shapes (B 1-16, C and M off the tile multiples), outputs poisoned with NaN, at the
defaults and at random points of the space, each run twice (bit-identical: the slice sum is
ordered and the tickets reset), VGG's fc6/fc7 at batches 1, 3 and 16, and `gemv-tf32` at every
batch size class on fc-like layers (within TF32's tolerance of fp64, and at fp32 accuracy
against fp64 with the TF32-rounded weights: the kernel's operands are the TF32 values).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conv_cases import FC6, FC7, Case, make_case, outputs_of_two_runs
from cuda_emulator import BLOCK_SHIM, CUDA_SHIM, GEMV_SHIM, MMA_SHIM, run_gemv_emulator

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import gemv
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.gpu.implicit_gemm_wgmma import tf32_round
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

NAMES = [f"gemv-{m}" for m in gemv.MODES]
GXX = shutil.which("g++")
N_SHAPES = 6


def random_shape(rng: np.random.Generator) -> ConvShape:
    """A linear layer: C a multiple of 8 (not of the slice step), M anything, B 1..16."""
    return ConvShape(int(rng.integers(1, gemv.MAX_BATCH + 1)), 8 * int(rng.integers(1, 600)),
                     1, 1, int(rng.integers(1, 700)), 1)


def random_point(rng: np.random.Generator) -> dict[str, int]:
    return {k: v[int(rng.integers(len(v)))] for k, v in gemv.SPACE.items()}


# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", list(gemv.MODES))
def test_every_define_set_a_prepare_builds_is_covered_by_the_compiled_ones(
        mode: str, rng: np.random.Generator) -> None:
    """CI compiles every GV_NB x GV_ROWS a prepare can build with each UNROLL and each LANES
    value (gemv.COMPILED_UNROLL_LANES), and the defaults exactly."""
    impl = get_impl(f"gemv-{mode}")
    assert impl.tolerance == TOLERANCE[mode] and impl.kernel_file == gemv.KERNEL_FILE
    compiled = impl.compile_variants()
    assert len({tuple(sorted(d.items())) for d in compiled}) == len(compiled)
    for B in range(1, gemv.MAX_BATCH + 1):
        assert gemv.gemv_defines(mode, B, impl.defaults) in compiled
        for params in [impl.params_for(random_point(rng)) for _ in range(8)]:
            want = gemv.gemv_defines(mode, B, params)
            for key in ("GV_UNROLL", "GV_LANES"):
                assert any(d[key] == want[key] and all(d[k] == want[k] for k in want
                                                       if k not in ("GV_UNROLL", "GV_LANES"))
                           for d in compiled), (B, params, key)


def test_batch_columns_and_refusals() -> None:
    assert [gemv.batch_columns(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16,
                                                                          16]
    with pytest.raises(ValueError, match="batch 17"):
        gemv.batch_columns(17)
    with pytest.raises(ValueError, match="unknown mode"):
        gemv.gemv_defines("3xtf32", 1, gemv.DEFAULTS)
    with pytest.raises(ValueError, match="LANES"):
        gemv.gemv_defines("fp32", 1, {**gemv.DEFAULTS, "LANES": 16})


def test_supports_only_linear_layers() -> None:
    assert gemv.supports(FC6) and gemv.supports(FC7.with_batch(16))
    assert not gemv.supports(FC7.with_batch(17))
    assert not gemv.supports(ConvShape(1, 4100, 1, 1, 64, 1))  # C not a multiple of 8
    assert not gemv.supports(ConvShape(1, 512, 16, 16, 512, 3))  # a convolution
    assert not gemv.supports(ConvShape(1, 64, 2, 2, 64, 1))  # 1x1 kernel over 2x2 images


@pytest.mark.parametrize("mode", list(gemv.MODES))
def test_launch_plan_covers_k_and_rows(mode: str, rng: np.random.Generator) -> None:
    shapes = [random_shape(rng) for _ in range(200)]
    shapes += [s.with_batch(b) for s in (FC6, FC7) for b in range(1, gemv.MAX_BATCH + 1)]
    for shape in shapes:
        for params in (gemv.DEFAULTS, {**gemv.DEFAULTS, **random_point(rng)}):
            try:
                p = gemv.launch_plan(shape, mode, params, int(rng.integers(1, 200)),
                                     int(rng.integers(1, 9)))
            except ValueError as err:  # only a forced split can overflow shared memory
                assert params["SPLIT"] and "shared memory" in str(err)
                continue
            d = p.defines
            step = d["GV_LANES"] * d["GV_UNROLL"] * gemv.piece_weights(mode)
            assert p.k_slice % step == 0 and p.k_slice % 4 == 0
            assert (p.slices - 1) * p.k_slice < shape.C <= p.slices * p.k_slice
            assert p.slices <= gemv.MAX_SLICES
            assert p.tile_rows == gemv.WARPS * d["GV_ROWS"] * 32 // d["GV_LANES"] * p.groups
            assert (p.tiles - 1) * p.tile_rows < shape.M <= p.tiles * p.tile_rows
            assert p.smem == d["GV_NB"] * p.k_slice * 4 <= gemv.SMEM_LIMIT
            assert d["GV_NB"] >= shape.B and d["GV_ROWS"] * d["GV_NB"] <= 64


@pytest.mark.parametrize("resident", [2, 3, 4])
def test_fc6_grid_is_whole_waves(resident: int) -> None:
    """fc6 at every batch and mode: x slices within X_SLICE_BYTES, at least MIN_WAVES waves of
    `resident` blocks an SM, the last one at least 95% full."""
    for B in range(1, gemv.MAX_BATCH + 1):
        for mode in gemv.MODES:
            p = gemv.launch_plan(FC6.with_batch(B), mode, gemv.DEFAULTS, 132, resident)
            capacity = 132 * resident
            blocks = p.tiles * p.slices
            waves = ceil_div(blocks, capacity)
            assert p.smem <= gemv.X_SLICE_BYTES
            assert waves >= gemv.MIN_WAVES and blocks >= 0.95 * waves * capacity, (B, mode, p)


def test_auto_takes_kernel_41_for_linear_layers_at_small_batch() -> None:
    """fc6/fc7 up to GEMV_MAX_BATCH: gemv-fp32 in fp32 and gemv-tf32 in tf32 up to 16,
    gemv-fp16 in fp16 up to 8, except where kernel 54, 48, 49 or 42 takes the layer
    (test_tune.py checks where: fc6 in fp32 is kernel 43's); above, and on convolutions, the
    implicit GEMMs; the tuner starts kernel 41 at its defaults."""
    from convolab.bench.cases import VGG_SWEEP_BATCHES
    from convolab.gpu import auto, gemv_cluster, gemv_mma, gemv_wgmma, gemv_wgmma_cluster, tune
    from convolab.registry import all_impls

    names = {i.name for i in all_impls("gpu")}
    for shape in (FC6, FC7):
        for batch in VGG_SWEEP_BATCHES:
            s = shape.with_batch(batch)
            for mode in auto.GEMM_FAMILY:
                choice = auto.default_choice(s, names, mode)
                taken = (gemv_wgmma_cluster.auto_choice(s, mode)
                         or gemv_cluster.auto_choice(s, mode) or gemv_wgmma.auto_choice(s, mode)
                         or gemv_mma.auto_choice(s, mode))
                if taken is not None:
                    assert choice.impl == taken[0]
                elif batch <= auto.GEMV_MAX_BATCH[mode]:
                    assert choice.impl == f"gemv-{auto.GEMV_FAMILY[mode]}"
                    assert get_impl(choice.impl).tolerance <= TOLERANCE[mode]
                else:
                    assert choice.impl.startswith("igemm-splitk-")
    assert auto.default_choice(FC7, names - {"gemv-fp32"}, "fp32").impl == "igemm-splitk-3xtf32"
    assert auto.default_choice(FC6, names, "tf32").impl == "gemv-tf32"
    assert auto.default_choice(FC6, names - {"gemv-bulk-3xtf32"}, "fp32").impl == "gemv-fp32"
    conv5 = ConvShape(1, 512, 16, 16, 512, 3)
    assert not auto.default_choice(conv5, names, "fp16").impl.startswith("gemv")
    impl = get_impl("gemv-fp16")
    assert tune.start_params(impl, FC6) == impl.params_for(None)
    assert impl in tune.tunable_impls()


def unpack_tf32(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The kernel's widen for GV_MODE 3 in NumPy: (hi << 16) | (nibble << 13), as uint32."""
    k = np.arange(hi.shape[1])
    nibble = (lo[:, k // 8] >> (4 * (k % 8)).astype(np.uint32)) & np.uint32(7)
    return (hi.astype(np.uint32) << np.uint32(16)) | (nibble << np.uint32(13))


TF32_ROWS = {"ties": 4, "under": 5, "carry": 6, "overflow": 7, "to_normal": 8, "inf": 11,
             "nan": 12}


def tf32_edge_weights(rng: np.random.Generator) -> np.ndarray:
    """(64, 96) fp32: random normals of both signs and, in the rows TF32_ROWS names (and rows 1-3:
    subnormals, the smallest subnormals, all 13 dropped bits set), the values TF32 rounding is
    delicate on."""
    w = rng.standard_normal((64, 96)).astype(np.float32)
    w[1] *= np.float32(1e-39)
    w[2] = rng.uniform(-1e-45, 1e-45, 96).astype(np.float32)
    sign = rng.integers(0, 2, (8, 96), dtype=np.uint32) << np.uint32(31)
    exponent = rng.integers(1, 0xFE, (8, 96), dtype=np.uint32) << np.uint32(23)
    bits = sign | exponent | rng.integers(0, 1 << 23, (8, 96), dtype=np.uint32)
    high = bits & np.uint32(0xFFFFE000)
    bits[0] |= np.uint32(0x1FFF)
    bits[1] = high[1] | np.uint32(0x1000)  # exact ties: away from zero
    bits[2] = high[2] | np.uint32(0x0FFF)  # just under a tie: truncated
    bits[3] = sign[3] | exponent[3] | np.uint32(0x007FF000)  # carries into the next binade
    bits[4] = sign[4] | np.uint32(0x7F7FF000)  # the largest finite values: round to inf
    bits[5] = sign[5] | np.uint32(0x007FF000)  # a subnormal that rounds to the smallest normal
    w[3:11] = bits.view(np.float32)
    w[TF32_ROWS["inf"], :48:2], w[TF32_ROWS["inf"], 1:48:2] = np.inf, -np.inf
    nans = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF, 0x7FFFF000, 0x7F801FFF],
                    dtype=np.uint32)
    w[TF32_ROWS["nan"], : nans.size] = nans.view(np.float32)
    return w


def test_tf32_planes_unpack_to_the_tf32_rounding(rng: np.random.Generator) -> None:
    """Unpacked as the kernel's widen does, the two planes are tf32_round(w) bit for bit (the
    rounding of cvt.rna.tf32.f32: nearest, ties away), NaN stays NaN; the 16-bit plane is the
    value's upper half (bf16's bits), each nibble's fourth bit is clear, and the one buffer the
    kernel reads is the 16-bit plane then the nibble plane, 2.5 bytes a weight."""
    w = tf32_edge_weights(rng)
    hi, lo = gemv.tf32_planes(w)
    assert hi.dtype == np.uint16 and hi.shape == w.shape
    assert lo.dtype == np.uint32 and lo.shape == (w.shape[0], w.shape[1] // 8)
    assert not (lo & np.uint32(0x88888888)).any()
    got = unpack_tf32(hi, lo)
    want = tf32_round(w).view(np.uint32)
    nan = np.isnan(w)
    assert nan.sum() == 6 and np.isnan(got.view(np.float32)[nan]).all()
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(hi[~nan], (want[~nan] >> np.uint32(16)).astype(np.uint16))
    assert (got & np.uint32(0x1FFF) == 0).all()
    assert (np.signbit(got.view(np.float32)) == np.signbit(w)).all()
    # The rule itself, independently of tf32_round, on the rows built for it.
    with np.errstate(invalid="ignore"):  # the signalling NaNs quieten in the cast
        v, a = got.view(np.float32).astype(np.float64), np.abs(w.astype(np.float64))
    r = TF32_ROWS
    assert (np.abs(v[r["ties"]]) > a[r["ties"]]).all()
    assert (np.abs(v[r["under"]]) < a[r["under"]]).all()
    w_bits = w.view(np.uint32)
    assert (got[r["carry"]] >> np.uint32(23) == (w_bits[r["carry"]] >> np.uint32(23)) + 1).all()
    assert np.isinf(v[r["overflow"]]).all() and np.isinf(v[r["inf"], :48]).all()
    assert (got[r["to_normal"]] & np.uint32(0x7FFFFFFF) == 0x00800000).all()
    buf = gemv.pack_tf32(w)
    assert buf.dtype == np.uint8 and buf.size == w.size * gemv.elem_bytes("tf32")
    assert np.array_equal(buf[: 2 * w.size].view(np.uint16).reshape(w.shape), hi)
    assert np.array_equal(buf[2 * w.size:].view(np.uint32).reshape(lo.shape), lo)


def test_tf32_planes_refuse_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv.tf32_planes(np.zeros((4, 12), np.float32))
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv.tf32_planes(np.zeros(16, np.float32))


def test_bytes_a_weight() -> None:
    assert [gemv.elem_bytes(m) for m in ("fp32", "fp16", "bf16", "tf32")] == [4, 2, 2, 2.5]
    assert [gemv.piece_weights(m) for m in ("fp32", "fp16", "bf16", "tf32")] == [4, 8, 8, 8]


def x_word(b: int, c: int, h: int, quads: int, vec: int) -> int:
    """kernels/41's shared-memory slot (in 16-byte words) of quad h of piece c of column b."""
    halves = vec // 4
    return b * quads + h * (quads // halves) + c


@pytest.mark.parametrize("mode", list(gemv.MODES))
@pytest.mark.parametrize("lanes", [8, 32])
def test_x_reads_are_free_of_bank_conflicts(mode: str, lanes: int) -> None:
    """Every 128-bit read of x takes one wavefront per quarter warp (8 lanes, 128 bytes; lanes
    reading the same word share it): the quads of a piece sit in separate planes."""
    vec = gemv.piece_weights(mode)
    for k_slice in (lanes * vec * 2, lanes * vec * 8):
        quads = k_slice // 4
        for b, h, c0 in ((0, 0, 0), (3, vec // 4 - 1, lanes)):
            for quarter in range(4):
                words = {x_word(b, c0 + lane % lanes, h, quads, vec)
                         for lane in range(8 * quarter, 8 * quarter + 8)}
                banks = [4 * w % 32 for w in words]  # a 16-byte word covers 4 banks from here
                assert len(banks) == len(set(banks)), (mode, lanes, k_slice, quarter)
    slots = sorted(x_word(0, c, h, 64, vec) for c in range(64 // (vec // 4))
                   for h in range(vec // 4))
    assert slots == list(range(64))  # the planes tile the column exactly


def replay_reduce_scatter(values: np.ndarray, lanes: int) -> list[tuple[int, int, float]]:
    """kernels/41's reduce_scatter, scattered_index and write rule for one row slot:
    values[lane, i] -> (lane, index, sum) for every lane that writes."""
    v = values.astype(np.float64).copy()
    n, w = v.shape[1], lanes // 2
    while w >= 1:
        lane = np.arange(lanes)
        partner = lane ^ w
        if n == 1:
            v[:, 0] = v[:, 0] + v[partner, 0]
        else:
            upper = (lane & w) != 0
            lo, hi = v[:, : n // 2].copy(), v[:, n // 2: n].copy()
            send = np.where(upper[:, None], lo, hi)
            keep = np.where(upper[:, None], hi, lo)
            v[:, : n // 2] = keep + send[partner]
            n //= 2
        w //= 2
    total = values.shape[1]
    kept = total // lanes if total >= lanes else 1
    copies = 1 if total >= lanes else lanes // total
    out = []
    for lane in range(lanes):
        if lane % copies:
            continue
        first, m = 0, total
        w = lanes // 2
        while w >= 1:
            if m > 1:
                first += m // 2 if lane & w else 0
                m //= 2
            w //= 2
        out += [(lane, first + j, v[lane, j]) for j in range(kept)]
    return out


@pytest.mark.parametrize("lanes", [8, 32])
@pytest.mark.parametrize("count", [1, 2, 4, 8, 16, 32, 64])
def test_reduce_scatter_writes_every_sum_once(lanes: int, count: int,
                                              rng: np.random.Generator) -> None:
    values = rng.standard_normal((lanes, count))
    written = replay_reduce_scatter(values, lanes)
    indices = sorted(i for _, i, _ in written)
    assert indices == list(range(count))
    for _, i, s in written:
        assert s == pytest.approx(values[:, i].sum(), rel=1e-12, abs=1e-12)


EMU = CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + GEMV_SHIM + r"""
struct float2 { float x, y; };
inline float2 __half22float2(__half2 h) { return {(float)h.x, (float)h.y}; }
alignas(16) float4 xs4[232448 / 16];
#include "kernel.inc"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), M = atoi(argv[3]), K = atoi(argv[4]), k_slice = atoi(argv[5]);
  const int groups = atoi(argv[6]), tiles = atoi(argv[7]), slices = atoi(argv[8]);
  const int launches = atoi(argv[9]);
  const GemvIo io = read_gemv_io(dir, B, M, K, tiles, slices, atol(argv[10]));
  run_launches(dir, io, tiles, slices, launches, atoi(argv[11]), [&](int bx, int by) {
    for (auto& v : xs4) v = make_float4(NAN, NAN, NAN, NAN);  // unstaged reads show
    run_block(bx, 32 * GV_WARPS, [=] {
      blockIdx.y = by;
      gemv_stream(io.x, io.w, io.bias, io.y, io.partial, io.tickets, B, M, K, k_slice, groups);
    });
  });
}
"""

EMULATED = [  # (mode, shape, params): slices and row groups, B off the powers of two
    ("fp32", ConvShape(3, 456, 1, 1, 77, 1), {"SPLIT": 4, "GROUPS": 2}),
    ("fp32", ConvShape(1, 200, 1, 1, 40, 1), {"LANES": 32, "SPLIT": 0, "GROUPS": 1}),
    ("fp32", ConvShape(16, 136, 1, 1, 33, 1), {"ROWS": 4, "UNROLL": 4, "SPLIT": 2, "GROUPS": 1}),
    ("fp16", ConvShape(5, 1048, 1, 1, 70, 1), {"SPLIT": 4, "GROUPS": 1}),
    ("bf16", ConvShape(2, 520, 1, 1, 130, 1), {"SPLIT": 0, "GROUPS": 2}),
    ("tf32", ConvShape(3, 1048, 1, 1, 77, 1), {"SPLIT": 4, "GROUPS": 2}),
    ("tf32", ConvShape(16, 264, 1, 1, 37, 1), {"ROWS": 2, "LANES": 32, "SPLIT": 0,
                                               "GROUPS": 1}),
]


def host_weights(w: np.ndarray, mode: str) -> np.ndarray:
    """gemv.operand_weights in NumPy: (M, C) in the operand type (bf16 rounded to nearest
    even, as implicit_gemm.to_bf16_bits; tf32 the two planes in one buffer)."""
    w2 = np.ascontiguousarray(w.reshape(w.shape[0], -1), np.float32)
    if mode == "tf32":
        return gemv.pack_tf32(w2)
    if mode == "fp16":
        return w2.astype(np.float16)
    if mode == "bf16":
        u = w2.view(np.uint32).astype(np.uint64)
        return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
    return w2


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("mode,shape,params", EMULATED)
def test_kernel_emulated_on_cpu(mode: str, shape: ConvShape, params: dict[str, int],
                                tmp_path: Path, rng: np.random.Generator) -> None:
    plan = gemv.launch_plan(shape, mode, {**gemv.DEFAULTS, **params}, sms=4, resident=2)
    assert plan.slices > 1 or params.get("SPLIT") == 0
    source = (KERNEL_DIR / gemv.KERNEL_FILE).read_text()
    assert "asm" not in source, "inline PTX the emulator does not know"
    (tmp_path / "kernel.inc").write_text(source.replace('#include "common.cuh"', ""))
    (tmp_path / "emu.cpp").write_text(EMU)
    exe = tmp_path / "emu"
    build = subprocess.run([str(GXX), "-std=c++20", "-O1", "-fno-strict-aliasing", "-pthread",
                            "-w", *define_flags(plan.defines), "-o", str(exe),
                            str(tmp_path / "emu.cpp")], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    case = make_case(rng, shape)
    packed = np.ascontiguousarray(host_weights(case.w, mode))
    got = run_gemv_emulator(exe, tmp_path, case, packed, (plan.k_slice, plan.groups), plan.tiles,
                            plan.slices, int(rng.integers(2**31)))
    assert rel_l2(got, case.ref) <= TOLERANCE[mode]
    if mode == "fp32":  # every product and sum in fp32: within a few ulps of each output
        np.testing.assert_allclose(got, case.ref, rtol=0, atol=1e-4 * np.abs(case.ref).max())
    if mode == "tf32":  # the TF32 weights exactly: fp32 accuracy against them in fp64
        ref = conv_reference(case.x, tf32_round(case.w), case.b)
        assert rel_l2(got, ref) <= TOLERANCE["fp32"], rel_l2(got, ref)
        assert rel_l2(got, ref) < rel_l2(got, case.ref) / 10


# ------------------------------------------------------------------------------- GPU


def run_twice(name: str, case: Case, params: dict | None = None) -> tuple[float, bool]:
    """rel L2 of the first run and whether a second run gave the same bits."""
    import cupy as cp

    outs = outputs_of_two_runs(name, case, params)
    return rel_l2(outs[0], case.ref), bool(cp.array_equal(outs[0], outs[1]))


@pytest.fixture(scope="module")
def cases(module_seed: int) -> list[Case]:
    rng = np.random.default_rng(module_seed)
    return [make_case(rng, random_shape(rng)) for _ in range(N_SHAPES)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_mode_on_random_shapes(name: str, cases: list[Case],
                                     rng: np.random.Generator) -> None:
    impl = get_impl(name)
    failures = []
    for case in cases:
        for params in (None, random_point(rng)):
            try:
                err, same = run_twice(name, case, params)
            except ValueError as e:  # a forced split whose x slice is over shared memory
                assert params and "shared memory" in str(e)
                continue
            if not (err <= impl.tolerance and same):
                failures.append(f"{case.shape} {params}: rel_l2 {err:.3g}, repeat same {same}")
    assert not failures, f"{name} (tol {impl.tolerance}):\n" + "\n".join(failures[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_vgg_classifier_layers(name: str, rng: np.random.Generator) -> None:
    """fc6's 25088-term and fc7's 4096-term sums at batch 1, 3 and 16, weights scaled by
    1/sqrt(C) as a trained layer's are: fp32 accuracy for gemv-fp32."""
    impl = get_impl(name)
    for shape in (FC6, FC7):
        for B in (1, 3, 16):
            s = shape.with_batch(B)
            x = rng.standard_normal(s.x_shape, dtype=np.float32)
            w = rng.standard_normal(s.w_shape, dtype=np.float32) / np.float32(np.sqrt(s.C))
            b = rng.standard_normal(s.M, dtype=np.float32)
            err, same = run_twice(name, Case(s, x, w, b, conv_reference(x, w, b)))
            assert err <= impl.tolerance and same, f"{name} {s}: {err:.3g}, same {same}"


# fc-like layers for gemv-tf32: fc6, fc7, and C off every slice length (a multiple of 8, not of
# the 128-weight sweep), M off the row tiles.
TF32_LAYERS = (FC6, FC7, ConvShape(1, 4104, 1, 1, 1000, 1), ConvShape(1, 9224, 1, 1, 517, 1))
TF32_BATCHES = (1, 2, 3, 4, 8, 12, 16)


@pytest.mark.gpu
def test_tf32_weights_at_every_batch(rng: np.random.Generator) -> None:
    """gemv-tf32 on fc-like layers at B = 1-16 (fresh inputs, weights scaled by 1/sqrt(C) as a
    trained layer's): within TF32's tolerance of the fp64 answer, at fp32 accuracy against the
    fp64 answer with the weights rounded to TF32 (the kernel multiplies exactly those values),
    bit-identical on a repeat; and its operand buffer is pack_tf32's, built on the GPU."""
    import cupy as cp

    assert all(s.C % gemv.launch_plan(s, "tf32", gemv.DEFAULTS).k_slice  # a part slice
               for s in TF32_LAYERS[2:])
    failures = []
    for shape in TF32_LAYERS:
        w = rng.standard_normal(shape.w_shape, dtype=np.float32) / np.float32(np.sqrt(shape.C))
        b = rng.standard_normal(shape.M, dtype=np.float32)
        w_tf32 = tf32_round(w)
        if shape is TF32_LAYERS[-1]:
            w2 = w.reshape(shape.M, -1)
            assert np.array_equal(gemv.operand_weights(cp.asarray(w), "tf32").get(),
                                  gemv.pack_tf32(w2))
        for B in TF32_BATCHES:
            s = shape.with_batch(B)
            x = rng.standard_normal(s.x_shape, dtype=np.float32)
            ref = conv_reference(x, w, b)
            outs = outputs_of_two_runs("gemv-tf32", Case(s, x, w, b, ref))
            err = rel_l2(outs[0], ref)
            err_tf32 = rel_l2(outs[0], conv_reference(x, w_tf32, b))
            same = bool(cp.array_equal(outs[0], outs[1]))
            if not (err <= TOLERANCE["tf32"] and err_tf32 <= TOLERANCE["fp32"] and same):
                failures.append(f"{s}: rel_l2 {err:.3g} (fp64), {err_tf32:.3g} (fp64 of the "
                                f"TF32 weights), repeat same {same}")
    assert not failures, "gemv-tf32:\n" + "\n".join(failures)


def test_tile_count_matches_ceil_div() -> None:
    p = gemv.launch_plan(FC7, "fp32", gemv.DEFAULTS)
    assert p.grid == (ceil_div(FC7.M, p.tile_rows), p.slices)
