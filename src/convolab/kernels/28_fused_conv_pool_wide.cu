// Rung 28 — fused-conv-pool on tensor cores for wide layers: fcp_wide. Rung 18 (fcp_mma_wa)
// with the roles of its operands swapped, for conv2-like layers with many output channels and
// a long reduction (the wider zoo models' conv2: C = 12 -> M = 24, K = 5 or 7).
//
// Why rung 18 cannot take them: it keeps the weights as the 16-row A operand in registers
// (M <= 16, C*K <= 32) and orders k as (c, p, q) with each filter row padded to 8 taps, which
// wastes 3/8 of every MMA at K = 5. Here:
//   * output positions are the 16 A rows and the output channels the n side: M = 24 is three
//     n-tiles of 8, no padding (rung 18's mapping would need two 16-row tiles: 25% idle);
//   * k is ordered (p, q, c), channels innermost, and the block's input is staged channels-last
//     (HWC) in shared memory, so for one position and filter row p the K*C taps are one
//     contiguous run: only the run's tail is padded to the MMA's k (60 -> 64 at K = 5 fp16);
//   * a 32-byte k-chunk is one MMA's k in the PTX order, so each A register is one 4-byte
//     load straight into its slot of the operand quad (lane t: bytes 4t and 16 + 4t of rows g
//     and g+8); the B fragment (weights, packed on the host in the same order) is one 8-byte
//     load per n-tile;
//   * the tiles of a unit are the output rows of its pool windows (FW_RP pooled rows): tile i
//     at filter row p reads input row i + p, so one loaded fragment (shift s) serves tile i
//     with p = s - i for every i: K + T - 1 fragment loads feed T*K MMA columns;
//   * a lane holds rows g and g+8 of each tile: the two left/right outputs of its window's row
//     (pool 2; pool 4: half the window, and one shuffle), so pooling is a max over registers;
//   * the whole image (staged once per image, optionally prefetched by cp.async) and all
//     weights (staged once per block: the grid is persistent) live in shared memory; a warp
//     keeps one k-chunk's weights for all K filter rows in registers while it works through
//     FW_UNITS units; the staged row pitch is padded so that the A loads hit distinct banks.
// FW_PREC 0: fp16 operands (m16n8k16); 1: tf32 (m16n8k8, inputs rounded rna while staged);
// 2: 3xTF32 (each operand split big + small, each k-chunk summed from zero and added into a
// separate total: fp32 accuracy on the tensor cores) in 3 tf32 MMAs, or (FW_SPLIT 2) big x big
// in tf32 plus both cross terms as one bf16 MMA; the split truncates (big = the top 19 bits,
// small = the exact rest, whose low bits the MMA drops: ~2^-21 an operand, 2 instructions);
// 3: 3xfp16, exact like 3xTF32 at twice the MMA rate: each operand is scaled by a power of two
// into fp16's range and split hi + lo (11 significant bits each), three m16n8k16 MMAs
// (hi x lo, lo x hi, hi x hi). The weights are scaled and split on the host (max |w| s_w in
// [2^14, 2^15)); each image is scaled by its own max |x| (a block reduction while staging) and
// split once as it is staged into two images, hi and lo; the pooled sum is multiplied by
// 1 / (s_w s_a), exactly (powers of two). Accumulation is fp32.
// FW_IN_HALF 1: the input is fp16 NCHW (a previous layer's fp16 output), else fp32 NCHW.
// Only finite reads: the padded tail of a run reads the next pixel's channels (weight 0), so a
// NaN input pixel may also spread to the horizontally adjacent window (tensor-core rungs'
// NaN policy: a NaN window is NaN, other images are untouched).
//
// Measured (H100, B = 10000, docs/raw.md). Before, with two 8-byte A row loads that ptxas
// moved into each quad (178 MOV a 60-HMMA loop) and a rounding 3xTF32 split (compare-and-
// select code): conv2 of ece408-mxnet fp16 0.47 ms, tf32 0.94, 3xTF32 2.60; eecs498 0.51 /
// 0.85 / 2.75. Now (a K = 5 fp16 loop: 60 HMMA, 63 LDS, 11 other): mxnet fp16 0.46, tf32
// 0.79, 3xTF32 1.87, 3xfp16 1.17; eecs498 0.47 / 0.77 / 2.07 / 1.32 (FFMA rung: 5.94 / 4.54).
// The moves were not what held fp16 back: ncu shows the tensor pipe 46-57% busy with 3.5
// warps a scheduler and no eligible warp 63% of the cycles (latency, not issue).

#include "common.cuh"

#ifndef FW_PREC
#define FW_PREC 0
#endif
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
#if FW_PREC == 2 && FW_SPLIT == 2
#include <cuda_bf16.h>
#endif
static_assert(FW_SPLIT == 2 || FW_SPLIT == 3, "fcp_wide: 3xTF32 takes 3 or 2 MMAs a step");

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

// The exponent e of 3xfp16's power-of-two scale for values of largest magnitude m >= 0:
// m 2^e in [2^14, 2^15), fp16's top binade but one (hi rounds up to at most 2^15). 0 for inf
// (NaN never reaches here: fmaxf drops it); at most 126 (all-zero or tiny images), so that
// 2^-e stays a normal float. gpu/fused_wide.fp16_scale_exponent is the host's copy.
__device__ __forceinline__ int fw_scale_exponent(float m) {
  const int biased = (int)((__float_as_uint(m) >> 23) & 0xffu);
  return biased == 0xff ? 0 : min(141 - biased, 126);
}

// Four consecutive channels of one pixel into the staged image: one 8-byte (fp16) or 16-byte
// (fp32) store; at a pixel pitch of 24 or 48 bytes a half-warp's (quarter-warp's) stores hit
// distinct banks. 3xfp16: v times 2^e split into hi (img) and lo (the image after it).
__device__ __forceinline__ void fw_store4(fw_t* dst, const float (&v)[4], float scale) {
#if FW_PREC == 0
  *reinterpret_cast<uint2*>(dst) = make_uint2(fw_half2_bits(v[0], v[1]),
                                              fw_half2_bits(v[2], v[3]));
#elif FW_PREC == 1
  *reinterpret_cast<float4*>(dst) =
      make_float4(tf32_round(v[0]), tf32_round(v[1]), tf32_round(v[2]), tf32_round(v[3]));
#elif FW_PREC == 2
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

// Image (NCHW, in global memory or its prefetched copy) -> img (HWC, channels padded to FW_CS
// with zeros). Threads walk pixels fastest, so each of a quad's four loads is coalesced along
// the image rows (and conflict-free in shared memory).
template <bool kShared>
__device__ __forceinline__ void fw_stage_image(fw_t* img, const fw_in_t* __restrict__ xb,
                                               float scale) {
  constexpr int PIX = FW_H * FW_W, ITEMS = PIX * (FW_CS / 4);
  for (int base = threadIdx.x; base < ITEMS; base += FW_THREADS * FW_STAGE_UNROLL) {
    float v[FW_STAGE_UNROLL][4];
#pragma unroll
    for (int u = 0; u < FW_STAGE_UNROLL; ++u) {
      const int i = base + u * FW_THREADS;
      const int quad = i / PIX, pix = i - quad * PIX;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 4 * quad + e;
        v[u][e] = (i < ITEMS && c < FW_C) ? fw_in<kShared>(xb + (size_t)c * PIX + pix) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < FW_STAGE_UNROLL; ++u) {
      const int i = base + u * FW_THREADS;
      const int quad = i / PIX, pix = i - quad * PIX;
      const int row_pad = (pix / FW_W) * (FW_WS - FW_W);
      if (i < ITEMS) fw_store4(img + (pix + row_pad) * FW_CS + 4 * quad, v[u], scale);
    }
  }
}

#if FW_PREC == 3
// 3xfp16's scale for one image: 2^e with e from the image's max |x| (fw_scale_exponent), the
// same in every thread. red: FW_WARPS floats of shared memory. Reads the image once more
// before staging (from L2 or the prefetched copy); returns after a barrier.
template <bool kShared>
__device__ __forceinline__ int fw_image_exponent(const fw_in_t* __restrict__ xb, float* red) {
  constexpr int N = FW_C * FW_H * FW_W;
  float m = 0.f;
#pragma unroll 8
  for (int i = threadIdx.x; i < N; i += FW_THREADS) m = fmaxf(m, fabsf(fw_in<kShared>(xb + i)));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < FW_WARPS; ++w) m = fmaxf(m, red[w]);
  return fw_scale_exponent(m);
}
#endif

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

// The MMAs of one A quad and one n-tile's weights: b / bs are the weights (3xTF32: big and
// small; 3xfp16: hi and lo), as the small (lo) part of the A quad (3xTF32, 3xfp16).
__device__ __forceinline__ void fw_step(float (&d)[4], const FwA& a, const FwA& as, uint2 b,
                                        uint2 bs) {
#if FW_PREC == 2 && FW_SPLIT == 2
  fw_mma_split2(d, a, as, b, bs);
#else
#if FW_EXACT
  fw_mma(d, as, b);
  fw_mma(d, a, bs);
#endif
  fw_mma(d, a, b);
#endif
}

// The units of one group: total[u][i][n] is tile i (output row i of the unit) x n-tile n. A
// partial last group recomputes real windows rather than branch, so the compiler interleaves
// the units' loads and MMAs.
__device__ __forceinline__ void fw_group(const fw_t* img, const uint2* w_s, int group, int lane,
                                         float (&total)[FW_UNITS][FW_T][FW_NT][4],
                                         FwRows (&rows)[FW_UNITS]) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < FW_UNITS; ++u) {
    rows[u] = fw_rows(group * FW_UNITS + u, g, t);
#pragma unroll
    for (int i = 0; i < FW_T; ++i)
#pragma unroll
      for (int n = 0; n < FW_NT; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) total[u][i][n][r] = 0.f;
  }
#if FW_EXACT
  float acc[FW_UNITS][FW_T][FW_NT][4];
#else
  float (&acc)[FW_UNITS][FW_T][FW_NT][4] = total;
#endif
#pragma unroll 1
  for (int j = 0; j < FW_J; ++j) {
    uint2 bw[FW_K][FW_NT], bs[FW_K][FW_NT];
#pragma unroll
    for (int p = 0; p < FW_K; ++p)
#pragma unroll
      for (int n = 0; n < FW_NT; ++n) {
        const int at = ((j * FW_K + p) * FW_NT + n) * 32 + lane;
        bw[p][n] = w_s[at];
#if FW_PREC == 2
        bs[p][n] = make_uint2(fw_small(bw[p][n].x), fw_small(bw[p][n].y));
#if FW_SPLIT == 2
        bs[p][n] = make_uint2(fw_bf16x2(bw[p][n].x, bw[p][n].y),
                              fw_bf16x2(bs[p][n].x, bs[p][n].y));
#endif
#elif FW_PREC == 3
        bs[p][n] = w_s[FW_WSET + at];
#else
        bs[p][n] = bw[p][n];  // unused
#endif
      }
#if FW_EXACT
#pragma unroll
    for (int u = 0; u < FW_UNITS; ++u)
#pragma unroll
      for (int i = 0; i < FW_T; ++i)
#pragma unroll
        for (int n = 0; n < FW_NT; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[u][i][n][r] = 0.f;
#endif
#pragma unroll
    for (int u = 0; u < FW_UNITS; ++u) {
      const fw_t* lo_p = img + rows[u].lo + j * FW_CH;
      const fw_t* hi_p = img + rows[u].hi + j * FW_CH;
#pragma unroll
      for (int s = 0; s < FW_SHIFTS; ++s) {
        FwA a = fw_lda(lo_p + s * FW_ROW, hi_p + s * FW_ROW);
#if FW_PREC == 2
        const FwA as = fw_split(a);
#elif FW_PREC == 3
        const FwA as = fw_lda(lo_p + s * FW_ROW + FW_IMG1, hi_p + s * FW_ROW + FW_IMG1);
#else
        const FwA& as = a;  // unused
#endif
#pragma unroll
        for (int i = 0; i < FW_T; ++i) {
          const int p = s - i;
          if (p < 0 || p >= FW_K) continue;
#pragma unroll
          for (int n = 0; n < FW_NT; ++n) fw_step(acc[u][i][n], a, as, bw[p][n], bs[p][n]);
        }
      }
    }
#if FW_EXACT
#pragma unroll
    for (int u = 0; u < FW_UNITS; ++u)
#pragma unroll
      for (int i = 0; i < FW_T; ++i)
#pragma unroll
        for (int n = 0; n < FW_NT; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) total[u][i][n][r] += acc[u][i][n][r];
#endif
  }
}

// Pool, unscale (3xfp16), bias, ReLU and store one unit. c0/c1 of a tile are the lane's row
// g, channels 2t and 2t+1 of the n-tile; c2/c3 the same channels of row g+8. The unscale
// factors are powers of two (> 0): they commute with the max, and each product is exact.
__device__ __forceinline__ void fw_store(const float (&acc)[FW_T][FW_NT][4], FwRows rows,
                                         int lane, const float* __restrict__ bias,
                                         float* __restrict__ y, size_t b, float w_unscale,
                                         float a_unscale) {
  const int g = lane >> 2, t = lane & 3;
  const bool writer = rows.valid && (FW_P == 2 || (g & 1) == 0);
#pragma unroll
  for (int r = 0; r < FW_RP; ++r)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = CONVOLAB_NEG_INF;
#pragma unroll
        for (int i = r * FW_P; i < (r + 1) * FW_P; ++i)
          v = fmax_nan(v, fmax_nan(acc[i][n][e], acc[i][n][2 + e]));
#if FW_P == 4
        v = fmax_nan(v, __shfl_xor_sync(0xffffffffu, v, 4));  // lane g^1: the other 2 columns
#endif
#if FW_PREC == 3
        v = v * w_unscale * a_unscale;
#endif
        const int m = n * 8 + 2 * t + e;
        if (writer && r >= rows.skip && m < FW_M)
          y[((b * FW_M + m) * FW_HP + rows.wy + r) * (size_t)FW_WP + rows.wx] =
              fmax_nan(v + __ldg(bias + m), 0.f);
      }
}

// Persistent: each block stages the weight fragments once, then loops over images. With
// FW_PREFETCH the next image's bytes land in shared memory while this one computes, and
// staging is a shared-to-shared transpose. w_unscale: 3xfp16's 2^-e of the weights' scale
// (ignored otherwise).
extern "C" __global__ void __launch_bounds__(FW_THREADS, FW_MINB)
fcp_wide(const fw_in_t* __restrict__ x, const uint4* __restrict__ wfrag,
         const float* __restrict__ bias, float* __restrict__ y, int batch, float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  const uint2* w_s = reinterpret_cast<const uint2*>(fw_smem);
  fw_t* img = reinterpret_cast<fw_t*>(fw_smem + FW_WBYTES);
  for (int i = threadIdx.x; i < FW_WBYTES / 16; i += FW_THREADS)
    reinterpret_cast<uint4*>(fw_smem)[i] = __ldg(wfrag + i);
  // The row padding and the slack past the image are read (times zero weights) but never
  // staged: zero them once (in each staged image).
  constexpr int PAD = (FW_WS - FW_W) * FW_CS, PAD1 = PAD > 0 ? PAD : 1;
#pragma unroll
  for (int part = 0; part < FW_PARTS; ++part) {
    fw_t* im = img + part * FW_IMG1;
    for (int i = threadIdx.x; i < FW_H * PAD; i += FW_THREADS)
      im[(i / PAD1) * FW_ROW + FW_W * FW_CS + i % PAD1] = fw_t(0.f);
    for (int i = FW_H * FW_ROW + threadIdx.x; i < FW_IMG1; i += FW_THREADS) im[i] = fw_t(0.f);
  }
#if FW_PREC == 3
  float* red = reinterpret_cast<float*>(fw_smem + FW_WBYTES + FW_PARTS * FW_IMG1_BYTES);
#endif
#if FW_PREFETCH
  unsigned char* raw = fw_smem + FW_WBYTES + FW_IMG_BYTES;
  if ((int)blockIdx.x < batch) fw_prefetch(raw, x, blockIdx.x);
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Which warp starts an image's groups turns image by image: where the groups do not split
  // evenly, the extra ones go to every warp (and scheduler) in turn.
  int turn = blockIdx.x;
  for (int b = blockIdx.x; b < batch; b += gridDim.x, ++turn) {
    int e = 0;  // 3xfp16: the image's scale 2^e
#if FW_PREFETCH
    const fw_in_t* xb = reinterpret_cast<const fw_in_t*>(raw);
    cp_async_wait_all();
    __syncthreads();  // image b has landed; every warp is done with the previous image
#if FW_PREC == 3
    e = fw_image_exponent<true>(xb, red);
#endif
    fw_stage_image<true>(img, xb, fw_pow2(e));
    __syncthreads();  // img is staged and raw is free
    if (b + (int)gridDim.x < batch) fw_prefetch(raw, x, b + gridDim.x);
#else
    const fw_in_t* xb = x + (size_t)b * (FW_C * FW_H * FW_W);
    __syncthreads();  // every warp is done with the previous image
#if FW_PREC == 3
    e = fw_image_exponent<false>(xb, red);
#endif
    fw_stage_image<false>(img, xb, fw_pow2(e));
    __syncthreads();
#endif
    const float a_unscale = fw_pow2(-e);
    for (int group = (warp + turn) % FW_WARPS; group < FW_NGROUPS; group += FW_WARPS) {
      float total[FW_UNITS][FW_T][FW_NT][4];
      FwRows rows[FW_UNITS];
      fw_group(img, w_s, group, lane, total, rows);
#pragma unroll
      for (int u = 0; u < FW_UNITS; ++u)
        fw_store(total[u], rows[u], lane, bias, y, (size_t)b, w_unscale, a_unscale);
    }
  }
}
