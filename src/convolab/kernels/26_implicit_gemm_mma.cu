// Rung 26: implicit-GEMM convolution for large channel counts (VGG's 64..512 channels and its
// classifier layers as 1x1 convolutions), on the tensor cores through mma.sync.
//
// What it changes against rung 10 (tensor-core, WMMA): rung 10 gathers the im2col tile from
// NCHW x with scalar loads into a 16-channel block tile, which suits LeNet (M <= 16, C*K*K
// <= 196) but on VGG spends its time in the gather (conv5_x: 2.1 ms vs cuDNN fp16 0.11).
// Here (igemm.cuh):
//   * the input is first made channels-last in the operand type (to_channels_last, a
//     separate kernel, counted in the rung's time): then one tap's channels are contiguous
//     and B is copied in 16-byte cp.async pieces just like the weights A; the registry's
//     contract stays NCHW fp32 in and out, and the conversion costs one read + one
//     half-size write of x (on conv1_2 at B=16 ~0.1 ms of the layer), paid because an NCHW
//     gather cannot issue 16-byte copies along k. 1x1 layers over 1x1 images (fc6, fc7) in
//     fp32 modes are already channels-last and skip it;
//   * block tiles of BM x BN = up to 128 x 128 over 8 warps (rung 10: 16 x 64), so each
//     operand byte brought on chip feeds 64-128 MMAs instead of 16;
//   * a STAGES-deep cp.async ring: the copies of k-tile t+STAGES-1 are in flight while the
//     tensor cores work on tile t;
//   * fragments by ldmatrix.x4 from padded rows (no bank conflicts, no swizzle);
//   * bias added in the epilogue, stored straight to NCHW y.
// Split-K for small B*Ho*Wo is the next file's idea (27).
//
// Measured (H100, docs/vgg.md; 59.2 GFLOP each): conv1_2 B=16 3xtf32 1.68 ms (cuDNN fp32
// 1.63), fp16 0.63 ms (cuDNN fp16 channels-last 0.34); conv5_x B=64 3xtf32 1.34 ms (cuDNN
// fp32 0.78), tf32 0.65 (0.25), fp16 0.325 = 182 TFLOP/s (0.121). Ahead of cuDNN fp32 on
// conv1_2 up to B=12, behind cuDNN's tensor-core paths from there: mma.sync with one barrier
// per k-tile reaches ~23% of the fp16 ceiling, where wgmma + TMA is the next step.

#include "igemm.cuh"

extern "C" __global__ void __launch_bounds__(IG_THREADS)
igemm_conv(const ig_t* __restrict__ x, const ig_t* __restrict__ w,
           const float* __restrict__ bias, float* __restrict__ y, IG_PROBLEM_ARGS) {
  const IgProblem p = IG_PROBLEM;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  float total[IG_MI][IG_NI][4];
  ig_mainloop(total, x, w, p, m0, n0, 0, p.Kd);
  const int pix = p.Ho * p.Wo;
  ig_for_each(total, m0, n0, [&](int m, int n, float v) {
    if (m < p.M && n < p.N) {
      const int b = n / pix;
      y[((size_t)b * p.M + m) * pix + (n - b * pix)] = v + bias[m];
    }
  });
}
