// Rung 39: implicit-GEMM convolution on Hopper's warpgroup MMA (wgmma, sm_90a only).
//
// What it changes against rung 26 (mma.sync): the same GEMM, Y[m, n] = sum_k A[m, k] B[k, n]
// with m the output channel, n = (b, ho, wo) and k = (p, q, c) over a channels-last input, but
//   * the tensor-core instruction is wgmma.mma_async: one warpgroup (4 warps) multiplies a
//     64-row slice of A by a whole BN-wide slice of B per instruction, both read straight from
//     shared memory through matrix descriptors. Rung 26 has every warp ldmatrix its fragments
//     into registers first, then issue m16n8 MMAs one by one, and reaches ~23% of the fp16
//     ceiling on conv5_x; here no operand passes through registers;
//   * shared memory holds each operand row (one 128-byte k-tile of one m or n) in the 128-byte
//     swizzled layout wgmma reads without bank conflicts: 16-byte piece j of row r sits at
//     piece j ^ (r % 8). The cp.async loader writes that layout directly; no padding;
//   * the wgmmas run asynchronously: the loads of the next k-tiles are issued while they run,
//     and with PIPE=1 a warpgroup keeps one k-tile's wgmmas in flight while it issues the next
//     (the ring slot a k-tile used is refilled two k-tiles later, once every warpgroup has
//     waited for it);
//   * the operands are made once by the layout pass (wg_channels_last, counted in the time)
//     and at prepare: TF32 rounded to nearest, and for 3xTF32 both the big and the small
//     parts of x and w (v = big + small, each tf32), so the main loop does no conversion.
//     3xTF32 is then three wgmmas per k-step (small*big, big*small, big*big), summed from zero
//     per k-tile into a separate fp32 total, since the tensor cores truncate as they add.
//     3xfp16 (IG_MODE 4) is the same with fp16 hi and lo parts of operands first scaled by
//     powers of two (x's from max |x| each call: wg_absmax, then the layout pass): a k-tile
//     holds 64 elements instead of 32, at twice TF32's MMA rate, for the same accuracy.
// Block: 2 warpgroups (256 threads). BM = 64 puts them side by side along n (each 64 x BN/2),
// BM = 128 one above the other (each 64 x BN), BM = 256 one above the other with two 64-row
// wgmmas each (each 128 x BN: every B tile read from shared memory feeds twice the work).
// The k-tile is 128 bytes of a row: BK = 64 fp16/bf16 or 32 fp32 elements.
//
// Measured (H100, docs/vgg.md; 59.2 GFLOP each, layout pass included): conv5_x B=64 fp16
// 0.199 ms = 297 TFLOP/s (rung 26: 0.328; cuDNN fp16 channels-last 0.116), TF32 0.304 (26:
// 0.657; cuDNN 0.246), 3xTF32 0.777 (26: 1.33; cuDNN fp32 0.776); conv1_2 B=16 fp16 0.435
// (26: 0.626; cuDNN 0.308), TF32 0.616 (cuDNN 0.763), 3xTF32 1.06 (cuDNN fp32 1.68). The
// layout pass alone takes 0.175 ms of conv1_2's 0.435 and 0.057 of conv5_x's 0.199. BM = 256
// did not pay for 16-bit operands (conv5_x 0.211 vs 128 x 192's 0.199): with one block
// barrier per k-tile the two warpgroups still stall together; rung 40 gives the copies to a
// producer warpgroup with mbarriers (and A to TMA). With WG_NHWC=1 (wgmma.cuh) the input and
// output stay channels-last in the operand type, no layout pass: conv5_x B=64 fp16 0.141 ms,
// conv1_2 B=16 0.240 (cuDNN fp16-cl 0.119, 0.319).
//
// Split-K (WG_KSLICED=1, wgmma.cuh): at batch 8-16 conv5_x has 36-100 output tiles for 132
// SMs, and a block's time is its k-loop (B=8 and B=16 both 0.067 ms NHWC fp16 at 128 x 128,
// against cuDNN fp16-cl's 0.045 at B=8). Block z then walks only k-slice z of gridDim.z, and
// wg_splitk_reduce adds the slices' fp32 partial sums in order. Measured (H100, docs/vgg.md):
// conv5_x channels-last B=8 fp16 0.051 ms at 128 x 192 split 3 (unsplit 0.080), TF32 0.058
// (0.128; cuDNN TF32 0.081); NCHW fp16 0.051 against 0.068 for whole 128 x 128 tiles.

#include "split_scale.cuh"
#include "wgmma.cuh"

#define WG_THREADS 256  // both warpgroups load, then both multiply

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
igemm_wgmma(const ig_t* __restrict__ x, const ig_t* __restrict__ w,
            const float* __restrict__ bias, wg_out_t* __restrict__ y, IG_PROBLEM_ARGS,
            long long x_plane) {
  const IgProblem p = IG_PROBLEM;
  extern __shared__ unsigned char wg_smem_raw[];
  // The swizzle repeats every 1024 bytes and is applied to absolute addresses: align the ring.
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(wg_smem_raw));
  const unsigned smem = (raw + 1023u) & ~1023u;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  const int group = threadIdx.x / 128;
  const int a_row = (group / WG_GROUPS_N) * 64 * WG_MI, b_row = (group % WG_GROUPS_N) * WG_N;

  WgLoader<WG_THREADS> ld;
  ld.init(x, w, p, m0, n0, smem, x_plane, threadIdx.x);
  WG_ACCUMULATORS;

  // t counts this block's k-tiles (all, or its slice with WG_KSLICED): k-tile k.first + t.
  const WgKRange k = wg_k_range((p.Kd + WG_BK - 1) / WG_BK);
  const int tiles = k.count;
  constexpr int AHEAD = STAGES - 1 - PIPE;  // k-tiles in copy while one is multiplied
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < tiles) ld.load(p, (k.first + s) * WG_BK, p.Kd, s);
    cp_async_commit();
  }
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<AHEAD - 1>();
    wg_proxy_fence();
    __syncthreads();  // k-tile t landed; every warpgroup is done with the slot refilled next
    const int next = t + AHEAD;
    if (next < tiles) ld.load(p, (k.first + next) * WG_BK, p.Kd, next % STAGES);
    cp_async_commit();
    wg_step(acc, total, smem + (t % STAGES) * WG_STAGE_BYTES, a_row, b_row);
  }
  wg_wait<0>();
  wg_hold(acc);
  cp_async_wait_all();
  wg_epilogue(total, y, bias, p, m0, n0, a_row, b_row,
              reinterpret_cast<float*>(wg_smem_raw + (smem - raw)), threadIdx.x);
}

// x NCHW fp32 -> channels-last (B, H, W, Cp) operands, channels C..Cp-1 zero: fp16/bf16 cast,
// tf32 rounded, or for 3xTF32 / 3xfp16 the big part here and the small part x_plane elements
// further (3xfp16: of x scaled by 2^e, e from wg_absmax's partial maxima).
// Per image this is a transpose of a C x (H*W) matrix: one block moves a WG_LAYOUT_C-channel x
// WG_LAYOUT_Q-pixel tile of it through shared memory, the pixels counted across rows (a tile
// of one row's columns would leave half of every read idle on 16-wide maps such as conv5_x's).
// A warp reads one channel's pixels, WG_LAYOUT_Q / 32 a lane (one vector load where H*W
// allows); each write is one 16-byte piece of a pixel's channels (8 fp16 or 4 fp32), so a
// pixel's channels leave as whole sectors. 32 x 128 (H200, benchmarks/layout_rate.py): conv1_2
// B=16 fp16 90 us (3.5 TB/s, the D2D copy's 4.0) against 123 for 32 x 32 tiles of one float a
// lane and 2-byte stores; conv5_x B=32 13.7 against 16.5.
#ifndef WG_LAYOUT_C
#define WG_LAYOUT_C 32  // gpu/implicit_gemm_wgmma.py's LAYOUT_TILE, as built without -D
#endif
#ifndef WG_LAYOUT_Q
#define WG_LAYOUT_Q 128
#endif
#define WG_LAYOUT_THREADS 256
#define WG_LAYOUT_VEC (WG_LAYOUT_Q / 32)  // pixels a lane reads

static_assert(WG_LAYOUT_VEC == 1 || WG_LAYOUT_VEC == 2 || WG_LAYOUT_VEC == 4,
              "a lane reads 1, 2 or 4 pixels");
static_assert(WG_LAYOUT_C % (16 / sizeof(ig_t)) == 0, "a tile holds whole 16-byte pieces");

__device__ __forceinline__ void wg_store_piece(ig_t* dst, const float (&v)[16 / sizeof(ig_t)],
                                               long long x_plane, float scale) {
  constexpr int PER = 16 / sizeof(ig_t);
  union {
    uint4 raw;
    ig_t e[PER];
  } piece, rest;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
#if IG_MODE == 3
    piece.e[k] = tf32_round(v[k]);
    rest.e[k] = tf32_round(v[k] - piece.e[k]);
#elif IG_MODE == 4
    const float scaled = v[k] * scale;  // exact: a power of two
    piece.e[k] = __float2half_rn(scaled);
    rest.e[k] = __float2half_rn(scaled - __half2float(piece.e[k]));
#elif IG_MODE == 0
    piece.e[k] = tf32_round(v[k]);
#else
    piece.e[k] = ig_t(v[k]);
#endif
  }
  *reinterpret_cast<uint4*>(dst) = piece.raw;
#if WG_3X
  *reinterpret_cast<uint4*>(dst + x_plane) = rest.raw;
#else
  (void)rest;
  (void)x_plane;
#endif
  (void)scale;
}

// 3xfp16's scale of x is one power of two a call, from max |x| over the whole input (the GEMM's
// tiles mix images). Two launches, neither waiting on another block: wg_absmax leaves each
// block's max in x_max[blockIdx.x], and every block of the layout pass reduces those
// WG_ABSMAX_BLOCKS values itself (1 KB from L2) to the same exponent.
#define WG_ABSMAX_BLOCKS 256  // gpu/implicit_gemm_wgmma.py's ABSMAX_BLOCKS
#define WG_ABSMAX_THREADS 256

// The max of v over the block's threads, in every thread (fmaxf drops NaN: a NaN input
// still propagates through the GEMM itself).
__device__ __forceinline__ float wg_block_max(float v) {
  __shared__ float warp_max[WG_ABSMAX_THREADS / 32];
  return fw_block_max<WG_ABSMAX_THREADS / 32>(v, warp_max);
}

extern "C" __global__ void __launch_bounds__(WG_ABSMAX_THREADS)
wg_absmax(const float* __restrict__ x, long long n, float* __restrict__ x_max) {
  float m = 0.0f;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    m = fmaxf(m, fabsf(__ldg(x + i)));
  m = wg_block_max(m);
  if (threadIdx.x == 0) x_max[blockIdx.x] = m;
}

extern "C" __global__ void __launch_bounds__(WG_LAYOUT_THREADS)
wg_channels_last(const float* __restrict__ x, ig_t* __restrict__ out, int C, int Cp, int H,
                 int W, long long x_plane, const float* __restrict__ x_max,
                 float* __restrict__ x_exponent) {
  constexpr int PER = 16 / sizeof(ig_t);     // channels a 16-byte piece holds
  constexpr int PIECES = WG_LAYOUT_C / PER;  // pieces of one pixel in the tile
  constexpr int V = WG_LAYOUT_VEC;
  __shared__ float tile[WG_LAYOUT_C][WG_LAYOUT_Q + 1];  // +1: a pixel's channels in 32 banks
  const int hw = H * W;
  const int q0 = blockIdx.x * WG_LAYOUT_Q, c0 = blockIdx.y * WG_LAYOUT_C, b = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool whole = hw % V == 0 && q0 + WG_LAYOUT_Q <= hw;  // vector loads stay aligned, in
  float scale = 1.0f;
#if IG_MODE == 4
  static_assert(WG_LAYOUT_THREADS == WG_ABSMAX_THREADS && WG_ABSMAX_BLOCKS <= WG_LAYOUT_THREADS,
                "one partial max a thread");
  const int e = fw_scale_exponent(
      wg_block_max(threadIdx.x < WG_ABSMAX_BLOCKS ? x_max[threadIdx.x] : 0.0f));
  scale = ldexpf(1.0f, e);
  if (blockIdx.x + blockIdx.y + blockIdx.z == 0 && threadIdx.x == 0) *x_exponent = (float)e;
#else
  (void)x_max;
  (void)x_exponent;
#endif
  for (int i = warp; i < WG_LAYOUT_C; i += WG_LAYOUT_THREADS / 32) {
    const int c = c0 + i, q = q0 + lane * V;
    const float* row = x + ((size_t)b * C + c) * hw;
    float v[V];
    if (c < C && whole) {
      if constexpr (V == 4) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(row + q));
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
      } else if constexpr (V == 2) {
        const float2 f = __ldg(reinterpret_cast<const float2*>(row + q));
        v[0] = f.x, v[1] = f.y;
      } else {
        v[0] = __ldg(row + q);
      }
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = c < C && q + e < hw ? __ldg(row + q + e) : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < V; ++e) tile[i][lane * V + e] = v[e];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < WG_LAYOUT_Q * PIECES; t += WG_LAYOUT_THREADS) {
    const int q = q0 + t / PIECES, c = c0 + (t % PIECES) * PER;
    if (q >= hw || c >= Cp) continue;  // Cp is a multiple of PER: a piece is all in or out
    float v[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) v[k] = tile[c - c0 + k][q - q0];
    wg_store_piece(out + ((size_t)b * hw + q) * Cp + c, v, x_plane, scale);
  }
}
