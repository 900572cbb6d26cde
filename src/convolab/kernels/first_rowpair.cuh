// Rung 29c's row-pair geometry, shared with rung 45 (the same operands on the warpgroup MMA):
// the defines, the float and raw inputs, the staging of the block's tile as fp16 (hi and lo
// parts with the split) and the store of a lane's pooled windows. 29c's header comment says
// what the mapping is; its kernel and 45's include this, define fr_conv_pool and FR_ENTRY,
// and then include first_rowpair_entries.cuh.
#pragma once
#include "first_block.cuh"

#ifndef FR_M
#define FR_M 12  // output channels
#endif
#ifndef FR_SPLIT
#define FR_SPLIT 0  // 1: hi/lo fp16 parts, three MMAs per product
#endif
#ifndef FR_TPH
#define FR_TPH FF_HP  // pooled rows of a block
#endif
#ifndef FR_WARPS
#define FR_WARPS 4
#endif
#ifndef FR_OUT_SMEM
#define FR_OUT_SMEM 0  // 1: stage the pooled output in dynamic shared memory (host sizes it)
#endif

static_assert(FF_P == 2, "a lane's accumulators are one 2x2 pool window");
static_assert(FF_K <= 7, "two outputs an A row need k % 8 - 1 < K");

#define FR_THREADS (FR_WARPS * 32)
#define FR_D (FF_K <= 5 ? 4 : 2)                  // conv columns of an A row (dx)
#define FR_CN (8 / FR_D)                          // channels of an n-tile
#define FR_NT ((FR_M + FR_CN - 1) / FR_CN)        // n-tiles
#define FR_KS ((FF_K + 1) / 2)                    // k-steps: filter-row pairs
#define FR_NA (2 * FR_KS + 1)                     // A words a lane loads an m-tile
#define FR_NR ((2 * FF_WP + FR_D - 1) / FR_D)     // runs (A rows) of a pooled row
#define FR_COMBOS (FR_TPH * FR_NR)                // (pooled row, run) pairs of a block
#define FR_MTILES ((FR_COMBOS + 7) / 8)
#define FR_IR (2 * FR_TPH + 2 * FR_KS - 1)        // staged rows: a3 of the last k-step
#define FR_RS ((FR_NR - 1) * FR_D + 8)            // staged columns (fp16): a run reads 8
#define FR_PAIRS (FR_IR * FR_RS / 2)              // staged pixel pairs
#define FR_PER ((FR_PAIRS + FR_THREADS - 1) / FR_THREADS)  // pairs a thread stages
#define FR_PARTS (FR_SPLIT ? 2 : 1)
#define FR_EMAX 60  // |input scale exponent|: the host keeps the weights' within the same

#ifndef FR_DYN_B
#define FR_DYN_B 0  // 1: the weights in dynamic shared memory, before the staged output (45)
#endif
#if (FR_OUT_SMEM || FR_DYN_B) && !defined(FR_DYN_SMEM)  // (the CPU emulator supplies its own)
// [weights (FR_DYN_B)] [FR_M x FR_TPH x FF_WP ff_out (FR_OUT_SMEM)]
extern __shared__ __align__(16) unsigned char fr_dyn_smem[];
#define FR_DYN_SMEM fr_dyn_smem
#elif !defined(FR_DYN_SMEM)
#define FR_DYN_SMEM static_cast<unsigned char*>(nullptr)  // (not read)
#endif

// The minimal pitch is also conflict-free: a warp's 8 runs read at most 8 * D / 2 + 4
// consecutive words of a row, continuing into the next pooled row where a tile crosses one.

struct FrFloatInput {  // fp32 (B, 1, H, W) in global memory
  const float* __restrict__ x;
  __device__ __forceinline__ float2 operator()(size_t b, int gy, int gx) const {
    float2 v = make_float2(0.f, 0.f);
    if (gy >= FF_H) return v;
    const float* row = x + (b * FF_H + gy) * (size_t)FF_W;
    if (FF_W % 2 == 0) {
      if (gx < FF_W) v = __ldg(reinterpret_cast<const float2*>(row + gx));
    } else {
      if (gx < FF_W) v.x = __ldg(row + gx);
      if (gx + 1 < FF_W) v.y = __ldg(row + gx + 1);
    }
    return v;
  }
};

struct FrRawInput {  // the row pass of the block's rows (ff_raw_rows), in shared memory
  const float* rows;
  const ResizeTap* taps;  // FF_H row taps, then FF_W column taps (shared memory)
  int row0;
  __device__ __forceinline__ float2 operator()(size_t, int gy, int gx) const {
    float2 v = make_float2(0.f, 0.f);
    if (gy < FF_H) {
      const float* row = rows + (gy - row0) * RAW_W;
      if (gx < FF_W) v.x = resized_from_row(row, taps[FF_H + gx]);
      if (gx + 1 < FF_W) v.y = resized_from_row(row, taps[FF_H + gx + 1]);
    }
    return v;
  }
};

__device__ __forceinline__ unsigned fr_half2(float a, float b) {
  const __half2 h = pack_half2(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

// 2^e as a float (|e| <= 126).
__device__ __forceinline__ float fr_pow2(int e) { return __int_as_float((127 + e) << 23); }

// Who stages: FR_THREADS threads, this one FR_STAGE_TID among them, their barrier
// FR_STAGE_SYNC() (the whole block in 29c and 45; kernel 47 gives its conv1 warpgroups theirs).
#ifndef FR_STAGE_TID
#define FR_STAGE_TID threadIdx.x
#define FR_STAGE_SYNC() __syncthreads()
#endif

// The block's tile as fp16 pixel pairs (tile[part][row][col]: part 0 hi, 1 lo), zero outside
// the image; returns the input's scale exponent (0 without the split).
template <typename Input>
__device__ __forceinline__ int fr_stage(Input input, unsigned* tile, size_t b, int iy0,
                                        float* red) {
  float2 v[FR_PER];
  float mx = 0.f;
#pragma unroll
  for (int u = 0; u < FR_PER; ++u) {
    const int i = FR_STAGE_TID + u * FR_THREADS;
    const int row = i / (FR_RS / 2), p2 = i - row * (FR_RS / 2);
    v[u] = make_float2(0.f, 0.f);
    if (i < FR_PAIRS) v[u] = input(b, iy0 + row, 2 * p2);
    mx = fmaxf(mx, fmaxf(fabsf(v[u].x), fabsf(v[u].y)));
  }
  int e = 0;
  float s = 1.f;
#if FR_SPLIT
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((FR_STAGE_TID & 31) == 0) red[FR_STAGE_TID >> 5] = mx;
  FR_STAGE_SYNC();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < FR_WARPS; ++w) mx = fmaxf(mx, red[w]);
  // largest |v| s in [2^14, 2^15): hi stays finite, lo keeps 11 bits for all but tiny values
  const int ex = static_cast<int>((__float_as_uint(mx) >> 23) & 0xff) - 127;
  e = max(-FR_EMAX, min(FR_EMAX, 14 - ex));
  s = fr_pow2(e);
#endif
#pragma unroll
  for (int u = 0; u < FR_PER; ++u) {
    const int i = FR_STAGE_TID + u * FR_THREADS;
    if (i >= FR_PAIRS) break;
    const float a = v[u].x * s, c = v[u].y * s;
    tile[i] = fr_half2(a, c);
#if FR_SPLIT
    const float ah = __half2float(__float2half_rn(a)), ch = __half2float(__float2half_rn(c));
    tile[FR_PAIRS + i] = fr_half2(a - ah, c - ch);
#endif
  }
  (void)red;
  return e;
}

// A lane's pooled windows (its accumulators acc[n][0..3] are one 2x2 window of channel
// n * CN + 2t / D) at run `run` of the block's pooled row ph_l, where `valid` (the lane's row
// of the m-tile is one of the block's): bias, ReLU, the split's unscale, to y or the staged
// maps out_s.
__device__ __forceinline__ void fr_store(const float (&acc)[FR_NT][4], const float (&bm)[FR_NT],
                                         ff_out* __restrict__ y, ff_out* out_s, size_t b,
                                         int tile_y, int ph_l, int run, bool valid,
                                         float unscale) {
  const int t = threadIdx.x & 3;
  const int ph = tile_y * FR_TPH + ph_l, pw = run * (FR_D / 2) + (2 * t % FR_D) / 2;
  if (valid && ph < FF_HP && pw < FF_WP) {
#if FR_OUT_SMEM
    ff_out* yp = out_s + ph_l * FF_WP + pw;
    constexpr int kPlane = FR_TPH * FF_WP;
#else
    ff_out* yp = y + b * FR_M * FF_TASKS + ph * FF_WP + pw;
    constexpr int kPlane = FF_TASKS;
#endif
#pragma unroll
    for (int n = 0; n < FR_NT; ++n) {
      const int c = n * FR_CN + 2 * t / FR_D;
      if (FR_M % FR_CN != 0 && c >= FR_M) continue;
      float v = fmax_nan(fmax_nan(acc[n][0], acc[n][1]), fmax_nan(acc[n][2], acc[n][3]));
      if (FR_SPLIT) v *= unscale;  // exact: a power of two, after the max (monotonic)
      yp[c * kPlane] = ff_convert(fmax_nan(v + bm[n], 0.f));
    }
  }
  (void)y;
  (void)out_s;
}

#ifndef FR_STG
#define FR_STG 0  // 1 (rung 45, split): write conv2's staged records instead of fp32 maps
#endif
#if FR_STG
// The record of one image as rung 46 reads it (FWS_STAGED_IN): part 0 (hi) then part 1 (lo) of
// conv2's staged image, each FR_STG_IMG1 fp16 elements (pixel (y, x), channel c at
// (y FR_STG_WS + x) FR_STG_CS + c; row padding and slack never written: the host zeroes the
// records once), then the image's scale exponent (an int) FR_STG_REC - 16 bytes in.
#ifndef FR_STG_WS
#define FR_STG_WS FF_WP
#endif
#ifndef FR_STG_CS
#define FR_STG_CS ((FR_M + 3) / 4 * 4)
#endif
#ifndef FR_STG_IMG1
#define FR_STG_IMG1 (FF_HP * FR_STG_WS * FR_STG_CS)
#endif
#ifndef FR_STG_REC
#define FR_STG_REC (2 * FR_STG_IMG1 * 2 + 16)
#endif
static_assert(FR_SPLIT && !FF_HALF, "staged records come from the split, fp32 sums");
static_assert(FR_TPH == FF_HP, "staged records: a whole image a block (one scale)");

// A lane's pooled windows (fr_store's) as conv2's staged hi and lo parts of v 2^e2: bias, ReLU,
// the split's unscale, then conv2's split (fw_store4's: hi = fp16(s), lo = fp16(s - hi)). The
// caller folds 2^e2 into both (powers of two: the same bits wherever s is a normal float), so
// that the scale costs no instruction here: u = unscale 2^e2, bs = the bias 2^e2.
__device__ __forceinline__ void fr_store_staged(const float (&acc)[FR_NT][4],
                                                const float (&bs)[FR_NT],
                                                __half* __restrict__ rec, int ph, int run,
                                                bool valid, float u) {
  const int t = threadIdx.x & 3;
  const int pw = run * (FR_D / 2) + (2 * t % FR_D) / 2;
  if (valid && ph < FF_HP && pw < FF_WP) {
    __half* const px = rec + (ph * FR_STG_WS + pw) * FR_STG_CS;
#pragma unroll
    for (int n = 0; n < FR_NT; ++n) {
      const int c = n * FR_CN + 2 * t / FR_D;
      if (FR_M % FR_CN != 0 && c >= FR_M) continue;
      float v = fmax_nan(fmax_nan(acc[n][0], acc[n][1]), fmax_nan(acc[n][2], acc[n][3]));
      const float s = fmax_nan(v * u + bs[n], 0.f);
      const __half hi = __float2half_rn(s);
      px[c] = hi;
      px[FR_STG_IMG1 + c] = __float2half_rn(s - __half2float(hi));
    }
  }
}
#endif

// The bias of this lane's channel in each n-tile (n * CN + 2t / D).
__device__ __forceinline__ void fr_bias(float (&bm)[FR_NT], const float* __restrict__ bias) {
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
  for (int n = 0; n < FR_NT; ++n) {
    const int c = n * FR_CN + 2 * t / FR_D;
    bm[n] = c < FR_M ? __ldg(&bias[c]) : 0.f;
  }
}
