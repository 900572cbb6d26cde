// 3xfp16's scale of one image, shared by the conv2 rungs that split their staged image (28b,
// 44, 46) and rung 45, which writes conv2's staged form itself (FR_STG).
#pragma once

// The exponent e of 3xfp16's power-of-two scale for values of largest magnitude m >= 0:
// m 2^e in [2^14, 2^15), fp16's top binade but one (hi rounds up to at most 2^15). 0 for inf
// (NaN never reaches here: fmaxf drops it); at most 126 (all-zero or tiny images), so that
// 2^-e stays a normal float. gpu/fused_wide.fp16_scale_exponent is the host's copy.
__device__ __forceinline__ int fw_scale_exponent(float m) {
  const int biased = (int)((__float_as_uint(m) >> 23) & 0xffu);
  return biased == 0xff ? 0 : min(141 - biased, 126);
}
