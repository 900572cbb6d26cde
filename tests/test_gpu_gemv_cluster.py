"""Kernel 48 (`gemv-cluster-fp16`, `-bf16`, `-tf32`): a classifier layer in one launch, its k
slices one thread-block cluster summed through distributed shared memory; and the bound launch
(`launch.BoundLaunch`) it runs through.

CPU tests: the launch plan's slices cover k in whole chunks with at most 8 (a portable cluster),
one wave where the shape allows; the shared memory holds the ring and the tile of sums; the
packed TF32 weights are the TF32 rounding of kernel 42's fp32 fragments; bad parameters are
refused by name; and the kernel source run on the CPU by the emulator (a cluster's blocks as
std::threads at once, each with its own shared memory; mma.sync from its fragment layouts) in
every mode and code path, with slices of more chunks than the ring holds, empty slices, and the
clusters in a random order, twice. GPU tests: every mode against the fp64 reference on fresh
random shapes (B 1-64,
C and M off the tile multiples), outputs poisoned, at the defaults and at random points of the
space including each SPLIT, two runs bit-identical (the cluster adds in rank order); fc6 / fc7 at
B = 1, 13, 64; TF32 at fp32 accuracy against its rounded operands; BoundLaunch against CuPy's
own call of the same kernel, and its refusal of an argument it cannot bind.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conv_cases import check_classifier_layers, check_two_runs, make_case, outputs_of_two_runs

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import gemv_cluster, gemv_mma
from convolab.gpu.implicit_gemm_wgmma import tf32_round
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape, ceil_div

MODES = list(gemv_cluster.MODES)
NAMES = [f"gemv-cluster-{m}" for m in MODES]


def random_shape(rng: np.random.Generator) -> ConvShape:
    """A linear layer: C a multiple of 8 (not of a chunk), M anything, B 1..64."""
    return ConvShape(int(rng.integers(1, gemv_cluster.MAX_BATCH + 1)),
                     8 * int(rng.integers(1, 500)), 1, 1, int(rng.integers(1, 700)), 1)


def random_point(rng: np.random.Generator) -> dict[str, int]:
    return {k: v[int(rng.integers(len(v)))] for k, v in gemv_cluster.SPACE.items()}


def fitting_point(rng: np.random.Generator, mode: str, shape: ConvShape) -> dict[str, int]:
    """A random point whose ring fits in shared memory (prepare refuses the others)."""
    while True:
        point = random_point(rng)
        params = {**gemv_cluster.DEFAULTS, **point}
        try:
            gemv_cluster.launch_plan(shape, mode, params)
        except ValueError:
            continue
        return point


# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", MODES)
def test_slices_cover_k_in_whole_chunks(mode: str, rng: np.random.Generator) -> None:
    for _ in range(50):
        shape = random_shape(rng)
        params = {**gemv_cluster.DEFAULTS, **fitting_point(rng, mode, shape)}
        plan = gemv_cluster.launch_plan(shape, mode, params, sms=132)
        pk, cp_ = gemv_cluster.piece_k(mode), params["CP"]
        assert plan.pieces == ceil_div(shape.C, pk)
        assert plan.slice_pieces % cp_ == 0
        assert 1 <= plan.split <= gemv_cluster.MAX_SPLIT
        assert plan.split * plan.slice_pieces >= plan.pieces  # every piece in a slice
        assert plan.tiles == ceil_div(ceil_div(shape.M, 16), params["WARPS"])
        nsplit = plan.defines["TC_NSPLIT"]
        assert nsplit == min(params["NSPLIT"], plan.defines["TC_NT"])
        assert plan.defines["TC_NT"] % nsplit == 0  # the kernel's static_assert
        assert plan.threads == 32 * params["WARPS"] * nsplit <= 1024
        if params["SPLIT"]:
            assert plan.split == params["SPLIT"]  # (empty slices where chunks are fewer)
        else:  # no empty slice
            assert (plan.split - 1) * plan.slice_pieces < plan.pieces


def test_auto_split_fills_one_wave() -> None:
    plan = gemv_cluster.launch_plan(ConvShape(64, 4096, 1, 1, 1024, 1), "fp16",
                                    gemv_cluster.DEFAULTS, sms=132)
    assert (plan.split, plan.tiles) == (8, 16)  # fc7: 128 blocks on 132 SMs
    plan = gemv_cluster.launch_plan(ConvShape(64, 25088, 1, 1, 4096, 1), "fp16",
                                    gemv_cluster.DEFAULTS, sms=132)
    assert plan.split * plan.tiles <= 132 and plan.split == 2
    assert gemv_cluster.auto_split(tiles=1, chunks=3, sms=132) == 2  # a slice holds a chunk


@pytest.mark.parametrize("mode", MODES)
def test_shared_memory_holds_ring_and_sums(mode: str) -> None:
    for warps, cp_ in ((4, 2), (8, 8)):
        xrow = gemv_cluster.x_row(mode, cp_)
        # the bank rule the kernel asserts, and room for a chunk
        assert xrow % 32 == (4 if mode == "tf32" else 8)
        assert xrow >= cp_ * gemv_cluster.piece_k(mode)
        orow = gemv_cluster.operand_row(mode, cp_)
        assert orow % 8 == 4  # the kernel's static_assert
        assert orow >= cp_ * gemv_cluster.piece_k(mode) // (1 if mode == "tf32" else 2)
        d = {"TC_NT": 8, "TC_WARPS": warps, "TC_CP": cp_, "TC_XROW": xrow, "TC_OROW": orow,
             "TC_STAGES": 2}
        stage = warps * cp_ * 512 + 64 * xrow * 4
        assert gemv_cluster.smem_bytes(mode, {**d, "TC_XONCE": 0}) == max(2 * stage,
                                                                           64 * 16 * warps * 4)
        assert gemv_cluster.smem_bytes(mode, {**d, "TC_XONCE": 1}) == max(
            2 * stage + 64 * orow * 4, 64 * 16 * warps * 4)


def test_tf32_weights_are_rounded_fp32_fragments(rng: np.random.Generator) -> None:
    w2 = rng.standard_normal((40, 72)).astype(np.float32)
    packed = gemv_cluster.pack_weights(w2, "tf32")
    fragments = gemv_mma.operand_values(w2, "3xtf32")
    assert packed.shape == fragments.shape
    np.testing.assert_array_equal(packed, tf32_round(fragments))
    assert not np.array_equal(packed, fragments)  # the rounding did something
    np.testing.assert_array_equal(gemv_cluster.pack_weights(w2, "fp16"),
                                  gemv_mma.operand_values(w2, "fp16"))


def test_bad_parameters_name_the_problem() -> None:
    shape = ConvShape(8, 64, 1, 1, 32, 1)
    with pytest.raises(ValueError, match="SPLIT"):
        gemv_cluster.launch_plan(shape, "fp16", {**gemv_cluster.DEFAULTS, "SPLIT": 3})
    with pytest.raises(ValueError, match="mode"):
        gemv_cluster.launch_plan(shape, "3xtf32", gemv_cluster.DEFAULTS)
    with pytest.raises(ValueError, match="does not support"):
        gemv_cluster.launch_plan(ConvShape(65, 64, 1, 1, 32, 1), "fp16", gemv_cluster.DEFAULTS)
    with pytest.raises(ValueError, match="shared memory"):
        gemv_cluster.launch_plan(ConvShape(64, 64, 1, 1, 32, 1), "fp16",
                                 {**gemv_cluster.DEFAULTS, "CP": 8, "WARPS": 8, "STAGES": 6})


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_mode_on_random_shapes(name: str, rng: np.random.Generator) -> None:
    mode = name.split("-")[-1]
    for i in range(8):
        shape = random_shape(rng)
        case = make_case(rng, shape)
        params = None if i < 2 else fitting_point(rng, mode, shape)
        check_two_runs(name, case, params, TOLERANCE[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_cluster_size_gives_the_layer(split: int, rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(37, 1000, 1, 1, 200, 1))  # M past a tile, C past a chunk
    outs = outputs_of_two_runs("gemv-cluster-fp16", case, {"SPLIT": split})
    assert rel_l2(outs[0], case.ref) <= TOLERANCE["fp16"], split


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 13, 64])
def test_vgg_classifier_layers(name: str, batch: int, rng: np.random.Generator) -> None:
    check_classifier_layers(name, batch, rng, TOLERANCE[name.split("-")[-1]])


@pytest.mark.gpu
def test_tf32_is_fp32_accurate_against_its_rounded_operands(rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(24, 4096, 1, 1, 300, 1))
    got = outputs_of_two_runs("gemv-cluster-tf32", case)[0].get()
    ref = conv_reference(tf32_round(case.x), tf32_round(case.w), case.b)
    assert rel_l2(got, ref) < rel_l2(got, case.ref) / 10


@pytest.mark.gpu
def test_bound_launch_is_cupys_call(rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.launch import BoundLaunch

    kernel = cp.RawKernel(r"""
    extern "C" __global__ void axpb(const float* x, float* y, float a, int n, long long shift) {
      const int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) y[i] = a * x[i] + (float)shift;
    }""", "axpb")
    n = 1000
    args = (None, None, np.float32(rng.standard_normal()), np.int32(n), np.int64(3))
    launch = BoundLaunch(kernel, (8,), (128,), args, per_call=(0, 1))
    for _ in range(2):  # new arrays each call: only their slots change
        x = cp.asarray(rng.standard_normal(n, dtype=np.float32))
        got, want = cp.full(n, cp.nan, cp.float32), cp.full(n, cp.nan, cp.float32)
        launch(x, got)
        kernel((8,), (128,), (x, want, *args[2:]))
        assert bool(cp.array_equal(got, want))
    with pytest.raises(TypeError, match="argument 2"):
        BoundLaunch(kernel, (8,), (128,), (None, None, 1.5, np.int32(n), np.int64(3)),
                    per_call=(0, 1))


def test_auto_takes_kernel_48_on_small_layers_only() -> None:
    from convolab.gpu import auto

    for batch in (1, 13, 64):
        fc7 = ConvShape(batch, 4096, 1, 1, 1024, 1)
        for mode in ("fp16", "tf32"):
            eligible = set(auto.eligible_impls(fc7, mode)) - {"gemv-wg-cluster-tf32"}
            choice = auto.default_choice(fc7, eligible, mode)  # TF32 without kernel 54
            assert choice.impl == f"gemv-cluster-{mode}", (batch, mode, choice)
            assert choice.params == gemv_cluster.auto_params(mode, batch)
            assert get_impl(choice.impl).params_for(choice.params)  # known parameters
        exact = auto.default_choice(fc7, auto.eligible_impls(fc7, "fp32"), "fp32")
        assert not exact.impl.startswith("gemv-cluster")  # no fp32-accurate mode
        fc6 = ConvShape(batch, 25088, 1, 1, 4096, 1)
        for mode in ("fp16", "tf32"):
            choice = auto.default_choice(fc6, auto.eligible_impls(fc6, mode), mode)
            assert not choice.impl.startswith("gemv-cluster"), (batch, mode, choice)


# ------------------------------------------------------------------------------- CPU emulator

# A cluster's blocks run at once, each with its own shared memory, block barrier and warps;
# cluster.cuh's loads read the other blocks' memory and its barrier spans them all. cp.async is
# a copy done at once (a slot refilled while a warp still read it would show), the rest of
# common.cuh's PTX comes from MMA_SHIM.
CLUSTER_SHIM = r"""
#include <memory>
#include <numeric>
#include <random>
struct WarpRegs { unsigned a[32][4], b[32][2]; float v[32]; };
thread_local std::barrier<>* block_bar;
thread_local std::barrier<>** warp_bars;
thread_local WarpRegs* tl_warp_regs;
thread_local unsigned char* tl_smem;
std::barrier<>* cluster_bar;
unsigned char* cluster_smem[8];
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline void warp_sync() { warp_bars[threadIdx.x / 32]->arrive_and_wait(); }
#define warp_regs tl_warp_regs
"""

EMU_MAIN = r"""
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct float2 { float x, y; };
struct __half2 { _Float16 x, y; };
inline __half2 __floats2half2_rn(float a, float b) { return {(_Float16)a, (_Float16)b}; }
template <typename T> inline unsigned ld_u32(const T* p) {
  unsigned u;
  std::memcpy(&u, p, 4);
  return u;
}
template <int N> inline void cp_async_wait() {}
inline void cp_async16_zfill(void* dst, const void* src, bool valid) {
  if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
inline unsigned cluster_address(const void* p, unsigned rank) {
  return (rank << 24) | (unsigned)(static_cast<const unsigned char*>(p) - tl_smem);
}
inline float4 cluster_load4(unsigned addr) {
  float4 v;
  std::memcpy(&v, cluster_smem[addr >> 24] + (addr & 0xFFFFFFu), 16);
  return v;
}
inline void cluster_sync() { cluster_bar->arrive_and_wait(); }
#define __cluster_dims__(...)
#include "kernel.inc"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), M = atoi(argv[3]), K = atoi(argv[4]), m_tiles = atoi(argv[5]);
  const int pieces = atoi(argv[6]), slice_pieces = atoi(argv[7]), tiles = atoi(argv[8]);
  const int split = atoi(argv[9]), threads = atoi(argv[10]), smem_bytes = atoi(argv[11]);
  const size_t w_bytes = atol(argv[12]);
  std::mt19937 order_rng(atoi(argv[13]));
  float* x = read<float>(dir, "x.bin", (size_t)B * K);
  const uint4* w = reinterpret_cast<const uint4*>(read<unsigned char>(dir, "w.bin", w_bytes));
  float* bias = read<float>(dir, "b.bin", M);
  const size_t ny = (size_t)B * M + 64;
  float* y = read<float>(dir, "y.bin", ny);
  gridDim.x = split;
  gridDim.y = tiles;
  std::vector<int> order(tiles);
  std::iota(order.begin(), order.end(), 0);
  for (int launch = 0; launch < 2; ++launch) {
    std::fill(y, y + ny, NAN);
    std::shuffle(order.begin(), order.end(), order_rng);  // clusters run in any order
    for (const int tile : order) {
      std::barrier<> cb(split * threads);
      cluster_bar = &cb;
      std::vector<std::vector<unsigned char>> mem(split);
      std::vector<std::unique_ptr<std::barrier<>>> bars;
      std::vector<std::vector<std::barrier<>*>> warps(split);
      std::vector<std::vector<WarpRegs>> regs(split, std::vector<WarpRegs>(threads / 32));
      for (int r = 0; r < split; ++r) {
        mem[r].assign(smem_bytes, 0xFF);  // NaN: reads of what was never written show
        cluster_smem[r] = mem[r].data();
        bars.emplace_back(new std::barrier<>(threads));
        for (int i = 0; i < threads / 32; ++i) {
          bars.emplace_back(new std::barrier<>(32));
          warps[r].push_back(bars.back().get());
        }
      }
      std::vector<std::thread> ts;
      for (int r = 0; r < split; ++r) {
        std::barrier<>* bb = bars[r * (threads / 32 + 1)].get();
        for (int t = 0; t < threads; ++t)
          ts.emplace_back([&, r, t, bb] {
            threadIdx.x = t;
            blockIdx.x = r;
            blockIdx.y = tile;
            block_bar = bb;
            warp_bars = warps[r].data();
            tl_warp_regs = regs[r].data();
            tl_smem = mem[r].data();
            gemv_cluster(x, w, bias, y, B, M, K, m_tiles, pieces, slice_pieces);
          });
      }
      for (auto& t : ts) t.join();
    }
    char path[1024]; snprintf(path, sizeof path, "%s/y_out%d.bin", dir, launch);
    FILE* f = fopen(path, "wb"); fwrite(y, 4, ny, f); fclose(f);
  }
}
"""

EMULATED = [  # (mode, shape, params): B and M off the tiles, C off the chunks, slices of
    # several chunks (more than the ring's stages), every code path once
    ("fp16", ConvShape(5, 200, 1, 1, 70, 1), {"CP": 2, "SPLIT": 4, "STAGES": 2}),
    ("bf16", ConvShape(11, 264, 1, 1, 40, 1), {"CP": 2, "SPLIT": 2, "STAGES": 3, "NSPLIT": 2,
                                               "XONCE": 0}),
    ("tf32", ConvShape(17, 392, 1, 1, 37, 1), {"CP": 2, "SPLIT": 8, "STAGES": 2}),
    ("tf32", ConvShape(3, 96, 1, 1, 20, 1), {"CP": 2, "SPLIT": 1, "STAGES": 3, "XONCE": 0}),
    ("fp16", ConvShape(9, 64, 1, 1, 24, 1), {"CP": 2, "SPLIT": 4}),  # two slices empty
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("mode,shape,params", EMULATED)
def test_kernel_emulated_on_cpu(mode: str, shape: ConvShape, params: dict[str, int],
                                tmp_path: Path, rng: np.random.Generator) -> None:
    from cuda_emulator import CUDA_SHIM, MMA_SHIM, READ_SHIM, cluster_sum_source

    from convolab.gpu.compile import KERNEL_DIR, define_flags

    params = {**gemv_cluster.DEFAULTS, **params}
    plan = gemv_cluster.launch_plan(shape, mode, params, sms=132)
    source = (KERNEL_DIR / gemv_cluster.KERNEL_FILE).read_text()
    for include in ('#include "common.cuh"', "#include <cuda_bf16.h>"):
        source = source.replace(include, "")
    source = source.replace('#include "cluster.cuh"', cluster_sum_source())
    source = source.replace("extern __shared__ __align__(16) unsigned char smem[];",
                            "unsigned char* smem = tl_smem;")
    assert "asm" not in source and "extern __shared__" not in source
    (tmp_path / "kernel.inc").write_text(source)
    (tmp_path / "emu.cpp").write_text(CUDA_SHIM + READ_SHIM + CLUSTER_SHIM + MMA_SHIM + EMU_MAIN)
    exe = tmp_path / "emu"
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-pthread", "-w",
                            *define_flags(plan.defines), "-o", str(exe),
                            str(tmp_path / "emu.cpp")], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    case = make_case(rng, shape)
    packed = np.ascontiguousarray(gemv_cluster.pack_weights(case.w.reshape(shape.M, -1), mode))
    packed.tofile(tmp_path / "w.bin")
    for name, a in (("x", case.x), ("b", case.b), ("y", np.full(shape.B * shape.M + 64, np.nan))):
        np.ascontiguousarray(a, np.float32).tofile(tmp_path / f"{name}.bin")
    args = (shape.B, shape.M, shape.C, plan.m_tiles, plan.pieces, plan.slice_pieces, plan.tiles,
            plan.split, plan.threads, plan.smem, packed.nbytes, int(rng.integers(2**31)))
    run = subprocess.run([str(exe), str(tmp_path), *map(str, args)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    ys = [np.fromfile(tmp_path / f"y_out{i}.bin", np.float32) for i in range(2)]
    assert np.array_equal(ys[0], ys[1], equal_nan=True), "two launches differ"
    assert np.isnan(ys[0][shape.B * shape.M:]).all(), "wrote past the output"
    got = ys[0][: shape.B * shape.M].reshape(shape.y_shape)
    assert rel_l2(got, case.ref) <= TOLERANCE[mode], rel_l2(got, case.ref)
    if mode == "tf32":  # the products of the TF32 operands, summed in fp64 by the emulator
        ref = conv_reference(tf32_round(case.x), tf32_round(case.w), case.b)
        assert rel_l2(got, ref) <= TOLERANCE["fp32"], rel_l2(got, ref)
