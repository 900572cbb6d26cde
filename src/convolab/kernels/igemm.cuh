// The implicit-GEMM family (kernels 26, 27): convolution as one GEMM on the tensor cores,
//   Y[m, n] = sum_k A[m, k] * B[k, n],   m = output channel,  n = (b, ho, wo),  k = (p, q, c),
// with A the weights laid out (M, K, K, Cp) and B gathered from a channels-last input
// x (B, H, W, Cp): for one pixel n and one tap (p, q) the channels c are contiguous, so every
// 16-byte piece of B is one cp.async from global memory, exactly like A's. Cp is C rounded up
// to 8 with zero channels (zero weights too), so no 16-byte piece straddles two taps.
//
// Operand modes (IG_MODE): 0 tf32, 1 fp16, 2 bf16 (fp32 accumulate), 3 3xtf32 (fp32-exact:
// v = big + small, both rounded to tf32, acc += a_s*b_b + a_b*b_s + a_b*b_b; the tensor cores
// truncate while accumulating, so each BK-slice is summed from zero and added into a separate
// fp32 total with round-to-nearest adds, which keeps 25088-term sums at ~1e-7).
// Shared memory holds fp32 (modes 0, 3) or 16-bit elements; in both a fragment's k-step is 32
// bytes, so one ldmatrix.x4 address rule serves every mode (a tf32 element is a b16 pair).
//
// Block tile BM x BN x BK (BK in elements), WARPS_M x WARPS_N warps each owning a
// (BM/WARPS_M) x (BN/WARPS_N) accumulator tile of m16n8 MMAs, STAGES-deep cp.async ring.
#pragma once

#include "common.cuh"
#include "igemm_problem.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 32
#endif
#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef WARPS_N
#define WARPS_N 4
#endif
#ifndef STAGES
#define STAGES 4
#endif


#define IG_THREADS (32 * WARPS_M * WARPS_N)
#define IG_ESIZE ((int)sizeof(ig_t))
#define IG_VEC (16 / IG_ESIZE)             // elements in one 16-byte copy
#define IG_KSTEP (32 / IG_ESIZE)           // k of one MMA: 8 (tf32) or 16 (fp16/bf16)
#define IG_CHUNKS (BK * IG_ESIZE / 16)     // 16-byte pieces in one row of a stage
#define IG_ROWB (BK * IG_ESIZE + 16)       // row pitch in bytes: an odd number of 16-byte
                                           // units, so ldmatrix's 8 rows hit 8 distinct bank
                                           // groups without a swizzle
#define IG_WM (BM / WARPS_M)
#define IG_WN (BN / WARPS_N)
#define IG_MI (IG_WM / 16)
#define IG_NI (IG_WN / 8)
#define IG_A_ITERS (BM * IG_CHUNKS / IG_THREADS)
#define IG_B_ITERS (BN * IG_CHUNKS / IG_THREADS)
#define IG_STAGE_BYTES ((BM + BN) * IG_ROWB)

static_assert((BK * IG_ESIZE) % 32 == 0, "a stage row must hold whole 32-byte k-steps");
static_assert(IG_WM % 16 == 0 && IG_WN % 16 == 0, "warp tile must be multiples of 16 x 16");
static_assert(IG_THREADS % IG_CHUNKS == 0, "threads must cover whole rows");
static_assert((BM * IG_CHUNKS) % IG_THREADS == 0 && (BN * IG_CHUNKS) % IG_THREADS == 0,
              "every thread copies the same number of pieces");
static_assert(STAGES >= 2, "the pipeline needs at least two stages");

__device__ __forceinline__ unsigned ig_tf32(unsigned bits) {
  return __float_as_uint(tf32_round(__uint_as_float(bits)));
}

// 3xTF32 on raw bits (common.cuh's tf32_split).
__device__ __forceinline__ unsigned ig_split_tf32(unsigned& v) {
  float f = __uint_as_float(v);
  const float small = tf32_split(f);
  v = __float_as_uint(f);
  return __float_as_uint(small);
}

__device__ __forceinline__ void ig_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
#if IG_MODE == 1
  mma_f16_m16n8k16(d, a[0], a[1], a[2], a[3], b0, b1);
#elif IG_MODE == 2
  mma_bf16_m16n8k16(d, a[0], a[1], a[2], a[3], b0, b1);
#else
  mma_tf32_m16n8k8(d, a[0], a[1], a[2], a[3], b0, b1);
#endif
}

// Per-thread copy plan of one block: which A rows and B pixels this thread moves, decoded once.
struct IgLoader {
  const ig_t* a_ptr[IG_A_ITERS];  // the weight row's element kc * IG_VEC
  bool a_ok[IG_A_ITERS];
  const ig_t* b_ptr[IG_B_ITERS];  // the pixel's (p, q, c) = (0, 0, 0) element
  bool b_ok[IG_B_ITERS];
  unsigned a_dst, b_dst;          // this thread's first shared-memory piece in stage 0
  int kc;                         // its 16-byte column within a row

  __device__ void init(const ig_t* x, const ig_t* w, const IgProblem& p, int m0, int n0,
                       unsigned smem) {
    const int tid = threadIdx.x;
    kc = tid % IG_CHUNKS;
    const int row0 = tid / IG_CHUNKS;
    constexpr int ROWS_PER_PASS = IG_THREADS / IG_CHUNKS;
#pragma unroll
    for (int i = 0; i < IG_A_ITERS; ++i) {
      const int m = m0 + row0 + i * ROWS_PER_PASS;
      a_ok[i] = m < p.M;
      a_ptr[i] = w + (size_t)(a_ok[i] ? m : 0) * p.Kd + kc * IG_VEC;
    }
    const int pix = p.Ho * p.Wo;
#pragma unroll
    for (int i = 0; i < IG_B_ITERS; ++i) {
      const int n = n0 + row0 + i * ROWS_PER_PASS;
      b_ok[i] = n < p.N;
      const int nn = b_ok[i] ? n : 0;
      const int b = nn / pix, r = nn - b * pix;
      const int ho = r / p.Wo, wo = r - ho * p.Wo;
      b_ptr[i] = x + (((size_t)b * p.H + (size_t)ho * p.S) * p.W + (size_t)wo * p.S) * p.Cp;
    }
    a_dst = smem + row0 * IG_ROWB + kc * 16;
    b_dst = smem + BM * IG_ROWB + row0 * IG_ROWB + kc * 16;
  }

  // Issue the copies of the k-tile starting at k0 (elements) into ring slot `stage`.
  __device__ void load(const IgProblem& p, int k0, int k_end, int stage) {
    constexpr int ROWS_PER_PASS = IG_THREADS / IG_CHUNKS;
    const int k = k0 + kc * IG_VEC;
    const bool k_ok = k < k_end;
    // The tap of this piece: one division pair per k-tile, shared by all its B rows. A's
    // pointers already hold kc * IG_VEC, B's hold the pixel only: b_off is the whole k part.
    const int tap = k_ok ? k / p.Cp : 0;
    const int c = k_ok ? k - tap * p.Cp : 0;
    const int pp = tap / p.K, q = tap - pp * p.K;
    const size_t b_off = ((size_t)pp * p.W + q) * p.Cp + c;
    const unsigned base = stage * IG_STAGE_BYTES;
#pragma unroll
    for (int i = 0; i < IG_A_ITERS; ++i)
      ig_cp16(a_dst + base + i * ROWS_PER_PASS * IG_ROWB, a_ptr[i] + (k_ok ? k0 : 0),
              a_ok[i] && k_ok);
#pragma unroll
    for (int i = 0; i < IG_B_ITERS; ++i)
      ig_cp16(b_dst + base + i * ROWS_PER_PASS * IG_ROWB, b_ptr[i] + b_off, b_ok[i] && k_ok);
  }
};

// Fragments of one 32-byte k-step of the warp's tile, loaded by ldmatrix.
__device__ __forceinline__ void ig_fragments(unsigned (&a)[IG_MI][4], unsigned (&b)[IG_NI][2],
                                             unsigned stage_base, int ks, int wm0, int wn0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mi = 0; mi < IG_MI; ++mi) {
    const int row = wm0 + mi * 16 + (lane % 16);
    ldsm_x4(a[mi], stage_base + row * IG_ROWB + ks * 32 + (lane / 16) * 16);
  }
#pragma unroll
  for (int nj = 0; nj < IG_NI / 2; ++nj) {
    const int row = wn0 + nj * 16 + (lane % 8) + (lane / 16) * 8;
    unsigned r[4];
    ldsm_x4(r, stage_base + BM * IG_ROWB + row * IG_ROWB + ks * 32 + ((lane / 8) % 2) * 16);
    b[2 * nj][0] = r[0];
    b[2 * nj][1] = r[1];
    b[2 * nj + 1][0] = r[2];
    b[2 * nj + 1][1] = r[3];
  }
}

// The warp's MMAs for one k-step, in the mode's arithmetic.
__device__ __forceinline__ void ig_step(float (&acc)[IG_MI][IG_NI][4], unsigned (&a)[IG_MI][4],
                                        unsigned (&b)[IG_NI][2]) {
#if IG_MODE == 3
  unsigned a_small[IG_MI][4], b_small[IG_NI][2];
#pragma unroll
  for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
    for (int r = 0; r < 4; ++r) a_small[mi][r] = ig_split_tf32(a[mi][r]);
#pragma unroll
  for (int ni = 0; ni < IG_NI; ++ni)
#pragma unroll
    for (int r = 0; r < 2; ++r) b_small[ni][r] = ig_split_tf32(b[ni][r]);
#pragma unroll
  for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < IG_NI; ++ni) {
      ig_mma(acc[mi][ni], a_small[mi], b[ni][0], b[ni][1]);
      ig_mma(acc[mi][ni], a[mi], b_small[ni][0], b_small[ni][1]);
      ig_mma(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
#else
#if IG_MODE == 0
#pragma unroll
  for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[mi][r] = ig_tf32(a[mi][r]);
#pragma unroll
  for (int ni = 0; ni < IG_NI; ++ni)
#pragma unroll
    for (int r = 0; r < 2; ++r) b[ni][r] = ig_tf32(b[ni][r]);
#endif
#pragma unroll
  for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < IG_NI; ++ni) ig_mma(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
#endif
}

// The block's accumulators over k in [k_begin, k_end): the STAGES-deep cp.async ring, one
// barrier per k-tile (the slot refilled at iteration t is the one every warp finished at t-1).
__device__ __forceinline__ void ig_mainloop(float (&total)[IG_MI][IG_NI][4], const ig_t* x,
                                            const ig_t* w, const IgProblem& p, int m0, int n0,
                                            int k_begin, int k_end) {
  extern __shared__ __align__(128) unsigned char ig_smem[];
  const unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(ig_smem));
  const int warp = threadIdx.x / 32;
  const int wm0 = (warp / WARPS_N) * IG_WM, wn0 = (warp % WARPS_N) * IG_WN;
  IgLoader ld;
  ld.init(x, w, p, m0, n0, smem);
#pragma unroll
  for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < IG_NI; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) total[mi][ni][r] = 0.0f;
#if IG_MODE == 3
  float acc[IG_MI][IG_NI][4];
#else
  float (&acc)[IG_MI][IG_NI][4] = total;
#endif

  const int tiles = (k_end - k_begin + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < tiles) ld.load(p, k_begin + s * BK, k_end, s);
    cp_async_commit();
  }
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int next = t + STAGES - 1;
    if (next < tiles) ld.load(p, k_begin + next * BK, k_end, next % STAGES);
    cp_async_commit();
    const unsigned stage_base = smem + (t % STAGES) * IG_STAGE_BYTES;
#if IG_MODE == 3
#pragma unroll
    for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < IG_NI; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.0f;
#endif
#pragma unroll
    for (int ks = 0; ks < BK / IG_KSTEP; ++ks) {
      unsigned a[IG_MI][4], b[IG_NI][2];
      ig_fragments(a, b, stage_base, ks, wm0, wn0);
      ig_step(acc, a, b);
    }
#if IG_MODE == 3
#pragma unroll
    for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < IG_NI; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) total[mi][ni][r] += acc[mi][ni][r];
#endif
  }
  cp_async_wait_all();
}

// Calls f(m, n, value) for each accumulator this thread holds: c0/c1 are row g, columns
// 2t and 2t+1 of an m16n8 tile; c2/c3 the same columns of row g+8.
template <typename F>
__device__ __forceinline__ void ig_for_each(const float (&total)[IG_MI][IG_NI][4], int m0,
                                            int n0, F f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm0 = (warp / WARPS_N) * IG_WM, wn0 = (warp % WARPS_N) * IG_WN;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < IG_MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < IG_NI; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        f(m0 + wm0 + mi * 16 + g + (r / 2) * 8, n0 + wn0 + ni * 8 + 2 * t + (r % 2),
          total[mi][ni][r]);
}

// x NCHW fp32 -> channels-last (B, H, W, Cp) in the operand type, channels C..Cp-1 zero.
// One block transposes a 32-channel x 32-column tile of one input row through shared
// memory, so both the read (along w) and the write (along c) are coalesced.
extern "C" __global__ void __launch_bounds__(256)
to_channels_last(const float* __restrict__ x, ig_t* __restrict__ out, int C, int Cp, int H,
                 int W) {
  __shared__ float tile[32][33];
  const int w0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
  const int bh = blockIdx.z;  // b * H + h
  const int b = bh / H, h = bh - b * H;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int c = c0 + i, wc = w0 + threadIdx.x;
    tile[i][threadIdx.x] =
        (c < C && wc < W) ? x[(((size_t)b * C + c) * H + h) * W + wc] : 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int wc = w0 + i, c = c0 + threadIdx.x;
    if (wc < W && c < Cp) out[((size_t)bh * W + wc) * Cp + c] = ig_t(tile[threadIdx.x][i]);
  }
}

// The same for 1x1 images (the classifier layers): NCHW already is channels-last, so only the
// type changes and channels C..Cp-1 are zeroed. The tile transpose above would launch one
// block per 32 channels of a single pixel there, slower than the GEMM it feeds.
extern "C" __global__ void __launch_bounds__(256)
cast_channels(const float* __restrict__ x, ig_t* __restrict__ out, int C, int Cp, int B) {
  const size_t total = (size_t)B * Cp;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const int b = (int)(i / Cp), c = (int)(i - (size_t)b * Cp);
    out[i] = ig_t(c < C ? x[(size_t)b * C + c] : 0.0f);
  }
}
