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
// Launch: grid (ceil(M / (16 TM_MT TM_WARPS)), slices), 32 TM_WARPS threads, dynamic shared
// memory TM_NT * 8 * TM_XROW * 4 bytes (twice that in 3xTF32: big and small planes); k_slice a multiple of TM_CP pieces, K a multiple
// of 4 (float4 loads of x), the packed W padded to whole m-tiles and pieces. A prepared run
// serves one stream at a time (the partials and tickets are its own).

#include "common.cuh"
#include <cuda_bf16.h>

#ifndef TM_MODE
#define TM_MODE 0  // 0 fp16, 1 bf16, 2 tf32 (2.5-byte weights), 3 3xtf32 (fp32 weights)
#endif
#ifndef TM_NT
#define TM_NT 8  // n-tiles of 8 batch columns (B <= 8 TM_NT)
#endif
#ifndef TM_MT
#define TM_MT 2  // m-tiles of 16 rows a warp
#endif
#ifndef TM_CP
#define TM_CP 4  // k pieces a chunk
#endif
#ifndef TM_WARPS
#define TM_WARPS 8
#endif

#define TM_THREADS (32 * TM_WARPS)
#define TM_SUM_OUTS 4  // outputs a thread sums at once in the split-k reduction
#define TM_PK (TM_MODE == 3 ? 8 : 16)  // k a piece
#define TM_KC (TM_CP * TM_PK)          // k a chunk
#define TM_ROWS (8 * TM_NT)            // batch rows of x staged
// Row stride of staged x in 32-bit words: 4 past a multiple of 8, so a B fragment's 32 lanes
// (row g, word t) hit 32 different banks (8 g mod 32 steps through every multiple of 4).
#define TM_XWORDS (TM_MODE <= 1 ? TM_KC / 2 : TM_KC)
#define TM_XROW (TM_XWORDS + 4)
#define TM_XQUADS (TM_ROWS * TM_KC / 4)  // float4s of x a chunk
#define TM_XLOADS ((TM_XQUADS + TM_THREADS - 1) / TM_THREADS)  // ... a thread

static_assert(TM_XWORDS % 8 == 0, "a chunk row must be a whole number of 32-byte sectors");

struct Piece {
  uint4 v;
#if TM_MODE == 2
  unsigned lo;  // the nibble word
#endif
};

__device__ __forceinline__ Piece load_piece(const uint4* w, const unsigned* lo, size_t at,
                                            bool valid) {
  Piece p;
  p.v = valid ? __ldcs(w + at) : make_uint4(0, 0, 0, 0);
#if TM_MODE == 2
  p.lo = valid ? __ldcs(lo + at) : 0u;
#endif
  return p;
}

// x's chunk from global memory (B x K fp32, row-major): TM_XLOADS float4s a thread, zero from
// k_end (the slice's end: past it the weights are zero, and 0 x inf would be a NaN).
__device__ __forceinline__ void load_x(float4 (&xr)[TM_XLOADS], const float* x, int B, int K,
                                       int k_end, int k0) {
#pragma unroll
  for (int i = 0; i < TM_XLOADS; ++i) {
    const int q = threadIdx.x + i * TM_THREADS;
    const int row = q / (TM_KC / 4), k = k0 + 4 * (q % (TM_KC / 4));
    xr[i] = q < TM_XQUADS && row < B && k < k_end ? __ldg(reinterpret_cast<const float4*>(x + (size_t)row * K + k))
                             : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// ... converted to the operand type into shared memory.
__device__ __forceinline__ void store_x(unsigned* xs, const float4 (&xr)[TM_XLOADS]) {
#pragma unroll
  for (int i = 0; i < TM_XLOADS; ++i) {
    const int q = threadIdx.x + i * TM_THREADS;
    const int row = q / (TM_KC / 4), c = q % (TM_KC / 4);
    if (q >= TM_XQUADS) break;
    const float4 v = xr[i];
#if TM_MODE == 0
    const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(xs + row * TM_XROW + 2 * c) =
        make_uint2(*reinterpret_cast<const unsigned*>(&a), *reinterpret_cast<const unsigned*>(&b));
#elif TM_MODE == 1
    const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(xs + row * TM_XROW + 2 * c) =
        make_uint2(*reinterpret_cast<const unsigned*>(&a), *reinterpret_cast<const unsigned*>(&b));
#elif TM_MODE == 2
    *reinterpret_cast<float4*>(xs + row * TM_XROW + 4 * c) =
        make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
#else
    // 3xTF32: big parts, then small parts one plane later (split once, not once per warp)
    float4 big = v, small;
    small.x = tf32_split(big.x), small.y = tf32_split(big.y);
    small.z = tf32_split(big.z), small.w = tf32_split(big.w);
    *reinterpret_cast<float4*>(xs + row * TM_XROW + 4 * c) = big;
    *reinterpret_cast<float4*>(xs + (TM_ROWS + row) * TM_XROW + 4 * c) = small;
#endif
  }
}

// One chunk's MMAs: acc[i][j] += W tile i (piece q of wb) x x's n-tile j.
__device__ __forceinline__ void chunk_mma(float (&acc)[TM_MT][TM_NT][4],
                                          const Piece (&wb)[TM_MT][TM_CP], const unsigned* xs,
                                          int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < TM_CP; ++q) {
#if TM_MODE <= 1
    unsigned b[TM_NT][2];
#pragma unroll
    for (int j = 0; j < TM_NT; ++j) {
      const unsigned* row = xs + (8 * j + g) * TM_XROW + 8 * q + t;  // k 16q + 2t, 2t + 1
      b[j][0] = row[0];
      b[j][1] = row[4];  // k + 8
    }
#pragma unroll
    for (int i = 0; i < TM_MT; ++i) {
      const uint4 a = wb[i][q].v;
#pragma unroll
      for (int j = 0; j < TM_NT; ++j) {
#if TM_MODE == 0
        mma_f16_m16n8k16(acc[i][j], a.x, a.y, a.z, a.w, b[j][0], b[j][1]);
#else
        mma_bf16_m16n8k16(acc[i][j], a.x, a.y, a.z, a.w, b[j][0], b[j][1]);
#endif
      }
    }
#elif TM_MODE == 2
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      unsigned b[TM_NT][2];
#pragma unroll
      for (int j = 0; j < TM_NT; ++j) {
        const unsigned* row = xs + (8 * j + g) * TM_XROW + 16 * q + 8 * s + t;
        b[j][0] = row[0];
        b[j][1] = row[4];
      }
#pragma unroll
      for (int i = 0; i < TM_MT; ++i) {
        // values 4s..4s+3 of the piece: upper halves in v's words 2s, 2s+1, nibbles 4e..4e+2
        const unsigned u0 = s ? wb[i][q].v.z : wb[i][q].v.x;
        const unsigned u1 = s ? wb[i][q].v.w : wb[i][q].v.y;
        const unsigned lo = wb[i][q].lo >> (16 * s);
        const unsigned a0 = (u0 << 16) | ((lo & 7u) << 13);
        const unsigned a1 = (u0 & 0xffff0000u) | (((lo >> 4) & 7u) << 13);
        const unsigned a2 = (u1 << 16) | (((lo >> 8) & 7u) << 13);
        const unsigned a3 = (u1 & 0xffff0000u) | (((lo >> 12) & 7u) << 13);
#pragma unroll
        for (int j = 0; j < TM_NT; ++j) mma_tf32_m16n8k8(acc[i][j], a0, a1, a2, a3, b[j][0], b[j][1]);
      }
    }
#else
    unsigned bb[TM_NT][2], bs[TM_NT][2];
#pragma unroll
    for (int j = 0; j < TM_NT; ++j) {
      const unsigned* row = xs + (8 * j + g) * TM_XROW + 8 * q + t;
      const unsigned* row_small = row + TM_ROWS * TM_XROW;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        bb[j][h] = row[4 * h];
        bs[j][h] = row_small[4 * h];
      }
    }
#pragma unroll
    for (int i = 0; i < TM_MT; ++i) {
      float a[4] = {__uint_as_float(wb[i][q].v.x), __uint_as_float(wb[i][q].v.y),
                    __uint_as_float(wb[i][q].v.z), __uint_as_float(wb[i][q].v.w)};
      unsigned ab[4], as[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        as[e] = __float_as_uint(tf32_split(a[e]));
        ab[e] = __float_as_uint(a[e]);
      }
#pragma unroll
      for (int j = 0; j < TM_NT; ++j) {
        mma_tf32_m16n8k8(acc[i][j], as[0], as[1], as[2], as[3], bb[j][0], bb[j][1]);
        mma_tf32_m16n8k8(acc[i][j], ab[0], ab[1], ab[2], ab[3], bs[j][0], bs[j][1]);
        mma_tf32_m16n8k8(acc[i][j], ab[0], ab[1], ab[2], ab[3], bb[j][0], bb[j][1]);
      }
    }
#endif
  }
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

extern "C" __global__ void __launch_bounds__(TM_THREADS)
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
#if TM_MODE == 3
  float total[TM_MT][TM_NT][4];
#endif
#pragma unroll
  for (int i = 0; i < TM_MT; ++i)
#pragma unroll
    for (int j = 0; j < TM_NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        acc[i][j][r] = 0.f;
#if TM_MODE == 3
        total[i][j][r] = 0.f;
#endif
      }

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
#pragma unroll
    for (int i = 0; i < TM_MT; ++i)
#pragma unroll
      for (int j = 0; j < TM_NT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          total[i][j][r] += acc[i][j][r];
          acc[i][j][r] = 0.f;
        }
#endif
#pragma unroll
    for (int i = 0; i < TM_MT; ++i)
#pragma unroll
      for (int q = 0; q < TM_CP; ++q) wa[i][q] = wn[i][q];
  }
#if TM_MODE == 3
#define TM_SUM total
#else
#define TM_SUM acc
#endif

  // acc[i][j][r] is row 16 (tile0 + i) + g + 8 (r / 2), batch column 8 j + 2 t + r % 2.
  const bool single = gridDim.y == 1;
  float* out = single ? y : partial + (size_t)blockIdx.y * B * M;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < TM_MT; ++i)
#pragma unroll
    for (int j = 0; j < TM_NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // rows of tiles past the last one are >= M
        const int m = 16 * (tile0 + i) + g + 8 * (r / 2), n = 8 * j + 2 * t + r % 2;
        if (m < M && n < B) out[(size_t)n * M + m] = TM_SUM[i][j][r] + (single ? bias[m] : 0.f);
      }
  if (single) return;

  __threadfence();  // this block's partials visible before its ticket is taken
  __syncthreads();
  const bool last =
      threadIdx.x == 0 && atomicAdd(&tickets[blockIdx.x], 1) == (int)gridDim.y - 1;
  if (!__syncthreads_or(last)) return;
  __threadfence();
  const int tile_rows = 16 * TM_MT * TM_WARPS, m0 = blockIdx.x * tile_rows;
  const size_t plane = (size_t)B * M;
  // One block sums the whole tile, so its loads must overlap: TM_SUM_OUTS outputs x 8 slices
  // in flight a thread (with 8 loads in flight, fc7 at B = 64 spent ~80 us here on L2 latency).
  for (int base = threadIdx.x; base < tile_rows * B; base += TM_THREADS * TM_SUM_OUTS) {
    const float* p[TM_SUM_OUTS];
    float s[TM_SUM_OUTS];
    bool live[TM_SUM_OUTS];
#pragma unroll
    for (int o = 0; o < TM_SUM_OUTS; ++o) {
      const int idx = base + o * TM_THREADS, n = idx / tile_rows, m = m0 + idx % tile_rows;
      live[o] = idx < tile_rows * B && m < M;
      p[o] = partial + (size_t)n * M + m;
      s[o] = 0.f;
    }
    for (int z = 0; z < (int)gridDim.y; z += 8) {  // added in slice order
      float v[TM_SUM_OUTS][8];
#pragma unroll
      for (int o = 0; o < TM_SUM_OUTS; ++o)
#pragma unroll
        for (int k = 0; k < 8; ++k)
          v[o][k] = live[o] && z + k < (int)gridDim.y ? __ldcg(p[o] + (z + k) * plane) : 0.f;
#pragma unroll
      for (int o = 0; o < TM_SUM_OUTS; ++o)
#pragma unroll
        for (int k = 0; k < 8; ++k)
          if (z + k < (int)gridDim.y) s[o] += v[o][k];
    }
#pragma unroll
    for (int o = 0; o < TM_SUM_OUTS; ++o)
      if (live[o]) {
        const int idx = base + o * TM_THREADS, n = idx / tile_rows, m = m0 + idx % tile_rows;
        y[(size_t)n * M + m] = s[o] + bias[m];
      }
  }
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}
