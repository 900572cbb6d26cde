// Rung 13 — fused-conv-pool: convolution + bias + ReLU + max-pool (window P, stride P, floor)
// in one kernel. Changes against rung 7 (register-tiled): a thread still owns a register tile
// of outputs, but the tile is now whole pool windows, so the P*P convolution outputs of a
// window never leave registers — only the pooled value is written. For the ece408 layers that
// removes the full-resolution write + re-read (conv1: 1 GB of its 1.3 GB of traffic) and, for
// conv2, the 34x34 -> 8x8 floor pool means rows/columns 32 and 33 are never computed at all
// (11% fewer FMAs than the unfused layer).
//
// Why it is fast (the layers are FMA-bound, not memory-bound, once fused):
//   * the input tile of a block is staged once in shared memory, CC channels at a time;
//   * each thread loads one input row segment into registers and reuses every value for
//     up to PW*P output columns x MT channels x (all pool rows that row feeds);
//   * weights sit in shared memory as [c][p][q][MT], read as float4 broadcasts (every lane
//     reads the same address), so one 16-byte load feeds 4 channels x PW*P columns of FMAs.
// Measured: conv1 0.696 ms, conv2 1.449 ms (H100, B=10000).
//
// Kernels:
//   fcp_exact   the register-tiled kernel above (fp32 FFMA, exact to fp32 rounding)
//   fcp_simple  one thread per pooled output, straight from global memory: the fallback for
//               pool windows or filters too large to tile in registers (P > 8, K > 15)

#include "fused_conv_pool.cuh"

extern "C" __global__ void __launch_bounds__(FCP_THREADS, FCP_MINB)
fcp_exact(const float* __restrict__ x, const float* __restrict__ w,
          const float* __restrict__ bias, float* __restrict__ y,
          int C, int H, int W, int M, int Hp, int Wp, int tiles_w, int tiles_per_image) {
  __shared__ __align__(16) float in_s[FCP_CC * FCP_IN_TILE];
  __shared__ __align__(16) float w_s[FCP_CC * FCP_W_TILE];

  const int tile = blockIdx.x % tiles_per_image;
  const size_t b = blockIdx.x / tiles_per_image;
  const int tile_y = tile / tiles_w, tile_x = tile % tiles_w;
  const int mb0 = blockIdx.y * FCP_MB;               // first channel of the block
  const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
  const int m0 = mb0 + tz * FCP_MT;                  // first channel of this thread
  const int tid = (tz * FCP_TY + ty) * FCP_TX + tx;
  const int pw0 = (tile_x * FCP_TX + tx) * FCP_PW;
  const int iy0 = tile_y * FCP_TY * FCP_RPT * FCP_P * FCP_S;
  const int ix0 = tile_x * FCP_TX * FCP_COL_STEP;
  const float* xb = x + b * C * (size_t)H * W;

  auto weight_at = [&](int i, int c0) -> float {
    const int cc = i / FCP_W_TILE, rem = i % FCP_W_TILE;
    const int pq = rem / FCP_MB, m = mb0 + rem % FCP_MB, c = c0 + cc;
    return (c < C && m < M) ? __ldg(&w[((size_t)m * C + c) * (FCP_K * FCP_K) + pq]) : 0.f;
  };

  const bool one_chunk = C <= FCP_CC;  // then the tile is staged once for all RPT rows
  // Rows start on 8-byte boundaries when W and the tile origin are even (conv1, conv2).
  const bool pairs = (W % 2 == 0) && (ix0 % 2 == 0);
  for (int rr = 0; rr < FCP_RPT; ++rr) {
    const int ty_in_tile = rr * FCP_TY + ty;  // pooled row within the block tile
    const int ph = tile_y * FCP_TY * FCP_RPT + ty_in_tile;
    float acc[FCP_MT][FCP_P][FCP_COLS] = {};  // zeros

    for (int c0 = 0; c0 < C; c0 += FCP_CC) {
      if (rr == 0 || !one_chunk) {
        __syncthreads();  // the previous pass is done reading the tile
        fcp_stage_tile(in_s, x, xb, c0, C, H, W, iy0, ix0, tid, pairs);
#define FCP_W_AT(i) weight_at(i, c0)
        FCP_STAGE(FCP_CC * FCP_W_TILE, tid, w_s, FCP_W_AT)
#undef FCP_W_AT
        cp_async_wait_all();
        __syncthreads();
      }
      const int cc_n = min(FCP_CC, C - c0);
      for (int cc = 0; cc < cc_n; ++cc) {
        const float* in_t = in_s + cc * FCP_IN_TILE +
                            (ty_in_tile * FCP_P * FCP_S) * FCP_IN_STRIDE + tx * FCP_COL_STEP;
        fcp_accumulate(acc, in_t, FcpSmemWeights{w_s + cc * FCP_W_TILE + tz * FCP_MT});
      }
    }

    fcp_store(acc, bias, y, b, M, m0, Hp, Wp, ph, pw0);
  }
}

// One thread per pooled output (b, m, ph, pw); every size is a run-time argument.
extern "C" __global__ void fcp_simple(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ bias, float* __restrict__ y,
                                      long long total, int C, int H, int W, int M, int K, int S,
                                      int P, int Hp, int Wp) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int pw = i % Wp, ph = (i / Wp) % Hp, m = (i / ((long long)Wp * Hp)) % M;
    const size_t b = i / ((long long)Wp * Hp * M);
    float mx = CONVOLAB_NEG_INF;
    for (int dy = 0; dy < P; ++dy)
      for (int dx = 0; dx < P; ++dx) {
        const int oh = ph * P + dy, ow = pw * P + dx;
        float acc = 0.f;
        for (int c = 0; c < C; ++c)
          for (int p = 0; p < K; ++p)
            for (int q = 0; q < K; ++q)
              acc = fmaf(x[((b * C + c) * H + oh * S + p) * (size_t)W + ow * S + q],
                         w[(((size_t)m * C + c) * K + p) * K + q], acc);
        mx = fmax_nan(mx, acc);
      }
    y[i] = fmax_nan(mx + bias[m], 0.f);
  }
}

