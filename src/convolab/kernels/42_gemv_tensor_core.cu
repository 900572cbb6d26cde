// Kernel 42: a classifier layer at batch 1-64 on tensor cores: the weights streamed once as
// the MMA's A operand, the batch as its n columns.
//
// What it changes against kernel 41: there every weight costs B FFMAs and B shared-memory
// reads of x, so from B = 8 the loop is bound by those, not by the weight stream (fc6 TF32 at
// B = 8-16: 0.175 ms against 0.113 at B = 1-4). Here one m16n8 MMA multiplies 16 rows of W by
// 8 batch columns at once: a weight costs 1/16 of a B fragment read and a share of one MMA, and
// the loop stays bound by reading W up to 64 columns (8 n-tiles).
//
// W is packed once at prepare in fragment order (gpu/gemv_mma.py, pack_weights): for each
// 16-row m-tile and each k piece, the 32 lanes' A fragments lie side by side, 16 bytes a lane,
// so a warp's load of a piece is 512 contiguous bytes and a lane's 16 bytes are its registers
// as the MMA wants them. A piece is one k16 step of fp16 / bf16 (8 values); in TF32 two k8 steps
// (8 values' upper 16 bits; the next 3 mantissa bits of each follow in a second plane, one
// 32-bit word a lane and piece: kernel 41's 2.5-byte TF32 format, rebuilt exactly in registers);
// in 3xTF32 one k8 step of 4 fp32 weights, split big + small in registers.
//
// A block's warps own TM_MT m-tiles each (the block's row tile) over one k slice (blockIdx.y).
// The slice goes in chunks of TM_CP pieces: x's chunk (TM_NT x 8 batch rows, zero past B and K)
// is converted to the operand type into shared memory once for all of the block's rows, while
// the next chunk's weights and x are already in flight in registers (two weight buffers, so a
// lane has TM_MT x TM_CP 16-byte loads outstanding across the block barrier).
//
// 3xTF32 sums each chunk's MMAs from zero and adds the chunk into an fp32 total: the tensor
// cores' accumulation does not round to nearest, and over fc6's 3136 k8 steps that bias would
// reach 1e-4. Split k as kernel 41: fp32 partials, and the last block of a row tile to finish
// (an atomic ticket) adds the slices in slice order plus the bias, then resets its ticket.
//
// A block waits for its chunk every chunk, so the stream needs several blocks an SM: TM_MINB
// is the launch bound's block count (left alone ptxas takes 164-250 registers, one block an SM:
// fc6 FP16 at 2.9-3.1 TB/s; two blocks 3.7-4.2, cuBLAS's rate; docs/vgg.md "fc6's weight
// stream").
//
// Launch: grid (ceil(M / (16 TM_MT TM_WARPS)), slices), 32 TM_WARPS threads, dynamic shared
// memory TM_NT * 8 * TM_XROW * 4 bytes (twice that in 3xTF32: big and small planes); k_slice a multiple of TM_CP pieces, K a multiple
// of 4 (float4 loads of x), the packed W padded to whole m-tiles and pieces. A prepared run
// serves one stream at a time (the partials and tickets are its own).

#include "gemv_mma.cuh"

__device__ __forceinline__ Piece load_piece(const uint4* w, const unsigned* lo, size_t at,
                                            bool valid) {
  Piece p;
  p.v = valid ? __ldcs(w + at) : make_uint4(0, 0, 0, 0);
#if TM_MODE == 2
  p.lo = valid ? __ldcs(lo + at) : 0u;
#endif
  return p;
}

// A warp's weights for one chunk: piece q of its m-tile i, or zeros past the slice. Tiles past
// the last one (M not a multiple of the block's rows) re-read the last; their sums are dropped.
__device__ __forceinline__ void load_chunk(Piece (&wb)[TM_MT][TM_CP], const uint4* w,
                                           const unsigned* lo, int tile0, int m_tiles,
                                           int pieces, int p_begin, int p_end, int lane) {
#pragma unroll
  for (int i = 0; i < TM_MT; ++i) {
    const size_t tile = min(tile0 + i, m_tiles - 1);
#pragma unroll
    for (int q = 0; q < TM_CP; ++q) {
      const int p = p_begin + q;
      wb[i][q] = load_piece(w, lo, (tile * pieces + p) * 32 + lane, p < p_end);
    }
  }
}

extern "C" __global__ void __launch_bounds__(TM_THREADS, TM_MINB)
gemv_mma(const float* __restrict__ x, const void* __restrict__ w_packed,
         const float* __restrict__ bias, float* __restrict__ y, float* __restrict__ partial,
         int* __restrict__ tickets, int B, int M, int K, int m_tiles, int pieces,
         int slice_pieces) {
  extern __shared__ unsigned xs[];  // [planes][TM_ROWS][TM_XROW]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile0 = (blockIdx.x * TM_WARPS + warp) * TM_MT;  // the warp's first m-tile
  const uint4* w = static_cast<const uint4*>(w_packed);
  // TF32's nibble plane follows the 16-byte pieces: one word a lane and piece.
  const unsigned* lo = reinterpret_cast<const unsigned*>(w + (size_t)m_tiles * pieces * 32);
  const int p0 = blockIdx.y * slice_pieces, p1 = min(pieces, p0 + slice_pieces);
  const int k_end = min(K, p1 * TM_PK);
  const int chunks = (p1 - p0 + TM_CP - 1) / TM_CP;

  float acc[TM_MT][TM_NT][4];
  clear(acc);
#if TM_MODE == 3
  float total[TM_MT][TM_NT][4];
  clear(total);
#endif

  Piece wa[TM_MT][TM_CP], wn[TM_MT][TM_CP];
  float4 xr[TM_XLOADS];
  load_chunk(wa, w, lo, tile0, m_tiles, pieces, p0, p1, lane);
  load_x(xr, x, B, K, k_end, p0 * TM_PK);
  for (int c = 0; c < chunks; ++c) {
    __syncthreads();  // the previous chunk's x is read
    store_x(xs, xr);
    __syncthreads();
    if (c + 1 < chunks) {  // the next chunk in flight while this one multiplies
      const int pn = p0 + (c + 1) * TM_CP;
      load_chunk(wn, w, lo, tile0, m_tiles, pieces, pn, p1, lane);
      load_x(xr, x, B, K, k_end, pn * TM_PK);
    }
    chunk_mma(acc, wa, xs, lane);
#if TM_MODE == 3
    fold_chunk(acc, total);
#endif
#pragma unroll
    for (int i = 0; i < TM_MT; ++i)
#pragma unroll
      for (int q = 0; q < TM_CP; ++q) wa[i][q] = wn[i][q];
  }
#if TM_MODE == 3
  finish(total, bias, y, partial, tickets, B, M, tile0, lane);
#else
  finish(acc, bias, y, partial, tickets, B, M, tile0, lane);
#endif
}
