// Rung 16 — fused-conv-pool with constant weights: fcp_exact_cw. rung 13's fcp_exact with the
// weights as a by-value kernel parameter instead of a shared-memory tile.
//
// Why: fcp_exact spends a broadcast float4 shared-memory load on weights for every
// 4 x FCP_COLS FMAs (conv1: 98 loads per 1568 FMAs of a pooled row), and ncu shows its
// shared-memory pipe, not the FMA pipe, setting the pace. Kernel parameters live in the
// constant bank, and an FFMA can take a constant-bank operand directly when every lane reads
// the same address, so weights passed by value cost no instruction at all: the inner loop
// becomes 3 row loads per input row and FFMAs. It needs every weight index to be a
// compile-time constant (C == FCP_CC, all M channels in one thread: FCP_MG == 1, grid.y == 1)
// and the weights to fit the 4 KB parameter space: conv1-like layers.
// Measured: conv1 0.568 ms vs 0.696 fcp_exact (H100, B=10000).
// fcp_exact_cw_raw: the same reading raw uint8 images, resized while the tile is staged
// (rung 25's rule, resize.cuh): 784 bytes an image in instead of the 86x86 floats.

#include "fused_conv_pool.cuh"

struct FcpParamWeights {
  float w[FCP_CC][FCP_K * FCP_K][FCP_MT];  // [c][p * K + q][m]
};

struct FcpConstWeights {
  const float (&wc)[FCP_K * FCP_K][FCP_MT];
  __device__ __forceinline__ void operator()(int p, int q, float (&wv)[FCP_MT]) const {
#pragma unroll
    for (int m = 0; m < FCP_MT; ++m) wv[m] = wc[p * FCP_K + q][m];
  }
};

// The kernel after its input tile is staged: stage(in_s, b, iy0, ix0, tid) fills the tile
// and leaves it visible to the whole block.
template <typename Stage>
__device__ __forceinline__ void fcp_cw_body(Stage stage, const FcpParamWeights& wp,
                                            const float* __restrict__ bias,
                                            float* __restrict__ y, int M, int Hp, int Wp,
                                            int tiles_w, int tiles_per_image) {
  static_assert(FCP_MG == 1, "fcp_exact_cw: one channel group per block");
  static_assert(sizeof(FcpParamWeights) <= 3900, "fcp_exact_cw: weights exceed the 4 KB params");
  __shared__ __align__(16) float in_s[FCP_CC * FCP_IN_TILE];
  const int tile = blockIdx.x % tiles_per_image;
  const size_t b = blockIdx.x / tiles_per_image;
  const int tile_y = tile / tiles_w, tile_x = tile % tiles_w;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * FCP_TX + tx;
  const int pw0 = (tile_x * FCP_TX + tx) * FCP_PW;
  const int iy0 = tile_y * FCP_TY * FCP_RPT * FCP_P * FCP_S;
  const int ix0 = tile_x * FCP_TX * FCP_COL_STEP;
  stage(in_s, b, iy0, ix0, tid);
  for (int rr = 0; rr < FCP_RPT; ++rr) {
    const int ty_in_tile = rr * FCP_TY + ty;
    float acc[FCP_MT][FCP_P][FCP_COLS] = {};  // zeros
    const float* in_t = in_s + (ty_in_tile * FCP_P * FCP_S) * FCP_IN_STRIDE + tx * FCP_COL_STEP;
#pragma unroll
    for (int cc = 0; cc < FCP_CC; ++cc)  // C == FCP_CC: every weight index is a constant
      fcp_accumulate(acc, in_t + cc * FCP_IN_TILE, FcpConstWeights{wp.w[cc]});
    fcp_store(acc, bias, y, b, M, 0, Hp, Wp, tile_y * FCP_TY * FCP_RPT + ty_in_tile, pw0);
  }
}

extern "C" __global__ void __launch_bounds__(FCP_THREADS, FCP_MINB)
fcp_exact_cw(const float* __restrict__ x, const FcpParamWeights wp,
             const float* __restrict__ bias, float* __restrict__ y, int C, int H, int W, int M,
             int Hp, int Wp, int tiles_w, int tiles_per_image) {
  fcp_cw_body(
      [=](float* in_s, size_t b, int iy0, int ix0, int tid) {
        fcp_stage_tile(in_s, x, x + b * C * (size_t)H * W, 0, C, H, W, iy0, ix0, tid,
                       (W % 2 == 0) && (ix0 % 2 == 0));
        cp_async_wait_all();
        __syncthreads();
      },
      wp, bias, y, M, Hp, Wp, tiles_w, tiles_per_image);
}

#if FCP_CC == 1  // raw images have one channel
extern "C" __global__ void __launch_bounds__(FCP_THREADS, FCP_MINB)
fcp_exact_cw_raw(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
                 const FcpParamWeights wp, const float* __restrict__ bias,
                 float* __restrict__ y, int H, int W, int M, int Hp, int Wp, int tiles_w,
                 int tiles_per_image) {
  __shared__ float unit[RAW_H * RAW_W];
  __shared__ float rows[FCP_IN_ROWS * RAW_W];
  fcp_cw_body(
      [=](float* in_s, size_t b, int iy0, int ix0, int tid) {
        stage_unit_image(unit, raw + b * (RAW_H * RAW_W), RAW_H * RAW_W, tid, FCP_THREADS);
        __syncthreads();
        fcp_stage_resized_tile(in_s, rows, unit, taps, H, W, iy0, ix0, tid);
        __syncthreads();
      },
      wp, bias, y, M, Hp, Wp, tiles_w, tiles_per_image);
}
#endif
