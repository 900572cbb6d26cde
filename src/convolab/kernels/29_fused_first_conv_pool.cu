// Rung 29 — the first block of a wider LeNet in one kernel: conv (one input channel, many
// output channels) + bias + ReLU + max-pool, from raw uint8 bytes resized on chip
// (ff_conv_pool_raw, resize.cuh) or from float images (ff_conv_pool_f32); the pooled map is
// written as fp32 or, with FF_HALF, as fp16 for a next layer that reads fp16.
//
// What changes against 16 (fcp_exact_cw): a thread owns one pool window for all FF_MT output
// channels (up to 16), and a block FF_THREADS consecutive windows of one image (row-major, so
// a band of pooled rows), staging just the input rows they read. 16 needs all M channels in
// a thread's multi-window register tile, so the wider models' conv1 (M = 12) ran the pipelined
// kernel 15 instead, in channel groups that each restaged the input (0.95 / 1.17 ms), and from
// raw bytes it also needed rung 25's resized image written and read back first.
// Why: conv1 of ece408-mxnet / eecs498 is 1.3 / 2.0 GFMA, ~0.05 ms at the FFMA peak, against
// 523 / 404 MB of pooled fp32 output (~0.17 / 0.13 ms of HBM writes): the kernel should run at
// its store stream. A warp's 32 consecutive windows make each channel's store 128 contiguous
// bytes (64 in fp16). The weights and bias are by-value kernel parameters, which an FFMA reads
// from the constant bank with no load instruction — as long as the kernel has no loop around
// them: with a loop over windows the compiler hoists all M*K*K weights into registers (227 per
// thread for K = 5), hence one window per thread and more blocks per image.
// Layers with more channels than one launch's FF_MT run one launch per channel group
// (gpu/fused_first.py). The accumulation order (filter rows, then columns, from zero), the
// pooling and the bias are fcp_accumulate's and fcp_store's, so the fp32 output is the same bits
// as the FFMA fused rung's, and a raw image gives the same bits as resize_bilinear's floats.

#include "common.cuh"
#include "resize.cuh"

#ifndef FF_K
#define FF_K 5  // filter size (stride 1)
#endif
#ifndef FF_P
#define FF_P 2  // pool window and stride
#endif
#ifndef FF_H
#define FF_H 70  // input image height (after the resize)
#endif
#ifndef FF_W
#define FF_W 70
#endif
#ifndef FF_MT
#define FF_MT 12  // output channels of one launch
#endif
#ifndef FF_THREADS
#define FF_THREADS 224  // pool windows of a block
#endif
#ifndef FF_MINB
#define FF_MINB 1  // blocks per SM the register allocation must allow
#endif
#ifndef FF_HALF
#define FF_HALF 0  // 1: fp16 output
#endif

#define FF_HP ((FF_H - FF_K + 1) / FF_P)  // pooled rows (floor)
#define FF_WP ((FF_W - FF_K + 1) / FF_P)
#define FF_TASKS (FF_HP * FF_WP)          // pool windows of one image and channel
#define FF_BPI ((FF_TASKS + FF_THREADS - 1) / FF_THREADS)  // blocks per image
#define FF_SPAN (FF_P - 1 + FF_K)         // input rows and columns one window reads
#define FF_VEC ((FF_P % 2) == 0)          // a window's first column is even: float2 loads
#define FF_SPAN2 ((FF_SPAN + 1) / 2 * 2)
#define FF_STRIDE ((FF_W + 1) / 2 * 2)    // shared row stride, even for the float2 loads
// Input rows of a block: its windows span at most ceil((THREADS - 1) / WP) + 1 pooled rows.
#define FF_ROWS_MAX (((FF_THREADS - 1 + FF_WP - 1) / FF_WP) * FF_P + FF_SPAN)
#define FF_ROWS (FF_ROWS_MAX < FF_H ? FF_ROWS_MAX : FF_H)
#define FF_IMG (FF_ROWS * FF_STRIDE + 2)  // + what the last float2 of the last row reads past

#if FF_HALF
typedef __half ff_out;
__device__ __forceinline__ ff_out ff_convert(float v) { return __float2half_rn(v); }
#else
typedef float ff_out;
__device__ __forceinline__ ff_out ff_convert(float v) { return v; }
#endif

struct FirstParams {
  float w[FF_K * FF_K][FF_MT];  // [p * K + q][m]
  float b[FF_MT];
};

// The block's windows and the input rows they read: image b, windows pos0.., rows r0..r0+n-1.
struct FfBand {
  size_t b;
  int pos0, r0, n_rows;
};

__device__ __forceinline__ FfBand ff_band() {
  const int j = blockIdx.x % FF_BPI;
  const int pos0 = j * FF_THREADS;
  const int last = min(pos0 + FF_THREADS, FF_TASKS) - 1;
  const int r0 = (pos0 / FF_WP) * FF_P;
  return FfBand{blockIdx.x / FF_BPI, pos0, r0, (last / FF_WP) * FF_P + FF_SPAN - r0};
}

// The thread's window from the staged rows (img: the band's rows, FF_STRIDE apart) for the
// launch's channels: y_b[m * FF_TASKS + window], m < m_count.
__device__ __forceinline__ void ff_conv_pool(const float* img, const FirstParams& wp,
                                             const FfBand& band, ff_out* __restrict__ y,
                                             int M, int m0, int m_count) {
  static_assert(sizeof(FirstParams) <= 3900, "rung 29: weights exceed the 4 KB parameters");
  const int pos = band.pos0 + threadIdx.x;
  if (pos >= FF_TASKS) return;
  const int ph = pos / FF_WP, pw = pos - ph * FF_WP;
  const float* in_t = img + (ph * FF_P - band.r0) * FF_STRIDE + pw * FF_P;
  float acc[FF_MT][FF_P][FF_P] = {};  // zeros
#pragma unroll
  for (int r = 0; r < FF_SPAN; ++r) {
    float row[FF_SPAN2];
#if FF_VEC
#pragma unroll
    for (int v = 0; v < FF_SPAN2 / 2; ++v) {
      const float2 f = *reinterpret_cast<const float2*>(in_t + r * FF_STRIDE + 2 * v);
      row[2 * v] = f.x;
      row[2 * v + 1] = f.y;
    }
#else
#pragma unroll
    for (int v = 0; v < FF_SPAN; ++v) row[v] = in_t[r * FF_STRIDE + v];
#endif
#pragma unroll
    for (int dy = 0; dy < FF_P; ++dy) {
      const int p = r - dy;  // filter row linking input row r to window row dy
      if (p < 0 || p >= FF_K) continue;
#pragma unroll
      for (int q = 0; q < FF_K; ++q)
#pragma unroll
        for (int dx = 0; dx < FF_P; ++dx)
#pragma unroll
          for (int m = 0; m < FF_MT; ++m)
            acc[m][dy][dx] = fmaf(row[dx + q], wp.w[p * FF_K + q][m], acc[m][dy][dx]);
    }
  }
  ff_out* y_b = y + (band.b * M + m0) * FF_TASKS + pos;
  // max(acc) + b == max(acc + b) exactly (rounding is monotonic); ReLU commutes with max.
#pragma unroll
  for (int m = 0; m < FF_MT; ++m) {
    if (m >= m_count) break;
    float mx = acc[m][0][0];
#pragma unroll
    for (int dy = 0; dy < FF_P; ++dy)
#pragma unroll
      for (int dx = 0; dx < FF_P; ++dx) mx = fmax_nan(mx, acc[m][dy][dx]);
    y_b[m * FF_TASKS] = ff_convert(fmax_nan(mx + wp.b[m], 0.f));
  }
}

// x: (B, 1, FF_H, FF_W) fp32; y: (B, M, HP, WP); this launch writes channels m0 .. m0 +
// m_count - 1. Grid: B * FF_BPI blocks.
extern "C" __global__ void __launch_bounds__(FF_THREADS, FF_MINB)
ff_conv_pool_f32(const float* __restrict__ x, const FirstParams wp, ff_out* __restrict__ y,
                 int M, int m0, int m_count) {
  __shared__ __align__(16) float img[FF_IMG];
  const FfBand band = ff_band();
  const float* src = x + (band.b * FF_H + band.r0) * FF_W;
  for (int i = threadIdx.x; i < band.n_rows * FF_W; i += FF_THREADS) {
    const int r = i / FF_W, c = i - r * FF_W;
    cp_async4(img + r * FF_STRIDE + c, src + i, true);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  ff_conv_pool(img, wp, band, y, M, m0, m_count);
}

// The same from raw images (B, RAW_H, RAW_W): the bytes as floats in [0, 1], the row pass of
// the band's rows, then the column pass into the rows the convolution reads (resize.cuh's rule).
#define FF_UNIT (RAW_H * RAW_W)
#define FF_LOW (FF_IMG > FF_UNIT ? FF_IMG : FF_UNIT)  // the band, over the dead raw floats

extern "C" __global__ void __launch_bounds__(FF_THREADS, FF_MINB)
ff_conv_pool_raw(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
                 const FirstParams wp, ff_out* __restrict__ y, int M, int m0, int m_count) {
  __shared__ __align__(16) float low[FF_LOW];
  __shared__ float rows[FF_ROWS * RAW_W];
  float* img = low;
  float* unit = low;  // read only by the row pass, before the band is written over it
  const FfBand band = ff_band();
  const int tid = threadIdx.x;
  stage_unit_image(unit, raw + band.b * FF_UNIT, FF_UNIT, tid, FF_THREADS);
  __syncthreads();
  resize_rows(rows, unit, taps, band.r0, band.n_rows, FF_H, tid, FF_THREADS);
  __syncthreads();
  for (int i = tid; i < band.n_rows * FF_W; i += FF_THREADS) {
    const int r = i / FF_W, c = i - r * FF_W;
    img[r * FF_STRIDE + c] = resized_from_row(rows + r * RAW_W, taps[FF_H + c]);
  }
  __syncthreads();
  ff_conv_pool(img, wp, band, y, M, m0, m_count);
}
