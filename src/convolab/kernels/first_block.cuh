// Rung 29's shared part: the first block's shape defines (one input channel, stride 1), the
// pooled sizes, the output type and the raw input's staging; 29_fused_first_conv_pool.cu
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

// ---- raw input: only the raw rows a band reads ------------------------------------------------
// A block that convolves resized rows row0 .. row0 + n_rows - 1 needs the raw rows between the
// first row's low tap and the last row's high tap (taps are monotonic), not the whole image:
// those bytes are staged as they are, and each is turned into [0, 1] through a 256-entry table
// of raw_to_unit (the same division, so the same bits as resize_bilinear), computed once per
// block: 256 divisions instead of one per raw pixel, and no float copy of the image.
#define FF_RAW_BYTES (RAW_H * RAW_W)

struct FfRawRows {
  float tab[256];                     // raw_to_unit(v)
  unsigned char bytes[FF_RAW_BYTES];  // the raw rows lo .. hi (at most the whole image)
};

// The row pass of resized rows row0 .. row0 + n_rows - 1 of raw image `img` into rows (n_rows x
// RAW_W floats): resize_rows' arithmetic, reading bytes through the table. Every thread of the
// block takes part; the caller synchronises before reading rows.
__device__ __forceinline__ void ff_raw_rows(float* rows, FfRawRows& s,
                                            const unsigned char* __restrict__ img,
                                            const ResizeTap* __restrict__ taps, int row0,
                                            int n_rows, int H, int tid, int threads) {
  const int lo = taps[min(row0, H - 1)].lo;
  const int hi = taps[min(row0 + n_rows - 1, H - 1)].hi;
  const int n = (hi - lo + 1) * RAW_W;
  for (int v = tid; v < 256; v += threads) s.tab[v] = raw_to_unit(static_cast<unsigned char>(v));
  const unsigned char* src = img + lo * RAW_W;
  if (RAW_W % 4 == 0 && (reinterpret_cast<size_t>(src) & 3) == 0) {  // whole words
    for (int i = tid; i < n / 4; i += threads)
      reinterpret_cast<unsigned*>(s.bytes)[i] = __ldg(reinterpret_cast<const unsigned*>(src) + i);
  } else {
    for (int i = tid; i < n; i += threads) s.bytes[i] = __ldg(src + i);
  }
  __syncthreads();
  for (int i = tid; i < n_rows * RAW_W; i += threads) {
    const int r = i / RAW_W, j = i - r * RAW_W;
    const ResizeTap t = taps[min(row0 + r, H - 1)];
    rows[i] = resize_lerp(s.tab[s.bytes[(t.lo - lo) * RAW_W + j]],
                          s.tab[s.bytes[(t.hi - lo) * RAW_W + j]], t.t);
  }
}
