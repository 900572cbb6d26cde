// Kernel 51: kernel 50's direct convolution on Hopper's warpgroup MMA (sm_90a): the ring of
// channels-last input rows read by wgmma descriptors, input rows loaded two output rows ahead.
//
// What it changes against kernel 50: there eight warps issue mma.sync from ldmatrix fragments
// (on conv1_2 ~200 TFLOP/s: mma.sync's rate on Hopper, and every warp's fragments read from
// shared memory), and the block stops computing while it converts the next input row. Here:
// - each of DW_WG warpgroups issues wgmma m64nNk16 for all 64 output channels and its N = DW_N
//   columns of the output row, both operands read from shared memory by descriptor. The ring's
//   layout is already wgmma's K-major 128-byte swizzle (a pixel's 64 channels one 128-byte row,
//   piece j at j ^ (pixel mod 8), 8-row groups 1024 bytes apart), so tap (p, q) is a descriptor
//   starting q rows (q x 128 bytes) into ring row oh + p: the hardware applies the swizzle to
//   the address bits, so the start needs no 1024-byte alignment (and the descriptor's base
//   offset stays 0: set to the start's row it gave wrong sums on the H200);
// - the ring has K + 2 rows. While an output row's wgmmas run (asynchronous), every thread
//   converts into the ring the input row it loaded during the previous output row, then issues
//   the loads of the next one into registers: a row's loads have a whole output row to land,
//   and there is no staging area in shared memory (the weights and the ring fill it).
// Rows wider than DW_WG x DW_N columns take several passes over the same ring rows. What bounds
// it on conv1_2 is the fp32 output: without its stores the call ran in about half the time
// (docs/vgg.md, "Kernels 50-51").
//
// Launch: grid = blocks (at most one per output row), 128 DW_WG threads; block i takes output
// rows [i R / grid, (i + 1) R / grid) of the R = B Ho rows of the batch. Dynamic shared memory:
// the weights (K*K taps x 64 rows x 128 bytes) and K + 2 ring rows of slot_pixels x 128 bytes
// (slot_pixels a multiple of 8), plus 1 KB to align them (gpu/direct_wgmma.py `smem_bytes`).

#include "common.cuh"
#include "wgmma_core.cuh"

#ifndef DW_MODE
#define DW_MODE 0  // operands: 0 fp16, 1 bf16
#endif
#ifndef DW_K
#define DW_K 3  // filter size
#endif
#ifndef DW_KK
#define DW_KK 4  // k-steps of 16 channels a tap: C <= 16 DW_KK
#endif
#ifndef DW_WG
#define DW_WG 2  // warpgroups along the output row
#endif
#ifndef DW_N
#define DW_N 112  // a warpgroup's output columns a pass (the wgmma's N)
#endif
#ifndef DW_LOADS
#define DW_LOADS 8  // 8-channel pieces of an input row a thread loads: ceil(W 2 DW_KK / threads)
#endif

#define DW_THREADS (128 * DW_WG)
#define DW_ROWB 128                              // a pixel's (or a weight row's) 64 channels
#define DW_TAP_BYTES (64 * DW_ROWB)              // one tap's weights: the wgmma's A
#define DW_A_BYTES (DW_K * DW_K * DW_TAP_BYTES)
#define DW_SLOTS (DW_K + 2)  // K rows an output row reads, the next one, one being stored
#define DW_PASS (DW_WG * DW_N)

static_assert(DW_KK >= 1 && DW_KK <= 4, "at most 64 channels: one 128-byte row a pixel");
static_assert(DW_N % 16 == 0 && DW_N >= 16 && DW_N <= 128, "N: 16..128 in steps of 16");

#include "direct_wgmma.cuh"  // dw_mma: this kernel's wgmma, its PTX

// Row y of image xb (C channels, fp32 NCHW) into registers: this thread's 8-channel pieces of
// it, all loads issued at once (they land while the block computes a row).
__device__ __forceinline__ void dw_load(float (&v)[DW_LOADS][8], const float* __restrict__ xb,
                                        int y, int C, int H, int W) {
#pragma unroll
  for (int i = 0; i < DW_LOADS; ++i) {
    const int t = threadIdx.x + i * DW_THREADS, j = t / W, p = t - j * W;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int c = 8 * j + e;
      v[i][e] = j < 2 * DW_KK && c < C ? __ldg(xb + ((size_t)c * H + y) * W + p) : 0.f;
    }
  }
}

// ... then into ring row `dst`: pixel p's channels 8j..8j+7 as one 16-byte piece at
// j ^ (p mod 8), zero past C.
__device__ __forceinline__ void dw_store(unsigned char* dst, const float (&v)[DW_LOADS][8],
                                         int W) {
#pragma unroll
  for (int i = 0; i < DW_LOADS; ++i) {
    const int t = threadIdx.x + i * DW_THREADS, j = t / W, p = t - j * W;
    if (j < 2 * DW_KK)
      *reinterpret_cast<uint4*>(dst + p * DW_ROWB + ((j ^ (p & 7)) << 4)) =
          make_uint4(pack_16bit<DW_MODE>(v[i][0], v[i][1]), pack_16bit<DW_MODE>(v[i][2], v[i][3]),
                     pack_16bit<DW_MODE>(v[i][4], v[i][5]), pack_16bit<DW_MODE>(v[i][6], v[i][7]));
  }
}

extern "C" __global__ void __launch_bounds__(DW_THREADS, 1)
    direct_conv_wgmma(const float* __restrict__ x, const uint4* __restrict__ wp,
                      const float* __restrict__ bias, float* __restrict__ y, int B, int C,
                      int H, int W, int M, int slot_pixels) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  unsigned char* smem = smem_raw + ((1024 - (raw & 1023)) & 1023);  // the swizzle's period
  const unsigned a_base = raw + static_cast<unsigned>(smem - smem_raw);
  const unsigned slot_bytes = slot_pixels * DW_ROWB;
  const int Ho = H - DW_K + 1, Wo = W - DW_K + 1, rows = B * Ho;
  const int r0 = (int)((long long)blockIdx.x * rows / gridDim.x);
  const int r1 = (int)((long long)(blockIdx.x + 1) * rows / gridDim.x);
  if (r0 >= r1) return;  // the host launches at most one block a row; kept for safety
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const size_t image = (size_t)C * H * W;

  for (int i = threadIdx.x; i < DW_A_BYTES / 16; i += DW_THREADS)
    cp_async16(smem + 16 * i, wp + i);
  cp_async_commit();

  // The ring holds image ring_b's input rows up to ring_end - 1; row `pending` (if >= 0) is in
  // flight in v; rows up to need_end - 1 are read by the run's output rows of this image.
  float v[DW_LOADS][8];
  int ring_b = -1, ring_end = 0, pending = -1, need_end = 0;
  for (int r = r0; r < r1; ++r) {
    const int b = r / Ho, oh = r % Ho;
    const float* xb = x + b * image;
    if (b != ring_b) {  // a run's or an image's first rows: K + 1 of them, before any MMA
      if (r > r0) __syncthreads();  // the other warpgroup's MMAs on the last image retired
      ring_b = b, pending = -1;
      need_end = min(r1 - 1 - b * Ho, Ho - 1) + DW_K;
      for (ring_end = oh; ring_end < min(oh + DW_K + 1, need_end); ++ring_end) {
        dw_load(v, xb, ring_end, C, H, W);
        dw_store(smem + DW_A_BYTES + (ring_end % DW_SLOTS) * slot_bytes, v, W);
      }
    }
    cp_async_wait_all();  // the weights, the first time
    wg_proxy_fence();     // what this thread stored is read by the wgmmas' (async) proxy
    __syncthreads();      // the ring rows complete; the previous row's MMAs all retired

    for (int n0 = 0; n0 < Wo; n0 += DW_PASS) {
      const int col = n0 + wg * DW_N;  // the warpgroup's first output column
      float acc[DW_N / 2];
      wg_fence();
#pragma unroll
      for (int p = 0; p < DW_K; ++p) {
        const unsigned in_row = a_base + DW_A_BYTES + ((oh + p) % DW_SLOTS) * slot_bytes;
#pragma unroll
        for (int q = 0; q < DW_K; ++q) {
          const unsigned long long da = wg_desc(a_base + (p * DW_K + q) * DW_TAP_BYTES);
          const unsigned long long db = wg_desc(in_row + (col + q) * DW_ROWB);
#pragma unroll
          for (int kk = 0; kk < DW_KK; ++kk)
            dw_mma(acc, wg_desc_add(da, 32 * kk), wg_desc_add(db, 32 * kk), p + q + kk);
        }
      }
      wg_commit();
      // While they run: the row loaded during the last output row into the ring row that row
      // freed (none of this row's MMAs reads it), then the loads of the row after it.
      if (n0 == 0) {
        if (pending >= 0) {
          dw_store(smem + DW_A_BYTES + (pending % DW_SLOTS) * slot_bytes, v, W);
          ring_end = pending + 1, pending = -1;
        }
        if (ring_end < need_end) dw_load(v, xb, pending = ring_end, C, H, W);
      }
      wg_wait<0>();
#pragma unroll
      for (int i = 0; i < DW_N / 2; ++i) WG_HOLD(acc[i]);

      const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = 16 * warp + g + 8 * h;
        if (m >= M) continue;
        const float bm = bias[m];
        float* out = y + (((size_t)b * M + m) * Ho + oh) * (size_t)Wo;
#pragma unroll
        for (int j = 0; j < DW_N / 8; ++j) {
          const int n = col + 8 * j + 2 * t4;
          const float v0 = acc[4 * j + 2 * h] + bm, v1 = acc[4 * j + 2 * h + 1] + bm;
          if (n + 1 < Wo && !(Wo & 1)) {
            *reinterpret_cast<float2*>(out + n) = make_float2(v0, v1);
          } else {
            if (n < Wo) out[n] = v0;
            if (n + 1 < Wo) out[n + 1] = v1;
          }
        }
      }
    }
  }
}
