// Rung 29's shared part: the first block's shape defines (one input channel, stride 1), the
// pooled sizes, the output type, the write of staged pooled maps and the raw input's staging; 29_fused_first_conv_pool.cu
// (FFMA), 29b_fused_first_conv_pool_mma.cu and 29c_fused_first_conv_pool_rowpair.cu (tensor
// cores) include it.
#pragma once
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
#ifndef FF_MINB
#define FF_MINB 1  // blocks per SM the register allocation must allow
#endif
#ifndef FF_HALF
#define FF_HALF 0  // 1: fp16 output
#endif

#define FF_HP ((FF_H - FF_K + 1) / FF_P)  // pooled rows (floor)
#define FF_WP ((FF_W - FF_K + 1) / FF_P)
#define FF_TASKS (FF_HP * FF_WP)          // pool windows of one image and channel

#if FF_HALF
typedef __half ff_out;
__device__ __forceinline__ ff_out ff_convert(float v) { return __float2half_rn(v); }
#else
typedef float ff_out;
__device__ __forceinline__ ff_out ff_convert(float v) { return v; }
#endif

// A block's pooled maps, staged in shared memory as out_s[c][row][pw] (M channels, TPH pooled
// rows from row ph0), to y (B, M, FF_HP, FF_WP) in whole sectors: a whole image's maps are one
// contiguous run, copied 8 bytes a thread where it is aligned; a band of rows is one run per
// channel.
template <int M, int TPH, int THREADS>
__device__ __forceinline__ void ff_write_pooled(ff_out* __restrict__ y, const ff_out* out_s,
                                                size_t b, int ph0) {
  ff_out* const dst = y + b * M * FF_TASKS + ph0 * FF_WP;
  constexpr int kImageBytes = M * FF_TASKS * static_cast<int>(sizeof(ff_out));
  if (TPH == FF_HP && kImageBytes % 8 == 0 && (reinterpret_cast<size_t>(dst) & 7) == 0) {
    for (int i = threadIdx.x; i < kImageBytes / 8; i += THREADS)
      reinterpret_cast<uint2*>(dst)[i] = reinterpret_cast<const uint2*>(out_s)[i];
    return;
  }
  const int rows = min(TPH, FF_HP - ph0);
  for (int c = 0; c < M; ++c)
    for (int i = threadIdx.x; i < rows * FF_WP; i += THREADS)
      dst[c * FF_TASKS + i] = out_s[c * TPH * FF_WP + i];
}

// ---- raw input: one round trip ------------------------------------------------------------------
// A block that reads raw bytes stages, with independent loads all in flight at once, the raw
// image's bytes (784 at 28x28: less than a tenth of a float band), the resize taps and a
// 256-entry table of raw_to_unit (the same division, so the same bits as resize_bilinear),
// then runs the row pass of its rows and the column pass from shared memory alone (before: the
// whole image through 784 divisions, then the band's rows through taps in global memory, four
// dependent round trips). Measured (H100): no faster — the resize costs its instructions, not
// its latency (docs/raw.md, rung 29c).
#define FF_RAW_BYTES (RAW_H * RAW_W)

struct FfRawRows {
  float tab[256];                     // raw_to_unit(v)
  ResizeTap taps[FF_H + FF_W];        // the row taps, then the column taps
  unsigned char bytes[FF_RAW_BYTES];  // the raw image
};

// Stage image `img`'s bytes, the taps and the table (every thread of the block takes part),
// then, after a barrier, the row pass of resized rows row0 .. row0 + n_rows - 1 into rows
// (n_rows x RAW_W floats; resize_rows' arithmetic; rows past the image repeat its last). The
// caller synchronises before reading rows.
__device__ __forceinline__ void ff_raw_rows(float* rows, FfRawRows& s,
                                            const unsigned char* __restrict__ img,
                                            const ResizeTap* __restrict__ taps, int row0,
                                            int n_rows, int tid, int threads) {
  static_assert(sizeof(ResizeTap) == 12, "taps are copied as three words each");
  for (int v = tid; v < 256; v += threads) s.tab[v] = raw_to_unit(static_cast<unsigned char>(v));
  for (int i = tid; i < 3 * (FF_H + FF_W); i += threads)
    reinterpret_cast<int*>(s.taps)[i] = __ldg(reinterpret_cast<const int*>(taps) + i);
  if (FF_RAW_BYTES % 4 == 0 && (reinterpret_cast<size_t>(img) & 3) == 0) {  // whole words
    for (int i = tid; i < FF_RAW_BYTES / 4; i += threads)
      reinterpret_cast<unsigned*>(s.bytes)[i] = __ldg(reinterpret_cast<const unsigned*>(img) + i);
  } else {
    for (int i = tid; i < FF_RAW_BYTES; i += threads) s.bytes[i] = __ldg(img + i);
  }
  __syncthreads();
  for (int i = tid; i < n_rows * RAW_W; i += threads) {
    const int r = i / RAW_W, j = i - r * RAW_W;
    const ResizeTap t = s.taps[min(row0 + r, FF_H - 1)];
    rows[i] = resize_lerp(s.tab[s.bytes[t.lo * RAW_W + j]], s.tab[s.bytes[t.hi * RAW_W + j]],
                          t.t);
  }
}
