// Training rung 34 — conv2 backward fused with its max-pool and ReLU backward: dX (the
// gradient of conv1's pooled output) and this block's share of dW2 and db2.
//
// Against kernels 22 + 24 (dense): the pooled gradient reaches one conv output per window
// (the forward's argmax byte, none where the ReLU cut it), so dY of the 16x34x34 conv output
// has at most 1024 non-zeros out of 18,496 and is never materialised. dW2 walks those 1024
// (filter, window) entries instead of every output; dX gathers, per input pixel, from the at
// most 3x3 windows per filter whose 7x7 footprint can reach it. One block per batch slice:
// each thread owns a (filter, channel, kernel row) of dW2 in seven registers across the
// slice and writes its partial once (kernel 36 adds the partials in a fixed order).
//
// Measured (H100, 2026-11-25): with 35, 0.147 ms at batch 256 and 2.2 ms at batch 4096,
// two thirds of the step: the dX gather (16 filters x up to 9 windows per pixel) is next.

#include "train_lenet.cuh"

constexpr int C2B_THREADS = C2_M * C1_M * C2_K;  // a thread per (filter, channel, kernel row)

extern "C" __global__ void __launch_bounds__(C2B_THREADS)
train_conv2_bwd(const float* __restrict__ pool1, const float* __restrict__ w2,
                const float* __restrict__ dfeat, const unsigned char* __restrict__ arg2,
                float* __restrict__ dpool1, float* __restrict__ part2, int batch,
                int per_block) {
  __shared__ __align__(16) float x[POOL1];
  __shared__ float w[C2_W];
  __shared__ float dp[FEAT];
  __shared__ unsigned char ag[FEAT];
  const int tid = threadIdx.x;
  const int first = blockIdx.x * per_block, last = min(batch, first + per_block);
  for (int i = tid; i < C2_W; i += C2B_THREADS) w[i] = w2[i];
  const int m = tid / (C1_M * C2_K), c = (tid / C2_K) % C1_M, kh = tid % C2_K;
  float gw[C2_K] = {};
  float gb = 0.f;
  for (int b = first; b < last; ++b) {
    const float4* in = reinterpret_cast<const float4*>(pool1 + static_cast<size_t>(b) * POOL1);
    for (int i = tid; i < POOL1 / 4; i += C2B_THREADS) reinterpret_cast<float4*>(x)[i] = in[i];
    for (int i = tid; i < FEAT; i += C2B_THREADS) {
      dp[i] = dfeat[static_cast<size_t>(b) * FEAT + i];
      ag[i] = arg2[static_cast<size_t>(b) * FEAT + i];
    }
    __syncthreads();
    // dX: each input pixel gathers from the windows whose conv outputs it fed.
    float* dx = dpool1 + static_cast<size_t>(b) * POOL1;
    for (int q = tid; q < P1_N; q += C2B_THREADS) {
      const int ih = q / P1_S, iw = q - ih * P1_S;
      const int py_lo = max(ih - C2_K + 1, 0) / C2_P, py_hi = min(ih, P2_S * C2_P - 1) / C2_P;
      const int px_lo = max(iw - C2_K + 1, 0) / C2_P, px_hi = min(iw, P2_S * C2_P - 1) / C2_P;
      float acc[C1_M] = {};
      for (int mm = 0; mm < C2_M; ++mm)
        for (int py = py_lo; py <= py_hi; ++py)
          for (int px = px_lo; px <= px_hi; ++px) {
            const int win = mm * P2_N + py * P2_S + px;
            const int a = ag[win];
            if (a == ARG_DEAD) continue;
            const int th = ih - (py * C2_P + a / C2_P), tw = iw - (px * C2_P + a % C2_P);
            if (static_cast<unsigned>(th) >= C2_K || static_cast<unsigned>(tw) >= C2_K) continue;
            const float g = dp[win];
            const float* wt = w + mm * (C1_M * C2_TAPS) + th * C2_K + tw;
#pragma unroll
            for (int cc = 0; cc < C1_M; ++cc) acc[cc] = fmaf(g, wt[cc * C2_TAPS], acc[cc]);
          }
#pragma unroll
      for (int cc = 0; cc < C1_M; ++cc) dx[cc * P1_N + q] = acc[cc];
    }
    // dW2, db2: the (filter, window) entries that carry a gradient.
    for (int win = 0; win < P2_N; ++win) {
      const int a = ag[m * P2_N + win];
      if (a == ARG_DEAD) continue;
      const float g = dp[m * P2_N + win];
      const int oh = (win / P2_S) * C2_P + a / C2_P, ow = (win % P2_S) * C2_P + a % C2_P;
      const float* row = x + c * P1_N + (oh + kh) * P1_S + ow;
#pragma unroll
      for (int kw = 0; kw < C2_K; ++kw) gw[kw] = fmaf(g, row[kw], gw[kw]);
      if (c == 0 && kh == 0) gb += g;
    }
    __syncthreads();  // x, dp, ag are refilled for the next image
  }
  float* p = part2 + static_cast<size_t>(blockIdx.x) * (C2_W + C2_M);
#pragma unroll
  for (int kw = 0; kw < C2_K; ++kw) p[tid * C2_K + kw] = gw[kw];
  if (c == 0 && kh == 0) p[C2_W + m] = gb;
}
