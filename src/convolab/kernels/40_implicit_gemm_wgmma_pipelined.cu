// Rung 40: rung 39's wgmma implicit GEMM with a producer warpgroup and per-stage mbarriers
// instead of a block barrier per k-tile (sm_90a only).
//
// What it changes against rung 39: there, every thread issues copies and then multiplies, and
// each k-tile starts with __syncthreads (the k-tile landed, every warpgroup is done with the
// slot refilled next): the two warpgroups wait for each other and for the slowest copy at
// every k-tile, and on conv5_x fp16 the GEMM ran ~420 TFLOP/s (54% of the ceiling); 256-row
// tiles, which halve the L2 traffic per MMA, did not help. Here
//   * a third warpgroup only copies: it waits for a ring slot's "empty" mbarrier, issues the
//     slot's cp.async pieces (rung 39's loader and swizzle, on 128 threads) and has each
//     thread's pieces arrive on the slot's "full" mbarrier when they land
//     (cp.async.mbarrier.arrive.noinc: 128 arrivals complete a phase);
//   * the two consumer warpgroups wait on "full" only, issue the slot's wgmmas, and release
//     the slot on "empty" (one arrival a warpgroup) once those wgmmas are done: with PIPE=1
//     the slot of the k-tile before, whose wgmmas the wait for at most one group retired.
//     No block-wide barrier in the loop: a warpgroup that is ahead runs on;
//   * WP_TMA=1: A comes by the tensor copy engine instead (one cp.async.bulk.tensor of the
//     whole BM x 128-byte box a stage, every plane, in the same 128-byte swizzle, counted as
//     transaction bytes on "full"), leaving the producer warpgroup B's gather alone;
//   * setmaxnreg moves registers from the producer (it holds addresses only) to the
//     consumers, so a 256 x 192 tile's 192 accumulators a thread fit without spilling.
// Parity: slot s serves k-tiles s, s + STAGES, ...; k-tile t is that slot's round t / STAGES,
// whose "full" phase has parity (t / STAGES) & 1, and the producer's refill for round r waits
// for "empty"'s round r - 1. With split-K (WG_KSLICED=1, wgmma.cuh: the block multiplies one
// k-slice, for outputs with fewer tiles than SMs) t counts the block's own k-tiles from 0, so
// slots and parities are the same as in a whole-k block; only the copies' k moves.
//
// Measured (H100, docs/vgg.md; conv5_x B=64, 59.2 GFLOP, channels-last in and out): 256 x 192
// with A by cp.async 0.133-0.136 ms fp16 (rung 39's best, 128 x 192: 0.141), no faster than
// rung 39 at 128 x 192 (the producer's 28 cp.async a thread and k-tile spilled: 870k local
// requests in Nsight Compute); with WP_TMA=1 0.107-0.112 ms = 530-550 TFLOP/s fp16 (cuDNN fp16
// channels-last 0.119) and 0.171 ms TF32 (cuDNN TF32 0.248, NCHW), SM throughput 52% -> 70%.

#include "mbarrier.cuh"
#include "warp_roles.cuh"
#include "wgmma.cuh"

#ifndef WP_TMA
#define WP_TMA 0  // 1: A (the weights) by the tensor copy engine, B by the producer's cp.async
#endif

#define WP_PRODUCERS 128                           // the copying warpgroup
#define WP_THREADS (WP_PRODUCERS + WG_CONSUMERS)
#ifndef WP_PRODUCER_REGS
#define WP_PRODUCER_REGS 56                        // 128 * 56 + 256 * 224 <= 64K registers
#endif
#ifndef WP_CONSUMER_REGS
#define WP_CONSUMER_REGS 224
#endif

// A's box of the k-tile at element k0, rows m0.., every plane, into `dst` in the 128-byte
// swizzle (the map's), completing as transaction bytes on `bar`. Rows past M and k past Kd
// arrive as zeros.
__device__ __forceinline__ void tma_load_a(unsigned dst, const void* map, int k0, int m0,
                                           unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(map), "r"(k0), "r"(m0), "r"(0), "r"(bar)
      : "memory");
}

extern "C" __global__ void __launch_bounds__(WP_THREADS, 1)
igemm_wgmma_pipelined(const ig_t* __restrict__ x, const ig_t* __restrict__ w,
                      const float* __restrict__ bias, wg_out_t* __restrict__ y,
                      IG_PROBLEM_ARGS, long long x_plane, const void* __restrict__ a_map) {
  const IgProblem p = IG_PROBLEM;
  extern __shared__ unsigned char wg_smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[s], then empty[s]
  // The swizzle repeats every 1024 bytes and is applied to absolute addresses: align the ring.
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(wg_smem_raw));
  const unsigned smem = (raw + 1023u) & ~1023u;
  const unsigned full = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  const unsigned empty = full + 8 * STAGES;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  // t counts this block's k-tiles (all, or its slice with WG_KSLICED): k-tile k.first + t.
  // Ring slots and parities follow t, so producer and consumers agree on them.
  const WgKRange k = wg_k_range((p.Kd + WG_BK - 1) / WG_BK);
  const int tiles = k.count;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, WP_PRODUCERS + WP_TMA);  // cp.async arrivals (+ A's bytes)
      mbar_init(empty + 8 * s, 2);  // one arrival per consumer warpgroup
    }
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them

  if (threadIdx.x < WP_PRODUCERS) {
    set_max_regs_dec<WP_PRODUCER_REGS>();
    WgLoader<WP_PRODUCERS> ld;
    ld.init(x, w, p, m0, n0, smem, x_plane, threadIdx.x);
    if (WP_TMA && threadIdx.x == 0) tma_acquire(a_map);
    for (int t = 0; t < tiles; ++t) {
      const int s = t % STAGES;
      if (t >= STAGES) mbar_wait(empty + 8 * s, ((t / STAGES) & 1) ^ 1);
#if WP_TMA
      if (threadIdx.x == 0) {
        mbar_expect_tx(full + 8 * s, WG_A_ROWS * WG_ROWB);
        tma_load_a(smem + s * WG_STAGE_BYTES, a_map, (k.first + t) * WG_BK, m0, full + 8 * s);
      }
      ld.load<false>(p, (k.first + t) * WG_BK, p.Kd, s);
#else
      ld.load(p, (k.first + t) * WG_BK, p.Kd, s);
#endif
      mbar_arrive_cp_async(full + 8 * s);
    }
    cp_async_wait_all();  // nothing of this block's left in flight when its threads exit
    return;
  }

  set_max_regs_inc<WP_CONSUMER_REGS>();
  const int ctid = threadIdx.x - WP_PRODUCERS;
  const int group = ctid / 128;
  const int a_row = (group / WG_GROUPS_N) * 64 * WG_MI, b_row = (group % WG_GROUPS_N) * WG_N;
  const bool signals = ctid % 128 == 0;  // the thread that releases slots for its warpgroup
  WG_ACCUMULATORS;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % STAGES;
    mbar_wait(full + 8 * s, (t / STAGES) & 1);
    wg_proxy_fence();  // the cp.async (generic proxy) writes it observed, before the wgmmas read
    wg_step(acc, total, smem + s * WG_STAGE_BYTES, a_row, b_row);
    // wg_step left at most PIPE k-tiles in flight: the slot of k-tile t - PIPE is read.
    if (signals && t >= PIPE) mbar_arrive(empty + 8 * ((t - PIPE) % STAGES));
  }
  wg_wait<0>();
  wg_hold(acc);
  wg_epilogue(total, y, bias, p, m0, n0, a_row, b_row,
              reinterpret_cast<float*>(wg_smem_raw + (smem - raw)), ctid);
}
