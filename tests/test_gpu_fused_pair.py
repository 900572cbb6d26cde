"""Kernel 47 (gpu/fused_pair.py): the exact forward's first two blocks in one kernel.

CPU: which zoo pairs it takes and why not, its plan against rungs 45 and 46's, its parameter
checks, its source under g++ against the fp64 layers. GPU: its output equals rung 45 writing
records then rung 46 reading them with the same conv2 loop (bit for bit) and the fp64 layers
(fp32's tolerance), for random weights and batch sizes that reuse both slots; FusedLeNet with
`c3.merge = 1` equals its staged pair bit for bit.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from cuda_emulator import (
    BLOCK_SHIM,
    CUDA_SHIM,
    MMA_SHIM,
    WGMMA_SHIM,
    inline_headers,
    run_fused_emulator,
)
from test_gpu_fused_first import ROWPAIR_SHIM
from test_gpu_fused_wgmma import WS_SHIM

from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.errors import InputError
from convolab.gpu import fused_first, fused_pair, fused_wgmma
from convolab.gpu.implicit_gemm import SMEM_LIMIT
from convolab.models import conv_blocks
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape

C1, C3 = (block.shape for block in conv_blocks("eecs498", 1))


def test_takes_eecs498_and_says_why_not_elsewhere() -> None:
    assert fused_pair.pair_why_not(C1, C3) is None
    mx1, mx3 = (block.shape for block in conv_blocks("ece408-mxnet", 1))
    assert "staged records" in fused_pair.pair_why_not(mx1, mx3)  # K = 5: fp32 maps
    assert "pooled output" in fused_pair.pair_why_not(C1, dataclasses.replace(C3, C=8))
    assert "pool" in fused_pair.pair_why_not(C1, C3, pool2=1)
    assert list(fused_pair.compile_jobs()) == ["fused-pair eecs498 (fpair_wgmma_ws)"]


def test_plan_is_rung_45s_conv1_and_rung_46s_conv2() -> None:
    plan = fused_pair.pair_plan(C1, C3)
    c1 = fused_first.first_plan(C1, 2, {}, None, "float32", "3xfp16").defines
    c2 = fused_wgmma.ws_plan(C3, "3xfp16", {"consumers": 2, **fused_pair.LOOP},
                             fused_wgmma.STAGED).defines
    assert plan.defines["FR_WARPS"] == fused_pair.FIRST_WARPS == 8  # rung 45 alone: 4
    assert all(plan.defines[k] == c1[k] for k in ("FF_K", "FF_H", "FF_W", "FR_M"))
    assert all(plan.defines[k] == v for k, v in c2.items() if k != "FWS_STAGED_IN")
    assert plan.threads == 128 * fused_pair.CONSUMERS + 32 * fused_pair.FIRST_WARPS == 512
    one = fused_pair.pair_plan(C1, C3, {"first_wgs": 1})
    assert one.threads == 384 and one.defines["FR_WARPS"] == c1["FR_WARPS"] == 4
    static = fused_first.rp_smem_bytes(C1, c1["FR_TPH"], True)
    record = fused_wgmma.staged_record(c2)["FR_STG_REC"]
    assert plan.smem > 2 * record and plan.smem + static <= SMEM_LIMIT
    assert fused_pair.pair_plan(C1, C3, {"ring": 5, "sum": 2}).defines["FW_RING"] == 5
    with pytest.raises(InputError, match="unknown parameter"):
        fused_pair.pair_plan(C1, C3, {"consumers": 3})
    two = fused_pair.pair_plan(C1, C3, {"first_wgs": 2})
    assert two.threads == 512 and two.defines["FR_WARPS"] == 8
    assert {k: two.defines[k] for k in ("FW_RING", "FW_SUM")} == {"FW_RING": 4, "FW_SUM": 6}
    with pytest.raises(InputError, match="first_wgs"):
        fused_pair.pair_plan(C1, C3, {"first_wgs": 3})


# ---- CPU: the kernel under g++, both roles' wgmmas and barriers emulated --------------------

EMU = CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + ROWPAIR_SHIM + r"""
alignas(1024) unsigned char emu_smem[232448];
#define fw_smem emu_smem
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
""" + WGMMA_SHIM + WS_SHIM + r"""
#include "kernel.inc"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int batch = atoi(argv[2]), grid = atoi(argv[3]), w_e = atoi(argv[4]);
  const float w_unscale = (float)atof(argv[5]);
  const size_t ny = (size_t)batch * FW_M * FW_HP * FW_WP;
  auto* x = read<float>(dir, "x.bin", (size_t)batch * FF_H * FF_W);
  auto* tiles = read<uint4>(dir, "t.bin", FR_B_BYTES / 16);
  auto* bias1 = read<float>(dir, "b1.bin", FR_M + 2);
  auto* wpack = read<uint4>(dir, "w.bin", FW_B_BYTES / 16);
  auto* bias = read<float>(dir, "b.bin", FW_M);
  auto* y = read<float>(dir, "y.bin", ny + 64);
  printf("%d\n", FP_SMEM_BYTES);
  gridDim.x = grid;
  for (int blk = 0; blk < grid; ++blk) {
    std::memset(emu_smem, 0xFF, sizeof emu_smem);  // NaN: what is read unwritten shows
    std::vector<std::unique_ptr<std::barrier<>>> bars;
    for (int g = 0; g < FP_THREADS / 128; ++g) {  // every warpgroup's (both roles' wgmmas)
      bars.emplace_back(new std::barrier<>(128));
      wg_bar[g] = bars.back().get();
    }
    for (int id = 1; id < 6; ++id) {  // conv1's own, then FULL and EMPTY of both slots
      bars.emplace_back(new std::barrier<>(id == 1 ? FR_THREADS : FP_THREADS));
      named_bar[id] = bars.back().get();
    }
    run_block(blk, FP_THREADS, [=] {
      fpair_wgmma_ws(x, tiles, bias1, w_e, wpack, bias, y, batch, w_unscale);
    });
  }
  char path[1024]; snprintf(path, sizeof path, "%s/y_out.bin", dir);
  FILE* f = fopen(path, "wb"); fwrite(y, 4, ny + 64, f); fclose(f);
}
"""

EMULATED = [  # (conv1, conv2 K and M, params, grid): blocks of 1-3 images, both slots reused
    (ConvShape(3, 1, 20, 20, 12, 7), 3, 24, {}, 1),
    (ConvShape(4, 1, 24, 24, 12, 7), 5, 24, {"first_wgs": 1}, 2),
    (ConvShape(3, 1, 22, 22, 8, 6), 3, 16, {"first_wgs": 2, "tails": -1}, 1),
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("case", range(len(EMULATED)))
def test_kernel_emulated_on_cpu(case: int, tmp_path: Path, rng: np.random.Generator) -> None:
    """The kernel's source under g++ (every thread a std::thread, named barriers and wgmmas
    emulated): conv2's pooled maps of conv1's equal the fp64 layers to fp32's tolerance, and
    nothing is written past them."""
    from convolab.gpu import fused_wide
    from convolab.gpu.compile import KERNEL_DIR, define_flags

    first, k2, m2, params, grid = EMULATED[case]
    hp, wp = (first.H - first.K + 1) // 2, (first.W - first.K + 1) // 2
    second = ConvShape(first.B, first.M, hp, wp, m2, k2)
    assert fused_pair.pair_why_not(first, second) is None
    plan = fused_pair.pair_plan(first, second, params)
    x = rng.random((first.B, 1, first.H, first.W), dtype=np.float32)
    w1 = (rng.standard_normal(first.w_shape) * 0.2).astype(np.float32)
    b1 = (rng.standard_normal(first.M) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal(second.w_shape) * 0.1).astype(np.float32)
    b2 = (rng.standard_normal(m2) * 0.1).astype(np.float32)
    tiles, w_e = fused_first.rowpair_wgmma_tiles(w1, True)
    source = inline_headers((KERNEL_DIR / fused_pair.KERNEL_FILE).read_text(), KERNEL_DIR,
                            keep=("common.cuh", "wgmma_core.cuh", "wgmma_rs.cuh",
                                  "mbarrier.cuh", "warp_roles.cuh"))
    source = source.replace("extern __shared__ __align__(16) unsigned char fw_smem[];", "")
    out = (first.B, m2, second.H_out // 2, second.W_out // 2)
    files = {"x.bin": x, "t.bin": tiles, "b1.bin": fused_first.staged_bias(w1, b1),
             "w.bin": fused_wgmma.wgmma_blocks(w2, "3xfp16", bool(plan.defines["FW_TAILS"])),
             "b.bin": b2}
    w_unscale = 2.0 ** -fused_wide.weight_exponent(w2)
    y, smem = run_fused_emulator(tmp_path, EMU, source, define_flags(plan.defines), files, out,
                                 [str(first.B), str(grid), str(w_e), repr(w_unscale)])
    assert smem == plan.smem
    maps = reference_conv_relu_pool(x.astype(np.float64), w1, b1, pool=2)
    ref = reference_conv_relu_pool(maps, w2, b2, pool=2)
    assert rel_l2(y, ref) <= TOLERANCE["fp32"], rel_l2(y, ref)


# ---- GPU ----------------------------------------------------------------------------------


def problem(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    x = rng.random((n, 1, C1.H, C1.W), dtype=np.float32)
    w1 = (rng.standard_normal(C1.w_shape) * 0.2).astype(np.float32)
    b1 = (rng.standard_normal(C1.M) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal(C3.w_shape) * 0.05).astype(np.float32)
    b2 = (rng.standard_normal(C3.M) * 0.1).astype(np.float32)
    return x, w1, b1, w2, b2


@pytest.mark.gpu
@pytest.mark.parametrize("first_wgs", [1, 2])
def test_equals_the_staged_pair_bit_for_bit_and_fp64(first_wgs: int,
                                                     rng: np.random.Generator) -> None:
    import cupy as cp

    loop = fused_pair.LOOP
    for n in (1, 7, int(rng.integers(133, 700))):
        x, w1, b1, w2, b2 = problem(rng, n)
        print(n)
        s1, s3 = dataclasses.replace(C1, B=n), dataclasses.replace(C3, B=n)
        pair = fused_pair.prepare_pair(s1, w1, b1, s3, w2, b2, {"first_wgs": first_wgs})
        assert pair.plan.threads == 128 * (2 + first_wgs)
        y = cp.full((n, *pair.out_tail), cp.nan, cp.float32)  # poisoned: every value written
        pair(cp.asarray(x), y)
        conv2 = fused_wgmma.prepare(s3, cp.asarray(w2), cp.asarray(b2), {"consumers": 2, **loop},
                                    "3xfp16", fused_wgmma.STAGED)
        conv1 = fused_first.prepare(s1, 2, w1, b1, {}, None, "float32", "3xfp16", conv2.staged)
        records = cp.zeros((n, *conv1.out_tail), cp.uint16)
        conv1(cp.asarray(x), records)
        want = cp.full_like(y, cp.nan)
        conv2(records, want)
        got = y.get()
        assert np.isfinite(got).all()
        assert np.array_equal(got, want.get())
        k = min(n, 16)
        maps = reference_conv_relu_pool(x[:k].astype(np.float64), w1, b1, pool=2)
        ref = reference_conv_relu_pool(maps, w2, b2, pool=2)
        assert rel_l2(got[:k], ref) <= TOLERANCE["fp32"]


@pytest.mark.gpu
def test_network_merge_equals_the_staged_pair(rng: np.random.Generator) -> None:
    import cupy as cp
    from test_gpu_network_raw import zoo_params

    from convolab.gpu.network import FusedLeNet

    params = zoo_params("eecs498", int(rng.integers(1 << 30)))
    n = int(rng.integers(150, 500))
    print(n)
    x = cp.asarray(rng.random((n, 1, C1.H, C1.W), dtype=np.float32))
    merged = FusedLeNet(params, mode="exact", model="eecs498", kernel_params={"c3": {"merge": 1}})
    staged = FusedLeNet(params, mode="exact", model="eecs498",
                        kernel_params={"c3": {"merge": -1}})
    runs, _ = merged._plan(n)
    assert getattr(runs[0], "plan", None) is not None
    assert runs[0].plan.threads == 128 * (fused_pair.CONSUMERS + fused_pair.FIRST_WARPS // 4)
    assert np.array_equal(merged(x).get(), staged(x).get())


@pytest.mark.gpu
def test_run_checks_its_arrays(rng: np.random.Generator) -> None:
    import cupy as cp

    x, w1, b1, w2, b2 = problem(rng, 3)
    run = fused_pair.prepare_pair(C1, w1, b1, C3, w2, b2)
    y = cp.empty((3, *run.out_tail), cp.float32)
    with pytest.raises(InputError, match="input must be"):
        run(cp.asarray(x, cp.float16), y)
    with pytest.raises(InputError, match="out must be"):
        run(cp.asarray(x), y[:2])
    with pytest.raises(InputError, match="do not fit"):
        fused_pair.prepare_pair(C1, w1[:, :, :5], b1, C3, w2, b2)
