// Kernel 49: a classifier layer at batch 16-64 on the warpgroup MMA, fed by a producer
// warpgroup: the weights by the bulk copy engine, x by cp.async, converted in shared memory.
//
// What it changes against kernel 43: there eight warps issue mma.sync from weight pieces in
// registers, and every warp reads all of x's chunk from shared memory as B fragments (at 64
// columns, 64 KB of shared-memory reads a chunk for 32 KB of weights), after the block has
// converted that chunk from fp32 through registers behind two block barriers a chunk. Here:
// - two warpgroups issue wgmma m64nNk16 with both operands read from shared memory through
//   descriptors (N: the batch rounded up to 8 TM_NT), each k-tile a row of 128 bytes in the
//   128-byte swizzle (16-byte piece j of row r at j ^ (r mod 8));
// - a third warpgroup fills a ring of GW_STAGES stages: one of its threads asks the copy engine
//   for the block's chunk of weights (packed at prepare in that swizzle, one contiguous run,
//   gpu/gemv_wgmma.py), all 128 copy x's chunk in fp32 by cp.async (both land on "loaded"),
//   GW_STAGES chunks ahead; when a chunk has landed they convert its x within shared memory
//   into the swizzled operand and arrive on "full". (Through the producers' registers, one
//   chunk ahead, x cost an L2 round trip a chunk, longer than a chunk's weights: docs/vgg.md,
//   "Kernel 49".)
// - a consumer warpgroup waits on "full", issues the chunk's wgmmas and, once the previous
//   chunk's have retired, releases that chunk's stage on "empty": one chunk of MMAs stays in
//   flight while the next is awaited, and there is no block barrier in the loop.
// GW_X16 = 1 takes x already in the operand type ([B][K], 16-bit, as a library's fp16 GEMM gets
// it): one producer thread then asks the tensor copy engine for x's chunk, a box of 64 k x N
// rows that it writes in the 128-byte swizzle with zeros past B and K, and a stage is complete
// when its copies land (no cp.async, no conversion, no "full" barrier). With x in fp32 the host
// may run `gw_x_to_operand` first, once a call, into a buffer of that type (XPASS in
// gpu/gemv_wgmma.py): the conversion then costs one pass over x, not one per row tile.
// GW_CLUSTER = 2 (with GW_X16): two row tiles of one k slice are a thread-block cluster and
// take turns asking for x's chunk, multicast into both: x's reads from L2 halve (at fc6 B = 64
// x is a third of what the blocks read). A stage is then released on both blocks' "empty"
// barriers, since whichever block copies x next writes into both.
// The packed row order gives warp w of warpgroup g the m-tiles kernel 42 gives warp 4g + w, and
// wgmma's accumulator layout is mma.sync m16n8's, n-tile by n-tile: kernel 42's end applies
// (gemv_mma.cuh `finish_parked`: y, or the split-k sum in slice order from partials parked as
// the threads hold them).
//
// Launch: grid (row tiles, k slices), clusters of GW_CLUSTER row tiles, 384 threads, dynamic
// shared memory GW_STAGES stages plus 1 KB (the ring is aligned to 1 KB, as the swizzle needs).
// fp16 and bf16 only: TF32 weights in 4 bytes would stream 1.6x kernel 43's 2.5-byte ones.

#ifndef GW_TIMELINE
#define GW_TIMELINE 0  // 1: each block's SM and times (benchmarks/block_timeline.py)
#endif
#if GW_TIMELINE
// Per block (linear id, up to 4096): its SM, then %globaltimer (ns) at its start (1), when its
// loop has retired its last wgmma (2), when it leaves (3), and in `finish_parked` (gemv_mma.cuh
// TM_STAMP): its partials stored (4), fenced (5), its ticket taken (6), the sum done (7, the
// last block of a row tile only).
__device__ unsigned long long gw_timeline[4096][8];
__device__ unsigned long long gw_now();  // gemv_wgmma.cuh
#define GW_STAMP(i) gw_timeline[blockIdx.y * gridDim.x + blockIdx.x][i] = gw_now()
#define TM_STAMP(i) \
  if (threadIdx.x == 0) GW_STAMP(i)
#else
#define GW_STAMP(i) ((void)0)
#endif

#include "cluster.cuh"
#include "gemv_mma.cuh"
#include "mbarrier.cuh"
#include "wgmma_core.cuh"

#ifndef GW_KT
#define GW_KT 1  // k-tiles of 64 a chunk
#endif
#ifndef GW_STAGES
#define GW_STAGES 4
#endif
#ifndef GW_X16
#define GW_X16 0
#endif
#ifndef GW_CLUSTER
#define GW_CLUSTER 1  // row tiles a cluster, sharing x's copies (x16 only)
#endif
#ifndef GW_INTERLEAVE
#define GW_INTERLEAVE 0  // 1: weights chunk-major (every row tile's chunk c side by side)
#endif

#define GW_ROWB 128                              // one operand row of a k-tile: the swizzle span
#define GW_N (8 * TM_NT)                         // wgmma N: batch columns
#define GW_TILE_A (64 * GW_ROWB)                 // one wgmma's A tile of a k-tile
#define GW_A_BYTES (GW_KT * 2 * TM_MT * GW_TILE_A)  // a block's weights a chunk
#define GW_X_BYTES (GW_KT * GW_N * GW_ROWB)      // x's chunk
#define GW_RAW_BYTES (GW_X16 ? 0 : GW_KT * 64 * 4 * GW_N)  // x as copied, in fp32
#define GW_STAGE_BYTES (GW_A_BYTES + GW_X_BYTES + GW_RAW_BYTES)

static_assert(TM_WARPS == 8, "two warpgroups");
static_assert(TM_MODE <= 1, "16-bit operands only");
static_assert(GW_X_BYTES % 1024 == 0 || GW_N == 8, "stages stay 1 KB aligned");
static_assert(GW_STAGES >= 2, "a stage in flight while one is read");
static_assert(GW_CLUSTER == 1 || (GW_CLUSTER == 2 && GW_X16), "x shared by 2 row tiles, x16");

#include "gemv_wgmma.cuh"  // gw_mma (this kernel's wgmma) and gw_store16: its PTX

#define GW_THREADS (TM_THREADS + 128)            // the consumers, then the producer warpgroup

#include "gemv_wgmma_x32.cuh"  // x in fp32: issue_chunk, convert_x_chunk, gw_x_to_operand

// GW_X16: chunk c's copies, by one producer thread: the weights, then x's k-tiles as boxes of
// the tensor map `x_map` (k innermost, then rows), each landing in the swizzled operand layout;
// in a cluster only on the block's turn (`x_turn`), into both blocks. Each block expects x's
// bytes every chunk, whoever copies them.
__device__ __forceinline__ void issue_chunk_x16(unsigned stage, unsigned loaded,
                                                const unsigned char* w_src, const void* x_map,
                                                int k0, bool x_turn) {
  mbar_expect_tx(loaded, GW_A_BYTES + GW_X_BYTES);
  bulk_copy(stage, w_src, GW_A_BYTES, loaded);
  if (!x_turn) return;
#pragma unroll
  for (int kt = 0; kt < GW_KT; ++kt) {
    const unsigned at = stage + GW_A_BYTES + kt * GW_N * GW_ROWB;
#if GW_CLUSTER > 1
    tma_load_2d_multicast(at, x_map, k0 + kt * 64, 0, loaded, (1u << GW_CLUSTER) - 1);
#else
    tma_load_2d(at, x_map, k0 + kt * 64, 0, loaded);
#endif
  }
}

#if GW_CLUSTER > 1
#define GW_CLUSTER_DIMS __cluster_dims__(GW_CLUSTER, 1, 1)
#else
#define GW_CLUSTER_DIMS
#endif

// Stage `empty_s` is free again in this block and, in a cluster, in every block of it (each
// consumer warpgroup of the cluster arrives on every block's barrier).
__device__ __forceinline__ void release_stage(unsigned empty_s) {
#if GW_CLUSTER > 1
  for (unsigned r = 0; r < GW_CLUSTER; ++r) mbar_arrive_remote(empty_s, r);
#else
  mbar_arrive(empty_s);
#endif
}

#if GW_X16
typedef void gw_x_t;   // x's tensor map, in device memory
#else
typedef float gw_x_t;  // x itself, (B, K) fp32
#endif

extern "C" __global__ void __launch_bounds__(GW_THREADS, TM_MINB) GW_CLUSTER_DIMS
gemv_wgmma(const gw_x_t* __restrict__ x, const unsigned char* __restrict__ w_packed,
           const float* __restrict__ bias, float* __restrict__ y, float* __restrict__ partial,
           int* __restrict__ tickets, int B, int M, int K, int chunks_total, int slice_chunks) {
  extern __shared__ unsigned char gw_raw[];
  // loaded[s]: the copies' bytes; full[s]: x converted (not used with GW_X16); empty[s]: both
  // warpgroups done with it
  __shared__ __align__(8) unsigned long long bars[3 * GW_STAGES];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(gw_raw));
  const unsigned ring = (raw + 1023) & ~1023u;  // the swizzle repeats on 1 KB boundaries
  const unsigned loaded = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  const unsigned full = loaded + 8 * GW_STAGES, empty = full + 8 * GW_STAGES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = warp >> 2;
  const int c0 = blockIdx.y * slice_chunks, chunks = min(chunks_total - c0, slice_chunks);

  if (threadIdx.x == 0) {
#if GW_TIMELINE
    gw_timeline[blockIdx.y * gridDim.x + blockIdx.x][0] = gw_smid();
#endif
    GW_STAMP(1);
    for (int s = 0; s < GW_STAGES; ++s) {
      mbar_init(loaded + 8 * s, GW_X16 ? 1 : 128 + 1);  // cp.asyncs, and the expect_tx
      mbar_init(full + 8 * s, 128);  // every producer thread, after its part of x
      mbar_init(empty + 8 * s, 2 * GW_CLUSTER);  // one arrival a consumer warpgroup
    }
    fence_barrier_init();
  }
#if GW_CLUSTER > 1
  cluster_sync();  // every block's barriers exist before the other copies or arrives on them
#else
  __syncthreads();  // the barriers exist before anything arrives on them
#endif

  float acc[TM_MT][TM_NT][4];
  clear(acc);
  if (threadIdx.x >= TM_THREADS) {
    const int ptid = threadIdx.x - TM_THREADS;
    // Chunk-major weights put the blocks' concurrent copies in one window of DRAM rather than
    // one stream a row tile, each a tile's whole run (1.6 MB at fc6) from the next.
    const size_t w_step = GW_INTERLEAVE ? (size_t)gridDim.x * GW_A_BYTES : GW_A_BYTES;
    const unsigned char* w_src =
        w_packed + (GW_INTERLEAVE ? (size_t)c0 * gridDim.x + blockIdx.x
                                  : (size_t)blockIdx.x * chunks_total + c0) * GW_A_BYTES;
#if GW_X16
    if (ptid == 0) {
      tma_acquire(x);
      const unsigned rank = GW_CLUSTER > 1 ? cluster_rank() : 0;
      for (int c = 0; c < chunks; ++c) {
        const int s = c % GW_STAGES;
        if (c >= GW_STAGES) mbar_wait(empty + 8 * s, (c / GW_STAGES - 1) & 1);
        issue_chunk_x16(ring + s * GW_STAGE_BYTES, loaded + 8 * s, w_src + (size_t)c * w_step,
                        x, (c0 + c) * GW_KT * 64, c % GW_CLUSTER == (int)rank);
      }
    }
#else
    unsigned char* ring_p = gw_raw + (ring - raw);
    auto issue = [&](int c) {
      const int s = c % GW_STAGES;
      issue_chunk(ring_p + s * GW_STAGE_BYTES, ring + s * GW_STAGE_BYTES, loaded + 8 * s,
                  w_src + (size_t)c * w_step, x, B, K, (c0 + c) * GW_KT * 64, ptid);
    };
    for (int c = 0; c < GW_STAGES && c < chunks; ++c) issue(c);
    for (int c = 0; c < chunks; ++c) {
      const int s = c % GW_STAGES;
      mbar_wait(loaded + 8 * s, (c / GW_STAGES) & 1);
      convert_x_chunk(ring_p + s * GW_STAGE_BYTES, ring + s * GW_STAGE_BYTES + GW_A_BYTES, ptid);
      wg_proxy_fence();  // the wgmmas (async proxy) read what these stores wrote
      mbar_arrive(full + 8 * s);
      // Chunk c - 1's stage, once both warpgroups are done with it, takes chunk c - 1 +
      // GW_STAGES: after converting chunk c, so that the consumers never wait on this.
      const int next = c - 1 + GW_STAGES;
      if (c >= 1 && next < chunks) {
        mbar_wait(empty + 8 * ((c - 1) % GW_STAGES), ((c - 1) / GW_STAGES) & 1);
        issue(next);
      }
    }
#endif
  } else {
    // GW_X16: a stage is ready when its copies have landed
    const unsigned ready = GW_X16 ? loaded : full;
    for (int c = 0; c < chunks; ++c) {
      const int s = c % GW_STAGES;
      const unsigned stage = ring + s * GW_STAGE_BYTES;
      mbar_wait(ready + 8 * s, (c / GW_STAGES) & 1);
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
      // Chunk c's wgmmas stay in flight; chunk c - 1's have retired, so its stage can refill
      // while this warpgroup waits for chunk c + 1 (docs/vgg.md, "Kernel 55").
      wg_wait<1>();
      if (c >= 1 && threadIdx.x % 128 == 0) release_stage(empty + 8 * ((c - 1) % GW_STAGES));
    }
    wg_wait<0>();
#pragma unroll
    for (int mi = 0; mi < TM_MT; ++mi) wg_hold(acc[mi]);
    if (threadIdx.x == 0) GW_STAMP(2);
  }
#if GW_CLUSTER > 1
  cluster_sync();  // no block leaves while the other may still copy into it or arrive on it
#endif
  finish_parked(acc, bias, y, partial, tickets, B, M, (blockIdx.x * TM_WARPS + warp) * TM_MT,
                lane);
#if GW_TIMELINE
  __syncthreads();  // the last block's sum is done (finish_parked returns early elsewhere)
  if (threadIdx.x == 0) GW_STAMP(3);
#endif
}
