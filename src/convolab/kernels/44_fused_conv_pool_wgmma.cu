// Rung 44 — rung 28's fused conv + bias + ReLU + max-pool for wide layers (fcp_wgmma), with
// the MMAs on Hopper's warpgroup MMA (wgmma, sm_90a) instead of mma.sync.
//
// Rung 28 runs its MMAs at about a third of the tensor cores' rate: each m16n8k16 is one
// warp instruction of 2048 FMAs, and with 3-4 warps a scheduler the warps wait on their
// shared-memory loads between them (docs/raw.md). A wgmma of 64 rows x N x 16 is one
// instruction of a warpgroup, asynchronous: its B operand (the weights) comes from shared
// memory by descriptor, so no warp loads weight fragments at all, and the warps load the next
// A operand while the tensor cores work on this one.
//   * The A operand comes from registers, loaded exactly as rung 28 loads it (fw_rows, fw_lda):
//     warp w of a warpgroup holds rows 16w..16w+15 of the 64, which are rung 28's unit 4G + w
//     (8 pool windows x left/right output), so one wgmma m-tile is 4 of rung 28's units.
//   * The weights of chunk j and filter row p are one 16-deep B block (N = 8 NT channels, k
//     in rung 28's (q, c) run order); the host packs four such blocks side by side into the
//     128-byte swizzled rows that the descriptor reads (wgmma_core.cuh): K-major, 8-row
//     groups 1024 bytes apart, the k-step a 32-byte step along the row.
//   * Each shift s (input row s of the unit) is one commit group: the tiles i with filter row
//     p = s - i take their wgmmas from the same A registers. A ring of three A slots lets the
//     warps load shift s + 1 while s runs (a slot is rewritten only after wait_group 1 has
//     retired the group that read it).
//   * 3xfp16 (FW_PREC 3, exact): rung 28b's scaled hi + lo split; each k-chunk's sum starts
//     from zero (scale-d 0 on its first wgmma) in one of two accumulator sets, and is added
//     into an fp32 total once the next chunk's first group has been issued and the chunk
//     retired: the adds overlap the next chunk's MMAs.
// The staging, pooled store and per-image scale are rung 28's (fused_wide_stage.cuh and the
// precision's hooks); FW_WGS warpgroups a block share the staged image and the weights.

#ifndef FW_PREC
#define FW_PREC 3
#endif
#ifndef FW_WGS
#define FW_WGS 1  // warpgroups a block
#endif
#define FW_WARPS (4 * FW_WGS)
#define FW_UNITS 1  // one unit a warp: its 16 rows of the warpgroup's 64
#include "fused_wide.cuh"
#if FW_PREC == 3
#include "fused_wide_split.cuh"
#else
#include "fused_wide_single.cuh"
#endif
#include "fused_wide_stage.cuh"
#include "wgmma_core.cuh"

static_assert(FW_PREC == 0 || FW_PREC == 3, "rung 44 runs fp16 (0) and 3xfp16 (3)");
static_assert(FW_P == 2 && FW_RP == 1 && FW_UNITS == 1, "rung 44: units of one pooled row, pool 2");
static_assert(!FW_PREFETCH, "rung 44 stages from global memory");
static_assert(FW_NT >= 1 && FW_NT <= 4, "rung 44: wgmma N = 8 NT, M <= 32");

#define FW_QS (FW_J * FW_K)                // B blocks: (chunk, filter row)
#define FW_BTILES ((FW_QS + 3) / 4)        // four blocks a 128-byte row
#define FW_BTILE_BYTES (FW_NT * 8 * 128)
#define FW_BPART_BYTES (FW_BTILES * FW_BTILE_BYTES)
#define FW_B_BYTES (FW_PARTS * FW_BPART_BYTES)
#define FW_NG ((FW_NUNITS + 3) / 4)        // m-tiles (4 units) of one image
#define FW_STEPS (FW_J * FW_SHIFTS)
// Dynamic shared memory: up to 1023 bytes to align the weights, the weights, the image(s).
#define FW44_SMEM_BYTES (1024 + FW_B_BYTES + FW_IMG_BYTES)

// d (+)= a * B for one 64 x (8 NT) x 16 step: a (this thread's A quad) in registers, B by
// descriptor; scale_d 0 starts d from zero.
__device__ __forceinline__ void fw_wgmma(float (&d)[FW_NT][4], const FwA& a,
                                         unsigned long long b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#if FW_NT == 1
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(b), "r"(scale_d));
#elif FW_NT == 2
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, "
               "%6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),
                 "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(b), "r"(scale_d));
#elif FW_NT == 3
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, "
               "%6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),
                 "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),
                 "+f"(d[2][2]), "+f"(d[2][3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(b), "r"(scale_d));
#else
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, "
               "%6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, "
               "1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),
                 "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),
                 "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),
                 "+f"(d[3][3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(b), "r"(scale_d));
#endif
#else
  __trap();  // the host builds this file for sm_90a only
#endif
}

typedef float FwTile[FW_T][FW_NT][4];

// Keeps the compiler from moving reads or writes of accumulators across the asynchronous
// wgmmas that own them.
__device__ __forceinline__ void fw_hold(FwTile& d) {
#pragma unroll
  for (int i = 0; i < FW_T; ++i)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[i][n][r])::"memory");
}

// The A quads (hi; 3xfp16 also lo) of step st = (chunk j, shift s) for this lane's rows.
__device__ __forceinline__ void fw_load_step(FwA (&a)[FW_PARTS], const fw_t* img,
                                             const FwRows& rows, int st) {
  const int j = st / FW_SHIFTS, s = st % FW_SHIFTS;
  const fw_t* lo = img + rows.lo + j * FW_CH + s * FW_ROW;
  const fw_t* hi = img + rows.hi + j * FW_CH + s * FW_ROW;
#pragma unroll
  for (int part = 0; part < FW_PARTS; ++part)
    a[part] = fw_lda(lo + part * FW_IMG1, hi + part * FW_IMG1);
}

// One m-tile (4 units) of the image in img: total[i] = tile i's sums over every chunk.
__device__ __forceinline__ void fw_mtile(const fw_t* img, unsigned wsm, const FwRows& rows,
                                         FwTile& total) {
#if FW_EXACT
  FwTile acc[2];
#pragma unroll
  for (int i = 0; i < FW_T; ++i)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) total[i][n][r] = 0.f;
#else
  FwTile(&acc)[1] = reinterpret_cast<FwTile(&)[1]>(total);
#endif
  FwA a[3][FW_PARTS];  // the ring of A slots
  fw_load_step(a[0], img, rows, 0);
#pragma unroll
  for (int st = 0; st < FW_STEPS; ++st) {
    const int j = st / FW_SHIFTS, s = st % FW_SHIFTS, slot = st % 3;
    FwTile& d = acc[FW_EXACT ? j % 2 : 0];
    fw_hold(d);
    wg_fence();
#pragma unroll
    for (int i = 0; i < FW_T; ++i) {
      const int p = s - i;
      if (p < 0 || p >= FW_K) continue;
      const int q = j * FW_K + p;
      const unsigned long long b =
          wg_desc(wsm + (q / 4) * FW_BTILE_BYTES) + 2ull * (q % 4);
      const int first = p == 0 && (FW_EXACT || j == 0);  // the sum starts here
#if FW_EXACT
      const unsigned long long b_lo = b + (FW_BPART_BYTES >> 4);
      fw_wgmma(d[i], a[slot][1], b, !first);  // the small products first
      fw_wgmma(d[i], a[slot][0], b_lo, 1);
      fw_wgmma(d[i], a[slot][0], b, 1);
#else
      fw_wgmma(d[i], a[slot][0], b, !first);
#endif
    }
    wg_commit();
    if (st + 1 < FW_STEPS) fw_load_step(a[(st + 1) % 3], img, rows, st + 1);
    wg_wait<1>();  // every group but this one has retired: slot (st + 2) % 3 is free
    fw_hold(d);
#if FW_EXACT
    if (s == 0 && j > 0) {  // chunk j - 1 has retired
      FwTile& prev = acc[(j + 1) % 2];
      fw_hold(prev);
#pragma unroll
      for (int i = 0; i < FW_T; ++i)
#pragma unroll
        for (int n = 0; n < FW_NT; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) total[i][n][r] += prev[i][n][r];
    }
#endif
  }
  wg_wait<0>();
#if FW_EXACT
  FwTile& last = acc[(FW_J - 1) % 2];
  fw_hold(last);
#pragma unroll
  for (int i = 0; i < FW_T; ++i)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) total[i][n][r] += last[i][n][r];
#else
  fw_hold(total);
#endif
}

// Persistent: each block copies the packed weights once, then loops over images; warpgroup
// wg of a block takes m-tiles wg, wg + FW_WGS, ... of each image. w_unscale: 3xfp16's 2^-e of
// the weights' scale (ignored otherwise).
extern "C" __global__ void __launch_bounds__(FW_THREADS, FW_MINB)
fcp_wgmma(const fw_in_t* __restrict__ x, const uint4* __restrict__ wpack,
          const float* __restrict__ bias, float* __restrict__ y, int batch, float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  const unsigned base = (unsigned)__cvta_generic_to_shared(fw_smem);
  const unsigned pad = (1024u - (base & 1023u)) & 1023u;
  unsigned char* wsm_p = fw_smem + pad;
  for (int i = threadIdx.x; i < FW_B_BYTES / 16; i += FW_THREADS)
    reinterpret_cast<uint4*>(wsm_p)[i] = __ldg(wpack + i);
  wg_proxy_fence();  // the wgmmas read the weights through the async proxy
  fw_t* img = reinterpret_cast<fw_t*>(wsm_p + FW_B_BYTES);
  float* red = reinterpret_cast<float*>(wsm_p + FW_B_BYTES + FW_PARTS * FW_IMG1_BYTES);
  fw_zero_slack(img);
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7;
  const int g = lane >> 2, t = lane & 3;
  for (int b = blockIdx.x; b < batch; b += gridDim.x) {
    const fw_in_t* xb = x + (size_t)b * (FW_C * FW_H * FW_W);
    __syncthreads();  // every warp is done with the previous image (and the weights are in)
    const int e = fw_image_exponent<false>(xb, red);
    fw_stage_image<false>(img, xb, fw_pow2(e));
    __syncthreads();
    const float a_unscale = fw_pow2(-e);
    for (int mt = wg; mt < FW_NG; mt += FW_WGS) {
      const FwRows rows = fw_rows(4 * mt + warp, g, t);
      FwTile total;
      fw_mtile(img, base + pad, rows, total);
      fw_store(total, rows, lane, bias, y, (size_t)b, w_unscale, a_unscale);
    }
  }
}
