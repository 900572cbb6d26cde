// Whole-network fused forward, the part after the two fused conv+pool layers (rung 13 kernels
// do C1 and C3): F5 (1024 -> 32) + ReLU, F6 (32 -> 10), softmax, in one kernel, so the
// 1024 features of an image are read once and only 10 probabilities are written.
//
// A warp owns HEAD_IMGS images and lane j computes F5 output j for all of them: the F5 weight
// column is read once per warp per k (transposed on the host to (1024, 32) so the 32 lanes
// read one 128-byte line), and the features go through shared memory as broadcasts.
// F6 and the softmax are 330 FMAs per image: one lane per image does them in fp32.

#ifndef HEAD_IMGS
#define HEAD_IMGS 8  // images per warp
#endif
#ifndef HEAD_WARPS
#define HEAD_WARPS 4
#endif
#define HEAD_IN 1024
#define HEAD_HID 32
#define HEAD_OUT 10
#define HEAD_CHUNK 128

extern "C" __global__ void __launch_bounds__(HEAD_WARPS * 32)
lenet_head(const float* __restrict__ feat, const float* __restrict__ w5t,
           const float* __restrict__ b5, const float* __restrict__ w6,
           const float* __restrict__ b6, float* __restrict__ probs, int B) {
  __shared__ __align__(16) float xs[HEAD_WARPS][HEAD_IMGS][HEAD_CHUNK + 4];
  __shared__ float hs[HEAD_WARPS][HEAD_IMGS][HEAD_HID + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long img0 = ((long long)blockIdx.x * HEAD_WARPS + warp) * HEAD_IMGS;
  float acc[HEAD_IMGS];
#pragma unroll
  for (int i = 0; i < HEAD_IMGS; ++i) acc[i] = 0.f;

  for (int k0 = 0; k0 < HEAD_IN; k0 += HEAD_CHUNK) {
    __syncwarp();
#pragma unroll
    for (int i = 0; i < HEAD_IMGS; ++i) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (img0 + i < B)
        v = __ldg(reinterpret_cast<const float4*>(feat + (img0 + i) * HEAD_IN + k0) + lane);
      *reinterpret_cast<float4*>(&xs[warp][i][4 * lane]) = v;
    }
    __syncwarp();
#pragma unroll 8
    for (int k = 0; k < HEAD_CHUNK; ++k) {
      const float wv = __ldg(&w5t[(k0 + k) * HEAD_HID + lane]);
#pragma unroll
      for (int i = 0; i < HEAD_IMGS; ++i) acc[i] = fmaf(xs[warp][i][k], wv, acc[i]);
    }
  }
  const float bias5 = __ldg(&b5[lane]);
#pragma unroll
  for (int i = 0; i < HEAD_IMGS; ++i) hs[warp][i][lane] = fmaxf(acc[i] + bias5, 0.f);
  __syncwarp();

  if (lane < HEAD_IMGS && img0 + lane < B) {
    float logits[HEAD_OUT];
    float mx = __int_as_float(0xff800000u);  // -inf (NVRTC has no INFINITY)
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) {
      float s = __ldg(&b6[o]);
#pragma unroll 8
      for (int j = 0; j < HEAD_HID; ++j) s = fmaf(hs[warp][lane][j], __ldg(&w6[o * HEAD_HID + j]), s);
      logits[o] = s;
      mx = fmaxf(mx, s);
    }
    float sum = 0.f;
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) {
      logits[o] = expf(logits[o] - mx);
      sum += logits[o];
    }
    const float inv = 1.f / sum;
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) probs[(img0 + lane) * HEAD_OUT + o] = logits[o] * inv;
  }
}
