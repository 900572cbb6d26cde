// Rung 2 — tiled: a block computes a TILE x TILE patch of one output map (b, m) and first
// stages the input patch it needs, one channel at a time, in shared memory. With stride S the
// patch is (TILE-1)*S + K wide (the halo), so each input element is fetched from global memory
// once per block instead of up to K*K times. The patch side depends on runtime K and S, hence
// dynamic shared memory; the host shrinks TILE when a large stride would not fit in 48 KB.
// Weights are still read from global memory (uniform across the block, so cached broadcasts).
#include "common.cuh"

#ifndef TILE
#define TILE 16
#endif

extern "C" __global__ void __launch_bounds__(TILE * TILE)
conv_tiled(const float* x, const float* w, const float* bias, float* y,
           int B, int C, int H, int W, int M, int K, int S, int Ho, int Wo,
           int tiles_w, int tiles_per_image) {
  extern __shared__ float patch[];
  const int b = blockIdx.x / tiles_per_image;
  const int tile = blockIdx.x % tiles_per_image;
  const int m = blockIdx.y;
  const int ho0 = (tile / tiles_w) * TILE, wo0 = (tile % tiles_w) * TILE;
  const int ho = ho0 + threadIdx.y, wo = wo0 + threadIdx.x;
  const int side = (TILE - 1) * S + K;
  const int tid = threadIdx.y * TILE + threadIdx.x;
  const bool live = ho < Ho && wo < Wo;

  float acc = 0.0f;
  for (int c = 0; c < C; ++c) {
    for (int i = tid; i < side * side; i += TILE * TILE) {
      const int hi = ho0 * S + i / side, wi = wo0 * S + i % side;
      patch[i] = (hi < H && wi < W) ? CONVOLAB_X_AT(x, b, c, hi, wi, C, H, W) : 0.0f;
    }
    __syncthreads();
    if (live) {
      const float* wc = w + (size_t)(m * C + c) * K * K;
      for (int p = 0; p < K; ++p)
        for (int q = 0; q < K; ++q)
          acc += patch[(threadIdx.y * S + p) * side + threadIdx.x * S + q] * wc[p * K + q];
    }
    __syncthreads();
  }
  if (live) CONVOLAB_Y_AT(y, b, m, ho, wo, M, Ho, Wo) = acc + bias[m];
}
