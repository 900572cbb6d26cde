// Training rung 32 — conv2 forward: conv + bias + ReLU + max-pool (floor), keeping the pooled
// features (f5's input) and each window's argmax byte for the backward.
//
// Against 31: the input is already float (31's pooled output), so the block only copies one
// image's 4x40x40 maps and all 16 filters into shared memory. Each thread owns one pooled
// position for four filters: a C2_P x C2_P window of conv outputs times four filters is 64
// accumulators, each input value loaded once per (kh, window row) serves 4 filters x 4 window
// columns, one float4 load gives four filters' weight of a tap. The conv rows and columns the
// floor pool drops (32, 33 of 34) are never computed.
//
// Measured (H100, 2026-11-25): with 31, 0.067 ms at batch 256, 0.92 ms at batch 4096.

#include "train_lenet.cuh"

constexpr int C2F_THREADS = (C2_M / 4) * P2_N;  // a thread per (four filters, pooled position)

extern "C" __global__ void __launch_bounds__(C2F_THREADS)
train_conv2_fwd(const float* __restrict__ pool1, const float* __restrict__ w2,
                const float* __restrict__ b2, float* __restrict__ feat,
                unsigned char* __restrict__ arg2) {
  __shared__ __align__(16) float x[POOL1];
  __shared__ float4 wsm[(C2_M / 4) * C1_M * C2_TAPS];  // (filter quad, channel, tap) -> 4 weights
  const int b = blockIdx.x, tid = threadIdx.x;
  const float4* in = reinterpret_cast<const float4*>(pool1 + static_cast<size_t>(b) * POOL1);
  for (int i = tid; i < POOL1 / 4; i += C2F_THREADS) reinterpret_cast<float4*>(x)[i] = in[i];
  for (int i = tid; i < C2_W; i += C2F_THREADS) {
    const int m = i / (C1_M * C2_TAPS), rest = i - m * (C1_M * C2_TAPS);  // rest = c * taps + t
    reinterpret_cast<float*>(wsm)[((m / 4) * C1_M * C2_TAPS + rest) * 4 + (m & 3)] = w2[i];
  }
  __syncthreads();
  const int quad = tid / P2_N, p = tid - quad * P2_N;
  const int ph = p / P2_S, pw = p - ph * P2_S;
  constexpr int SPAN = C2_P + C2_K - 1;  // input columns under one pooling window
  float acc[4][C2_P][C2_P] = {};
#pragma unroll 1
  for (int c = 0; c < C1_M; ++c) {
    const float* patch = x + c * P1_N + (ph * C2_P) * P1_S + pw * C2_P;
    const float4* wq = wsm + (quad * C1_M + c) * C2_TAPS;
#pragma unroll 1
    for (int kh = 0; kh < C2_K; ++kh) {
      float4 w[C2_K];
#pragma unroll
      for (int kw = 0; kw < C2_K; ++kw) w[kw] = wq[kh * C2_K + kw];
#pragma unroll
      for (int oy = 0; oy < C2_P; ++oy) {
        float row[SPAN];
#pragma unroll
        for (int j = 0; j < SPAN; ++j) row[j] = patch[(oy + kh) * P1_S + j];
#pragma unroll
        for (int kw = 0; kw < C2_K; ++kw)
#pragma unroll
          for (int ox = 0; ox < C2_P; ++ox) {
            const float v = row[ox + kw];
            acc[0][oy][ox] = fmaf(v, w[kw].x, acc[0][oy][ox]);
            acc[1][oy][ox] = fmaf(v, w[kw].y, acc[1][oy][ox]);
            acc[2][oy][ox] = fmaf(v, w[kw].z, acc[2][oy][ox]);
            acc[3][oy][ox] = fmaf(v, w[kw].w, acc[3][oy][ox]);
          }
      }
    }
  }
  float* out = feat + static_cast<size_t>(b) * FEAT;
  unsigned char* arg = arg2 + static_cast<size_t>(b) * FEAT;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int m = quad * 4 + j;
    unsigned char at;
    out[m * P2_N + p] = pool_relu<C2_P>(acc[j], b2[m], at);
    arg[m * P2_N + p] = at;
  }
}
