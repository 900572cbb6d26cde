// Rung 17 — fused-conv-pool on tensor cores, Toeplitz mapping: fcp_mma_toe. The fusion of
// rung 13 with the convolution as mma.sync instead of FFMA, for conv1-like layers (few output
// channels, C*K <= 8, pool 2): output positions are the 16 A rows, the weights a banded
// (Toeplitz) B operand per filter row (fused_mma.cuh explains the mapping). A 2x2 pool window
// is the 4 accumulators one lane holds, so pooling costs no shuffles.
// TC_PREC 0: fp16 inputs (fused-conv-pool2-tc); 1: tf32 inputs (fused-conv-pool2-tf32).
// Measured: conv1 0.32 ms fp16 with 2 warps per block vs 0.38 with 5 (H100, B=10000).
// fcp_mma_toe_raw: the same kernel reading raw uint8 images and resizing them while staging
// the tile (rung 25's rule, resize.cuh): 784 bytes an image in instead of the 86x86 floats.

#include "fused_mma.cuh"

struct ToeNchwStore {  // fp32 NCHW (B, TC_M, Hp, Wp)
  float* __restrict__ y;
  int Hp, Wp;
  __device__ __forceinline__ void operator()(size_t b, int ph, int pw,
                                             const float (&out)[TC_M]) const {
#pragma unroll
    for (int n = 0; n < TC_M; ++n) y[((b * TC_M + n) * Hp + ph) * (size_t)Wp + pw] = out[n];
  }
};

extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_MINB)
fcp_mma_toe(const float* __restrict__ x, const uint2* __restrict__ bfrag,
            const float* __restrict__ bias, float* __restrict__ y, int H, int W, int Hp, int Wp,
            int tiles_h) {
  toe_conv_pool(ToeFloatInput{x, H, W}, bfrag, bias, Hp, Wp, tiles_h,
                ToeNchwStore{y, Hp, Wp});
}

#if TC_C == 1  // raw images have one channel
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_MINB)
fcp_mma_toe_raw(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
                const uint2* __restrict__ bfrag, const float* __restrict__ bias,
                float* __restrict__ y, int H, int W, int Hp, int Wp, int tiles_h) {
  __shared__ float unit[RAW_H * RAW_W];
  __shared__ float rows[TOE_IR * RAW_W];
  toe_conv_pool(toe_stage_raw(unit, rows, raw, taps, H, W, tiles_h), bfrag, bias, Hp, Wp,
                tiles_h, ToeNchwStore{y, Hp, Wp});
}
#endif
