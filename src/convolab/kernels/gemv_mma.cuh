// What kernels 42 and 43 share (the tensor-core GEMV for classifier layers at batch 1-64):
// the compile-time shape, x's chunk staged in shared memory in the operand type, one chunk's
// MMAs from a warp's weight pieces, and the end: sums to y, or fp32 partials added in slice
// order by the last block of a row tile. The kernels differ in how the pieces arrive.

#pragma once
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
#ifndef TM_MINB
#define TM_MINB 1  // blocks an SM the launch bound keeps registers for
#endif

#define TM_THREADS (32 * TM_WARPS)
#ifndef TM_STAMP
#define TM_STAMP(i) ((void)0)  // kernel 49's GW_TIMELINE: a time stamp in `finish_parked`
#endif
// Quads of outputs a thread sums at once in the split-k reduction. Four, where one block an SM
// leaves the registers, measured the same (fc6 FP16 B = 64 on kernel 43: 81.3 against 81.9 us).
#define TM_SUM_QUADS 1
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

__device__ __forceinline__ void clear(float (&sums)[TM_MT][TM_NT][4]) {
#pragma unroll
  for (int i = 0; i < TM_MT; ++i)
#pragma unroll
    for (int j = 0; j < TM_NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) sums[i][j][r] = 0.f;
}

// 3xTF32: a chunk's MMAs summed from zero, then added into the total with round-to-nearest adds.
__device__ __forceinline__ void fold_chunk(float (&acc)[TM_MT][TM_NT][4],
                                           float (&total)[TM_MT][TM_NT][4]) {
#pragma unroll
  for (int i = 0; i < TM_MT; ++i)
#pragma unroll
    for (int j = 0; j < TM_NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        total[i][j][r] += acc[i][j][r];
        acc[i][j][r] = 0.f;
      }
}

// A warp's sums as held (v[i][j][r]: row 16 (tile0 + i) + g + 8 (r / 2), batch column
// 8 j + 2 t + r % 2) to out[column M + row], plus bias[row] where a bias is given; rows of
// tiles past the last one are >= M.
__device__ __forceinline__ void store_held(const float (&v)[TM_MT][TM_NT][4],
                                           const float* __restrict__ bias, float* __restrict__ out,
                                           int B, int M, int tile0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < TM_MT; ++i)
#pragma unroll
    for (int j = 0; j < TM_NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int m = 16 * (tile0 + i) + g + 8 * (r / 2), n = 8 * j + 2 * t + r % 2;
        if (m < M && n < B) out[(size_t)n * M + m] = v[i][j][r] + (bias ? bias[m] : 0.f);
      }
}

// The warp's sums to y, or to this slice's partials; then, split, the last block of the row
// tile to finish (an atomic ticket) adds the slices in slice order plus the bias and resets its
// ticket.
__device__ __forceinline__ void finish(const float (&sums)[TM_MT][TM_NT][4],
                                       const float* __restrict__ bias, float* __restrict__ y,
                                       float* __restrict__ partial, int* __restrict__ tickets,
                                       int B, int M, int tile0, int lane) {
  const bool single = gridDim.y == 1;
  // Threads past TM_THREADS (a producer warpgroup) hold no sums and add none; they only meet
  // the block barriers.
  const bool adds = threadIdx.x < TM_THREADS;
  if (adds)
    store_held(sums, single ? bias : nullptr, single ? y : partial + (size_t)blockIdx.y * B * M,
               B, M, tile0, lane);
  if (single) return;

  __threadfence();  // this block's partials visible before its ticket is taken
  __syncthreads();
  const bool last =
      threadIdx.x == 0 && atomicAdd(&tickets[blockIdx.x], 1) == (int)gridDim.y - 1;
  if (!__syncthreads_or(last) || !adds) return;
  __threadfence();
  const int tile_rows = 16 * TM_MT * TM_WARPS, m0 = blockIdx.x * tile_rows;
  const int quads = tile_rows / 4;  // a thread sums 4 rows of one column at once
  const size_t plane = (size_t)B * M;
  const bool aligned = M % 4 == 0;  // float4 loads; otherwise the 4 rows one by one
  // One block sums the whole tile, so a thread's loads must overlap and be wide: TM_SUM_QUADS
  // float4s x 8 slices in flight (fc6 FP16 B = 64, kernel 43: 82-84 us against 90-92 with 4
  // scalar outputs x 8 slices).
  for (int base = threadIdx.x; base < quads * B; base += TM_THREADS * TM_SUM_QUADS) {
    const float* p[TM_SUM_QUADS];
    float4 s[TM_SUM_QUADS];
    int live[TM_SUM_QUADS];  // rows of the quad below M
#pragma unroll
    for (int o = 0; o < TM_SUM_QUADS; ++o) {
      const int idx = base + o * TM_THREADS, n = idx / quads, m = m0 + 4 * (idx % quads);
      live[o] = idx < quads * B && m < M ? min(4, M - m) : 0;
      p[o] = partial + (size_t)n * M + m;
      s[o] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int z = 0; z < (int)gridDim.y; z += 8) {  // added in slice order
      float4 v[TM_SUM_QUADS][8];
#pragma unroll
      for (int o = 0; o < TM_SUM_QUADS; ++o)
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float* q = p[o] + (z + k) * plane;
          const bool in = live[o] && z + k < (int)gridDim.y;
          if (in && aligned) {
            v[o][k] = __ldcg(reinterpret_cast<const float4*>(q));
          } else {
            v[o][k].x = in ? __ldcg(q) : 0.f;
            v[o][k].y = in && live[o] > 1 ? __ldcg(q + 1) : 0.f;
            v[o][k].z = in && live[o] > 2 ? __ldcg(q + 2) : 0.f;
            v[o][k].w = in && live[o] > 3 ? __ldcg(q + 3) : 0.f;
          }
        }
#pragma unroll
      for (int o = 0; o < TM_SUM_QUADS; ++o)
#pragma unroll
        for (int k = 0; k < 8; ++k)
          if (z + k < (int)gridDim.y) {
            s[o].x += v[o][k].x, s[o].y += v[o][k].y;
            s[o].z += v[o][k].z, s[o].w += v[o][k].w;
          }
    }
#pragma unroll
    for (int o = 0; o < TM_SUM_QUADS; ++o) {
      const int idx = base + o * TM_THREADS, n = idx / quads, m = m0 + 4 * (idx % quads);
      float* out = y + (size_t)n * M + m;
      const float sum[4] = {s[o].x, s[o].y, s[o].z, s[o].w};
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (c < live[o]) out[c] = sum[c] + bias[m + c];
    }
  }
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}

#define TM_PARKED_RUN (TM_MT * TM_NT)  // float4s a thread
#define TM_PARK_GROUP (TM_MINB > 1 || TM_MT > 1 ? 1 : 2)  // slices loaded at once (registers)

// `finish` with the slices' partials parked as the threads hold them (kernel 49): a thread
// stores its TM_MT TM_NT float4s, and in the last block of the row tile each thread reads the
// other slices' float4s at its own places, TM_PARK_GROUP slices' loads in flight at once, adds
// all in slice order (its own from registers) and stores y with the bias as the unsplit end
// does. In `finish` the last block re-reads the tile's partials in [column][row] order, one
// float4 of each slice a round trip: at fc6 B = 64 that sum took ~6 us after the last loop
// (docs/vgg.md, "fc6's split-k sum, and three feeds that did not help").
__device__ __forceinline__ void finish_parked(const float (&sums)[TM_MT][TM_NT][4],
                                              const float* __restrict__ bias,
                                              float* __restrict__ y, float* __restrict__ parked,
                                              int* __restrict__ tickets, int B, int M, int tile0,
                                              int lane) {
  const bool adds = threadIdx.x < TM_THREADS;
  if (gridDim.y == 1) {
    if (adds) store_held(sums, bias, y, B, M, tile0, lane);
    return;
  }
  // [slice][tile][float4 (i, j)][thread]: a warp's stores and loads of one float4 are 512
  // contiguous bytes
  const size_t slice_stride = (size_t)gridDim.x * TM_PARKED_RUN * TM_THREADS;
  float4* at = reinterpret_cast<float4*>(parked) +
               (size_t)blockIdx.x * TM_PARKED_RUN * TM_THREADS + threadIdx.x;
  if (adds) {
#pragma unroll
    for (int i = 0; i < TM_MT; ++i)
#pragma unroll
      for (int j = 0; j < TM_NT; ++j)
        __stcg(at + blockIdx.y * slice_stride + (i * TM_NT + j) * TM_THREADS,
               make_float4(sums[i][j][0], sums[i][j][1], sums[i][j][2], sums[i][j][3]));
  }
  TM_STAMP(4);
  __threadfence();  // this block's partials visible before its ticket is taken
  __syncthreads();
  TM_STAMP(5);
  const bool last =
      threadIdx.x == 0 && atomicAdd(&tickets[blockIdx.x], 1) == (int)gridDim.y - 1;
  const bool summing = __syncthreads_or(last);
  TM_STAMP(6);
  if (!summing || !adds) return;
  __threadfence();
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
  float total[TM_MT][TM_NT][4];
  clear(total);
  for (int z = 0; z < (int)gridDim.y; z += TM_PARK_GROUP) {  // added in slice order
    float4 v[TM_PARK_GROUP][TM_MT][TM_NT];
#pragma unroll
    for (int k = 0; k < TM_PARK_GROUP; ++k)
#pragma unroll
      for (int i = 0; i < TM_MT; ++i)
#pragma unroll
        for (int j = 0; j < TM_NT; ++j) {
          const int slice = z + k;
          v[k][i][j] = slice == (int)blockIdx.y
                           ? make_float4(sums[i][j][0], sums[i][j][1], sums[i][j][2],
                                         sums[i][j][3])
                       : slice < (int)gridDim.y
                           ? __ldcg(at + slice * slice_stride + (i * TM_NT + j) * TM_THREADS)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
    for (int k = 0; k < TM_PARK_GROUP; ++k)
#pragma unroll
      for (int i = 0; i < TM_MT; ++i)
#pragma unroll
        for (int j = 0; j < TM_NT; ++j)
          if (z + k < (int)gridDim.y) {
            total[i][j][0] += v[k][i][j].x, total[i][j][1] += v[k][i][j].y;
            total[i][j][2] += v[k][i][j].z, total[i][j][3] += v[k][i][j].w;
          }
  }
  TM_STAMP(7);
  store_held(total, bias, y, B, M, tile0, lane);
}
