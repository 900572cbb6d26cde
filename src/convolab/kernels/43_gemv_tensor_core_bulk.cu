// Kernel 43: kernel 42 with the weight stream brought by the bulk copy engine.
//
// What it changes against kernel 42: there every lane loads its own 16-byte pieces into a
// register double buffer, so a warp has MT x CP loads of 512 bytes in flight and the block
// waits on them once a chunk; fc6 in fp16 streamed its 205 MB at 2.0-2.4 TB/s, as fast as
// cuBLAS but 70-80 % of the copy ceiling. Here W is packed at prepare so that each block's
// chunk (its WARPS x MT m-tiles x CP pieces) is one contiguous run of bytes, and one thread
// asks the copy engine for whole chunks (cp.async.bulk, completing on a per-stage mbarrier)
// TB_STAGES - 1 chunks ahead into a ring in shared memory; the warps read their A pieces from
// there (16 contiguous bytes a lane: no bank conflicts). The loads leave the warps' instruction
// streams and registers, and DRAM sees 20-40 KB requests instead of 512-byte ones.
//
// Measured (H100, docs/vgg.md "Kernel 43"): the FP16 stream is no faster (fc6 1.9-2.1 TB/s, as
// kernel 42 and cuBLAS: the memory system, not the load issue, bounds it); TF32 at 32-64
// columns is, without kernel 42's 64 weight registers a thread (fc6 B = 64: 0.140 ms, kernel 42
// 0.186).
//
// Everything else is kernel 42's (gemv_mma.cuh): x's chunk staged in the operand type, the
// MMAs, the split-k sum. Launch as kernel 42, with dynamic shared memory TB_STAGES chunks of
// weights, then TB_STAGES mbarriers, then x's chunk (gpu/gemv_mma.py, bulk_smem).

#include "gemv_mma.cuh"
#include "mbarrier.cuh"

#ifndef TB_STAGES
#define TB_STAGES 4  // chunks of weights in the ring
#endif

#define TB_LO_BYTES (TM_MODE == 2 ? 4 : 0)  // TF32's nibble word a lane and piece
#define TB_BAR_BYTES ((8 * TB_STAGES + 15) / 16 * 16)  // the mbarriers, x's chunk 16-aligned
// One block's chunk: its warps' pieces (16 bytes a lane), then TF32's nibble words.
#define TB_CHUNK_BYTES (TM_WARPS * TM_MT * TM_CP * 32 * (16 + TB_LO_BYTES))

static_assert(TB_CHUNK_BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");
static_assert(TB_STAGES >= 2, "the ring needs a chunk in flight while one is read");

// Warp w's piece q of its m-tile i in a staged chunk (kernel 42's Piece, from shared memory).
__device__ __forceinline__ void read_chunk(Piece (&wb)[TM_MT][TM_CP], const unsigned char* stage,
                                           int warp, int lane) {
#pragma unroll
  for (int i = 0; i < TM_MT; ++i)
#pragma unroll
    for (int q = 0; q < TM_CP; ++q) {
      const int at = ((warp * TM_MT + i) * TM_CP + q) * 32 + lane;
      wb[i][q].v = reinterpret_cast<const uint4*>(stage)[at];
#if TM_MODE == 2
      wb[i][q].lo = reinterpret_cast<const unsigned*>(
          stage + TM_WARPS * TM_MT * TM_CP * 32 * 16)[at];
#endif
    }
}

extern "C" __global__ void __launch_bounds__(TM_THREADS, TM_MINB)
gemv_bulk(const float* __restrict__ x, const unsigned char* __restrict__ w_packed,
          const float* __restrict__ bias, float* __restrict__ y, float* __restrict__ partial,
          int* __restrict__ tickets, int B, int M, int K, int chunks_total, int slice_chunks) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;  // [TB_STAGES][TB_CHUNK_BYTES]
  unsigned long long* full =
      reinterpret_cast<unsigned long long*>(smem + TB_STAGES * TB_CHUNK_BYTES);
  unsigned* xs = reinterpret_cast<unsigned*>(smem + TB_STAGES * TB_CHUNK_BYTES + TB_BAR_BYTES);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile0 = (blockIdx.x * TM_WARPS + warp) * TM_MT;
  const int c0 = blockIdx.y * slice_chunks, chunks = min(chunks_total - c0, slice_chunks);
  const unsigned char* src = w_packed + ((size_t)blockIdx.x * chunks_total + c0) * TB_CHUNK_BYTES;
  const int k_end = min(K, (c0 + chunks) * TM_KC);
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ring));
  const unsigned full_s = static_cast<unsigned>(__cvta_generic_to_shared(full));

  if (threadIdx.x == 0) {
    for (int s = 0; s < TB_STAGES; ++s) mbar_init(full_s + 8 * s, 1);
    fence_barrier_init();
  }
  __syncthreads();  // the barriers exist before the copies complete on them
  if (threadIdx.x == 0)
    for (int s = 0; s < TB_STAGES - 1 && s < chunks; ++s) {
      mbar_expect_tx(full_s + 8 * s, TB_CHUNK_BYTES);
      bulk_copy(ring_s + s * TB_CHUNK_BYTES, src + (size_t)s * TB_CHUNK_BYTES, TB_CHUNK_BYTES,
                full_s + 8 * s);
    }

  float acc[TM_MT][TM_NT][4];
  clear(acc);
#if TM_MODE == 3
  float total[TM_MT][TM_NT][4];
  clear(total);
#endif

  float4 xr[TM_XLOADS];
  load_x(xr, x, B, K, k_end, c0 * TM_KC);
  for (int c = 0; c < chunks; ++c) {
    const int stage = c % TB_STAGES;
    __syncthreads();  // chunk c - 1 is read: its stage and x's buffer are free
    const int ahead = c + TB_STAGES - 1;
    if (threadIdx.x == 0 && ahead < chunks) {
      const int s = ahead % TB_STAGES;
      mbar_expect_tx(full_s + 8 * s, TB_CHUNK_BYTES);
      bulk_copy(ring_s + s * TB_CHUNK_BYTES, src + (size_t)ahead * TB_CHUNK_BYTES,
                TB_CHUNK_BYTES, full_s + 8 * s);
    }
    store_x(xs, xr);
    __syncthreads();
    if (c + 1 < chunks) load_x(xr, x, B, K, k_end, (c0 + c + 1) * TM_KC);
    mbar_wait(full_s + 8 * stage, (c / TB_STAGES) & 1);
    Piece wa[TM_MT][TM_CP];
    read_chunk(wa, ring + stage * TB_CHUNK_BYTES, warp, lane);
    chunk_mma(acc, wa, xs, lane);
#if TM_MODE == 3
    fold_chunk(acc, total);
#endif
  }
#if TM_MODE == 3
  finish(total, bias, y, partial, tickets, B, M, tile0, lane);
#else
  finish(acc, bias, y, partial, tickets, B, M, tile0, lane);
#endif
}
