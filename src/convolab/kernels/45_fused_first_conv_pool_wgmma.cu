// Rung 45 — rung 29c's first block on the warpgroup MMA (wgmma, sm_90a): the same row-pair
// operands (an A row is 8 pixels of two input rows, B's columns the channels x dx; 29c's header
// comment and first_rowpair.cuh), fp16 or split in hi/lo fp16 parts (3xfp16, exact mode).
//
// Why. 29c issues one m16n8k16 MMA per (k-step, n-tile, part) and warp: 36 an m-tile in 3xfp16
// at eecs498 (4 k-steps x 3 n-tiles x 3 parts), each chained on the accumulator of the one before,
// and takes twice its fp16 time in exact mode. A warpgroup's 64 rows are four of 29c's m-tiles
// (the warps' A quads are 29c's fragments as they are, a1 = a2 included); one m64nNk16 wgmma with
// N = 8 NT covers every channel of a (k-step, part): 12 instructions a warpgroup where four
// warps issued 144, at the warpgroup MMA's rate rather than mma.sync's; 11 with an odd K, whose
// last k-step carries the input's hi and lo parts of one filter row (fr_issue).
//
// B comes from shared memory by descriptor: per (part, k-step) NT x 2 core matrices (8 columns
// x 8 k, 128 bytes; the second 8 k 128 bytes on, the next 8 columns 256 bytes on), copied from
// the host's packing (gpu/fused_first.py rowpair_wgmma_tiles) into dynamic shared memory ahead
// of the staged output (FR_OUT_SMEM). A warpgroup runs one m-tile group at a time: its wgmmas
// are one commit group, waited for before the pooled store; the SM's other warpgroups cover the
// wait.
//
// FR_STG 1 (exact mode's handoff to rung 46): the pooled maps go out as the next block's staged
// records (fr_store_staged: fp16 hi and lo of v 2^e2, channels-last), e2 from a bound on the
// image's outputs known before the MMAs (the input's exponent, the host's largest filter sum
// and bias), so that rung 46's producer only copies.

#define FR_DYN_B 1
#include "first_rowpair.cuh"
#include "wgmma_core.cuh"
#include "wgmma_rs.cuh"
#if FR_STG
#include "split_scale.cuh"
#endif

#include "first_wgmma.cuh"

typedef uint4 fr_b_t;  // 16 bytes of the packed B tiles
#define FR_ENTRY(kind) frw_conv_pool_##kind

template <typename Input>
__device__ __forceinline__ void fr_conv_pool(Input input, const uint4* __restrict__ btiles,
                                             const float* __restrict__ bias,
                                             ff_out* __restrict__ y, int w_e, int tiles_h) {
  __shared__ __align__(16) unsigned tile[FR_PARTS * FR_PAIRS];
  __shared__ float red[FR_WARPS];
  unsigned char* dyn = FR_DYN_SMEM;
  for (int i = threadIdx.x; i < FR_B_BYTES / 16; i += FR_THREADS)
    reinterpret_cast<uint4*>(dyn)[i] = __ldg(&btiles[i]);
  const size_t b = blockIdx.x / tiles_h;
  const int tile_y = blockIdx.x % tiles_h;
  const int warp = threadIdx.x >> 5;
  const int e = fr_stage(input, tile, b, tile_y * FR_TPH * 2, red);
  const float unscale = fr_pow2(-(e + w_e));
  float bm[FR_NT];
  fr_bias(bm, bias);
  wg_proxy_fence();  // the B tiles were written by ordinary stores; the wgmmas read them
  __syncthreads();
  const unsigned long long d0 =
      wg_desc_interleaved(static_cast<unsigned>(__cvta_generic_to_shared(dyn)), 128, 256);
  ff_out* out_s = reinterpret_cast<ff_out*>(dyn + FR_B_BYTES);
  const int wq = warp % 4;
#if FR_STG
  // conv2's scale from a bound on this image's outputs, known before any is computed:
  // |x| < 2^(15 - e) (fr_stage's exponent), so |out| <= 2^(15 - e) W1 + B1, with W1 = max_c
  // sum |w_c| and B1 = max |b| (the host's, after the biases).
  const float bound = fr_pow2(15 - e) * __ldg(bias + FR_M) + __ldg(bias + FR_M + 1);
  const int e2 = fw_scale_exponent(bound);
  __half* const rec = reinterpret_cast<__half*>(reinterpret_cast<unsigned char*>(y) +
                                                b * (size_t)FR_STG_REC);
  if (threadIdx.x == 0) *reinterpret_cast<int*>(rec + 2 * FR_STG_IMG1) = e2;
  const float u2 = unscale * fr_pow2(e2);
  float bs[FR_NT];
#pragma unroll
  for (int n = 0; n < FR_NT; ++n) bs[n] = bm[n] * fr_pow2(e2);
#endif
  // One group at a time: a second accumulator set whose wgmmas run while this one is stored
  // makes ptxas serialize every wgmma (it reads the stored set inside the other's stage).
  for (int grp = warp / 4; grp < FR_GROUPS; grp += FR_WGS) {
    float acc[FR_NT][4];
    fr_issue(acc, tile, grp * 4 + wq, d0);
    wg_wait<0>();
    wg_hold(acc);
    const FrRows r = fr_rows(grp * 4 + wq);
#if FR_STG
    fr_store_staged(acc, bs, rec, r.ph_l, r.run, r.valid, u2);
#else
    fr_store(acc, bm, y, out_s, b, tile_y, r.ph_l, r.run, r.valid, unscale);
#endif
  }
#if FR_OUT_SMEM
  __syncthreads();
  ff_write_pooled<FR_M, FR_TPH, FR_THREADS>(y, out_s, b, tile_y * FR_TPH);
#endif
  (void)out_s;
}

#include "first_rowpair_entries.cuh"
