// Rung 28's staging, k loop, store and persistent kernel, for the precision whose hooks the
// including file defined (fused_wide.cuh lists them).
#pragma once

// Image (NCHW, in global memory or its prefetched copy) -> img (HWC, channels padded to FW_CS
// with zeros). Threads walk pixels fastest, so each of a quad's four loads is coalesced along
// the image rows (and conflict-free in shared memory).
template <bool kShared>
__device__ __forceinline__ void fw_stage_image(fw_t* img, const fw_in_t* __restrict__ xb,
                                               float scale) {
  constexpr int PIX = FW_H * FW_W, ITEMS = PIX * (FW_CS / 4);
  for (int base = threadIdx.x; base < ITEMS; base += FW_THREADS * FW_STAGE_UNROLL) {
    float v[FW_STAGE_UNROLL][4];
#pragma unroll
    for (int u = 0; u < FW_STAGE_UNROLL; ++u) {
      const int i = base + u * FW_THREADS;
      const int quad = i / PIX, pix = i - quad * PIX;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 4 * quad + e;
        v[u][e] = (i < ITEMS && c < FW_C) ? fw_in<kShared>(xb + (size_t)c * PIX + pix) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < FW_STAGE_UNROLL; ++u) {
      const int i = base + u * FW_THREADS;
      const int quad = i / PIX, pix = i - quad * PIX;
      const int row_pad = (pix / FW_W) * (FW_WS - FW_W);
      if (i < ITEMS) fw_store4(img + (pix + row_pad) * FW_CS + 4 * quad, v[u], scale);
    }
  }
}

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

// Pool, unscale (3xfp16), bias, ReLU and store one unit. c0/c1 of a tile are the lane's row
// g, channels 2t and 2t+1 of the n-tile; c2/c3 the same channels of row g+8. The unscale
// factors are powers of two (> 0): they commute with the max, and each product is exact.
__device__ __forceinline__ void fw_store(const float (&acc)[FW_T][FW_NT][4], FwRows rows,
                                         int lane, const float* __restrict__ bias,
                                         float* __restrict__ y, size_t b, float w_unscale,
                                         float a_unscale) {
  const int g = lane >> 2, t = lane & 3;
  const bool writer = rows.valid && (FW_P == 2 || (g & 1) == 0);
#pragma unroll
  for (int r = 0; r < FW_RP; ++r)
#pragma unroll
    for (int n = 0; n < FW_NT; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = CONVOLAB_NEG_INF;
#pragma unroll
        for (int i = r * FW_P; i < (r + 1) * FW_P; ++i)
          v = fmax_nan(v, fmax_nan(acc[i][n][e], acc[i][n][2 + e]));
#if FW_P == 4
        v = fmax_nan(v, __shfl_xor_sync(0xffffffffu, v, 4));  // lane g^1: the other 2 columns
#endif
        v = fw_unscale(v, w_unscale, a_unscale);
        const int m = n * 8 + 2 * t + e;
        if (writer && r >= rows.skip && m < FW_M)
          y[((b * FW_M + m) * FW_HP + rows.wy + r) * (size_t)FW_WP + rows.wx] =
              fmax_nan(v + __ldg(bias + m), 0.f);
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
  // The row padding and the slack past the image are read (times zero weights) but never
  // staged: zero them once (in each staged image).
  constexpr int PAD = (FW_WS - FW_W) * FW_CS, PAD1 = PAD > 0 ? PAD : 1;
#pragma unroll
  for (int part = 0; part < FW_PARTS; ++part) {
    fw_t* im = img + part * FW_IMG1;
    for (int i = threadIdx.x; i < FW_H * PAD; i += FW_THREADS)
      im[(i / PAD1) * FW_ROW + FW_W * FW_CS + i % PAD1] = fw_t(0.f);
    for (int i = FW_H * FW_ROW + threadIdx.x; i < FW_IMG1; i += FW_THREADS) im[i] = fw_t(0.f);
  }
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
