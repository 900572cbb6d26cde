// Rung 45 — rung 29c's first block on the warpgroup MMA (wgmma, sm_90a): the same row-pair
// operands (an A row is 8 pixels of two input rows, B's columns the channels x dx; 29c's header
// comment and first_rowpair.cuh), fp16 or split in hi/lo fp16 parts (3xfp16, exact mode).
//
// Why. 29c issues one m16n8k16 MMA per (k-step, n-tile, part) and warp: 36 an m-tile in 3xfp16
// at eecs498 (4 k-steps x 3 n-tiles x 3 parts), each chained on the accumulator of the one before,
// and takes twice its fp16 time in exact mode. A warpgroup's 64 rows are four of 29c's m-tiles
// (the warps' A quads are 29c's fragments as they are, a1 = a2 included); one m64nNk16 wgmma with
// N = 8 NT covers every channel of a (k-step, part): 12 instructions a warpgroup where four
// warps issued 144, at the warpgroup MMA's rate rather than mma.sync's.
//
// A's quads are staged as the wgmma reads them. A quad {a0, a1, a2, a3} is input rows y + 2s,
// y + 2s + 1, y + 2s + 1, y + 2s + 2 at the lane's column, and a wgmma wants it in four
// consecutive registers: built from 29c's row tile, each group's quads took 33 register moves
// and 18 loads. Here the staging writes every pixel pair into the quads that hold it (quad row
// e = rows 2e, 2e + 1, 2e + 1, 2e + 2; twice the tile's bytes), and a quad is one 16-byte load.
// The descriptors are one base plus a constant each (ptxas rebuilt each from the address,
// four uniform instructions a wgmma).
//
// B comes from shared memory by descriptor: per (part, k-step) NT x 2 core matrices (8 columns
// x 8 k, 128 bytes; the second 8 k 128 bytes on, the next 8 columns 256 bytes on), copied from
// the host's packing (gpu/fused_first.py rowpair_wgmma_tiles) into dynamic shared memory ahead
// of the staged output (FR_OUT_SMEM). A warpgroup runs one m-tile group at a time: its wgmmas
// are one commit group, waited for before the pooled store; the SM's other warpgroups cover the
// wait.

#define FR_DYN_B 1
#include "first_rowpair.cuh"
#include "wgmma_core.cuh"
#include "wgmma_rs.cuh"

static_assert(FR_WARPS % 4 == 0, "rung 45 runs whole warpgroups");
static_assert(FR_NT == 1 || FR_NT == 2 || FR_NT == 3 || FR_NT == 4 || FR_NT == 6 || FR_NT == 8,
              "rung 45: wgmma N = 8 NT for NT in 1, 2, 3, 4, 6, 8");

#define FR_WGS (FR_WARPS / 4)
#define FR_B_TILE (FR_NT * 256)                    // one (part, k-step) B operand, bytes
#define FR_B_BYTES (FR_PARTS * FR_KS * FR_B_TILE)  // dynamic shared memory before the output
#define FR_GROUPS ((FR_MTILES + 3) / 4)            // m-tile groups: one m-tile a warp
#define FR_NQ (FR_TPH + FR_KS - 1)                 // quad rows: even input rows 0 .. IR - 3
#define FR_QROW (FR_RS / 2)                        // quads of a quad row (a word column each)
#define FR_Q_BYTES (FR_PARTS * FR_NQ * FR_QROW * 16)  // dynamic shared memory after the B tiles

typedef uint4 fr_b_t;  // 16 bytes of the packed B tiles
#define FR_ENTRY(kind) frw_conv_pool_##kind

// The descriptor of (part, k-step s) from the base descriptor d0 of the B tiles: part 0 hi
// (the only one without the split), 1 lo. The start address is the low field, in 16-byte
// units; the tiles end below 256 KB, so the sum never carries out of it.
__device__ __forceinline__ unsigned long long fr_b_desc(unsigned long long d0, int part, int s) {
  return d0 + (unsigned long long)((part * FR_KS + s) * FR_B_TILE / 16);
}

// The staging's sink: pair (row, p2) into the quads that hold it (part p's quad row e at
// quads + (p NQ + e) QROW): rows 2e as a0 of quad row e and a3 of e - 1, rows 2e + 1 as a1 and
// a2 of quad row e.
struct FrQuadSink {
  unsigned* quads;  // 4 words a quad
  __device__ __forceinline__ void operator()(int part, int, int row, int p2, unsigned w) const {
    unsigned* q = quads + 4 * ((part * FR_NQ + row / 2) * FR_QROW + p2);
    if (row % 2) {
      if (row / 2 < FR_NQ) q[1] = q[2] = w;
    } else {
      if (row / 2 < FR_NQ) q[0] = w;
      if (row >= 2 && row / 2 - 1 < FR_NQ) q[3 - 4 * FR_QROW] = w;
    }
  }
};

// Where m-tile mt's rows sit: the lane's (pooled row, run) and its quad column.
struct FrRows {
  int ph_l, run, col;
  bool valid;
};

__device__ __forceinline__ FrRows fr_rows(int mt) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int combo = min(mt * 8 + g, FR_COMBOS - 1);
  FrRows r;
  r.ph_l = combo / FR_NR;
  r.run = combo - r.ph_l * FR_NR;
  r.col = r.run * FR_D / 2 + t;  // the word of column x + 2t
  r.valid = mt * 8 + g < FR_COMBOS;
  return r;
}

// Load m-tile mt's A quads and issue its wgmmas into acc as one commit group.
__device__ __forceinline__ void fr_issue(float (&acc)[FR_NT][4], const uint4* quads, int mt,
                                         unsigned long long d0) {
  const FrRows r = fr_rows(mt);
  const uint4* q = quads + r.ph_l * FR_QROW + r.col;  // quad row ph_l + s: step s
  uint4 ah[FR_KS];
#pragma unroll
  for (int s = 0; s < FR_KS; ++s) ah[s] = q[s * FR_QROW];
#if FR_SPLIT
  uint4 al[FR_KS];
#pragma unroll
  for (int s = 0; s < FR_KS; ++s) al[s] = q[(FR_NQ + s) * FR_QROW];
#endif
  wg_fence();
#pragma unroll
  for (int s = 0; s < FR_KS; ++s) {
    const unsigned a_hi[4] = {ah[s].x, ah[s].y, ah[s].z, ah[s].w};
#if FR_SPLIT  // the small products first; the first wgmma starts the sums (scale-d 0)
    const unsigned a_lo[4] = {al[s].x, al[s].y, al[s].z, al[s].w};
    wg_mma_rs<FR_NT>(acc, a_lo, fr_b_desc(d0, 0, s), s > 0);
    wg_mma_rs<FR_NT>(acc, a_hi, fr_b_desc(d0, 1, s), 1);
    wg_mma_rs<FR_NT>(acc, a_hi, fr_b_desc(d0, 0, s), 1);
#else
    wg_mma_rs<FR_NT>(acc, a_hi, fr_b_desc(d0, 0, s), s > 0);
#endif
  }
  wg_commit();
}

__device__ __forceinline__ void fr_hold(float (&acc)[FR_NT][4]) {
#pragma unroll
  for (int n = 0; n < FR_NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) WG_HOLD(acc[n][r]);
}

template <typename Input>
__device__ __forceinline__ void fr_conv_pool(Input input, const uint4* __restrict__ btiles,
                                             const float* __restrict__ bias,
                                             ff_out* __restrict__ y, int w_e, int tiles_h) {
  __shared__ float red[FR_WARPS];
  unsigned char* dyn = FR_DYN_SMEM;  // [B tiles] [quads] [staged maps (FR_OUT_SMEM)]
  for (int i = threadIdx.x; i < FR_B_BYTES / 16; i += FR_THREADS)
    reinterpret_cast<uint4*>(dyn)[i] = __ldg(&btiles[i]);
  uint4* quads = reinterpret_cast<uint4*>(dyn + FR_B_BYTES);
  const size_t b = blockIdx.x / tiles_h;
  const int tile_y = blockIdx.x % tiles_h;
  const int warp = threadIdx.x >> 5;
  const int e = fr_stage(input, FrQuadSink{reinterpret_cast<unsigned*>(quads)}, b,
                         tile_y * FR_TPH * 2, red);
  const float unscale = fr_pow2(-(e + w_e));
  float bm[FR_NT];
  fr_bias(bm, bias);
  wg_proxy_fence();  // the B tiles were written by ordinary stores; the wgmmas read them
  __syncthreads();
  const unsigned long long d0 =
      wg_desc_interleaved(static_cast<unsigned>(__cvta_generic_to_shared(dyn)), 128, 256);
  ff_out* out_s = reinterpret_cast<ff_out*>(dyn + FR_B_BYTES + FR_Q_BYTES);
  const int wq = warp % 4;
  // One group at a time: a second accumulator set whose wgmmas run while this one is stored
  // makes ptxas serialize every wgmma (it reads the stored set inside the other's stage).
  for (int grp = warp / 4; grp < FR_GROUPS; grp += FR_WGS) {
    float acc[FR_NT][4];
    fr_issue(acc, quads, grp * 4 + wq, d0);
    wg_wait<0>();
    fr_hold(acc);
    const FrRows r = fr_rows(grp * 4 + wq);
    fr_store(acc, bm, y, out_s, b, tile_y, r.ph_l, r.run, r.valid, unscale);
  }
#if FR_OUT_SMEM
  __syncthreads();
  ff_write_pooled<FR_M, FR_TPH, FR_THREADS>(y, out_s, b, tile_y * FR_TPH);
#endif
}

#include "first_rowpair_entries.cuh"
