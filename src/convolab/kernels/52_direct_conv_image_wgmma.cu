// Kernel 52: a wide convolution on small images (VGG's conv5_x: 512 -> 512 channels, 14 x 14
// outputs) as a direct convolution over whole images in shared memory, on the warpgroup MMA
// (sm_90a), straight from NCHW fp32.
//
// What it changes against rungs 39-40 there: an implicit GEMM over a channels-last operand that
// a layout pass writes first, whose B tiles are gathered per filter tap, so each 64-channel slice
// of an image is read from L2 nine times. Here a block takes 128 output channels of one image:
// - for each 64-channel chunk the image's pixels are loaded once from NCHW fp32 (a channel's
//   plane is one contiguous run) and converted into a channels-last buffer in shared memory
//   whose rows are DI_PW pixels wide (DI_PW >= W, a multiple of 8; pixel (y, x) at row
//   y DI_PW + x, 128 bytes a pixel, wgmma's K-major 128-byte swizzle);
// - the block computes output pixels n = oh DI_PW + ow for ow < DI_PW (those with ow >= Wo are
//   computed and dropped), so tap (p, q) reads input row n + p DI_PW + q for every n: one
//   descriptor start shift per tap, as in kernel 51, over the whole image;
// - two consumer warpgroups (64 output channels each) issue m64nNk16, N = Ho DI_PW rounded up
//   to 16 (224 on conv5_x), and a producer thread streams the weights, packed per (128-row tile,
//   chunk, tap) as 16 KB runs, into a ring by the bulk copy engine (full / empty mbarriers;
//   setmaxnreg moves the producers' registers to the consumers);
// - the next chunk's pixels are loaded into registers while a chunk's wgmmas run and converted
//   into the second buffer halfway through its taps.
// With gridDim.z > 1 each block takes a slice of the chunks and writes fp32 partial sums (no
// bias) to its slab of a workspace in NCHW order; rung 39's wg_splitk_reduce adds them in slice
// order.
//
// Launch: grid (M / 128, B, slices), 384 threads (two consumer warpgroups, a producer one).
// Dynamic shared memory: DI_STAGES weight stages of 16 KB, two pixel buffers of DI_BPIX x 128
// bytes, 1 KB to align them (gpu/direct_image.py `smem_bytes`).

#include "common.cuh"
#include "mbarrier.cuh"
#include "wgmma_core.cuh"
#include <cuda_bf16.h>

#ifndef DW_MODE
#define DW_MODE 0  // operands: 0 fp16, 1 bf16
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

#define DW_N (16 * ((DI_HO * DI_PW + 15) / 16))  // the wgmma's N: output pixels computed
#define DI_TAPS (DI_K * DI_K)
#define DI_ROWB 128                              // a pixel's 64 channels, a weight row's
#define DI_STAGE_BYTES (128 * DI_ROWB)           // one tap of a 128-row tile's weights
#define DI_BPIX (8 * ((DW_N + (DI_K - 1) * (DI_PW + 1) + 7) / 8))  // rows a tap may read
#define DI_BUF_BYTES (DI_BPIX * DI_ROWB)
#define DI_CONSUMERS 256
#define DI_THREADS (DI_CONSUMERS + 128)       // and a producer warpgroup (one thread copies)
#define DI_LOADS ((DI_HW * 8 + DI_CONSUMERS - 1) / DI_CONSUMERS)  // (pixel, 8 channels) a thread

static_assert(DI_PW % 8 == 0, "buffer rows of whole 8-pixel groups");
static_assert(DW_N <= 256, "one wgmma covers the image's output pixels");
static_assert(DI_STAGES >= 2, "a stage in flight while one is read");

#include "direct_wgmma.cuh"  // dw_mma: the wgmma, its PTX
#include "warp_roles.cuh"    // bar_sync, setmaxnreg

__device__ __forceinline__ unsigned di_pack(float lo, float hi) {
#if DW_MODE == 0
  const __half2 v = __floats2half2_rn(lo, hi);
#else
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#endif
  return *reinterpret_cast<const unsigned*>(&v);
}

// Channels c0..c0+63 of image xb (NCHW fp32) into registers: this thread's (pixel, 8-channel)
// pieces, every load issued at once.
__device__ __forceinline__ void di_load(float (&v)[DI_LOADS][8], const float* __restrict__ xb,
                                        int c0, int C) {
#pragma unroll
  for (int i = 0; i < DI_LOADS; ++i) {
    const int t = threadIdx.x + i * DI_CONSUMERS, j = t / DI_HW, px = t % DI_HW;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int c = c0 + 8 * j + e;
      v[i][e] = t < DI_HW * 8 && c < C ? __ldg(xb + (size_t)c * DI_HW + px) : 0.f;
    }
  }
}

// ... into a pixel buffer: input pixel (y, x) at row y DI_PW + x, channels 8j..8j+7 in 16-byte
// piece j ^ (row mod 8).
__device__ __forceinline__ void di_store(unsigned char* buf, const float (&v)[DI_LOADS][8],
                                         int W) {
#pragma unroll
  for (int i = 0; i < DI_LOADS; ++i) {
    const int t = threadIdx.x + i * DI_CONSUMERS, j = t / DI_HW, px = t % DI_HW;
    const int row = (px / W) * DI_PW + px % W;
    if (t < DI_HW * 8)
      *reinterpret_cast<uint4*>(buf + row * DI_ROWB + ((j ^ (row & 7)) << 4)) =
          make_uint4(di_pack(v[i][0], v[i][1]), di_pack(v[i][2], v[i][3]),
                     di_pack(v[i][4], v[i][5]), di_pack(v[i][6], v[i][7]));
  }
}

extern "C" __global__ void __launch_bounds__(DI_THREADS, 1)
    direct_conv_image(const float* __restrict__ x, const unsigned char* __restrict__ wp,
                      const float* __restrict__ bias, float* __restrict__ y,
                      float* __restrict__ slabs, int B, int C, int W, int M, int chunks_total,
                      int slice_chunks) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * DI_STAGES];  // full[s], empty[s]
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  unsigned char* smem = smem_raw + ((1024 - (raw & 1023)) & 1023);  // the swizzle's period
  const unsigned ring = raw + static_cast<unsigned>(smem - smem_raw);
  const unsigned bufs = ring + DI_STAGES * DI_STAGE_BYTES;
  const unsigned full = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  const unsigned empty = full + 8 * DI_STAGES;
  const int tile = blockIdx.x, b = blockIdx.y;
  const int c_begin = blockIdx.z * slice_chunks;
  const int chunks = min(chunks_total - c_begin, slice_chunks), steps = chunks * DI_TAPS;

  if (threadIdx.x == 0) {
    for (int s = 0; s < DI_STAGES; ++s) {
      mbar_init(full + 8 * s, 1);   // the producer's expect_tx
      mbar_init(empty + 8 * s, 2);  // one arrival a consumer warpgroup
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers exist before anything arrives on them

  if (threadIdx.x >= DI_CONSUMERS) {  // the producer warpgroup: weights, one tap a stage
    set_max_regs_dec<40>();
    if (threadIdx.x == DI_CONSUMERS) {
      const unsigned char* src =
          wp + ((size_t)tile * chunks_total + c_begin) * DI_TAPS * DI_STAGE_BYTES;
      for (int i = 0; i < steps; ++i) {
        const int s = i % DI_STAGES;
        if (i >= DI_STAGES) mbar_wait(empty + 8 * s, ((i / DI_STAGES) - 1) & 1);
        mbar_expect_tx(full + 8 * s, DI_STAGE_BYTES);
        bulk_copy(ring + s * DI_STAGE_BYTES, src + (size_t)i * DI_STAGE_BYTES, DI_STAGE_BYTES,
                  full + 8 * s);
      }
    }
    return;
  }

  set_max_regs_inc<232>();  // 128 x 40 + 256 x 232 <= 64K: the accumulators and a chunk's loads
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const float* xb = x + (size_t)b * C * DI_HW;
  float v[DI_LOADS][8];
  di_load(v, xb, 64 * c_begin, C);
  di_store(smem + DI_STAGES * DI_STAGE_BYTES, v, W);
  wg_proxy_fence();
  bar_sync(1, DI_CONSUMERS);

  float acc[DW_N / 2];
  int released = 0;  // steps 0 .. released - 1: stages this warpgroup has handed back
  for (int c = 0; c < chunks; ++c) {
    const unsigned buf = bufs + (c & 1) * DI_BUF_BYTES;
    if (c + 1 < chunks) di_load(v, xb, 64 * (c_begin + c + 1), C);
#pragma unroll
    for (int t = 0; t < DI_TAPS; ++t) {
      const int i = c * DI_TAPS + t, s = i % DI_STAGES;
      mbar_wait(full + 8 * s, (i / DI_STAGES) & 1);
      const unsigned long long da = wg_desc(ring + s * DI_STAGE_BYTES + wg * 64 * DI_ROWB);
      const unsigned long long db = wg_desc(buf + ((t / DI_K) * DI_PW + t % DI_K) * DI_ROWB);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        dw_mma(acc, wg_desc_add(da, 32 * kk), wg_desc_add(db, 32 * kk), i + kk);
      wg_commit();
      wg_wait<1>();  // step i - 1's wgmmas retired: its stage goes back to the producer
      if (i > 0 && released == i - 1) {
        if ((threadIdx.x & 127) == 0) mbar_arrive(empty + 8 * ((i - 1) % DI_STAGES));
        released = i;
      }
      if (t == DI_TAPS / 2 && c + 1 < chunks)  // the other buffer: chunk c - 1's, retired
        di_store(smem + DI_STAGES * DI_STAGE_BYTES + ((c + 1) & 1) * DI_BUF_BYTES, v, W);
    }
    wg_wait<0>();  // this chunk's wgmmas retired before the buffers change hands
    const int last = (c + 1) * DI_TAPS - 1;
    if (released == last) {
      if ((threadIdx.x & 127) == 0) mbar_arrive(empty + 8 * (last % DI_STAGES));
      released = last + 1;
    }
    if (c + 1 < chunks) {
      wg_proxy_fence();
      bar_sync(1, DI_CONSUMERS);
    }
  }
#pragma unroll
  for (int i = 0; i < DW_N / 2; ++i) WG_HOLD(acc[i]);

  // Output pixel n = oh DI_PW + ow of channel m; ow >= Wo and oh >= Ho are dropped.
  const int Wo = W - DI_K + 1, g = lane >> 2, t4 = lane & 3;
  const bool sliced = gridDim.z > 1;
  float* out = sliced ? slabs + (size_t)blockIdx.z * B * M * DI_HO * Wo : y;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = 128 * tile + 64 * wg + 16 * warp + g + 8 * h;
    if (m >= M) continue;
    const float bm = sliced ? 0.f : bias[m];
    float* row = out + ((size_t)b * M + m) * DI_HO * Wo;
#pragma unroll
    for (int j = 0; j < DW_N / 8; ++j) {
      const int n = 8 * j + 2 * t4, oh = n / DI_PW, ow = n % DI_PW;
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
