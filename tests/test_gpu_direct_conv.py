"""Kernel 50 (`direct-fp16`, `direct-bf16`): a narrow convolution straight from NCHW fp32, each
input row converted once into a channels-last ring in shared memory.

CPU tests: every weight is found where the kernel's ldmatrix reads it (offsets computed here
from the layout the kernel states: tap (p, q), row m, piece j ^ (m mod 8)), everything else
zero; the tiles chosen cover the output row and what does not fit is refused with the reason;
`supports` follows the limits; and the kernel sources run on the CPU by emulators (a
std::thread a CUDA thread, ldmatrix and mma.sync from their PTX fragment layouts, the wgmma
reading its operands through the descriptors and the 128-byte swizzle, shared memory poisoned
with NaN before every block): kernels 50-51 in both modes, with runs of rows crossing images,
rows in several passes, odd widths and C, M off the tile multiples; kernel 52 in fp16, bf16 and
tf32, both tiles, K = 1 / 3 / 5, widths off 8, C and M off the chunk and the tile, with no split
and with its slices one cluster of 2, 3 or 4 blocks run at once (each with its own shared
memory, mbarriers and barriers; rank 0 running ahead of the others, one consumer warpgroup
trailing the other), the clusters in a random order and the launch run twice: bit-identical,
nothing written past the output, accurate for the mode and fp32-accurate against the rounded
operands. GPU tests: every mode against the fp64 reference on fresh random shapes and tile
points, outputs poisoned, runs bit-identical; VGG's conv1_2 at batch 2.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from conv_cases import check_two_runs, make_case, outputs_of_two_runs
from cuda_emulator import (
    ASAN_OPTIONS,
    BLOCK_SHIM,
    CLUSTER_RUN_SHIM,
    CLUSTER_SHIM,
    CUDA_SHIM,
    GEMV_SHIM,
    LAG_SHIM,
    MBARRIER_SHIM,
    MMA_SHIM,
    SENTINEL,
    WGMMA_SS_SHIM,
    build_emulator,
    cluster_sum_source,
    run_fused_emulator,
    static_shared_in_block,
    two_launches,
)

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import direct_conv, direct_image, direct_wgmma, gemv_mma
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.precision import TOLERANCE
from convolab.registry import get_impl
from convolab.shapes import ConvShape

MODES = list(direct_conv.MODES)
NAMES = [f"direct-{m}" for m in MODES] + [f"direct-wg-{m}" for m in MODES]
IMAGE_NAMES = [f"direct-img-{m}" for m in direct_image.MODES]
GXX = shutil.which("g++")
CONV1_2 = ConvShape(1, 64, 226, 226, 64, 3)


# ------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", MODES)
def test_weights_where_the_kernel_reads_them(mode: str, rng: np.random.Generator) -> None:
    shape = ConvShape(1, 37, 9, 9, 45, 3)
    d = direct_conv.defines(mode, shape, direct_conv.DEFAULTS)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32)
    packed = direct_conv.pack_weights(w, mode, 16 * d["DC_MT"])
    rows = 16 * d["DC_MT"]
    assert packed.nbytes == shape.K * shape.K * rows * direct_conv.ROW_BYTES
    m, c, p, q = np.meshgrid(*(np.arange(n) for n in shape.w_shape), indexing="ij")
    offsets = (((p * shape.K + q) * rows + m) * 128 + ((c // 8) ^ (m % 8)) * 16 + (c % 8) * 2)
    bits = packed.view(np.uint16)
    want = gemv_mma.sixteen_bit(w, mode).view(np.uint16)
    assert np.array_equal(bits[offsets // 2], want)
    rest = np.ones(bits.size, bool)
    rest[(offsets // 2).ravel()] = False
    assert not bits[rest].any(), "bytes outside the weights must be zero"


def test_tiles_cover_the_row_and_what_does_not_fit_is_refused() -> None:
    d = direct_conv.defines("fp16", CONV1_2, direct_conv.DEFAULTS)
    assert (d["DC_NT"], d["DC_KK"], d["DC_MT"], d["DC_VEC"], d["DC_WM"]) == (7, 4, 4, 2, 2)
    assert direct_conv.defines("fp16", ConvShape(1, 8, 5, 5, 40, 3), {"WM": 0, "WN": 4, "NT": 0}
                               )["DC_WM"] == 1  # 3 m-tiles do not split over two warps
    assert direct_conv.pass_columns(d) == CONV1_2.W_out  # 224 columns in one pass
    plan = direct_conv.launch_plan(CONV1_2.with_batch(16), "fp16", direct_conv.DEFAULTS, sms=132)
    assert plan.blocks == 132 and plan.smem <= direct_conv.SMEM_LIMIT
    assert direct_conv.launch_plan(CONV1_2, "fp16", direct_conv.DEFAULTS, sms=300).blocks == 224
    for width in (9, 64, 100, 300, 1000):  # chosen n-tiles: one pass where the registers allow
        shape = ConvShape(1, 16, 5, width, 16, 3)
        for wn in direct_conv.SPACE["WN"]:
            dd = direct_conv.defines("fp16", shape, {"WM": 1, "WN": wn, "NT": 0})
            cols = direct_conv.pass_columns(dd)
            passes = -(-shape.W_out // cols)
            assert cols * passes >= shape.W_out and cols * (passes - 1) < shape.W_out
            assert dd["DC_NT"] * dd["DC_MT"] <= direct_conv.MAX_ACCUMULATORS
    with pytest.raises(ValueError, match="m-tiles"):
        direct_conv.defines("fp16", ConvShape(1, 8, 5, 5, 40, 3), {"WM": 2, "WN": 4, "NT": 0})
    with pytest.raises(ValueError, match="unknown mode"):
        direct_conv.defines("tf32", CONV1_2, direct_conv.DEFAULTS)
    with pytest.raises(ValueError, match="shared memory"):
        direct_conv.launch_plan(ConvShape(1, 64, 40, 700, 64, 3), "fp16",
                                {"WM": 1, "WN": 8, "NT": 8}, sms=132)


def test_supports() -> None:
    assert direct_conv.supports(CONV1_2.with_batch(64))
    assert direct_conv.supports(ConvShape(3, 1, 10, 10, 7, 1))
    assert not direct_conv.supports(ConvShape(1, 512, 16, 16, 512, 3))  # conv5_x
    assert not direct_conv.supports(ConvShape(1, 64, 226, 226, 65, 3))
    assert not direct_conv.supports(ConvShape(1, 64, 226, 226, 64, 3, 2))
    assert not direct_conv.supports(ConvShape(1, 64, 40, 2000, 64, 3))  # a ring row too long
    assert get_impl("direct-fp16").supports(CONV1_2)


def test_kernel_51_tiles_and_shared_memory() -> None:
    d = direct_wgmma.defines("fp16", CONV1_2, direct_wgmma.DEFAULTS)
    assert (d["DW_N"], d["DW_WG"], d["DW_KK"], d["DW_LOADS"]) == (112, 2, 4, 8)
    assert direct_wgmma.slot_pixels(CONV1_2, d) == 232  # 224 + 2, on the 8-row period
    plan = direct_wgmma.launch_plan(CONV1_2.with_batch(16), "fp16", direct_wgmma.DEFAULTS, 132)
    assert plan.blocks == 132 and plan.smem <= direct_conv.SMEM_LIMIT
    for width in (20, 100, 257, 600):  # chosen N: passes of both warpgroups cover the row
        shape = ConvShape(1, 16, 5, width, 16, 3)
        for wg in direct_wgmma.SPACE["WG"]:
            n = direct_wgmma.defines("fp16", shape, {"WG": wg, "N": 0})["DW_N"]
            passes = -(-shape.W_out // (wg * n))
            assert n % 16 == 0 and n <= direct_wgmma.MAX_N
            assert wg * n * (passes - 1) < shape.W_out <= wg * n * passes
            assert n - 16 < -(-shape.W_out // (wg * passes))  # no 16 columns to spare
    with pytest.raises(ValueError, match="shared memory"):
        direct_wgmma.launch_plan(ConvShape(1, 64, 40, 300, 64, 5), "fp16", direct_wgmma.DEFAULTS,
                                 132)
    assert not direct_wgmma.supports(ConvShape(1, 64, 40, 300, 64, 5))  # 25 taps: 200 KB
    assert not direct_wgmma.supports(ConvShape(1, 65, 40, 40, 64, 3))
    assert direct_wgmma.supports(ConvShape(1, 3, 226, 226, 64, 3))  # VGG's conv1_1


def test_auto_takes_kernel_51_for_narrow_wide_layers_in_fp16() -> None:
    from convolab.gpu import auto
    from convolab.registry import all_impls

    names = {i.name for i in all_impls("gpu")}
    for batch in (1, 2, 16, 64):
        shape = CONV1_2.with_batch(batch)
        assert auto.default_choice(shape, names, "fp16").impl == "direct-wg-fp16"
        for mode in ("fp32", "tf32"):
            assert not auto.default_choice(shape, names, mode).impl.startswith("direct")
        assert auto.default_choice(shape, names - {"direct-wg-fp16"}, "fp16").impl.startswith(
            "igemm-wg")  # a GPU without wgmma: what ran before
    narrow = ConvShape(4, 64, 30, 30, 64, 3)  # rows shorter than AUTO_MIN_WIDTH
    assert not auto.default_choice(narrow, names, "fp16").impl.startswith("direct")
    assert auto.default_choice(ConvShape(4, 512, 16, 16, 512, 3), names,
                               "fp16").impl != "direct-wg-fp16"  # C > 64: kernel 52's


def test_prepare_names_an_unsupported_shape_or_wrong_weights() -> None:
    """The checks run before anything needs CuPy: the same message with or without a GPU."""
    w = np.zeros(CONV1_2.w_shape, np.float32)
    with pytest.raises(ValueError, match="direct-wg-fp16 does not support shape"):
        direct_conv.checked_weights("direct-wg-fp16", CONV1_2, w, False)
    with pytest.raises(ValueError, match=r"weights of shape \(64, 64, 3, 3\) for .*want "
                                         r"\(64, 32, 3, 3\)"):
        direct_conv.checked_weights("direct-fp16", ConvShape(1, 32, 10, 10, 64, 3), w, True)


CONV5 = ConvShape(1, 512, 16, 16, 512, 3)


@pytest.mark.parametrize("mode", list(direct_image.MODES))
@pytest.mark.parametrize("tm", direct_image.TILES_M)
def test_kernel_52_weights_where_the_kernel_reads_them(mode: str, tm: int,
                                                       rng: np.random.Generator) -> None:
    shape = ConvShape(1, 70, 5, 5, 130, 3)  # 2-3 tiles, 2-3 chunks, the last of each padding
    w = rng.standard_normal(shape.w_shape, dtype=np.float32)
    packed = direct_image.pack_weights(w, mode, tm)
    cc = 32 if mode == "tf32" else 64  # a chunk's channels: 128 bytes of them
    size, per_piece = 128 // cc, cc // 8
    tiles, chunks, taps = -(-130 // tm), -(-70 // cc), 9
    assert packed.nbytes == tiles * chunks * taps * tm * 128
    m, c, p, q = np.meshgrid(*(np.arange(n) for n in shape.w_shape), indexing="ij")
    r = m % tm
    run = ((m // tm) * chunks + c // cc) * taps + p * 3 + q  # the run of tm rows the copier takes
    offsets = (run * tm * 128 + r * 128 + (((c % cc) // per_piece) ^ (r % 8)) * 16
               + (c % per_piece) * size)
    bits = packed.view(np.uint32 if mode == "tf32" else np.uint16)
    want = (rounded(w, mode).view(np.uint32) if mode == "tf32"
            else gemv_mma.sixteen_bit(w, mode).view(np.uint16))
    assert np.array_equal(bits[offsets // size], want)
    rest = np.ones(bits.size, bool)
    rest[(offsets // size).ravel()] = False
    assert not bits[rest].any(), "bytes outside the weights must be zero"


def test_kernel_52_plan_split_and_supports() -> None:
    assert direct_image.n_pixels(CONV5) == 224
    assert [direct_image.warpgroup_n(CONV5, tm) for tm in (64, 128)] == [112, 224]
    assert [direct_image.buffer_pixels(CONV5, tm) for tm in (64, 128)] == [264, 264]
    assert direct_image.smem_bytes(CONV5, 128, 5, "fp16") <= direct_conv.SMEM_LIMIT
    assert direct_image.smem_bytes(CONV5, 128, 5, "tf32") == direct_image.smem_bytes(
        CONV5, 128, 5, "fp16") - 32 * 16 * 16 * 4  # half the channels staged
    # (batch, TM, slices): 64-row tiles while 128-row ones fill at most a quarter of the SMs,
    # then slices while the blocks fill at most half of them; each slice keeps 2 chunks
    for batch, tm, split in ((1, 64, 4), (4, 64, 4), (8, 64, 2), (12, 128, 2), (16, 128, 2),
                             (32, 128, 1), (64, 128, 1)):
        plan = direct_image.launch_plan(CONV5.with_batch(batch), "fp16", direct_image.DEFAULTS,
                                        sms=132)
        assert (plan.defines["DI_TM"], plan.slices) == (tm, split), batch
        assert plan.slice_chunks * split == 8 and plan.grid[:2] == (512 // tm, batch)
    # TF32: 16 chunks of 32 channels, the same tiles
    for batch, tm, split in ((1, 64, 8), (4, 64, 4), (8, 64, 2), (12, 128, 2), (16, 128, 2),
                             (32, 128, 1)):
        plan = direct_image.launch_plan(CONV5.with_batch(batch), "tf32", direct_image.DEFAULTS,
                                        sms=132)
        assert (plan.defines["DI_TM"], plan.slices) == (tm, split), batch
        assert plan.slice_chunks * split == 16 and plan.defines["DW_MODE"] == 2
    # the slices of a (tile, image) are one cluster: its size compiled in, its tile of sums in
    # shared memory
    for batch in (1, 8, 12):
        plan = direct_image.launch_plan(CONV5.with_batch(batch), "fp16", {}, sms=132)
        assert plan.defines.get("DI_SPLIT", 1) == plan.slices
        assert plan.smem >= plan.defines["DI_TM"] * direct_image.sum_row(
            CONV5, plan.defines["DI_TM"]) * 4
    plan = direct_image.launch_plan(ConvShape(1, 130, 4, 8, 40, 1), "fp16",
                                    {"TM": 128, "STAGES": 2, "SPLIT": 8}, sms=132)
    assert (plan.slices, plan.slice_chunks) == (3, 1)  # no more slices than chunks
    assert direct_image.supports(CONV5.with_batch(64))
    assert not direct_image.supports(ConvShape(1, 512, 30, 30, 512, 3))  # 28 x 32 pixels
    assert not direct_image.supports(ConvShape(1, 64, 7, 7, 64, 3))  # 49-pixel planes
    assert not direct_image.supports(ConvShape(1, 64, 16, 16, 64, 3, 2))
    with pytest.raises(ValueError, match="TM, STAGES and SPLIT"):
        direct_image.defines("fp16", CONV5, {"TM": 0, "STAGES": 9, "SPLIT": 0})


def test_a_split_whose_clusters_do_not_fit_is_halved() -> None:
    """The H200's answers: 30 clusters of 4 and 15 of 8 with one block an SM, 66 of 2."""
    asked: list[int] = []

    def capacity(plan: direct_image.LaunchPlan) -> int:
        asked.append(plan.slices)
        return {2: 66, 4: 30, 8: 15}[plan.slices]

    def chosen(batch: int, mode: str, params: dict[str, int] | None = None) -> int:
        asked.clear()
        plan = direct_image.fitting_plan(CONV5.with_batch(batch), mode, params or {}, 132,
                                         capacity)
        assert plan.defines.get("DI_SPLIT", 1) == plan.slices
        return plan.slices

    assert chosen(2, "fp16") == 4 and asked == [4]  # 64 blocks in 16 clusters of 4
    assert chosen(4, "fp16") == 2 and asked == [4, 2]  # 128 blocks would need 32 clusters
    assert chosen(2, "tf32") == 4 and asked == [8, 4]  # 128 blocks in clusters of 8: 15 fit
    assert chosen(8, "fp16") == 2 and asked == [2]  # 128 blocks in 64 pairs
    assert chosen(32, "fp16") == 1 and asked == []  # no cluster: nothing to ask
    assert chosen(4, "fp16", {"SPLIT": 4}) == 4 and asked == []  # a split asked for is kept
    assert direct_image.fitting_plan(CONV5.with_batch(4), "fp16", {}, 132,
                                     lambda plan: None).slices == 4  # the driver cannot say


def test_auto_takes_kernel_52_for_conv5_in_fp16_and_tf32() -> None:
    from convolab.gpu import auto
    from convolab.registry import all_impls

    names = {i.name for i in all_impls("gpu")}
    for batch in (1, 2, 3, 4, 8, 12, 16, 32, 64):
        shape = CONV5.with_batch(batch)
        for mode in ("fp16", "tf32"):
            assert auto.default_choice(shape, names, mode).impl == f"direct-img-{mode}", batch
            assert not auto.default_choice(shape, names - {f"direct-img-{mode}"},
                                           mode).impl.startswith("direct")
        assert not auto.default_choice(shape, names, "fp32").impl.startswith("direct")
        narrow = ConvShape(batch, 64, 16, 16, 512, 3)  # too few input channels
        assert not auto.default_choice(narrow, names, "tf32").impl.startswith("direct-img")


# ------------------------------------------------------------------------- CPU emulator

# Kernels 50-51's shared memory (emu_smem: a shared address is the offset into it), ldmatrix,
# float2, and for kernel 51 its wgmma (cuda_emulator.WGMMA_SS_SHIM: each runs at the wait that
# retires it) and wgmma_core.cuh's fences (after CUDA_SHIM, BLOCK_SHIM, MMA_SHIM, GEMV_SHIM).
DC_SHIM = r"""
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
alignas(1024) unsigned char emu_smem[1 << 18];
inline unsigned __cvta_generic_to_shared(const void* p) {
  return (unsigned)((const unsigned char*)p - emu_smem);
}
inline unsigned char* shared_ptr(unsigned a) { return emu_smem + a; }
unsigned ldsm_rows[32][32];
// lane l gets, of each matrix i, the 4 bytes at 4 (l % 4) of the row lane 8 i + l / 4 named
template <int N> void emu_ldsm(unsigned (&r)[N], unsigned saddr) {
  const int l = threadIdx.x % 32;
  unsigned* rows = ldsm_rows[threadIdx.x / 32];
  rows[l] = saddr;
  warp_sync();
  for (int i = 0; i < N; ++i) std::memcpy(&r[i], emu_smem + rows[8 * i + l / 4] + 4 * (l % 4), 4);
  warp_sync();
}
inline void ldsm_x4(unsigned (&r)[4], unsigned saddr) { emu_ldsm(r, saddr); }
inline void ldsm_x2(unsigned (&r)[2], unsigned saddr) { emu_ldsm(r, saddr); }
#define WG_HOLD(x) ((void)0)
inline void wg_fence() {}
inline void wg_proxy_fence() {}
""" + WGMMA_SS_SHIM

DW_SHIM = r"""
inline void dw_mma(float (&d)[DW_N / 2], unsigned long long da, unsigned long long db,
                   int scale_d) {
  wgss_mma(d, DW_N, da, db, scale_d, DW_MODE);
}
"""

# argv: dir, B, C, H, W, M, blocks, slot pixels, staging stride (kernel 50), shared memory
# bytes, weight bytes. Each block's shared memory is poisoned with NaN first.
DC_MAIN = r"""
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), C = atoi(argv[3]), H = atoi(argv[4]), W = atoi(argv[5]);
  const int M = atoi(argv[6]), blocks = atoi(argv[7]), slot = atoi(argv[8]);
  const int stride = atoi(argv[9]), smem_bytes = atoi(argv[10]), w_bytes = atoi(argv[11]);
  const int Ho = H - EMU_K + 1, Wo = W - EMU_K + 1;
  const size_t ny = (size_t)B * M * Ho * Wo + 64;
  float* x = read<float>(dir, "x.bin", (size_t)B * C * H * W);
  uint4* w = read<uint4>(dir, "w.bin", w_bytes / 16);
  float* bias = read<float>(dir, "b.bin", M);
  float* y = read<float>(dir, "y.bin", ny);
  printf("%d\n", smem_bytes);
  if (smem_bytes > (int)sizeof emu_smem) std::abort();
  gridDim.x = blocks;
  for (int blk = 0; blk < blocks; ++blk) {
    std::memset(emu_smem, 0xFF, sizeof emu_smem);  // NaN in fp16, bf16 and fp32
    std::barrier<> group0(128), group1(128);
    wgss_bar[0] = &group0;
    wgss_bar[1] = &group1;
#ifdef DW_N
    run_block(blk, DW_THREADS,
              [=] { direct_conv_wgmma(x, w, bias, y, B, C, H, W, M, slot); });
#else
    run_block(blk, DC_THREADS,
              [=] { direct_conv(x, w, bias, y, B, C, H, W, M, slot, stride); });
#endif
  }
  char path[1024]; snprintf(path, sizeof path, "%s/y_out.bin", dir);
  FILE* f = fopen(path, "wb"); fwrite(y, 4, ny, f); fclose(f);
}
"""


def emulated_source(kernel_file: str) -> str:
    """The kernel with its PTX left to the shims (common.cuh, direct_wgmma.cuh, wgmma_core.cuh's
    fences) but wgmma_core.cuh's descriptor functions kept: the encoding the kernel really uses;
    its dynamic shared memory the emulator's."""
    core = (KERNEL_DIR / "wgmma_core.cuh").read_text()
    descriptors = "".join(re.findall(
        r"__device__ __forceinline__ unsigned long long wg_desc(?:_add)?\(.*?\n}\n", core,
        re.DOTALL))
    source = (KERNEL_DIR / kernel_file).read_text()
    for include, text in (('#include "common.cuh"', ""), ("#include <cuda_bf16.h>", ""),
                          ('#include "wgmma_core.cuh"', descriptors),
                          ('#include "direct_wgmma.cuh"', DW_SHIM), ('#include "mbarrier.cuh"', ""),
                          ('#include "warp_roles.cuh"', ""),
                          ('#include "cluster.cuh"', cluster_sum_source()),
                          ('#include "direct_image_sum.cuh"',  # kernel 52's, PTX-free
                           (KERNEL_DIR / "direct_image_sum.cuh").read_text().replace(
                               "#pragma once", ""))):
        source = source.replace(include, text)
    source, n = re.subn(r"extern __shared__ __align__\(\d+\) unsigned char (\w+)\[\];",
                        r"unsigned char* \1 = emu_smem;", source)
    assert n == 1
    return source


EMULATED = [  # (rung, mode, shape, params, blocks): runs of rows crossing images, odd widths
    # (4-byte copies, scalar stores), several passes a row, C and M off the tiles, K = 1, 4 and 5
    (50, "fp16", ConvShape(2, 20, 9, 19, 24, 3), {"WM": 1, "WN": 2, "NT": 0}, 5),
    (50, "bf16", ConvShape(3, 64, 6, 12, 64, 3), {"WM": 2, "WN": 2, "NT": 0}, 4),
    (50, "fp16", ConvShape(1, 8, 7, 46, 10, 5), {"WM": 1, "WN": 2, "NT": 2}, 2),
    (51, "fp16", ConvShape(2, 20, 9, 19, 24, 3), {"WG": 2, "N": 0}, 5),
    (51, "bf16", ConvShape(3, 64, 6, 12, 64, 3), {"WG": 1, "N": 0}, 4),
    (51, "fp16", ConvShape(1, 8, 7, 46, 10, 4), {"WG": 2, "N": 16}, 2),
    (51, "fp16", ConvShape(2, 40, 5, 9, 50, 1), {"WG": 1, "N": 0}, 3),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("rung,mode,shape,params,blocks", EMULATED)
def test_kernel_emulated_on_cpu(rung: int, mode: str, shape: ConvShape, params: dict[str, int],
                                blocks: int, tmp_path: Path, rng: np.random.Generator) -> None:
    if rung == 50:
        plan = direct_conv.launch_plan(shape, mode, params, sms=blocks)
        rows, stride = 16 * plan.defines["DC_MT"], plan.stage_stride
        flags = [f"-DEMU_K={shape.K}", *define_flags(plan.defines)]
    else:
        plan = direct_wgmma.launch_plan(shape, mode, params, sms=blocks)
        rows, stride = direct_wgmma.A_ROWS, 0
        flags = [f"-DEMU_K={shape.K}", *define_flags(plan.defines)]
    assert plan.blocks == blocks
    source = emulated_source(direct_conv.KERNEL_FILE if rung == 50 else direct_wgmma.KERNEL_FILE)
    case = make_case(rng, shape)
    packed = np.ascontiguousarray(direct_conv.pack_weights(case.w, mode, rows))
    main = (CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + GEMV_SHIM + DC_SHIM + '#include "kernel.inc"\n'
            + DC_MAIN)
    got, smem = run_fused_emulator(
        tmp_path, main, source, ["-fno-strict-aliasing", *flags],
        {"x.bin": case.x, "w.bin": packed, "b.bin": case.b}, shape.y_shape,
        [str(v) for v in (shape.B, shape.C, shape.H, shape.W, shape.M, plan.blocks,
                          plan.slot_pixels, stride, plan.smem, packed.nbytes)])
    assert smem == plan.smem
    assert rel_l2(got, case.ref) <= TOLERANCE[mode], rel_l2(got, case.ref)
    # against the products of the rounded operands: only the fp32 sums' error is left
    ref = conv_reference(rounded(case.x, mode), rounded(case.w, mode), case.b)
    assert rel_l2(got, ref) <= TOLERANCE["fp32"], rel_l2(got, ref)


# Kernel 52 on the CPU: cuda_emulator's CLUSTER_SHIM (the rank blockIdx.z; both consumer
# warpgroups issue wgmmas, one trailing the other: the second in even ranks, the first in odd
# ones; rank 0 ahead at the cluster barriers; `bars` moved into each block's own shared memory
# by static_shared_in_block, the dynamic shared memory EMU_DYN_PAD bytes after it, so that the
# 1 KB alignment takes some of the slack), LAG_SHIM, and the named barriers: 1 the consumers',
# 2 the pixel workers'. argv: dir, B, C, H, W, M, tiles, chunks, chunks a slice, weight bytes,
# seed. Two launches, each the (tile, image) clusters (or, without a split, the blocks) in a
# fresh random order, every cluster's blocks at once; y_out0.bin, y_out1.bin.
DI_SHIM = r"""
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
"""
DI_MAIN = ASAN_OPTIONS + r"""
#define EMU_NAMED_BARS {1, DI_CONSUMERS}, {2, DI_WORKERS}
""" + CLUSTER_RUN_SHIM + r"""
// the block the host launches (direct_image.threads) is the one the kernel is written for
static_assert(DI_THREADS == EMU_THREADS, "launch and kernel disagree on the block's threads");
static_assert(DI_SPLIT == EMU_CLUSTER, "the cluster is the slices");
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), C = atoi(argv[3]), H = atoi(argv[4]), W = atoi(argv[5]);
  const int M = atoi(argv[6]), tiles = atoi(argv[7]), chunks = atoi(argv[8]);
  const int per_slice = atoi(argv[9]), w_bytes = atoi(argv[10]);
  const size_t n = (size_t)B * M * (H - DI_K + 1) * (W - DI_K + 1);
  float* x = read<float>(dir, "x.bin", (size_t)B * C * H * W);
  unsigned char* w = read<unsigned char>(dir, "w.bin", w_bytes);
  float* bias = read<float>(dir, "b.bin", M);
  float* y = read<float>(dir, "y.bin", n + 64);
  gridDim.x = tiles, gridDim.y = B, gridDim.z = DI_SPLIT;
  run_unit_launches(dir, y, n + 64, tiles * B, 2, atoi(argv[11]), [&](int unit) {
    run_cluster(DI_THREADS, [&](int r) {
      blockIdx.x = unit % tiles, blockIdx.y = unit / tiles, blockIdx.z = r;
      direct_conv_image(x, w, bias, y, C, W, M, chunks, per_slice);
    });
  });
}
"""

IMAGE_EMULATED = [  # (mode, shape, params, slices): C and M off the chunk and tile, widths off 8
    # (rows padded), K = 1 / 3 / 5, both tiles, stages fewer than taps; no split, clusters of 2
    # (the last slice shorter), 3 and 4 slices
    ("fp16", ConvShape(2, 100, 6, 10, 150, 3), {"TM": 128, "STAGES": 2, "SPLIT": 1}, 1),
    ("bf16", ConvShape(1, 130, 4, 9, 40, 1), {"TM": 64, "STAGES": 3, "SPLIT": 2}, 2),
    ("fp16", ConvShape(1, 150, 6, 10, 70, 3), {"TM": 64, "STAGES": 2, "SPLIT": 4}, 3),
    ("fp16", ConvShape(1, 250, 8, 6, 100, 5), {"TM": 128, "STAGES": 4, "SPLIT": 4}, 4),
    ("tf32", ConvShape(2, 70, 6, 10, 150, 3), {"TM": 128, "STAGES": 3, "SPLIT": 2}, 2),
    ("tf32", ConvShape(1, 100, 4, 7, 60, 3), {"TM": 64, "STAGES": 2, "SPLIT": 4}, 4),
    ("bf16", ConvShape(1, 150, 7, 12, 90, 5), {"TM": 128, "STAGES": 3, "SPLIT": 4}, 3),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("mode,shape,params,slices", IMAGE_EMULATED)
def test_kernel_52_emulated_on_cpu(mode: str, shape: ConvShape, params: dict[str, int],
                                   slices: int, tmp_path: Path, rng: np.random.Generator) -> None:
    assert direct_image.supports(shape)
    plan = direct_image.launch_plan(shape, mode, params, sms=132)
    d, tm = plan.defines, plan.defines["DI_TM"]
    assert plan.slices == slices and d.get("DI_SPLIT", 1) == plan.slices
    source, static = static_shared_in_block(emulated_source(direct_image.KERNEL_FILE))
    main = (static + CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + GEMV_SHIM + DI_SHIM + CLUSTER_SHIM
            + MBARRIER_SHIM + WGMMA_SS_SHIM + LAG_SHIM + '#include "kernel.inc"\n' + DI_MAIN)
    dyn = 16 * int(rng.integers(0, 64))  # where dynamic shared memory starts: not on 1 KB
    exe = build_emulator(tmp_path, main, source,
                         [*define_flags(d), f"-DEMU_THREADS={direct_image.threads(tm)}",
                          "-DEMU_RANK=blockIdx.z", f"-DEMU_CLUSTER={plan.slices}",
                          "-DEMU_WG_ISSUERS=2", f"-DEMU_DYN_PAD={dyn}",
                          f"-DEMU_SMEM_BYTES={plan.smem}"])
    case = make_case(rng, shape)
    packed = np.ascontiguousarray(direct_image.pack_weights(case.w, mode, tm))
    n = int(np.prod(shape.y_shape))
    for name, a in (("x", case.x), ("w", packed), ("b", case.b),
                    ("y", np.full(n + SENTINEL, np.nan, np.float32))):
        a.tofile(tmp_path / f"{name}.bin")
    args = (shape.B, shape.C, shape.H, shape.W, shape.M, plan.grid[0],
            direct_image.chunks_of(shape, mode), plan.slice_chunks, packed.nbytes,
            int(rng.integers(2**31)))
    run = subprocess.run([str(exe), str(tmp_path), *map(str, args)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = two_launches(tmp_path, n).reshape(shape.y_shape)  # bit-identical, nothing past y
    assert rel_l2(out, case.ref) <= TOLERANCE[mode], rel_l2(out, case.ref)
    # against the products of the rounded operands: only the fp32 sums' error is left
    ref = conv_reference(rounded(case.x, mode), rounded(case.w, mode), case.b)
    assert rel_l2(out, ref) <= TOLERANCE["fp32"], rel_l2(out, ref)


def rounded(a: np.ndarray, mode: str) -> np.ndarray:
    """fp32 values rounded to the operand type (tf32: nearest, ties away), back in fp32."""
    if mode == "tf32":
        u = np.ascontiguousarray(a, np.float32).view(np.uint32)
        return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    bits = gemv_mma.sixteen_bit(a, mode)
    if mode == "fp16":
        return bits.astype(np.float32)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ------------------------------------------------------------------------------- GPU


def module_of(name: str) -> ModuleType:
    if name.startswith("direct-img-"):
        return direct_image
    return direct_wgmma if name.startswith("direct-wg-") else direct_conv


def fits_rung(name: str, shape: ConvShape, params: dict[str, int]) -> bool:
    try:
        module_of(name).launch_plan(shape, name.split("-")[-1], params, 132)
    except ValueError:  # the rung's refusal: no such tile, or shared memory it lacks
        return False
    return True


def random_shape(name: str, rng: np.random.Generator) -> ConvShape:
    """Kernels 50-51: C, M up to 64, rows up to 300 wide; kernel 52: small images, C and M
    up to 300 (several chunks and tiles)."""
    K = int(rng.integers(1, 6))
    if name.startswith("direct-img-"):
        return ConvShape(int(rng.integers(1, 6)), int(rng.integers(1, 300)),
                         int(rng.integers(K, 17)), int(rng.integers(K, 17)),
                         int(rng.integers(1, 300)), K)
    return ConvShape(int(rng.integers(1, 5)), int(rng.integers(1, 65)), int(rng.integers(K, 40)),
                     int(rng.integers(K, 300)), int(rng.integers(1, 65)), K)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES + IMAGE_NAMES)
def test_every_mode_on_random_shapes(name: str, rng: np.random.Generator) -> None:
    """Fresh shapes the rung supports, at the defaults, then at random points of its space."""
    mode, module = name.split("-")[-1], module_of(name)
    tested = 0
    while tested < 9:
        shape = random_shape(name, rng)
        if not module.supports(shape):
            continue
        params = None
        if tested >= 3:
            params = {k: v[int(rng.integers(len(v)))] for k, v in module.SPACE.items()}
            while not fits_rung(name, shape, params):
                params = {k: v[int(rng.integers(len(v)))] for k, v in module.SPACE.items()}
        tested += 1
        check_two_runs(name, make_case(rng, shape), params, TOLERANCE[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_vgg_conv1_2(name: str, rng: np.random.Generator) -> None:
    case = make_case(rng, CONV1_2.with_batch(2))
    outs = outputs_of_two_runs(name, case)
    assert rel_l2(outs[0], case.ref) <= TOLERANCE[name.split("-")[-1]]


@pytest.mark.gpu
@pytest.mark.parametrize("name", IMAGE_NAMES)
@pytest.mark.parametrize("batch", [3, 32])
def test_kernel_52_on_conv5(name: str, batch: int, rng: np.random.Generator) -> None:
    case = make_case(rng, ConvShape(batch, 512, 16, 16, 512, 3))
    outs = outputs_of_two_runs(name, case)
    assert rel_l2(outs[0], case.ref) <= TOLERANCE[name.split("-")[-1]]
