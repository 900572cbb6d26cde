// Kernel 53: a classifier layer at batch 17-64 on the warpgroup MMA, x converted once by each
// thread-block cluster before the weight stream needs it, then brought like the weights.
//
// What it changes against kernel 49: there each block brings x's chunk in fp32 into every
// stage and converts it in shared memory, so at 64 columns a stage carries 24 KB of x for 32 KB
// of weights, and the 16 row tiles of a k slice each convert the same x. Here the row tiles of
// one slice are a cluster of GC_CLUSTER blocks (which the hardware runs together); before the
// loop each converts 1/GC_CLUSTER of the slice's x chunks into the operand layout (the 128-byte
// swizzle, chunk by chunk) in a global scratch buffer of its cluster, and after one cluster
// barrier a stage is two bulk copies (weights, then x in fp16: 8 KB at 64 columns) and no
// conversion: more stages fit, and the producers do nothing but ask for copies. The weight
// copies of the first GC_STAGES chunks are asked for before the conversion, so the stream
// starts at once; only their x copies wait for the barrier.
//
// Launch: grid (row tiles, k slices), cluster (GC_CLUSTER, 1, 1) along the row tiles, 384
// threads (two consumer warpgroups, as kernel 49; the third converts with them, then one of
// its threads copies), dynamic shared memory GW_STAGES stages plus 1 KB. The layout of a stage
// and the end (gemv_mma.cuh `finish`) are kernel 49's.

#include "cluster.cuh"
#include "gemv_mma.cuh"
#include "mbarrier.cuh"
#include "wgmma_core.cuh"

#ifndef GW_KT
#define GW_KT 1  // k-tiles of 64 a chunk
#endif
#ifndef GW_STAGES
#define GW_STAGES 5
#endif
#ifndef GC_CLUSTER
#define GC_CLUSTER 8  // row tiles sharing a conversion of x (8: the portable cluster)
#endif

#define GW_ROWB 128                              // one operand row of a k-tile: the swizzle span
#define GW_N (8 * TM_NT)                         // wgmma N: batch columns
#define GW_TILE_A (64 * GW_ROWB)                 // one wgmma's A tile of a k-tile
#define GW_A_BYTES (GW_KT * 2 * TM_MT * GW_TILE_A)  // a block's weights a chunk
#define GW_X_BYTES (GW_KT * GW_N * GW_ROWB)      // x's chunk in the operand type
#define GW_STAGE_BYTES (GW_A_BYTES + GW_X_BYTES)
#define GW_THREADS (TM_THREADS + 128)
#define GW_X_PIECES (GW_KT * GW_N * 8)           // 16-byte pieces of x's chunk
#define GC_BATCH 4                               // pieces a thread loads before it stores any

static_assert(TM_WARPS == 8, "two warpgroups");
static_assert(TM_MODE <= 1, "16-bit operands only");
static_assert(GW_X_BYTES % 1024 == 0 || GW_N == 8, "stages stay 1 KB aligned");
static_assert(GW_STAGES >= 2, "a stage in flight while one is read");

#include "gemv_wgmma.cuh"  // gw_mma (this kernel's wgmma): its PTX

__device__ __forceinline__ unsigned gc_pack2(float lo, float hi) {
#if TM_MODE == 0
  const __half2 h = __floats2half2_rn(lo, hi);
#else
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#endif
  return *reinterpret_cast<const unsigned*>(&h);
}

// This block's share of the slice's x: chunks rank, rank + GC_CLUSTER, ... of the slice, piece
// j of k-tile kt, row n stored at j ^ (n mod 8) (zero past B and past K, which is a multiple of
// 8: a piece is all in or all out). GC_BATCH pieces a thread in flight at once.
__device__ __forceinline__ void convert_share(const float* x, uint4* scratch, int B, int K,
                                              int c0, int chunks, int rank) {
  const int mine = (chunks - rank + GC_CLUSTER - 1) / GC_CLUSTER;
  const int total = mine * GW_X_PIECES;
  for (int q0 = threadIdx.x; q0 < total; q0 += GC_BATCH * GW_THREADS) {
    float4 v[GC_BATCH][2];
#pragma unroll
    for (int u = 0; u < GC_BATCH; ++u) {
      const int q = q0 + u * GW_THREADS, p = q % GW_X_PIECES;
      const int c = c0 + rank + GC_CLUSTER * (q / GW_X_PIECES);
      const int n = (p / 8) % GW_N, k = (c * GW_KT + p / (8 * GW_N)) * 64 + 8 * (p % 8);
      v[u][0] = v[u][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (q < total && n < B && k < K) {
        const float4* src = reinterpret_cast<const float4*>(x + (size_t)n * K + k);
        v[u][0] = __ldg(src);
        v[u][1] = __ldg(src + 1);
      }
    }
#pragma unroll
    for (int u = 0; u < GC_BATCH; ++u) {
      const int q = q0 + u * GW_THREADS, p = q % GW_X_PIECES;
      if (q >= total) break;
      const int c = c0 + rank + GC_CLUSTER * (q / GW_X_PIECES);
      const int row = p / 8, n = row % GW_N;
      const float4 a = v[u][0], b = v[u][1];
      scratch[((size_t)c * GW_KT * GW_N + row) * 8 + ((p % 8) ^ (n % 8))] =
          make_uint4(gc_pack2(a.x, a.y), gc_pack2(a.z, a.w), gc_pack2(b.x, b.y),
                     gc_pack2(b.z, b.w));
    }
  }
}

// The conversion's global stores are read next by the bulk copy engine (the async proxy) of
// other blocks: each writer fences its stores into that proxy before the cluster barrier.
__device__ __forceinline__ void proxy_fence_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(GW_THREADS, TM_MINB) __cluster_dims__(GC_CLUSTER, 1, 1)
gemv_wgmma_cluster(const float* __restrict__ x, const unsigned char* __restrict__ w_packed,
                   const float* __restrict__ bias, float* __restrict__ y,
                   float* __restrict__ partial, int* __restrict__ tickets,
                   uint4* __restrict__ scratch, int B, int M, int K, int chunks_total,
                   int slice_chunks) {
  extern __shared__ unsigned char gw_raw[];
  // full[s]: both copies' bytes; empty[s]: both consumer warpgroups done with it
  __shared__ __align__(8) unsigned long long bars[2 * GW_STAGES];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(gw_raw));
  const unsigned ring = (raw + 1023) & ~1023u;  // the swizzle repeats on 1 KB boundaries
  const unsigned full = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  const unsigned empty = full + 8 * GW_STAGES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = warp >> 2;
  const int c0 = blockIdx.y * slice_chunks, chunks = min(chunks_total - c0, slice_chunks);
  // the cluster's x, all k: clusters of the same slice convert it each for themselves
  uint4* x_ops = scratch + (size_t)(blockIdx.x / GC_CLUSTER) * chunks_total * (GW_X_BYTES / 16);
  const unsigned char* x_src = reinterpret_cast<const unsigned char*>(x_ops) +
                               (size_t)c0 * GW_X_BYTES;
  const unsigned char* w_src = w_packed + ((size_t)blockIdx.x * chunks_total + c0) * GW_A_BYTES;
  const bool copier = threadIdx.x == TM_THREADS;

  if (threadIdx.x == 0) {
    for (int s = 0; s < GW_STAGES; ++s) {
      mbar_init(full + 8 * s, 1);   // the copier's expect_tx; the bytes of both copies
      mbar_init(empty + 8 * s, 2);  // one arrival a consumer warpgroup
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers exist before anything arrives on them
  if (copier)
    for (int c = 0; c < GW_STAGES && c < chunks; ++c) {
      mbar_expect_tx(full + 8 * c, GW_STAGE_BYTES);  // x's bytes come after the barrier below
      bulk_copy(ring + c * GW_STAGE_BYTES, w_src + (size_t)c * GW_A_BYTES, GW_A_BYTES,
                full + 8 * c);
    }
  convert_share(x, x_ops, B, K, c0, chunks, blockIdx.x % GC_CLUSTER);
  proxy_fence_global();
  cluster_sync();

  float acc[TM_MT][TM_NT][4];
  clear(acc);
  if (copier) {
    proxy_fence_global();
    for (int c = 0; c < GW_STAGES && c < chunks; ++c)
      bulk_copy(ring + c * GW_STAGE_BYTES + GW_A_BYTES, x_src + (size_t)c * GW_X_BYTES,
                GW_X_BYTES, full + 8 * c);
    for (int c = GW_STAGES; c < chunks; ++c) {
      const int s = c % GW_STAGES;
      const unsigned stage = ring + s * GW_STAGE_BYTES;
      mbar_wait(empty + 8 * s, (c / GW_STAGES - 1) & 1);
      mbar_expect_tx(full + 8 * s, GW_STAGE_BYTES);
      bulk_copy(stage, w_src + (size_t)c * GW_A_BYTES, GW_A_BYTES, full + 8 * s);
      bulk_copy(stage + GW_A_BYTES, x_src + (size_t)c * GW_X_BYTES, GW_X_BYTES, full + 8 * s);
    }
  } else if (threadIdx.x < TM_THREADS) {
    for (int c = 0; c < chunks; ++c) {
      const int s = c % GW_STAGES;
      const unsigned stage = ring + s * GW_STAGE_BYTES;
      mbar_wait(full + 8 * s, (c / GW_STAGES) & 1);
      wg_fence();
#pragma unroll
      for (int kt = 0; kt < GW_KT; ++kt) {
        const unsigned long long db = wg_desc(stage + GW_A_BYTES + kt * GW_N * GW_ROWB);
#pragma unroll
        for (int mi = 0; mi < TM_MT; ++mi) {
          const unsigned long long da =
              wg_desc(stage + (kt * 2 * TM_MT + group * TM_MT + mi) * GW_TILE_A);
#pragma unroll
          for (int ks = 0; ks < GW_ROWB / 32; ++ks)  // k16 steps: 32 bytes along the row
            gw_mma(acc[mi], wg_desc_add(da, 32 * ks), wg_desc_add(db, 32 * ks));
        }
      }
      wg_commit();
      wg_wait<0>();  // memory-bound: the stage is free as soon as its wgmmas retire
      if (threadIdx.x % 128 == 0) mbar_arrive(empty + 8 * s);
    }
#pragma unroll
    for (int mi = 0; mi < TM_MT; ++mi) wg_hold(acc[mi]);
  }
  finish(acc, bias, y, partial, tickets, B, M, (blockIdx.x * TM_WARPS + warp) * TM_MT, lane);
}
