// Rung 19 — the fp16 LeNet's channels-last pair. Changes against rungs 17/18: the tensor
// between conv1 and conv2 is fp16 channels-last [b][ph][pw][4] (8 bytes a pixel) instead of
// fp32 NCHW, written by conv1's Toeplitz kernel and read by a conv2 kernel made for it.
// Why: that map (256 MB fp32 at B=10000, written once, read once) is the only full-size tensor
// of the fused forward; fp16 channels-last halves it and lets conv2 stage it with plain 16-byte
// cp.async (no conversion, no shifted copy). Neither kernel is a registry rung: their input or
// output is not the fp32 NCHW tensor of the ConvImpl contract; FusedLeNet (mode 'fp16') runs
// them.
// Measured: conv1 0.246 ms (a block per image), conv2 0.181 ms, whole fp16 forward 0.501 ms
// (H100, B=10000).
//
// fcp_mma_toe_cl — kernel 17's Toeplitz kernel (fp16, TC_PREC 0) with a channels-last fp16 store.

#include "fused_mma.cuh"

static_assert(TC_PREC == 0, "the channels-last map is fp16: conv1 runs on fp16 tensor cores");

struct ToeChannelsLastStore {  // fp16 [b][Hp][Wp][TC_M]
  __half2* __restrict__ y;
  int Hp, Wp;
  __device__ __forceinline__ void operator()(size_t b, int ph, int pw,
                                             const float (&out)[TC_M]) const {
    __half2* yc = y + ((b * Hp + ph) * (size_t)Wp + pw) * (TC_M / 2);
#pragma unroll
    for (int n = 0; n < TC_M; n += 2) yc[n / 2] = pack_half2(out[n], out[n + 1]);
  }
};

extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_MINB)
fcp_mma_toe_cl(const float* __restrict__ x, const uint2* __restrict__ bfrag,
               const float* __restrict__ bias, __half2* __restrict__ y, int H, int W, int Hp,
               int Wp, int tiles_h) {
  static_assert(TC_M % 2 == 0, "channels-last fp16 output stores channel pairs");
  toe_conv_pool(ToeFloatInput{x, H, W}, bfrag, bias, Hp, Wp, tiles_h,
                ToeChannelsLastStore{y, Hp, Wp});
}

// fcp_mma_toe_cl_raw — the same from raw uint8 images, resized while staging (resize.cuh).
#if TC_C == 1  // raw images have one channel
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_MINB)
fcp_mma_toe_cl_raw(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
                   const uint2* __restrict__ bfrag, const float* __restrict__ bias,
                   __half2* __restrict__ y, int H, int W, int Hp, int Wp, int tiles_h) {
  static_assert(TC_M % 2 == 0, "channels-last fp16 output stores channel pairs");
  __shared__ float unit[RAW_H * RAW_W];
  __shared__ float rows[TOE_IR * RAW_W];
  toe_conv_pool(toe_stage_raw(unit, rows, raw, taps, H, W, tiles_h), bfrag, bias, Hp, Wp,
                tiles_h, ToeChannelsLastStore{y, Hp, Wp});
}
#endif

// =============================================================================================
// fcp_mma_cl — conv2 on tensor cores, reading the pooled C1 map as fp16 channels-last. Same
// fusion and same pool-4 window mapping as kernel 18's fcp_mma_wa (weights = the 16-row A
// operand, kept in registers; B = implicit im2col, 8 positions per n-tile; one 4x4 pool window
// = 2 n-tiles in one quad, pooled by a max over registers and 2 shuffles). What it adds over fcp_mma_wa, and why:
//   * its input is the map fcp_mma_toe_cl above writes: fp16 [b][40][40][4], 8 bytes a
//     pixel. The 256 MB fp32 NCHW intermediate (written once, read once) becomes
//     128 MB: half the bytes of the only full-size tensor between the two layers;
//   * no conversion: the map is already fp16, so staging is plain 16-byte cp.async of the
//     image's rows straight into shared memory (no register round trip, no cvt, no stores);
//   * no shifted copy: fcp_mma_wa needs a second, one-element-shifted tile because its k pairs
//     are two horizontally adjacent pixels of one channel and half of them start on an odd
//     column. Here a k pair is two channels of ONE pixel, always 4-byte aligned;
//   * B fragments are reused in registers: n-tile jj of a warp's unit (CL_NV windows stacked
//     vertically) at filter row p reads input row pair 2 jj + p, so one load feeds up to 4
//     mma (fcp_mma_wa loads one fragment per mma);
//   * the 1024 pooled features of an image go through shared memory and leave as coalesced
//     float4 stores in the order the head (kernels/20 lenet_head) reads: c*64 + ph*8 + pw.
//
// GEMM k order. For filter row p, k-step h covers 16 k = 4 columns q x 4 channels c (q = 7 is
// padding with zero weight), 2 steps a row, 14 mma.m16n8k16 per n-tile (as many as
// fcp_mma_wa). Within a step, CL_KORDER picks which k sits where (A fragments follow, see
// gpu/fused_cl.py cl_fragments):
//   0: kk -> q = 4h + kk/4, c = kk%4. Lane t's b0 = pixel (ow + 4h + t/2), channels 2(t&1),
//      2(t&1)+1 (one 32-bit load); b1 = the pixel two columns right. 2 x LDS.32 per mma.
//   1: kk -> q = 4h + (kk%8)/2, c = 2(kk/8) + kk%2. Lane t's b0 = channels 0,1 and b1 =
//      channels 2,3 of the SAME pixel (ow + 4h + t): one 64-bit load gives both. 1 x LDS.64
//      per mma: half the shared-memory instructions.
// Bank check (one warp, one load): lane (g, t) reads pixel (oh + R, ow + 4h + t') with
// oh = 4ph0 + g/4, ow = 4pw + g%4. A shared row is 40 px x 8 B = 320 B = 80 words,
// so the two output rows of the n-tile sit 16 banks apart; each row touches pixels dx + t' in
// 0..6 (KORDER 1: 14 words; KORDER 0: 10 words): 0..13 and 16..29 mod 32 -> no two distinct
// words share a bank (equal words are broadcast), one wavefront per load.

#ifndef CL_H
#define CL_H 40  // input rows (pooled C1 map)
#endif
#ifndef CL_W
#define CL_W 40  // input columns
#endif
#ifndef CL_K
#define CL_K 7  // filter size (<= 8)
#endif
#ifndef CL_M
#define CL_M 16  // output channels (<= 16: one mma row each)
#endif
#ifndef CL_WARPS
#define CL_WARPS 4
#endif
#ifndef CL_MINB
#define CL_MINB 1  // blocks per SM the register allocation must allow
#endif
#ifndef CL_KORDER
#define CL_KORDER 1
#endif
#ifndef CL_SPLIT
// 1: stage the rows of the upper half of the pool windows as one cp.async group and the rest
// as a second, and start on the upper windows while the second group is still in flight.
#define CL_SPLIT 0
#endif
#ifndef CL_NV
#define CL_NV 1  // vertically stacked pool windows a warp works on at once (divides the rows)
#endif

#define CL_C 4  // input channels: one 8-byte pixel; a k-step is 4 columns x 4 channels
#define CL_P 4  // pool window and stride
#define CL_HP ((CL_H - CL_K + 1) / CL_P)
#define CL_WP ((CL_W - CL_K + 1) / CL_P)
#define CL_KS ((CL_K + 3) / 4)             // k-steps per filter row
#define CL_STEPS (CL_K * CL_KS)            // mma per n-tile
#define CL_ROWS (CL_HP * CL_P - 1 + CL_K)  // input rows the pool windows reach
#define CL_WINDOWS (CL_HP * CL_WP)
#define CL_FEATS (CL_M * CL_WINDOWS)       // pooled features of one image
#define CL_UNITS (CL_WINDOWS / CL_NV)      // warp work items: CL_NV windows of one column
#define CL_THREADS (CL_WARPS * 32)

static_assert(CL_K >= 1 && CL_K <= 8 && CL_M >= 1 && CL_M <= 16, "one 16-row A operand");
static_assert(CL_HP >= 1 && CL_WP >= 1, "no complete 4x4 pool window");
static_assert(CL_WP * CL_P - 1 + 4 * CL_KS - 1 < CL_W,
              "the zero-weight padding taps (q >= K) must still read inside the row");
static_assert((CL_H * CL_W) % 2 == 0 && (CL_ROWS * CL_W) % 2 == 0,
              "images and staged rows are whole 16-byte chunks (2 pixels)");
static_assert(CL_NV >= 1 && CL_HP % CL_NV == 0, "CL_NV must divide the pooled rows");

__device__ __forceinline__ void cl_mma(float (&d)[4], const uint4& a, unsigned b0, unsigned b1) {
  mma_f16_m16n8k16(d, a.x, a.y, a.z, a.w, b0, b1);
}

// Chunks [lo, hi) of 16 bytes (2 pixels) of the image -> the same offsets in shared memory.
__device__ __forceinline__ void cl_stage(uint4* dst, const uint4* __restrict__ src, int lo,
                                         int hi) {
  for (int i = lo + static_cast<int>(threadIdx.x); i < hi; i += CL_THREADS)
    cp_async16(dst + i, src + i);
  cp_async_commit();
}

// One warp-iteration: the CL_NV pool windows (ph0 + v, pw), v < CL_NV, of unit u, stacked
// vertically: n-tile jj (2 per window) holds output rows 4 ph0 + 2 jj + g/4, columns 4 pw + g%4.
// Its B fragment for filter row p depends only on R = 2 jj + p (the input row pair), so each
// (R, h) fragment is loaded once and feeds up to 4 n-tiles: 2 CL_NV + K - 1 row pairs x KS
// loads for 2 CL_NV x K x KS mma (CL_NV 1: 18 loads / 28 mma; 2: 26 / 56; 4: 42 / 112).
// The pooled, biased, ReLU'd values go to out_s[channel][window].
__device__ __forceinline__ void cl_unit(const uint2* in_s, float* out_s,
                                        const uint4 (&af)[CL_STEPS], int u, float b_lo,
                                        float b_hi) {
  constexpr int NT = 2 * CL_NV;  // n-tiles of the unit
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ph0 = (u / CL_WP) * CL_NV, pw = u % CL_WP;
  const uint2* base = in_s + (ph0 * CL_P + (g >> 2)) * CL_W + pw * CL_P + (g & 3) + t;
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  // The NT accumulator chains are independent: consecutive mma of a warp do not wait on
  // each other.
#pragma unroll
  for (int r = 0; r < 2 * (NT - 1) + CL_K; ++r)
#pragma unroll
    for (int h = 0; h < CL_KS; ++h) {
#if CL_KORDER == 1
      const uint2 px = base[r * CL_W + 4 * h];
      const unsigned b0 = px.x, b1 = px.y;
#else
      const unsigned* wd = reinterpret_cast<const unsigned*>(base - t + r * CL_W + 4 * h) + t;
      const unsigned b0 = wd[0], b1 = wd[4];
#endif
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int p = r - 2 * j;
        if (p >= 0 && p < CL_K) cl_mma(acc[j], af[p * CL_KS + h], b0, b1);
      }
    }
#pragma unroll
  for (int v = 0; v < CL_NV; ++v) {
    // acc[.][0..1]: channel g, positions 2t, 2t+1; acc[.][2..3]: channel g + 8.
    const float(&a)[4] = acc[2 * v];
    const float(&c)[4] = acc[2 * v + 1];
    float lo = fmax_nan(fmax_nan(a[0], a[1]), fmax_nan(c[0], c[1]));
    float hi = fmax_nan(fmax_nan(a[2], a[3]), fmax_nan(c[2], c[3]));
    lo = fmax_nan(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
    hi = fmax_nan(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
    lo = fmax_nan(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
    hi = fmax_nan(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
    const int wi = (ph0 + v) * CL_WP + pw;
    if (t == 0) {
      // max(acc) + b == max(acc + b) exactly (rounding is monotonic); ReLU commutes with max.
      if (g < CL_M) out_s[g * CL_WINDOWS + wi] = fmax_nan(lo + b_lo, 0.f);
      if (g + 8 < CL_M) out_s[(g + 8) * CL_WINDOWS + wi] = fmax_nan(hi + b_hi, 0.f);
    }
  }
}

// x: fp16 channels-last [B][CL_H][CL_W][4] (16-byte chunks); afrag: (CL_STEPS, 32 lanes) uint4
// A fragments from gpu/fused_cl.py; y: fp32 [B][CL_M][CL_HP][CL_WP]. One block per image.
extern "C" __global__ void __launch_bounds__(CL_THREADS, CL_MINB)
fcp_mma_cl(const uint4* __restrict__ x, const uint4* __restrict__ afrag,
           const float* __restrict__ bias, float* __restrict__ y) {
  __shared__ __align__(16) uint2 in_s[CL_ROWS * CL_W];  // one pixel = 4 fp16 channels
  __shared__ __align__(16) float out_s[CL_FEATS];
  const size_t b = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  const uint4* src = x + b * (CL_H * CL_W / 2);
  uint4* dst = reinterpret_cast<uint4*>(in_s);
  // Staging first (asynchronous), then the weight fragments: their loads overlap.
#if CL_SPLIT
  // The first group: the rows the units of the upper HALF_PH window rows read.
  constexpr int HALF_PH = CL_HP / 2 / CL_NV * CL_NV;
  constexpr int ROWS_A = HALF_PH * CL_P - 1 + CL_K;
  constexpr int CHUNKS_A = (ROWS_A * CL_W) / 2;
  constexpr int CL_UNITS_A = HALF_PH / CL_NV * CL_WP;
  static_assert(HALF_PH >= 1 && (ROWS_A * CL_W) % 2 == 0, "CL_SPLIT: no whole upper half");
  cl_stage(dst, src, 0, CHUNKS_A);
  cl_stage(dst, src, CHUNKS_A, CL_ROWS * CL_W / 2);
#else
  cl_stage(dst, src, 0, CL_ROWS * CL_W / 2);
#endif
  uint4 af[CL_STEPS];
#pragma unroll
  for (int s = 0; s < CL_STEPS; ++s) af[s] = __ldg(&afrag[s * 32 + lane]);
  const float b_lo = g < CL_M ? __ldg(&bias[g]) : 0.f;
  const float b_hi = g + 8 < CL_M ? __ldg(&bias[g + 8]) : 0.f;

#if CL_SPLIT
  cp_async_wait<1>();
  __syncthreads();
  for (int u = warp; u < CL_UNITS_A; u += CL_WARPS) cl_unit(in_s, out_s, af, u, b_lo, b_hi);
  cp_async_wait<0>();
  __syncthreads();
  for (int u = CL_UNITS_A + warp; u < CL_UNITS; u += CL_WARPS)
    cl_unit(in_s, out_s, af, u, b_lo, b_hi);
#else
  cp_async_wait<0>();
  __syncthreads();
  for (int u = warp; u < CL_UNITS; u += CL_WARPS) cl_unit(in_s, out_s, af, u, b_lo, b_hi);
#endif
  __syncthreads();
#if CL_FEATS % 4 == 0  // every image's features start 16-byte aligned: float4 stores
  float4* yb = reinterpret_cast<float4*>(y + b * CL_FEATS);
  const float4* os = reinterpret_cast<const float4*>(out_s);
  for (int i = threadIdx.x; i < CL_FEATS / 4; i += CL_THREADS) yb[i] = os[i];
#else
  for (int i = threadIdx.x; i < CL_FEATS; i += CL_THREADS) y[b * CL_FEATS + i] = out_s[i];
#endif
}
