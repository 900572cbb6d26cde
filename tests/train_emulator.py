"""The training forward kernels on the CPU: kernels 37 and 38 (and 31, 32) compiled with g++
on cuda_emulator's prelude plus what they need beyond it — warp shuffles, and mma.sync done
by the warp's 32 threads exchanging their fragments (the PTX fragment layouts, written out
here once more from the ISA's tables, independently of the kernels' own index arithmetic).
Each CUDA thread is a std::thread; blocks run one after another."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
from cuda_emulator import CUDA_SHIM, READ_SHIM

from convolab.gpu import trainer as tr
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.gpu.resize import resize_taps

GXX = shutil.which("g++")
HEADERS = ("train_mma.cuh", "train_lenet.cuh", "resize.cuh")

# Stands in for common.cuh: what the training kernels take from it.
FAKE_COMMON = r"""
#pragma once
constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
inline float tf32_round(float v) {  // cvt.rna.tf32.f32: nearest, ties away from zero
  return __uint_as_float((__float_as_uint(v) + 0x1000u) & 0xffffe000u);
}
struct MmaFrag { unsigned a[4]; unsigned b[2]; };
MmaFrag mma_frag[32][32];  // [warp][lane]
inline float tf32_of(unsigned u) { return __uint_as_float(u & 0xffffe000u); }
inline float bf16_of(unsigned u, int half) {
  return __uint_as_float(half ? u & 0xffff0000u : u << 16);
}
// D (16x8) += A B; A(r, k), B(k, n) read out of the warp's fragments.
template <class FA, class FB>
inline void mma_emulated(float (&d)[4], int kdim, FA A, FB B) {
  const int l = threadIdx.x % 32, g = l >> 2, t = l & 3;
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
    double s = d[i];
    for (int k = 0; k < kdim; ++k) s += (double)A(r, k) * (double)B(k, n);
    d[i] = (float)s;
  }
}
inline void mma_publish(unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                        unsigned b1) {
  mma_frag[threadIdx.x / 32][threadIdx.x % 32] = {{a0, a1, a2, a3}, {b0, b1}};
  __syncwarp();
}
// m16n8k8 tf32: a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4); b0 (t, g) b1 (t+4, g)
inline void mma_tf32_m16n8k8(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                             unsigned b0, unsigned b1) {
  mma_publish(a0, a1, a2, a3, b0, b1);
  const MmaFrag* f = mma_frag[threadIdx.x / 32];
  mma_emulated(d, 8,
      [&](int r, int k) { return tf32_of(f[(r % 8) * 4 + k % 4].a[(r >= 8) + 2 * (k >= 4)]); },
      [&](int k, int n) { return tf32_of(f[n * 4 + k % 4].b[k >= 4]); });
  __syncwarp();
}
// m16n8k16 bf16: a0 (g, 2t..2t+1) a1 (g+8, ..) a2 (g, 2t+8..) a3 (g+8, 2t+8..);
// b0 (2t..2t+1, g) b1 (2t+8.., g); the lower k in the low half
inline void mma_bf16_m16n8k16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                              unsigned a3, unsigned b0, unsigned b1) {
  mma_publish(a0, a1, a2, a3, b0, b1);
  const MmaFrag* f = mma_frag[threadIdx.x / 32];
  mma_emulated(d, 16,
      [&](int r, int k) {
        return bf16_of(f[(r % 8) * 4 + (k % 8) / 2].a[(r >= 8) + 2 * (k >= 8)], k & 1); },
      [&](int k, int n) { return bf16_of(f[n * 4 + (k % 8) / 2].b[k >= 8], k & 1); });
  __syncwarp();
}
"""

PRELUDE = CUDA_SHIM + r"""
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float fminf(float a, float b) { return std::fmin(a, b); }
Dim3 blockDim;
std::barrier<>* block_bar;
std::barrier<>* warp_bar[32];
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
unsigned shfl_box[32][32];
template <class T> inline T __shfl_xor_sync(unsigned, T v, int off) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  std::memcpy(&shfl_box[w][l], &v, 4);
  __syncwarp();
  T r; std::memcpy(&r, &shfl_box[w][l ^ off], 4);
  __syncwarp();
  return r;
}
#undef __shared__
#define __shared__ static
"""

# main(): argv = folder, blocks, threads; reads the kernel's inputs from folder/NAME.bin and
# writes its outputs back (poisoned by the caller). KERNEL_CALL launches one thread.
MAIN = READ_SHIM + r"""
template <class T> static T* load(const char* dir, const char* name, size_t n) {
  char file[256]; snprintf(file, sizeof file, "%s.bin", name);
  return read<T>(dir, file, n);
}
template <class T> static void save(const char* dir, const char* name, const T* p, size_t n) {
  char path[1024]; snprintf(path, sizeof path, "%s/%s.bin", dir, name);
  FILE* f = fopen(path, "wb");
  fwrite(p, sizeof(T), n, f);
  fclose(f);
}
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int blocks = atoi(argv[2]), threads = atoi(argv[3]);
  KERNEL_ARGS
  gridDim.x = blocks;
  blockDim.x = threads;
  for (int b = 0; b < blocks; ++b) {
    std::barrier<> bb(threads);
    block_bar = &bb;
    for (int w = 0; w < threads / 32; ++w) warp_bar[w] = new std::barrier<>(32);
    std::vector<std::thread> ts;
    for (int i = 0; i < threads; ++i)
      ts.emplace_back([=] { threadIdx.x = i; blockIdx.x = b; KERNEL_CALL; });
    for (auto& t : ts) t.join();
    for (int w = 0; w < threads / 32; ++w) delete warp_bar[w];
  }
  KERNEL_SAVE
}
"""

CONV1 = {  # rungs 31 / 37: raw bytes in, pooled maps and argmax bytes out
    "args": """const int n_raw = atoi(argv[4]);
  auto raw = load<unsigned char>(dir, "raw", (size_t)n_raw * RAW_H * RAW_W);
  auto index = load<long long>(dir, "index", blocks);
  auto taps = load<ResizeTap>(dir, "taps", 2 * IN_S);
  auto salt = load<unsigned>(dir, "salt", 1);
  auto w1 = load<float>(dir, "w1", C1_W);
  auto b1 = load<float>(dir, "b1", C1_M);
  auto pool1 = load<float>(dir, "pool1", (size_t)blocks * POOL1);
  auto arg1 = load<unsigned char>(dir, "arg1", (size_t)blocks * POOL1);""",
    "save": """save(dir, "pool1", pool1, (size_t)blocks * POOL1);
  save(dir, "arg1", arg1, (size_t)blocks * POOL1);""",
    "call": "KERNEL(raw, index, taps, salt, w1, b1, pool1, arg1)",
}
CONV2 = {  # rungs 32 / 38: pooled maps in, features and argmax bytes out
    "args": """auto pool1 = load<float>(dir, "pool1", (size_t)blocks * POOL1);
  auto w2 = load<float>(dir, "w2", C2_W);
  auto b2 = load<float>(dir, "b2", C2_M);
  auto feat = load<float>(dir, "feat", (size_t)blocks * FEAT);
  auto arg2 = load<unsigned char>(dir, "arg2", (size_t)blocks * FEAT);""",
    "save": """save(dir, "feat", feat, (size_t)blocks * FEAT);
  save(dir, "arg2", arg2, (size_t)blocks * FEAT);""",
    "call": "KERNEL(pool1, w2, b2, feat, arg2)",
}


def build(tmp: Path, filename: str, kernel: str, io: dict[str, str],
          defines: dict[str, int]) -> Path:
    """The emulator binary of one kernel (g++, the trainer's shape defines plus `defines`)."""
    for name in HEADERS:
        (tmp / name).write_text((KERNEL_DIR / name).read_text())
    (tmp / "common.cuh").write_text(FAKE_COMMON)
    main = (MAIN.replace("KERNEL_ARGS", io["args"]).replace("KERNEL_SAVE", io["save"])
            .replace("KERNEL_CALL", io["call"].replace("KERNEL", kernel)))
    (tmp / "emu.cpp").write_text(PRELUDE + f'#include "{filename}"\n' + main)
    (tmp / filename).write_text((KERNEL_DIR / filename).read_text())
    exe = tmp / "emu"
    flags = define_flags({**tr.kernel_defines(), **defines})
    done = subprocess.run([str(GXX), "-std=c++20", "-O1", "-pthread", "-w", "-ffp-contract=off",
                           f"-I{tmp}", *flags, "-o", str(exe), str(tmp / "emu.cpp")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return exe


def run(exe: Path, tmp: Path, blocks: int, threads: int, inputs: dict[str, np.ndarray],
        outputs: dict[str, tuple[tuple[int, ...], np.dtype]], *extra: str
        ) -> dict[str, np.ndarray]:
    """Write the inputs and poisoned outputs, run `blocks` blocks, read the outputs back."""
    for name, value in inputs.items():
        np.ascontiguousarray(value).tofile(tmp / f"{name}.bin")
    for name, (shape, dtype) in outputs.items():
        poison = np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0xAB, dtype)
        poison.tofile(tmp / f"{name}.bin")
    done = subprocess.run([str(exe), str(tmp), str(blocks), str(threads), *extra],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return {name: np.fromfile(tmp / f"{name}.bin", dtype).reshape(shape)
            for name, (shape, dtype) in outputs.items()}


def taps_bytes() -> np.ndarray:
    side = tr.kernel_defines()["IN_S"]
    return resize_taps(tr.RAW_SIDE, tr.RAW_SIDE, side, side)
