"""Kernel 42 (`gemv-mma-fp16`, `-bf16`, `-tf32`, `-3xtf32`): classifier layers at batch 1-64 on
tensor cores, the weights packed in fragment order and streamed as the MMA's A.

CPU tests: the packed weights read back through the PTX fragment layouts (written out here
independently of the packer's axis orders) give W exactly, zero past M and C; TF32's two planes
are the TF32 rounding of every weight; bf16 bits round to nearest even; the launch plan's slices
cover k exactly in whole chunks; the compiled define sets cover every value; and the kernel
source run on the CPU by the emulator (one std::thread a CUDA thread, mma.sync from its fragment
layouts) on small layers in every mode, with several slices, launched twice with the blocks in a
random order each time. GPU tests: every mode against the fp64 reference on fresh random shapes
(B 1-64, C and M off the tile multiples), outputs poisoned with NaN, at the defaults and at
random points of the space, each run twice (bit-identical); VGG's fc6 / fc7 at B = 1, 13, 64;
TF32 at fp32 accuracy against its rounded operands; 3xTF32 at fp32 accuracy.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conv_cases import check_classifier_layers, check_two_runs, make_case, outputs_of_two_runs
from cuda_emulator import BLOCK_SHIM, CUDA_SHIM, GEMV_SHIM, MMA_SHIM, run_gemv_emulator

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import gemv_mma
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.gpu.implicit_gemm_wgmma import tf32_round
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = list(gemv_mma.MODES)
NAMES = [f"gemv-{kind}-{m}" for kind in ("mma", "bulk") for m in MODES]
GXX = shutil.which("g++")


def random_shape(rng: np.random.Generator) -> ConvShape:
    """A linear layer: C a multiple of 8 (not of a piece), M anything, B 1..64."""
    return ConvShape(int(rng.integers(1, gemv_mma.MAX_BATCH + 1)), 8 * int(rng.integers(1, 500)),
                     1, 1, int(rng.integers(1, 700)), 1)


def random_point(rng: np.random.Generator, space: dict | None = None) -> dict[str, int]:
    space = gemv_mma.SPACE if space is None else space
    return {k: v[int(rng.integers(len(v)))] for k, v in space.items()}


# ------------------------------------------------------------------------------- CPU


def unpack(values: np.ndarray, mode: str) -> np.ndarray:
    """(m-tiles, pieces, 32, n) lane values -> the (16 m-tiles, k) matrix they are A fragments
    of, from the PTX layouts: lane 4g + t; m16n8k16 register r = row g + 8 (r % 2), columns
    2t + 8 (r // 2) and + 1; m16n8k8 a0..a3 = (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)."""
    tiles, pieces = values.shape[:2]
    pk = gemv_mma.piece_k(mode)
    out = np.full((16 * tiles, pk * pieces), np.nan, np.float64)
    for tile, piece, lane in np.ndindex(tiles, pieces, 32):
        g, t, v = lane // 4, lane % 4, values[tile, piece, lane]
        r0, k0 = 16 * tile, pk * piece
        if mode in ("fp16", "bf16"):
            for r in range(4):
                for e in range(2):
                    out[r0 + g + 8 * (r % 2), k0 + 2 * t + 8 * (r // 2) + e] = v[2 * r + e]
        else:
            for s in range(2 if mode == "tf32" else 1):
                for i, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 4), (8, 4))):
                    out[r0 + g + dr, k0 + 8 * s + t + dk] = v[4 * s + i]
    return out


@pytest.mark.parametrize("mode", MODES)
def test_fragment_values_are_w_in_the_ptx_layout(mode: str, rng: np.random.Generator) -> None:
    M, C = int(rng.integers(1, 60)), 8 * int(rng.integers(1, 12))
    w = rng.standard_normal((M, C)).astype(np.float32)
    values = gemv_mma.fragment_values(w, mode)
    assert values.shape == (ceil_div(M, 16), ceil_div(C, gemv_mma.piece_k(mode)), 32,
                            {"3xtf32": 4}.get(mode, 8))
    full = unpack(values, mode)
    assert not np.isnan(full).any(), "a position no lane holds"
    np.testing.assert_array_equal(full[:M, :C], w)
    assert not full[M:].any() and not full[:, C:].any(), "padding is not zero"


@pytest.mark.parametrize("mode", MODES)
def test_packed_weights_are_the_operand_values(mode: str, rng: np.random.Generator) -> None:
    M, C = int(rng.integers(1, 40)), 8 * int(rng.integers(1, 10))
    w = rng.standard_normal((M, C)).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -10, 10, (M, C)).astype(np.float32)
    packed = gemv_mma.pack_weights(w, mode)
    shape = gemv_mma.fragment_values(w, mode).shape
    if mode == "tf32":
        n = int(np.prod(shape))
        assert packed.dtype == np.uint8 and packed.size == 2 * n + n // 2
        hi = packed[: 2 * n].view(np.uint16).astype(np.uint32).reshape(-1, 8)
        lo = packed[2 * n:].view(np.uint32)
        nib = (lo[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & np.uint32(7)
        got = ((hi << 16) | (nib << 13)).view(np.float32).reshape(shape)
        want = tf32_round(w)
    elif mode == "bf16":
        got = (packed.astype(np.uint32) << 16).view(np.float32)
        u = w.astype(np.float64)
        want = w  # checked below: nearest of the two bf16 neighbours
        lower = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        upper = ((w.view(np.uint32) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
        full = unpack(got, mode)[:M, :C]
        assert ((full == lower) | (full == upper)).all()
        err = np.abs(full - u)
        assert (err <= np.minimum(np.abs(lower - u), np.abs(upper - u))).all()
        return
    else:
        got = packed.astype(np.float32)
        want = w.astype(np.float16).astype(np.float32) if mode == "fp16" else w
    np.testing.assert_array_equal(unpack(np.asarray(got, np.float32), mode)[:M, :C], want)


@pytest.mark.parametrize("mode", MODES)
def test_launch_plan_covers_k_in_whole_chunks(mode: str, rng: np.random.Generator) -> None:
    for _ in range(40):
        shape = random_shape(rng)
        params = random_point(rng)
        plan = gemv_mma.launch_plan(shape, mode, params, sms=int(rng.integers(1, 140)))
        pieces = ceil_div(shape.C, gemv_mma.piece_k(mode))
        assert plan.pieces == pieces and plan.m_tiles == ceil_div(shape.M, 16)
        assert plan.slice_pieces % plan.defines["TM_CP"] == 0
        assert (plan.slices - 1) * plan.slice_pieces < pieces <= plan.slices * plan.slice_pieces
        rows = 16 * plan.defines["TM_MT"] * plan.defines["TM_WARPS"]
        assert (plan.tiles - 1) * rows < shape.M <= plan.tiles * rows
        assert 8 * plan.defines["TM_NT"] >= shape.B
        if params["SPLIT"]:
            assert plan.slices <= params["SPLIT"]
        assert plan.smem == gemv_mma.staged_x_bytes(mode, plan.defines) <= gemv_mma.SMEM_LIMIT


def test_plan_fills_one_wave_of_the_blocks_an_sm_holds() -> None:
    """fc6 FP16 at B = 8: with MINB blocks an SM the planner takes one wave of sms x MINB slots
    (a second wave pays another ramp: 33 slices in two waves ran 18 % slower than 16 in one);
    kernel 43 holds fewer blocks than MINB where its rings outgrow the SM's shared memory."""
    fc6 = ConvShape(8, 25088, 1, 1, 4096, 1)
    for minb in (1, 2, 4):
        for sms in (114, 132):
            params = {**gemv_mma.DEFAULTS, "MINB": minb, "MT": 1 if minb == 4 else 2}
            plan = gemv_mma.launch_plan(fc6, "fp16", params, sms=sms)
            blocks = plan.tiles * plan.slices
            assert sms * minb // 2 < blocks <= sms * minb, (minb, sms, plan.grid)
    ring = {**gemv_mma.BULK_DEFAULTS, "MINB": 2}
    for stages, fits in ((2, 2), (4, 1)):
        d = gemv_mma.bulk_defines("fp16", 8, {**ring, "STAGES": stages})
        assert gemv_mma.bulk_resident(d, gemv_mma.bulk_smem("fp16", d)) == fits


@pytest.mark.parametrize("mode", MODES)
def test_compiled_define_sets_cover_every_value(mode: str) -> None:
    """Each mode at the fewest and most batch tiles; the varied modes at every tile value."""
    compiled = gemv_mma.compile_variants(mode)()
    assert {d["TM_NT"] for d in compiled} == {1, gemv_mma.N_TILES[-1]}
    assert all(d["TM_MODE"] == gemv_mma.MODES[mode] for d in compiled)
    if mode in gemv_mma.VARIED_MODES:
        for key, values in (("TM_MT", gemv_mma.SPACE["MT"]), ("TM_CP", gemv_mma.SPACE["CP"]),
                            ("TM_WARPS", gemv_mma.SPACE["WARPS"])):
            assert {d[key] for d in compiled} == set(values), key
    assert len(compiled) <= 7, "CI's nvcc check compiles each of these"


@pytest.mark.parametrize("mode", MODES)
def test_bulk_define_sets_and_shared_memory(mode: str) -> None:
    """Kernel 43: each mode compiled at the fewest and most batch tiles, fp16 at every ring
    depth; every ring depth fits shared memory at the default tiles and 64 columns."""
    compiled = gemv_mma.bulk_compile_variants(mode)()
    assert {d["TM_NT"] for d in compiled} == {1, gemv_mma.N_TILES[-1]}
    if mode == "fp16":
        assert {d["TB_STAGES"] for d in compiled} == set(gemv_mma.BULK_SPACE["STAGES"])
    for stages in gemv_mma.BULK_SPACE["STAGES"]:
        d = gemv_mma.bulk_defines(mode, gemv_mma.MAX_BATCH,
                                  {**gemv_mma.BULK_DEFAULTS, "STAGES": stages})
        assert gemv_mma.bulk_smem(mode, d) <= gemv_mma.SMEM_LIMIT
    with pytest.raises(ValueError, match="STAGES"):
        gemv_mma.bulk_defines(mode, 8, {**gemv_mma.BULK_DEFAULTS, "STAGES": 5})


def test_chunks_are_the_fragment_pieces_block_by_block(rng: np.random.Generator) -> None:
    """pack_chunks (fp16): chunk c of row group g holds, in (warp, m-tile, piece, lane) order,
    the fragment piece of m-tile (g, warp, m-tile) and piece c x CP + piece; zeros past the
    layer."""
    M, C = int(rng.integers(1, 90)), 8 * int(rng.integers(1, 30))
    w = rng.standard_normal((M, C)).astype(np.float32)
    d = {"TM_WARPS": 2, "TM_MT": 2, "TM_CP": 2}
    values = gemv_mma.operand_values(w, "fp16")
    packed = gemv_mma.pack_chunks(w, "fp16", d).view(np.float16)
    tiles, pieces = values.shape[:2]
    groups, chunks = ceil_div(tiles, 4), ceil_div(pieces, 2)
    got = packed.reshape(groups, chunks, 2, 2, 2, 32, 8)
    for g, c, wp, i, q in np.ndindex(groups, chunks, 2, 2, 2):
        tile, piece = (g * 2 + wp) * 2 + i, c * 2 + q
        want = (values[tile, piece] if tile < tiles and piece < pieces
                else np.zeros((32, 8), np.float16))
        np.testing.assert_array_equal(got[g, c, wp, i, q], want)


def test_bad_parameters_name_the_problem() -> None:
    for key, bad in (("MT", 3), ("MINB", 5)):
        with pytest.raises(ValueError, match="MT, CP, WARPS and MINB"):
            gemv_mma.mma_defines("fp16", 8, {**gemv_mma.DEFAULTS, key: bad})
    with pytest.raises(ValueError, match="unknown mode"):
        gemv_mma.mma_defines("fp8", 8, gemv_mma.DEFAULTS)
    with pytest.raises(ValueError, match="batch 65"):
        gemv_mma.n_tiles(65)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv_mma.pack_weights(np.zeros((4, 12), np.float32), "fp16")
    assert not gemv_mma.supports(ConvShape(65, 64, 1, 1, 8, 1))
    assert not gemv_mma.supports(ConvShape(4, 12, 1, 1, 8, 1))
    assert not gemv_mma.supports(ConvShape(4, 64, 3, 3, 8, 1))


EMU = CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + GEMV_SHIM + r"""
alignas(16) unsigned xs[232448 / 4];
alignas(128) unsigned char smem[232448];
#include "kernel.inc"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), M = atoi(argv[3]), K = atoi(argv[4]);
  const int a5 = atoi(argv[5]), a6 = atoi(argv[6]), a7 = atoi(argv[7]), tiles = atoi(argv[8]);
  const int slices = atoi(argv[9]), launches = atoi(argv[10]);
  const GemvIo io = read_gemv_io(dir, B, M, K, tiles, slices, atol(argv[11]));
  run_launches(dir, io, tiles, slices, launches, atoi(argv[12]), [&](int bx, int by) {
    std::memset(xs, 0xFF, sizeof xs);  // NaN: unstaged reads show
    std::memset(smem, 0xFF, sizeof smem);
    run_block(bx, 32 * TM_WARPS, [=] {
      blockIdx.y = by;
#ifdef TB_STAGES
      gemv_bulk(io.x, io.w, io.bias, io.y, io.partial, io.tickets, B, M, K, a5, a6);
#else
      gemv_mma(io.x, io.w, io.bias, io.y, io.partial, io.tickets, B, M, K, a5, a6, a7);
#endif
    });
  });
}
"""

# mbarrier.cuh on the CPU: a bulk copy is a memcpy done by the time its thread passes the next
# block barrier, which every read of the stage follows, so the waits have nothing to wait for.
BULK_SHIM = r"""
inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<const unsigned char*>(p) - smem;
}
inline void mbar_init(unsigned, unsigned) {}
inline void fence_barrier_init() {}
inline void mbar_expect_tx(unsigned, unsigned) {}
inline void mbar_wait(unsigned, unsigned) {}
inline void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned) {
  std::memcpy(smem + dst, src, bytes);
}
"""


def emulated_source(filename: str) -> str:
    """A kernel file with gemv_mma.cuh inlined and common.cuh's PTX, cuda_bf16.h and
    mbarrier.cuh left to the shims."""
    header = (KERNEL_DIR / "gemv_mma.cuh").read_text().replace("#pragma once", "")
    source = (KERNEL_DIR / filename).read_text().replace('#include "gemv_mma.cuh"', header)
    source = source.replace('#include "mbarrier.cuh"', BULK_SHIM)
    source = source.replace('#include "common.cuh"', "").replace("#include <cuda_bf16.h>", "")
    assert "asm" not in source, "inline PTX the emulator does not know"
    return source


EMULATED = [  # (kernel, mode, shape, params): several slices, B and M off the tiles, a partial
    # row tile; kernel 43 with more chunks a slice than ring stages; MINB 2's narrower split-k sum
    (42, "fp16", ConvShape(5, 200, 1, 1, 70, 1), {"MT": 1, "CP": 2, "WARPS": 4, "SPLIT": 4}),
    (42, "fp16", ConvShape(13, 392, 1, 1, 45, 1),
     {"MT": 1, "CP": 8, "WARPS": 4, "SPLIT": 2, "MINB": 2}),
    (42, "bf16", ConvShape(11, 136, 1, 1, 40, 1), {"MT": 2, "CP": 2, "WARPS": 4, "SPLIT": 0}),
    (42, "tf32", ConvShape(3, 264, 1, 1, 37, 1), {"MT": 1, "CP": 2, "WARPS": 4, "SPLIT": 3}),
    (42, "tf32", ConvShape(17, 96, 1, 1, 20, 1), {"MT": 2, "CP": 2, "WARPS": 4, "SPLIT": 1}),
    (42, "3xtf32", ConvShape(9, 152, 1, 1, 33, 1), {"MT": 1, "CP": 4, "WARPS": 4, "SPLIT": 2}),
    (43, "fp16", ConvShape(5, 520, 1, 1, 70, 1),
     {"MT": 1, "CP": 2, "WARPS": 4, "SPLIT": 2, "STAGES": 3}),
    (43, "tf32", ConvShape(12, 392, 1, 1, 37, 1),
     {"MT": 2, "CP": 2, "WARPS": 4, "SPLIT": 1, "STAGES": 2}),
    (43, "3xtf32", ConvShape(9, 264, 1, 1, 33, 1),
     {"MT": 1, "CP": 4, "WARPS": 4, "SPLIT": 2, "STAGES": 4}),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("kernel,mode,shape,params", EMULATED)
def test_kernel_emulated_on_cpu(kernel: int, mode: str, shape: ConvShape, params: dict[str, int],
                                tmp_path: Path, rng: np.random.Generator) -> None:
    bulk = kernel == 43
    params = {**(gemv_mma.BULK_DEFAULTS if bulk else gemv_mma.DEFAULTS), **params}
    plan = gemv_mma.launch_plan(shape, mode, params, sms=4)
    defines = gemv_mma.bulk_defines(mode, shape.B, params) if bulk else plan.defines
    if bulk:  # the slices hold more chunks than the ring has stages
        assert plan.slice_pieces // defines["TM_CP"] > defines["TB_STAGES"]
    filename = gemv_mma.BULK_KERNEL_FILE if bulk else gemv_mma.KERNEL_FILE
    (tmp_path / "kernel.inc").write_text(emulated_source(filename))
    (tmp_path / "emu.cpp").write_text(EMU)
    exe = tmp_path / "emu"
    build = subprocess.run([str(GXX), "-std=c++20", "-O1", "-fno-strict-aliasing", "-pthread",
                            "-w", *define_flags(defines), "-o", str(exe),
                            str(tmp_path / "emu.cpp")], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    case = make_case(rng, shape)
    w2 = case.w.reshape(shape.M, -1)
    packed = np.ascontiguousarray(gemv_mma.pack_chunks(w2, mode, defines) if bulk
                                  else gemv_mma.pack_weights(w2, mode))
    cp_ = defines["TM_CP"]
    sizes = ((ceil_div(plan.pieces, cp_), plan.slice_pieces // cp_, 0) if bulk
             else (plan.m_tiles, plan.pieces, plan.slice_pieces))
    got = run_gemv_emulator(exe, tmp_path, case, packed, sizes, plan.tiles, plan.slices,
                            int(rng.integers(2**31)))
    assert rel_l2(got, case.ref) <= TOLERANCE[mode], rel_l2(got, case.ref)
    if mode == "tf32":  # the products of the TF32 operands, summed in fp64 by the emulator
        ref = conv_reference(tf32_round(case.x), tf32_round(case.w), case.b)
        assert rel_l2(got, ref) <= TOLERANCE["fp32"], rel_l2(got, ref)


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_mode_on_random_shapes(name: str, rng: np.random.Generator) -> None:
    mode = name.split("-")[-1]
    impl = get_impl(name)
    for i in range(6):
        shape = random_shape(rng)
        case = make_case(rng, shape)
        params = None if i < 2 else random_point(rng, dict(impl.space))
        while name.startswith("gemv-bulk") and params is not None and gemv_mma.bulk_smem(
                mode, gemv_mma.bulk_defines(mode, shape.B, impl.params_for(params))) > \
                gemv_mma.SMEM_LIMIT:  # a ring that does not fit is refused by prepare
            params = random_point(rng, dict(impl.space))
        check_two_runs(name, case, params, TOLERANCE[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 13, 64])
def test_vgg_classifier_layers(name: str, batch: int, rng: np.random.Generator) -> None:
    check_classifier_layers(name, batch, rng, TOLERANCE[name.split("-")[-1]])


@pytest.mark.gpu
def test_tf32_is_fp32_accurate_against_its_rounded_operands(rng: np.random.Generator) -> None:
    """The kernel's operands are the TF32 roundings of x and W: against those in fp64 the error
    is the fp32 accumulation's, far below the rounding's."""
    case = make_case(rng, ConvShape(24, 4096, 1, 1, 300, 1))
    got = outputs_of_two_runs("gemv-mma-tf32", case)[0].get()
    ref = conv_reference(tf32_round(case.x), tf32_round(case.w), case.b)
    assert rel_l2(got, ref) < rel_l2(got, case.ref) / 10
