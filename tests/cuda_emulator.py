"""The CUDA-on-the-CPU prelude of the kernel emulator tests: a head kernel's source, with this
prelude and a test's own main(), compiles with g++ and runs each block's threads as std::threads
(std::barrier for __syncthreads), so index arithmetic and shared-memory use are checked where
no GPU is. Each test adds what its kernel needs beyond it (warp shuffles, cp.async)."""

CUDA_SHIM = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
thread_local Dim3 threadIdx, blockIdx;
Dim3 gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
template <class T> inline T __ldg(const T* p) { return *p; }
using std::min;
inline float __int_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
#define CONVOLAB_NEG_INF (__int_as_float(0xff800000u))
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
// common.cuh's IEEE maximum (max.NaN.f32): NaN if either operand is NaN.
inline float fmax_nan(float a, float b) { return (a != a || b != b) ? NAN : std::fmax(a, b); }
inline float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
inline float expf(float a) { return std::exp(a); }
"""

# Block-level sync for kernels that also sync warps (the mma emulations' warp_sync), and one
# block's launch: `threads` std::threads with blockIdx.x = blk, each running body().
BLOCK_SHIM = r"""
#include <memory>
std::barrier<>* block_bar;
std::barrier<>* warp_bar[32];
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline void warp_sync() { warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
// A warp's registers, exchanged through memory between two warp barriers (mma fragments,
// shuffles).
struct WarpRegs { unsigned a[32][4], b[32][2]; float v[32]; };
WarpRegs warp_regs[32];
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  const int l = threadIdx.x % 32;
  WarpRegs& R = warp_regs[threadIdx.x / 32];
  R.v[l] = v;
  warp_sync();
  const float r = R.v[l ^ mask];
  warp_sync();
  return r;
}
// A test's input file, 16-byte aligned like cudaMalloc's memory.
template <class T> static T* read(const char* dir, const char* name, size_t n) {
  T* p = static_cast<T*>(std::aligned_alloc(16, ((n * sizeof(T) + 15) / 16) * 16));
  char path[1024]; snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = fopen(path, "rb");
  if (!f || fread(p, sizeof(T), n, f) != n) std::abort();
  fclose(f);
  return p;
}
template <class F> void run_block(int blk, int threads, F body) {
  std::barrier<> bb(threads);
  block_bar = &bb;
  std::vector<std::unique_ptr<std::barrier<>>> wb;
  for (int w = 0; w < threads / 32; ++w) {
    wb.emplace_back(new std::barrier<>(32));
    warp_bar[w] = wb.back().get();
  }
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([=] {
      threadIdx.x = t;
      blockIdx.x = blk;
      body();
    });
  for (auto& t : ts) t.join();
}
"""
