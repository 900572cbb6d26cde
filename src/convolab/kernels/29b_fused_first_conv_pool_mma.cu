// Rung 29b — rung 29's first block on fp16 tensor cores (mode 'fp16'): the same outputs as
// 29_fused_first_conv_pool.cu's FFMA family (raw uint8 or float input, fp32 or fp16 output),
// with kernel 17's Toeplitz mapping for many output channels. 17 keeps the B fragments of all
// M channels in registers (120-168 at M = 12), so here the channel loop sits outside the tile
// loop: groups of TC_M channels over one staged tile. Why and what it measured: the opening
// comment of 29_fused_first_conv_pool.cu (fp16 mxnet 0.41 / 0.58 ms float / raw, H100).

#include "first_block.cuh"

// =============================================================================================
// fp16 tensor cores: kernel 17's Toeplitz mapping (fused_mma.cuh explains it) for TC_M = FF_GC
// channels at a time; a block stages FF_TPH pooled rows' input once (as fp16) and runs every
// channel group over them, each group's B fragments (K x FF_GC x 2 registers) loaded once per
// warp and group.
#ifndef FF_GC
#define FF_GC 4  // output channels of a group
#endif
#ifndef FF_TPH
#define FF_TPH 11  // pooled rows of a block
#endif
#ifndef FF_WARPS
#define FF_WARPS 4
#endif
#define TC_PREC 0
#define TC_C 1
#define TC_K FF_K
#define TC_P 2
#define TC_M FF_GC
#define TC_TPH FF_TPH
#define TC_TPW FF_WP
#define TC_WARPS FF_WARPS
#define TC_MINB FF_MINB
#include "fused_mma.cuh"

static_assert(FF_P == 2, "the Toeplitz mapping pools 2x2 windows");
static_assert(FF_K + 7 <= 16, "the Toeplitz mapping's 16 input columns give 8 outputs");

// bfrag: kernel 17's fragments (gpu/fused_mma.py toeplitz_fragments, fp16) of m_pad channels
// (the layer's M, zero-padded to whole groups): [r][m][lane].
template <typename Input>
__device__ __forceinline__ void ff_toe(Input input, const uint2* __restrict__ bfrag,
                                       const float* __restrict__ bias, ff_out* __restrict__ y,
                                       int M, int m_pad, int tiles_h) {
  __shared__ __align__(16) tc_elem in_s[TOE_IR * TOE_RS];
  const size_t b = blockIdx.x / tiles_h;
  const int tile_y = blockIdx.x % tiles_h;
  const int iy0 = tile_y * TC_TPH * 2;
  {  // the tile as fp16 pixel pairs, TC_STAGE_UNROLL loads in flight per thread (17's staging)
    constexpr int HS = TOE_RS / 2, NP = TOE_IR * HS;
    for (int base = threadIdx.x; base < NP; base += TC_THREADS * TC_STAGE_UNROLL) {
      float2 v[TC_STAGE_UNROLL];
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        const int row = i / HS, p2 = i - row * HS;
        v[u] = make_float2(0.f, 0.f);
        if (i < NP) v[u] = input(b, 0, iy0 + row, 2 * p2);
      }
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        if (i < NP) tc_store2(in_s + 2 * i, v[u].x, v[u].y);
      }
    }
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
  for (int m0 = 0; m0 < M; m0 += TC_M) {
    uint2 bf[TC_K][TC_M];
    float bm[TC_M];
#pragma unroll
    for (int r = 0; r < TC_K; ++r)
#pragma unroll
      for (int n = 0; n < TC_M; ++n) bf[r][n] = __ldg(&bfrag[(r * m_pad + m0 + n) * 32 + lane]);
#pragma unroll
    for (int n = 0; n < TC_M; ++n) bm[n] = m0 + n < M ? __ldg(&bias[m0 + n]) : 0.f;
    for (int mt = warp; mt < TOE_MTILES; mt += TC_WARPS) {
      const int combo = min(mt * 8 + g, TOE_COMBOS - 1);
      const int ph_l = combo / TOE_NG, ow0 = (combo % TOE_NG) * 8;
      float acc[TC_M][4];
#pragma unroll
      for (int n = 0; n < TC_M; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
      for (int r = 0; r < TC_K; ++r) {
        const tc_elem* row0 = in_s + (2 * ph_l + r) * TOE_RS + ow0;
        const tc_elem* row1 = row0 + TOE_RS;
        const unsigned a0 = ld_u32(row0 + 2 * t), a1 = ld_u32(row1 + 2 * t);
        const unsigned a2 = ld_u32(row0 + 2 * t + 8), a3 = ld_u32(row1 + 2 * t + 8);
#pragma unroll
        for (int n = 0; n < TC_M; ++n) tc_mma(acc[n], a0, a1, a2, a3, bf[r][n].x, bf[r][n].y);
      }
      const int ph = tile_y * TC_TPH + ph_l, pw = ow0 / 2 + t;
      if (mt * 8 + g < TOE_COMBOS && ph < FF_HP && pw < FF_WP) {
        ff_out* yp = y + (b * M + m0) * FF_TASKS + ph * FF_WP + pw;
#pragma unroll
        for (int n = 0; n < TC_M; ++n) {
          if (m0 + n >= M) break;
          const float v =
              fmax_nan(fmax_nan(acc[n][0], acc[n][1]), fmax_nan(acc[n][2], acc[n][3]));
          yp[n * FF_TASKS] = ff_convert(fmax_nan(v + bm[n], 0.f));
        }
      }
    }
  }
}

// x: (B, 1, FF_H, FF_W) fp32; y: (B, M, HP, WP). Grid: B * tiles_h blocks.
extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MINB)
ff_toe_f32(const float* __restrict__ x, const uint2* __restrict__ bfrag,
           const float* __restrict__ bias, ff_out* __restrict__ y, int M, int m_pad,
           int tiles_h) {
  ff_toe(ToeFloatInput{x, FF_H, FF_W}, bfrag, bias, y, M, m_pad, tiles_h);
}

// Raw images: the image's bytes and taps in one round trip (first_block.cuh's ff_raw_rows),
// the row pass of the tile's rows, and the column pass as the tile is staged (ToeRawInput).
extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MINB)
ff_toe_raw(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
           const uint2* __restrict__ bfrag, const float* __restrict__ bias,
           ff_out* __restrict__ y, int M, int m_pad, int tiles_h) {
  __shared__ __align__(16) FfRawRows raw_s;
  __shared__ float rows[TOE_IR * RAW_W];
  const int row0 = (blockIdx.x % tiles_h) * TC_TPH * 2;
  ff_raw_rows(rows, raw_s, raw + (size_t)(blockIdx.x / tiles_h) * FF_RAW_BYTES, taps, row0,
              TOE_IR, threadIdx.x, TC_THREADS);
  __syncthreads();
  ff_toe(ToeRawInput{rows, raw_s.taps, FF_H, FF_W, row0}, bfrag, bias, y, M, m_pad, tiles_h);
}
