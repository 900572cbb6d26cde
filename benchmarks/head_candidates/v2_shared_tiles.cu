// Kept for benchmarks/device_head.py: kernels/15 as committed at 78272ff (v2), launched with
// ceil(B / 32) blocks of 256 threads.
// Whole-network fused forward, the part after the two fused conv+pool layers (rung 13 kernels
// do C1 and C3): F5 (1024 -> 32) + ReLU, F6 (32 -> 10), softmax in one kernel, so the 1024
// features of an image are read once and only 10 probabilities are written.
//
// F5 is a small GEMM (B x 1024) . (1024 x 32): a block takes HEAD_IMGS images, stages k-chunks
// of their features (transposed, padded against bank conflicts) and of the F5 weights
// (pre-transposed on the host to (1024, 32)) in shared memory, and each thread accumulates
// 2 images x 2 outputs in registers. The first version (one warp per 8 images, features
// broadcast one float at a time) took ~0.12 ms at B=10000, more than cuBLAS' unfused head.
// F6 and the softmax are 330 FMAs per image: one thread per image, fp32, expf.

#ifndef HEAD_IMGS
#define HEAD_IMGS 32  // images per block
#endif
#define HEAD_THREADS 256
#define HEAD_IN 1024
#define HEAD_HID 32
#define HEAD_OUT 10
#define HEAD_KC 32                                 // k chunk staged per pass
#define HEAD_IPT (HEAD_IMGS / 16)                  // images per thread
#define HEAD_XS_STRIDE (HEAD_IMGS + 1)             // odd: conflict-free transposed stores

extern "C" __global__ void __launch_bounds__(HEAD_THREADS)
lenet_head(const float* __restrict__ feat, const float* __restrict__ w5t,
           const float* __restrict__ b5, const float* __restrict__ w6,
           const float* __restrict__ b6, float* __restrict__ probs, int B) {
  __shared__ float xs[HEAD_KC][HEAD_XS_STRIDE];
  __shared__ __align__(16) float ws[HEAD_KC][HEAD_HID];
  __shared__ float hs[HEAD_IMGS][HEAD_HID + 1];
  const int tid = threadIdx.x;
  const int tj = tid % 16, ti = tid / 16;  // outputs 2tj, 2tj+1; images ti*IPT ...
  const long long img0 = (long long)blockIdx.x * HEAD_IMGS;
  float acc[HEAD_IPT][2];
#pragma unroll
  for (int i = 0; i < HEAD_IPT; ++i) acc[i][0] = acc[i][1] = 0.f;

  for (int k0 = 0; k0 < HEAD_IN; k0 += HEAD_KC) {
    __syncthreads();
#pragma unroll
    for (int e = tid; e < HEAD_IMGS * HEAD_KC; e += HEAD_THREADS) {
      const int img = e / HEAD_KC, kk = e % HEAD_KC;  // consecutive lanes: consecutive k
      xs[kk][img] = img0 + img < B ? __ldg(&feat[(img0 + img) * HEAD_IN + k0 + kk]) : 0.f;
    }
    if (tid < HEAD_KC * HEAD_HID / 4)
      reinterpret_cast<float4*>(&ws[0][0])[tid] =
          __ldg(reinterpret_cast<const float4*>(w5t + (size_t)k0 * HEAD_HID) + tid);
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < HEAD_KC; ++kk) {
      const float2 wv = *reinterpret_cast<const float2*>(&ws[kk][2 * tj]);
#pragma unroll
      for (int i = 0; i < HEAD_IPT; ++i) {
        const float xv = xs[kk][ti * HEAD_IPT + i];
        acc[i][0] = fmaf(xv, wv.x, acc[i][0]);
        acc[i][1] = fmaf(xv, wv.y, acc[i][1]);
      }
    }
  }
  const float bias0 = __ldg(&b5[2 * tj]), bias1 = __ldg(&b5[2 * tj + 1]);
#pragma unroll
  for (int i = 0; i < HEAD_IPT; ++i) {
    hs[ti * HEAD_IPT + i][2 * tj] = fmaxf(acc[i][0] + bias0, 0.f);
    hs[ti * HEAD_IPT + i][2 * tj + 1] = fmaxf(acc[i][1] + bias1, 0.f);
  }
  __syncthreads();

  if (tid < HEAD_IMGS && img0 + tid < B) {
    float logits[HEAD_OUT];
    float mx = __int_as_float(0xff800000u);  // -inf (NVRTC has no INFINITY)
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) {
      float s = __ldg(&b6[o]);
#pragma unroll 8
      for (int j = 0; j < HEAD_HID; ++j) s = fmaf(hs[tid][j], __ldg(&w6[o * HEAD_HID + j]), s);
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
    for (int o = 0; o < HEAD_OUT; ++o) probs[(img0 + tid) * HEAD_OUT + o] = logits[o] * inv;
  }
}
