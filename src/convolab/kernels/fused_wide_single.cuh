// Rung 28's hooks (fused_wide.cuh lists them) for one operand part: fp16 (FW_PREC 0) or tf32
// (1). Rung 28 and the wgmma rung 44 include this after fused_wide.cuh.
#pragma once

static_assert(FW_PREC == 0 || FW_PREC == 1, "rung 28 runs fp16 (0) and tf32 (1); 28b splits");

// Four consecutive channels of one pixel into the staged image: one 8-byte (fp16) or 16-byte
// (tf32) store; at a pixel pitch of 24 or 48 bytes a half-warp's (quarter-warp's) stores hit
// distinct banks.
__device__ __forceinline__ void fw_store4(fw_t* dst, const float (&v)[4], float) {
#if FW_PREC == 0
  *reinterpret_cast<uint2*>(dst) = make_uint2(fw_half2_bits(v[0], v[1]),
                                              fw_half2_bits(v[2], v[3]));
#else
  *reinterpret_cast<float4*>(dst) =
      make_float4(tf32_round(v[0]), tf32_round(v[1]), tf32_round(v[2]), tf32_round(v[3]));
#endif
}

// One operand part: no scale, no second parts, one MMA a step.
template <bool kShared>
__device__ __forceinline__ int fw_image_exponent(const fw_in_t*, float*) { return 0; }
__device__ __forceinline__ uint2 fw_weights_small(uint2& bw, const uint2*, int) { return bw; }
__device__ __forceinline__ FwA fw_a_small(FwA& a, const fw_t*, const fw_t*) { return a; }
__device__ __forceinline__ void fw_step(float (&d)[4], const FwA& a, const FwA&, uint2 b,
                                        uint2) {
  fw_mma(d, a, b);
}
__device__ __forceinline__ float fw_unscale(float v, float, float) { return v; }
