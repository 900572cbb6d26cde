// Training rung 31 — conv1 forward from raw bytes: resize + conv + bias + ReLU + max-pool in
// one kernel, keeping what the backward needs.
//
// Against the inference kernels (13-18, fed a resized float batch): the batch is a gather of
// raw uint8 images through the shuffled `index` (47 MB of training set resident on the GPU,
// no resized copy, no per-step gather), resized on chip with resize.cuh's bit-exact rule; and
// besides the pooled activations it writes one byte per pooled output, the window offset of
// the maximum (ARG_DEAD where the ReLU cut it), so the backward needs neither the 80x80
// pre-pool map nor a recomputed argmax.
//
// One block per image: the resized 86x86 image (30 KB) lives in shared memory; each thread
// owns a pooled position for all four filters, so one float4 shared load gives four weights
// and each loaded input value serves four filters and both window columns.
//
// Measured (H100, 2026-11-25, launched alone with 32 below): both conv forwards 0.067 ms at
// batch 256, 0.92 ms at batch 4096 (benchmarks/results/2026-11-25_h100_train).

#include "train_lenet.cuh"

#ifndef C1F_THREADS
#define C1F_THREADS 256
#endif

extern "C" __global__ void __launch_bounds__(C1F_THREADS)
train_conv1_fwd(const unsigned char* __restrict__ raw, const long long* __restrict__ index,
                const ResizeTap* __restrict__ taps, const unsigned* __restrict__ salt,
                const float* __restrict__ w1, const float* __restrict__ b1,
                float* __restrict__ pool1, unsigned char* __restrict__ arg1) {
  __shared__ float unit[RAW_H * RAW_W];
  __shared__ float img[IN_S * IN_S];
  __shared__ float4 wsm[C1_TAPS];  // tap -> the four filters' weights
  const int b = blockIdx.x, tid = threadIdx.x;
  const long long src = source_of(index, b);
  for (int i = tid; i < C1_W; i += C1F_THREADS) {
    const int m = i / C1_TAPS, t = i - m * C1_TAPS;
    reinterpret_cast<float*>(wsm)[t * 4 + m] = w1[i];
  }
  stage_input(img, unit, raw + src * (RAW_H * RAW_W), taps, mirrored(src, salt ? *salt : 0u));
  const float bias[4] = {b1[0], b1[1], b1[2], b1[3]};
  float* out = pool1 + static_cast<size_t>(b) * POOL1;
  unsigned char* arg = arg1 + static_cast<size_t>(b) * POOL1;
  for (int p = tid; p < P1_N; p += C1F_THREADS) {
    const int ph = p / P1_S, pw = p - ph * P1_S;
    float acc[4][C1_P][C1_P] = {};
    const float* patch = img + (ph * C1_P) * IN_S + pw * C1_P;
    // kh stays a loop (not unrolled): unrolling it too keeps every input row in registers
    // at once and spills.
#pragma unroll 1
    for (int kh = 0; kh < C1_K; ++kh) {
      float4 w[C1_K];
#pragma unroll
      for (int kw = 0; kw < C1_K; ++kw) w[kw] = wsm[kh * C1_K + kw];
#pragma unroll
      for (int oy = 0; oy < C1_P; ++oy) {
        float row[C1_P + C1_K - 1];
#pragma unroll
        for (int j = 0; j < C1_P + C1_K - 1; ++j) row[j] = patch[(oy + kh) * IN_S + j];
#pragma unroll
        for (int kw = 0; kw < C1_K; ++kw)
#pragma unroll
          for (int ox = 0; ox < C1_P; ++ox) {
            const float v = row[ox + kw];
            acc[0][oy][ox] = fmaf(v, w[kw].x, acc[0][oy][ox]);
            acc[1][oy][ox] = fmaf(v, w[kw].y, acc[1][oy][ox]);
            acc[2][oy][ox] = fmaf(v, w[kw].z, acc[2][oy][ox]);
            acc[3][oy][ox] = fmaf(v, w[kw].w, acc[3][oy][ox]);
          }
      }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      unsigned char at;
      out[m * P1_N + p] = pool_relu<C1_P>(acc[m], bias[m], at);
      arg[m * P1_N + p] = at;
    }
  }
}
