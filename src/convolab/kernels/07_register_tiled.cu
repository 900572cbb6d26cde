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
// Staging uses cp.async (global -> shared without passing through registers, zero-fill for
// the padding): a plain load-then-store loop waits out one DRAM latency per element, which
// measured 2x slower on conv1. The host pre-arranges the weights as [M/TM][C][q][p][TM] so
// their staging is a straight 16-byte copy.
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

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 4 bytes global -> shared, or 4 zero bytes when !valid (src is then never read).
__device__ __forceinline__ void copy_async_4(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void copy_async_16(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)),
               "l"(src));
}

__device__ __forceinline__ void copy_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(MAX_THREADS)
conv_register_tiled(const float* __restrict__ x, const float* __restrict__ w_arranged,
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
    // Weights of this chunk: one contiguous, 16-byte aligned run of w_arranged (zero-padded
    // for channels m >= M by the host).
    const float* w_src = w_arranged + ((size_t)blockIdx.y * C + c0) * KK * TM;
    for (int i = tid; i < nc * KK * TM / 4; i += nthreads) copy_async_16(s_w + 4 * i, w_src + 4 * i);
    // Out-of-range input (only the padding rows/columns of edge tiles) is zero so the
    // compute loop needs no bounds checks; those outputs are never stored.
    for (int cl = 0; cl < nc; ++cl) {
      const float* x_c = x + ((size_t)b * C + c0 + cl) * H * (size_t)W;
      float* dst = s_in + cl * in_rows * in_cols;
      for (int r = ty; r < in_rows; r += by) {
        const int hi = hi0 + r;
        for (int col = tx; col < in_cols; col += bx) {
          const int wi = wi0 + col;
          const bool valid = hi < H && wi < W;
          copy_async_4(dst + r * in_cols + col, valid ? x_c + (size_t)hi * W + wi : x, valid);
        }
      }
    }
    copy_async_wait_all();
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
#pragma unroll
    for (int mm = 0; mm < TM; ++mm) {
      const int m = m0 + mm;
      if (ho < Ho && m < M) CONVOLAB_Y_AT(y, b, m, ho, wo, M, Ho, Wo) = acc[mm][j] + bias[m];
    }
  }
}
