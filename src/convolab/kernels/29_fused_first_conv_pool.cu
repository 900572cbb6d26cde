// Rung 29 — the first block of a wider LeNet in one kernel: conv (one input channel, many
// output channels) + bias + ReLU + max-pool, from raw uint8 bytes resized on chip (the _raw
// entries, resize.cuh) or from float images (the _f32 entries), writing the pooled map as fp32
// or, with FF_HALF, as fp16 for a next layer that reads fp16. Two families: this file's
// ff_conv_pool_* (FFMA, modes 'exact' and 'tf32'), and 29b_fused_first_conv_pool_mma.cu's
// ff_toe_* (fp16 tensor cores, kernel 17's Toeplitz mapping in channel groups, mode 'fp16');
// first_block.cuh holds what they share.
//
// What changes against 15/16 (FFMA) and 17 (tensor cores), and why. The wider models' conv1
// (M = 12) fit neither 16 (all M channels in one thread's multi-window tile, weights as
// constant-bank operands) nor 17 (the B fragments of all M channels in registers: 120-168), so
// they ran 15 in three channel groups that each restaged the input (0.95 / 1.17 ms) and, from
// raw bytes, behind rung 25's resized image (written and read back). Here:
//   * one input band is staged once for every channel: the FFMA family loops over channel
//     groups of FF_MT inside the block, the tensor-core family over groups of TC_M, each group's
//     weights loaded once per block and used for all its windows;
//   * FFMA: a thread owns one pool window, a block FF_THREADS consecutive windows (row-major:
//     a band of pooled rows), so a warp's store of one channel is 32 consecutive values. The
//     weights live in shared memory, read as broadcast float4s: as by-value parameters (16's
//     constant-bank operands) they ran 2-4x slower here — 1.2-2.4 KB of weights thrash the
//     constant cache that 16's 0.8 KB fits (H100: mxnet 1.33 ms, eecs498 3.05 ms raw);
//   * tensor cores: 17's body with the channel loop outside the tile loop.
// conv1 is 13.1 (mxnet) / 19.8 (eecs498) GFMA at B = 10,000: 0.39 / 0.59 ms at the FFMA peak,
// above its 0.18 / 0.14 ms of fp32 output at HBM speed — FMA-bound, not memory-bound.
// The FFMA accumulation order (filter rows, then columns, from zero), pooling and bias are
// fcp_accumulate's and fcp_store's: the fp32 output is the same bits as the FFMA fused rung's.
// A raw image gives the same bits as resize_bilinear's floats in both families.
// Measured (H100, B = 10,000, float / raw input): FFMA mxnet 0.81 / 0.96 ms (before: 1.25 /
// 1.39 with rung 25), eecs498 1.14 / 1.42 (1.25 / 1.37), ~50 % of the FFMA peak; fp16 tensor
// cores mxnet 0.41 / 0.58 (mode fp16 before: 1.64 / 1.80), eecs498 0.41 / 0.52 (1.14 / 1.27).
// The raw entries pay 0.17-0.28 ms for the resize. Neither a 256-entry table instead of the 784
// divisions a block nor one global round trip instead of four dependent ones (first_block.cuh)
// moved them (1.00 / 1.43 ms raw): the blocks' bands overlap (1.4x the image's pixels resized)
// and each resized pixel costs ~30 instructions, 15-20 % of the FFMA work. Modes exact and tf32
// now run 29c's 3xfp16 instead (0.44-0.52 ms); ece408's conv1 (M = 4) is faster on 16 / 17.

#include "first_block.cuh"

// =============================================================================================
// FFMA: one pool window of FF_MT channels per thread, FF_G channel groups per block.
#ifndef FF_MT
#define FF_MT 12  // output channels of a group (accumulators: FF_MT * P * P)
#endif
#ifndef FF_G
#define FF_G 1  // channel groups: the layer has at most FF_G * FF_MT channels
#endif
#ifndef FF_THREADS
#define FF_THREADS 224  // pool windows of a block
#endif

#define FF_MT4 ((FF_MT + 3) / 4 * 4)
#define FF_WG (FF_K * FF_K * FF_MT4)      // floats of one group's weights: [p * K + q][MT4]
#define FF_WALL (FF_G * (FF_WG + FF_MT4))  // every group's weights, then every group's bias
#define FF_BPI ((FF_TASKS + FF_THREADS - 1) / FF_THREADS)  // blocks per image
#define FF_SPAN (FF_P - 1 + FF_K)         // input rows and columns one window reads
#define FF_VEC ((FF_P % 2) == 0)          // a window's first column is even: float2 loads
#define FF_SPAN2 ((FF_SPAN + 1) / 2 * 2)
#define FF_STRIDE ((FF_W + 1) / 2 * 2)    // shared row stride, even for the float2 loads
// Input rows of a block: its windows span at most ceil((THREADS - 1) / WP) + 1 pooled rows.
#define FF_ROWS_MAX (((FF_THREADS - 1 + FF_WP - 1) / FF_WP) * FF_P + FF_SPAN)
#define FF_ROWS (FF_ROWS_MAX < FF_H ? FF_ROWS_MAX : FF_H)
#define FF_IMG (FF_ROWS * FF_STRIDE + 2)  // + what the last float2 of the last row reads past

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

// Every group's weights and bias (host-packed, FF_WALL floats) -> shared memory.
__device__ __forceinline__ void ff_stage_weights(float* w_s, const float* __restrict__ wpack) {
  for (int i = threadIdx.x; i < FF_WALL / 4; i += FF_THREADS)
    reinterpret_cast<float4*>(w_s)[i] = __ldg(reinterpret_cast<const float4*>(wpack) + i);
}

// The thread's window from the staged rows (img: the band's rows, FF_STRIDE apart), every
// channel group in turn.
__device__ __forceinline__ void ff_conv_pool(const float* img, const float* w_s,
                                             const FfBand& band, ff_out* __restrict__ y,
                                             int M) {
  const int pos = band.pos0 + threadIdx.x;
  if (pos >= FF_TASKS) return;
  const int ph = pos / FF_WP, pw = pos - ph * FF_WP;
  const float* in_t = img + (ph * FF_P - band.r0) * FF_STRIDE + pw * FF_P;
  ff_out* y_b = y + band.b * M * FF_TASKS + pos;
#pragma unroll 1
  for (int g = 0; g < FF_G; ++g) {
    const float* wg = w_s + g * FF_WG;
    float acc[FF_MT][FF_P][FF_P] = {};  // zeros
#pragma unroll 1
    for (int p = 0; p < FF_K; ++p) {
      float rows[FF_P][FF_SPAN2];  // input rows p .. p + P - 1 of the window
#pragma unroll
      for (int dy = 0; dy < FF_P; ++dy) {
#if FF_VEC
#pragma unroll
        for (int v = 0; v < FF_SPAN2 / 2; ++v) {
          const float2 f =
              *reinterpret_cast<const float2*>(in_t + (p + dy) * FF_STRIDE + 2 * v);
          rows[dy][2 * v] = f.x;
          rows[dy][2 * v + 1] = f.y;
        }
#else
#pragma unroll
        for (int v = 0; v < FF_SPAN; ++v) rows[dy][v] = in_t[(p + dy) * FF_STRIDE + v];
#endif
      }
#pragma unroll
      for (int q = 0; q < FF_K; ++q) {
        float wv[FF_MT4];  // w[m][p][q] of the group: broadcast loads, 4 channels each
#pragma unroll
        for (int v = 0; v < FF_MT4 / 4; ++v) {
          const float4 f = *reinterpret_cast<const float4*>(wg + (p * FF_K + q) * FF_MT4 + 4 * v);
          wv[4 * v] = f.x; wv[4 * v + 1] = f.y; wv[4 * v + 2] = f.z; wv[4 * v + 3] = f.w;
        }
#pragma unroll
        for (int dy = 0; dy < FF_P; ++dy)
#pragma unroll
          for (int dx = 0; dx < FF_P; ++dx)
#pragma unroll
            for (int m = 0; m < FF_MT; ++m)
              acc[m][dy][dx] = fmaf(rows[dy][dx + q], wv[m], acc[m][dy][dx]);
      }
    }
    // max(acc) + b == max(acc + b) exactly (rounding is monotonic); ReLU commutes with max.
    const float* bias = w_s + FF_G * FF_WG + g * FF_MT4;
#pragma unroll
    for (int m = 0; m < FF_MT; ++m) {
      const int c = g * FF_MT + m;
      if (c >= M) break;
      float mx = acc[m][0][0];
#pragma unroll
      for (int dy = 0; dy < FF_P; ++dy)
#pragma unroll
        for (int dx = 0; dx < FF_P; ++dx) mx = fmax_nan(mx, acc[m][dy][dx]);
      y_b[c * FF_TASKS] = ff_convert(fmax_nan(mx + bias[m], 0.f));
    }
  }
}

// x: (B, 1, FF_H, FF_W) fp32; y: (B, M, HP, WP). Grid: B * FF_BPI blocks.
extern "C" __global__ void __launch_bounds__(FF_THREADS, FF_MINB)
ff_conv_pool_f32(const float* __restrict__ x, const float* __restrict__ wpack,
                 ff_out* __restrict__ y, int M) {
  __shared__ __align__(16) float img[FF_IMG];
  __shared__ __align__(16) float w_s[FF_WALL];
  const FfBand band = ff_band();
  const float* src = x + (band.b * FF_H + band.r0) * FF_W;
  for (int i = threadIdx.x; i < band.n_rows * FF_W; i += FF_THREADS) {
    const int r = i / FF_W, c = i - r * FF_W;
    cp_async4(img + r * FF_STRIDE + c, src + i, true);
  }
  cp_async_commit();
  ff_stage_weights(w_s, wpack);
  cp_async_wait_all();
  __syncthreads();
  ff_conv_pool(img, w_s, band, y, M);
}

// The same from raw images (B, RAW_H, RAW_W): the image's bytes and taps (first_block.cuh's
// ff_raw_rows, one round trip), the row pass of the band's rows, then the column pass into the
// rows the convolution reads (resize.cuh's rule).
extern "C" __global__ void __launch_bounds__(FF_THREADS, FF_MINB)
ff_conv_pool_raw(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
                 const float* __restrict__ wpack, ff_out* __restrict__ y, int M) {
  __shared__ __align__(16) float img[FF_IMG];
  __shared__ float rows[FF_ROWS * RAW_W];
  __shared__ __align__(16) float w_s[FF_WALL];
  __shared__ __align__(16) FfRawRows raw_s;
  const FfBand band = ff_band();
  const int tid = threadIdx.x;
  ff_stage_weights(w_s, wpack);
  ff_raw_rows(rows, raw_s, raw + band.b * FF_RAW_BYTES, taps, band.r0, band.n_rows, tid,
              FF_THREADS);
  __syncthreads();
  for (int i = tid; i < band.n_rows * FF_W; i += FF_THREADS) {
    const int r = i / FF_W, c = i - r * FF_W;
    img[r * FF_STRIDE + c] = resized_from_row(rows + r * RAW_W, raw_s.taps[FF_H + c]);
  }
  __syncthreads();
  ff_conv_pool(img, w_s, band, y, M);
}
