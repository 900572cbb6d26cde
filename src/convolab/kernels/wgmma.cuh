// What kernels 39 and 40 share: the tile configuration, Hopper's warpgroup MMA (wgmma) on
// 128-byte-swizzled shared memory, the cp.async loader that writes that swizzle, and the
// epilogues. 39 runs the loader on all of its threads between block barriers; 40 gives it to
// a producer warpgroup of its own, so the loader is a template on how many threads run it.
//
// Output: NCHW fp32 (the registry's contract), or with WG_NHWC=1 channels-last
// (planes, B, Ho, Wo, Mp) in the operand type (fp16/bf16, tf32-rounded fp32, 3xTF32's big
// and small planes), Mp = M rounded up to 8 with channels M..Mp-1 zero: exactly what the next
// layer's loader reads, so a network keeps its activations channels-last between layers.
// Bias is added in fp32 to the fp32 accumulators; WG_RELU=1 applies ReLU (NaN stays NaN).
//
// Split-K (WG_KSLICED=1): conv5_x at batch 8-16 has 36-100 output tiles for 132 SMs, so the
// k-tiles are cut into gridDim.z slices and block z multiplies slice z alone (wg_k_range).
// Its epilogue then writes the fp32 partial sums, no bias, no ReLU, one plane, to slab z of a
// workspace in the output's own element order (NCHW, or (B, Ho, Wo, Mp) channels-last), so
// that wg_splitk_reduce is elementwise and coalesced: it adds the slabs in slice order (a
// fixed order: deterministic, no atomics), then bias and ReLU, and writes the output's real
// form through the same stores as the unsplit epilogue.
#pragma once

#include "common.cuh"
#include "igemm_problem.cuh"
#include "wgmma_core.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef PIPE
#define PIPE 1
#endif
#ifndef WG_NHWC
#define WG_NHWC 0
#endif
#ifndef WG_RELU
#define WG_RELU 0
#endif
#ifndef WG_KSLICED
#define WG_KSLICED 0
#endif

// The layer's output type, and what the GEMM kernel writes: the output itself, or with
// WG_KSLICED its fp32 partial sums.
#if WG_NHWC
typedef ig_t wg_y_t;
#else
typedef float wg_y_t;
#endif
#if WG_KSLICED
typedef float wg_out_t;
#else
typedef wg_y_t wg_out_t;
#endif

#define WG_CONSUMERS 256                    // the two warpgroups that issue the wgmmas
#define WG_3X (IG_MODE == 3 || IG_MODE == 4)  // 3xTF32 / 3xfp16: two planes, three wgmmas
#define WG_SPLIT (WG_3X ? 2 : 1)            // operand planes: big (+ small for the 3x modes)
#define WG_ROWB 128                         // bytes of one operand row in a stage: the swizzle span
#define WG_BK (WG_ROWB / (int)sizeof(ig_t))
#define WG_VEC (16 / (int)sizeof(ig_t))     // elements of one 16-byte piece
#define WG_MI (BM == 256 ? 2 : 1)           // 64-row wgmmas per warpgroup
#define WG_GROUPS_M (BM == 64 ? 1 : 2)      // warpgroups along m
#define WG_GROUPS_N (2 / WG_GROUPS_M)       // and along n
#define WG_N (BN / WG_GROUPS_N)             // a warpgroup's wgmma N
#define WG_ACC (WG_N / 2)                   // accumulators per thread of one wgmma
#define WG_A_ROWS (BM * WG_SPLIT)
#define WG_B_ROWS (BN * WG_SPLIT)
#define WG_STAGE_BYTES ((WG_A_ROWS + WG_B_ROWS) * WG_ROWB)
#define WG_KSTEPS (WG_ROWB / 32)            // wgmma k-steps of 32 bytes per k-tile
#define WG_EPI_LD (BM + 4)                  // fp32 row of the NHWC staging tile (4: no conflicts)

static_assert(BM == 64 || BM == 128 || BM == 256, "BM is 64, 128 or 256 rows");
static_assert(WG_N == 64 || WG_N == 96 || WG_N == 128 || WG_N == 192 || WG_N == 256,
              "a warpgroup's N is 64, 96, 128, 192 or 256");
static_assert(STAGES >= 2 + PIPE, "PIPE=1 needs a slot for the k-tile still in flight");
static_assert(!WG_3X || PIPE == 0, "the 3x modes read each k-tile's sum before the next");
// 3xfp16's x scale is made per call by the layout pass, which a channels-last input skips.
static_assert(IG_MODE != 4 || !WG_NHWC, "3xfp16 takes NCHW input only");

// ---- wgmma wrappers --------------------------------------------------------------------------

// The instruction's k and operand types, and its tail: scale-d (a predicate: 0 ignores d),
// the immediate scales of a and b, and (16-bit types only) no transpose: both K-major.
#if IG_MODE == 1 || IG_MODE == 4
#define WG_TYPES "k16.f32.f16.f16"
#define WG_TAIL ", 1, 1, 0, 0;\n"
#elif IG_MODE == 2
#define WG_TYPES "k16.f32.bf16.bf16"
#define WG_TAIL ", 1, 1, 0, 0;\n"
#else
#define WG_TYPES "k8.f32.tf32.tf32"
#define WG_TAIL ", 1, 1;\n"
#endif

#define WG_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_R1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define WG_R3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_R4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define WG_R5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define WG_R6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, " \
              "%109, %110, %111"
#define WG_R7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
              "%124, %125, %126, %127"
#define WG_D16(i) "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]),      \
                  "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7]),      \
                  "+f"(d[i + 8]), "+f"(d[i + 9]), "+f"(d[i + 10]), "+f"(d[i + 11]),    \
                  "+f"(d[i + 12]), "+f"(d[i + 13]), "+f"(d[i + 14]), "+f"(d[i + 15])
// One wgmma of N columns: d (N/2 registers), then the two descriptors and scale-d.
#define WG_MMA(N, REGS, IA, IB, IS)                                                      \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                                      \
  "wgmma.mma_async.sync.aligned.m64n" #N WG_TYPES " {" REGS "}, %" #IA ", %" #IB ", p" \
  WG_TAIL "}\n"

// d (+)= A * B for one 64 x N x k-step: A and B by descriptor, d in this thread's registers.
__device__ __forceinline__ void wg_mma(float (&d)[WG_ACC], unsigned long long da,
                                       unsigned long long db, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#if WG_N == 64
  asm volatile(WG_MMA(64, WG_R0 ", " WG_R1, 32, 33, 34)
               : WG_D16(0), WG_D16(16)
               : "l"(da), "l"(db), "r"(scale_d));
#elif WG_N == 96
  asm volatile(WG_MMA(96, WG_R0 ", " WG_R1 ", " WG_R2, 48, 49, 50)
               : WG_D16(0), WG_D16(16), WG_D16(32)
               : "l"(da), "l"(db), "r"(scale_d));
#elif WG_N == 128
  asm volatile(WG_MMA(128, WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3, 64, 65, 66)
               : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48)
               : "l"(da), "l"(db), "r"(scale_d));
#elif WG_N == 192
  asm volatile(WG_MMA(192, WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3 ", " WG_R4 ", " WG_R5,
                      96, 97, 98)
               : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48), WG_D16(64), WG_D16(80)
               : "l"(da), "l"(db), "r"(scale_d));
#else
  asm volatile(WG_MMA(256, WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3 ", " WG_R4 ", " WG_R5
                      ", " WG_R6 ", " WG_R7, 128, 129, 130)
               : WG_D16(0), WG_D16(16), WG_D16(32), WG_D16(48), WG_D16(64), WG_D16(80),
                 WG_D16(96), WG_D16(112)
               : "l"(da), "l"(db), "r"(scale_d));
#endif
#else
  __trap();  // built for a target without wgmma: the host builds this file for sm_90a only
#endif
}

// WG_HOLD over a warpgroup's accumulators (between wg_fence and wg_wait).
__device__ __forceinline__ void wg_hold(float (&d)[WG_MI][WG_ACC]) {
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) WG_HOLD(d[mi][i]);
}

// ---- loader ----------------------------------------------------------------------------------

// Per-thread copy plan of a loader of LT threads (thread `tid` of them): the thread moves
// 16-byte piece kc of rows row0 + PASS * i of A and B. A's rows are a fixed stride apart; B's
// pixels are not, so each keeps its own offset (32 bits: `supports` keeps one operand plane
// under 2^32 elements, and registers matter here).
template <int LT>
struct WgLoader {
  static constexpr int PASS = LT / 8;  // rows one pass of the loader's copies covers
  static constexpr int A_ITERS = BM / PASS;
  static constexpr int B_ITERS = BN / PASS;
  static_assert(BM % PASS == 0 && BN % PASS == 0, "every thread copies whole passes");

  const ig_t* w;
  const ig_t* x;
  size_t a_first;                 // row m0 + row0, element kc * WG_VEC
  unsigned a_ok, b_ok;            // bit i: row i of this thread is inside M / N
  unsigned b_pix[B_ITERS];        // the pixel's (p, q, c) = (0, 0, 0) element
  unsigned dst;                   // row0's swizzled piece in stage 0 (add the section)
  int kc;
  long long a_plane, x_plane;     // 3xTF32: elements from a big part to its small part

  __device__ void init(const ig_t* x_, const ig_t* w_, const IgProblem& p, int m0, int n0,
                       unsigned smem, long long xp, int tid) {
    w = w_;
    x = x_;
    kc = tid % 8;
    const int row0 = tid / 8;
    a_first = (size_t)(m0 + row0) * p.Kd + kc * WG_VEC;
    a_ok = b_ok = 0;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) a_ok |= (m0 + row0 + i * PASS < p.M ? 1u : 0u) << i;
    const int pix = p.Ho * p.Wo;
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int n = n0 + row0 + i * PASS;
      b_ok |= (n < p.N ? 1u : 0u) << i;
      const int nn = n < p.N ? n : 0;
      const int b = nn / pix, r = nn - b * pix;
      const int ho = r / p.Wo, wo = r - ho * p.Wo;
      b_pix[i] = (unsigned)((((size_t)b * p.H + (size_t)ho * p.S) * p.W + (size_t)wo * p.S) *
                            p.Cp);
    }
    // row0 + PASS * i keeps row0 % 8 (PASS is a multiple of 8): one swizzle a thread.
    dst = smem + row0 * WG_ROWB + ((kc ^ (row0 % 8)) << 4);
    a_plane = (long long)p.M * p.Kd;
    x_plane = xp;
  }

  // Issue the copies of the k-tile starting at k0 into ring slot `stage` (B's alone where
  // another engine brings A).
  template <bool WITH_A = true>
  __device__ void load(const IgProblem& p, int k0, int k_end, int stage) {
    const int k = k0 + kc * WG_VEC;
    const bool k_ok = k < k_end;
    const int tap = k_ok ? k / p.Cp : 0;
    const int c = k_ok ? k - tap * p.Cp : 0;
    const int pp = tap / p.K, q = tap - pp * p.K;
    const size_t b_off = ((size_t)pp * p.W + q) * p.Cp + c;
    const unsigned a_dst = dst + stage * WG_STAGE_BYTES;
    const unsigned b_dst = a_dst + WG_A_ROWS * WG_ROWB;
#pragma unroll
    for (int s = 0; s < WG_SPLIT; ++s) {
#pragma unroll
      for (int i = 0; i < (WITH_A ? A_ITERS : 0); ++i) {
        const bool ok = k_ok && (a_ok >> i & 1u);
        const ig_t* src = w + (ok ? a_first + (size_t)i * PASS * p.Kd + s * a_plane + k0 : 0);
        ig_cp16(a_dst + (s * BM + i * PASS) * WG_ROWB, src, ok);
      }
#pragma unroll
      for (int i = 0; i < B_ITERS; ++i) {
        const bool ok = k_ok && (b_ok >> i & 1u);
        const ig_t* src = x + (ok ? b_pix[i] + s * x_plane + b_off : 0);
        ig_cp16(b_dst + (s * BN + i * PASS) * WG_ROWB, src, ok);
      }
    }
  }
};

// ---- k range, k-tile and epilogues ----------------------------------------------------------

// The k-tiles this block multiplies, [first, first + count): all of them, or with WG_KSLICED
// slice blockIdx.z of gridDim.z near-equal slices (the host keeps gridDim.z <= tiles, so none
// is empty). Callers index their ring by the local count, not by the k-tile.
struct WgKRange {
  int first, count;
};

__device__ __forceinline__ WgKRange wg_k_range(int tiles) {
#if WG_KSLICED
  const int z = blockIdx.z, slices = gridDim.z;
  const int first = (int)((long long)z * tiles / slices);
  return {first, (int)((long long)(z + 1) * tiles / slices) - first};
#else
  return {0, tiles};
#endif
}

// The warpgroup's wgmmas of one k-tile in the ring slot at `slot` (its A rows from a_row,
// its B rows from b_row).
__device__ __forceinline__ void wg_tile(float (&acc)[WG_MI][WG_ACC], unsigned slot, int a_row,
                                        int b_row) {
  const unsigned a = slot + a_row * WG_ROWB;
  const unsigned b = slot + WG_A_ROWS * WG_ROWB + b_row * WG_ROWB;
  const unsigned long long db = wg_desc(b);
#pragma unroll
  for (int ks = 0; ks < WG_KSTEPS; ++ks) {
    // A k-step is 32 bytes further along the row: +2 in the descriptor's 16-byte units (the
    // hardware applies the swizzle to the address it forms).
    const unsigned long long step = 2ull * ks;
#pragma unroll
    for (int mi = 0; mi < WG_MI; ++mi) {
      const unsigned long long da = wg_desc(a + mi * 64 * WG_ROWB);
#if WG_3X
      const unsigned long long da_s = wg_desc(a + (BM + mi * 64) * WG_ROWB);
      const unsigned long long db_s = wg_desc(b + BN * WG_ROWB);
      wg_mma(acc[mi], da_s + step, db + step, ks > 0);  // the k-tile's sum starts from zero
      wg_mma(acc[mi], da + step, db_s + step, 1);
      wg_mma(acc[mi], da + step, db + step, 1);
#else
      wg_mma(acc[mi], da + step, db + step, 1);
#endif
    }
  }
}

// Bias added in fp32, then ReLU where asked (max.NaN: a NaN stays NaN, as on the CPU path).
__device__ __forceinline__ float wg_act(float v) {
#if WG_RELU
  return fmax_nan(v, 0.0f);
#else
  return v;
#endif
}

// What the GEMM's epilogue stores for sum v of a channel with bias bm: v + bm through the
// activation, or with WG_KSLICED the partial sum itself (bm is then never read).
#if WG_KSLICED
#define WG_OUT(v, bm) (v)
#else
#define WG_OUT(v, bm) wg_act((v) + (bm))
#endif

__device__ __forceinline__ void wg_zero(float (&a)[WG_MI][WG_ACC]) {
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) a[mi][i] = 0.0f;
}

// A consumer thread's accumulators, zeroed: acc, and for the 3x modes a separate fp32 total of
// the k-tiles' sums (in the other modes total is acc itself).
#if WG_3X
#define WG_ACCUMULATORS                                \
  float acc[WG_MI][WG_ACC], total[WG_MI][WG_ACC];      \
  wg_zero(acc);                                        \
  wg_zero(total)
#else
#define WG_ACCUMULATORS             \
  float acc[WG_MI][WG_ACC];         \
  wg_zero(acc);                     \
  float(&total)[WG_MI][WG_ACC] = acc
#endif

// One k-tile of a warpgroup: its wgmmas on ring slot `slot` issued, then a wait until at most
// PIPE k-tiles are still in flight. The 3x modes add the k-tile's sum into the fp32 total
// (which is acc itself in the other modes): the tensor cores truncate as they accumulate, so a
// sum of thousands of terms kept in acc would lose fp32's accuracy.
__device__ __forceinline__ void wg_step(float (&acc)[WG_MI][WG_ACC],
                                        float (&total)[WG_MI][WG_ACC], unsigned slot,
                                        int a_row, int b_row) {
  wg_hold(acc);
  wg_fence();
  wg_tile(acc, slot, a_row, b_row);
  wg_commit();
  wg_wait<PIPE>();
  wg_hold(acc);
#if WG_3X
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) total[mi][i] += acc[mi][i];
#endif
}

// y[b, m, pix] = WG_OUT(total, bias) for this thread's accumulators: register r of a
// warpgroup's 64 x WG_N tile is row 16*warp + lane/4 + 8*((r/2)%2), column 8*(r/4) +
// 2*(lane%4) + r%2. Registers r, r+1 (r even) are columns n, n+1 of one row with n even: with
// an even pixel count per image (and y 8-byte aligned) both land in one image, 8-byte
// aligned, and go out as one 8-byte store.
__device__ __forceinline__ void wg_store(const float (&total)[WG_ACC], float* __restrict__ y,
                                         const float* __restrict__ bias, const IgProblem& p,
                                         int m_base, int n_base) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int pix = p.Ho * p.Wo;
  const bool pairs = pix % 2 == 0 && reinterpret_cast<size_t>(y) % 8 == 0;
#pragma unroll
  for (int r = 0; r < WG_ACC; r += 2) {
    const int m = m_base + 16 * warp + lane / 4 + 8 * ((r / 2) % 2);
    const int n = n_base + 8 * (r / 4) + 2 * (lane % 4);
    if (m >= p.M) continue;
    [[maybe_unused]] const float bm = WG_KSLICED ? 0.0f : bias[m];
    if (pairs && n < p.N) {
      const int b = n / pix;
      // (nvcc splits a float2 store through a cast pointer into two here)
      asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(
                       y + ((size_t)b * p.M + m) * pix + (n - b * pix)),
                   "f"(WG_OUT(total[r], bm)), "f"(WG_OUT(total[r + 1], bm))
                   : "memory");
      continue;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (pairs || n + e >= p.N) continue;
      const int b = (n + e) / pix;
      y[((size_t)b * p.M + m) * pix + (n + e - b * pix)] = WG_OUT(total[r + e], bm);
    }
  }
}

__device__ __forceinline__ void wg_bar_consumers() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(WG_CONSUMERS) : "memory");
}

// Two fp32 values as one 32-bit pair of the 16-bit operand type, the first in the low half.
__device__ __forceinline__ unsigned wg_pack2(float lo, float hi) {
#if IG_MODE == 2
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#else
  __half2 h = __floats2half2_rn(lo, hi);
#endif
  return *reinterpret_cast<unsigned*>(&h);
}

// OV channels of one output pixel at y (16 bytes of the operand type), as the next layer's
// loader reads them: fp16/bf16, tf32-rounded fp32, or 3xTF32's big part here and its small
// part `plane` elements further.
template <int OV>
__device__ __forceinline__ void wg_put_operand(ig_t* __restrict__ y, size_t plane,
                                               const float (&o)[OV]) {
#if IG_MODE == 1 || IG_MODE == 2
  *reinterpret_cast<uint4*>(y) = make_uint4(wg_pack2(o[0], o[1]), wg_pack2(o[2], o[3]),
                                            wg_pack2(o[4], o[5]), wg_pack2(o[6], o[7]));
#else
  float4 big;
  big.x = tf32_round(o[0]);
  big.y = tf32_round(o[1]);
  big.z = tf32_round(o[2]);
  big.w = tf32_round(o[3]);
  *reinterpret_cast<float4*>(y) = big;
#if IG_MODE == 3
  const float4 small = make_float4(tf32_round(o[0] - big.x), tf32_round(o[1] - big.y),
                                   tf32_round(o[2] - big.z), tf32_round(o[3] - big.w));
  *reinterpret_cast<float4*>(y + plane) = small;
#endif
#endif
}

#if WG_NHWC
// The block's BM x BN tile, channels-last, in the operand type (with WG_KSLICED:
// fp32 partial sums, one plane). The accumulators of one register sit 8 channels and 2 pixels
// apart, so they go through shared memory first (fp32, [n][m]) and leave as 16-byte runs of
// channels of one pixel.
__device__ void wg_store_nhwc(const float (&total)[WG_MI][WG_ACC], wg_out_t* __restrict__ y,
                              const float* __restrict__ bias, const IgProblem& p, int m0,
                              int n0, int a_row, int b_row, float* stage, int ctid) {
  constexpr int OV = 16 / (int)sizeof(wg_out_t);  // channels of one 16-byte store
  constexpr int PER_ROW = BM / OV;
  const int warp = (ctid / 32) % 4, lane = ctid % 32;
  wg_bar_consumers();  // every warpgroup is done reading the ring the tile goes into
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int r = 0; r < WG_ACC; ++r) {
      const int m = a_row + 64 * mi + 16 * warp + lane / 4 + 8 * ((r / 2) % 2);
      const int n = b_row + 8 * (r / 4) + 2 * (lane % 4) + r % 2;
      stage[n * WG_EPI_LD + m] = total[mi][r];
    }
  wg_bar_consumers();
  const int mp = (p.M + 7) & ~7;  // channels of an output pixel: M padded like the input's Cp
  for (int v = ctid; v < BN * PER_ROW; v += WG_CONSUMERS) {
    const int nl = v / PER_ROW, ml = (v - nl * PER_ROW) * OV;
    const int n = n0 + nl, m = m0 + ml;
    if (n >= p.N || m >= mp) continue;
    float o[OV];
#pragma unroll
    for (int j = 0; j < OV; ++j)
      o[j] = m + j < p.M ? WG_OUT(stage[nl * WG_EPI_LD + ml + j], bias[m + j]) : 0.0f;
    const size_t at = (size_t)n * mp + m;
#if WG_KSLICED
    *reinterpret_cast<float4*>(y + at) = make_float4(o[0], o[1], o[2], o[3]);
#else
    wg_put_operand(y + at, (size_t)p.N * mp, o);
#endif
  }
}
#endif

// The block's output from the consumer warpgroups' registers (ctid: the thread among the
// WG_CONSUMERS; every k-tile has been consumed, so the ring at `stage` is free). WG_KSLICED:
// into slab blockIdx.z of the partial sums, each slab one output's elements in its order.
// 3xfp16: bias holds M + 2 floats, the biases then the exponents e of the weights' scale 2^e
// (made at prepare) and of x's (written by this call's layout pass); ldexpf undoes both at
// once, since 2^-e of either alone may leave fp32's range where the output does not.
__device__ __forceinline__ void wg_epilogue(float (&total)[WG_MI][WG_ACC],
                                            wg_out_t* __restrict__ y,
                                            const float* __restrict__ bias, const IgProblem& p,
                                            int m0, int n0, int a_row, int b_row, float* stage,
                                            int ctid) {
#if IG_MODE == 4
  const int unscale = -(int)(bias[p.M] + bias[p.M + 1]);
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) total[mi][i] = ldexpf(total[mi][i], unscale);
#endif
#if WG_KSLICED
  y += (size_t)blockIdx.z * p.N * (WG_NHWC ? (p.M + 7) & ~7 : p.M);
#endif
#if WG_NHWC
  wg_store_nhwc(total, y, bias, p, m0, n0, a_row, b_row, stage, ctid);
#else
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
    wg_store(total[mi], y, bias, p, m0 + a_row + 64 * mi, n0 + b_row);
#endif
}

#include "wgmma_splitk.cuh"
