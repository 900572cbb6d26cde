// Rung 45's MMA issue, shared with kernel 47 (which runs rung 45's conv1 inside rung 46's
// block): the B descriptors of a (part, k-step), where an m-tile's rows sit, and one m-tile
// group's wgmmas (45's header comment says why each is as it is). Included after
// first_rowpair.cuh, wgmma_core.cuh and wgmma_rs.cuh.
#pragma once

static_assert(FR_WARPS % 4 == 0, "rung 45 runs whole warpgroups");
static_assert(FR_NT == 1 || FR_NT == 2 || FR_NT == 3 || FR_NT == 4 || FR_NT == 6 || FR_NT == 8,
              "rung 45: wgmma N = 8 NT for NT in 1, 2, 3, 4, 6, 8");

#define FR_WGS (FR_WARPS / 4)
#define FR_B_TILE (FR_NT * 256)                    // one (part, k-step) B operand, bytes
#define FR_B_BYTES (FR_PARTS * FR_KS * FR_B_TILE)  // dynamic shared memory before the output
#define FR_GROUPS ((FR_MTILES + 3) / 4)            // m-tile groups: one m-tile a warp

// The descriptor of (part, k-step s) from the B tiles' first (d0): part 0 hi (the only one
// without the split), 1 lo.
__device__ __forceinline__ unsigned long long fr_b_desc(unsigned long long d0, int part, int s) {
  return wg_desc_add(d0, (part * FR_KS + s) * FR_B_TILE);
}

// Where m-tile mt's rows sit: the lane's (pooled row, run) and the word of its A quads.
struct FrRows {
  int ph_l, run, at;
  bool valid;
};

__device__ __forceinline__ FrRows fr_rows(int mt) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int combo = min(mt * 8 + g, FR_COMBOS - 1);
  FrRows r;
  r.ph_l = combo / FR_NR;
  r.run = combo - r.ph_l * FR_NR;
  r.at = (2 * r.ph_l * FR_RS + r.run * FR_D) / 2 + t;  // word of row y, column x + 2t
  r.valid = mt * 8 + g < FR_COMBOS;
  return r;
}

// Load m-tile mt's A quads and issue its wgmmas into acc as one commit group. A quad is rows
// y + 2s, y + 2s + 1 (twice), y + 2s + 2 of the lane's column, each word loaded once; the
// quads cost register moves (a wgmma reads four consecutive registers), which loading each
// quad's words into its own registers or staging the quads as they are read did not beat
// (docs/raw.md, "Rung 45").
__device__ __forceinline__ void fr_issue(float (&acc)[FR_NT][4], const unsigned* tile, int mt,
                                         unsigned long long d0) {
  constexpr int kRow = FR_RS / 2;  // words a staged row
  const int at = fr_rows(mt).at;
  const unsigned* hi_s = tile;
  unsigned ah[FR_NA];
#pragma unroll
  for (int j = 0; j < FR_NA; ++j) ah[j] = hi_s[at + j * kRow];
#if FR_SPLIT
  const unsigned* lo_s = tile + FR_PAIRS;
  unsigned al[FR_NA];
#pragma unroll
  for (int j = 0; j < FR_NA; ++j) al[j] = lo_s[at + j * kRow];
#endif
  wg_fence();
#pragma unroll
  for (int s = 0; s < FR_KS; ++s) {
    const unsigned a_hi[4] = {ah[2 * s], ah[2 * s + 1], ah[2 * s + 1], ah[2 * s + 2]};
#if FR_SPLIT  // the small products first; the first wgmma starts the sums (scale-d 0)
    if (FF_K % 2 == 1 && FF_K > 1 && s == FR_KS - 1) {
      // Odd K: this step's second filter row is zero. Its k 8-15 take the lo part of the first
      // row's pixels instead, and the host's hi tile repeats row K - 1 there: hi x lo_w (k
      // 8-15 of the lo tile are zero), then [hi | lo] x [hi_w | hi_w]. Two wgmmas, not three.
      const unsigned a_mix[4] = {ah[2 * s], ah[2 * s + 1], al[2 * s], al[2 * s + 1]};
      wg_mma_rs<FR_NT>(acc, a_mix, fr_b_desc(d0, 1, s), 1);
      wg_mma_rs<FR_NT>(acc, a_mix, fr_b_desc(d0, 0, s), 1);
      continue;
    }
    const unsigned a_lo[4] = {al[2 * s], al[2 * s + 1], al[2 * s + 1], al[2 * s + 2]};
    wg_mma_rs<FR_NT>(acc, a_lo, fr_b_desc(d0, 0, s), s > 0);
    wg_mma_rs<FR_NT>(acc, a_hi, fr_b_desc(d0, 1, s), 1);
    wg_mma_rs<FR_NT>(acc, a_hi, fr_b_desc(d0, 0, s), 1);
#else
    wg_mma_rs<FR_NT>(acc, a_hi, fr_b_desc(d0, 0, s), s > 0);
#endif
  }
  wg_commit();
}
