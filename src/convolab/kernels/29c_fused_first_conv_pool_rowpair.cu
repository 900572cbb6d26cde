// Rung 29c — rung 29's first block on fp16 tensor cores with two filter rows per MMA and the
// output channels in the MMA's n (modes 'fp16' and, split in two fp16 parts, 'exact'); the same
// entries as 29b (raw uint8 or float input, fp32 or fp16 output).
//
// What changes against 29b, and why. 29b's Toeplitz operand (kernel 17) feeds one filter row of
// 16 input columns to 8 outputs of one channel: K of every 16 k-terms are useful (31 % at K = 5),
// so conv1 issued 2228 (mxnet) / 2436 (eecs498) MMAs an image, and ran them per channel group
// (the B fragments of 12 channels did not fit the registers). Here an A row is 8 pixels of input
// row y + 2s followed by the 8 pixels below them (row y + 2s + 1), and B's column n = (channel,
// dx) holds filter rows 2s and 2s + 1 of that channel shifted by dx:
//     A[i][k] = in[y_i + 2s + k / 8][x_i + k % 8],   B[k][c * D + dx] = w[c][2s + k / 8][k % 8 - dx]
// with D = 4 outputs per A row at K <= 5 (k % 8 - dx < K needs dx <= 8 - K) and D = 2 at K = 7:
// 10 (K = 5) or 14 (K = 7) of 16 k-terms useful, ceil(K / 2) k-steps, 8 / D channels per n-tile,
// so every channel's fragments stay in registers and one pass covers all of them: 1278 / 1272
// MMAs an image. As in 17, A rows i and i + 8 are vertically adjacent outputs and a lane's
// columns 2t, 2t + 1 horizontally adjacent ones (dx even), so a lane's 4 accumulators are one
// 2x2 pool window of one channel. A's registers: a0 = row y + 2s, a1 = a2 = row y + 2s + 1, a3 =
// row y + 2s + 2 (each 4 bytes at column x + 2t), so an m-tile loads 2 * ceil(K / 2) + 1 words a
// lane for all its k-steps and channels.
//
// FR_SPLIT = 1 ('3xfp16', exact mode): v = hi + lo with hi = fp16(v s), lo = fp16(v s - hi)
// (s a power of two), and a*b ~ lo_a hi_b + hi_a lo_b + hi_a hi_b: 22 bits of each operand, three
// MMAs per product, fp32 accumulation — fp32 accuracy. The weights' scale is chosen on the host,
// the input's per block from the largest |value| the block stages (power-of-two scaling is
// exact, so the raw and float entries still agree bit for bit); the output is unscaled before
// the bias. Values whose split falls in fp16's subnormals lose bits only far below 2^-24 of the
// block's largest input.
//
// A block stages FR_TPH pooled rows' input (one image by default: the raw image's bytes once,
// first_block.cuh) as fp16 (hi and lo with FR_SPLIT), then its warps take m-tiles of 8 runs.
// Zero weights meet the pixels right of a run and the row below the last filter row, so a NaN
// there also reaches the neighbouring windows (tensor-core rungs may widen a NaN; FFMA rungs
// do not).
//
// FR_OUT_SMEM = 1: the pooled maps go through dynamic shared memory (ff_write_pooled). From
// the fragments, an m-tile writes 8 values of each channel plane: 16 bytes, half a sector, in
// fp16 at K = 7 (docs/raw.md: conv1 L2-bound, 298 -> 206 us on the H100).
//
// Measured (H100, B = 10,000, float / raw input, fp32 out; docs/raw.md): fp16 mxnet 0.416 /
// 0.330 ms (fp16 out 0.270 / 0.304; 29b 0.417 / 0.540), eecs498 0.453 / 0.325 (fp16 out 0.312 /
// 0.282; 29b 0.395 / 0.488); 3xfp16 mxnet 0.443 / 0.521, eecs498 0.437 / 0.473 (FFMA 0.83 /
// 1.00 and 1.15 / 1.43) at 2.7e-7 relative L2. ncu (fp16, raw): 5 blocks an SM (95 registers),
// 7.7 cycles between a warp's instructions, 62 % SM throughput, 22 % DRAM: issue-bound at low
// occupancy; the raw column pass issues about as many instructions as the MMA loop.

#include "first_rowpair.cuh"

typedef uint2 fr_b_t;  // a lane's B fragment of one k-step and n-tile
#define FR_ENTRY(kind) fr_conv_pool_##kind

// A lane's B fragments of every k-step and n-tile ([part][s][nt][lane] in bfrag:
// gpu/fused_first.py rowpair_fragments) and the bias of its channel in each n-tile (n * CN +
// 2t / D).
struct FrWeights {
  uint2 bf[FR_PARTS][FR_KS][FR_NT];
  float bm[FR_NT];
};

__device__ __forceinline__ FrWeights fr_weights(const uint2* __restrict__ bfrag,
                                                const float* __restrict__ bias) {
  const int lane = threadIdx.x & 31;
  FrWeights wt;
#pragma unroll
  for (int h = 0; h < FR_PARTS; ++h)
#pragma unroll
    for (int s = 0; s < FR_KS; ++s)
#pragma unroll
      for (int n = 0; n < FR_NT; ++n)
        wt.bf[h][s][n] = __ldg(&bfrag[((h * FR_KS + s) * FR_NT + n) * 32 + lane]);
  fr_bias(wt.bm, bias);
  return wt;
}

// w_e: the weights' scale exponent (0 without the split). The weights are loaded after the
// staging: loaded before it (their latency overlapping it) they kept their registers live with
// the staged values' (104-110 instead of 95 at mxnet), ran as fast or up to 8 % slower.
template <typename Input>
__device__ __forceinline__ void fr_conv_pool(Input input, const uint2* __restrict__ bfrag,
                                             const float* __restrict__ bias,
                                             ff_out* __restrict__ y, int w_e, int tiles_h) {
  __shared__ __align__(16) unsigned tile[FR_PARTS * FR_PAIRS];
  __shared__ float red[FR_WARPS];
  const size_t b = blockIdx.x / tiles_h;
  const int tile_y = blockIdx.x % tiles_h;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int e = fr_stage(input, tile, b, tile_y * FR_TPH * 2, red);
  const float unscale = fr_pow2(-(e + w_e));
  const FrWeights wt = fr_weights(bfrag, bias);
  const auto& bf = wt.bf;
  __syncthreads();
  const unsigned* hi_s = tile;
  const unsigned* lo_s = tile + FR_PAIRS;
  (void)lo_s;
  for (int mt = warp; mt < FR_MTILES; mt += FR_WARPS) {
    const int combo = min(mt * 8 + g, FR_COMBOS - 1);
    const int ph_l = combo / FR_NR, run = combo - ph_l * FR_NR;
    const int at = (2 * ph_l * FR_RS + run * FR_D) / 2 + t;  // word of row y, column x + 2t
    unsigned ah[FR_NA];
#pragma unroll
    for (int j = 0; j < FR_NA; ++j) ah[j] = hi_s[at + j * (FR_RS / 2)];
#if FR_SPLIT
    unsigned al[FR_NA];
#pragma unroll
    for (int j = 0; j < FR_NA; ++j) al[j] = lo_s[at + j * (FR_RS / 2)];
#endif
    float acc[FR_NT][4];
#pragma unroll
    for (int n = 0; n < FR_NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int s = 0; s < FR_KS; ++s) {
#pragma unroll
      for (int n = 0; n < FR_NT; ++n) {
#if FR_SPLIT  // the small products first
        mma_f16_m16n8k16(acc[n], al[2 * s], al[2 * s + 1], al[2 * s + 1], al[2 * s + 2],
                         bf[0][s][n].x, bf[0][s][n].y);
        mma_f16_m16n8k16(acc[n], ah[2 * s], ah[2 * s + 1], ah[2 * s + 1], ah[2 * s + 2],
                         bf[FR_PARTS - 1][s][n].x, bf[FR_PARTS - 1][s][n].y);
#endif
        mma_f16_m16n8k16(acc[n], ah[2 * s], ah[2 * s + 1], ah[2 * s + 1], ah[2 * s + 2],
                         bf[0][s][n].x, bf[0][s][n].y);
      }
    }
    fr_store(acc, wt.bm, y, reinterpret_cast<ff_out*>(FR_DYN_SMEM), b, tile_y, ph_l, run,
             mt * 8 + g < FR_COMBOS, unscale);
  }
#if FR_OUT_SMEM
  __syncthreads();
  ff_write_pooled<FR_M, FR_TPH, FR_THREADS>(y, reinterpret_cast<const ff_out*>(FR_DYN_SMEM), b,
                                            tile_y * FR_TPH);
#endif
}

#include "first_rowpair_entries.cuh"
