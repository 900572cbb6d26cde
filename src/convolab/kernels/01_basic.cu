// Rung 1 — basic: one thread per output element (PMPP fig. 16.12, lecture 12).
// The baseline every other rung is measured against. A flat 1-D grid over B*M*Ho*Wo (64-bit
// index) avoids gridDim.y/z's 65535 limit, so any batch works. Every weight and every input
// element is re-read from global memory by each thread that needs it (K*K*C loads per output,
// served mostly by L1/L2): that redundant traffic is what the next rungs remove.
#include "common.cuh"

#ifndef BLOCK_SIZE
#define BLOCK_SIZE 256
#endif

extern "C" __global__ void __launch_bounds__(BLOCK_SIZE)
conv_basic(const float* x, const float* w, const float* bias, float* y,
           int B, int C, int H, int W, int M, int K, int S, int Ho, int Wo) {
  const long long idx = (long long)blockIdx.x * BLOCK_SIZE + threadIdx.x;
  const long long total = (long long)B * M * Ho * Wo;
  if (idx >= total) return;
  const int wo = (int)(idx % Wo);
  long long rest = idx / Wo;
  const int ho = (int)(rest % Ho);
  rest /= Ho;
  const int m = (int)(rest % M);
  const int b = (int)(rest / M);

  float acc = 0.0f;
  for (int c = 0; c < C; ++c) {
    for (int p = 0; p < K; ++p) {
      for (int q = 0; q < K; ++q) {
        acc += CONVOLAB_X_AT(x, b, c, ho * S + p, wo * S + q, C, H, W) *
               w[((m * C + c) * K + p) * K + q];
      }
    }
  }
  y[idx] = acc + bias[m];
}
