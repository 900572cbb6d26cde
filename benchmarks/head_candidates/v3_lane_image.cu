// Kept for benchmarks/device_head.py: the "v3" head tried in round 2 (not committed before;
// 0.081 ms vs v2 0.092 at B=10000 on the H100), launched with ceil(B / 32) blocks of 256.
// Whole-network fused forward, the part after the two fused conv+pool layers (rung 13 kernels
// do C1 and C3): F5 (1024 -> 32) + ReLU, F6 (32 -> 10), softmax in one kernel, so the 1024
// features of an image are read once and only 10 probabilities are written.
//
// F5 is a skinny GEMM (B x 1024) . (1024 x 32): 41 MB of features and 0.66 GFLOP at B=10000,
// so ~0.015 ms is the floor either way. A block takes 32 images; each lane owns one image
// (lane = image, so no shuffles) and all 32 outputs, and the block's 8 warps
// split k into 8 slices that are summed through shared memory at the end. Every lane of a warp
// reads the same F5 weights at the same time, so a weight load is one broadcast float4 from
// L1 feeding 4 x 32 FMAs, and the features stream straight from global memory into
// registers (8 float4 loads in flight per lane) without staging or barriers in the k loop. (Two
// images per lane would halve the weight loads but needs > 48 KB of static shared memory.)
// Versions: v1 one warp per 8 images, features broadcast one float at a time (~0.12 ms);
// v2 shared-memory tiles, 2 images x 2 outputs per thread (0.098 ms: 3 shared loads per
// 4 FMAs and a barrier pair per 32 k); v3 this one.
// F6 and the softmax are 330 FMAs per image: one thread per image, fp32, expf.

#define HEAD_IMGS 32  // images per block: one per lane
#define HEAD_WARPS 8
#define HEAD_THREADS (32 * HEAD_WARPS)
#define HEAD_IN 1024
#define HEAD_HID 32
#define HEAD_OUT 10
#define HEAD_KW (HEAD_IN / HEAD_WARPS)  // k slice of one warp
#define HEAD_PF 8                       // float4 feature loads in flight per image

extern "C" __global__ void __launch_bounds__(HEAD_THREADS)
lenet_head(const float* __restrict__ feat, const float* __restrict__ w5t,
           const float* __restrict__ b5, const float* __restrict__ w6,
           const float* __restrict__ b6, float* __restrict__ probs, int B) {
  __shared__ float part[HEAD_WARPS][HEAD_HID][HEAD_IMGS + 1];  // +1: conflict-free columns
  __shared__ float hs[HEAD_IMGS][HEAD_HID + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long img0 = (long long)blockIdx.x * HEAD_IMGS;
  const long long img = min(img0 + lane, (long long)B - 1);  // tail lanes reread the last image
  const float4* xr = reinterpret_cast<const float4*>(feat + img * HEAD_IN + warp * HEAD_KW);
  const float4* wr = reinterpret_cast<const float4*>(w5t + (size_t)warp * HEAD_KW * HEAD_HID);
  float acc[HEAD_HID];
#pragma unroll
  for (int o = 0; o < HEAD_HID; ++o) acc[o] = 0.f;

  for (int k4 = 0; k4 < HEAD_KW / 4; k4 += HEAD_PF) {
    float4 xv[HEAD_PF];
#pragma unroll
    for (int u = 0; u < HEAD_PF; ++u) xv[u] = __ldg(xr + k4 + u);
#pragma unroll
    for (int u = 0; u < HEAD_PF; ++u) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float4* w = wr + ((k4 + u) * 4 + e) * (HEAD_HID / 4);
#pragma unroll
        for (int v = 0; v < HEAD_HID / 4; ++v) {
          const float4 wv = __ldg(w + v);  // same address in every lane: one broadcast
          const float x = e == 0 ? xv[u].x : e == 1 ? xv[u].y : e == 2 ? xv[u].z : xv[u].w;
          acc[4 * v] = fmaf(x, wv.x, acc[4 * v]);
          acc[4 * v + 1] = fmaf(x, wv.y, acc[4 * v + 1]);
          acc[4 * v + 2] = fmaf(x, wv.z, acc[4 * v + 2]);
          acc[4 * v + 3] = fmaf(x, wv.w, acc[4 * v + 3]);
        }
      }
    }
  }
#pragma unroll
  for (int o = 0; o < HEAD_HID; ++o) part[warp][o][lane] = acc[o];
  __syncthreads();
  for (int e = threadIdx.x; e < HEAD_IMGS * HEAD_HID; e += HEAD_THREADS) {
    const int o = e / HEAD_IMGS, i = e % HEAD_IMGS;
    float s = __ldg(&b5[o]);
#pragma unroll
    for (int w = 0; w < HEAD_WARPS; ++w) s += part[w][o][i];
    hs[i][o] = fmaxf(s, 0.f);
  }
  __syncthreads();

  const int tid = threadIdx.x;
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
