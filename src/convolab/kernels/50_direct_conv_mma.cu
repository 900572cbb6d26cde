// Kernel 50: a narrow convolution (C and M up to 64, stride 1) straight from NCHW fp32 input,
// each input row converted once into a channels-last ring in shared memory; fp16 or bf16
// tensor cores, fp32 accumulate, fp32 NCHW output with bias.
//
// What it changes against rungs 39-40 on conv1_2 (224 x 224, 64 -> 64): there a separate pass
// first writes the whole input as a channels-last operand (a quarter of an FP16 call), and the
// GEMM then reads every input pixel from L2 once per filter tap (nine times). Here a block
// walks a run of output rows and keeps in shared memory only what they need:
// - each input row arrives once, in fp32, by cp.async (a channel's row is one contiguous run
//   of NCHW), and the block converts it into one row of a K-row ring: pixel p's channels are a
//   128-byte row, 16-byte piece j (channels 8j..8j+7) at j ^ (p mod 8), zeros past C;
// - tap (p, q) of output row oh is ring row oh + p read from pixel q on. ldmatrix takes a row
//   address per lane, so a shift by q pixels is an address, not a copy or a re-read;
// - all the weights (K*K taps x 16 MT rows of 128 bytes, packed and swizzled the same way at
//   prepare, gpu/direct_conv.py) stay in shared memory for the block's life;
// - the next input row's copy is in flight while an output row computes.
// Each warp computes 16 DC_WMT output channels x 8 DC_NT output columns of the row by
// mma.sync m16n8k16; DC_WN x DC_WM warps cover a pass of 8 DC_NT DC_WN columns.
//
// Launch: grid = blocks (at most one per output row), DC_THREADS threads; block i takes output
// rows [i R / grid, (i + 1) R / grid) of the R = B Ho rows of the batch. Dynamic shared memory:
// the weights, K ring rows of slot_pixels x 128 bytes, and one staged input row of C x stride
// floats (gpu/direct_conv.py `smem_bytes`).

#include "common.cuh"

#ifndef DC_MODE
#define DC_MODE 0  // operands: 0 fp16, 1 bf16
#endif
#ifndef DC_K
#define DC_K 3  // filter size
#endif
#ifndef DC_KK
#define DC_KK 4  // k-steps of 16 channels a tap: C <= 16 DC_KK
#endif
#ifndef DC_MT
#define DC_MT 4  // m-tiles of 16 output channels: M <= 16 DC_MT
#endif
#ifndef DC_WM
#define DC_WM 1  // warps along the output channels
#endif
#ifndef DC_WN
#define DC_WN 4  // warps along the output row
#endif
#ifndef DC_NT
#define DC_NT 7  // n-tiles of 8 output columns a warp
#endif
#ifndef DC_VEC
#define DC_VEC 2  // floats a cp.async: 4, 2 or 1, whichever divides the input width
#endif

#define DC_THREADS (32 * DC_WM * DC_WN)
#define DC_ROWB 128                              // a pixel's (or a weight row's) 64 channels
#define DC_AROWS (16 * DC_MT)
#define DC_A_BYTES (DC_K * DC_K * DC_AROWS * DC_ROWB)
#define DC_WMT (DC_MT / DC_WM)                   // m-tiles a warp
#define DC_PASS (8 * DC_NT * DC_WN)              // output columns the block computes at once

static_assert(DC_KK >= 1 && DC_KK <= 4, "at most 64 channels: one 128-byte row a pixel");
static_assert(DC_MT % DC_WM == 0, "whole m-tiles a warp");
static_assert(DC_VEC == 1 || DC_VEC == 2 || DC_VEC == 4, "cp.async moves 4, 8 or 16 bytes");

// Byte offset of 16-byte piece j within row r: the swizzle that puts the 8 rows of one
// ldmatrix phase (8 consecutive pixels, or weight rows) in 8 distinct bank groups.
__device__ __forceinline__ unsigned dc_piece(int r, int j) {
  return static_cast<unsigned>((j ^ (r & 7)) << 4);
}

__device__ __forceinline__ void dc_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
#if DC_MODE == 0
  mma_f16_m16n8k16(d, a[0], a[1], a[2], a[3], b0, b1);
#else
  mma_bf16_m16n8k16(d, a[0], a[1], a[2], a[3], b0, b1);
#endif
}

// Input row y of image b (C channels, fp32) -> the staging area, channel c at c * stride.
__device__ __forceinline__ void dc_fetch(float* stage, const float* __restrict__ x, int b, int y,
                                         int C, int H, int W, int stride) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pieces = W / DC_VEC;
  for (int c = warp; c < C; c += DC_THREADS / 32) {
    const float* src = x + (((size_t)b * C + c) * H + y) * (size_t)W;
    for (int v = lane; v < pieces; v += 32) {
#if DC_VEC == 4
      cp_async16(stage + c * stride + 4 * v, src + 4 * v);
#elif DC_VEC == 2
      cp_async8(stage + c * stride + 2 * v, src + 2 * v, true);
#else
      cp_async4(stage + c * stride + v, src + v, true);
#endif
    }
  }
  cp_async_commit();
}

// The staged row -> a ring row: pixel p's channels 8j..8j+7 one 16-byte piece, zero past C
// (the packed weights are zero there too, but zero times stale bits can be NaN).
__device__ __forceinline__ void dc_convert(unsigned char* row, const float* stage, int C, int W,
                                           int stride) {
#pragma unroll 1
  for (int j = 0; j < 2 * DC_KK; ++j)
    for (int p = threadIdx.x; p < W; p += DC_THREADS) {
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 8 * j + e < C ? stage[(8 * j + e) * stride + p] : 0.f;
      *reinterpret_cast<uint4*>(row + p * DC_ROWB + dc_piece(p, j)) =
          make_uint4(pack_16bit<DC_MODE>(v[0], v[1]), pack_16bit<DC_MODE>(v[2], v[3]),
                     pack_16bit<DC_MODE>(v[4], v[5]), pack_16bit<DC_MODE>(v[6], v[7]));
    }
}

// After row (b, y) is staged, the next input row the block's output rows [.., r1) need, in the
// order they are converted: the rest of image b up to its last output row's window, then
// image b + 1 from row 0. False when there is none.
__device__ __forceinline__ bool dc_next_row(int& b, int& y, int r1, int Ho) {
  const int last = min(r1 - 1 - b * Ho, Ho - 1);  // image b's last output row in the run
  if (y + 1 < last + DC_K) {
    ++y;
    return true;
  }
  if ((b + 1) * Ho < r1) {
    ++b;
    y = 0;
    return true;
  }
  return false;
}

extern "C" __global__ void __launch_bounds__(DC_THREADS, 1)
    direct_conv(const float* __restrict__ x, const uint4* __restrict__ wp,
                const float* __restrict__ bias, float* __restrict__ y, int B, int C, int H,
                int W, int M, int slot_pixels, int stride) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem + DC_A_BYTES;
  float* stage = reinterpret_cast<float*>(ring + DC_K * slot_pixels * DC_ROWB);
  const int Ho = H - DC_K + 1, Wo = W - DC_K + 1, rows = B * Ho;
  const int r0 = (int)((long long)blockIdx.x * rows / gridDim.x);
  const int r1 = (int)((long long)(blockIdx.x + 1) * rows / gridDim.x);
  if (r0 >= r1) return;  // the host launches at most one block a row; kept for safety
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / DC_WN, wn = warp % DC_WN;
  const unsigned a_base = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned ring_base = a_base + DC_A_BYTES;

  for (int i = threadIdx.x; i < DC_A_BYTES / 16; i += DC_THREADS)  // lands with the first row
    cp_async16(smem + 16 * i, wp + i);
  int fetch_b = r0 / Ho, fetch_y = r0 % Ho;
  bool fetching = true;
  dc_fetch(stage, x, fetch_b, fetch_y, C, H, W, stride);

  int ring_b = -1, ring_end = 0;  // the ring holds image ring_b's rows up to ring_end - 1
  for (int r = r0; r < r1; ++r) {
    const int b = r / Ho, oh = r % Ho;
    if (b != ring_b) ring_b = b, ring_end = oh;
    while (ring_end < oh + DC_K) {  // rows oh .. oh + K - 1 of image b into the ring
      cp_async_wait_all();
      __syncthreads();  // row ring_end staged by every thread; ring row ring_end - K unread
      dc_convert(smem + DC_A_BYTES + (ring_end % DC_K) * slot_pixels * DC_ROWB, stage, C, W,
                 stride);
      ++ring_end;
      __syncthreads();  // the ring row complete, the staging area free
      fetching = fetching && dc_next_row(fetch_b, fetch_y, r1, Ho);
      if (fetching) dc_fetch(stage, x, fetch_b, fetch_y, C, H, W, stride);
    }

    for (int n0 = 0; n0 < Wo; n0 += DC_PASS) {
      const int col = n0 + wn * 8 * DC_NT;  // the warp's first output column
      float acc[DC_WMT][DC_NT][4] = {};
#pragma unroll 1
      for (int p = 0; p < DC_K; ++p) {
        const unsigned in_row = ring_base + ((oh + p) % DC_K) * slot_pixels * DC_ROWB;
#pragma unroll
        for (int q = 0; q < DC_K; ++q)
#pragma unroll
          for (int kk = 0; kk < DC_KK; ++kk) {
            unsigned a[DC_WMT][4], bf[DC_NT][2];
#pragma unroll
            for (int i = 0; i < DC_WMT; ++i) {
              const int m = (wm * DC_WMT + i) * 16 + (lane & 15);
              ldsm_x4(a[i], a_base + ((p * DC_K + q) * DC_AROWS + m) * DC_ROWB +
                                dc_piece(m, 2 * kk + (lane >> 4)));
            }
#pragma unroll
            for (int t = 0; t + 1 < DC_NT; t += 2) {
              const int px = col + 8 * (t + (lane >> 4)) + (lane & 7) + q;
              unsigned v[4];
              ldsm_x4(v, in_row + px * DC_ROWB + dc_piece(px, 2 * kk + ((lane >> 3) & 1)));
              bf[t][0] = v[0], bf[t][1] = v[1], bf[t + 1][0] = v[2], bf[t + 1][1] = v[3];
            }
            if (DC_NT & 1) {
              const int px = col + 8 * (DC_NT - 1) + (lane & 7) + q;
              unsigned v[2];
              ldsm_x2(v, in_row + px * DC_ROWB + dc_piece(px, 2 * kk + ((lane >> 3) & 1)));
              bf[DC_NT - 1][0] = v[0], bf[DC_NT - 1][1] = v[1];
            }
#pragma unroll
            for (int i = 0; i < DC_WMT; ++i)
#pragma unroll
              for (int t = 0; t < DC_NT; ++t) dc_mma(acc[i][t], a[i], bf[t][0], bf[t][1]);
          }
      }

      const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
      for (int i = 0; i < DC_WMT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = (wm * DC_WMT + i) * 16 + g + 8 * h;
          if (m >= M) continue;
          const float bm = bias[m];
          float* out = y + (((size_t)b * M + m) * Ho + oh) * (size_t)Wo;
#pragma unroll
          for (int t = 0; t < DC_NT; ++t) {
            const int n = col + 8 * t + 2 * t4;
            const float v0 = acc[i][t][2 * h] + bm, v1 = acc[i][t][2 * h + 1] + bm;
            if (n + 1 < Wo && !(Wo & 1)) {
              *reinterpret_cast<float2*>(out + n) = make_float2(v0, v1);
            } else {
              if (n < Wo) out[n] = v0;
              if (n + 1 < Wo) out[n + 1] = v1;
            }
          }
        }
    }
  }
}
