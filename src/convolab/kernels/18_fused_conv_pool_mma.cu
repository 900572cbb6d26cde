// Rung 18 — fused-conv-pool on tensor cores, weights as A: fcp_mma_wa. The fusion of rung 13
// with the convolution as mma.sync, for conv2-like layers (up to 16 output channels): kernel 17's
// Toeplitz mapping would waste the A rows, so here the weights are the 16-row A operand and
// stay in registers for the whole kernel; B is the implicit im2col of the input (8 positions
// per n-tile), gathered straight from the shared-memory tile. The GEMM k axis is the filter
// taps with each filter row padded to 8 columns (q = 7 has weight 0), so a k pair (2t, 2t+1)
// is two adjacent input pixels: one 32-bit shared load. Pixel pairs starting at an odd column
// are read from a second copy of the tile shifted by one element (fp16 only).
// Positions are ordered so that a pool window's outputs sit in lanes of one quad (pool 2) or
// in two n-tiles of one quad (pool 4): pooling is a max over registers and 1-2 shuffles.
// Measured: conv2 fp16 5% faster with registers capped at 128 (TC_MINB 4, H100, B=10000).

#include "fused_mma.cuh"

#define WA_IR (TC_TPH * TC_P - 1 + TC_K)
#define WA_RS (((TC_TPW * TC_P - 1 + 8) + 1) / 2 * 2 + 2)
#define WA_TILE (TC_C * WA_IR * WA_RS)
#if TC_PREC == 0
#define WA_STEPS ((TC_R + 1) / 2)
#define WA_COPIES 2
#else
#define WA_STEPS TC_R
#define WA_COPIES 1
#endif
#define WA_WINDOWS (TC_TPH * TC_TPW)
#if TC_P == 4
#define WA_UNITS WA_WINDOWS  // one window = two n-tiles
#define WA_NJ 2
#else
#define WA_UNITS ((WA_WINDOWS + 1) / 2)  // one n-tile = two windows
#define WA_NJ 1
#endif

// Shared-memory offset of filter row r = (c, p) relative to a position's top-left pixel.
__device__ __forceinline__ int wa_row_off(int r) {
  const int rr = r < TC_R ? r : 0;  // padded k rows have zero weights: read anything finite
  return ((rr / TC_K) * WA_IR + rr % TC_K) * WA_RS;
}

extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_MINB)
fcp_mma_wa(const float* __restrict__ x, const uint4* __restrict__ afrag,
           const float* __restrict__ bias, float* __restrict__ y, int M, int H, int W, int Hp,
           int Wp, int tiles_w, int tiles_per_image) {
  __shared__ __align__(16) tc_elem in_s[WA_COPIES * WA_TILE];
  const int tile = blockIdx.x % tiles_per_image;
  const size_t b = blockIdx.x / tiles_per_image;
  const int tile_y = tile / tiles_w, tile_x = tile % tiles_w;
  const int iy0 = tile_y * TC_TPH * TC_P, ix0 = tile_x * TC_TPW * TC_P;
  // Weight fragments first: their loads overlap the staging below.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint4 af[WA_STEPS];
#pragma unroll
  for (int s = 0; s < WA_STEPS; ++s) af[s] = __ldg(&afrag[s * 32 + lane]);
  const float b_lo = g < M ? __ldg(&bias[g]) : 0.f;
  const float b_hi = g + 8 < M ? __ldg(&bias[g + 8]) : 0.f;
  // Stage the tile in pixel pairs; the shifted copy's pair (x[gx+1], x[gx+2]) reuses the
  // pair's second value and one more (L1-resident) load.
  {
    constexpr int HS = WA_RS / 2, NP = TC_C * WA_IR * HS;
    const bool vec = W % 2 == 0;  // ix0 is even (pool 2 or 4), so pairs are 8-byte aligned
    for (int base = threadIdx.x; base < NP; base += TC_THREADS * TC_STAGE_UNROLL) {
      float2 v[TC_STAGE_UNROLL];
      float e[TC_STAGE_UNROLL];
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        const int row = i / HS, p2 = i - row * HS;
        const int c = TC_C == 1 ? 0 : row / WA_IR, r = row - c * WA_IR;
        const int gy = iy0 + r, gx = ix0 + 2 * p2;
        v[u] = make_float2(0.f, 0.f);
        e[u] = 0.f;
        if (i < NP && gy < H) {
          const float* src_row = x + ((b * TC_C + c) * H + gy) * (size_t)W;
          v[u] = tc_load2(src_row, gx, W, vec);
#if WA_COPIES == 2
          if (gx + 2 < W) e[u] = __ldg(src_row + gx + 2);
#endif
        }
      }
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        if (i >= NP) break;
        tc_store2(in_s + 2 * i, v[u].x, v[u].y);
#if WA_COPIES == 2
        tc_store2(in_s + WA_TILE + 2 * i, v[u].y, e[u]);
#else
        (void)e[u];
#endif
      }
    }
  }
  __syncthreads();

  for (int u = warp; u < WA_UNITS; u += TC_WARPS) {
    float vmax_lo = CONVOLAB_NEG_INF, vmax_hi = CONVOLAB_NEG_INF;
#pragma unroll
    for (int j = 0; j < WA_NJ; ++j) {
      // This lane's B column n = g: which position of which window it gathers.
#if TC_P == 4
      const int wi = u, dy = 2 * j + (g >> 2), dx = g & 3;
#else
      const int wi = min(2 * u + (g >> 2), WA_WINDOWS - 1), dy = (g >> 1) & 1, dx = g & 1;
#endif
      const int oh = (wi / TC_TPW) * TC_P + dy, ow = (wi % TC_TPW) * TC_P + dx;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#if TC_PREC == 0
      // pixel pair (ow + 2t, ow + 2t + 1): from the shifted copy when it starts on an odd column
      const tc_elem* base = in_s + (ow & 1) * WA_TILE + oh * WA_RS + (ow & ~1) + 2 * t;
#pragma unroll
      for (int s = 0; s < WA_STEPS; ++s) {
        const unsigned b0 = ld_u32(base + wa_row_off(2 * s));
        const unsigned b1 = ld_u32(base + wa_row_off(2 * s + 1));
        tc_mma(acc, af[s].x, af[s].y, af[s].z, af[s].w, b0, b1);
      }
#else
      const tc_elem* base = in_s + oh * WA_RS + ow + t;
#pragma unroll
      for (int s = 0; s < WA_STEPS; ++s) {
        const unsigned b0 = ld_u32(base + wa_row_off(s));
        const unsigned b1 = ld_u32(base + wa_row_off(s) + 4);
        tc_mma(acc, af[s].x, af[s].y, af[s].z, af[s].w, b0, b1);
      }
#endif
      vmax_lo = fmax_nan(vmax_lo, fmax_nan(acc[0], acc[1]));  // channel g, columns 2t, 2t+1
      vmax_hi = fmax_nan(vmax_hi, fmax_nan(acc[2], acc[3]));  // channel g + 8
    }
    vmax_lo = fmax_nan(vmax_lo, __shfl_xor_sync(0xffffffffu, vmax_lo, 1));
    vmax_hi = fmax_nan(vmax_hi, __shfl_xor_sync(0xffffffffu, vmax_hi, 1));
#if TC_P == 4
    vmax_lo = fmax_nan(vmax_lo, __shfl_xor_sync(0xffffffffu, vmax_lo, 2));
    vmax_hi = fmax_nan(vmax_hi, __shfl_xor_sync(0xffffffffu, vmax_hi, 2));
    const bool writer = t == 0;
    const int wi = u;
#else
    const bool writer = (t & 1) == 0;
    const int wi = 2 * u + (t >> 1);
#endif
    const int ph = tile_y * TC_TPH + wi / TC_TPW, pw = tile_x * TC_TPW + wi % TC_TPW;
    if (writer && wi < WA_WINDOWS && ph < Hp && pw < Wp) {
      if (g < M) y[((b * M + g) * Hp + ph) * (size_t)Wp + pw] = fmax_nan(vmax_lo + b_lo, 0.f);
      if (g + 8 < M) y[((b * M + g + 8) * Hp + ph) * (size_t)Wp + pw] = fmax_nan(vmax_hi + b_hi, 0.f);
    }
  }
}
