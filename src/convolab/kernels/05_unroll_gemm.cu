// Rung 5 — unroll + GEMM: the convolution becomes a matrix multiply. unroll_input copies the
// receptive fields of a chunk of images into X_unroll (C*K*K rows, chunk*Ho*Wo columns: the
// im2col "unrolled" matrix), then gemm_bias computes Y = W (M x C*K*K) * X_unroll with the
// classic TILE x TILE shared-memory tiling, adding the bias as it writes y in NCHW order.
// GEMM gets regular, coalesced, reusable tiles; the price is writing and re-reading a matrix
// K*K times larger than the input, which is why the host bounds it to a chunk of the batch.
#include "common.cuh"

#ifndef TILE
#define TILE 16
#endif
#ifndef UNROLL_BLOCK
#define UNROLL_BLOCK 256
#endif

// One thread per element of X_unroll; columns (b, ho, wo) are the fastest index, so both the
// writes and (for stride 1) the reads of neighbouring threads are contiguous.
extern "C" __global__ void __launch_bounds__(UNROLL_BLOCK)
unroll_input(const float* __restrict__ x, float* __restrict__ x_unroll, int b0, int nb,
             int C, int H, int W, int K, int S, int Ho, int Wo) {
  const long long cols = (long long)nb * Ho * Wo;
  const long long idx = (long long)blockIdx.x * UNROLL_BLOCK + threadIdx.x;
  if (idx >= cols * C * K * K) return;
  const long long col = idx % cols;
  const int row = (int)(idx / cols);
  const int q = row % K, p = (row / K) % K, c = row / (K * K);
  const int wo = (int)(col % Wo), ho = (int)((col / Wo) % Ho);
  const int b = b0 + (int)(col / ((long long)Ho * Wo));
  x_unroll[idx] = CONVOLAB_X_AT(x, b, c, ho * S + p, wo * S + q, C, H, W);
}

// y[b0 + n / (Ho*Wo), m, n % (Ho*Wo)] = bias[m] + sum_k w[m, k] * x_unroll[k, n]
extern "C" __global__ void __launch_bounds__(TILE * TILE)
gemm_bias(const float* __restrict__ w, const float* __restrict__ x_unroll,
          const float* __restrict__ bias, float* __restrict__ y,
          int M, int KK, int N, int HoWo, int b0) {
  __shared__ float w_tile[TILE][TILE];
  __shared__ float x_tile[TILE][TILE + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int m = blockIdx.y * TILE + ty;
  const long long n = (long long)blockIdx.x * TILE + tx;

  float acc = 0.0f;
  for (int k0 = 0; k0 < KK; k0 += TILE) {
    w_tile[ty][tx] = (m < M && k0 + tx < KK) ? w[(size_t)m * KK + k0 + tx] : 0.0f;
    x_tile[ty][tx] = (k0 + ty < KK && n < N) ? x_unroll[(size_t)(k0 + ty) * N + n] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) acc += w_tile[ty][k] * x_tile[k][tx];
    __syncthreads();
  }
  if (m < M && n < N) {
    const int b = b0 + (int)(n / HoWo), hw = (int)(n % HoWo);
    y[((size_t)b * M + m) * HoWo + hw] = acc + bias[m];
  }
}
