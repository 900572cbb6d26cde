// Rung 44's MMA loop, shared with its warp-specialized form (rung 46): a precision's
// accumulator sets and steps (3xfp16's three products summed from zero over FW_SUM k-chunks,
// fp16's paired tiles), and fw_mtile, which runs one m-tile of a staged image with A loaded
// FW_LEAD shifts ahead into a ring of FW_RING slots; fws_consume, a consumer warpgroup's
// m-tiles of an image in the warp-specialized kernels (46, 47). 44's header comment says why
// each piece is as it is. Included after fused_wgmma.cuh.
#pragma once

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

// A consumer warpgroup's share of image b, its block's i-th (staged in img), in rungs 46 and
// 47: the loop above and the store over the warpgroup's m-tiles.
__device__ __forceinline__ void fws_consume(const fw_t* img, unsigned long long d0,
                                            const float* __restrict__ bias, float* __restrict__ y,
                                            int b, int i, float w_unscale, float a_unscale) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7;
  const int g = lane >> 2, t = lane & 3;
  // The m-tiles go round the warpgroups across images (tile i FW_NG + mt to warpgroup
  // (i FW_NG + mt) % FW_WGS), so that FW_NG need not divide among them.
  const int first = FW_NG % FW_WGS == 0 ? wg : ((wg - i * FW_NG) % FW_WGS + FW_WGS) % FW_WGS;
  for (int mt = first; mt < FW_NG; mt += FW_WGS) {
    const FwRows rows = fw_rows(4 * mt + warp, g, t);
    FwTile total;
    fw_mtile(img, d0, rows, total);
    fw_store(total, rows, lane, bias, y, (size_t)b, w_unscale, a_unscale);
  }
}
