// Rung 29's shared part: the first block's shape defines (one input channel, stride 1), the
// pooled sizes and the output type; 29_fused_first_conv_pool.cu (FFMA) and
// 29b_fused_first_conv_pool_mma.cu (fp16 tensor cores) include it.
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
