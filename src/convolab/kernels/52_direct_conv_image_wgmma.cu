// Kernel 52: a wide convolution on small images (VGG's conv5_x: 512 -> 512 channels, 14 x 14
// outputs) as a direct convolution over whole images in shared memory, on the warpgroup MMA
// (sm_90a), straight from NCHW fp32.
//
// What it changes against rungs 39-40 there: an implicit GEMM over a channels-last operand that
// a layout pass writes first, whose B tiles are gathered per filter tap, so each 64-channel slice
// of an image is read from L2 nine times. Here a block takes DI_TM output channels of one image:
// - for each 64-channel chunk the image's pixels are loaded once from NCHW fp32 (a channel's
//   plane is one contiguous run) and converted into a channels-last buffer in shared memory
//   whose rows are DI_PW pixels wide (DI_PW >= W, a multiple of 8; pixel (y, x) at row
//   y DI_PW + x, 128 bytes a pixel, wgmma's K-major 128-byte swizzle);
// - the block computes output pixels n = oh DI_PW + ow for ow < DI_PW (those with ow >= Wo are
//   computed and dropped), so tap (p, q) reads input row n + p DI_PW + q for every n: one
//   descriptor start shift per tap, as in kernel 51, over the whole image;
// - two consumer warpgroups issue m64nNk16: with DI_TM = 128 each takes 64 of the block's output
//   channels and all its pixels (N = Ho DI_PW rounded up to 16: 224 on conv5_x), with DI_TM = 64
//   the same 64 channels and half the pixels each (N = 112), for twice the blocks at small
//   batch; one producer thread streams the weights, packed per (DI_TM-row tile, chunk, tap) as
//   runs of DI_TM x 128 bytes, into a ring by the bulk copy engine (full / empty mbarriers;
//   with 128-row tiles setmaxnreg moves the producers' registers to the consumers);
// - the other producer threads (96, or 224 with 64-row tiles) stage the next chunk (64 channels
//   of an NCHW image are one contiguous run: one bulk copy of 64 KB for 16 x 16 pixels) and
//   convert it into the second pixel buffer while the consumers compute on the first (full /
//   empty mbarriers per buffer), so the consumers only issue wgmmas.
// With DI_SPLIT > 1 slices of the chunks, the blocks of a (tile, image) are one thread-block
// cluster: each parks its fp32 sums in its own shared memory and the cluster adds them through
// distributed shared memory in rank order, plus the bias (one launch; partial sums in global
// memory added by a second kernel ran 6-13 us slower at B = 1-8 on conv5_x: docs/vgg.md,
// "Kernel 52's slices summed in a cluster").
// In TF32 (DW_MODE 2) a chunk is 32 channels: a pixel's 128-byte row holds 32 tf32 values, a
// weight row likewise, and a k-step of 32 bytes is wgmma's k8 instead of k16; nothing else
// changes (twice the chunks, each staged in half the bytes).
//
// Launch: grid (M / DI_TM, B, DI_SPLIT), clusters of (1, 1, DI_SPLIT), DI_THREADS threads (two
// consumer warpgroups, then one producer warpgroup with 128-row tiles, two with 64-row ones).
// Dynamic shared memory: DI_STAGES weight stages of DI_TM x 128 bytes, two pixel buffers of
// DI_BPIX x 128 bytes, the staged chunk (DI_CC H W floats), 1 KB to align them, at least the
// tile of sums with DI_SPLIT > 1 (gpu/direct_image.py `smem_bytes`).

#include "cluster.cuh"
#include "common.cuh"
#include "mbarrier.cuh"
#include "wgmma_core.cuh"

#ifndef DW_MODE
#define DW_MODE 0  // operands: 0 fp16, 1 bf16, 2 tf32 (fp32 rounded)
#endif
#ifndef DI_K
#define DI_K 3  // filter size
#endif
#ifndef DI_PW
#define DI_PW 16  // pixels a buffer row: W rounded up to 8
#endif
#ifndef DI_HO
#define DI_HO 14  // output rows
#endif
#ifndef DI_HW
#define DI_HW 256  // input pixels H W
#endif
#ifndef DI_STAGES
#define DI_STAGES 4  // weight stages (taps) in the ring
#endif
#ifndef DI_SPLIT
#define DI_SPLIT 1  // > 1: the slices of a (tile, image) are one cluster that sums them itself
#endif
#ifndef DI_TM
#define DI_TM 128  // output channels a block: 128 (a warpgroup 64 of them, all pixels) or 64 (all
                   // 64, a warpgroup half the pixels: twice the blocks for small batches)
#endif

#define DI_NPIX (16 * ((DI_HO * DI_PW + 15) / 16))  // output pixels the block computes
#define DW_N (DI_TM == 128 ? DI_NPIX : 16 * ((DI_NPIX + 31) / 32))  // a warpgroup's: the N
#define DI_NCOMP (DI_TM == 128 ? DW_N : 2 * DW_N)  // pixels both warpgroups compute
#define DI_TAPS (DI_K * DI_K)
#define DI_ROWB 128                              // a pixel's chunk of channels, a weight row's
#define DI_CC (DW_MODE == 2 ? 32 : 64)           // input channels a chunk: 128 bytes of them
#define DI_PIECE (DI_CC / 8)                     // channels a 16-byte piece
#define DI_PPT (16 / DI_PIECE)                   // pixels a converting thread takes at once
#define DI_STAGE_BYTES (DI_TM * DI_ROWB)         // one tap of a tile's weights
#define DI_BPIX (8 * ((DI_NCOMP + (DI_K - 1) * (DI_PW + 1) + 7) / 8))  // rows a tap reads
#define DI_BUF_BYTES (DI_BPIX * DI_ROWB)
#define DI_CONSUMERS 256
// Producers: one warpgroup beside 128-row tiles, whose accumulators need the registers that
// setmaxnreg moves to the consumers; two beside 64-row tiles (half the accumulators, 128
// registers a thread for all 512), so that 224 threads convert instead of 96.
#define DI_PRODUCERS (DI_TM == 128 ? 128 : 256)
#define DI_THREADS (DI_CONSUMERS + DI_PRODUCERS)
#define DI_WORKERS (DI_PRODUCERS - 32)           // producer threads that stage the pixels (one
                                                 // thread of the first warp copies weights)

static_assert(DI_PW % 8 == 0, "buffer rows of whole 8-pixel groups");
static_assert(DW_N <= 256, "one wgmma covers a warpgroup's output pixels");
static_assert(DI_TM == 64 || DI_TM == 128, "tiles of 64 or 128 output channels");
static_assert(DI_STAGES >= 2, "a stage in flight while one is read");
static_assert(DI_HW % 4 == 0, "channel planes of whole 16-byte pieces: one bulk copy a chunk");
static_assert(DI_SPLIT >= 1 && DI_SPLIT <= 8, "a portable cluster holds at most 8 blocks");
#define DI_SUM_ROW (DI_NCOMP + 4)  // the tile of sums [channel][pixel], rows 16-byte aligned

#include "direct_wgmma.cuh"  // dw_mma: the wgmma, its PTX
#include "warp_roles.cuh"    // bar_sync, setmaxnreg

// The staged chunk (channel planes of DI_HW fp32, `valid` of them) into a pixel buffer by the
// DI_WORKERS threads: input pixel (y, x) at row y DI_PW + x, channels DI_PIECE j.. DI_PIECE j +
// DI_PIECE - 1 in 16-byte piece j ^ (row mod 8), zero past the valid channels. A thread takes
// DI_PPT pixels, so that a channel's values for them are one 8- or 16-byte load (planes of
// DI_HW, a multiple of 4 floats), 16 values in registers in either mode (beside 128-row tiles
// the producers run in 56 registers).
__device__ __forceinline__ void di_store_piece(unsigned char* buf, int row, int j,
                                               const float (&f)[DI_PIECE]) {
  uint4* at = reinterpret_cast<uint4*>(buf + row * DI_ROWB + ((j ^ (row & 7)) << 4));
#if DW_MODE == 2
  *at = make_uint4(__float_as_uint(tf32_round(f[0])), __float_as_uint(tf32_round(f[1])),
                   __float_as_uint(tf32_round(f[2])), __float_as_uint(tf32_round(f[3])));
#else
  *at = make_uint4(pack_16bit<DW_MODE>(f[0], f[1]), pack_16bit<DW_MODE>(f[2], f[3]),
                   pack_16bit<DW_MODE>(f[4], f[5]), pack_16bit<DW_MODE>(f[6], f[7]));
#endif
}

__device__ __forceinline__ void di_convert(unsigned char* buf, const float* staged, int valid,
                                           int W, int worker) {
  for (int t = worker; t < DI_HW / DI_PPT * 8; t += DI_WORKERS) {
    const int j = t / (DI_HW / DI_PPT), px0 = DI_PPT * (t % (DI_HW / DI_PPT));
    float v[DI_PIECE][DI_PPT];
#pragma unroll
    for (int e = 0; e < DI_PIECE; ++e) {
      const float* src = staged + (DI_PIECE * j + e) * DI_HW + px0;
      const bool in = DI_PIECE * j + e < valid;
#if DI_PPT == 4
      const float4 q = in ? *reinterpret_cast<const float4*>(src) : make_float4(0.f, 0.f, 0.f, 0.f);
      v[e][0] = q.x, v[e][1] = q.y, v[e][2] = q.z, v[e][3] = q.w;
#else
      const float2 q = in ? *reinterpret_cast<const float2*>(src) : make_float2(0.f, 0.f);
      v[e][0] = q.x, v[e][1] = q.y;
#endif
    }
#pragma unroll
    for (int p = 0; p < DI_PPT; ++p) {
      const int px = px0 + p;
      float f[DI_PIECE];
#pragma unroll
      for (int e = 0; e < DI_PIECE; ++e) f[e] = v[e][p];
      di_store_piece(buf, (px / W) * DI_PW + px % W, j, f);
    }
  }
}

#include "direct_image_sum.cuh"  // park_sums, cluster_sum: the slices' sum (DI_SPLIT > 1)

extern "C" __global__ void __launch_bounds__(DI_THREADS, 1)
#if DI_SPLIT > 1
    __cluster_dims__(1, 1, DI_SPLIT)
#endif
    direct_conv_image(const float* __restrict__ x, const unsigned char* __restrict__ wp,
                      const float* __restrict__ bias, float* __restrict__ y, int C, int W,
                      int M, int chunks_total, int slice_chunks) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // full[s] / empty[s]: weight stages; b_full[k] / b_empty[k]: pixel buffers; staged: the copy
  __shared__ __align__(8) unsigned long long bars[2 * DI_STAGES + 5];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  unsigned char* smem = smem_raw + ((1024 - (raw & 1023)) & 1023);  // the swizzle's period
  const unsigned ring = raw + static_cast<unsigned>(smem - smem_raw);
  const unsigned bufs = ring + DI_STAGES * DI_STAGE_BYTES;
  unsigned char* bufs_p = smem + DI_STAGES * DI_STAGE_BYTES;
  float* staged = reinterpret_cast<float*>(bufs_p + 2 * DI_BUF_BYTES);
  const unsigned full = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  const unsigned empty = full + 8 * DI_STAGES, b_full = empty + 8 * DI_STAGES;
  const unsigned b_empty = b_full + 16, staged_bar = b_empty + 16;
  const int tile = blockIdx.x, b = blockIdx.y;
  const int c_begin = blockIdx.z * slice_chunks;
  const int chunks = min(chunks_total - c_begin, slice_chunks), steps = chunks * DI_TAPS;

  if (threadIdx.x == 0) {
    for (int s = 0; s < DI_STAGES; ++s) {
      mbar_init(full + 8 * s, 1);   // the copier's expect_tx
      mbar_init(empty + 8 * s, 2);  // one arrival a consumer warpgroup
    }
    for (int k = 0; k < 2; ++k) {
      mbar_init(b_full + 8 * k, DI_WORKERS);  // every worker, after its part of the buffer
      mbar_init(b_empty + 8 * k, 2);
    }
    mbar_init(staged_bar, 1);
    fence_barrier_init();
  }
  __syncthreads();  // the barriers exist before anything arrives on them

  if (threadIdx.x >= DI_CONSUMERS) {  // the producer warpgroup(s)
#if DI_TM == 128
    set_max_regs_dec<56>();
#endif
    const int ptid = threadIdx.x - DI_CONSUMERS;
    if (ptid == 0) {  // the weights, one tap a stage
      const unsigned char* src =
          wp + ((size_t)tile * chunks_total + c_begin) * DI_TAPS * DI_STAGE_BYTES;
      for (int i = 0; i < steps; ++i) {
        const int s = i % DI_STAGES;
        if (i >= DI_STAGES) mbar_wait(empty + 8 * s, ((i / DI_STAGES) - 1) & 1);
        mbar_expect_tx(full + 8 * s, DI_STAGE_BYTES);
        bulk_copy(ring + s * DI_STAGE_BYTES, src + (size_t)i * DI_STAGE_BYTES, DI_STAGE_BYTES,
                  full + 8 * s);
      }
    } else if (ptid >= 32) {  // the pixels: stage a chunk, convert it into a free buffer
      const int worker = ptid - 32;
      const unsigned staged_at = bufs + 2 * DI_BUF_BYTES;
      for (int c = 0; c < chunks; ++c) {
        const int c0 = DI_CC * (c_begin + c), valid = min(DI_CC, C - c0);
        if (worker == 0) {  // after every worker's reads of the last chunk (bar_sync below)
          const unsigned bytes = valid * DI_HW * 4;
          wg_proxy_fence();  // those generic reads before the copy engine's writes
          mbar_expect_tx(staged_bar, bytes);
          bulk_copy(staged_at, x + ((size_t)b * C + c0) * DI_HW, bytes, staged_bar);
        }
        mbar_wait(staged_bar, c & 1);
        if (c >= 2) mbar_wait(b_empty + 8 * (c & 1), ((c / 2) - 1) & 1);
        di_convert(bufs_p + (c & 1) * DI_BUF_BYTES, staged, valid, W, worker);
        wg_proxy_fence();  // the wgmmas (async proxy) read what these stores wrote
        mbar_arrive(b_full + 8 * (c & 1));
        bar_sync(2, DI_WORKERS);  // every worker done with the staged chunk: the next copy
      }
    }
#if DI_SPLIT > 1
    cluster_sum(smem, bias, y, M, W, tile, b);  // the cluster's barriers span every thread
#endif
    return;
  }

#if DI_TM == 128
  set_max_regs_inc<224>();  // 128 x 56 + 256 x 224 <= 64K: the accumulators
#endif
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  // this warpgroup's weight rows in a stage and first output pixel
  const int a_row = DI_TM == 128 ? 64 * wg : 0, n_base = DI_TM == 128 ? 0 : wg * DW_N;
  float acc[DW_N / 2];
  for (int c = 0; c < chunks; ++c) {
    const unsigned buf = bufs + (c & 1) * DI_BUF_BYTES;
    mbar_wait(b_full + 8 * (c & 1), (c / 2) & 1);
#pragma unroll
    for (int t = 0; t < DI_TAPS; ++t) {
      const int i = c * DI_TAPS + t, s = i % DI_STAGES;
      mbar_wait(full + 8 * s, (i / DI_STAGES) & 1);
      const unsigned long long da = wg_desc(ring + s * DI_STAGE_BYTES + a_row * DI_ROWB);
      const unsigned long long db =
          wg_desc(buf + (n_base + (t / DI_K) * DI_PW + t % DI_K) * DI_ROWB);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // k-steps of 32 bytes: 16 fp16 / bf16 or 8 tf32 values
        dw_mma(acc, wg_desc_add(da, 32 * kk), wg_desc_add(db, 32 * kk), i + kk);
      wg_commit();
      wg_wait<1>();  // step i - 1's wgmmas retired: its stage (and at t = 0 its buffer) go back
      if ((threadIdx.x & 127) == 0 && i > 0) {
        mbar_arrive(empty + 8 * ((i - 1) % DI_STAGES));
        if (t == 0) mbar_arrive(b_empty + 8 * ((c - 1) & 1));
      }
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int i = 0; i < DW_N / 2; ++i) WG_HOLD(acc[i]);

#if DI_SPLIT > 1
  park_sums(smem, acc, a_row, n_base, warp, lane);
  cluster_sum(smem, bias, y, M, W, tile, b);
  return;
#endif
  // Output pixel n = oh DI_PW + ow of channel m; ow >= Wo and oh >= Ho are dropped.
  const int Wo = W - DI_K + 1, pix = DI_HO * Wo, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = DI_TM * tile + a_row + 16 * warp + g + 8 * h;
    if (m >= M) continue;
    const float bm = bias[m];
    float* row = y + ((size_t)b * M + m) * pix;
#pragma unroll
    for (int j = 0; j < DW_N / 8; ++j) {
      const int n = n_base + 8 * j + 2 * t4, oh = n / DI_PW, ow = n % DI_PW;
      if (oh >= DI_HO) continue;
      const float v0 = acc[4 * j + 2 * h] + bm, v1 = acc[4 * j + 2 * h + 1] + bm;
      if (ow + 1 < Wo && !(Wo & 1)) {
        *reinterpret_cast<float2*>(row + oh * Wo + ow) = make_float2(v0, v1);
      } else {
        if (ow < Wo) row[oh * Wo + ow] = v0;
        if (ow + 1 < Wo) row[oh * Wo + ow + 1] = v1;
      }
    }
  }
}
