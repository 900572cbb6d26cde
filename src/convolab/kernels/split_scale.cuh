// 3xfp16's scale of one image, shared by the conv2 rungs that split their staged image (28b,
// 44, 46) and rung 45, which writes conv2's staged form itself (FR_STG); and of a whole input,
// in the wgmma implicit GEMM's layout pass (39).
#pragma once

// The exponent e of 3xfp16's power-of-two scale for values of largest magnitude m >= 0:
// m 2^e in [2^14, 2^15), fp16's top binade but one (hi rounds up to at most 2^15). 0 for inf
// (NaN never reaches here: fmaxf drops it); at most 126 (all-zero or tiny images), so that
// 2^-e stays a normal float. gpu/fused_wide.fp16_scale_exponent is the host's copy.
__device__ __forceinline__ int fw_scale_exponent(float m) {
  const int biased = (int)((__float_as_uint(m) >> 23) & 0xffu);
  return biased == 0xff ? 0 : min(141 - biased, 126);
}

// The max of each thread's m over a block of WARPS warps, the same in every thread (fmaxf drops
// NaN). red: WARPS floats of shared memory; returns after a barrier.
template <int WARPS>
__device__ __forceinline__ float fw_block_max(float m, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) m = fmaxf(m, red[w]);
  return m;
}
