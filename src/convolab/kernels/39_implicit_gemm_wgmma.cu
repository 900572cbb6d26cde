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
// barrier per k-tile the two warpgroups still stall together; a producer warp with mbarriers
// (and TMA) is the next step.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common.cuh"
#include "igemm_problem.cuh"

#ifndef IG_MODE
#define IG_MODE 1
#endif
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

#if IG_MODE == 1
typedef __half ig_t;
#elif IG_MODE == 2
typedef __nv_bfloat16 ig_t;
#else
typedef float ig_t;
#endif

#define WG_THREADS 256
#define WG_SPLIT (IG_MODE == 3 ? 2 : 1)   // operand planes: big (+ small for 3xTF32)
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
#define WG_PASS (WG_THREADS / 8)            // rows one pass of the block's copies covers
#define WG_A_ITERS (BM / WG_PASS)
#define WG_B_ITERS (BN / WG_PASS)
#define WG_KSTEPS (WG_ROWB / 32)            // wgmma k-steps of 32 bytes per k-tile

static_assert(BM == 64 || BM == 128 || BM == 256, "BM is 64, 128 or 256 rows");
static_assert(WG_N == 64 || WG_N == 96 || WG_N == 128 || WG_N == 192 || WG_N == 256,
              "a warpgroup's N is 64, 96, 128, 192 or 256");
static_assert(BM % WG_PASS == 0 && BN % WG_PASS == 0, "every thread copies whole passes");
static_assert(STAGES >= 2 + PIPE, "PIPE=1 needs a slot for the k-tile still in flight");
static_assert(IG_MODE != 3 || PIPE == 0, "3xTF32 reads each k-tile's sum before the next");

// ---- wgmma wrappers --------------------------------------------------------------------------

// The instruction's k and operand types, and its tail: scale-d (a predicate: 0 ignores d),
// the immediate scales of a and b, and (16-bit types only) no transpose: both K-major.
#if IG_MODE == 1
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

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of the accumulators across the asynchronous
// wgmmas that own them between wg_fence and wg_wait.
__device__ __forceinline__ void wg_hold(float (&d)[WG_MI][WG_ACC]) {
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) asm volatile("" : "+f"(d[mi][i])::"memory");
}

// cp.async (generic proxy) wrote the stage; the wgmmas read it through the async proxy.
__device__ __forceinline__ void wg_proxy_fence() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Descriptor of a K-major operand in the 128-byte swizzle: start address, leading offset
// (unused by this layout, 1 by convention), stride offset 1024 bytes between 8-row groups,
// layout 1 = 128-byte swizzle. Addresses and offsets are stored in 16-byte units.
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// ---- loader ----------------------------------------------------------------------------------

// Per-thread copy plan: the thread moves 16-byte piece kc of rows row0 + WG_PASS * i of A and
// B. A's rows are a fixed stride apart; B's pixels are not, so each keeps its own offset (32
// bits: `supports` keeps one operand plane under 2^32 elements, and registers matter here).
struct WgLoader {
  const ig_t* w;
  const ig_t* x;
  size_t a_first;                 // row m0 + row0, element kc * WG_VEC
  unsigned a_ok, b_ok;            // bit i: row i of this thread is inside M / N
  unsigned b_pix[WG_B_ITERS];     // the pixel's (p, q, c) = (0, 0, 0) element
  unsigned dst;                   // row0's swizzled piece in stage 0 (add the section)
  int kc;
  long long a_plane, x_plane;     // 3xTF32: elements from a big part to its small part

  __device__ void init(const ig_t* x_, const ig_t* w_, const IgProblem& p, int m0, int n0,
                       unsigned smem, long long xp) {
    const int tid = threadIdx.x;
    w = w_;
    x = x_;
    kc = tid % 8;
    const int row0 = tid / 8;
    a_first = (size_t)(m0 + row0) * p.Kd + kc * WG_VEC;
    a_ok = b_ok = 0;
#pragma unroll
    for (int i = 0; i < WG_A_ITERS; ++i) a_ok |= (m0 + row0 + i * WG_PASS < p.M ? 1u : 0u) << i;
    const int pix = p.Ho * p.Wo;
#pragma unroll
    for (int i = 0; i < WG_B_ITERS; ++i) {
      const int n = n0 + row0 + i * WG_PASS;
      b_ok |= (n < p.N ? 1u : 0u) << i;
      const int nn = n < p.N ? n : 0;
      const int b = nn / pix, r = nn - b * pix;
      const int ho = r / p.Wo, wo = r - ho * p.Wo;
      b_pix[i] = (unsigned)((((size_t)b * p.H + (size_t)ho * p.S) * p.W + (size_t)wo * p.S) *
                            p.Cp);
    }
    // row0 + WG_PASS * i keeps row0 % 8 (WG_PASS is a multiple of 8): one swizzle a thread.
    dst = smem + row0 * WG_ROWB + ((kc ^ (row0 % 8)) << 4);
    a_plane = (long long)p.M * p.Kd;
    x_plane = xp;
  }

  // Issue the copies of the k-tile starting at k0 into ring slot `stage`.
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
      for (int i = 0; i < WG_A_ITERS; ++i) {
        const bool ok = k_ok && (a_ok >> i & 1u);
        const ig_t* src = w + (ok ? a_first + (size_t)i * WG_PASS * p.Kd + s * a_plane + k0 : 0);
        ig_cp16(a_dst + (s * BM + i * WG_PASS) * WG_ROWB, src, ok);
      }
#pragma unroll
      for (int i = 0; i < WG_B_ITERS; ++i) {
        const bool ok = k_ok && (b_ok >> i & 1u);
        const ig_t* src = x + (ok ? b_pix[i] + s * x_plane + b_off : 0);
        ig_cp16(b_dst + (s * BN + i * WG_PASS) * WG_ROWB, src, ok);
      }
    }
  }
};

// ---- main loop -------------------------------------------------------------------------------

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
#if IG_MODE == 3
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

// y[b, m, pix] = total + bias for this thread's accumulators: register r of a warpgroup's
// 64 x WG_N tile is row 16*warp + lane/4 + 8*((r/2)%2), column 8*(r/4) + 2*(lane%4) + r%2.
// Registers r, r+1 (r even) are columns n, n+1 of one row with n even: with an even pixel
// count per image (and y 8-byte aligned) both land in one image, 8-byte aligned, and go out
// as one 8-byte store.
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
    const float bm = bias[m];
    if (pairs && n < p.N) {
      const int b = n / pix;
      // (nvcc splits a float2 store through a cast pointer into two here)
      asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(
                       y + ((size_t)b * p.M + m) * pix + (n - b * pix)),
                   "f"(total[r] + bm), "f"(total[r + 1] + bm)
                   : "memory");
      continue;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (pairs || n + e >= p.N) continue;
      const int b = (n + e) / pix;
      y[((size_t)b * p.M + m) * pix + (n + e - b * pix)] = total[r + e] + bm;
    }
  }
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
igemm_wgmma(const ig_t* __restrict__ x, const ig_t* __restrict__ w,
            const float* __restrict__ bias, float* __restrict__ y, IG_PROBLEM_ARGS,
            long long x_plane) {
  const IgProblem p = IG_PROBLEM;
  extern __shared__ unsigned char wg_smem_raw[];
  // The swizzle repeats every 1024 bytes and is applied to absolute addresses: align the ring.
  const unsigned smem =
      (static_cast<unsigned>(__cvta_generic_to_shared(wg_smem_raw)) + 1023u) & ~1023u;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  const int group = threadIdx.x / 128;
  const int a_row = (group / WG_GROUPS_N) * 64 * WG_MI, b_row = (group % WG_GROUPS_N) * WG_N;

  WgLoader ld;
  ld.init(x, w, p, m0, n0, smem, x_plane);
  float acc[WG_MI][WG_ACC];
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) acc[mi][i] = 0.0f;
#if IG_MODE == 3
  float total[WG_MI][WG_ACC];
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) total[mi][i] = 0.0f;
#else
  float (&total)[WG_MI][WG_ACC] = acc;
#endif

  const int tiles = (p.Kd + WG_BK - 1) / WG_BK;
  constexpr int AHEAD = STAGES - 1 - PIPE;  // k-tiles in copy while one is multiplied
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < tiles) ld.load(p, s * WG_BK, p.Kd, s);
    cp_async_commit();
  }
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<AHEAD - 1>();
    wg_proxy_fence();
    __syncthreads();  // k-tile t landed; every warpgroup is done with the slot refilled next
    const int next = t + AHEAD;
    if (next < tiles) ld.load(p, next * WG_BK, p.Kd, next % STAGES);
    cp_async_commit();
    wg_hold(acc);
    wg_fence();
    wg_tile(acc, smem + (t % STAGES) * WG_STAGE_BYTES, a_row, b_row);
    wg_commit();
    wg_wait<PIPE>();
    wg_hold(acc);
#if IG_MODE == 3
#pragma unroll
    for (int mi = 0; mi < WG_MI; ++mi)
#pragma unroll
      for (int i = 0; i < WG_ACC; ++i) total[mi][i] += acc[mi][i];
#endif
  }
  wg_wait<0>();
  wg_hold(acc);
  cp_async_wait_all();
#pragma unroll
  for (int mi = 0; mi < WG_MI; ++mi)
    wg_store(total[mi], y, bias, p, m0 + a_row + 64 * mi, n0 + b_row);
}

// x NCHW fp32 -> channels-last (B, H, W, Cp) operands, channels C..Cp-1 zero: fp16/bf16 cast,
// tf32 rounded, or for 3xTF32 the big part here and the small part x_plane elements further.
// One block transposes a 32-channel x 32-column tile of one input row through shared memory.
extern "C" __global__ void __launch_bounds__(256)
wg_channels_last(const float* __restrict__ x, ig_t* __restrict__ out, int C, int Cp, int H,
                 int W, long long x_plane) {
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
    if (wc >= W || c >= Cp) continue;
    const size_t at = ((size_t)bh * W + wc) * Cp + c;
    const float v = tile[threadIdx.x][i];
#if IG_MODE == 3
    const float big = tf32_round(v);
    out[at] = big;
    out[at + x_plane] = tf32_round(v - big);
#elif IG_MODE == 0
    out[at] = tf32_round(v);
#else
    out[at] = ig_t(v);
#endif
  }
}
