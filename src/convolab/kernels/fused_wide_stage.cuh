// Rung 28's image staging and pooled store, shared by its k loop (fused_wide_kernel.cuh) and
// the wgmma rung 44's (which stages in one pass: fw_stage_once): what they need of the
// including file's hooks is fw_store4 and fw_unscale (fused_wide.cuh lists them).
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

// The row padding and the slack past the image are read (times zero weights) but never
// staged: zeroed once, in each staged image.
__device__ __forceinline__ void fw_zero_slack(fw_t* img) {
  constexpr int PAD = (FW_WS - FW_W) * FW_CS, PAD1 = PAD > 0 ? PAD : 1;
#pragma unroll
  for (int part = 0; part < FW_PARTS; ++part) {
    fw_t* im = img + part * FW_IMG1;
    for (int i = threadIdx.x; i < FW_H * PAD; i += FW_THREADS)
      im[(i / PAD1) * FW_ROW + FW_W * FW_CS + i % PAD1] = fw_t(0.f);
    for (int i = FW_H * FW_ROW + threadIdx.x; i < FW_IMG1; i += FW_THREADS) im[i] = fw_t(0.f);
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

// Image (NCHW, global memory) -> img (HWC, rung 28's staged form): every load of the thread's
// share is issued before the first store, so the image costs one memory latency rather than
// one per batch of loads; 3xfp16's scale comes from the same registers (rung 28 reads the
// image twice). Returns the scale exponent (0 in fp16).
__device__ __forceinline__ int fw_stage_once(fw_t* img, const fw_in_t* __restrict__ xb,
                                             float* red) {
  constexpr int PIX = FW_H * FW_W, ITEMS = PIX * (FW_CS / 4);
  constexpr int PER = (ITEMS + FW_THREADS - 1) / FW_THREADS;
  float v[PER][4];
  float m = 0.f;
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = threadIdx.x + u * FW_THREADS;
    const int quad = i / PIX, pix = i - quad * PIX;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 4 * quad + e;
      v[u][e] = (i < ITEMS && c < FW_C) ? fw_in<false>(xb + (size_t)c * PIX + pix) : 0.f;
      m = fmaxf(m, fabsf(v[u][e]));
    }
  }
#if FW_PREC == 3
  const int e = fw_block_exponent(m, red);
#else
  const int e = 0;
#endif
  const float scale = fw_pow2(e);
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = threadIdx.x + u * FW_THREADS;
    const int quad = i / PIX, pix = i - quad * PIX;
    const int row_pad = (pix / FW_W) * (FW_WS - FW_W);
    if (i < ITEMS) fw_store4(img + (pix + row_pad) * FW_CS + 4 * quad, v[u], scale);
  }
  return e;
}
