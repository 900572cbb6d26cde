// Rung 44 — rung 28's fused conv + bias + ReLU + max-pool for wide layers (fcp_wgmma), with
// the MMAs on Hopper's warpgroup MMA (wgmma, sm_90a) instead of mma.sync.
//
// Rung 28 issues one m16n8k16 per warp instruction (2048 FMAs) and loads every weight fragment
// itself; a wgmma of 64 rows x N x 16 is one asynchronous instruction of a warpgroup whose B
// operand (the weights) comes from shared memory by descriptor. What this buys is fewer
// instructions a shift; the loop stays issue-bound (2 warps a scheduler at ~200 registers),
// so every instruction and every exposed latency counts:
//   * A comes from registers, loaded as rung 28 loads it (fw_rows, fw_lda): warp w of a
//     warpgroup holds rows 16w..16w+15 of the 64, rung 28's unit 4G + w (8 pool windows x
//     left/right output), so one m-tile is 4 of rung 28's units.
//   * Input row s of the unit (shift s) feeds tile 0 (the windows' top output row) at filter
//     row p = s and tile 1 at p = s - 1 from the same A registers. The host stores each weight
//     block (chunk j, filter row p: 8 NT channels x 16 k) as 8 x 16-byte core matrices without
//     swizzle, filter rows falling, 3xfp16's lo and hi parts side by side, so that one wgmma of
//     N = 16 NT covers two adjacent blocks: fp16 both tiles of a shift (shifts 0 and K, one
//     tile each, write sets of their own: a register that sits at different operand positions
//     in two wgmmas makes ptxas serialize every wgmma), 3xfp16 hi x [lo | hi] of a tile, beside
//     lo x hi (N = 8 NT).
//   * Each shift is one commit group. The warps load A FW_LEAD shifts ahead into a ring of
//     FW_RING slots, FW_RING - FW_LEAD - 1 groups running meanwhile (a slot is rewritten only
//     after wait_group has retired the group that read it).
//   * Sums start from zero by the scale-d operand of their first wgmma (no zeroing); 3xfp16's
//     three products, summed over FW_SUM k-chunks, go into an fp32 total once retired.
//   * The image is staged in one pass: each thread issues all its loads before its first
//     store (one memory latency an image; rung 28's two passes cost a fifth of the time here).
//   * FW_TAILS packs the filter rows' run tails into shared k-chunks (the define's comment;
//     eecs498's conv2: 0.785 ms against 0.866 padded, 3xfp16 on the H100).
// Measured steps and what did not help (deeper rings, more accumulator chains): docs/raw.md,
// "Rung 44". FW_WGS warpgroups a block share the staged image and the weights.

#ifndef FW_PREC
#define FW_PREC 3
#endif
#ifndef FW_WGS
#define FW_WGS 1  // warpgroups a block
#endif
#ifndef FW_RING
#define FW_RING 5  // A slots: FW_RING - 1 commit groups in flight
#endif
#ifndef FW_LEAD
#define FW_LEAD 2  // shifts ahead the warps load A (its shared-memory latency behind the MMAs)
#endif
#ifndef FW_SUM
#define FW_SUM 2  // 3xfp16: k-chunks summed from zero before they join the fp32 total
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

#include "fused_wgmma.cuh"

#if FW_EXACT
// 3xfp16: per tile, lo x hi in `small` (N = 8 NT) and hi x [lo | hi] in `big` (one wgmma of
// N = 16 NT: the block's lo and hi parts are adjacent), each chunk's sums from zero.
struct FwAcc {
  float small[FW_T][FW_NT][4];
  float big[FW_T][2 * FW_NT][4];
};

__device__ __forceinline__ void fw_hold_acc(FwAcc& c) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i) {
    wg_hold(c.small[i]);
    wg_hold(c.big[i]);
  }
}

// first: the step opens a sum (its first wgmma into a tile's sets starts them from zero).
__device__ __forceinline__ void fw_step(FwAcc& c, const FwA (&a)[FW_PARTS], unsigned long long d0,
                                        int j, int s, bool first) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i) {
    const int p = s - i;  // tile 0 (top output row) at filter row s, tile 1 at s - 1
    if (p < 0 || p >= FW_K) continue;
    const int keep = !(first && p == 0);
    wg_mma_rs<FW_NT>(c.small[i], a[1].r, fw_b(d0, j, p, 1), keep);
    wg_mma_rs<2 * FW_NT>(c.big[i], a[0].r, fw_b(d0, j, p, 0), keep);
  }
}

__device__ __forceinline__ void fw_tail(FwAcc& c, const FwA (&a)[FW_PARTS],
                                        unsigned long long d0, int i, int cc) {
  wg_mma_rs<FW_NT>(c.small[i], a[1].r, fw_b_tail(d0, cc, 1), 1);
  wg_mma_rs<2 * FW_NT>(c.big[i], a[0].r, fw_b_tail(d0, cc, 0), 1);
}

// After a sum has retired: its sets into the fp32 total, small products first.
__device__ __forceinline__ void fw_sum_end(const FwAcc& c, FwTile& total) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        total[i][n][r] += (c.small[i][n][r] + c.big[i][n][r]) + c.big[i][FW_NT + n][r];
}
#else
// fp16: shifts 1..K-1 feed both tiles from one wgmma of N = 16 NT (blocks p = s and s - 1 are
// adjacent: d = [tile 0 | tile 1]); shift 0 (tile 0 alone) and K (tile 1 alone) take N = 8 NT
// into sets of their own, so that every accumulator register always sits at the same operand
// position (tile 1's registers in a tile-1-only wgmma made ptxas serialize every wgmma).
struct FwAcc {
  float pair[2 * FW_NT][4];
  float edge[FW_T][FW_NT][4];
};

__device__ __forceinline__ void fw_hold_acc(FwAcc& c) {
  wg_hold(c.pair);
#pragma unroll
  for (int i = 0; i < FW_T; ++i) wg_hold(c.edge[i]);
}

__device__ __forceinline__ void fw_step(FwAcc& c, const FwA (&a)[FW_PARTS], unsigned long long d0,
                                        int j, int s, bool first) {
  // One sum over every chunk: each set starts at its first shift of chunk 0.
  const int keep = j > 0;
  if (s == 0)
    wg_mma_rs<FW_NT>(c.edge[0], a[0].r, fw_b(d0, j, 0, 0), keep);
  else if (s == FW_K)
    wg_mma_rs<FW_NT>(c.edge[1], a[0].r, fw_b(d0, j, FW_K - 1, 0), keep);
  else
    wg_mma_rs<2 * FW_NT>(c.pair, a[0].r, fw_b(d0, j, s, 0), keep || s > 1);
}

// A tail chunk goes to the tile's edge set (N = 8 NT, as the edge shifts).
__device__ __forceinline__ void fw_tail(FwAcc& c, const FwA (&a)[FW_PARTS],
                                        unsigned long long d0, int i, int cc) {
  wg_mma_rs<FW_NT>(c.edge[i], a[0].r, fw_b_tail(d0, cc, 0), 1);
}
#endif

// One m-tile (4 units) of the image in img: total[i] = tile i's sums over every chunk.
__device__ __forceinline__ void fw_mtile(const fw_t* img, unsigned long long d0, const FwRows& rows,
                                         FwTile& total) {
  FwAcc c;  // every set is started from zero by its sum's first wgmma (scale-d 0)
#pragma unroll
  for (int i = 0; i < FW_T; ++i) fw_zero(total[i]);
  FwA a[FW_RING][FW_PARTS];
#pragma unroll
  for (int st = 0; st < FW_LEAD; ++st) fw_load_step(a[st], img, rows, st);
#pragma unroll
  for (int st = 0; st < FW_STEPS; ++st) {
    const int s = st % FW_SHIFTS, j = st / FW_SHIFTS;
    fw_hold_acc(c);
    wg_fence();
    fw_step(c, a[st % FW_RING], d0, j, s, j % FW_SUM == 0);
    wg_commit();
    if (st + FW_LEAD < FW_STEPS)
      fw_load_step(a[(st + FW_LEAD) % FW_RING], img, rows, st + FW_LEAD);
    // A sum closes after its last chunk; with packed tails the last one closes after them.
    const bool closes = (j % FW_SUM == FW_SUM - 1 || j == FW_JM - 1) &&
                        !(FW_TCH > 0 && j == FW_JM - 1);
    if (FW_EXACT && s == FW_SHIFTS - 1 && closes) {
      wg_wait<0>();  // the sum has retired
      fw_hold_acc(c);
#if FW_EXACT
      fw_sum_end(c, total);
#endif
    } else {
      // Retires the group that read the slot the next step loads into.
      wg_wait<FW_RING - FW_LEAD - 1>();
    }
  }
#if FW_TCH > 0
  {
    const int t = threadIdx.x & 3;
    FwA ta[FW_T][FW_TCH][FW_PARTS];
#pragma unroll
    for (int i = 0; i < FW_T; ++i)
#pragma unroll
      for (int cc = 0; cc < FW_TCH; ++cc) fw_load_tail(ta[i][cc], img, rows, i, cc, t);
    fw_hold_acc(c);
    wg_fence();
#pragma unroll
    for (int i = 0; i < FW_T; ++i)
#pragma unroll
      for (int cc = 0; cc < FW_TCH; ++cc) fw_tail(c, ta[i][cc], d0, i, cc);
    wg_commit();
    wg_wait<0>();
    fw_hold_acc(c);
#if FW_EXACT
    fw_sum_end(c, total);
#endif
  }
#endif
#if !FW_EXACT
  wg_wait<0>();
  fw_hold_acc(c);
#pragma unroll
  for (int n = 0; n < FW_NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      total[0][n][r] = c.pair[n][r] + c.edge[0][n][r];
      total[1][n][r] = c.pair[FW_NT + n][r] + c.edge[1][n][r];
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
  const unsigned long long d0 = fw_b0(base + pad);
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7;
  const int g = lane >> 2, t = lane & 3;
  for (int b = blockIdx.x; b < batch; b += gridDim.x) {
    const fw_in_t* xb = x + (size_t)b * (FW_C * FW_H * FW_W);
    __syncthreads();  // every warp is done with the previous image (and the weights are in)
    const int e = fw_stage_once(img, xb, red);
    __syncthreads();
    const float a_unscale = fw_pow2(-e);
    for (int mt = wg; mt < FW_NG; mt += FW_WGS) {
      const FwRows rows = fw_rows(4 * mt + warp, g, t);
      FwTile total;
      fw_mtile(img, d0, rows, total);
      fw_store(total, rows, lane, bias, y, (size_t)b, w_unscale, a_unscale);
    }
  }
}
