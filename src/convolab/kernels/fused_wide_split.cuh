// Rung 28b's hooks (fused_wide.cuh lists them) for the split precisions: 3xTF32 (FW_PREC 2)
// and 3xfp16 (3). Rung 28b and the wgmma rung 44 include this after fused_wide.cuh.
#pragma once

#if FW_PREC == 2 && FW_SPLIT == 2
#include <cuda_bf16.h>
#endif

#include "split_scale.cuh"

static_assert(FW_PREC == 2 || FW_PREC == 3, "rung 28b runs 3xTF32 (2) and 3xfp16 (3)");
static_assert(FW_SPLIT == 2 || FW_SPLIT == 3, "fcp_wide: 3xTF32 takes 3 or 2 MMAs a step");


// Four consecutive channels of one pixel into the staged image(s): 3xTF32 one 16-byte store
// (split as it is loaded for the MMAs); 3xfp16 v times 2^e split into hi (img) and lo (the
// image after it).
__device__ __forceinline__ void fw_store4(fw_t* dst, const float (&v)[4], float scale) {
#if FW_PREC == 2
  *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
#else
  float hi[4], lo[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float s = v[e] * scale;  // exact: a power of two
    hi[e] = __half2float(__float2half_rn(s));
    lo[e] = s - hi[e];  // exact in fp32
  }
  *reinterpret_cast<uint2*>(dst) = make_uint2(fw_half2_bits(hi[0], hi[1]),
                                              fw_half2_bits(hi[2], hi[3]));
  *reinterpret_cast<uint2*>(dst + FW_IMG1) = make_uint2(fw_half2_bits(lo[0], lo[1]),
                                                        fw_half2_bits(lo[2], lo[3]));
#endif
}

#if FW_PREC == 3
// The block's scale exponent from each thread's partial max |x| m (fw_scale_exponent of the
// block's maximum), the same in every thread. red: FW_WARPS floats of shared memory; returns
// after a barrier.
__device__ __forceinline__ int fw_block_exponent(float m, float* red) {
  return fw_scale_exponent(fw_block_max<FW_WARPS>(m, red));
}

// 3xfp16's scale for one image: 2^e with e from the image's max |x| (fw_scale_exponent), the
// same in every thread. red: FW_WARPS floats of shared memory. Reads the image once more
// before staging (from L2 or the prefetched copy); returns after a barrier.
template <bool kShared>
__device__ __forceinline__ int fw_image_exponent(const fw_in_t* __restrict__ xb, float* red) {
  constexpr int N = FW_C * FW_H * FW_W;
  float m = 0.f;
#pragma unroll 8
  for (int i = threadIdx.x; i < N; i += FW_THREADS) m = fmaxf(m, fabsf(fw_in<kShared>(xb + i)));
  return fw_block_exponent(m, red);
}
#else
template <bool kShared>
__device__ __forceinline__ int fw_image_exponent(const fw_in_t*, float*) { return 0; }
#endif

#if FW_PREC == 2
// 3xTF32's truncating split of one fp32 register: big keeps sign, exponent and the top 10
// mantissa bits (all a tf32 operand holds), small = v - big exactly (13 bits, of which the
// MMA reads the top 11).
__device__ __forceinline__ unsigned fw_small(unsigned& v) {
  const unsigned big = v & 0xffffe000u;
  const unsigned small = __float_as_uint(__uint_as_float(v) - __uint_as_float(big));
  v = big;
  return small;
}

__device__ __forceinline__ FwA fw_split(FwA& a) {
  FwA s;
#pragma unroll
  for (int i = 0; i < 4; ++i) s.r[i] = fw_small(a.r[i]);
  return s;
}
#endif
#if FW_PREC == 2 && FW_SPLIT == 2
// Two 32-bit floats as one bf16x2 register, x in the low half (lower k).
__device__ __forceinline__ unsigned fw_bf16x2(unsigned x, unsigned y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(__uint_as_float(x), __uint_as_float(y));
  return *reinterpret_cast<const unsigned*>(&h);
}

// 2 MMAs a step instead of 3: big x big in tf32, and the cross terms small_a x big_b +
// big_a x small_b as one bf16 m16n8k16 whose k runs over both: lane t's k 2t, 2t+1 carry
// (small_a, big_b) of its two tf32 k (t, t + 4) and k 2t+8, 2t+9 (big_a, small_b). A cross
// term is ~2^-11 of the product and bf16 keeps 8 bits of it: ~2^-20 relative, as 3xTF32's
// dropped small x small. bx = {bf16x2(big_b), bf16x2(small_b)}.
__device__ __forceinline__ void fw_mma_split2(float (&d)[4], const FwA& a, const FwA& as,
                                              uint2 bw, uint2 bx) {
  mma_bf16_m16n8k16(d, fw_bf16x2(as.r[0], as.r[2]), fw_bf16x2(as.r[1], as.r[3]),
                    fw_bf16x2(a.r[0], a.r[2]), fw_bf16x2(a.r[1], a.r[3]), bx.x, bx.y);
  fw_mma(d, a, bw);
}
#endif

// A step's second weight operand: 3xTF32 splits bw (big stays in bw; with FW_SPLIT 2 both as
// bf16x2 pairs), 3xfp16 reads the lo weight set after the hi one.
__device__ __forceinline__ uint2 fw_weights_small(uint2& bw, const uint2* w_s, int at) {
#if FW_PREC == 2
  uint2 bs = make_uint2(fw_small(bw.x), fw_small(bw.y));
#if FW_SPLIT == 2
  bs = make_uint2(fw_bf16x2(bw.x, bw.y), fw_bf16x2(bs.x, bs.y));
#endif
  return bs;
#else
  return w_s[FW_WSET + at];
#endif
}

// A step's second A operand: 3xTF32 splits a, 3xfp16 loads the lo image's quad.
__device__ __forceinline__ FwA fw_a_small(FwA& a, const fw_t* lo, const fw_t* hi) {
#if FW_PREC == 2
  return fw_split(a);
#else
  return fw_lda(lo + FW_IMG1, hi + FW_IMG1);
#endif
}

// The MMAs of one A quad and one n-tile's weights: b / bs are the weights (3xTF32: big and
// small; 3xfp16: hi and lo), as the small (lo) part of the A quad. The small products first.
__device__ __forceinline__ void fw_step(float (&d)[4], const FwA& a, const FwA& as, uint2 b,
                                        uint2 bs) {
#if FW_PREC == 2 && FW_SPLIT == 2
  fw_mma_split2(d, a, as, b, bs);
#else
  fw_mma(d, as, b);
  fw_mma(d, a, bs);
  fw_mma(d, a, b);
#endif
}

// 3xfp16's pooled sum back to the operands' scale (powers of two: exact, and they commute
// with the max).
__device__ __forceinline__ float fw_unscale(float v, float w_unscale, float a_unscale) {
  return FW_PREC == 3 ? v * w_unscale * a_unscale : v;
}
