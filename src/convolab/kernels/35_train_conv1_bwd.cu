// Training rung 35 — conv1 backward fused with its max-pool and ReLU backward: this block's
// share of dW1 and db1 (the first layer needs no dX), its input re-resized from raw bytes.
//
// Against kernel 22's register-tap dW (dense dY, a resized input batch in memory): the input
// is rebuilt on chip from the 784 raw bytes exactly as rung 31 built it (cheaper than reading
// back a 30 KB float image), and dY1 has one non-zero per pooling window, found through 31's
// argmax byte. The work is split by window instead of by weight: each thread owns a filter
// and every 64th window and keeps all 49 tap sums in registers across the slice, so each
// gradient value is loaded once and used 49 times; the 64 threads of a filter are reduced
// once per block, in a fixed order.
//
// Measured (H100, 2026-11-25): with 34, 0.147 ms at batch 256, 2.2 ms at batch 4096.

#include "train_lenet.cuh"

constexpr int C1B_THREADS = 256;
constexpr int C1B_LANES = C1B_THREADS / C1_M;  // threads per filter
static_assert(C1B_LANES % 32 == 0, "a filter's threads fill whole warps");

extern "C" __global__ void __launch_bounds__(C1B_THREADS)
train_conv1_bwd(const unsigned char* __restrict__ raw, const long long* __restrict__ index,
                const ResizeTap* __restrict__ taps, const unsigned* __restrict__ salt,
                const float* __restrict__ dpool1, const unsigned char* __restrict__ arg1,
                float* __restrict__ part1, int batch, int per_block) {
  __shared__ float unit[RAW_H * RAW_W];
  __shared__ float img[IN_S * IN_S];
  const int tid = threadIdx.x, m = tid / C1B_LANES, lane = tid % C1B_LANES;
  const int first = blockIdx.x * per_block, last = min(batch, first + per_block);
  const unsigned epoch_salt = salt ? *salt : 0u;
  float gw[C1_TAPS] = {};
  float gb = 0.f;
  for (int b = first; b < last; ++b) {
    const long long src = source_of(index, b);
    stage_input(img, unit, raw + src * (RAW_H * RAW_W), taps, mirrored(src, epoch_salt));
    const size_t at = static_cast<size_t>(b) * POOL1 + m * P1_N;
    for (int win = lane; win < P1_N; win += C1B_LANES) {
      const int a = arg1[at + win];
      if (a == ARG_DEAD) continue;
      const float g = dpool1[at + win];
      const int oy = (win / P1_S) * C1_P + a / C1_P, ox = (win % P1_S) * C1_P + a % C1_P;
      const float* patch = img + oy * IN_S + ox;
#pragma unroll
      for (int kh = 0; kh < C1_K; ++kh)
#pragma unroll
        for (int kw = 0; kw < C1_K; ++kw)
          gw[kh * C1_K + kw] = fmaf(g, patch[kh * IN_S + kw], gw[kh * C1_K + kw]);
      gb += g;
    }
    __syncthreads();  // img is rebuilt for the next image
  }
  // Reduce each filter's C1B_LANES threads: warp shuffles, then the filter's warps in order.
  constexpr int SUMS = C1_TAPS + 1;
  float* red = img;  // free now: (warp, tap) partials
  const int warp = tid >> 5;
#pragma unroll
  for (int t = 0; t < SUMS; ++t) {
    float v = t < C1_TAPS ? gw[t] : gb;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((tid & 31) == 0) red[warp * SUMS + t] = v;
  }
  __syncthreads();
  float* p = part1 + static_cast<size_t>(blockIdx.x) * (C1_W + C1_M);
  for (int q = tid; q < C1_M * SUMS; q += C1B_THREADS) {
    const int mm = q / SUMS, t = q - mm * SUMS;
    float v = 0.f;
    for (int w = 0; w < C1B_LANES / 32; ++w) v += red[(mm * (C1B_LANES / 32) + w) * SUMS + t];
    p[t < C1_TAPS ? mm * C1_TAPS + t : C1_W + mm] = v;
  }
}
