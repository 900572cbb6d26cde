// Kernel 49: a classifier layer at batch 16-64 on the warpgroup MMA, weights and x both brought
// by the bulk copy engine.
//
// What it changes against kernel 43: there eight warps issue mma.sync from weight pieces in
// registers, and every warp reads all of x's chunk from shared memory as B fragments (at 64
// columns, 64 KB of shared-memory reads a chunk for 32 KB of weights), after the block has
// converted that chunk from fp32 through registers behind two block barriers a chunk. Here:
// - x is converted once a call (gemv_pack_x below) into the operand type and laid out chunk
//   by chunk as wgmma reads it, so a chunk of x is one contiguous run, like a chunk of weights
//   (packed at prepare, gpu/gemv_wgmma.py); one thread brings both into a ring stage with two
//   cp.async.bulk copies counted on the stage's "full" mbarrier;
// - two warpgroups issue wgmma m64nNk16 with both operands read from shared memory through
//   descriptors (N: the batch rounded up to 8 TM_NT), each k-tile in the 128-byte swizzle;
// - a warpgroup releases a stage on its "empty" mbarrier once its wgmmas on it retired, and the
//   copying thread refills the stage when both have: no block barrier in the loop.
// The packed row order gives warp w of warpgroup g the m-tiles kernel 42 gives warp 4g + w, and
// wgmma's accumulator layout is mma.sync m16n8's, n-tile by n-tile: kernel 42's end
// (gemv_mma.cuh `finish`: y, or the split-k sum in slice order) applies unchanged.
//
// Launch: grid (row tiles, k slices), 256 threads, dynamic shared memory GW_STAGES stages plus
// 1 KB (the ring is aligned to 1 KB, as the swizzle needs). fp16 and bf16 only: TF32 weights
// in 4 bytes would stream 1.6x kernel 43's 2.5-byte ones.

#include "gemv_mma.cuh"
#include "mbarrier.cuh"
#include "wgmma_core.cuh"

#ifndef GW_KT
#define GW_KT 1  // k-tiles of 64 a chunk
#endif
#ifndef GW_STAGES
#define GW_STAGES 4
#endif

#define GW_ROWB 128                              // one operand row of a k-tile: the swizzle span
#define GW_N (8 * TM_NT)                         // wgmma N: batch columns
#define GW_TILE_A (64 * GW_ROWB)                 // one wgmma's A tile of a k-tile
#define GW_A_BYTES (GW_KT * 2 * TM_MT * GW_TILE_A)  // a block's weights a chunk
#define GW_X_BYTES (GW_KT * GW_N * GW_ROWB)      // x's chunk
#define GW_STAGE_BYTES (GW_A_BYTES + GW_X_BYTES)

static_assert(TM_WARPS == 8, "two warpgroups");
static_assert(TM_MODE <= 1, "16-bit operands only");
static_assert(GW_X_BYTES % 1024 == 0 || GW_N == 8, "stages stay 1 KB aligned");
static_assert(GW_STAGES >= 2, "a stage in flight while one is read");

#if TM_MODE == 0
#define GW_TYPES "k16.f32.f16.f16"
#else
#define GW_TYPES "k16.f32.bf16.bf16"
#endif
// scale-d is a predicate operand, here always true: the accumulators start at zero.
#define GW_MMA(N, REGS)                                                                    \
  "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"                                              \
  "wgmma.mma_async.sync.aligned.m64n" #N GW_TYPES " {" REGS "}, %" GW_DA ", %" GW_DB       \
  ", p, 1, 1, 0, 0;\n}\n"
#define GW_F(i) "+f"(d[(i) / 4][(i) % 4])
#define GW_F4(i) GW_F(i), GW_F(i + 1), GW_F(i + 2), GW_F(i + 3)

// d += A x B for one 64 x GW_N x 16 step; d[j][r] is wgmma's register 4j + r, which for warp w
// of the warpgroup is row 16w + g + 8 (r / 2), column 8j + 2t + r % 2: mma.sync's m16n8 layout.
__device__ __forceinline__ void gw_mma(float (&d)[TM_NT][4], unsigned long long da,
                                       unsigned long long db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#if GW_N == 8
#define GW_DA "4"
#define GW_DB "5"
  asm volatile(GW_MMA(8, "%0, %1, %2, %3") : GW_F4(0) : "l"(da), "l"(db));
#elif GW_N == 16
#define GW_DA "8"
#define GW_DB "9"
  asm volatile(GW_MMA(16, "%0, %1, %2, %3, %4, %5, %6, %7") : GW_F4(0), GW_F4(4)
               : "l"(da), "l"(db));
#elif GW_N == 32
#define GW_DA "16"
#define GW_DB "17"
  asm volatile(GW_MMA(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15")
               : GW_F4(0), GW_F4(4), GW_F4(8), GW_F4(12)
               : "l"(da), "l"(db));
#else
#define GW_DA "32"
#define GW_DB "33"
  asm volatile(GW_MMA(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
                          "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, "
                          "%28, %29, %30, %31")
               : GW_F4(0), GW_F4(4), GW_F4(8), GW_F4(12), GW_F4(16), GW_F4(20), GW_F4(24),
                 GW_F4(28)
               : "l"(da), "l"(db));
#endif
#else
  __trap();  // built for a target without wgmma: the host builds this file for sm_90a only
#endif
}

// Programmatic dependent launch (gpu/launch.py, early=True): gemv_wgmma may start while
// gemv_pack_x still runs, so that its weight stream begins at once; only its x copies wait.
__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void wait_for_prerequisites() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// x (B x K fp32, row-major) -> the operand, chunk by chunk: k-tile kt of chunk c is GW_N rows
// of 128 bytes, 16-byte piece j of row n at j ^ (n mod 8); rows past B and k past K zero. One
// thread a piece: consecutive threads read consecutive 32 bytes of a row of x.
extern "C" __global__ void gemv_pack_x(const float* __restrict__ x, uint4* __restrict__ xp,
                                       int B, int K, int pieces) {
  allow_dependents();
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= pieces) return;
  const int j = p % 8, n = (p / 8) % GW_N, tile = p / (8 * GW_N);
  const int k = tile * 64 + 8 * j;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (n < B && k < K) {  // K is a multiple of 8: a piece is all in or all out
    const float4* src = reinterpret_cast<const float4*>(x + (size_t)n * K + k);
    const float4 a = __ldg(src), b = __ldg(src + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
  unsigned u[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
#if TM_MODE == 0
    const __half2 h = __floats2half2_rn(v[2 * e], v[2 * e + 1]);
#else
    const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
#endif
    u[e] = *reinterpret_cast<const unsigned*>(&h);
  }
  xp[((size_t)tile * GW_N + n) * 8 + (j ^ (n % 8))] = make_uint4(u[0], u[1], u[2], u[3]);
}

extern "C" __global__ void __launch_bounds__(TM_THREADS, TM_MINB)
gemv_wgmma(const uint4* __restrict__ xp, const unsigned char* __restrict__ w_packed,
           const float* __restrict__ bias, float* __restrict__ y, float* __restrict__ partial,
           int* __restrict__ tickets, int B, int M, int chunks_total, int slice_chunks) {
  extern __shared__ unsigned char gw_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * GW_STAGES];  // full[s], then empty[s]
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(gw_raw));
  const unsigned ring = (raw + 1023) & ~1023u;  // the swizzle repeats on 1 KB boundaries
  const unsigned full = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  const unsigned empty = full + 8 * GW_STAGES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = warp >> 2;
  const int c0 = blockIdx.y * slice_chunks, chunks = min(chunks_total - c0, slice_chunks);
  const unsigned char* w_src =
      w_packed + ((size_t)blockIdx.x * chunks_total + c0) * GW_A_BYTES;
  const unsigned char* x_src = reinterpret_cast<const unsigned char*>(xp) + (size_t)c0 * GW_X_BYTES;

  if (threadIdx.x == 0) {
    for (int s = 0; s < GW_STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 2);  // one arrival a warpgroup
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers exist before anything arrives on them
  auto fetch_w = [&](int c, int s) {
    mbar_expect_tx(full + 8 * s, GW_STAGE_BYTES);
    bulk_copy(ring + s * GW_STAGE_BYTES, w_src + (size_t)c * GW_A_BYTES, GW_A_BYTES, full + 8 * s);
  };
  auto fetch_x = [&](int c, int s) {
    bulk_copy(ring + s * GW_STAGE_BYTES + GW_A_BYTES, x_src + (size_t)c * GW_X_BYTES, GW_X_BYTES,
              full + 8 * s);
  };
  if (threadIdx.x == 0) {
    for (int c = 0; c < GW_STAGES && c < chunks; ++c) fetch_w(c, c);
    wait_for_prerequisites();  // x is gemv_pack_x's output
    for (int c = 0; c < GW_STAGES && c < chunks; ++c) fetch_x(c, c);
  }

  float acc[TM_MT][TM_NT][4];
  clear(acc);
  for (int c = 0; c < chunks; ++c) {
    const int s = c % GW_STAGES;
    const unsigned parity = (c / GW_STAGES) & 1;
    mbar_wait(full + 8 * s, parity);
    const unsigned stage = ring + s * GW_STAGE_BYTES;
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < GW_KT; ++kt) {
      const unsigned long long db = wg_desc(stage + GW_A_BYTES + kt * GW_N * GW_ROWB);
#pragma unroll
      for (int mi = 0; mi < TM_MT; ++mi) {
        const unsigned long long da =
            wg_desc(stage + (kt * 2 * TM_MT + group * TM_MT + mi) * GW_TILE_A);
#pragma unroll
        for (int ks = 0; ks < GW_ROWB / 32; ++ks)  // k16 steps: 32 bytes along the row
          gw_mma(acc[mi], wg_desc_add(da, 32 * ks), wg_desc_add(db, 32 * ks));
      }
    }
    wg_commit();
    wg_wait<0>();
    // Memory-bound: a chunk's wgmmas take a fraction of its copy, so none is kept in flight
    // across chunks and the stage is free as soon as they retire.
    if (threadIdx.x % 128 == 0) mbar_arrive(empty + 8 * s);
    if (threadIdx.x == 0 && c + GW_STAGES < chunks) {
      mbar_wait(empty + 8 * s, parity);
      fetch_w(c + GW_STAGES, s);
      fetch_x(c + GW_STAGES, s);
    }
  }
#pragma unroll
  for (int mi = 0; mi < TM_MT; ++mi) wg_hold(acc[mi]);
  finish(acc, bias, y, partial, tickets, B, M, (blockIdx.x * TM_WARPS + warp) * TM_MT, lane);
}
