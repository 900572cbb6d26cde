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
//   * within a 32-byte k-chunk, lane t's four (fp16) or two (tf32) k values are the 8 bytes at
//     offset 8t, so each A fragment row is one 8-byte load and the B fragment (weights, packed
//     on the host in the same order) is one 8-byte load per n-tile;
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
// in tf32 plus both cross terms as one bf16 MMA. Accumulation is fp32.
// FW_IN_HALF 1: the input is fp16 NCHW (a previous layer's fp16 output), else fp32 NCHW.
// Only finite reads: the padded tail of a run reads the next pixel's channels (weight 0), so a
// NaN input pixel may also spread to the horizontally adjacent window (tensor-core rungs'
// NaN policy: a NaN window is NaN, other images are untouched).
//
// Measured (H100, B = 10000, docs/raw.md): conv2 of ece408-mxnet fp16 0.47 ms, tf32 0.94,
// 3xTF32 2.60 (FW_SPLIT 2: 2.22-2.47) against the FFMA rung's 5.96; eecs498 0.51 / 0.85 / 2.75
// (2.50-2.57) against 4.54. That is ~0.25 MMAs a clock an SM, ~1/3 of the measured cuBLAS
// ceiling, in every precision; prefetching, two-row units, the conflict-free pitch and twice
// the blocks an SM each moved it by less than 10%. The SASS assembles each A quad from the two
// 8-byte row loads with ~3 register moves an MMA (178 MOV in a 60-HMMA loop), and split 3's
// cvt.rna.tf32 becomes a compare-and-select sequence: the next things to remove.

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

#if FW_PREC == 0
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
#define FW_CS ((FW_C + 3) / 4 * 4)             // staged channels: quads (8/16-byte stores)
#define FW_CH (32 / FW_ESIZE)                   // elements of one 32-byte k-chunk
#define FW_LANE_ELEMS (FW_CH / 4)               // lane t's elements of a chunk (8 bytes)
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
#define FW_WBYTES (FW_J * FW_K * FW_NT * 256)   // weight fragments: 8 bytes a lane
// The image plus a chunk run of slack: the last row's padded run tail reads past its end.
#define FW_IMG_BYTES (((FW_H * FW_ROW + FW_J * FW_CH) * FW_ESIZE + 15) / 16 * 16)
#define FW_IN_ESIZE (FW_IN_HALF ? 2 : 4)
#define FW_RAW_BYTES (FW_C * FW_H * FW_W * FW_IN_ESIZE)
#define FW_RAW_VEC (FW_RAW_BYTES % 16 == 0 ? 16 : FW_RAW_BYTES % 8 == 0 ? 8 : 4)
#define FW_RAW_SMEM (FW_PREFETCH ? (FW_RAW_BYTES + 15) / 16 * 16 : 0)
#define FW_SMEM_BYTES (FW_WBYTES + FW_IMG_BYTES + FW_RAW_SMEM)

static_assert(FW_P == 2 || FW_P == 4, "fcp_wide pools 2x2 or 4x4 windows");
static_assert(FW_HP >= FW_RP && FW_WP >= 1, "fcp_wide: the output holds no unit of windows");
static_assert(FW_WS >= FW_W, "fcp_wide: the staged row pitch holds a whole image row");
static_assert(!FW_PREFETCH || FW_RAW_BYTES % 4 == 0, "fcp_wide: cp.async moves 4-byte pieces");

#if FW_PREC == 0
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

// Four consecutive channels of one pixel into the staged image: one 8-byte (fp16) or 16-byte
// (fp32) store; at a pixel pitch of 24 or 48 bytes a half-warp's (quarter-warp's) stores hit
// distinct banks.
__device__ __forceinline__ void fw_store4(fw_t* dst, const float (&v)[4]) {
#if FW_PREC == 0
  *reinterpret_cast<uint2*>(dst) = make_uint2(fw_half2_bits(v[0], v[1]),
                                              fw_half2_bits(v[2], v[3]));
#elif FW_PREC == 1
  *reinterpret_cast<float4*>(dst) =
      make_float4(tf32_round(v[0]), tf32_round(v[1]), tf32_round(v[2]), tf32_round(v[3]));
#else
  *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
#endif
}

// Image (NCHW, in global memory or its prefetched copy) -> img (HWC, channels padded to FW_CS
// with zeros). Threads walk pixels fastest, so each of a quad's four loads is coalesced along
// the image rows (and conflict-free in shared memory).
template <bool kShared>
__device__ __forceinline__ void fw_stage_image(fw_t* img, const fw_in_t* __restrict__ xb) {
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
      if (i < ITEMS) fw_store4(img + (pix + row_pad) * FW_CS + 4 * quad, v[u]);
    }
  }
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
// is output row i below). A half-warp's four lanes read 8 bytes each from four windows' rows;
// fp16 gives them every other window (pixels 4 x 24 bytes apart), tf32 consecutive ones (2 x
// 48 bytes): distinct banks within an image row, and the host pads the staged row pitch
// (FW_WS) so that units wrapping to the next row stay conflict-free too
// (gpu/fused_wide.row_pitch counts the conflicts). A unit is FW_WPU window columns x FW_RP
// pooled rows; its anchors (top windows) run along the rows of anchors, FW_RP pooled rows
// apart, the last one moved up to fit.
struct FwRows {
  int lo, hi;
  int wy, wx;  // the top window of the lane
  int skip;    // leading window rows the anchor row above also computes (not stored again)
  bool valid;  // false in a partial last unit: a real window recomputed, not stored
};

__device__ __forceinline__ FwRows fw_rows(int unit, int g, int t) {
  const int slot = FW_P == 4 ? g >> 1 : FW_PREC == 0 ? 2 * (g & 3) + (g >> 2) : g;
  const int anchor = unit * FW_WPU + slot;
  const int ac = min(anchor, FW_ANCHORS - 1);
  const int arow = ac / FW_WP, wx = ac % FW_WP;
  const int wy = min(arow * FW_RP, FW_HP - FW_RP);
  const int oy = wy * FW_P;
  const int ox = wx * FW_P + (FW_P == 4 ? 2 * (g & 1) : 0);
  const int lo = (oy * FW_WS + ox) * FW_CS + t * FW_LANE_ELEMS;
  return FwRows{lo, lo + FW_CS, wy, wx, arow * FW_RP - wy, anchor < FW_ANCHORS};
}

__device__ __forceinline__ uint2 fw_ld8(const fw_t* p) {
  return *reinterpret_cast<const uint2*>(p);
}

#if FW_PREC == 2
// uint2 of two fp32 values -> its tf32 big part (in place) and the tf32 small part.
__device__ __forceinline__ uint2 fw_split(uint2& v) {
  float x = __uint_as_float(v.x), y = __uint_as_float(v.y);
  const float sx = tf32_split(x), sy = tf32_split(y);
  v = make_uint2(__float_as_uint(x), __float_as_uint(y));
  return make_uint2(__float_as_uint(sx), __float_as_uint(sy));
}
#endif
#if FW_PREC == 2 && FW_SPLIT == 2
// The pair (x, y) of 32-bit floats as one bf16x2 register, x in the low half (lower k).
__device__ __forceinline__ unsigned fw_bf16x2(uint2 v) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(__uint_as_float(v.x), __uint_as_float(v.y));
  return *reinterpret_cast<const unsigned*>(&h);
}

// 2 MMAs a step instead of 3: big x big in tf32, and the cross terms small_a x big_b +
// big_a x small_b as one bf16 m16n8k16 whose k runs over both: lane t's k 2t, 2t+1 carry
// (small_a, big_b) and k 2t+8, 2t+9 (big_a, small_b) of its two elements. A cross term is
// ~2^-11 of the product and bf16 keeps 8 bits of it: ~2^-20 relative, as 3xTF32's dropped
// small x small. bx = {bf16x2(big_b), bf16x2(small_b)}.
__device__ __forceinline__ void fw_mma_split2(float (&d)[4], uint2 lo, uint2 hi, uint2 lo_s,
                                              uint2 hi_s, uint2 bw, uint2 bx) {
  mma_bf16_m16n8k16(d, fw_bf16x2(lo_s), fw_bf16x2(hi_s), fw_bf16x2(lo), fw_bf16x2(hi), bx.x,
                    bx.y);
  mma_tf32_m16n8k8(d, lo.x, hi.x, lo.y, hi.y, bw.x, bw.y);
}
#endif

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
#if FW_PREC == 2
  float acc[FW_UNITS][FW_T][FW_NT][4];
#else
  float (&acc)[FW_UNITS][FW_T][FW_NT][4] = total;
#endif
#pragma unroll 1
  for (int j = 0; j < FW_J; ++j) {
    uint2 bw[FW_K][FW_NT];
#if FW_PREC == 2
    uint2 bs[FW_K][FW_NT];
#endif
#pragma unroll
    for (int p = 0; p < FW_K; ++p)
#pragma unroll
      for (int n = 0; n < FW_NT; ++n) {
        bw[p][n] = w_s[((j * FW_K + p) * FW_NT + n) * 32 + lane];
#if FW_PREC == 2
        bs[p][n] = fw_split(bw[p][n]);
#if FW_SPLIT == 2
        bs[p][n] = make_uint2(fw_bf16x2(bw[p][n]), fw_bf16x2(bs[p][n]));
#endif
#endif
      }
#if FW_PREC == 2
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
        uint2 lo = fw_ld8(lo_p + s * FW_ROW), hi = fw_ld8(hi_p + s * FW_ROW);
#if FW_PREC == 2
        const uint2 lo_s = fw_split(lo), hi_s = fw_split(hi);
#endif
#pragma unroll
        for (int i = 0; i < FW_T; ++i) {
          const int p = s - i;
          if (p < 0 || p >= FW_K) continue;
#pragma unroll
          for (int n = 0; n < FW_NT; ++n) {
#if FW_PREC == 2 && FW_SPLIT == 2
            fw_mma_split2(acc[u][i][n], lo, hi, lo_s, hi_s, bw[p][n], bs[p][n]);
#else
#if FW_PREC == 2
            FW_MMA(acc[u][i][n], lo_s.x, hi_s.x, lo_s.y, hi_s.y, bw[p][n].x, bw[p][n].y);
            FW_MMA(acc[u][i][n], lo.x, hi.x, lo.y, hi.y, bs[p][n].x, bs[p][n].y);
#endif
            FW_MMA(acc[u][i][n], lo.x, hi.x, lo.y, hi.y, bw[p][n].x, bw[p][n].y);
#endif
          }
        }
      }
    }
#if FW_PREC == 2
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

// Pool, bias, ReLU and store one unit. c0/c1 of a tile are the lane's row g, channels 2t and
// 2t+1 of the n-tile; c2/c3 the same channels of row g+8.
__device__ __forceinline__ void fw_store(const float (&acc)[FW_T][FW_NT][4], FwRows rows,
                                         int lane, const float* __restrict__ bias,
                                         float* __restrict__ y, size_t b) {
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
        const int m = n * 8 + 2 * t + e;
        if (writer && r >= rows.skip && m < FW_M)
          y[((b * FW_M + m) * FW_HP + rows.wy + r) * (size_t)FW_WP + rows.wx] =
              fmax_nan(v + __ldg(bias + m), 0.f);
      }
}

// Persistent: each block stages the weight fragments once, then loops over images. With
// FW_PREFETCH the next image's bytes land in shared memory while this one computes, and
// staging is a shared-to-shared transpose.
extern "C" __global__ void __launch_bounds__(FW_THREADS, FW_MINB)
fcp_wide(const fw_in_t* __restrict__ x, const uint4* __restrict__ wfrag,
         const float* __restrict__ bias, float* __restrict__ y, int batch) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  const uint2* w_s = reinterpret_cast<const uint2*>(fw_smem);
  fw_t* img = reinterpret_cast<fw_t*>(fw_smem + FW_WBYTES);
  for (int i = threadIdx.x; i < FW_WBYTES / 16; i += FW_THREADS)
    reinterpret_cast<uint4*>(fw_smem)[i] = __ldg(wfrag + i);
  // The row padding and the slack past the image are read (times zero weights) but never
  // staged: zero them once.
  constexpr int PAD = (FW_WS - FW_W) * FW_CS, PAD1 = PAD > 0 ? PAD : 1;
  for (int i = threadIdx.x; i < FW_H * PAD; i += FW_THREADS)
    img[(i / PAD1) * FW_ROW + FW_W * FW_CS + i % PAD1] = fw_t(0.f);
  for (int i = FW_H * FW_ROW + threadIdx.x; i < FW_IMG_BYTES / FW_ESIZE; i += FW_THREADS)
    img[i] = fw_t(0.f);
#if FW_PREFETCH
  unsigned char* raw = fw_smem + FW_WBYTES + FW_IMG_BYTES;
  if ((int)blockIdx.x < batch) fw_prefetch(raw, x, blockIdx.x);
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int b = blockIdx.x; b < batch; b += gridDim.x) {
#if FW_PREFETCH
    cp_async_wait_all();
    __syncthreads();  // image b has landed; every warp is done with the previous image
    fw_stage_image<true>(img, reinterpret_cast<const fw_in_t*>(raw));
    __syncthreads();  // img is staged and raw is free
    if (b + (int)gridDim.x < batch) fw_prefetch(raw, x, b + gridDim.x);
#else
    __syncthreads();  // every warp is done with the previous image
    fw_stage_image<false>(img, x + (size_t)b * (FW_C * FW_H * FW_W));
    __syncthreads();
#endif
    for (int group = warp; group < FW_NGROUPS; group += FW_WARPS) {
      float total[FW_UNITS][FW_T][FW_NT][4];
      FwRows rows[FW_UNITS];
      fw_group(img, w_s, group, lane, total, rows);
#pragma unroll
      for (int u = 0; u < FW_UNITS; ++u) fw_store(total[u], rows[u], lane, bias, y, (size_t)b);
    }
  }
}
