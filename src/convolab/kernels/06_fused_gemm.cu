// Rung 6 — fused GEMM (implicit GEMM): rung 5's matrix multiply without the unrolled matrix.
// Each thread owns one GEMM column n = (b, ho, wo) for the whole K loop, so it computes the
// address of its receptive field once; when it loads its element of the B tile it maps the row
// k to (c, p, q) and reads x directly. The K*K-times-larger X_unroll is never written or read
// back, and the whole batch runs in one launch with no workspace.
#include "common.cuh"

#ifndef TILE
#define TILE 16
#endif

extern "C" __global__ void __launch_bounds__(TILE * TILE)
conv_fused_gemm(const float* __restrict__ x, const float* __restrict__ w,
                const float* __restrict__ bias, float* __restrict__ y,
                int B, int C, int H, int W, int M, int K, int S, int Ho, int Wo) {
  __shared__ float w_tile[TILE][TILE];
  __shared__ float x_tile[TILE][TILE + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int KK = C * K * K, HoWo = Ho * Wo;
  const long long N = (long long)B * HoWo;
  const int m = blockIdx.y * TILE + ty;
  const long long n = (long long)blockIdx.x * TILE + tx;
  const bool col_live = n < N;
  const int b = col_live ? (int)(n / HoWo) : 0;
  const int hw = col_live ? (int)(n % HoWo) : 0;
  // Top-left input element of this column's receptive field in channel 0.
  const float* field = x + (size_t)b * C * H * W + (size_t)(hw / Wo) * S * W + (hw % Wo) * S;

  float acc = 0.0f;
  for (int k0 = 0; k0 < KK; k0 += TILE) {
    w_tile[ty][tx] = (m < M && k0 + tx < KK) ? w[(size_t)m * KK + k0 + tx] : 0.0f;
    const int k = k0 + ty;
    float v = 0.0f;
    if (col_live && k < KK) {
      const int c = k / (K * K), pq = k % (K * K);
      v = field[(size_t)c * H * W + (pq / K) * W + pq % K];
    }
    x_tile[ty][tx] = v;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TILE; ++kk) acc += w_tile[ty][kk] * x_tile[kk][tx];
    __syncthreads();
  }
  if (m < M && col_live) y[((size_t)b * M + m) * HoWo + hw] = acc + bias[m];
}
