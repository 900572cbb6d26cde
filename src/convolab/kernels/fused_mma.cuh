// Shared by the tensor-core fused conv+pool kernels (17, 18, 19): the TC_* defines, the
// mma.sync and element-type helpers for TC_PREC, and the toeplitz kernel's body.
//
// Two mappings, because the two ece408 layers have opposite shapes:
//  * fcp_mma_wa (18, conv2: M=16 output channels): weights are the 16-row A operand, kept in
//    registers; B is the implicit im2col of the input.
//  * toeplitz (17 and 19, conv1: M=4, C=1): an M=16 weight operand would waste 3/4 of every
//    MMA, so rows are output positions instead. Each row is a run of 8 adjacent outputs and the
//    weights enter as a banded (Toeplitz) 16x8 matrix per filter row: row of input pixels
//    ow0..ow0+15 times T[j][dx] = w[j - dx] gives the 8 outputs ow0+dx. Rows g and g+8 are
//    vertically adjacent outputs and columns 2t, 2t+1 horizontally adjacent, so a 2x2 pool
//    window is exactly the 4 accumulators one lane holds: no shuffles at all.
// TC_PREC 0: fp16 inputs, m16n8k16; 1: tf32 inputs (rounded rna), m16n8k8. Accumulate fp32.
// Fragment-ordered weights are prepared on the host (gpu/fused_mma.py) and loaded once per warp.
#pragma once

#include "common.cuh"
#include "resize.cuh"

#ifndef TC_PREC
#define TC_PREC 0
#endif
#ifndef TC_C
#define TC_C 1
#endif
#ifndef TC_K
#define TC_K 7
#endif
#ifndef TC_P
#define TC_P 2
#endif
#ifndef TC_M
#define TC_M 4
#endif
#ifndef TC_TPH
#define TC_TPH 8  // pooled rows per block
#endif
#ifndef TC_TPW
#define TC_TPW 40  // pooled columns per block
#endif
#ifndef TC_WARPS
#define TC_WARPS 4
#endif
#ifndef TC_MINB
#define TC_MINB 1
#endif

#define TC_THREADS (TC_WARPS * 32)
#ifndef TC_STAGE_UNROLL
#define TC_STAGE_UNROLL 16  // global loads in flight per thread while staging
#endif

#if TC_PREC == 0
typedef __half tc_elem;
#else
typedef float tc_elem;
#endif

#define TC_R (TC_C * TC_K)  // filter rows (c, p): one (fp16) or two (tf32) k-steps each

__device__ __forceinline__ void tc_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                       unsigned a3, unsigned b0, unsigned b1) {
#if TC_PREC == 0
  mma_f16_m16n8k16(d, a0, a1, a2, a3, b0, b1);
#else
  mma_tf32_m16n8k8(d, a0, a1, a2, a3, b0, b1);
#endif
}

__device__ __forceinline__ tc_elem tc_convert(float v) {
#if TC_PREC == 0
  return __float2half_rn(v);
#else
  return tf32_round(v);
#endif
}

// Two adjacent input values -> shared memory in the kernel's element type (4/8-byte store).
__device__ __forceinline__ void tc_store2(tc_elem* dst, float a, float b) {
#if TC_PREC == 0
  *reinterpret_cast<__half2*>(dst) = pack_half2(a, b);
#else
  *reinterpret_cast<float2*>(dst) = make_float2(tc_convert(a), tc_convert(b));
#endif
}

// x[gx], x[gx+1] of one input row (zero past W); one 8-byte load when the row allows it.
__device__ __forceinline__ float2 tc_load2(const float* row, int gx, int W, bool vec) {
  float2 v = make_float2(0.f, 0.f);
  if (vec) {
    if (gx < W) v = __ldg(reinterpret_cast<const float2*>(row + gx));  // W even
  } else {
    if (gx < W) v.x = __ldg(row + gx);
    if (gx + 1 < W) v.y = __ldg(row + gx + 1);
  }
  return v;
}

// ---- conv1-style: positions as rows, banded weights as B ------------------------------------
#define TOE_NG ((2 * TC_TPW + 7) / 8)          // 8-wide output runs per pooled-row pair
#define TOE_IR ((TC_TPH * 2 - 1) + TC_K)      // input rows of the tile
#define TOE_RS (TOE_NG * 8 + 8)               // input columns (j reaches ow0 + 15)
#define TOE_COMBOS (TC_TPH * TOE_NG)          // (pooled row, run) pairs = 8 per m-tile
#define TOE_MTILES ((TOE_COMBOS + 7) / 8)
#if TC_PREC == 0
#define TOE_KSTEPS 1
#else
#define TOE_KSTEPS 2
#endif

// Where the toeplitz kernels' input pixels come from: input(b, c, gy, gx) returns the pixels
// (gy, gx) and (gy, gx + 1) of image b, channel c, zero outside the image.
struct ToeFloatInput {  // fp32 NCHW in global memory
  const float* __restrict__ x;
  int H, W;
  __device__ __forceinline__ float2 operator()(size_t b, int c, int gy, int gx) const {
    // W even: a pixel pair is one 8-byte load
    return gy < H ? tc_load2(x + ((b * TC_C + c) * H + gy) * (size_t)W, gx, W, W % 2 == 0)
                  : make_float2(0.f, 0.f);
  }
};

struct ToeRawInput {  // the block's raw image, resized on the fly (resize.cuh)
  const float* rows;  // the row pass of the tile's rows (resize_rows), in shared memory
  const ResizeTap* __restrict__ taps;  // H row taps, then W column taps
  int H, W;  // the resized size the convolution sees
  int row0;  // the tile's first row
  __device__ __forceinline__ float2 operator()(size_t, int, int gy, int gx) const {
    float2 v = make_float2(0.f, 0.f);
    if (gy < H) {
      const float* row = rows + (gy - row0) * RAW_W;
      if (gx < W) v.x = resized_from_row(row, taps[H + gx]);
      if (gx + 1 < W) v.y = resized_from_row(row, taps[H + gx + 1]);
    }
    return v;
  }
};

// The raw kernels' prologue: this block's raw image (b = blockIdx.x / tiles_h) staged in
// shared memory as floats in [0, 1], then the row pass of the tile's TOE_IR rows. Returns the
// input functor that resizes the tile's pixels out of those rows.
__device__ __forceinline__ ToeRawInput toe_stage_raw(float* unit, float* rows,
                                                     const unsigned char* raw,
                                                     const ResizeTap* __restrict__ taps, int H,
                                                     int W, int tiles_h) {
  stage_unit_image(unit, raw + (size_t)(blockIdx.x / tiles_h) * (RAW_H * RAW_W), RAW_H * RAW_W,
                   threadIdx.x, TC_THREADS);
  __syncthreads();
  const int row0 = (blockIdx.x % tiles_h) * TC_TPH * 2;
  resize_rows(rows, unit, taps, row0, TOE_IR, H, threadIdx.x, TC_THREADS);
  __syncthreads();
  return ToeRawInput{rows, taps, H, W, row0};
}

// The toeplitz kernel's staging and main loop; store(b, ph, pw, out) writes the TC_M pooled,
// biased, ReLU'd values of one pool window (17: fp32 NCHW, 19: fp16 channels-last).
template <typename Input, typename Store>
__device__ __forceinline__ void toe_conv_pool(Input input, const uint2* __restrict__ bfrag,
                                              const float* __restrict__ bias, int Hp, int Wp,
                                              int tiles_h, Store store) {
  __shared__ __align__(16) tc_elem in_s[TC_C * TOE_IR * TOE_RS];
  const size_t b = blockIdx.x / tiles_h;
  const int tile_y = blockIdx.x % tiles_h;
  const int iy0 = tile_y * TC_TPH * 2;
  // Weight fragments first: their loads overlap the staging below.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint2 bf[TC_R][TOE_KSTEPS][TC_M];
#pragma unroll
  for (int r = 0; r < TC_R; ++r)
#pragma unroll
    for (int h = 0; h < TOE_KSTEPS; ++h)
#pragma unroll
      for (int n = 0; n < TC_M; ++n)
        bf[r][h][n] = __ldg(&bfrag[((r * TOE_KSTEPS + h) * TC_M + n) * 32 + lane]);
  float bm[TC_M];
#pragma unroll
  for (int n = 0; n < TC_M; ++n) bm[n] = __ldg(&bias[n]);
  // Stage the tile in pixel pairs with TC_STAGE_UNROLL loads in flight per thread.
  {
    constexpr int HS = TOE_RS / 2, NP = TC_C * TOE_IR * HS;
    for (int base = threadIdx.x; base < NP; base += TC_THREADS * TC_STAGE_UNROLL) {
      float2 v[TC_STAGE_UNROLL];
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        const int row = i / HS, p2 = i - row * HS;
        const int c = TC_C == 1 ? 0 : row / TOE_IR, r = row - c * TOE_IR, gy = iy0 + r;
        v[u] = make_float2(0.f, 0.f);
        if (i < NP) v[u] = input(b, c, gy, 2 * p2);
      }
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        if (i < NP) tc_store2(in_s + 2 * i, v[u].x, v[u].y);  // row * RS + 2 p2 == 2 i
      }
    }
  }
  __syncthreads();

  for (int mt = warp; mt < TOE_MTILES; mt += TC_WARPS) {
    const int combo = min(mt * 8 + g, TOE_COMBOS - 1);
    const int ph_l = combo / TOE_NG, ow0 = (combo % TOE_NG) * 8;
    float acc[TC_M][4];
#pragma unroll
    for (int n = 0; n < TC_M; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int r = 0; r < TC_R; ++r) {
      const int c = r / TC_K, p = r % TC_K;
      const tc_elem* row0 = in_s + (c * TOE_IR + 2 * ph_l + p) * TOE_RS + ow0;
      const tc_elem* row1 = row0 + TOE_RS;
#pragma unroll
      for (int h = 0; h < TOE_KSTEPS; ++h) {
#if TC_PREC == 0
        const unsigned a0 = ld_u32(row0 + 2 * t), a1 = ld_u32(row1 + 2 * t);
        const unsigned a2 = ld_u32(row0 + 2 * t + 8), a3 = ld_u32(row1 + 2 * t + 8);
#else
        const unsigned a0 = ld_u32(row0 + 8 * h + t), a1 = ld_u32(row1 + 8 * h + t);
        const unsigned a2 = ld_u32(row0 + 8 * h + t + 4), a3 = ld_u32(row1 + 8 * h + t + 4);
#endif
#pragma unroll
        for (int n = 0; n < TC_M; ++n) tc_mma(acc[n], a0, a1, a2, a3, bf[r][h][n].x, bf[r][h][n].y);
      }
    }
    const int ph = tile_y * TC_TPH + ph_l, pw = ow0 / 2 + t;
    if (mt * 8 + g < TOE_COMBOS && ph_l < TC_TPH && ph < Hp && pw < Wp) {
      float out[TC_M];
#pragma unroll
      for (int n = 0; n < TC_M; ++n) {
        const float v = fmax_nan(fmax_nan(acc[n][0], acc[n][1]), fmax_nan(acc[n][2], acc[n][3]));
        out[n] = fmax_nan(v + bm[n], 0.f);
      }
      store(b, ph, pw, out);
    }
  }
}

