"""The CUDA-on-the-CPU prelude of the kernel emulator tests: a head kernel's source, with this
prelude and a test's own main(), compiles with g++ and runs each block's threads as std::threads
(std::barrier for __syncthreads), so index arithmetic and shared-memory use are checked where
no GPU is. Each test adds what its kernel needs beyond it (warp shuffles, cp.async). For
thread-block clusters (kernels 49, 52, 54) CLUSTER_SHIM and CLUSTER_RUN_SHIM run a cluster's
blocks at once, each with its own shared memory and barriers, on a schedule that makes ordering
mistakes show; CLUSTER_MBAR_SHIM carries arrivals and multicast copies (TMA_SHIM's boxes) from
one block to another's barriers and memory."""

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

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

# A test's input files (after CUDA_SHIM).
READ_SHIM = r"""
// A test's input file, 16-byte aligned like cudaMalloc's memory.
template <class T> static T* read(const char* dir, const char* name, size_t n) {
  T* p = static_cast<T*>(std::aligned_alloc(16, ((n * sizeof(T) + 15) / 16) * 16));
  char path[1024]; snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = fopen(path, "rb");
  if (!f || fread(p, sizeof(T), n, f) != n) std::abort();
  fclose(f);
  return p;
}
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
""" + READ_SHIM + r"""template <class F> void run_block(int blk, int threads, F body) {
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

# Vector types, fp16 / bf16 / tf32 conversions, cp.async as copies, and mma.sync (m16n8k16 fp16 and
# bf16, m16n8k8 tf32) from the PTX fragment layouts, summed in fp64: what common.cuh's PTX does,
# for the tensor-core kernels (needs BLOCK_SHIM before it).
MMA_SHIM = r"""
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
typedef _Float16 __half;
inline __half __float2half_rn(float f) { return (__half)f; }
inline float __half2float(__half h) { return (float)h; }
inline unsigned short __half_as_ushort(__half h) {
  unsigned short u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float tf32_round(float v) {
  return __uint_as_float((__float_as_uint(v) + 0x1000u) & 0xFFFFE000u);
}
inline float tf32_split(float& v) {
  const float big = tf32_round(v), small = tf32_round(v - big);
  v = big;
  return small;
}
struct __nv_bfloat162 { unsigned short x, y; };
inline unsigned short bf16_bits(float f) {  // round to nearest even (finite values)
  const unsigned u = __float_as_uint(f);
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {bf16_bits(lo), bf16_bits(hi)};
}
// common.cuh's pack of two values into 16-bit operands (MODE 0 fp16, 1 bf16), low half first
template <int MODE> inline unsigned pack_16bit(float lo, float hi) {
  if constexpr (MODE == 0)
    return __half_as_ushort((__half)lo) | (unsigned)__half_as_ushort((__half)hi) << 16;
  else
    return bf16_bits(lo) | (unsigned)bf16_bits(hi) << 16;
}
inline void cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void cp_async8(void* dst, const void* src, bool) { std::memcpy(dst, src, 8); }
inline void cp_async4(void* dst, const void* src, bool) { std::memcpy(dst, src, 4); }
inline void cp_async_commit() {}
inline void cp_async_wait_all() {}
static double bf16(unsigned bits) { return (double)__uint_as_float((bits & 0xFFFF) << 16); }
static double f16(unsigned bits) {
  const unsigned short s = bits & 0xFFFF;
  _Float16 h;
  std::memcpy(&h, &s, 2);
  return (double)h;
}
// the MMA reads the top 19 bits of a tf32 operand
static double tf32(unsigned bits) { return (double)__uint_as_float(bits & 0xFFFFE000u); }
// d += A B for one warp, from the PTX fragment layouts of m16n8k16 (fp16, bf16) and m16n8k8
// (tf32).
enum Kind { kF16, kBF16, kTF32 };
template <Kind kind>
void emu_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
             unsigned b1) {
  const int l = threadIdx.x % 32;
  WarpRegs& R = warp_regs[threadIdx.x / 32];
  R.a[l][0] = a0; R.a[l][1] = a1; R.a[l][2] = a2; R.a[l][3] = a3; R.b[l][0] = b0; R.b[l][1] = b1;
  warp_sync();
  double A[16][16] = {}, B[16][8] = {};
  for (int ln = 0; ln < 32; ++ln) {
    const int g = ln / 4, t = ln % 4;
    if (kind != kTF32) {
      double (*half)(unsigned) = kind == kF16 ? f16 : bf16;
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = half(R.a[ln][0] >> (16 * h));
        A[g + 8][2 * t + h] = half(R.a[ln][1] >> (16 * h));
        A[g][2 * t + 8 + h] = half(R.a[ln][2] >> (16 * h));
        A[g + 8][2 * t + 8 + h] = half(R.a[ln][3] >> (16 * h));
        B[2 * t + h][g] = half(R.b[ln][0] >> (16 * h));
        B[2 * t + 8 + h][g] = half(R.b[ln][1] >> (16 * h));
      }
    } else {
      A[g][t] = tf32(R.a[ln][0]); A[g + 8][t] = tf32(R.a[ln][1]);
      A[g][t + 4] = tf32(R.a[ln][2]); A[g + 8][t + 4] = tf32(R.a[ln][3]);
      B[t][g] = tf32(R.b[ln][0]); B[t + 4][g] = tf32(R.b[ln][1]);
    }
  }
  const int g = l / 4, t = l % 4;
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r / 2), col = 2 * t + r % 2;
    double s = d[r];
    for (int k = 0; k < (kind == kTF32 ? 8 : 16); ++k) s += A[row][k] * B[k][col];
    d[r] = (float)s;
  }
  warp_sync();
}
inline void mma_f16_m16n8k16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                             unsigned b0, unsigned b1) {
  emu_mma<kF16>(d, a0, a1, a2, a3, b0, b1);
}
inline void mma_bf16_m16n8k16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                              unsigned b0, unsigned b1) {
  emu_mma<kBF16>(d, a0, a1, a2, a3, b0, b1);
}
inline void mma_tf32_m16n8k8(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                             unsigned b0, unsigned b1) {
  emu_mma<kTF32>(d, a0, a1, a2, a3, b0, b1);
}
"""


# What gemv_mma.cuh needs beyond MMA_SHIM (kernels 42, 43, 49): x's fp16 pairs, the cache-hinted
# loads, and the split-k end's fence, ticket and block-wide OR; and the emulators' files and
# launches (needs BLOCK_SHIM before it).
GEMV_SHIM = r"""
#include <atomic>
#include <numeric>
#include <random>
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct __half2 { _Float16 x, y; };
inline __half2 __floats2half2_rn(float a, float b) { return {(_Float16)a, (_Float16)b}; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
std::atomic<int> block_or;
inline bool __syncthreads_or(bool p) {
  if (p) block_or = 1;
  block_bar->arrive_and_wait();
  const bool any = block_or != 0;
  block_bar->arrive_and_wait();
  if (threadIdx.x == 0) block_or = 0;
  block_bar->arrive_and_wait();
  return any;
}
// A GEMV emulator's files in `dir`: x.bin (B x K), w.bin (w_bytes), b.bin, partial.bin (slices
// planes, or `partial_floats`), y.bin (B x M and 64 floats past it), tickets.bin (tiles).
struct GemvIo {
  float *x, *bias, *partial, *y;
  unsigned char* w;
  int* tickets;
  size_t ny;
};
inline GemvIo read_gemv_io(const char* dir, int B, int M, int K, int tiles, int slices,
                           size_t w_bytes, size_t partial_floats = 0) {
  const size_t ny = (size_t)B * M + 64;
  if (!partial_floats) partial_floats = (size_t)slices * B * M;
  return {read<float>(dir, "x.bin", (size_t)B * K), read<float>(dir, "b.bin", M),
          read<float>(dir, "partial.bin", partial_floats), read<float>(dir, "y.bin", ny),
          read<unsigned char>(dir, "w.bin", w_bytes), read<int>(dir, "tickets.bin", tiles), ny};
}
// `launches` launches of `units` units (blocks, or clusters that run at once): y's ny floats
// poisoned with NaN, then unit(u) for every unit in a fresh random order (they finish in any
// order); y_out<i>.bin after each.
template <class F>
void run_unit_launches(const char* dir, float* y, size_t ny, int units, int launches,
                       unsigned seed, F unit) {
  std::mt19937 order_rng(seed);
  std::vector<int> order(units);
  std::iota(order.begin(), order.end(), 0);
  char path[1024];
  for (int launch = 0; launch < launches; ++launch) {
    std::fill(y, y + ny, NAN);
    std::shuffle(order.begin(), order.end(), order_rng);
    for (const int u : order) unit(u);
    snprintf(path, sizeof path, "%s/y_out%d.bin", dir, launch);
    FILE* f = fopen(path, "wb"); fwrite(y, 4, ny, f); fclose(f);
  }
}
// `launches` launches of a (tiles, slices) grid (run_unit_launches, block(bx, by) the unit; with
// `cluster` > 1 the unit is the cluster of row tiles bx .. bx + cluster - 1, which run at once);
// tickets_out.bin at the end.
template <class F>
void run_launches(const char* dir, const GemvIo& io, int tiles, int slices, int launches,
                  unsigned seed, F block, int cluster = 1) {
  if (tiles % cluster) std::abort();
  const int units = tiles / cluster;  // a slice's
  gridDim.x = tiles;
  gridDim.y = slices;
  run_unit_launches(dir, io.y, io.ny, units * slices, launches, seed,
                    [&](int u) { block(cluster * (u % units), u / units); });
  char path[1024];
  snprintf(path, sizeof path, "%s/tickets_out.bin", dir);
  FILE* f = fopen(path, "wb"); fwrite(io.tickets, 4, tiles, f); fclose(f);
}
"""


def inline_headers(source: str, kernel_dir: Path, keep: tuple[str, ...] = ("common.cuh",)) -> str:
    """source with every `#include "x.cuh"` of the kernel folder replaced by that header's text,
    recursively, each header once (they are `#pragma once`); the headers in `keep` are dropped
    instead (the shim stands in for them)."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in keep or name in seen:
                return ""
            seen.add(name)
            return expand((kernel_dir / name).read_text())

        return re.sub(r'#include "([^"]+)"', one, text)

    return expand(source)


# The warpgroup MMA of wgmma_core.cuh / wgmma_rs.cuh (fp16 A from registers, B by a no-swizzle
# K-major descriptor into the emulated shared memory `emu_smem`) with its asynchrony: a thread's
# wgmma is only recorded (its A quad as issued, the addresses of its accumulators, the
# descriptor); wg_commit closes a group; wg_wait<N> runs the oldest committed groups until N
# are left, as late as the hardware may: B is read from shared memory and the accumulators are
# updated then. So a kernel that reads its accumulators, or rewrites the B operand's shared
# memory, before the wait that retires the wgmma gets wrong numbers here, and a wgmma never
# waited for never lands. Running a recorded wgmma: the warpgroup's 128 threads post their A
# quads, meet at a warpgroup barrier, and each computes its own accumulators in fp64 from the
# PTX layouts (needs BLOCK_SHIM and MMA_SHIM before it; the test sets up wg_bar per warpgroup).
# What is not caught: A registers rewritten before the wait (a copy is taken at issue).
WGMMA_SHIM = r"""
extern unsigned char emu_smem[];
std::barrier<>* wg_bar[8];
inline void wg_sync() { wg_bar[threadIdx.x / 128]->arrive_and_wait(); }
struct WgRegs { unsigned a[128][4]; };
WgRegs wg_regs[8];
#define WG_HOLD(x) ((void)0)
template <int R> inline void wg_hold(float (&)[R][4]) {}
inline void wg_fence() {}
inline void wg_proxy_fence() {}
inline unsigned __cvta_generic_to_shared(const void* p) {
  return (unsigned)((const unsigned char*)p - emu_smem);
}
inline unsigned long long wg_desc_interleaved(unsigned saddr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32);
}
inline unsigned long long wg_desc_add(unsigned long long d0, unsigned bytes) {
  return d0 + (bytes >> 4);
}
struct WgOp { float* d; int nr; unsigned a[4]; unsigned long long desc; int scale_d; };
thread_local std::vector<WgOp> wg_pending;               // this thread's, not yet committed
thread_local std::vector<std::vector<WgOp>> wg_groups;  // committed, oldest first
inline void wg_run(const WgOp& op) {
  const int tid = threadIdx.x % 128;
  WgRegs& R = wg_regs[threadIdx.x / 128];
  for (int i = 0; i < 4; ++i) R.a[tid][i] = op.a[i];
  wg_sync();
  const unsigned start = (unsigned)(op.desc & 0x3FFF) << 4;
  const unsigned lbo = (unsigned)((op.desc >> 16) & 0x3FFF) << 4;
  const unsigned sbo = (unsigned)((op.desc >> 32) & 0x3FFF) << 4;
  const int w = tid / 32, l = tid % 32, g = l / 4, t = l % 4;
  double A[2][16];  // this thread's rows g and g + 8 of its warp's 16
  for (int ln = 0; ln < 4; ++ln)
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {
        const unsigned* q = R.a[32 * w + 4 * g + ln];
        A[half][2 * ln + h] = f16(q[half] >> (16 * h));
        A[half][2 * ln + 8 + h] = f16(q[2 + half] >> (16 * h));
      }
  for (int n = 0; n < op.nr; ++n)
    for (int r = 0; r < 4; ++r) {
      const int col = 8 * n + 2 * t + r % 2;
      double s = op.scale_d ? op.d[4 * n + r] : 0.0;
      for (int k = 0; k < 16; ++k) {
        const unsigned at = start + (col / 8) * sbo + (k / 8) * lbo + (col % 8) * 16 + (k % 8) * 2;
        unsigned short bits;
        std::memcpy(&bits, emu_smem + at, 2);
        s += A[r / 2][k] * f16(bits);
      }
      op.d[4 * n + r] = (float)s;
    }
  wg_sync();
}
inline void wg_commit() {
  wg_groups.push_back(std::move(wg_pending));
  wg_pending.clear();
}
template <int N> inline void wg_wait() {
  while ((int)wg_groups.size() > N) {
    for (const WgOp& op : wg_groups.front()) wg_run(op);
    wg_groups.erase(wg_groups.begin());
  }
}
template <int NR>
void wg_mma_rs(float (&d)[NR][4], const unsigned (&a)[4], unsigned long long desc,
               int scale_d) {
  wg_pending.push_back({&d[0][0], NR, {a[0], a[1], a[2], a[3]}, desc, scale_d});
}
"""


# mbarrier.cuh with its semantics (kernels 49, 52, 54), keyed by the barrier's shared address:
# arrivals and transaction bytes pending, then a phase completes; a wait for parity p returns
# once the phase of that parity has completed, and aborts after 20 s (a deadlock: the roles wait
# on one another). Copies land at once. Needs the test's shared_ptr(shared address). Where
# blocks run at once (a cluster's), the test defines EMU_BAR_KEY(bar) before it: the key of a
# barrier of the calling thread's block (by default the shared address alone); emu_arrive(key)
# and emu_complete_tx(key, bytes) are there for arrivals and copies on another block's barriers
# (an unknown key aborts: a barrier not initialised, or its block gone). It may also define
# EMU_PARK_SLOT() (the calling thread's slot, or -1) and EMU_PARKED(slot, d): a thread that has to
# wait is counted, d = 1, as it starts, and d = -1 as the phase it waits for completes (not as
# late as it wakes up).
MBARRIER_SHIM = r"""
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <unordered_map>
#include <vector>
#ifndef EMU_BAR_KEY
#define EMU_BAR_KEY(bar) (bar)
#endif
#ifndef EMU_PARK_SLOT
#define EMU_PARK_SLOT() (-1)
#define EMU_PARKED(slot, d) ((void)0)
#endif
// mbarrier.cuh with its semantics: arrivals and transaction bytes pending, then a phase
// completes; a wait for parity p returns once the phase of that parity has completed.
struct EmuWaiter { int slot; unsigned parity; };
struct EmuBar {
  unsigned count = 0, pending = 0;
  long long tx = 0;
  unsigned phase = 0;
  std::vector<EmuWaiter> waiters;  // counted ones
};
std::mutex bar_mutex;
std::condition_variable bar_cv;
std::unordered_map<unsigned, EmuBar> emu_bars;
inline void bar_settle(EmuBar& b) {
  if (b.pending == 0 && b.tx == 0) {
    ++b.phase;
    b.pending = b.count;
    std::erase_if(b.waiters, [&](const EmuWaiter& w) {
      if ((b.phase & 1) == w.parity) return false;
      EMU_PARKED(w.slot, -1);
      return true;
    });
    bar_cv.notify_all();
  }
}
// The barrier of `key` (with bar_mutex held).
inline EmuBar& emu_bar(unsigned key) {
  const auto it = emu_bars.find(key);
  if (it == emu_bars.end()) {
    fprintf(stderr, "thread %u: no mbarrier of key %#x (not initialised, or its block gone)\n",
            threadIdx.x, key);
    std::abort();
  }
  return it->second;
}
inline void mbar_init(unsigned bar, unsigned count) {
  std::lock_guard<std::mutex> lk(bar_mutex);
  emu_bars[EMU_BAR_KEY(bar)] = EmuBar{count, count, 0, 0};
}
inline void fence_barrier_init() {}
inline void emu_arrive(unsigned key) {
  std::lock_guard<std::mutex> lk(bar_mutex);
  EmuBar& b = emu_bar(key);
  if (b.pending == 0) {
    fprintf(stderr, "thread %u: an arrival on mbarrier of key %#x beyond its count\n",
            threadIdx.x, key);
    std::abort();
  }
  --b.pending;
  bar_settle(b);
}
// A copy's `bytes` landed: they complete on the barrier of `key` (it may run ahead of the
// expect_tx that announces them, as the hardware's count may go below zero).
inline void emu_complete_tx(unsigned key, unsigned bytes) {
  std::lock_guard<std::mutex> lk(bar_mutex);
  EmuBar& b = emu_bar(key);
  b.tx -= bytes;
  bar_settle(b);
}
inline void mbar_arrive(unsigned bar) { emu_arrive(EMU_BAR_KEY(bar)); }
inline void mbar_expect_tx(unsigned bar, unsigned bytes) {
  {
    std::lock_guard<std::mutex> lk(bar_mutex);
    emu_bar(EMU_BAR_KEY(bar)).tx += bytes;
  }
  mbar_arrive(bar);
}
inline void mbar_wait(unsigned bar, unsigned parity) {
  std::unique_lock<std::mutex> lk(bar_mutex);
  EmuBar& b = emu_bar(EMU_BAR_KEY(bar));
  if ((b.phase & 1) == parity) {
    const int slot = EMU_PARK_SLOT();
    if (slot >= 0) {
      EMU_PARKED(slot, 1);
      b.waiters.push_back({slot, parity});
    }
  }
  if (!bar_cv.wait_for(lk, std::chrono::seconds(20),
                       [&] { return (b.phase & 1) != parity; })) {
    fprintf(stderr, "thread %u: no phase of parity %u completes on barrier %u\n", threadIdx.x,
            parity, bar);
    std::abort();  // a deadlock: the roles wait on one another
  }
}
// Copies land at once: a bulk copy then completes its bytes, cp.async's arrival is an arrival.
inline void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  std::memcpy(shared_ptr(dst), src, bytes);
  emu_complete_tx(EMU_BAR_KEY(bar), bytes);
}
inline void cp_async16_zfill(void* dst, const void* src, bool valid) {
  if (valid) std::memcpy(dst, src, 16);
  else std::memset(dst, 0, 16);
}
inline void mbar_arrive_cp_async(unsigned bar) { mbar_arrive(bar); }
"""


# The warpgroup MMA with both operands by descriptor (kernels 49, 51, 52): K-major, layout 1 (the
# 128-byte swizzle), start address and 8-row group stride from the descriptor, the byte at
# logical address L read from L ^ (((L >> 7) & 7) << 4) as the hardware does (a start inside a
# 1024-byte period included); one thread's accumulators of m64nNk16 (d[4j + r]: row 16w + g +
# 8 (r / 2), column 8j + 2t + r % 2), summed in fp64; kind 0 fp16, 1 bf16 (k16), 2 tf32 (k8,
# the low 13 bits of each fp32 dropped). The instruction is one of the whole warpgroup: none of
# its threads goes on before all have issued it, hence a barrier around it. It is recorded, not
# run: wg_commit closes a group and wg_wait<N> runs the oldest committed groups until N are
# left, reading both operands from shared memory then, as late as the hardware may, and the
# warpgroup meets after it (so a release of a stage after the wait follows every one of its
# threads' reads). A kernel that reads its accumulators, or lets a stage be rewritten, before the
# wait that retires its wgmmas gets wrong numbers here; wgmma_core.cuh's wg_commit and wg_wait
# are these (the tests define only its fence, hold and proxy fence). Needs MMA_SHIM's
# f16 / bf16, the test's shared_ptr(shared address) and a std::barrier of 128 threads in
# wgss_bar[] per warpgroup: slot EMU_WGSS_SLOT, by default the warpgroup of the block
# (threadIdx.x / 128); where blocks run at once, the test defines it before this (one slot a
# warpgroup of every block running). EMU_WGSS_ISSUE(slot), if the test defines it, runs on
# each thread as it issues a wgmma (CLUSTER_SHIM's schedule of a block's warpgroups).
WGMMA_SS_SHIM = r"""
#ifndef EMU_WGSS_SLOT
#define EMU_WGSS_SLOT (threadIdx.x / 128)
#endif
#ifndef EMU_WGSS_ISSUE
#define EMU_WGSS_ISSUE(slot) ((void)0)
#endif
std::barrier<>* wgss_bar[16];
inline double wgss_operand(unsigned long long desc, int row, int k, int kind) {
  if (((desc >> 62) & 3) != 1 || ((desc >> 49) & 7) != 0) std::abort();
  const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
  const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
  const unsigned size = kind == 2 ? 4 : 2;  // a tf32 value is fp32's bits
  const unsigned at = start + (row / 8) * sbo + (row % 8) * 128 + size * k;
  unsigned bits = 0;
  std::memcpy(&bits, shared_ptr(at ^ (((at >> 7) & 7) << 4)), size);
  if (kind == 2) {  // the hardware reads a tf32 value's 19 bits: unrounded fp32 is truncated
    bits &= 0xFFFFE000u;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return kind == 0 ? f16(bits) : bf16(bits);
}
// A thread's part of one wgmma, run at the wait that retires it: its accumulators from the
// operands as shared memory holds them then.
struct WgssOp { float* d; int n; unsigned long long da, db; int scale_d, kind; };
inline void wgss_run(const WgssOp& op) {
  const int tid = threadIdx.x % 128, w = tid / 32, g = tid % 32 / 4, t = tid % 4;
  for (int j = 0; j < op.n / 8; ++j)
    for (int r = 0; r < 4; ++r) {
      const int row = 16 * w + g + 8 * (r / 2), col = 8 * j + 2 * t + r % 2;
      double s = op.scale_d ? op.d[4 * j + r] : 0.0;
      for (int k = 0; k < (op.kind == 2 ? 8 : 16); ++k)  // a 32-byte k-step
        s += wgss_operand(op.da, row, k, op.kind) * wgss_operand(op.db, col, k, op.kind);
      op.d[4 * j + r] = (float)s;
    }
}
thread_local std::vector<WgssOp> wgss_pending;               // issued, not yet committed
thread_local std::vector<std::vector<WgssOp>> wgss_groups;  // committed, oldest first
inline void wgss_mma(float* d, int n, unsigned long long da, unsigned long long db, int scale_d,
                     int kind) {
  EMU_WGSS_ISSUE(EMU_WGSS_SLOT);
  wgss_bar[EMU_WGSS_SLOT]->arrive_and_wait();
  wgss_pending.push_back({d, n, da, db, scale_d, kind});
  wgss_bar[EMU_WGSS_SLOT]->arrive_and_wait();
}
inline void wg_commit() {
  wgss_groups.push_back(std::move(wgss_pending));
  wgss_pending.clear();
}
// The oldest groups run until N are left; then the warpgroup meets, so that what any of its
// threads does after the wait (a stage released) follows every one of its threads' reads.
template <int N> inline void wg_wait() {
  bool ran = false;
  while ((int)wgss_groups.size() > N) {
    for (const WgssOp& op : wgss_groups.front()) wgss_run(op);
    wgss_groups.erase(wgss_groups.begin());
    ran = true;
  }
  if (ran) wgss_bar[EMU_WGSS_SLOT]->arrive_and_wait();
}
"""


# Thread-block clusters on the CPU (kernels 49, 52, 54; after CUDA_SHIM, BLOCK_SHIM, MMA_SHIM and
# GEMV_SHIM, before MBARRIER_SHIM and WGMMA_SS_SHIM, whose barrier keys, wgmma slots and hooks it
# sets; CLUSTER_RUN_SHIM after those runs a cluster): the EMU_CLUSTER blocks of a cluster run at
# once, each with its own shared memory (a shared address is the offset into it: the static
# arrays that `static_shared_in_block` moved there in its first EMU_STATIC bytes, the dynamic
# shared memory `emu_smem` EMU_DYN_PAD bytes after them, holding EMU_SMEM_BYTES), block
# barrier (and __syncthreads_or), named barriers (EMU_NAMED_BARS: {id, threads} pairs; bar.sync
# / bar.arrive must name that count), mbarriers (keyed by rank and address, each in the block's
# static or dynamic shared memory) and wgmma barriers (slots: EMU_WG_ISSUERS a block, by rank;
# only its first EMU_WG_ISSUERS warpgroups issue wgmmas). EMU_RANK is the block's rank in its
# cluster as the kernel computes it (blockIdx.x % N with __cluster_dims__(N, 1, 1), .z with
# (1, 1, N)); cluster_rank() returns it. cluster.cuh's address of another block's memory carries
# the rank in its high byte, its load reads that block's memory (16-byte aligned, inside it),
# its barrier spans the cluster's threads; a block reached after all its threads have left
# (emu_present) aborts. setmaxnreg does nothing; a wgmma runs at the wait that retires it
# (WGMMA_SS_SHIM). A thread is parked while it waits on what other threads must do (at a
# barrier until the barrier releases it, on an mbarrier phase until it completes) and for good
# once it has left; the schedules below read these counts, by rank and by wgmma slot.
# Schedules make ordering mistakes show every run rather than now and then:
# - rank 0 runs ahead: the other blocks start, and leave a cluster barrier, only once every
#   thread of rank 0 has reached its next one or left (its memory poisoned: run_cluster), or
#   rank 0 can go no further (every thread parked: it waits on the others), so a block that
#   reaches another's barriers before they are initialised, reads another's sums before they are
#   parked, or leaves while others still read its own, shows;
# - a block's wgmma-issuing warpgroups go in a chain, led by warpgroup rank mod EMU_WG_ISSUERS
#   (with two, the first leads in even ranks, the second in odd ones), each of the others
#   trailing the one before it (g - 1, cyclically): it issues its n-th wgmma only once that one
#   has issued its (n + 1)-th (so has read its n-th's operands) or can go no further (each of
#   its threads parked), so that what the leading warpgroup writes after its last wgmma lands
#   before the trailing one's last reads its operands;
# - with EMU_RANKS_TRAIL defined, the ranks too: a warpgroup of rank r > 0 issues a wgmma only
#   while block r - 1 can go no further (every thread parked), so each block's consumers lag the
#   one before as far as the kernel's waits let them (a block that reuses a stage the others
#   still read, or leaves while they still arrive on its barriers, shows).
# Each of these waits gives up after 2 s (a schedule the kernel's own waits do not allow).
CLUSTER_SHIM = r"""
#include <atomic>
#include <memory>
#if !defined(EMU_RANK) || !defined(EMU_CLUSTER) || !defined(EMU_DYN_PAD) || !defined(EMU_SMEM_BYTES)
#error "CLUSTER_SHIM needs EMU_RANK, EMU_CLUSTER, EMU_DYN_PAD and EMU_SMEM_BYTES"
#endif
#ifndef EMU_STATIC
#define EMU_STATIC 0
#endif
#ifndef EMU_WG_ISSUERS
#define EMU_WG_ISSUERS 1
#endif
#define EMU_DYN ((EMU_STATIC + 15) / 16 * 16 + EMU_DYN_PAD)
#define EMU_BLOCK_BYTES (EMU_DYN + EMU_SMEM_BYTES)
static_assert(EMU_CLUSTER >= 1 && EMU_CLUSTER <= 8 && EMU_WG_ISSUERS * EMU_CLUSTER <= 16);
#include <chrono>
#include <condition_variable>
#include <mutex>
// Parked threads by park id: a rank's wgmma slots, then (EMU_WG_ISSUERS) its other threads.
#define EMU_PARK_IDS (EMU_CLUSTER * (EMU_WG_ISSUERS + 1))
std::atomic<int> rank_parked[EMU_CLUSTER], wg_issued[16], wg_parked[16];
inline void emu_parked(int id, int d) {
  const int n = EMU_WG_ISSUERS, rank = id / (n + 1), g = id % (n + 1);
  rank_parked[rank] += d;
  if (g < n) wg_parked[n * rank + g] += d;
}
// A barrier whose completion unparks every thread it held before any of them goes on: no count
// shows a thread parked that the barrier has already let go.
struct EmuTally { std::atomic<int> at[EMU_PARK_IDS] = {}; };
struct EmuRelease {
  EmuTally* tally;
  void operator()() noexcept {
    for (int id = 0; id < EMU_PARK_IDS; ++id)
      if (const int k = tally->at[id].exchange(0)) emu_parked(id, -k);
  }
};
struct EmuSync {
  EmuTally tally;
  std::barrier<EmuRelease> bar;
  explicit EmuSync(int threads) : bar(threads, EmuRelease{&tally}) {}
  void wait(int park_id) {
    ++tally.at[park_id];
    emu_parked(park_id, 1);
    bar.arrive_and_wait();
  }
};
thread_local unsigned char* tl_smem;   // this block's shared memory
thread_local unsigned char* emu_smem;  // its dynamic shared memory
thread_local EmuSync* tl_block_bar;
unsigned char* cluster_smem[EMU_CLUSTER];
std::atomic<bool> block_gone[EMU_CLUSTER];  // every thread of the block has left
std::atomic<int> block_or_of[EMU_CLUSTER];  // __syncthreads_or's vote
EmuSync* cluster_bar;
EmuSync* named_bar[EMU_CLUSTER][16];
int named_threads[EMU_CLUSTER][16];
int block_threads;  // a block's threads
inline unsigned emu_rank() {
  const unsigned r = EMU_RANK;
  if (r >= EMU_CLUSTER || cluster_smem[r] != tl_smem) std::abort();
  return r;
}
inline unsigned cluster_rank() { return emu_rank(); }
// `rank`, a block of the cluster whose threads have not all left, which `what` reaches.
inline unsigned emu_present(unsigned rank, const char* what) {
  if (rank < EMU_CLUSTER && !block_gone[rank]) return rank;
  fprintf(stderr, "rank %u thread %u: %s block %u of the cluster, which %s\n", emu_rank(),
          threadIdx.x, what, rank, rank < EMU_CLUSTER ? "has left" : "does not exist");
  std::abort();
}
inline unsigned __cvta_generic_to_shared(const void* p) {
  const unsigned char* at = static_cast<const unsigned char*>(p);
  if (at < tl_smem || at > tl_smem + EMU_BLOCK_BYTES) std::abort();  // not this block's
  return (unsigned)(at - tl_smem);
}
inline unsigned char* shared_ptr(unsigned a) {
  if (a >= EMU_BLOCK_BYTES) std::abort();
  return tl_smem + a;
}
// Shared address `a` of block `rank` (a multicast copy writes other blocks' memory too).
inline unsigned char* cluster_shared_ptr(unsigned rank, unsigned a) {
  if (rank >= EMU_CLUSTER || a >= EMU_BLOCK_BYTES) std::abort();
  return cluster_smem[rank] + a;
}
// The key of the mbarrier at shared address `bar` of block `rank`.
inline unsigned emu_bar_key_of(unsigned rank, unsigned bar) {
  if (bar % 8 || bar + 8 > EMU_BLOCK_BYTES || (bar + 8 > EMU_STATIC && bar < EMU_DYN))
    std::abort();
  return rank << 24 | bar;
}
#define EMU_BAR_KEY(bar) emu_bar_key_of(emu_rank(), bar)
inline unsigned emu_wgss_slot() {
  if (threadIdx.x >= 128 * EMU_WG_ISSUERS) std::abort();
  return EMU_WG_ISSUERS * emu_rank() + threadIdx.x / 128;
}
#define EMU_WGSS_SLOT emu_wgss_slot()
inline int emu_park_id() {
  const unsigned n = EMU_WG_ISSUERS, g = threadIdx.x / 128;
  return (int)((n + 1) * emu_rank() + (g < n ? g : n));
}
#define EMU_PARK_SLOT() emu_park_id()
#define EMU_PARKED(slot, d) emu_parked(slot, d)
// Until `ready` or 2 s, 100 us at a time.
template <class F> inline void emu_hold_until(F ready) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!ready() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
}
inline void emu_wgss_issue(unsigned slot) {
  if (threadIdx.x % 128) return;  // the warpgroup's other threads wait for this one at its wgmma
  const int mine = wg_issued[slot].load();
  const unsigned n = EMU_WG_ISSUERS, rank = slot / n, g = slot % n;
  if (g != rank % n) {  // not the block's leading warpgroup: trail the one before it
    const unsigned lead = rank * n + (g + n - 1) % n;
    emu_hold_until([&] { return wg_issued[lead] >= mine + 2 || wg_parked[lead] >= 128; });
  }
#ifdef EMU_RANKS_TRAIL
  if (rank > 0) emu_hold_until([&] { return rank_parked[rank - 1] == block_threads; });
#endif
  wg_issued[slot] = mine + 1;
}
#define EMU_WGSS_ISSUE(slot) emu_wgss_issue(slot)
inline void emu_syncthreads() { tl_block_bar->wait(emu_park_id()); }
#define __syncthreads() emu_syncthreads()
inline bool emu_syncthreads_or(bool p) {
  const unsigned r = emu_rank();
  if (p) block_or_of[r] = 1;
  emu_syncthreads();
  const bool any = block_or_of[r] != 0;
  emu_syncthreads();
  if (threadIdx.x == 0) block_or_of[r] = 0;
  emu_syncthreads();
  return any;
}
#define __syncthreads_or(p) emu_syncthreads_or(p)
inline unsigned cluster_address(const void* p, unsigned rank) {
  if (rank >= EMU_CLUSTER) std::abort();
  return rank << 24 | __cvta_generic_to_shared(p);
}
inline float4 cluster_load4(unsigned addr) {
  const unsigned rank = emu_present(addr >> 24, "a load from"), at = addr & 0xFFFFFFu;
  if (at % 16 || at + 16 > EMU_BLOCK_BYTES) std::abort();
  float4 v;
  std::memcpy(&v, cluster_smem[rank] + at, 16);
  return v;
}
// Rank 0 ahead: lead_reached[k], rank 0's threads that reached their k-th cluster barrier or left
// before it. After barrier k (k = 0: the start) the other ranks' first thread watches rank 0
// (lead_watched[k]) and lets the rest go (lead_go[k]), which sleep meanwhile: hundreds of
// threads polling would starve the ones that they wait for.
std::atomic<int> lead_reached[16], lead_watched[16];
bool lead_go[16];
std::mutex lead_mutex;
std::condition_variable lead_cv;
thread_local int tl_cluster_syncs;  // cluster barriers this thread reached
inline void emu_follow_lead(int k) {
  if (lead_watched[k]++ == 0) {
    emu_hold_until([&] {
      return lead_reached[k + 1] == block_threads || rank_parked[0] == block_threads;
    });
    std::lock_guard<std::mutex> lk(lead_mutex);
    lead_go[k] = true;
    lead_cv.notify_all();
  } else {
    std::unique_lock<std::mutex> lk(lead_mutex);
    lead_cv.wait(lk, [&] { return lead_go[k]; });  // the watcher gives up after 2 s at most
  }
}
inline void cluster_sync() {
  const unsigned r = emu_rank();
  const int k = ++tl_cluster_syncs;
  if (k >= 15) std::abort();
  if (r == 0) ++lead_reached[k];
  cluster_bar->wait(emu_park_id());
  if (r != 0) emu_follow_lead(k);
}
// A thread's end: rank 0's reaches every later cluster barrier; the thread is parked for good.
inline void emu_thread_leaves() {
  if (emu_rank() == 0)
    for (int k = tl_cluster_syncs + 1; k < 16; ++k) ++lead_reached[k];
  emu_parked(emu_park_id(), 1);
}
#define __cluster_dims__(...)
template <int R> inline void set_max_regs_dec() {}
template <int R> inline void set_max_regs_inc() {}
inline EmuSync* emu_named(int id, int threads) {
  const unsigned r = emu_rank();
  if (id < 1 || id > 15 || !named_bar[r][id] || named_threads[r][id] != threads) std::abort();
  return named_bar[r][id];
}
inline void bar_sync(int id, int threads) { emu_named(id, threads)->wait(emu_park_id()); }
inline void bar_arrive(int id, int threads) { (void)emu_named(id, threads)->bar.arrive(); }
#define WG_HOLD(x) ((void)0)
inline void wg_fence() {}
inline void wg_proxy_fence() {}
"""

# After MBARRIER_SHIM: an arriving thread may fall behind the threads its arrival releases, so
# each of the kernel's arrivals is followed by a pause: what a thread writes after its arrival
# lands after the waiters go on (x rounded after `full` is signalled shows).
LAG_SHIM = r"""
inline void emu_arrive_then_lag(unsigned bar) {
  mbar_arrive(bar);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
}
#define mbar_arrive emu_arrive_then_lag
"""

# The tensor copy engine's 2-D box (mbarrier.cuh's tma_load_2d, kernel 49; after MBARRIER_SHIM,
# with the test's shared_ptr): the tensor map is an EmuMap2d of 16-bit values (base, dim0
# innermost, dim1, the box's rows); a box of 64 values (the 128-byte swizzle's span) x rows
# lands with the byte at shared address a stored at a ^ (((a >> 7) & 7) << 4), the 128-byte
# swizzle as the hardware applies it, zeros outside the tensor, and completes its whole box's
# bytes on the barrier.
TMA_SHIM = r"""
struct EmuMap2d { const unsigned short* base; int dim0, dim1, rows; };
inline void tma_acquire(const void*) {}
// The box at (c0, c1) written from shared address `dst` on into the memory `at` gives (a block's
// shared address to a pointer); its bytes.
template <class At> unsigned emu_tma_box(const void* map, int c0, int c1, unsigned dst, At at) {
  const EmuMap2d& m = *static_cast<const EmuMap2d*>(map);
  for (int r = 0; r < m.rows; ++r)
    for (int e = 0; e < 64; ++e) {
      const int k = c0 + e, n = c1 + r;
      const bool in = k >= 0 && k < m.dim0 && n >= 0 && n < m.dim1;
      const unsigned short v = in ? m.base[(size_t)n * m.dim0 + k] : 0;
      const unsigned a = dst + 2 * (64 * r + e);
      std::memcpy(at(a ^ (((a >> 7) & 7) << 4)), &v, 2);
    }
  return m.rows * 128;
}
inline void tma_load_2d(unsigned dst, const void* map, int c0, int c1, unsigned bar) {
  emu_complete_tx(EMU_BAR_KEY(bar), emu_tma_box(map, c0, c1, dst, shared_ptr));
}
"""

# A cluster's mbarrier traffic between its blocks (cluster.cuh's mbar_arrive_remote, kernel 49's
# tma_load_2d_multicast; after CLUSTER_SHIM, MBARRIER_SHIM and TMA_SHIM): an arrival on another
# block's barrier lands on that block's barrier at the same shared address; a multicast box is
# written into each block of the mask at the same shared address and completes its bytes on
# each one's barrier there. A rank outside the cluster, or a block whose threads have all left,
# aborts.
CLUSTER_MBAR_SHIM = r"""
inline void mbar_arrive_remote(unsigned bar, unsigned rank) {
  emu_arrive(emu_bar_key_of(emu_present(rank, "an arrival on"), bar));
}
inline void tma_load_2d_multicast(unsigned dst, const void* map, int c0, int c1, unsigned bar,
                                  unsigned short blocks) {
  if (blocks == 0 || blocks >> EMU_CLUSTER) std::abort();  // no block, or one not in the cluster
  for (unsigned r = 0; r < EMU_CLUSTER; ++r)
    if (blocks >> r & 1) {
      emu_present(r, "a copy into");
      const unsigned bytes = emu_tma_box(map, c0, c1, dst,
                                         [r](unsigned a) { return cluster_shared_ptr(r, a); });
      emu_complete_tx(emu_bar_key_of(r, bar), bytes);
    }
}
"""

# One cluster's run (after CLUSTER_SHIM, MBARRIER_SHIM and WGMMA_SS_SHIM): run_cluster(threads,
# body) runs body(rank) on every thread of each of the EMU_CLUSTER blocks at once (body sets
# blockIdx, EMU_RANK among it, and calls the kernel), each block's barriers fresh (the
# mbarriers of the cluster before forgotten: one used before its init aborts) and its memory
# poisoned with NaN (0xFF) before it runs and again when its last thread leaves (a block that
# has left has no shared memory: a read of it after shows, an arrival on it or a copy into it
# aborts).
CLUSTER_RUN_SHIM = r"""
#ifndef EMU_NAMED_BARS
#define EMU_NAMED_BARS
#endif
template <class F> void run_cluster(int threads, F body) {
  struct { int id, threads; } named[] = {{0, 0}, EMU_NAMED_BARS};
  std::vector<std::vector<unsigned char>> mem(EMU_CLUSTER);
  std::vector<std::unique_ptr<std::barrier<>>> bars;
  std::vector<std::unique_ptr<EmuSync>> syncs;
  std::vector<EmuSync*> block(EMU_CLUSTER);
  std::atomic<int> running[EMU_CLUSTER];
  EmuSync cluster(EMU_CLUSTER * threads);
  cluster_bar = &cluster;
  block_threads = threads;
  std::fill(wgss_bar, wgss_bar + 16, nullptr);
  for (int i = 0; i < 16; ++i) {
    wg_issued[i] = 0, wg_parked[i] = 0;
    lead_reached[i] = 0, lead_watched[i] = 0, lead_go[i] = false;
  }
  {
    std::lock_guard<std::mutex> lk(bar_mutex);
    emu_bars.clear();
  }
  for (int r = 0; r < EMU_CLUSTER; ++r) {
    mem[r].assign(EMU_BLOCK_BYTES, 0xFF);  // NaN in fp16, bf16 and fp32: what nothing wrote shows
    cluster_smem[r] = mem[r].data();
    rank_parked[r] = 0, block_gone[r] = false, block_or_of[r] = 0;
    syncs.emplace_back(new EmuSync(threads));
    block[r] = syncs.back().get();
    for (int g = 0; g < EMU_WG_ISSUERS; ++g) {
      bars.emplace_back(new std::barrier<>(128));
      wgss_bar[EMU_WG_ISSUERS * r + g] = bars.back().get();
    }
    for (int id = 0; id < 16; ++id) named_bar[r][id] = nullptr, named_threads[r][id] = 0;
    for (const auto& n : named)
      if (n.threads) {
        syncs.emplace_back(new EmuSync(n.threads));
        named_bar[r][n.id] = syncs.back().get(), named_threads[r][n.id] = n.threads;
      }
    running[r] = threads;
  }
  std::vector<std::thread> ts;
  for (int r = 0; r < EMU_CLUSTER; ++r)
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, r, t] {
        threadIdx.x = t;
        tl_smem = mem[r].data(), emu_smem = tl_smem + EMU_DYN;
        tl_block_bar = block[r];
        if (r != 0) emu_follow_lead(0);  // rank 0 ahead from the start
        body(r);
        if (--running[r] == 0) {
          block_gone[r] = true;
          std::memset(mem[r].data(), 0xFF, EMU_BLOCK_BYTES);
        }
        emu_thread_leaves();  // after the poison: rank 0's last thread lets the others go on
      });
  for (auto& t : ts) t.join();
}
"""


def static_shared_in_block(source: str) -> tuple[str, str]:
    """`source` with each static `__shared__ __align__(a) T name[n];` made a pointer into the
    running block's own shared memory (CLUSTER_SHIM's tl_smem: blocks that run at once must not
    share one array), the arrays one after another from its start at their alignment; and the
    #define of EMU_STATIC (their bytes) to put before CLUSTER_SHIM."""
    end = "0"

    def one(match: re.Match[str]) -> str:
        nonlocal end
        align, kind, name, count = match.groups()
        at = f"(({end}) + {align} - 1) / {align} * {align}"
        end = f"({at} + sizeof({kind}) * ({count}))"
        return f"{kind}* {name} = reinterpret_cast<{kind}*>(tl_smem + {at});"

    source = re.sub(r"__shared__ __align__\((\d+)\) ((?:\w+ )*?\w+) (\w+)\[([^\]]+)\];", one,
                    source)
    assert "__shared__" not in source, "a static shared array of another form"
    return source, f"#define EMU_STATIC ({end})\n"


@functools.cache
def sanitizer_flags() -> tuple[str, ...]:
    """AddressSanitizer where g++ has it: a read or write past x, the weights, the bias or a
    block's shared memory aborts the emulator."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a.cpp").write_text("int main() {}\n")
        flags = ("-fsanitize=address",)
        build = subprocess.run([str(shutil.which("g++")), *flags, "-o", f"{tmp}/a",
                                f"{tmp}/a.cpp"], capture_output=True, timeout=120)
        return flags if build.returncode == 0 else ()


# AddressSanitizer's options (the inputs are never freed; its verdict within the stderr tail),
# for a main() built with sanitizer_flags().
ASAN_OPTIONS = r"""
extern "C" const char* __asan_default_options() { return "detect_leaks=0:print_legend=0"; }
"""


def build_emulator(tmp_path: Path, main: str, kernel_source: str, flags: list[str]) -> Path:
    """`main` (which includes kernel.inc: kernel_source) built with g++ -O1, the -D `flags` and
    AddressSanitizer where g++ has it; the executable's path."""
    assert "asm" not in kernel_source, "inline PTX the emulator does not know"
    (tmp_path / "kernel.inc").write_text(kernel_source)
    (tmp_path / "emu.cpp").write_text(main)
    exe = tmp_path / "emu"
    build = subprocess.run([str(shutil.which("g++")), "-std=c++20", "-O1", "-fno-strict-aliasing",
                            "-pthread", "-w", *sanitizer_flags(), *flags, "-o", str(exe),
                            str(tmp_path / "emu.cpp")], capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


def two_launches(tmp_path: Path, n: int) -> np.ndarray:
    """The output of an emulator's two launches (run_unit_launches' y_out0.bin, y_out1.bin, each
    n floats and a NaN tail): asserts that they agree bit for bit and that nothing was written
    past the output; returns the first's n floats."""
    ys = [np.fromfile(tmp_path / f"y_out{i}.bin", np.float32) for i in range(2)]
    assert ys[0].size == ys[1].size > n
    assert np.array_equal(ys[0], ys[1], equal_nan=True), "two launches differ"
    assert np.isnan(ys[0][n:]).all(), "wrote past the output"
    return ys[0][:n]

# The main() of the fused conv + pool rungs' emulators (28, 44), after the kernel's source: it
# reads x.bin, w.bin, b.bin and y.bin (args: dir, batch, grid, w_unscale), prints the kernel's
# shared-memory size, runs each block and writes y_out.bin. The test defines EMU_SMEM (the
# array the kernel's dynamic shared memory is), EMU_W_BYTES, EMU_SMEM_BYTES, EMU_KERNEL and
# EMU_BLOCK_SETUP (what a block needs besides run_block's barriers); EMU_THREADS (a block's
# threads) defaults to FW_THREADS, EMU_X_BYTES (an input image's bytes) to C H W elements.
FUSED_MAIN = r"""
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int batch = atoi(argv[2]), grid = atoi(argv[3]);
  const float w_unscale = (float)atof(argv[4]);
#ifndef EMU_X_BYTES  // an input image's bytes
#define EMU_X_BYTES (FW_C * FW_H * FW_W * sizeof(fw_in_t))
#endif
  const size_t nx = (size_t)batch * EMU_X_BYTES / sizeof(fw_in_t);
  const size_t ny = (size_t)batch * FW_M * FW_HP * FW_WP + 64;
  fw_in_t* x = read<fw_in_t>(dir, "x.bin", nx);
  uint4* w = read<uint4>(dir, "w.bin", EMU_W_BYTES / 16);
  float* bias = read<float>(dir, "b.bin", FW_M);
  float* y = read<float>(dir, "y.bin", ny);
  printf("%d\n", EMU_SMEM_BYTES);
  static_assert(EMU_SMEM_BYTES <= (int)sizeof(EMU_SMEM), "emulator shared memory");
  static_assert(FW_THREADS == 32 * FW_WARPS);
#ifndef EMU_THREADS
#define EMU_THREADS FW_THREADS
#endif
  gridDim.x = grid;
  for (int blk = 0; blk < grid; ++blk) {
    std::memset(EMU_SMEM, 0xFF, sizeof EMU_SMEM);  // NaN in fp16 and fp32: unstaged reads show
    EMU_BLOCK_SETUP;
    run_block(blk, EMU_THREADS, [=] { EMU_KERNEL(x, w, bias, y, batch, w_unscale); });
  }
  char path[1024]; snprintf(path, sizeof path, "%s/y_out.bin", dir);
  FILE* f = fopen(path, "wb"); fwrite(y, 4, ny, f); fclose(f);
}
"""
SENTINEL = 64  # floats past the output, which must stay untouched (FUSED_MAIN's 64)


def run_fused_emulator(tmp_path: Path, main: str, kernel_source: str, flags: list[str],
                       files: dict[str, np.ndarray], out_shape: tuple[int, ...],
                       args: list[str]) -> tuple[np.ndarray, int]:
    """Build `main` (which includes kernel.inc: kernel_source) with g++ and the -D flags, write
    the input files, run it with (tmp_path, *args) and return the output (read from y_out.bin,
    NaN-poisoned before, with SENTINEL floats past it that must stay NaN) and the integer the
    program printed first."""
    assert "asm" not in kernel_source, "inline PTX the emulator does not know"
    (tmp_path / "kernel.inc").write_text(kernel_source)
    (tmp_path / "emu.cpp").write_text(main)
    exe = tmp_path / "emu"
    build = subprocess.run([str(shutil.which("g++")), "-std=c++20", "-O1", "-pthread", "-w",
                            *flags, "-o", str(exe), str(tmp_path / "emu.cpp")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    for name, array in files.items():
        array.tofile(tmp_path / name)
    ny = int(np.prod(out_shape))
    np.full(ny + SENTINEL, np.nan, np.float32).tofile(tmp_path / "y.bin")
    run = subprocess.run([str(exe), str(tmp_path), *args], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    y = np.fromfile(tmp_path / "y_out.bin", np.float32)
    assert np.isnan(y[ny:]).all(), "wrote past the output"
    return y[:ny].reshape(out_shape), int(run.stdout.split()[0])


def run_gemv_emulator(exe: Path, tmp_path: Path, case: Any, packed: np.ndarray,
                      sizes: tuple[int, ...], tiles: int, slices: int, seed: int,
                      partial_floats: int | None = None) -> np.ndarray:
    """A GEMV emulator built with GEMV_SHIM's `read_gemv_io` / `run_launches` (argv: dir, B, M,
    K, the kernel's `sizes`, tiles, slices, launches, w bytes, seed): its files written (x, the
    packed weights, b, NaN partials and output), two launches run; asserts that the tickets
    are back to zero, both launches agree and nothing past the output was written. Returns the
    output, shaped as the layer's. `partial_floats`: the partials' size where it is not slices
    planes of the output (kernel 49's parked sums)."""
    shape = case.shape
    packed.tofile(tmp_path / "w.bin")
    for name, a in (("x", case.x), ("b", case.b),
                    ("partial", np.full(partial_floats or slices * shape.B * shape.M, np.nan)),
                    ("y", np.full(shape.B * shape.M + 64, np.nan))):
        np.ascontiguousarray(a, np.float32).tofile(tmp_path / f"{name}.bin")
    np.zeros(tiles, np.int32).tofile(tmp_path / "tickets.bin")
    args = (shape.B, shape.M, shape.C, *sizes, tiles, slices, 2, packed.nbytes, seed)
    run = subprocess.run([str(exe), str(tmp_path), *map(str, args)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (np.fromfile(tmp_path / "tickets_out.bin", np.int32) == 0).all()
    return two_launches(tmp_path, shape.B * shape.M).reshape(shape.y_shape)



def cluster_sum_source() -> str:
    """cluster.cuh's sum over a cluster's blocks (`cluster_sum4`, no PTX of its own): what an
    emulated kernel gets in place of `#include "cluster.cuh"`, after the shims of its
    primitives (cluster_address, cluster_load4, cluster_sync)."""
    from convolab.gpu.compile import KERNEL_DIR

    header = (KERNEL_DIR / "cluster.cuh").read_text()
    found = re.search(r"template <int RANKS>\n__device__ __forceinline__ float4 "
                      r"cluster_sum4\(.*?\n}\n", header, re.DOTALL)
    assert found, "cluster.cuh's cluster_sum4"
    return found.group(0)
