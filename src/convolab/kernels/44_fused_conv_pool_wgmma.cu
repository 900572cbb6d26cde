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
#include "fused_wgmma_loop.cuh"

// Persistent: each block copies the packed weights once, then loops over images; warpgroup
// wg of a block takes m-tiles wg, wg + FW_WGS, ... of each image. w_unscale: 3xfp16's 2^-e of
// the weights' scale (ignored otherwise).
extern "C" __global__ void __launch_bounds__(FW_THREADS, FW_MINB)
fcp_wgmma(const fw_in_t* __restrict__ x, const uint4* __restrict__ wpack,
          const float* __restrict__ bias, float* __restrict__ y, int batch, float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  unsigned wsm;
  unsigned char* wsm_p = fw_aligned(fw_smem, wsm);
  for (int i = threadIdx.x; i < FW_B_BYTES / 16; i += FW_THREADS)
    reinterpret_cast<uint4*>(wsm_p)[i] = __ldg(wpack + i);
  wg_proxy_fence();  // the wgmmas read the weights through the async proxy
  fw_t* img = reinterpret_cast<fw_t*>(wsm_p + FW_B_BYTES);
  float* red = reinterpret_cast<float*>(wsm_p + FW_B_BYTES + FW_PARTS * FW_IMG1_BYTES);
  fw_zero_slack(img);
  const unsigned long long d0 = fw_b0(wsm);
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
