// Rung 27: split-K implicit GEMM, for layers whose output is too small to fill the GPU.
//
// What it changes against rung 26: the same tensor-core main loop (igemm.cuh), but the GEMM's
// k = C*K*K range is cut into gridDim.z slices computed by separate blocks. conv5_x at B=64
// has 4 x 98 output tiles of 128 x 128 for 132 SMs, fc6/fc7 at batch <= 64 have one column
// of tiles (N = B), i.e. 32 (fc6) or 8 (fc7) blocks: without the split, most SMs idle while
// a few walk k = 25088. Each slice writes fp32 partial sums to a workspace (SPLIT x M x N);
// a second kernel adds the slices in slice order (deterministic, no atomics) plus the bias
// and scatters to NCHW y. The workspace round trip is M*N*SPLIT*8 bytes, small exactly when
// the split pays (fc6 at B=64, SPLIT=4: 4 MB against 411 MB of fp32 weights).
//
// Measured (H100, docs/vgg.md): fc7 3xtf32 0.027-0.039 ms at every batch 1-64, 1.2-2.1x
// cuBLAS SGEMM; fc6 fp16 0.10-0.13 ms, 1.1-2.6x cuBLAS fp16; conv5_x B=1 fp16 0.039 ms vs
// cuDNN 0.109. Split-K wins on conv5_x below ~66 output tiles of 128 x 128 (B <= 8) and
// loses from 76 (B >= 12), which is auto's rule. fc6 3xtf32 at B=1 (0.213 ms with 16-column
// tiles) stays behind cuBLAS's GEMV (0.154): most of each m16n8 MMA is padding there.

#include "igemm.cuh"

extern "C" __global__ void __launch_bounds__(IG_THREADS)
igemm_conv_splitk(const ig_t* __restrict__ x, const ig_t* __restrict__ w,
                  float* __restrict__ partial, IG_PROBLEM_ARGS, int k_slice) {
  const IgProblem p = IG_PROBLEM;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  const int k_begin = blockIdx.z * k_slice;
  const int k_end = min(p.Kd, k_begin + k_slice);
  float total[IG_MI][IG_NI][4];
  ig_mainloop(total, x, w, p, m0, n0, k_begin, k_end);
  float* slab = partial + (size_t)blockIdx.z * p.M * p.N;
  ig_for_each(total, m0, n0, [&](int m, int n, float v) {
    if (m < p.M && n < p.N) slab[(size_t)m * p.N + n] = v;
  });
}

// y[b, m, pix] = bias[m] + sum over slices z = 0, 1, ... of partial[z, m, n]: fixed order.
extern "C" __global__ void __launch_bounds__(256)
splitk_reduce(const float* __restrict__ partial, const float* __restrict__ bias,
              float* __restrict__ y, int M, int N, int pix, int splits) {
  const size_t total = (size_t)M * N;
  const size_t plane = total;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const int m = (int)(i / N), n = (int)(i - (size_t)m * N);
    float s = 0.0f;
    for (int z = 0; z < splits; ++z) s += partial[z * plane + i];
    const int b = n / pix;
    y[((size_t)b * M + m) * pix + (n - b * pix)] = s + bias[m];
  }
}
