// Rung 28's staging, k loop, store and persistent kernel, for the precision whose hooks the
// including file defined (fused_wide.cuh lists them).
#pragma once
#include "fused_wide_stage.cuh"

// A group's accumulators: [unit][tile][n-tile][fragment register].
typedef float FwAcc[FW_UNITS][FW_T][FW_NT][4];

// acc = 0, or (add) total += acc, register by register.
template <bool kAdd>
__device__ __forceinline__ void fw_acc_pass(FwAcc& total, const FwAcc& acc) {
#pragma unroll
  for (int u = 0; u < FW_UNITS; ++u)
#pragma unroll
    for (int i = 0; i < FW_T; ++i)
#pragma unroll
      for (int n = 0; n < FW_NT; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          total[u][i][n][r] = kAdd ? total[u][i][n][r] + acc[u][i][n][r] : 0.f;
}

// The units of one group: total[u][i][n] is tile i (output row i of the unit) x n-tile n. A
// partial last group recomputes real windows rather than branch, so the compiler interleaves
// the units' loads and MMAs.
__device__ __forceinline__ void fw_group(const fw_t* img, const uint2* w_s, int group, int lane,
                                         FwAcc& total, FwRows (&rows)[FW_UNITS]) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < FW_UNITS; ++u) rows[u] = fw_rows(group * FW_UNITS + u, g, t);
  fw_acc_pass<false>(total, total);
#if FW_EXACT
  FwAcc acc;
#else
  FwAcc& acc = total;
#endif
#pragma unroll 1
  for (int j = 0; j < FW_J; ++j) {
    uint2 bw[FW_K][FW_NT], bs[FW_K][FW_NT];
#pragma unroll
    for (int p = 0; p < FW_K; ++p)
#pragma unroll
      for (int n = 0; n < FW_NT; ++n) {
        const int at = ((j * FW_K + p) * FW_NT + n) * 32 + lane;
        bw[p][n] = w_s[at];
        bs[p][n] = fw_weights_small(bw[p][n], w_s, at);
      }
#if FW_EXACT
    fw_acc_pass<false>(acc, acc);
#endif
#pragma unroll
    for (int u = 0; u < FW_UNITS; ++u) {
      const fw_t* lo_p = img + rows[u].lo + j * FW_CH;
      const fw_t* hi_p = img + rows[u].hi + j * FW_CH;
#pragma unroll
      for (int s = 0; s < FW_SHIFTS; ++s) {
        FwA a = fw_lda(lo_p + s * FW_ROW, hi_p + s * FW_ROW);
        const FwA as = fw_a_small(a, lo_p + s * FW_ROW, hi_p + s * FW_ROW);
#pragma unroll
        for (int i = 0; i < FW_T; ++i) {
          const int p = s - i;
          if (p < 0 || p >= FW_K) continue;
#pragma unroll
          for (int n = 0; n < FW_NT; ++n) fw_step(acc[u][i][n], a, as, bw[p][n], bs[p][n]);
        }
      }
    }
#if FW_EXACT
    fw_acc_pass<true>(total, acc);
#endif
  }
}

// Persistent: each block stages the weight fragments once, then loops over images. With
// FW_PREFETCH the next image's bytes land in shared memory while this one computes, and
// staging is a shared-to-shared transpose. w_unscale: 3xfp16's 2^-e of the weights' scale
// (ignored otherwise).
extern "C" __global__ void __launch_bounds__(FW_THREADS, FW_MINB)
fcp_wide(const fw_in_t* __restrict__ x, const uint4* __restrict__ wfrag,
         const float* __restrict__ bias, float* __restrict__ y, int batch, float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  const uint2* w_s = reinterpret_cast<const uint2*>(fw_smem);
  fw_t* img = reinterpret_cast<fw_t*>(fw_smem + FW_WBYTES);
  for (int i = threadIdx.x; i < FW_WBYTES / 16; i += FW_THREADS)
    reinterpret_cast<uint4*>(fw_smem)[i] = __ldg(wfrag + i);
  fw_zero_slack(img);
  float* red = reinterpret_cast<float*>(fw_smem + FW_WBYTES + FW_PARTS * FW_IMG1_BYTES);
#if FW_PREFETCH
  unsigned char* raw = fw_smem + FW_WBYTES + FW_IMG_BYTES;
  if ((int)blockIdx.x < batch) fw_prefetch(raw, x, blockIdx.x);
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Which warp starts an image's groups turns image by image: where the groups do not split
  // evenly, the extra ones go to every warp (and scheduler) in turn.
  int turn = blockIdx.x;
  for (int b = blockIdx.x; b < batch; b += gridDim.x, ++turn) {
    int e = 0;  // 3xfp16: the image's scale 2^e
#if FW_PREFETCH
    const fw_in_t* xb = reinterpret_cast<const fw_in_t*>(raw);
    cp_async_wait_all();
    __syncthreads();  // image b has landed; every warp is done with the previous image
    e = fw_image_exponent<true>(xb, red);
    fw_stage_image<true>(img, xb, fw_pow2(e));
    __syncthreads();  // img is staged and raw is free
    if (b + (int)gridDim.x < batch) fw_prefetch(raw, x, b + gridDim.x);
#else
    const fw_in_t* xb = x + (size_t)b * (FW_C * FW_H * FW_W);
    __syncthreads();  // every warp is done with the previous image
    e = fw_image_exponent<false>(xb, red);
    fw_stage_image<false>(img, xb, fw_pow2(e));
    __syncthreads();
#endif
    const float a_unscale = fw_pow2(-e);
    for (int group = (warp + turn) % FW_WARPS; group < FW_NGROUPS; group += FW_WARPS) {
      FwAcc total;
      FwRows rows[FW_UNITS];
      fw_group(img, w_s, group, lane, total, rows);
#pragma unroll
      for (int u = 0; u < FW_UNITS; ++u)
        fw_store(total[u], rows[u], lane, bias, y, (size_t)b, w_unscale, a_unscale);
    }
  }
}
