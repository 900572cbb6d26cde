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

#include "first_block.cuh"

#ifndef FR_M
#define FR_M 12  // output channels
#endif
#ifndef FR_SPLIT
#define FR_SPLIT 0  // 1: hi/lo fp16 parts, three MMAs per product
#endif
#ifndef FR_TPH
#define FR_TPH FF_HP  // pooled rows of a block
#endif
#ifndef FR_WARPS
#define FR_WARPS 4
#endif
#ifndef FR_OUT_SMEM
#define FR_OUT_SMEM 0  // 1: stage the pooled output in dynamic shared memory (host sizes it)
#endif

static_assert(FF_P == 2, "a lane's accumulators are one 2x2 pool window");
static_assert(FF_K <= 7, "two outputs an A row need k % 8 - 1 < K");

#define FR_THREADS (FR_WARPS * 32)
#define FR_D (FF_K <= 5 ? 4 : 2)                  // conv columns of an A row (dx)
#define FR_CN (8 / FR_D)                          // channels of an n-tile
#define FR_NT ((FR_M + FR_CN - 1) / FR_CN)        // n-tiles
#define FR_KS ((FF_K + 1) / 2)                    // k-steps: filter-row pairs
#define FR_NA (2 * FR_KS + 1)                     // A words a lane loads an m-tile
#define FR_NR ((2 * FF_WP + FR_D - 1) / FR_D)     // runs (A rows) of a pooled row
#define FR_COMBOS (FR_TPH * FR_NR)                // (pooled row, run) pairs of a block
#define FR_MTILES ((FR_COMBOS + 7) / 8)
#define FR_IR (2 * FR_TPH + 2 * FR_KS - 1)        // staged rows: a3 of the last k-step
#define FR_RS ((FR_NR - 1) * FR_D + 8)            // staged columns (fp16): a run reads 8
#define FR_PAIRS (FR_IR * FR_RS / 2)              // staged pixel pairs
#define FR_PER ((FR_PAIRS + FR_THREADS - 1) / FR_THREADS)  // pairs a thread stages
#define FR_PARTS (FR_SPLIT ? 2 : 1)
#define FR_EMAX 60  // |input scale exponent|: the host keeps the weights' within the same

#if FR_OUT_SMEM && !defined(FR_DYN_SMEM)  // (the CPU emulator supplies its own buffer)
extern __shared__ __align__(16) unsigned char fr_dyn_smem[];  // FR_M x FR_TPH x FF_WP ff_out
#define FR_DYN_SMEM fr_dyn_smem
#endif

// The minimal pitch is also conflict-free: a warp's 8 runs read at most 8 * D / 2 + 4
// consecutive words of a row, continuing into the next pooled row where a tile crosses one.

struct FrFloatInput {  // fp32 (B, 1, H, W) in global memory
  const float* __restrict__ x;
  __device__ __forceinline__ float2 operator()(size_t b, int gy, int gx) const {
    float2 v = make_float2(0.f, 0.f);
    if (gy >= FF_H) return v;
    const float* row = x + (b * FF_H + gy) * (size_t)FF_W;
    if (FF_W % 2 == 0) {
      if (gx < FF_W) v = __ldg(reinterpret_cast<const float2*>(row + gx));
    } else {
      if (gx < FF_W) v.x = __ldg(row + gx);
      if (gx + 1 < FF_W) v.y = __ldg(row + gx + 1);
    }
    return v;
  }
};

struct FrRawInput {  // the row pass of the block's rows (ff_raw_rows), in shared memory
  const float* rows;
  const ResizeTap* taps;  // FF_H row taps, then FF_W column taps (shared memory)
  int row0;
  __device__ __forceinline__ float2 operator()(size_t, int gy, int gx) const {
    float2 v = make_float2(0.f, 0.f);
    if (gy < FF_H) {
      const float* row = rows + (gy - row0) * RAW_W;
      if (gx < FF_W) v.x = resized_from_row(row, taps[FF_H + gx]);
      if (gx + 1 < FF_W) v.y = resized_from_row(row, taps[FF_H + gx + 1]);
    }
    return v;
  }
};

__device__ __forceinline__ unsigned fr_half2(float a, float b) {
  const __half2 h = pack_half2(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

// 2^e as a float (|e| <= 126).
__device__ __forceinline__ float fr_pow2(int e) { return __int_as_float((127 + e) << 23); }

// The block's tile as fp16 pixel pairs (tile[part][row][col]: part 0 hi, 1 lo), zero outside
// the image; returns the input's scale exponent (0 without the split).
template <typename Input>
__device__ __forceinline__ int fr_stage(Input input, unsigned* tile, size_t b, int iy0,
                                        float* red) {
  float2 v[FR_PER];
  float mx = 0.f;
#pragma unroll
  for (int u = 0; u < FR_PER; ++u) {
    const int i = threadIdx.x + u * FR_THREADS;
    const int row = i / (FR_RS / 2), p2 = i - row * (FR_RS / 2);
    v[u] = make_float2(0.f, 0.f);
    if (i < FR_PAIRS) v[u] = input(b, iy0 + row, 2 * p2);
    mx = fmaxf(mx, fmaxf(fabsf(v[u].x), fabsf(v[u].y)));
  }
  int e = 0;
  float s = 1.f;
#if FR_SPLIT
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < FR_WARPS; ++w) mx = fmaxf(mx, red[w]);
  // largest |v| s in [2^14, 2^15): hi stays finite, lo keeps 11 bits for all but tiny values
  const int ex = static_cast<int>((__float_as_uint(mx) >> 23) & 0xff) - 127;
  e = max(-FR_EMAX, min(FR_EMAX, 14 - ex));
  s = fr_pow2(e);
#endif
#pragma unroll
  for (int u = 0; u < FR_PER; ++u) {
    const int i = threadIdx.x + u * FR_THREADS;
    if (i >= FR_PAIRS) break;
    const float a = v[u].x * s, c = v[u].y * s;
    tile[i] = fr_half2(a, c);
#if FR_SPLIT
    const float ah = __half2float(__float2half_rn(a)), ch = __half2float(__float2half_rn(c));
    tile[FR_PAIRS + i] = fr_half2(a - ah, c - ch);
#endif
  }
  (void)red;
  return e;
}

// A lane's B fragments of every k-step and n-tile ([part][s][nt][lane] in bfrag:
// gpu/fused_first.py rowpair_fragments) and the bias of its channel in each n-tile (n * CN +
// 2t / D).
struct FrWeights {
  uint2 bf[FR_PARTS][FR_KS][FR_NT];
  float bm[FR_NT];
};

__device__ __forceinline__ FrWeights fr_weights(const uint2* __restrict__ bfrag,
                                                const float* __restrict__ bias) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  FrWeights wt;
#pragma unroll
  for (int h = 0; h < FR_PARTS; ++h)
#pragma unroll
    for (int s = 0; s < FR_KS; ++s)
#pragma unroll
      for (int n = 0; n < FR_NT; ++n)
        wt.bf[h][s][n] = __ldg(&bfrag[((h * FR_KS + s) * FR_NT + n) * 32 + lane]);
#pragma unroll
  for (int n = 0; n < FR_NT; ++n) {
    const int c = n * FR_CN + 2 * t / FR_D;
    wt.bm[n] = c < FR_M ? __ldg(&bias[c]) : 0.f;
  }
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
    const int ph = tile_y * FR_TPH + ph_l, pw = run * (FR_D / 2) + (2 * t % FR_D) / 2;
    if (mt * 8 + g < FR_COMBOS && ph < FF_HP && pw < FF_WP) {
#if FR_OUT_SMEM
      ff_out* yp = reinterpret_cast<ff_out*>(FR_DYN_SMEM) + ph_l * FF_WP + pw;
      constexpr int kPlane = FR_TPH * FF_WP;
#else
      ff_out* yp = y + b * FR_M * FF_TASKS + ph * FF_WP + pw;
      constexpr int kPlane = FF_TASKS;
#endif
#pragma unroll
      for (int n = 0; n < FR_NT; ++n) {
        const int c = n * FR_CN + 2 * t / FR_D;
        if (FR_M % FR_CN != 0 && c >= FR_M) continue;
        float v = fmax_nan(fmax_nan(acc[n][0], acc[n][1]), fmax_nan(acc[n][2], acc[n][3]));
        if (FR_SPLIT) v *= unscale;  // exact: a power of two, after the max (monotonic)
        yp[c * kPlane] = ff_convert(fmax_nan(v + wt.bm[n], 0.f));
      }
    }
  }
#if FR_OUT_SMEM
  __syncthreads();
  ff_write_pooled<FR_M, FR_TPH, FR_THREADS>(y, reinterpret_cast<const ff_out*>(FR_DYN_SMEM), b,
                                            tile_y * FR_TPH);
#endif
}

// x: (B, 1, FF_H, FF_W) fp32; y: (B, FR_M, HP, WP). Grid: B * tiles_h blocks.
extern "C" __global__ void __launch_bounds__(FR_THREADS, FF_MINB)
fr_conv_pool_f32(const float* __restrict__ x, const uint2* __restrict__ bfrag,
                 const float* __restrict__ bias, ff_out* __restrict__ y, int w_e, int tiles_h) {
  fr_conv_pool(FrFloatInput{x}, bfrag, bias, y, w_e, tiles_h);
}

// raw: (B, RAW_H, RAW_W) uint8: the image's bytes and taps in one round trip (ff_raw_rows), the
// row pass of the block's rows, and the column pass as the tile is staged.
extern "C" __global__ void __launch_bounds__(FR_THREADS, FF_MINB)
fr_conv_pool_raw(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
                 const uint2* __restrict__ bfrag, const float* __restrict__ bias,
                 ff_out* __restrict__ y, int w_e, int tiles_h) {
  __shared__ __align__(16) FfRawRows raw_s;
  __shared__ float rows[FR_IR * RAW_W];
  const int row0 = (blockIdx.x % tiles_h) * FR_TPH * 2;
  ff_raw_rows(rows, raw_s, raw + (size_t)(blockIdx.x / tiles_h) * FF_RAW_BYTES, taps, row0,
              FR_IR, threadIdx.x, FR_THREADS);
  __syncthreads();
  fr_conv_pool(FrRawInput{rows, raw_s.taps, row0}, bfrag, bias, y, w_e, tiles_h);
}
