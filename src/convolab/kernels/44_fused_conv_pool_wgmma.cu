// Rung 44 — rung 28's fused conv + bias + ReLU + max-pool for wide layers (fcp_wgmma), with
// the MMAs on Hopper's warpgroup MMA (wgmma, sm_90a) instead of mma.sync.
//
// Rung 28 runs its MMAs at about a third of the tensor cores' rate: each m16n8k16 is one
// warp instruction of 2048 FMAs, and with 3-4 warps a scheduler the warps wait on their
// shared-memory loads between them (docs/raw.md). A wgmma of 64 rows x N x 16 is one
// instruction of a warpgroup, asynchronous: its B operand (the weights) comes from shared
// memory by descriptor, so no warp loads weight fragments at all, and the warps load the next
// A operand while the tensor cores work on this one.
//   * The A operand comes from registers, loaded exactly as rung 28 loads it (fw_rows, fw_lda):
//     warp w of a warpgroup holds rows 16w..16w+15 of the 64, which are rung 28's unit 4G + w
//     (8 pool windows x left/right output), so one wgmma m-tile is 4 of rung 28's units.
//   * Input row s of the unit (shift s) feeds tile 0 (the windows' top output row) at filter
//     row p = s and tile 1 (bottom row) at p = s - 1, one wgmma of N = 8 NT each from the same
//     A registers. The host stores the weight blocks (chunk j, filter row p: 8 NT channels x
//     16 k) as 8 x 16-byte core matrices without swizzle, filter rows falling.
//   * Each shift is one commit group. FW_RING A slots let FW_RING - 1 groups run while the
//     warps load the next shift's A (a slot is rewritten only after wait_group has retired the
//     group that read it).
//   * What sets the pace is not the groups in flight but the chains of wgmmas into one set of
//     accumulators: a wgmma of N = 24 takes ~12 cycles of the tensor cores, but the next one
//     into the same registers waits ~100 for it (measured: the ring depth 3-6 did not move
//     the time; fp16 took ~120 cycles a shift, 3xfp16 with three wgmmas a tile ~300). So a
//     tile keeps FW_SETS independent accumulator sets: fp16 alternates shifts between them,
//     3xfp16 gives each of its three products (lo x hi, hi x lo, hi x hi of rung 28b's scaled
//     split) its own; each k-chunk's three sums start from zero and go into the fp32 total at
//     the chunk's end, once the chunk has retired.
// The staging, pooled store and per-image scale are rung 28's (fused_wide_stage.cuh and the
// precision's hooks); FW_WGS warpgroups a block share the staged image and the weights.

#ifndef FW_PREC
#define FW_PREC 3
#endif
#ifndef FW_WGS
#define FW_WGS 1  // warpgroups a block
#endif
#ifndef FW_RING
#define FW_RING 4  // A slots: FW_RING - 1 commit groups in flight
#endif
#ifndef FW_SETS
#define FW_SETS (FW_PREC == 3 ? 3 : 2)  // accumulator sets a tile: independent wgmma chains
#endif
#define FW_WARPS (4 * FW_WGS)
#define FW_UNITS 1  // one unit a warp: its 16 rows of the warpgroup's 64
#include "fused_wide.cuh"
#if FW_PREC == 3
#include "fused_wide_split.cuh"
#else
#include "fused_wide_single.cuh"
#endif
#include "fused_wide_stage.cuh"
#include "wgmma_core.cuh"
#include "wgmma_rs.cuh"

static_assert(FW_PREC == 0 || FW_PREC == 3, "rung 44 runs fp16 (0) and 3xfp16 (3)");
static_assert(FW_P == 2 && FW_RP == 1, "rung 44: units of one pooled row, pool 2");
static_assert(!FW_PREFETCH, "rung 44 stages from global memory");
static_assert(FW_NT >= 1 && FW_NT <= 4, "rung 44: wgmma N = 8 NT or 16 NT, M <= 32");
static_assert(FW_RING >= 3, "rung 44: FW_RING >= 3");
static_assert(FW_PREC == 0 || FW_SETS == 3, "rung 44: 3xfp16 keeps one set a product");

#define FW_BLOCK_BYTES (FW_NT * 256)  // one (chunk, filter row) block: NT x 2 core matrices
#define FW_BPART_BYTES (FW_J * FW_K * FW_BLOCK_BYTES)
#define FW_B_BYTES (FW_PARTS * FW_BPART_BYTES)
#define FW_NG ((FW_NUNITS + 3) / 4)  // m-tiles (4 units) of one image
#define FW_STEPS (FW_J * FW_SHIFTS)
#define FW_ALIGN 128
// Dynamic shared memory: the weights' alignment slack, the weights, the image(s).
#define FW44_SMEM_BYTES (FW_ALIGN + FW_B_BYTES + FW_IMG_BYTES)

typedef float FwTile[FW_T][FW_NT][4];  // [tile][n-tile][register]

// Keeps the compiler from moving reads or writes of accumulators across the asynchronous
// wgmmas that own them.
__device__ __forceinline__ void fw_hold(FwTile& d) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[i][n][r])::"memory");
}

__device__ __forceinline__ void fw_zero(FwTile& d) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) d[i][n][r] = 0.f;
}

// The A quads (hi; 3xfp16 also lo) of step st = (chunk j, shift s) for this lane's rows.
__device__ __forceinline__ void fw_load_step(FwA (&a)[FW_PARTS], const fw_t* img,
                                             const FwRows& rows, int st) {
  const int j = st / FW_SHIFTS, s = st % FW_SHIFTS;
  const fw_t* lo = img + rows.lo + j * FW_CH + s * FW_ROW;
  const fw_t* hi = img + rows.hi + j * FW_CH + s * FW_ROW;
#pragma unroll
  for (int part = 0; part < FW_PARTS; ++part)
    a[part] = fw_lda(lo + part * FW_IMG1, hi + part * FW_IMG1);
}

// d += a * (the weights of chunk j at shift s): tile 0 at filter row s, tile 1 at s - 1, one
// wgmma of N = 8 NT each. bpart: the shared address of one weight part (hi or lo). Each
// tile's accumulators are always the same instruction operand: one wgmma of N = 16 NT over
// both tiles would reuse tile 1's registers at other positions than a tile-1-only one, and
// ptxas then serializes every wgmma (measured: 1.75 ms against 1.26 on eecs498's conv2).
__device__ __forceinline__ void fw_shift(FwTile& d, const FwA& a, unsigned bpart, int j,
                                         int s) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i) {
    const int p = s - i;
    if (p < 0 || p >= FW_K) continue;
    wg_mma_rs<FW_NT>(d[i], a.r, wg_desc_interleaved(
        bpart + (j * FW_K + FW_K - 1 - p) * FW_BLOCK_BYTES, 128, 256));
  }
}

// total += d, register by register.
__device__ __forceinline__ void fw_add(FwTile& total, const FwTile& d) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) total[i][n][r] += d[i][n][r];
}

// One m-tile (4 units) of the image in img: total[i] = tile i's sums over every chunk.
__device__ __forceinline__ void fw_mtile(const fw_t* img, unsigned wsm, const FwRows& rows,
                                         FwTile& total) {
  FwTile acc[FW_SETS];
#pragma unroll
  for (int k = 0; k < FW_SETS; ++k) fw_zero(acc[k]);
  fw_zero(total);
  FwA a[FW_RING][FW_PARTS];
  fw_load_step(a[0], img, rows, 0);
#pragma unroll
  for (int st = 0; st < FW_STEPS; ++st) {
    const int s = st % FW_SHIFTS, j = st / FW_SHIFTS, slot = st % FW_RING;
#pragma unroll
    for (int k = 0; k < FW_SETS; ++k) fw_hold(acc[k]);
    wg_fence();
#if FW_EXACT
    fw_shift(acc[0], a[slot][1], wsm, j, s);  // lo x hi
    fw_shift(acc[1], a[slot][0], wsm + FW_BPART_BYTES, j, s);  // hi x lo
    fw_shift(acc[2], a[slot][0], wsm, j, s);  // hi x hi
#else
    fw_shift(acc[st % FW_SETS], a[slot][0], wsm, j, s);
#endif
    wg_commit();
    if (st + 1 < FW_STEPS) fw_load_step(a[(st + 1) % FW_RING], img, rows, st + 1);
    if (FW_EXACT && s == FW_SHIFTS - 1) {
      // The chunk's three sums, each from zero, into the fp32 total (small products first).
      wg_wait<0>();
#pragma unroll
      for (int k = 0; k < FW_SETS; ++k) fw_hold(acc[k]);
#pragma unroll
      for (int i = 0; i < FW_T; ++i)
#pragma unroll
        for (int n = 0; n < FW_NT; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            total[i][n][r] += (acc[0][i][n][r] + acc[1][i][n][r]) + acc[2][i][n][r];
            acc[0][i][n][r] = acc[1][i][n][r] = acc[2][i][n][r] = 0.f;
          }
    } else {
      wg_wait<FW_RING - 2>();  // the group that read slot (st + 2) % FW_RING has retired
    }
  }
#if !FW_EXACT
  wg_wait<0>();
#pragma unroll
  for (int k = 0; k < FW_SETS; ++k) {
    fw_hold(acc[k]);
    fw_add(total, acc[k]);
  }
#endif
}

// Persistent: each block copies the packed weights once, then loops over images; warpgroup
// wg of a block takes m-tiles wg, wg + FW_WGS, ... of each image. w_unscale: 3xfp16's 2^-e of
// the weights' scale (ignored otherwise).
extern "C" __global__ void __launch_bounds__(FW_THREADS, FW_MINB)
fcp_wgmma(const fw_in_t* __restrict__ x, const uint4* __restrict__ wpack,
          const float* __restrict__ bias, float* __restrict__ y, int batch, float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  const unsigned base = (unsigned)__cvta_generic_to_shared(fw_smem);
  const unsigned pad = (FW_ALIGN - (base & (FW_ALIGN - 1))) & (FW_ALIGN - 1);
  unsigned char* wsm_p = fw_smem + pad;
  for (int i = threadIdx.x; i < FW_B_BYTES / 16; i += FW_THREADS)
    reinterpret_cast<uint4*>(wsm_p)[i] = __ldg(wpack + i);
  wg_proxy_fence();  // the wgmmas read the weights through the async proxy
  fw_t* img = reinterpret_cast<fw_t*>(wsm_p + FW_B_BYTES);
  float* red = reinterpret_cast<float*>(wsm_p + FW_B_BYTES + FW_PARTS * FW_IMG1_BYTES);
  fw_zero_slack(img);
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7;
  const int g = lane >> 2, t = lane & 3;
  for (int b = blockIdx.x; b < batch; b += gridDim.x) {
    const fw_in_t* xb = x + (size_t)b * (FW_C * FW_H * FW_W);
    __syncthreads();  // every warp is done with the previous image (and the weights are in)
    const int e = fw_image_exponent<false>(xb, red);
    fw_stage_image<false>(img, xb, fw_pow2(e));
    __syncthreads();
    const float a_unscale = fw_pow2(-e);
    for (int mt = wg; mt < FW_NG; mt += FW_WGS) {
      const FwRows rows = fw_rows(4 * mt + warp, g, t);
      FwTile total;
      fw_mtile(img, base + pad, rows, total);
      fw_store(total, rows, lane, bias, y, (size_t)b, w_unscale, a_unscale);
    }
  }
}
