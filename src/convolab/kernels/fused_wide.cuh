// Rung 28's shared part (fcp_wide): the defines, the geometry of units and k-chunks, the
// element types, input reads and the A operand's loads. A precision's kernel file (28: fp16 and
// tf32; 28b: the split precisions 3xTF32 and 3xfp16) defines FW_PREC, includes this, defines
// its hooks (what a precision changes) and includes fused_wide_kernel.cuh, the staging, k loop,
// store and persistent kernel that call them:
//   fw_store4(dst, v, scale)             four channels of a pixel into the staged image(s)
//   fw_image_exponent<kShared>(xb, red)  the image's power-of-two scale exponent (0: none)
//   fw_weights_small(bw, w_s, at)        a step's second weight operand (may split bw)
//   fw_a_small(a, lo, hi)                a step's second A operand (may split a)
//   fw_step(d, a, as, b, bs)             the MMAs of one A quad and one n-tile
//   fw_unscale(v, w_unscale, a_unscale)  a pooled sum back to the operands' scale
#pragma once
#include "common.cuh"

#ifndef FW_IN_HALF
#define FW_IN_HALF 0
#endif
#ifndef FW_C
#define FW_C 12
#endif
#ifndef FW_H
#define FW_H 33
#endif
#ifndef FW_W
#define FW_W 33
#endif
#ifndef FW_WS
#define FW_WS FW_W  // staged row pitch in pixels (>= FW_W): the host pads it against conflicts
#endif
#ifndef FW_M
#define FW_M 24
#endif
#ifndef FW_K
#define FW_K 5
#endif
#ifndef FW_P
#define FW_P 2
#endif
#ifndef FW_WARPS
#define FW_WARPS 4
#endif
#ifndef FW_UNITS
#define FW_UNITS 2  // units a warp computes together (they share its weight registers)
#endif
#ifndef FW_RP
#define FW_RP 1  // pooled rows of one unit: its FW_P * FW_RP tiles share the shifted fragments
#endif
#ifndef FW_PREFETCH
#define FW_PREFETCH 0  // 1: the next image's bytes arrive by cp.async while this one computes
#endif
#ifndef FW_MINB
#define FW_MINB 1
#endif
#ifndef FW_SPLIT
#define FW_SPLIT 3  // FW_PREC 2: 3 tf32 MMAs, or 2 (big x big in tf32, both cross terms as bf16)
#endif
#ifndef FW_STAGE_UNROLL
#define FW_STAGE_UNROLL 8  // channel quads a thread loads before storing (4 loads each)
#endif

#if FW_PREC == 0 || FW_PREC == 3
typedef __half fw_t;
#define FW_ESIZE 2
#else
typedef float fw_t;
#define FW_ESIZE 4
#endif
#if FW_IN_HALF
typedef __half fw_in_t;
#else
typedef float fw_in_t;
#endif

#define FW_THREADS (FW_WARPS * 32)
#define FW_PARTS (FW_PREC == 3 ? 2 : 1)          // staged images and weight sets (hi, lo)
#define FW_EXACT (FW_PREC >= 2)                  // chunks summed from zero into a total
#define FW_CS ((FW_C + 3) / 4 * 4)             // staged channels: quads (8/16-byte stores)
#define FW_CH (32 / FW_ESIZE)                   // elements of one 32-byte k-chunk
#define FW_WORD (4 / FW_ESIZE)                  // elements of one 4-byte A register
#define FW_RUN (FW_K * FW_CS)                   // one filter row's taps x channels
#define FW_J ((FW_RUN + FW_CH - 1) / FW_CH)     // k-chunks per filter row
#define FW_NT ((FW_M + 7) / 8)                  // n-tiles of output channels
#define FW_HP ((FW_H - FW_K + 1) / FW_P)
#define FW_WP ((FW_W - FW_K + 1) / FW_P)
#define FW_T (FW_P * FW_RP)                    // tiles (output rows) of one unit
#define FW_WPU (16 / FW_P)                      // pool-window columns of one unit
#define FW_AROWS ((FW_HP + FW_RP - 1) / FW_RP)  // unit rows: FW_RP pooled rows each
#define FW_ANCHORS (FW_AROWS * FW_WP)
#define FW_NUNITS ((FW_ANCHORS + FW_WPU - 1) / FW_WPU)
#define FW_NGROUPS ((FW_NUNITS + FW_UNITS - 1) / FW_UNITS)
#define FW_SHIFTS (FW_K + FW_T - 1)
#define FW_ROW (FW_WS * FW_CS)                  // elements of one staged image row
#define FW_WSET (FW_J * FW_K * FW_NT * 32)     // uint2 of one weight set: 8 bytes a lane
#define FW_WBYTES (FW_PARTS * FW_WSET * 8)
// One staged image plus a chunk run of slack: the last row's padded run tail reads past its
// end. 3xfp16 stages two (hi, lo) and keeps the warps' partial maxima after them.
#define FW_IMG1_BYTES (((FW_H * FW_ROW + FW_J * FW_CH) * FW_ESIZE + 15) / 16 * 16)
#define FW_IMG1 (FW_IMG1_BYTES / FW_ESIZE)
#define FW_RED_BYTES (FW_PREC == 3 ? 128 : 0)
#define FW_IMG_BYTES (FW_PARTS * FW_IMG1_BYTES + FW_RED_BYTES)
#define FW_IN_ESIZE (FW_IN_HALF ? 2 : 4)
#define FW_RAW_BYTES (FW_C * FW_H * FW_W * FW_IN_ESIZE)
#define FW_RAW_VEC (FW_RAW_BYTES % 16 == 0 ? 16 : FW_RAW_BYTES % 8 == 0 ? 8 : 4)
#define FW_RAW_SMEM (FW_PREFETCH ? (FW_RAW_BYTES + 15) / 16 * 16 : 0)
#define FW_SMEM_BYTES (FW_WBYTES + FW_IMG_BYTES + FW_RAW_SMEM)

static_assert(FW_P == 2 || FW_P == 4, "fcp_wide pools 2x2 or 4x4 windows");
static_assert(FW_HP >= FW_RP && FW_WP >= 1, "fcp_wide: the output holds no unit of windows");
static_assert(FW_WS >= FW_W, "fcp_wide: the staged row pitch holds a whole image row");
static_assert(!FW_PREFETCH || FW_RAW_BYTES % 4 == 0, "fcp_wide: cp.async moves 4-byte pieces");
static_assert(FW_WARPS <= 32, "fcp_wide: one partial maximum a warp in 128 bytes");

#if FW_PREC == 0 || FW_PREC == 3
#define FW_MMA mma_f16_m16n8k16
#else
#define FW_MMA mma_tf32_m16n8k8
#endif
// One input element as float: from global memory (read-only path) or from the prefetched
// copy in shared memory.
template <bool kShared>
__device__ __forceinline__ float fw_in(const fw_in_t* p) {
#if FW_IN_HALF
  return __half2float(kShared ? *p : __ldg(p));
#else
  return kShared ? *p : __ldg(p);
#endif
}

__device__ __forceinline__ unsigned fw_half2_bits(float lo, float hi) {
  return (unsigned)__half_as_ushort(__float2half_rn(lo)) |
         ((unsigned)__half_as_ushort(__float2half_rn(hi)) << 16);
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float fw_pow2(int e) {
  return __uint_as_float((unsigned)(127 + e) << 23);
}

// Image b's bytes -> raw (shared memory) by cp.async: no registers, in flight while the block
// computes the image before it.
__device__ __forceinline__ void fw_prefetch(unsigned char* raw, const fw_in_t* __restrict__ x,
                                            int b) {
  const unsigned char* src =
      reinterpret_cast<const unsigned char*>(x + (size_t)b * (FW_C * FW_H * FW_W));
  for (int i = threadIdx.x; i < FW_RAW_BYTES / FW_RAW_VEC; i += FW_THREADS) {
#if FW_RAW_VEC == 16
    cp_async16(raw + 16 * i, src + 16 * i);
#elif FW_RAW_VEC == 8
    cp_async8(raw + 8 * i, src + 8 * i, true);
#else
    cp_async4(raw + 4 * i, src + 4 * i, true);
#endif
  }
  cp_async_commit();
}

// Where this lane's A rows of a unit start (elements of img, lane offset included): rows g and
// g+8 are the left and right outputs of the top row of the lane's pool window (tile 0; tile i
// is output row i below). A warp's A load is 8 rows x 16 bytes (lane t: 4 bytes at 4t): lane
// g takes window g (pool 4: half a window), so in fp16 (24-byte pixels, windows 48 bytes
// apart) the 8 rows fill distinct 16-byte bank groups; in fp32 (48-byte pixels) windows 96
// bytes apart reach only the even groups, so lanes g >= 4 swap left and right (row g is their
// window's right output) and take the odd ones. The host pads the staged row pitch (FW_WS) so
// that units wrapping to the next row stay conflict-free too (gpu/fused_wide.row_pitch counts
// the conflicts). A unit is FW_WPU window columns x FW_RP pooled rows; its anchors (top
// windows) run along the rows of anchors, FW_RP pooled rows apart, the last one moved up to fit.
struct FwRows {
  int lo, hi;
  int wy, wx;  // the top window of the lane
  int skip;    // leading window rows the anchor row above also computes (not stored again)
  bool valid;  // false in a partial last unit: a real window recomputed, not stored
};

__device__ __forceinline__ FwRows fw_rows(int unit, int g, int t) {
  const int slot = FW_P == 4 ? g >> 1 : g;
  const int anchor = unit * FW_WPU + slot;
  const int ac = min(anchor, FW_ANCHORS - 1);
  const int arow = ac / FW_WP, wx = ac % FW_WP;
  const int wy = min(arow * FW_RP, FW_HP - FW_RP);
  const int oy = wy * FW_P;
  const int ox = wx * FW_P + (FW_P == 4 ? 2 * (g & 1) : 0);
  const int swap = FW_ESIZE == 4 && g >= 4;
  const int px = (oy * FW_WS + ox) * FW_CS + t * FW_WORD;
  return FwRows{px + swap * FW_CS, px + (1 - swap) * FW_CS, wy, wx, arow * FW_RP - wy,
                anchor < FW_ANCHORS};
}

// One A operand quad in PTX order: a0/a1 rows g/g+8 at k 2t (fp16; tf32: t), a2/a3 the same
// rows 16 bytes on.
struct FwA {
  unsigned r[4];
};

__device__ __forceinline__ unsigned fw_ld32(const fw_t* p) {
  return *reinterpret_cast<const unsigned*>(p);
}

__device__ __forceinline__ FwA fw_lda(const fw_t* lo, const fw_t* hi) {
  return FwA{{fw_ld32(lo), fw_ld32(hi), fw_ld32(lo + FW_CH / 2), fw_ld32(hi + FW_CH / 2)}};
}

__device__ __forceinline__ void fw_mma(float (&d)[4], const FwA& a, uint2 b) {
  FW_MMA(d, a.r[0], a.r[1], a.r[2], a.r[3], b.x, b.y);
}
