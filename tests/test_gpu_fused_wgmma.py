"""Rung 44 (fused-conv-pool2-wgmma, kernels/44_fused_conv_pool_wgmma.cu): rung 28's fused
conv + bias + ReLU + max-pool on Hopper's warpgroup MMA, fp16 and 3xfp16.

CPU: what the rung takes, its plan (row pitch, blocks an SM, parameters, packed tails), the
weights' packing read back element by element where the descriptors point, and the kernel
source itself compiled with g++ and run with the warpgroup MMA emulated (each wgmma from the
PTX layouts of its register A and descriptor B), so its indexing is checked where no GPU is.
GPU: random shapes and the zoo's conv2 against the fp64 reference on poisoned outputs, a wide
dynamic range per image (3xfp16), every tunable parameter, NaN, and the registry entries.
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
    FUSED_MAIN,
    MMA_SHIM,
    WGMMA_SHIM,
    inline_headers,
    run_fused_emulator,
)
from test_gpu_fused_wide import (
    check_each_image,
    check_result,
    output_of,
    problem,
    wide_blocks,
    wide_range_problem,
)

from convolab.check import rel_l2
from convolab.conv_cpu import reference_conv_relu_pool
from convolab.errors import InputError
from convolab.gpu import fused_wgmma, fused_wide
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.gpu.device import SM_SMEM_BYTES
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape

PRECISIONS = tuple(fused_wgmma.PRECISIONS)
GXX = shutil.which("g++")
EECS498_CONV2 = ConvShape(1, 12, 29, 29, 24, 7)


def random_shape(rng: np.random.Generator, precision: str) -> ConvShape:
    """Pool-2 layers around the zoo's conv2: C 4-16, M 1-32 (n-tiles 1-4), K 3/5/7, odd sizes
    and batches."""
    while True:
        K = int(rng.choice([3, 5, 7]))
        side = K - 1 + 2 * int(rng.integers(2, 14))
        shape = ConvShape(int(rng.integers(1, 6)), int(rng.integers(4, 17)),
                          side + int(rng.integers(0, 2)), side + int(rng.integers(0, 2)),
                          int(rng.integers(1, 33)), K)
        if fused_wgmma.supports(shape, 2, precision):
            return shape


# ---- CPU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_zoo_wide_layers_are_taken(precision: str) -> None:
    for shape, pool in wide_blocks():
        assert fused_wgmma.why_not(shape, pool, precision) is None


def test_what_the_rung_refuses() -> None:
    shape = EECS498_CONV2
    assert "precision" in fused_wgmma.why_not(shape, 2, "tf32")
    assert "pool" in fused_wgmma.why_not(shape, 4, "fp16")
    assert "M <= 32" in fused_wgmma.why_not(ConvShape(1, 12, 29, 29, 40, 7), 2, "fp16")
    assert "stride" in fused_wgmma.why_not(ConvShape(1, 12, 29, 29, 24, 7, 2), 2, "fp16")
    with pytest.raises(InputError, match="unknown parameter"):
        fused_wgmma.wgmma_plan(shape, "fp16", {"warps": 4})
    with pytest.raises(InputError, match="wgs must be one of"):
        fused_wgmma.wgmma_plan(shape, "fp16", {"wgs": 3})
    with pytest.raises(InputError, match="input dtype"):
        fused_wgmma.wgmma_plan(shape, "fp16", {}, "float64")
    with pytest.raises(InputError, match="must be at least lead"):
        fused_wgmma.wgmma_plan(shape, "3xfp16", {"ring": 4, "lead": 3})


def test_network_takes_the_wide_blocks_unless_given_rung_28_parameters() -> None:
    for shape, pool in wide_blocks(3):
        for precision in PRECISIONS:
            assert fused_wgmma.network_takes(shape, pool, precision, {"wgs": 2})
            assert not fused_wgmma.network_takes(shape, pool, precision, {"warps": 8})
        assert not fused_wgmma.network_takes(shape, pool, "tf32", {})


@pytest.mark.parametrize("precision", PRECISIONS)
def test_default_plan_leaves_room_for_two_blocks(precision: str) -> None:
    """The default pitch is the least conflicted one that still lets an SM hold two blocks
    (one stages while the other computes); an explicit pitch is taken as given."""
    for shape, _ in wide_blocks():
        plan = fused_wgmma.wgmma_plan(shape, precision)
        assert 2 * (plan.smem + 1024) <= SM_SMEM_BYTES
        pitch = plan.defines["FW_WS"]
        cost = fused_wide.load_cost(shape, 2, precision, 1, pitch)
        for other in range(shape.W, shape.W + fused_wide.MAX_PITCH_PAD + 1):
            if 2 * (fused_wgmma.smem_bytes(shape, precision, other) + 1024) <= SM_SMEM_BYTES:
                assert cost <= fused_wide.load_cost(shape, 2, precision, 1, other)
        wide = fused_wgmma.wgmma_plan(shape, precision, {"pitch": shape.W + 6, "wgs": 2})
        assert wide.defines["FW_WS"] == shape.W + 6 and wide.threads == 256


@pytest.mark.parametrize("tails", [False, True])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_packed_weights_read_back_as_wgmma_reads_them(precision: str, tails: bool,
                                                      rng: np.random.Generator) -> None:
    """Every weight where the kernel's descriptors point wgmma: part `part` (3xfp16: lo, hi) of
    block b, core matrix (8 channels x 8 k, 128 bytes) 2 (n // 8) + kk // 8 of it, row n % 8,
    element kk % 8. Block b: chunk j of filter row p at j K + K - 1 - p; with tails, packed tail
    chunk c at JM K + c, its element e the element e % T of row e // T's tail."""
    while True:
        M, C, K = int(rng.integers(1, 33)), int(rng.integers(1, 17)), int(rng.choice([3, 5, 7]))
        cs, ch, chunks = fused_wide.run_layout(C, K, precision)
        if not tails or (K * cs >= ch and K * cs % ch):
            break
    w = rng.standard_normal((M, C, K, K)).astype(np.float32)
    packed = fused_wgmma.wgmma_blocks(w, precision, tails)
    shape = ConvShape(1, C, K, K, M, K)
    main, n_tails = fused_wgmma.chunk_counts(shape, precision, tails)
    nt, parts = -(-M // 8), fused_wide.parts(precision)
    assert packed.nbytes == fused_wgmma.weight_bytes(shape, precision, tails)
    scale = 2.0 ** fused_wide.weight_exponent(w) if precision == "3xfp16" else 1.0
    flat = packed.reshape(-1).view(np.float16).astype(np.float64)
    seen = np.zeros(flat.size, bool)
    tail = K * cs - main * ch

    def check(block: int, n: int, kk: int, p: int, r: int) -> None:
        """Element kk of channel n in block `block` holds run element r of filter row p."""
        at = [((block * parts + part) * 2 * nt + 2 * (n // 8) + kk // 8) * 64 + (n % 8) * 8
              + kk % 8 for part in range(parts)]
        tap, c = divmod(r, cs)
        want = w[n, c, p, tap] * scale if n < M and c < C and p < K and tap < K else 0.0
        # fp16 rounding, or half of fp16's subnormal spacing (the last part's)
        rel = 2.0 ** -21 if precision == "3xfp16" else 2.0 ** -11
        assert abs(flat[at].sum() - want) <= max(abs(want) * rel, 2.0 ** -25), (block, n, kk)
        if parts == 2:  # hi is the fp16 nearest the value, lo the rest
            assert flat[at[1]] == np.float16(want)
        seen[at] = True

    for n in range(nt * 8):
        for kk in range(16):
            for j in range(main):
                for p in range(K):
                    check(j * K + K - 1 - p, n, kk, p, j * 16 + kk)
            for c in range(n_tails):
                p, o = divmod(16 * c + kk, tail)
                check(main * K + c, n, kk, p, main * 16 + o)
    assert seen.all(), "slots no block element maps to"
    if tails:
        assert main * K + n_tails < chunks * K  # fewer chunk MMAs than padded runs


def test_tails_are_packed_where_they_save_a_tenth() -> None:
    eecs498, mxnet = EECS498_CONV2, ConvShape(1, 12, 33, 33, 24, 5)
    for precision in PRECISIONS:
        assert fused_wgmma.chunk_counts(eecs498, precision, True) == (5, 2)
        assert fused_wgmma.wgmma_plan(eecs498, precision).defines["FW_TAILS"] == 1
        assert fused_wgmma.wgmma_plan(mxnet, precision).defines["FW_TAILS"] == 0
        assert fused_wgmma.wgmma_plan(eecs498, precision, {"tails": -1}).defines["FW_TAILS"] == 0
        assert fused_wgmma.wgmma_plan(mxnet, precision, {"tails": 1}).defines["FW_TAILS"] == 1
    with pytest.raises(InputError, match="tails=1 needs"):
        fused_wgmma.wgmma_plan(ConvShape(1, 4, 12, 12, 8, 3), "fp16", {"tails": 1})


def test_warp_specialized_plan_and_refusals() -> None:
    """Rung 46: rung 44's loop defines with two consumer warpgroups (three fed staged records),
    one block an SM, two staged images and the raw one in shared memory; it refuses rung 44's
    block-shape parameters and layers whose buffers do not fit."""
    for shape, _ in wide_blocks():
        for precision in PRECISIONS:
            plan = fused_wgmma.ws_plan(shape, precision)
            loop = fused_wgmma.wgmma_plan(shape, precision).defines
            assert plan.threads == 384 and plan.bps == 1 and plan.rung == 46
            assert plan.kernel == (fused_wgmma.WS_KERNEL_FILE, fused_wgmma.WS_KERNEL)
            assert plan.defines == {**{k: v for k, v in loop.items() if k != "FW_MINB"},
                                    "FW_WGS": 2}
            assert plan.smem <= fused_wgmma.SMEM_LIMIT  # (the emulator checks the sum)
            assert fused_wgmma.default_rung(shape, precision) == \
                fused_wgmma.DEFAULT_RUNG[precision]
    shape = EECS498_CONV2
    # fed staged records: three consumers at the loop defines that fit 128 registers
    staged = fused_wgmma.ws_plan(shape, "3xfp16", {}, fused_wgmma.STAGED)
    assert staged.threads == 512 and staged.defines["FW_WGS"] == 3
    assert {k: staged.defines[k] for k in ("FW_RING", "FW_SUM")} == {"FW_RING": 4, "FW_SUM": 6}
    two = fused_wgmma.ws_plan(shape, "3xfp16", {"consumers": 2}, fused_wgmma.STAGED)
    assert two.threads == 384 and two.defines["FW_RING"] == fused_wgmma.DEFAULT_RING["3xfp16"]
    with pytest.raises(InputError, match="consumers must be one of"):
        fused_wgmma.ws_plan(shape, "fp16", {"consumers": 4})
    with pytest.raises(InputError, match="unknown parameter"):
        fused_wgmma.ws_plan(shape, "fp16", {"wgs": 2})
    with pytest.raises(InputError, match="unknown parameter"):
        fused_wgmma.wgmma_plan(shape, "fp16", {"consumers": 3})
    big = ConvShape(1, 16, 30, 30, 32, 5)
    assert fused_wgmma.supports(big, 2, "3xfp16")
    assert "shared memory" in fused_wgmma.ws_why_not(big, 2, "3xfp16")
    assert fused_wgmma.default_rung(big, "3xfp16") == 44
    with pytest.raises(InputError, match="does not take"):
        fused_wgmma.ws_plan(big, "3xfp16")


def test_rung_parameter_and_registry_entries() -> None:
    from convolab.registry import get_impl

    for suffix in ("tc", "3xfp16"):
        ws = get_impl(f"fused-conv-pool2-wgmma-ws-{suffix}")
        assert ws.rung == 46 and ws.kernel_file == fused_wgmma.WS_KERNEL_FILE
        assert set(ws.space) == set(fused_wgmma.WS_SPACE)
        assert get_impl(f"fused-conv-pool2-wgmma-{suffix}").rung == 44
        assert ws.compile_variants() and all(
            v["FW_WGS"] == (3 if v.get("FWS_STAGED_IN") else 2) for v in ws.compile_variants())
    with pytest.raises(InputError, match="rung must be one of"):
        fused_wgmma.prepare(EECS498_CONV2, np.zeros((24, 12, 7, 7), np.float32),
                            np.zeros(24, np.float32), {"rung": 45}, "fp16")


# ---- CPU: the kernel source under g++, the warpgroup MMA emulated ----------------------------

EMU = CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + r"""
alignas(1024) unsigned char emu_smem[232448];
#define fw_smem emu_smem
""" + WGMMA_SHIM + r"""
#include "kernel.inc"
#define EMU_SMEM emu_smem
#define EMU_W_BYTES FW_B_BYTES
#define EMU_SMEM_BYTES FW44_SMEM_BYTES
#define EMU_KERNEL fcp_wgmma
// each warpgroup's barrier, alive while run_block runs the block
#define EMU_BLOCK_SETUP                                  \
  std::vector<std::unique_ptr<std::barrier<>>> wgb;      \
  for (int g = 0; g < FW_WGS; ++g) {                     \
    wgb.emplace_back(new std::barrier<>(128));           \
    wg_bar[g] = wgb.back().get();                        \
  }
""" + FUSED_MAIN
# Rung 46's extra primitives on the CPU: setmaxnreg is nothing, a named barrier a std::barrier
# of its thread count (bar.arrive counts without waiting), and an mbarrier a count of completed
# phases, which a bulk copy (a memcpy) completes at once.
WS_SHIM = r"""
#include <atomic>
template <int R> inline void set_max_regs_dec() {}
template <int R> inline void set_max_regs_inc() {}
std::barrier<>* named_bar[16];
inline void bar_sync(int id, int) { named_bar[id]->arrive_and_wait(); }
inline void bar_arrive(int id, int) { (void)named_bar[id]->arrive(); }
std::atomic<int> emu_mbar_phases[64];  // by the mbarrier's address
inline std::atomic<int>& emu_mbar(unsigned bar) { return emu_mbar_phases[bar / 8 % 64]; }
inline void mbar_init(unsigned bar, unsigned) { emu_mbar(bar) = 0; }
inline void fence_barrier_init() {}
inline void mbar_expect_tx(unsigned, unsigned) {}
inline void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  std::memcpy(emu_smem + dst, src, bytes);
  emu_mbar(bar).fetch_add(1);
}
inline void mbar_wait(unsigned bar, unsigned parity) {
  while ((emu_mbar(bar).load() & 1) == (int)parity) std::this_thread::yield();
}
"""
EMU_WS = CUDA_SHIM + BLOCK_SHIM + MMA_SHIM + r"""
alignas(1024) unsigned char emu_smem[232448];
#define fw_smem emu_smem
""" + WGMMA_SHIM + WS_SHIM + r"""
#include "kernel.inc"
#define EMU_SMEM emu_smem
#define EMU_W_BYTES FW_B_BYTES
#define EMU_SMEM_BYTES FWS_SMEM_BYTES
#define EMU_KERNEL fcp_wgmma_ws
#define EMU_THREADS FWS_THREADS
#if FWS_STAGED_IN
#define EMU_X_BYTES FWS_REC_BYTES
#endif
// the consumer warpgroups' barriers and the named barriers, alive while run_block runs
#define EMU_BLOCK_SETUP                                                  \
  std::vector<std::unique_ptr<std::barrier<>>> wgb;                      \
  for (int g = 0; g < FW_WGS; ++g) {                                     \
    wgb.emplace_back(new std::barrier<>(128));                           \
    wg_bar[g] = wgb.back().get();                                        \
  }                                                                      \
  for (int id = 1; id < 6; ++id) {                                       \
    wgb.emplace_back(new std::barrier<>(id == 1 ? 128 : FWS_THREADS));   \
    named_bar[id] = wgb.back().get();                                    \
  }
""" + FUSED_MAIN


def emulate(tmp_path: Path, shape: ConvShape, precision: str, in_dtype: str, x: np.ndarray,
            w: np.ndarray, b: np.ndarray, params: dict[str, int], grid: int,
            rung: int = 44) -> np.ndarray:
    """Rung 44's (or 46's) output for (x, w, b) run on the CPU (the wgmma's shared-memory and
    register operands as the kernel lays them out)."""
    if rung == 46:
        defines = fused_wgmma.ws_plan(shape, precision, params, in_dtype).defines
        if in_dtype == fused_wgmma.STAGED:
            x = staged_records(x, defines)
        file, main = fused_wgmma.WS_KERNEL_FILE, EMU_WS
        keep = ("common.cuh", "wgmma_core.cuh", "wgmma_rs.cuh", "mbarrier.cuh",
                "warp_roles.cuh")
    else:
        defines = fused_wgmma._plan_defines(shape, precision, params, in_dtype)
        file, main = fused_wgmma.KERNEL_FILE, EMU
        keep = ("common.cuh", "wgmma_core.cuh", "wgmma_rs.cuh")
    source = inline_headers((KERNEL_DIR / file).read_text(), KERNEL_DIR, keep=keep)
    source = source.replace("extern __shared__ __align__(16) unsigned char fw_smem[];", "")
    tails = bool(defines["FW_TAILS"])
    w_unscale = 2.0 ** -fused_wide.weight_exponent(w) if precision == "3xfp16" else 1.0
    files = {"x.bin": np.ascontiguousarray(x, np.uint16 if in_dtype == fused_wgmma.STAGED
                                           else in_dtype),
             "w.bin": fused_wgmma.wgmma_blocks(w, precision, tails),
             "b.bin": b.astype(np.float32)}
    y, smem = run_fused_emulator(tmp_path, main, source, define_flags(defines), files,
                                 (shape.B, shape.M, shape.H_out // 2, shape.W_out // 2),
                                 [str(shape.B), str(grid), repr(w_unscale)])
    if in_dtype == fused_wgmma.STAGED:
        assert smem == fused_wgmma.ws_plan(shape, precision, params, in_dtype).smem
        return y
    size = fused_wgmma.ws_smem_bytes if rung == 46 else fused_wgmma.smem_bytes
    assert smem == size(shape, precision, defines["FW_WS"], in_dtype, tails)
    return y


def staged_records(x: np.ndarray, defines: dict[str, int]) -> np.ndarray:
    """Images (B, C, H, W) as rung 46's staged records (FWS_STAGED_IN), written here
    independently of the kernels: per image e from its largest |x| (rung 44's exponent), hi =
    fp16(x 2^e), lo = fp16(x 2^e - hi), pixel (y, x) channel c at (y WS + x) CS + c of each
    part, zeros elsewhere, e as an int after the two parts."""
    layout = fused_wgmma.staged_record(defines)
    ws, cs, part = layout["FR_STG_WS"], layout["FR_STG_CS"], layout["FR_STG_IMG1"]
    B, C, H, W = x.shape
    out = np.zeros((B, layout["FR_STG_REC"] // 2), np.uint16)
    for i in range(B):
        e = fused_wide.fp16_scale_exponent(float(np.abs(x[i]).max()))
        scaled = x[i].astype(np.float32) * np.float32(2.0 ** e)
        hi = scaled.astype(np.float16)
        lo = (scaled - hi.astype(np.float32)).astype(np.float16)
        at = ((np.arange(H)[:, None] * ws + np.arange(W)[None, :])[None] * cs
              + np.arange(C)[:, None, None])
        out[i, at] = hi.view(np.uint16)
        out[i, part + at] = lo.view(np.uint16)
        out[i, 2 * part:2 * part + 2] = np.array([e], np.int32).view(np.uint16)
    return out


EMULATED = [  # (precision, input, shape, params, grid): small images, padded and packed tails
    ("fp16", "float32", ConvShape(3, 12, 15, 17, 24, 5), {"tails": -1, "wgs": 1}, 2),
    ("fp16", "float16", ConvShape(2, 12, 14, 14, 24, 7), {"tails": 1}, 1),  # two warpgroups
    ("fp16", "float32", ConvShape(2, 9, 13, 13, 19, 3), {"tails": 1, "lead": 1, "ring": 3}, 2),
    ("3xfp16", "float32", ConvShape(3, 12, 15, 17, 24, 5), {"tails": 1}, 2),
    ("3xfp16", "float16", ConvShape(2, 12, 14, 14, 24, 7), {"sum": 1, "wgs": 2}, 1),
    ("3xfp16", "float32", ConvShape(1, 12, 29, 29, 24, 7), {}, 1),  # eecs498's conv2
    ("3xfp16", "float32", ConvShape(2, 7, 12, 11, 32, 5), {"tails": -1, "sum": 6}, 1),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("case", range(len(EMULATED)))
def test_kernel_emulated_on_cpu(case: int, tmp_path: Path, rng: np.random.Generator) -> None:
    precision, in_dtype, shape, params, grid = EMULATED[case]
    x, w, b = problem(rng, shape, in_dtype)
    y = emulate(tmp_path, shape, precision, in_dtype, x, w, b, params, grid)
    check_result(y, x, w, b, 2, precision)


EMULATED_WS = [  # rung 46: (precision, input, shape, params, grid); blocks of 1-4 images, so
    # that both slots are reused; fp16 inputs whose images start off 16-byte granules
    ("3xfp16", "float32", ConvShape(3, 12, 29, 29, 24, 7), {}, 1),  # eecs498's conv2
    ("fp16", "float16", ConvShape(4, 9, 13, 13, 19, 3), {"ring": 3, "lead": 1}, 1),
    ("3xfp16", "float16", ConvShape(3, 7, 12, 11, 32, 5), {"tails": -1, "sum": 6}, 1),
    ("fp16", "float32", ConvShape(3, 12, 15, 17, 24, 5), {"tails": -1}, 2),
    # three consumers: eecs498's 4 m-tiles an image go round them across the block's images
    ("3xfp16", "float32", ConvShape(4, 12, 29, 29, 24, 7), {"consumers": 3}, 1),
    ("fp16", "float16", ConvShape(5, 9, 13, 13, 19, 3), {"consumers": 3}, 2),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("case", range(len(EMULATED_WS)))
def test_warp_specialized_kernel_emulated_on_cpu(case: int, tmp_path: Path,
                                                  rng: np.random.Generator) -> None:
    precision, in_dtype, shape, params, grid = EMULATED_WS[case]
    x, w, b = problem(rng, shape, in_dtype)
    y = emulate(tmp_path, shape, precision, in_dtype, x, w, b, params, grid, rung=46)
    check_result(y, x, w, b, 2, precision)
    if case == 0:  # the same MMAs in the same order as rung 44's, the same scale exponents
        (tmp_path / "44").mkdir()
        y44 = emulate(tmp_path / "44", shape, precision, in_dtype, x, w, b, params, 1)
        assert np.array_equal(y, y44)
    if precision == "3xfp16" and in_dtype == "float32":  # fed the same values as records
        (tmp_path / "staged").mkdir()  # (with as many consumers: the same loop defines)
        consumers = params.get("consumers", fused_wgmma.WS_CONSUMERS)
        ys = emulate(tmp_path / "staged", shape, precision, fused_wgmma.STAGED, x, w, b,
                     {**params, "consumers": consumers}, grid, rung=46)
        assert np.array_equal(ys, y)


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
def test_3xfp16_emulated_on_a_wide_dynamic_range(tmp_path: Path,
                                                 rng: np.random.Generator) -> None:
    shape = ConvShape(3, 12, 14, 15, 24, 5)
    x, w, b = wide_range_problem(rng, shape)
    y = emulate(tmp_path, shape, "3xfp16", "float32", x, w, b, {"tails": 1}, 2)
    check_each_image(y, x, w, 2, "3xfp16")


# ---- GPU -------------------------------------------------------------------------------------


def run_gpu(shape: ConvShape, precision: str, in_dtype: str, x: np.ndarray, w: np.ndarray,
            b: np.ndarray, params: dict[str, int] | None = None) -> np.ndarray:
    import cupy as cp

    run = fused_wgmma.prepare(shape, cp.asarray(w), cp.asarray(b), params or {}, precision,
                              in_dtype)
    return output_of(run, shape, 2, x)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", fused_wide.IN_DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", range(4))
def test_random_shapes(case: int, precision: str, in_dtype: str,
                       rng: np.random.Generator) -> None:
    shape = random_shape(rng, precision)
    x, w, b = problem(rng, shape, in_dtype)
    cs, ch, _ = fused_wide.run_layout(shape.C, shape.K, precision)
    packable = shape.K * cs > ch and shape.K * cs % ch
    params = {"wgs": int(rng.integers(1, 3)),
              "tails": int(rng.choice([-1, 1])) if packable else -1}
    print(shape, params)
    check_result(run_gpu(shape, precision, in_dtype, x, w, b, params), x, w, b, 2, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", fused_wide.IN_DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_zoo_wide_layers(precision: str, in_dtype: str, rng: np.random.Generator) -> None:
    for shape, _ in wide_blocks(37):
        x, w, b = problem(rng, shape, in_dtype)
        check_result(run_gpu(shape, precision, in_dtype, x, w, b), x, w, b, 2, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(3))
def test_3xfp16_on_a_wide_dynamic_range(case: int, rng: np.random.Generator) -> None:
    shape = ([s for s, _ in wide_blocks(5)] + [random_shape(rng, "3xfp16")])[case]
    shape = ConvShape(max(3, shape.B), shape.C, shape.H, shape.W, shape.M, shape.K)
    x, w, b = wide_range_problem(rng, shape)
    check_each_image(run_gpu(shape, "3xfp16", "float32", x, w, b), x, w, 2, "3xfp16")


@pytest.mark.gpu
@pytest.mark.parametrize("params", [{"wgs": 2}, {"wgs": 2, "minb": 1}, {"bps": 1},
                                    {"pitch": 29}, {"pitch": 35}, {"minb": 1, "bps": 2},
                                    {"ring": 4}, {"ring": 6, "wgs": 2}, {"sum": 1},
                                    {"sum": 6, "ring": 3, "lead": 1}, {"lead": 3, "ring": 6},
                                    {"wgs": 1}, {"tails": -1}, {"tails": 1, "sum": 6}])
def test_tunable_parameters_keep_the_result(params: dict[str, int],
                                            rng: np.random.Generator) -> None:
    shape = dataclasses.replace(EECS498_CONV2, B=19)
    x, w, b = problem(rng, shape, "float32")
    for precision in PRECISIONS:
        check_result(run_gpu(shape, precision, "float32", x, w, b, params), x, w, b, 2,
                     precision)


@pytest.mark.gpu
def test_registry_entries_through_forward(rng: np.random.Generator) -> None:
    import cupy as cp

    shape, _ = wide_blocks(5)[0]
    x, w, b = problem(rng, shape, "float32")
    for precision in PRECISIONS:
        impl = fused_wgmma.wgmma_impl(precision)
        y = impl.forward(cp.asarray(x), cp.asarray(w), cp.asarray(b), wgs=2)
        check_result(y.get(), x, w, b, 2, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_nan_stays_in_its_image(precision: str, rng: np.random.Generator) -> None:
    shape = dataclasses.replace(EECS498_CONV2, B=3)
    x, w, b = problem(rng, shape, "float32")
    x[1, 5, shape.H // 2, shape.W // 3] = np.nan
    y = run_gpu(shape, precision, "float32", x, w, b)
    ref = reference_conv_relu_pool(x, w, b, 1, 2)
    assert np.isnan(y[np.isnan(ref)]).all(), "a pool window with a NaN gave a finite value"
    for i in (0, 2):
        assert rel_l2(y[i], ref[i]) <= TOLERANCE[precision]


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", fused_wide.IN_DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_warp_specialized_equals_rung_44_bit_for_bit(precision: str, in_dtype: str,
                                                     rng: np.random.Generator) -> None:
    """Rung 46 runs rung 44's MMAs in rung 44's order on the same staged values: eecs498's conv2
    and a random layer, with a few hundred images so that every block reuses both slots."""
    drawn = random_shape(rng, precision)
    for shape in (dataclasses.replace(EECS498_CONV2, B=300),
                  dataclasses.replace(drawn, B=int(rng.integers(133, 400)))):
        params = {"ring": int(rng.choice([4, 5, 6]))}
        print(shape, params)
        x, w, b = problem(rng, shape, in_dtype)
        y46 = run_gpu(shape, precision, in_dtype, x, w, b, {**params, "rung": 46})
        check_result(y46, x, w, b, 2, precision)
        assert np.array_equal(y46, run_gpu(shape, precision, in_dtype, x, w, b,
                                           {**params, "rung": 44}))


@pytest.mark.gpu
@pytest.mark.parametrize("params", [{"ring": 4}, {"ring": 6, "lead": 3}, {"sum": 1},
                                    {"sum": 6, "ring": 3, "lead": 1}, {"tails": -1},
                                    {"pitch": 29}, {"consumers": 3},
                                    {"consumers": 3, "ring": 3, "lead": 1}])
def test_warp_specialized_parameters_keep_the_result(params: dict[str, int],
                                                     rng: np.random.Generator) -> None:
    shape = dataclasses.replace(EECS498_CONV2, B=277)
    x, w, b = problem(rng, shape, "float32")
    for precision in PRECISIONS:
        check_result(run_gpu(shape, precision, "float32", x, w, b, {**params, "rung": 46}),
                     x, w, b, 2, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["eecs498", "ece408-mxnet"])
def test_staged_handoff_matches_fp64_and_the_float_handoff(model: str,
                                                          rng: np.random.Generator) -> None:
    """The exact forward with conv1 (rung 45) writing rung 46's staged records (`c3.merge = -1`:
    not kernel 47) equals the fp64 forward and the forward through fp32 maps (`c3.staged =
    -1`) to fp32's tolerance; the plans show which handoff each took."""
    import cupy as cp
    from test_gpu_network_raw import zoo_params

    from convolab.conv_cpu import reference_forward
    from convolab.gpu.network import FusedLeNet
    from convolab.models import spec

    params = zoo_params(model, int(rng.integers(1 << 30)))
    n = int(rng.integers(150, 400)) | 1
    size = spec(model).input_size
    x = rng.random((n, 1, size, size), dtype=np.float32)
    staged = FusedLeNet(params, mode="exact", model=model, kernel_params={"c3": {"merge": -1}})
    plain = FusedLeNet(params, mode="exact", model=model, kernel_params={"c3": {"staged": -1}})
    a, p = staged(cp.asarray(x)).get(), plain(cp.asarray(x)).get()
    # taken from conv1's K = 7 (eecs498); mxnet's K = 5 keeps fp32 maps (fused_first.STAGED_MIN_K)
    want = np.uint16 if model == "eecs498" else np.float32
    assert staged._plan(n)[1][1].dtype == want, "the handoff is not the one chosen"
    assert plain._plan(n)[1][1].dtype == np.float32
    print(model, n)
    assert np.isfinite(a).all()
    assert rel_l2(a, p) <= TOLERANCE["fp32"]
    assert rel_l2(a[:64], reference_forward(params, x[:64], model=model)) <= TOLERANCE["fp32"]
