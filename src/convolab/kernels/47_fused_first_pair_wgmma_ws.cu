// Kernel 47 — the exact forward's first two blocks in one persistent kernel: rung 45's conv1
// (row pairs, 3xfp16, wgmma) runs on conv1 warpgroups of rung 46's block and writes its pooled
// maps, as conv2's staged form, straight into the slot that rung 46's consumer warpgroups
// compute conv2 from (their loop, fws_consume, unchanged).
//
// Why. Apart, conv1 (rung 45) leaves its tensor pipe half idle and conv2 (rung 46 fed
// records) its issue slots; and 40 KB of records an image go to HBM and back between them.
// Together on one SM each fills some of the other's idle time (eecs498: 974 us against 344 +
// 657 apart on the H200, docs/raw.md "Kernel 47"), and the records stay in shared memory.
//   * Roles: FW_WGS consumer warpgroups (threads 0 ..), FR_WARPS / 4 conv1 warpgroups after
//     them. Two conv1 warpgroups (one alone is latency-bound: 1,151 us): 512 threads, and
//     setmaxnreg gives conv1 112 registers and the consumers 144, where rung 46's loop fits at
//     ring 4 with one sum (at an even 128 ptxas serializes the consumers' wgmmas). One: 384
//     threads, 168 registers for every role.
//   * Per image, the conv1 warpgroups stage it into their tile (fr_stage, on their own named
//     barrier), wait for the slot to be EMPTY, run rung 45's m-tile groups storing each
//     group's windows into the slot (fr_store_staged, whose pointer is now shared memory), set
//     the slot's exponent and arrive on FULL; the consumers wait on FULL, run conv2 and
//     arrive on EMPTY, as in rung 46.
// Same conv1 arithmetic as rung 45 writing records, same conv2 loop as rung 46 fed them: the
// output equals that pair's (with the same conv2 loop defines) bit for bit.

#ifndef FW_PREC
#define FW_PREC 3
#endif
#ifndef FW_WGS
#define FW_WGS 2  // consumer warpgroups (conv2)
#endif
#ifndef FW_RING
#define FW_RING 4
#endif
#ifndef FW_LEAD
#define FW_LEAD 2
#endif
#ifndef FW_SUM
#define FW_SUM 6
#endif
#ifndef FW_C  // eecs498's conv2 (the standalone build's shape)
#define FW_C 12
#define FW_H 29
#define FW_W 29
#define FW_WS 35
#define FW_M 24
#define FW_K 7
#define FW_TAILS 1
#endif
#define FW_WARPS (4 * FW_WGS)
#define FW_UNITS 1
#include "fused_wide.cuh"
#include "fused_wide_split.cuh"
#include "fused_wide_stage.cuh"
#include "warp_roles.cuh"
#include "wgmma_core.cuh"
#include "wgmma_rs.cuh"

#include "fused_wgmma.cuh"
#include "fused_wgmma_loop.cuh"

static_assert(FW_PREC == 3, "kernel 47: the exact forward's pair (3xfp16)");

#ifndef FR_WARPS
#define FR_WARPS 8  // conv1 warpgroups x 4
#endif
#ifndef FF_K  // eecs498's conv1
#define FF_K 7
#define FF_H 64
#define FF_W 64
#define FR_M 12
#endif
#define FR_SPLIT 1
#define FR_TPH FF_HP
#define FR_STG 1
#define FR_STG_WS FW_WS  // conv1 writes conv2's staged form
#define FR_STG_CS FW_CS
#define FR_STG_IMG1 FW_IMG1
enum { kBarFirst = 1, kBarFull = 2, kBarEmpty = 4 };  // kBarFull + slot, kBarEmpty + slot
#define FR_STAGE_TID (threadIdx.x - FW_THREADS)
#define FR_STAGE_SYNC() bar_sync(kBarFirst, FR_THREADS)
#include "first_rowpair.cuh"
#include "first_wgmma.cuh"
#include "split_scale.cuh"

static_assert(FR_M == FW_C && FF_HP == FW_H && FF_WP == FW_W,
              "kernel 47: conv1's pooled maps are conv2's input");
#define FP_THREADS (FW_THREADS + FR_THREADS)
// 0: no setmaxnreg (one conv1 warpgroup: 168 registers for every role, which both fit)
#ifndef FP_FIRST_REGS
#define FP_FIRST_REGS ((FR_WARPS + FW_WARPS) > 12 ? 112 : 0)  // at 104 conv1 spills 40 bytes
#endif
#define FP_CONSUMER_REGS ((65536 - FR_THREADS * FP_FIRST_REGS) / FW_THREADS / 8 * 8)
#define FP_SLOT_BYTES (FW_PARTS * FW_IMG1_BYTES)
// [align][conv2's weights][slot 0][slot 1][conv1's B tiles][exponents 2 x 4, padding]
#define FP_SMEM_BYTES (FW_ALIGN + FW_B_BYTES + 2 * FP_SLOT_BYTES + FR_B_BYTES + 16)

// x: (B, 1, FF_H, FF_W) fp32; btiles, bias1 (FR_M + 2: the bound's W1, B1 after the biases),
// w_e: rung 45's; wpack, bias, w_unscale: rung 46's; y: (B, FW_M, FW_HP, FW_WP) fp32.
// Persistent, one block an SM: image i of the block goes through slot i % 2.
extern "C" __global__ void __launch_bounds__(FP_THREADS, 1)
fpair_wgmma_ws(const float* __restrict__ x, const uint4* __restrict__ btiles,
               const float* __restrict__ bias1, int w_e, const uint4* __restrict__ wpack,
               const float* __restrict__ bias, float* __restrict__ y, int batch,
               float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  __shared__ __align__(16) unsigned tile[FR_PARTS * FR_PAIRS];
  __shared__ float red[FR_WARPS];
  unsigned wsm;
  unsigned char* wsm_p = fw_aligned(fw_smem, wsm);
  fw_t* slots = reinterpret_cast<fw_t*>(wsm_p + FW_B_BYTES);
  unsigned char* b1 = wsm_p + FW_B_BYTES + 2 * FP_SLOT_BYTES;
  int* exps = reinterpret_cast<int*>(b1 + FR_B_BYTES);
  for (int i = threadIdx.x; i < FW_B_BYTES / 16; i += FP_THREADS)
    reinterpret_cast<uint4*>(wsm_p)[i] = __ldg(wpack + i);
  for (int i = threadIdx.x; i < FR_B_BYTES / 16; i += FP_THREADS)
    reinterpret_cast<uint4*>(b1)[i] = __ldg(btiles + i);
  // conv1 writes only the pixels' channels: the slots' padding and slack stay zero
  for (int i = threadIdx.x; i < 2 * FP_SLOT_BYTES / 16; i += FP_THREADS)
    reinterpret_cast<uint4*>(slots)[i] = make_uint4(0u, 0u, 0u, 0u);
  wg_proxy_fence();  // both blocks' wgmmas read their weights through the async proxy
  __syncthreads();
  constexpr int kSlotElems = FP_SLOT_BYTES / FW_ESIZE;

  if (threadIdx.x >= FW_THREADS) {  // conv1: rung 45's groups into the slot
#if FP_FIRST_REGS
    set_max_regs_dec<FP_FIRST_REGS>();
#endif
    const int ft = threadIdx.x - FW_THREADS, wq = (ft >> 5) & 3, fwg = ft >> 7;
    const unsigned long long d1 = wg_desc_interleaved(wsm + (unsigned)(b1 - wsm_p), 128, 256);
    float bm[FR_NT];
    fr_bias(bm, bias1);
    const float w1 = __ldg(bias1 + FR_M), b1max = __ldg(bias1 + FR_M + 1);
    int i = 0;
    for (int b = blockIdx.x; b < batch; b += gridDim.x, ++i) {
      const int slot = i & 1;
      FR_STAGE_SYNC();  // every conv1 thread is done with the tile and red of the image before
      const int e = fr_stage(FrFloatInput{x}, tile, b, 0, red);
      // conv2's scale from rung 45's bound: |out| <= 2^(15 - e) W1 + B1
      const int e2 = fw_scale_exponent(fr_pow2(15 - e) * w1 + b1max);
      const float u2 = fr_pow2(-(e + w_e)) * fr_pow2(e2);
      float bs[FR_NT];
#pragma unroll
      for (int n = 0; n < FR_NT; ++n) bs[n] = bm[n] * fr_pow2(e2);
      FR_STAGE_SYNC();  // the tile is staged
      if (i >= 2) bar_sync(kBarEmpty + slot, FP_THREADS);  // image i - 2 is done with the slot
      __half* const rec = reinterpret_cast<__half*>(slots + slot * kSlotElems);
      for (int grp = fwg; grp < FR_GROUPS; grp += FR_WARPS / 4) {
        float acc[FR_NT][4];
        fr_issue(acc, tile, grp * 4 + wq, d1);
        wg_wait<0>();
        wg_hold(acc);
        const FrRows r = fr_rows(grp * 4 + wq);
        fr_store_staged(acc, bs, rec, r.ph_l, r.run, r.valid, u2);
      }
      if (ft == 0) exps[slot] = e2;
      bar_arrive(kBarFull + slot, FP_THREADS);
    }
  } else {  // conv2: rung 46's consumers
#if FP_FIRST_REGS
    set_max_regs_inc<FP_CONSUMER_REGS>();
#endif
    const unsigned long long d0 = fw_b0(wsm);
    int i = 0;
    for (int b = blockIdx.x; b < batch; b += gridDim.x, ++i) {
      const int slot = i & 1;
      bar_sync(kBarFull + slot, FP_THREADS);
      const float a_unscale = fw_pow2(-exps[slot]);
      fws_consume(slots + slot * kSlotElems, d0, bias, y, b, i, w_unscale, a_unscale);
      // conv1 waits for this slot only where the block has an image i + 2 for it
      if (b + 2 * (int)gridDim.x < batch) bar_arrive(kBarEmpty + slot, FP_THREADS);
    }
  }
}
