"""Kernel 49 (`gemv-wg-fp16`, `gemv-wg-bf16`): classifier layers at batch 16-64 on the
warpgroup MMA, fed by a producer warpgroup (the weights by the bulk copy engine, x by cp.async,
converted in shared memory).

CPU tests: every weight is found where the kernel's descriptors read it (addresses computed
here from the layout the kernel states: a block's chunk of KT k-tiles, each 2 MT tiles of 64
rows x 128 bytes, piece j of row r at j ^ (r mod 8), row 16 w + r of tile (g, mi) being kernel
42's m-tile mi of warp 4 g + w), everything else zero; the launch plan's slices cover k in
whole chunks and rings that do not fit are refused; bad parameters name the problem; and the
kernel source run on the CPU by an emulator (a std::thread a CUDA thread; mbarriers with their
counts, transaction bytes and phases, so that the producer and consumer warpgroups really wait
on each other; wgmma reading shared memory through its descriptors and the 128-byte swizzle as
the hardware applies it) in both modes and in clusters of two row tiles (both blocks at once,
each with its own shared memory; x's boxes multicast into both, their bytes completing on both
blocks' barriers; stages released on both blocks' barriers; one block's consumers lagging the
other's as far as the kernel's waits let them), with several slices, partial chunks and row
tiles, launched twice with the blocks in a random order. GPU tests: every mode against the fp64
reference on fresh random shapes (B 1-64, C and M off the tile multiples), outputs poisoned, at
the defaults and at random points of the space, each run twice (bit-identical); VGG's fc6 and
fc7 at B = 16, 33, 64.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conv_cases import FC6, Case, check_classifier_layers, check_two_runs, make_case
from cuda_emulator import (
    ASAN_OPTIONS,
    BLOCK_SHIM,
    CLUSTER_MBAR_SHIM,
    CLUSTER_RUN_SHIM,
    CLUSTER_SHIM,
    CUDA_SHIM,
    GEMV_SHIM,
    MBARRIER_SHIM,
    MMA_SHIM,
    TMA_SHIM,
    WGMMA_SS_SHIM,
    build_emulator,
    run_gemv_emulator,
    static_shared_in_block,
)

from convolab.check import poison, rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import gemv_mma, gemv_wgmma
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = list(gemv_wgmma.MODES)
NAMES = [f"gemv-wg-{m}" for m in MODES]
GXX = shutil.which("g++")


def random_point(rng: np.random.Generator) -> dict[str, int]:
    """A random point of the space that `defines` accepts: clusters only where x comes by the
    tensor copy engine."""
    point = {k: v[int(rng.integers(len(v)))] for k, v in gemv_wgmma.SPACE.items()}
    if point["CLUSTER"] > 1:
        point["XPASS"] = 1
    return point


def launchable(mode: str, shape: ConvShape, params: dict[str, int]) -> bool:
    """The point's ring fits and, in clusters, the layer's row tiles pair up (else prepare
    refuses it, tested in test_launch_plan_covers_k_in_whole_chunks)."""
    try:
        gemv_wgmma.launch_plan(shape, mode, {**gemv_wgmma.DEFAULTS, **params})
    except ValueError:
        return False
    return True


def sixteen_bits(a: np.ndarray, mode: str) -> np.ndarray:
    """The operand's bit patterns, uint16, independently of the packer: fp16 by NumPy's cast,
    bf16 by rounding the fp32 bits to nearest even in fp64 arithmetic."""
    if mode == "fp16":
        return a.astype(np.float16).view(np.uint16)
    u = a.astype(np.float32).view(np.uint32).astype(np.int64)
    return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)


def weight_offsets(M: int, C: int, d: dict[str, int]) -> np.ndarray:
    """(M, C) element offsets of each weight in the packed buffer, from the kernel's reads."""
    mt, kt = d["TM_MT"], d["GW_KT"]
    rows = 128 * mt
    chunks = ceil_div(C, 64 * kt)
    m, k = np.meshgrid(np.arange(M), np.arange(C), indexing="ij")
    tile, in_tile = m // rows, m % rows
    warp, mi, r = in_tile // 16 // mt, in_tile // 16 % mt, in_tile % 16
    group, w = warp // 4, warp % 4
    chunk, ktile, j, e = k // (64 * kt), k // 64 % kt, k % 64 // 8, k % 8
    tiles = ceil_div(M, rows)
    run = chunk * tiles + tile if d.get("GW_INTERLEAVE") else tile * chunks + chunk
    a_tile = ((run * kt + ktile) * 2 + group) * mt + mi
    row = 16 * w + r
    return (a_tile * 64 + row) * 64 + (j ^ (row % 8)) * 8 + e


@pytest.mark.parametrize("mode", MODES)
def test_weights_sit_where_the_descriptors_read_them(mode: str, rng: np.random.Generator) -> None:
    for _ in range(3):
        M, C = int(rng.integers(1, 600)), 8 * int(rng.integers(1, 40))
        d = gemv_wgmma.defines(mode, 8, random_point(rng))
        w = rng.standard_normal((M, C)).astype(np.float32)
        packed = gemv_wgmma.pack_weights(w, mode, d).view(np.uint16)
        tiles, chunks = ceil_div(M, 128 * d["TM_MT"]), ceil_div(C, 64 * d["GW_KT"])
        assert packed.size * 2 == tiles * chunks * gemv_wgmma.a_bytes(d)
        at = weight_offsets(M, C, d)
        np.testing.assert_array_equal(packed[at], sixteen_bits(w, mode), err_msg=str((M, C, d)))
        rest = np.ones(packed.size, bool)
        rest[at.reshape(-1)] = False
        assert not packed[rest].any(), "padding is not zero"


@pytest.mark.parametrize("mode", MODES)
def test_launch_plan_covers_k_in_whole_chunks(mode: str, rng: np.random.Generator) -> None:
    for _ in range(50):
        shape = ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 4000)), 1, 1,
                          int(rng.integers(1, 5000)), 1)
        params = random_point(rng)
        d = gemv_wgmma.defines(mode, shape.B, params)
        if gemv_wgmma.smem_bytes(d) > gemv_mma.SMEM_LIMIT:
            with pytest.raises(ValueError, match="shared memory"):
                gemv_wgmma.launch_plan(shape, mode, params)
            continue
        if params["CLUSTER"] == 2 and ceil_div(shape.M, 128 * d["TM_MT"]) % 2:
            with pytest.raises(ValueError, match="pairs row tiles"):
                gemv_wgmma.launch_plan(shape, mode, params)
            continue
        plan = gemv_wgmma.launch_plan(shape, mode, params, sms=int(rng.integers(1, 140)))
        assert plan.chunks * 64 * d["GW_KT"] >= shape.C > (plan.chunks - 1) * 64 * d["GW_KT"]
        per = plan.slice_chunks
        assert (plan.slices - 1) * per < plan.chunks <= plan.slices * per
        assert plan.tiles * 128 * d["TM_MT"] >= shape.M
        if params["SPLIT"]:
            assert plan.slices == ceil_div(plan.chunks, ceil_div(plan.chunks, min(
                params["SPLIT"], plan.chunks)))


@pytest.mark.parametrize("mode", MODES)
def test_x16_boxes_are_the_stage_operand(mode: str, rng: np.random.Generator) -> None:
    """x's tensor map, as the kernel's x16 stage reads it: a box is one k-tile (64 16-bit values,
    the 128-byte swizzle's span) of the stage's 8 TM_NT rows, rows C elements apart; the stage
    holds the boxes and no fp32 copy, so it is the weights plus KT boxes; and the 128-row tiles
    fit the 8 stages `auto`'s XPASS rule asks for at every batch."""
    for _ in range(20):
        B, C = int(rng.integers(1, 65)), 8 * int(rng.integers(1, 4000))
        shape = ConvShape(B, C, 1, 1, int(rng.integers(1, 5000)), 1)
        params = {**random_point(rng), "x16": 0, "XPASS": 1}
        d = gemv_wgmma.defines(mode, B, params)
        dims, strides, box = gemv_wgmma.x_map_geometry(shape, d)
        assert dims == (C, B) and strides == (2 * C,)
        assert box == (gemv_wgmma.K_TILE, 8 * d["TM_NT"]) and 8 * d["TM_NT"] >= B
        assert box[0] * 2 == gemv_wgmma.ROW_BYTES
        assert gemv_wgmma.x_bytes(d) == d["GW_KT"] * box[0] * 2 * box[1]
        ring = gemv_wgmma.defines(mode, B, {**params, "XPASS": 0, "CLUSTER": 1})
        assert gemv_wgmma.x_bytes(ring) == 3 * gemv_wgmma.x_bytes(d)  # + the fp32 rows
    fc6 = FC6.with_batch(64)
    choice = gemv_wgmma.auto_choice(fc6, "fp16")
    assert choice is not None and choice[1].get("XPASS") == 1
    plan = gemv_wgmma.launch_plan(fc6, mode, {**gemv_wgmma.DEFAULTS, **choice[1]})
    assert plan.smem <= gemv_mma.SMEM_LIMIT and "GW_X16" in plan.defines


def test_bad_parameters_name_the_problem() -> None:
    with pytest.raises(ValueError, match="MT, KT, STAGES, MINB and INTERLEAVE"):
        gemv_wgmma.defines("fp16", 8, {**gemv_wgmma.DEFAULTS, "STAGES": 9})
    with pytest.raises(ValueError, match="x16 is 0"):
        gemv_wgmma.defines("fp16", 8, {**gemv_wgmma.DEFAULTS, "x16": 2})
    with pytest.raises(ValueError, match="already converted"):
        gemv_wgmma.defines("fp16", 8, {**gemv_wgmma.DEFAULTS, "x16": 1, "XPASS": 1})
    with pytest.raises(ValueError, match="CLUSTER is 1, or 2 where x comes by the tensor copy"):
        gemv_wgmma.defines("fp16", 8, {**gemv_wgmma.DEFAULTS, "CLUSTER": 2})
    with pytest.raises(ValueError, match="CLUSTER is 1"):
        gemv_wgmma.defines("fp16", 8, {**gemv_wgmma.DEFAULTS, "x16": 1, "CLUSTER": 4})
    assert gemv_wgmma.defines("fp16", 8, {**gemv_wgmma.DEFAULTS, "x16": 1,
                                          "CLUSTER": 2})["GW_CLUSTER"] == 2
    with pytest.raises(ValueError, match="unknown mode"):
        gemv_wgmma.defines("tf32", 8, gemv_wgmma.DEFAULTS)
    with pytest.raises(ValueError, match="batch 65"):
        gemv_wgmma.defines("fp16", 65, gemv_wgmma.DEFAULTS)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv_wgmma.pack_weights(np.zeros((4, 12), np.float32), "fp16",
                                gemv_wgmma.defines("fp16", 8, gemv_wgmma.DEFAULTS))
    assert not gemv_wgmma.supports(ConvShape(65, 64, 1, 1, 8, 1))
    assert not gemv_wgmma.supports(ConvShape(4, 64, 3, 3, 8, 1))


def test_compiled_define_sets_cover_every_value() -> None:
    compiled = gemv_wgmma.compile_variants("fp16")()
    for key, name in (("MT", "TM_MT"), ("KT", "GW_KT"), ("STAGES", "GW_STAGES")):
        assert {d[name] for d in compiled} == set(gemv_wgmma.SPACE[key])
    assert {d["TM_NT"] for d in gemv_wgmma.compile_variants("bf16")()} == {1, 8}
    assert {d.get("GW_CLUSTER", 1) for d in compiled} == set(gemv_wgmma.SPACE["CLUSTER"])


# ------------------------------------------------------------------------- CPU emulator

# Kernel 49 on the CPU: cuda_emulator's CLUSTER_SHIM, each launch's clusters of GW_CLUSTER row
# tiles (one block without GW_CLUSTER) run at once, the rank blockIdx.x % GW_CLUSTER, each block
# with its own shared memory (the static barriers moved there by static_shared_in_block, the
# ring's memory EMU_DYN_PAD bytes after them, so that the ring's 1 KB alignment takes some of
# the slack), both consumer warpgroups issuing wgmmas, one trailing the other, and each rank's
# consumers trailing the rank before's as far as the kernel's waits let them (EMU_RANKS_TRAIL:
# a stage refilled while the other block still reads it, or a block gone while the other still
# arrives on it, shows); x's boxes by TMA_SHIM, multicast and remote arrivals by
# CLUSTER_MBAR_SHIM. Here: wgmma_core.cuh's hold and gemv_wgmma.cuh (the 16-byte store, the
# wgmma: WGMMA_SS_SHIM's, run at the wait that retires it).
GW_SHIM = r"""
template <int R> inline void wg_hold(float (&)[R][4]) {}
inline void gw_store16(unsigned at, unsigned a, unsigned b, unsigned c, unsigned d) {
  const unsigned v[4] = {a, b, c, d};
  std::memcpy(shared_ptr(at), v, 16);
}
inline void gw_mma(float (&d)[TM_NT][4], unsigned long long da, unsigned long long db) {
  wgss_mma(&d[0][0], 8 * TM_NT, da, db, 1, TM_MODE);
}
"""

# argv as run_gemv_emulator passes it (dir, B, M, K, chunks, chunks a slice, tiles, slices,
# launches, w bytes, seed). With GW_X16, x in the operand type (rounded to nearest even as
# gemv_wgmma.to_operand does) behind an EmuMap2d of the kernel's box: 64 k x GW_N rows.
WG_MAIN = ASAN_OPTIONS + r"""
static_assert(EMU_CLUSTER == GW_CLUSTER, "a cluster is the kernel's row tiles");
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), M = atoi(argv[3]), K = atoi(argv[4]);
  const int chunks_total = atoi(argv[5]), slice_chunks = atoi(argv[6]);
  const int tiles = atoi(argv[7]), slices = atoi(argv[8]), launches = atoi(argv[9]);
  // the parked partials (gemv_mma.cuh finish_parked), as LaunchPlan.parked_floats counts them
  const size_t parked = (size_t)slices * tiles * TM_THREADS * TM_PARKED_RUN * 4;
  const GemvIo io = read_gemv_io(dir, B, M, K, tiles, slices, atol(argv[10]),
                                 slices > 1 ? parked : 0);
#if GW_X16
  std::vector<unsigned short> x16((size_t)B * K);
  for (size_t i = 0; i < x16.size(); ++i)
    x16[i] = TM_MODE == 0 ? __half_as_ushort(__float2half_rn(io.x[i])) : bf16_bits(io.x[i]);
  const EmuMap2d x_map{x16.data(), K, B, GW_N};
  const void* x_arg = &x_map;
#else
  const float* x_arg = io.x;
#endif
  run_launches(dir, io, tiles, slices, launches, atoi(argv[11]), [&](int bx, int by) {
    run_cluster(GW_THREADS, [&](int r) {
      blockIdx.x = bx + r, blockIdx.y = by;
      gemv_wgmma(x_arg, io.w, io.bias, io.y, io.partial, io.tickets, B, M, K, chunks_total,
                 slice_chunks);
    });
  }, GW_CLUSTER);
}
"""


def emulated_source(kernel: str | None = None) -> tuple[str, str]:
    """Kernel 49 (its file, or the text `kernel`) with gemv_mma.cuh and gemv_wgmma_x32.cuh
    inlined and wgmma_core.cuh's descriptor functions (the encoding the kernel really uses); its
    PTX (gemv_wgmma.cuh, mbarrier.cuh, cluster.cuh, common.cuh's cp.async, wgmma_core.cuh's
    fences) left to the shims; its dynamic shared memory the running block's `emu_smem`, its
    barriers moved into the block's memory (`static_shared_in_block`, whose EMU_STATIC #define
    comes second)."""
    core = (KERNEL_DIR / "wgmma_core.cuh").read_text()
    descriptors = "".join(re.findall(
        r"__device__ __forceinline__ unsigned long long wg_desc(?:_add)?\(.*?\n}\n", core,
        re.DOTALL))
    assert descriptors.count("wg_desc") >= 2
    header = (KERNEL_DIR / "gemv_mma.cuh").read_text().replace("#pragma once", "")
    x32 = (KERNEL_DIR / "gemv_wgmma_x32.cuh").read_text().replace("#pragma once", "")
    source = kernel if kernel is not None else (KERNEL_DIR / gemv_wgmma.KERNEL_FILE).read_text()
    for include, text in (('#include "gemv_mma.cuh"', header), ('#include "mbarrier.cuh"', ""),
                          ('#include "wgmma_core.cuh"', descriptors),
                          ('#include "gemv_wgmma.cuh"', GW_SHIM),
                          ('#include "gemv_wgmma_x32.cuh"', x32), ('#include "common.cuh"', ""),
                          ('#include "cluster.cuh"', ""), ("#include <cuda_bf16.h>", "")):
        assert include in source or include in header, include
        source = source.replace(include, text)
    source, n = re.subn(r"extern __shared__ unsigned char gw_raw\[\];",
                        "unsigned char* gw_raw = emu_smem;", source)
    assert n == 1
    # XPASS's conversion launch is a grid-stride loop the emulator does not run (the GPU tests
    # check it bit for bit against the conversion in the ring)
    source, n = re.subn(r'extern "C" __global__ void gw_x_to_operand\(.*?\n}\n', "", source,
                        flags=re.DOTALL)
    assert n == 1
    assert "asm" not in source, "inline PTX the emulator does not know"
    return static_shared_in_block(source)


EMULATED = [  # (mode, shape, params): more chunks a slice than stages, B, M and K off the tiles
    ("fp16", ConvShape(5, 1000, 1, 1, 70, 1), {"STAGES": 2, "SPLIT": 2}),
    ("bf16", ConvShape(37, 392, 1, 1, 300, 1), {"MT": 2, "STAGES": 3, "SPLIT": 2}),
    ("fp16", ConvShape(20, 904, 1, 1, 140, 1), {"KT": 2, "STAGES": 2, "SPLIT": 3,
                                                "INTERLEAVE": 1}),
    # x in the operand type, by the tensor copy engine
    ("fp16", ConvShape(37, 1000, 1, 1, 300, 1), {"STAGES": 3, "SPLIT": 2, "x16": 1}),
    ("bf16", ConvShape(9, 904, 1, 1, 140, 1), {"KT": 2, "STAGES": 2, "SPLIT": 3, "x16": 1}),
    # clusters of two row tiles sharing x's boxes: 4 tiles (two clusters a slice), slices of 8
    # and 7 chunks (an odd one: rank 0 copies one box more); 2 tiles, slices of 3, 3 and 2
    ("fp16", ConvShape(37, 904, 1, 1, 400, 1), {"STAGES": 3, "SPLIT": 2, "x16": 1, "CLUSTER": 2}),
    ("bf16", ConvShape(9, 904, 1, 1, 200, 1),
     {"KT": 2, "STAGES": 2, "SPLIT": 3, "XPASS": 1, "CLUSTER": 2}),
]


def rounded(a: np.ndarray, mode: str) -> np.ndarray:
    """fp32 values rounded to the operand type, back in fp32."""
    bits = gemv_mma.sixteen_bit(a, mode)
    if mode == "fp16":
        return bits.astype(np.float32)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def plan_of(mode: str, shape: ConvShape, params: dict[str, int]) -> gemv_wgmma.LaunchPlan:
    """The emulated launch at `params` over the defaults, slices chosen as for 4 SMs."""
    return gemv_wgmma.launch_plan(shape, mode, {**gemv_wgmma.DEFAULTS, **params}, sms=4)


def build_kernel_emulator(plan: gemv_wgmma.LaunchPlan, tmp_path: Path, rng: np.random.Generator,
                          kernel: str | None = None) -> Path:
    """The emulator of kernel 49 (or of the text `kernel`) for `plan`."""
    d = plan.defines
    cluster = d.get("GW_CLUSTER", 1)
    source, static = emulated_source(kernel)
    main = (static + CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + GEMV_SHIM + CLUSTER_SHIM + MBARRIER_SHIM
            + WGMMA_SS_SHIM + TMA_SHIM + CLUSTER_MBAR_SHIM + CLUSTER_RUN_SHIM
            + '#include "kernel.inc"\n' + WG_MAIN)
    dyn = 16 * int(rng.integers(0, 64))  # where dynamic shared memory starts: not on 1 KB
    return build_emulator(tmp_path, main, source,
                          [*define_flags(d), f"-DEMU_RANK=(blockIdx.x%{cluster})",
                           f"-DEMU_CLUSTER={cluster}", "-DEMU_WG_ISSUERS=2", "-DEMU_RANKS_TRAIL",
                           f"-DEMU_DYN_PAD={dyn}", f"-DEMU_SMEM_BYTES={plan.smem}"])


def run_kernel_emulator(exe: Path, plan: gemv_wgmma.LaunchPlan, mode: str, shape: ConvShape,
                        tmp_path: Path, rng: np.random.Generator) -> tuple[np.ndarray, Case]:
    """A random case of the layer through the emulator `exe`: its output, checked by
    run_gemv_emulator (an AssertionError if not), and the case."""
    case = make_case(rng, shape)
    packed = gemv_wgmma.pack_weights(case.w.reshape(shape.M, -1), mode, plan.defines)
    got = run_gemv_emulator(exe, tmp_path, case, np.ascontiguousarray(packed),
                            (plan.chunks, plan.slice_chunks), plan.tiles, plan.slices,
                            int(rng.integers(2**31)), plan.parked_floats)
    return got, case


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("mode,shape,params", EMULATED)
def test_kernel_emulated_on_cpu(mode: str, shape: ConvShape, params: dict[str, int],
                                tmp_path: Path, rng: np.random.Generator) -> None:
    plan = plan_of(mode, shape, params)
    d = plan.defines
    assert plan.slice_chunks > d["GW_STAGES"] and plan.smem <= gemv_mma.SMEM_LIMIT
    assert plan.tiles % d.get("GW_CLUSTER", 1) == 0
    assert shape.B % 8 and shape.M % gemv_wgmma.tile_rows(d) and shape.C % gemv_wgmma.K_TILE
    exe = build_kernel_emulator(plan, tmp_path, rng)
    got, case = run_kernel_emulator(exe, plan, mode, shape, tmp_path, rng)
    assert rel_l2(got, case.ref) <= TOLERANCE[mode], rel_l2(got, case.ref)
    # against the products of the rounded operands: only the fp32 sums' error is left
    ref = conv_reference(rounded(case.x, mode), rounded(case.w, mode), case.b)
    assert rel_l2(got, ref) <= TOLERANCE["fp32"], rel_l2(got, ref)


# Kernel 49 broken as its clusters could be (the edit, and what the emulator must say, or None
# for any failure): the first cluster barrier a block barrier, so a block copies into or arrives
# on the other's barriers before they are initialised; the last one dropped, so a block leaves
# while the other still arrives on its `empty` barriers; a stage released on the block's own
# barrier only (twice, so the count is met), so the other block's multicast overwrites x's stage
# while this one's wgmmas still read it.
BROKEN = [
    pytest.param("  cluster_sync();  // every block's barriers exist before the other copies or "
                 "arrives on them\n", "  __syncthreads();\n", "not initialised",
                 id="no-first-cluster-sync"),
    pytest.param("  cluster_sync();  // no block leaves while the other may still copy into it or "
                 "arrive on it\n", "", "which has left", id="no-last-cluster-sync"),
    pytest.param("mbar_arrive_remote(empty_s, r);", "mbar_arrive_remote(empty_s, cluster_rank());",
                 None, id="own-empty-only"),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("old,new,says", BROKEN)
def test_emulator_shows_a_broken_cluster(old: str, new: str, says: str | None, tmp_path: Path,
                                         rng: np.random.Generator) -> None:
    kernel = (KERNEL_DIR / gemv_wgmma.KERNEL_FILE).read_text()
    assert kernel.count(old) == 1, old
    mode, shape, params = EMULATED[-1]
    plan = plan_of(mode, shape, params)
    assert plan.defines["GW_CLUSTER"] == 2
    exe = build_kernel_emulator(plan, tmp_path, rng, kernel.replace(old, new))
    try:
        got, case = run_kernel_emulator(exe, plan, mode, shape, tmp_path, rng)
    except AssertionError as e:  # the emulator aborted, or its launches differ
        failure = str(e)
    else:
        err = rel_l2(got, case.ref)
        failure = f"rel_l2 {err}" if not err <= TOLERANCE[mode] else ""
    assert failure, "the emulator ran the broken kernel to the right result"
    assert says is None or says in failure, failure


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_mode_on_random_shapes(name: str, rng: np.random.Generator) -> None:
    mode = name.split("-")[-1]
    for i in range(8):
        shape = ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 600)), 1, 1,
                          int(rng.integers(1, 900)), 1)
        params = None if i < 2 else random_point(rng)
        while params is not None and not launchable(mode, shape, params):
            params = random_point(rng)
        check_two_runs(name, make_case(rng, shape), params, TOLERANCE[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [16, 33, 64])
def test_vgg_classifier_layers(name: str, batch: int, rng: np.random.Generator) -> None:
    assert get_impl(name).supports(ConvShape(batch, 4096, 1, 1, 1024, 1))
    check_classifier_layers(name, batch, rng, TOLERANCE[name.split("-")[-1]])


def fitting_point(rng: np.random.Generator, mode: str, B: int) -> dict[str, int]:
    """A random point of the space whose ring fits in both forms (x in fp32 needs more)."""
    while True:
        params = {**random_point(rng), "x16": 0, "XPASS": 0, "CLUSTER": 1}
        if gemv_wgmma.smem_bytes(gemv_wgmma.defines(mode, B, params)) <= gemv_mma.SMEM_LIMIT:
            return params


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_x16_equals_the_fp32_form_bit_for_bit(mode: str, rng: np.random.Generator) -> None:
    """x given in the operand type (x16=1: x's chunks by the tensor copy engine, swizzled by
    it), and x in fp32 converted by a first launch (XPASS=1), against x converted in the ring:
    the same operands (all round to nearest even) in the same order of sums, so the same bits;
    within the tolerance of the fp64 reference; another buffer of the same x (a new tensor map)
    gives them again; and so do both in clusters of two row tiles sharing x's copies, where the
    row tiles pair up."""
    import cupy as cp

    impl = get_impl(f"gemv-wg-{mode}")
    for i in range(6):
        shape = (FC6.with_batch(64) if i == 0 else
                 ConvShape(int(rng.integers(1, 65)), 8 * int(rng.integers(1, 600)), 1, 1,
                           int(rng.integers(1, 900)), 1))
        params = dict(gemv_wgmma.DEFAULTS) if i < 2 else fitting_point(rng, mode, shape.B)
        case = make_case(rng, shape)
        w, b = cp.asarray(case.w), cp.asarray(case.b)
        forms = [(0, 0, 1), (1, 0, 1), (1, 0, 1), (0, 1, 1)]
        if launchable(mode, shape, {**params, "x16": 1, "CLUSTER": 2}):
            forms += [(1, 0, 2), (0, 1, 2)]
        outs = []
        for x16, xpass, cluster in forms:
            run = impl.prepare(shape, w, b, impl.params_for(
                {**params, "x16": x16, "XPASS": xpass, "CLUSTER": cluster}))
            x = cp.asarray(case.x)
            y = cp.empty(shape.y_shape, dtype=cp.float32)
            poison(y)
            run(gemv_wgmma.to_operand(x, mode) if x16 else x, y)
            outs.append(y)
        err = rel_l2(outs[1].get(), case.ref)
        assert err <= TOLERANCE[mode], (shape, params, err)
        assert bool(cp.array_equal(outs[0], outs[1])), (shape, params, "x16 differs")
        assert bool(cp.array_equal(outs[1], outs[2])), (shape, params, "runs differ")
        assert bool(cp.array_equal(outs[0], outs[3])), (shape, params, "XPASS differs")
        for got in outs[4:]:
            assert bool(cp.array_equal(outs[0], got)), (shape, params, "a cluster form differs")
        assert i > 0 or len(outs) == 6, "fc6's row tiles pair up"


@pytest.mark.gpu
def test_x16_refuses_an_input_not_in_the_operand_type() -> None:
    import cupy as cp

    impl = get_impl("gemv-wg-fp16")
    shape = ConvShape(4, 64, 1, 1, 32, 1)
    run = impl.prepare(shape, cp.ones(shape.w_shape, dtype=cp.float32),
                       cp.zeros(shape.M, dtype=cp.float32), impl.params_for({"x16": 1}))
    y = cp.empty(shape.y_shape, dtype=cp.float32)
    for bad in (cp.ones(shape.x_shape, dtype=cp.float32), cp.ones((4, 64), dtype=cp.float32),
                cp.ones((4, 72), dtype=cp.float16), cp.ones((64, 4), dtype=cp.float16).T):
        with pytest.raises(ValueError, match=r"x16=1.*\(4, 64\) float16"):
            run(bad, y)


def test_auto_takes_kernel_49_for_fc6_in_fp16_from_batch_17() -> None:
    """fc6 in FP16 from AUTO_FROM_BATCH with AUTO_TILES' parameters; kernel 42/43 where kernel
    49 is not eligible (a GPU without wgmma), at smaller batch, in other modes, and on fc7."""
    from convolab.bench.cases import VGG_SWEEP_BATCHES
    from convolab.gpu import auto
    from convolab.registry import all_impls

    names = {i.name for i in all_impls("gpu")}
    fc6, fc7 = ConvShape(1, 25088, 1, 1, 4096, 1), ConvShape(1, 4096, 1, 1, 1024, 1)
    for batch in VGG_SWEEP_BATCHES:
        for mode in auto.GEMM_FAMILY:
            choice = auto.default_choice(fc6.with_batch(batch), names, mode)
            if mode == "fp16" and batch >= gemv_wgmma.AUTO_FROM_BATCH:
                assert choice.impl == "gemv-wg-fp16", (batch, choice)
                want = next(p for up_to, p in gemv_wgmma.AUTO_TILES if up_to >= batch)
                assert choice.params == want
                plan = gemv_wgmma.launch_plan(fc6.with_batch(batch), mode,
                                              get_impl(choice.impl).params_for(choice.params))
                assert plan.smem <= gemv_mma.SMEM_LIMIT
                fallback = auto.default_choice(fc6.with_batch(batch), names - {choice.impl}, mode)
                assert fallback.impl.startswith(("gemv-mma-", "gemv-bulk-")), fallback
            else:
                assert not choice.impl.startswith("gemv-wg"), (batch, mode, choice)
            small = auto.default_choice(fc7.with_batch(batch), names, mode).impl
            assert small not in {f"gemv-wg-{m}" for m in gemv_wgmma.MODES}, (batch, mode, small)
