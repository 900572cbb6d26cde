// Rung 7 — register tiling + shared-memory tiling + thread coarsening.
// Rung 6 computes one output per thread and pays two shared-memory loads per FMA; in the
// ece408 layers M is tiny (4 and 16), so a square GEMM tile also wastes most of its rows on M
// padding. Here the GEMM is tiled to the layer instead: a block's M-extent is TM output
// channels (TM = 4, 8 or 16 picked >= M, so conv1 and conv2 pad nothing) and its N-extent is a
// (BY*TN) x BX patch of output pixels of one image. Each thread computes TM channels x TN
// vertically adjacent pixels held in registers (acc[TM][TN]). Per channel chunk (the GEMM's BK
// = CCH*K*K), the block stages the input patch + halo and the weights in shared memory; then
// for each (c, q) a thread loads one input column strip of (TN-1)*S+K values into registers
// and reuses each value for up to K*TM FMAs, while the weights for all TM channels arrive as
// float4 broadcasts. Per strip that is K*TN*TM FMAs against (TN-1)*S+K + K*TM/4 loads (conv2:
// 448 FMAs, 38 loads), so the SM runs near its FMA rate instead of its load/store rate.
// Threads are laid out along output columns, so neighbouring lanes read neighbouring shared-
// memory words (no bank conflicts at stride 1) and write coalesced rows of y.
// Compile-time: KSIZE, TM, TN and STRIDE (0 = stride passed at run time: the strip then reads
// shared memory per tap instead of registers, still correct for any S).
#include "common.cuh"

#ifndef KSIZE
#define KSIZE 7
#endif
#ifndef STRIDE
#define STRIDE 1
#endif
#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 8
#endif
#ifndef MAX_THREADS
#define MAX_THREADS 256
#endif

#if TM % 4 != 0
#error "TM must be a multiple of 4 (weights are read as float4)"
#endif

extern "C" __global__ void __launch_bounds__(MAX_THREADS)
conv_register_tiled(const float* __restrict__ x, const float* __restrict__ w,
                    const float* __restrict__ bias, float* __restrict__ y,
                    int B, int C, int H, int W, int M, int stride, int Ho, int Wo,
                    int cch, int tiles_w, int tiles_per_image) {
  extern __shared__ float4 smem4[];
  constexpr int KK = KSIZE * KSIZE;
  const int S = STRIDE > 0 ? STRIDE : stride;
  const int bx = blockDim.x, by = blockDim.y;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * bx + tx, nthreads = bx * by;
  const int in_rows = (by * TN - 1) * S + KSIZE;
  const int in_cols = (bx - 1) * S + KSIZE;
  // [cch][q][p][TM]: for a fixed (c, q) the K*TM weights a strip needs are contiguous float4s.
  float* s_w = reinterpret_cast<float*>(smem4);
  float* s_in = s_w + cch * KK * TM;  // [cch][in_rows][in_cols]

  const int b = blockIdx.x / tiles_per_image;
  const int tile = blockIdx.x % tiles_per_image;
  const int m0 = blockIdx.y * TM;
  const int ho0 = (tile / tiles_w) * by * TN, wo0 = (tile % tiles_w) * bx;
  const int hi0 = ho0 * S, wi0 = wo0 * S;

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

  for (int c0 = 0; c0 < C; c0 += cch) {
    const int nc = min(cch, C - c0);
    for (int i = tid; i < nc * KK * TM; i += nthreads) {
      const int mm = i % TM, p = (i / TM) % KSIZE, q = (i / (TM * KSIZE)) % KSIZE;
      const int cl = i / (TM * KK);
      const int m = m0 + mm;
      s_w[i] = m < M ? w[((size_t)m * C + c0 + cl) * KK + p * KSIZE + q] : 0.0f;
    }
    // Out-of-range input (only the padding rows/columns of edge tiles) is zero so the
    // compute loop needs no bounds checks; those outputs are never stored.
    for (int i = tid; i < nc * in_rows * in_cols; i += nthreads) {
      const int col = i % in_cols, row = (i / in_cols) % in_rows, cl = i / (in_cols * in_rows);
      const int hi = hi0 + row, wi = wi0 + col;
      s_in[i] = (hi < H && wi < W) ? CONVOLAB_X_AT(x, b, c0 + cl, hi, wi, C, H, W) : 0.0f;
    }
    __syncthreads();

    for (int cl = 0; cl < nc; ++cl) {
      const float* in_c = s_in + ((size_t)cl * in_rows + ty * TN * S) * in_cols + tx * S;
      const float4* w_c = reinterpret_cast<const float4*>(s_w + cl * KK * TM);
#pragma unroll 1
      for (int q = 0; q < KSIZE; ++q) {
#if STRIDE > 0
        float strip[(TN - 1) * STRIDE + KSIZE];
#pragma unroll
        for (int i = 0; i < (TN - 1) * STRIDE + KSIZE; ++i) strip[i] = in_c[i * in_cols + q];
#define CONVOLAB_TAP(j, p) strip[(j) * STRIDE + (p)]
#else
#define CONVOLAB_TAP(j, p) in_c[((j) * S + (p)) * in_cols + q]
#endif
#pragma unroll
        for (int p = 0; p < KSIZE; ++p) {
          float wv[TM];
#pragma unroll
          for (int v = 0; v < TM / 4; ++v) {
            const float4 f = w_c[(q * KSIZE + p) * (TM / 4) + v];
            wv[4 * v] = f.x;
            wv[4 * v + 1] = f.y;
            wv[4 * v + 2] = f.z;
            wv[4 * v + 3] = f.w;
          }
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            const float in = CONVOLAB_TAP(j, p);
#pragma unroll
            for (int mm = 0; mm < TM; ++mm) acc[mm][j] = fmaf(in, wv[mm], acc[mm][j]);
          }
        }
#undef CONVOLAB_TAP
      }
    }
    __syncthreads();
  }

  const int wo = wo0 + tx;
  if (wo >= Wo) return;
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    const int ho = ho0 + ty * TN + j;
    if (ho >= Ho) break;
#pragma unroll
    for (int mm = 0; mm < TM; ++mm) {
      const int m = m0 + mm;
      if (m < M) CONVOLAB_Y_AT(y, b, m, ho, wo, M, Ho, Wo) = acc[mm][j] + bias[m];
    }
  }
}
