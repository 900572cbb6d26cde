// The warpgroup MMA's (wgmma, sm_90a) primitives that every wgmma kernel shares: the fence,
// commit and wait of its asynchronous groups, the proxy fence that lets it read what ordinary
// stores wrote to shared memory, and the descriptors of a K-major operand: in the 128-byte
// swizzle (rows of 128 bytes, 8-row groups 1024 bytes apart, the group 1024-byte aligned) or
// without swizzle (core matrices of 8 rows x 16 bytes).
#pragma once

// Keeps the compiler from moving reads or writes of an accumulator register across the
// asynchronous wgmmas that own it (an empty asm that "changes" it).
#define WG_HOLD(x) asm volatile("" : "+f"(x)::"memory")

// WG_HOLD over a set of accumulators d[n][0..3] (after the wait that completes them).
template <int R>
__device__ __forceinline__ void wg_hold(float (&d)[R][4]) {
#pragma unroll
  for (int n = 0; n < R; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) WG_HOLD(d[n][r]);
}

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Shared memory written through the generic proxy (ordinary stores, cp.async) is read by the
// wgmmas through the async proxy: each writing thread fences before the barrier.
__device__ __forceinline__ void wg_proxy_fence() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Descriptor of a K-major operand in the 128-byte swizzle: start address, leading offset
// (unused by this layout, 1 by convention), stride offset 1024 bytes between 8-row groups,
// layout 1 = 128-byte swizzle. Addresses and offsets are stored in 16-byte units.
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// Descriptor of a K-major operand without swizzle: 8 x 16-byte core matrices, each 128
// contiguous bytes; lbo bytes from one to the next along k, sbo bytes to the next 8 rows
// (layout 0).
__device__ __forceinline__ unsigned long long wg_desc_interleaved(unsigned saddr, unsigned lbo,
                                                                  unsigned sbo) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32);
}

// The descriptor `bytes` further on from descriptor d0 (same layout and offsets): the start
// address is the low field in 16-byte units and shared memory ends below 256 KB, so the sum
// never carries out of it. Built once and offset by constants, a loop's descriptors cost one
// uniform add each; built from the address each time, ptxas spent about four.
__device__ __forceinline__ unsigned long long wg_desc_add(unsigned long long d0, unsigned bytes) {
  return d0 + (bytes >> 4);
}
