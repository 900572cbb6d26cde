// Kernel 54: a classifier layer in TF32 at batch 16-64 on the warpgroup MMA, x copied straight
// into its operand, the k slices of a row tile one thread-block cluster.
//
// What it changes against kernel 48 (mma.sync, the same cluster sum) and kernel 49 (wgmma fed
// by a producer warpgroup, 16-bit only, the split-k sum through global memory and a ticket):
// - in TF32 a chunk of 32 channels of one batch row of x is 128 bytes of fp32: already a row of
//   the wgmma's K-major B operand. The producers copy it by cp.async straight to its place in
//   the 128-byte swizzle (16-byte piece j of row n at j ^ (n mod 8)) and only round it in place
//   (cvt.rna, as the host rounds the weights): no conversion buffer, no second layout;
// - the weights (rounded and packed in the same swizzle at prepare, gpu/gemv_wgmma_cluster.py)
//   come by the bulk copy engine, one run of bytes a chunk;
// - one consumer warpgroup issues m64nNk8 wgmmas (N: the batch rounded up to 16) for the
//   block's GT_MT x 64 rows, releasing each stage as its wgmmas retire;
// - the GT_SPLIT k slices of a row tile are the blocks of one cluster: each parks its tile of
//   sums in its own shared memory, and after one cluster barrier each block adds its share of
//   the tile across the cluster in rank order (the same sum every run), plus the bias.
//
// Launch: grid (GT_SPLIT slices, row tiles), 256 threads (the consumers, then the producer
// warpgroup), dynamic shared memory: 1 KB of alignment slack, the ring of GT_STAGES stages,
// then its 3 GT_STAGES mbarriers. K (x's row length) a multiple of 4.

#include "common.cuh"
#include "cluster.cuh"
#include "mbarrier.cuh"
#include "wgmma_core.cuh"

#ifndef GT_MT
#define GT_MT 1  // 64-row wgmmas a block: its rows are 64 GT_MT
#endif
#ifndef GT_STAGES
#define GT_STAGES 8
#endif
#ifndef GT_SPLIT
#define GT_SPLIT 8  // k slices = blocks of a cluster (8: the portable maximum)
#endif
#ifndef DW_N
#define DW_N 64  // the wgmma's N: batch rows of x a stage, B rounded up to 16
#endif
#define DW_MODE 2  // tf32 operands (direct_wgmma.cuh's wgmma)
#include "direct_wgmma.cuh"

#define GT_ROWB 128                         // a row of a chunk: 32 tf32 values
#define GT_TM (64 * GT_MT)                  // weight rows (output channels) a block
#define GT_A_BYTES (GT_TM * GT_ROWB)        // a block's weights a chunk
#define GT_STAGE_BYTES (GT_A_BYTES + DW_N * GT_ROWB)
#define GT_THREADS 256
#define GT_X_LOADS (DW_N * 8 / 128)          // 16-byte pieces of x's chunk a producer thread
#define GT_SUM_ROW (GT_TM + 4)               // the tile of sums, [column][row]: 4 rows of pad
                                             // keep a warp's 8 rows x 4 column pairs apart

static_assert(GT_SPLIT >= 1 && GT_SPLIT <= 8, "a portable cluster holds at most 8 blocks");
static_assert(GT_STAGES >= 2, "a stage in flight while one is read");
static_assert(DW_N % 16 == 0 && DW_N <= 64, "N: the batch rounded up to 16, at most 64");
static_assert(DW_N * GT_SUM_ROW * 4 <= GT_STAGES * GT_STAGE_BYTES, "the sums fit the ring");

// Chunk c's copies into a stage, counted on `loaded`: the weights (one bulk copy), x's
// DW_N rows of 32 channels from k0 by cp.async into their swizzled places, zero past B.
__device__ __forceinline__ void gt_issue(unsigned char* stage_p, unsigned stage, unsigned loaded,
                                         const unsigned char* w_src, const float* x, int B,
                                         int K, int k0, int ptid) {
  if (ptid == 0) {
    mbar_expect_tx(loaded, GT_A_BYTES);
    bulk_copy(stage, w_src, GT_A_BYTES, loaded);
  }
  unsigned char* xs = stage_p + GT_A_BYTES;
#pragma unroll
  for (int i = 0; i < GT_X_LOADS; ++i) {
    const int q = ptid + 128 * i, n = q / 8, j = q % 8, k = k0 + 4 * j;
    const bool valid = n < B && k < K;
    cp_async16_zfill(xs + n * GT_ROWB + 16 * (j ^ (n % 8)), valid ? x + (size_t)n * K + k : x,
                     valid);
  }
  mbar_arrive_cp_async(loaded);
}

// This thread's pieces of x's chunk, rounded to tf32 in place (the hardware would truncate).
__device__ __forceinline__ void gt_round(unsigned char* stage_p, int ptid) {
  float4* xs = reinterpret_cast<float4*>(stage_p + GT_A_BYTES);
#pragma unroll
  for (int i = 0; i < GT_X_LOADS; ++i) {
    float4 v = xs[ptid + 128 * i];
    v.x = tf32_round(v.x), v.y = tf32_round(v.y), v.z = tf32_round(v.z), v.w = tf32_round(v.w);
    xs[ptid + 128 * i] = v;
  }
}

__device__ __forceinline__ void gt_cluster_sync() {
#if GT_SPLIT > 1
  cluster_sync();
#else
  __syncthreads();
#endif
}

extern "C" __global__ void __launch_bounds__(GT_THREADS, 1)
#if GT_SPLIT > 1
__cluster_dims__(GT_SPLIT, 1, 1)
#endif
gemv_wgmma_tf32(const float* __restrict__ x, const unsigned char* __restrict__ w_packed,
                const float* __restrict__ bias, float* __restrict__ y, int B, int M, int K,
                int chunks_total, int slice_chunks) {
  extern __shared__ __align__(16) unsigned char gt_raw[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(gt_raw));
  const unsigned ring = (raw + 1023) & ~1023u;  // the swizzle repeats on 1 KB boundaries
  unsigned char* ring_p = gt_raw + (ring - raw);
  // loaded[s]: the copies' bytes; full[s]: x rounded; empty[s]: the consumers done with it
  const unsigned loaded = ring + GT_STAGES * GT_STAGE_BYTES;
  const unsigned full = loaded + 8 * GT_STAGES, empty = full + 8 * GT_STAGES;
  const int c0 = blockIdx.x * slice_chunks, chunks = min(chunks_total - c0, slice_chunks);

  if (threadIdx.x == 0) {
    for (int s = 0; s < GT_STAGES; ++s) {
      mbar_init(loaded + 8 * s, 128 + 1);  // the producers' cp.asyncs, the weights' expect_tx
      mbar_init(full + 8 * s, 128);
      mbar_init(empty + 8 * s, 1);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers exist before anything arrives on them

  float d[GT_MT][DW_N / 2];
#pragma unroll
  for (int mi = 0; mi < GT_MT; ++mi)
#pragma unroll
    for (int i = 0; i < DW_N / 2; ++i) d[mi][i] = 0.f;
  if (threadIdx.x >= 128) {
    const int ptid = threadIdx.x - 128;
    const unsigned char* w_src = w_packed + ((size_t)blockIdx.y * chunks_total + c0) * GT_A_BYTES;
    auto issue = [&](int c) {
      const int s = c % GT_STAGES;
      gt_issue(ring_p + s * GT_STAGE_BYTES, ring + s * GT_STAGE_BYTES, loaded + 8 * s,
               w_src + (size_t)c * GT_A_BYTES, x, B, K, (c0 + c) * 32, ptid);
    };
    for (int c = 0; c < GT_STAGES && c < chunks; ++c) issue(c);
    for (int c = 0; c < chunks; ++c) {
      const int s = c % GT_STAGES;
      mbar_wait(loaded + 8 * s, (c / GT_STAGES) & 1);
      gt_round(ring_p + s * GT_STAGE_BYTES, ptid);
      wg_proxy_fence();  // the wgmmas (async proxy) read what these stores wrote
      mbar_arrive(full + 8 * s);
      // Chunk c - 1's stage takes chunk c - 1 + GT_STAGES once the consumers are done with it:
      // after rounding chunk c, so that the consumers never wait on this.
      const int next = c - 1 + GT_STAGES;
      if (c >= 1 && next < chunks) {
        mbar_wait(empty + 8 * ((c - 1) % GT_STAGES), ((c - 1) / GT_STAGES) & 1);
        issue(next);
      }
    }
  } else {
    for (int c = 0; c < chunks; ++c) {
      const int s = c % GT_STAGES;
      const unsigned stage = ring + s * GT_STAGE_BYTES;
      mbar_wait(full + 8 * s, (c / GT_STAGES) & 1);
      wg_fence();
      const unsigned long long db = wg_desc(stage + GT_A_BYTES);
#pragma unroll
      for (int mi = 0; mi < GT_MT; ++mi) {
        const unsigned long long da = wg_desc(stage + mi * 64 * GT_ROWB);
#pragma unroll
        for (int ks = 0; ks < GT_ROWB / 32; ++ks)  // k8 steps: 32 bytes along the row
          dw_mma(d[mi], wg_desc_add(da, 32 * ks), wg_desc_add(db, 32 * ks), 1);
      }
      wg_commit();
      // Memory-bound: a chunk's wgmmas take a fraction of its copy, so none stays in flight
      // across chunks and the stage is free as soon as they retire.
      wg_wait<0>();
      if (threadIdx.x == 0) mbar_arrive(empty + 8 * s);
    }
#pragma unroll
    for (int mi = 0; mi < GT_MT; ++mi)
#pragma unroll
      for (int i = 0; i < DW_N / 2; ++i) WG_HOLD(d[mi][i]);
  }
  __syncthreads();  // every chunk is read: the ring becomes the tile of sums, [column][row]
  float* sums = reinterpret_cast<float*>(ring_p);
  if (threadIdx.x < 128) {
    // d[mi][4j + r]: row 64 mi + 16 w + g + 8 (r / 2), column 8 j + 2 t + r % 2
    const int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mi = 0; mi < GT_MT; ++mi)
#pragma unroll
      for (int i = 0; i < DW_N / 2; ++i)
        sums[(8 * (i / 4) + 2 * t + i % 2) * GT_SUM_ROW + 64 * mi + 16 * w + g + 8 * (i % 4 / 2)] =
            d[mi][i];
  }
  gt_cluster_sync();
  // This block's share of the tile: float4s of rows, B GT_TM / 4 in all.
  constexpr int ROW_QUADS = GT_TM / 4;
  const int quads = B * ROW_QUADS, share = (quads + GT_SPLIT - 1) / GT_SPLIT;
  const int m0 = blockIdx.y * GT_TM, q_end = min(quads, (int)(blockIdx.x + 1) * share);
  for (int q = blockIdx.x * share + threadIdx.x; q < q_end; q += GT_THREADS) {
    const int n = q / ROW_QUADS, r = 4 * (q % ROW_QUADS), m = m0 + r;
    const float4 s = cluster_sum4<GT_SPLIT>(sums + n * GT_SUM_ROW + r);
    float* out = y + (size_t)n * M;
    if (m < M) out[m] = s.x + bias[m];
    if (m + 1 < M) out[m + 1] = s.y + bias[m + 1];
    if (m + 2 < M) out[m + 2] = s.z + bias[m + 2];
    if (m + 3 < M) out[m + 3] = s.w + bias[m + 3];
  }
  gt_cluster_sync();  // no block leaves while another still reads its sums
}
