// Shared by the FFMA fused conv+pool kernels (13, 15, 16): the compile-time tile geometry, the
// cp.async staging of an input tile, the register-tiled accumulate loop and the pooled store.
// The kernels differ only in where their weights come from and how they schedule tiles.
//
// A thread owns FCP_MT output channels x FCP_PW whole pool windows of one pooled row: the
// P*P convolution outputs of a window stay in registers and only the pooled value is written.
// Everything that shapes the unrolled loops is a define; B, C, H, W, M are run-time arguments.
#pragma once

#include "common.cuh"
#include "resize.cuh"

#ifndef FCP_K
#define FCP_K 7  // filter size
#endif
#ifndef FCP_S
#define FCP_S 1  // convolution stride
#endif
#ifndef FCP_P
#define FCP_P 2  // pool window and pool stride
#endif
#ifndef FCP_MT
#define FCP_MT 4  // output channels per thread
#endif
#ifndef FCP_PW
#define FCP_PW 2  // pooled columns per thread
#endif
#ifndef FCP_TX
#define FCP_TX 20  // threads across a tile (each PW pooled columns)
#endif
#ifndef FCP_TY
#define FCP_TY 8  // threads down a tile (each one pooled row)
#endif
#ifndef FCP_CC
#define FCP_CC 1  // input channels staged in shared memory per pass
#endif

#ifndef FCP_MINB
#define FCP_MINB 1  // blocks per SM the register allocation must allow (caps registers)
#endif
#ifndef FCP_MG
#define FCP_MG 1  // channel groups per block (threadIdx.z): they share one staged input tile
#endif
#ifndef FCP_RPT
#define FCP_RPT 1  // tile rows of TY pooled rows a block walks through (only when CC >= C)
#endif

#define FCP_THREADS (FCP_TX * FCP_TY * FCP_MG)
#ifndef FCP_STAGE_UNROLL
#define FCP_STAGE_UNROLL 8  // global loads each thread keeps in flight while staging
#endif

#define FCP_COLS (FCP_PW * FCP_P)                            // conv columns per thread
#define FCP_SPAN ((FCP_COLS - 1) * FCP_S + FCP_K)            // input columns a thread reads
#define FCP_SPAN4 ((FCP_SPAN + 3) / 4 * 4)                   // ... rounded up for float4 loads
#define FCP_ROWS_T ((FCP_P - 1) * FCP_S + FCP_K)             // input rows one thread reads
#define FCP_IN_ROWS ((FCP_TY * FCP_RPT * FCP_P - 1) * FCP_S + FCP_K)  // rows of a block tile
#define FCP_COL_STEP (FCP_COLS * FCP_S)                      // input columns between threads
#define FCP_VEC_ROWS ((FCP_COL_STEP % 4) == 0)               // row loads can be float4
#define FCP_IN_STRIDE ((((FCP_TX - 1) * FCP_COL_STEP + FCP_SPAN4) + 3) / 4 * 4)
#define FCP_IN_TILE (FCP_IN_ROWS * FCP_IN_STRIDE)
#define FCP_MB (FCP_MT * FCP_MG)  // output channels of a block
#define FCP_W_TILE (FCP_K * FCP_K * FCP_MB)

// Copy n floats (index -> value function) into shared memory with FCP_STAGE_UNROLL
// independent global loads in flight per thread: a plain strided loop waits out one full
// memory latency per element (half of fcp_exact's time, docs/fused.md).
#define FCP_STAGE(n, tid, DST, VALUE_AT)                                          \
  for (int base_ = (tid); base_ < (n); base_ += FCP_THREADS * FCP_STAGE_UNROLL) { \
    float v_[FCP_STAGE_UNROLL];                                                   \
    _Pragma("unroll") for (int u_ = 0; u_ < FCP_STAGE_UNROLL; ++u_) {             \
      const int i_ = base_ + u_ * FCP_THREADS;                                    \
      v_[u_] = i_ < (n) ? VALUE_AT(i_) : 0.f;                                     \
    }                                                                             \
    _Pragma("unroll") for (int u_ = 0; u_ < FCP_STAGE_UNROLL; ++u_) {             \
      const int i_ = base_ + u_ * FCP_THREADS;                                    \
      if (i_ < (n)) DST[i_] = v_[u_];                                             \
    }                                                                             \
  }

// The input tile (FCP_CC channels from c0, rows iy0.., columns ix0..) -> dst with cp.async
// (no register round trip, every copy of the thread in flight at once; out-of-image elements
// are zero-filled). The caller commits/waits.
__device__ __forceinline__ void fcp_stage_tile(float* dst, const float* x, const float* xb,
                                               int c0, int C, int H, int W, int iy0, int ix0,
                                               int tid, bool pairs) {
  if (pairs) {  // 8-byte copies: half the copies and half the index arithmetic
    constexpr int HS = FCP_IN_STRIDE / 2, NP = FCP_CC * FCP_IN_ROWS * HS;
    for (int i = tid; i < NP; i += FCP_THREADS) {
      const int row = i / HS, p2 = i - row * HS;
      const int cc = FCP_CC == 1 ? 0 : row / FCP_IN_ROWS, r = row - cc * FCP_IN_ROWS;
      const int c = c0 + cc, gy = iy0 + r, gx = ix0 + 2 * p2;
      const bool inside = c < C && gy < H && gx < W;  // W even: gx + 1 < W too
      cp_async8(&dst[row * FCP_IN_STRIDE + 2 * p2],
                inside ? &xb[((size_t)c * H + gy) * W + gx] : x, inside);
    }
  } else {
    for (int i = tid; i < FCP_CC * FCP_IN_TILE; i += FCP_THREADS) {
      const int cc = i / FCP_IN_TILE, rem = i % FCP_IN_TILE;
      const int r = rem / FCP_IN_STRIDE, col = rem % FCP_IN_STRIDE;
      const int c = c0 + cc, gy = iy0 + r, gx = ix0 + col;
      const bool inside = c < C && gy < H && gx < W;
      cp_async4(&dst[i], inside ? &xb[((size_t)c * H + gy) * W + gx] : x, inside);
    }
  }
}

// The input tile resized out of a raw image already staged as floats (`unit`, RAW_H x RAW_W):
// one channel, rows iy0.., columns ix0.. of the H x W image the convolution sees, zero
// outside it; `rows` (FCP_IN_ROWS x RAW_W floats) takes the row pass. The caller synchronises.
__device__ __forceinline__ void fcp_stage_resized_tile(float* dst, float* rows, const float* unit,
                                                       const ResizeTap* __restrict__ taps, int H,
                                                       int W, int iy0, int ix0, int tid) {
  resize_rows(rows, unit, taps, iy0, FCP_IN_ROWS, H, tid, FCP_THREADS);
  __syncthreads();
  for (int i = tid; i < FCP_IN_TILE; i += FCP_THREADS) {
    const int r = i / FCP_IN_STRIDE, col = i - r * FCP_IN_STRIDE;
    const int gy = iy0 + r, gx = ix0 + col;
    dst[i] = (gy < H && gx < W) ? resized_from_row(rows + r * RAW_W, taps[H + gx]) : 0.f;
  }
}

// acc += one staged input channel's contribution to the thread's pool windows. in_t: the
// thread's first input pixel; weights_at(p, q, wv) fills wv[m] = w[m0 + m][c][p][q].
// Every FFMA fused kernel runs this loop; they differ in where the weights come from.
template <typename WeightsAt>
__device__ __forceinline__ void fcp_accumulate(float (&acc)[FCP_MT][FCP_P][FCP_COLS],
                                               const float* in_t, WeightsAt weights_at) {
#pragma unroll
  for (int r = 0; r < FCP_ROWS_T; ++r) {
    float row[FCP_SPAN4];
#if FCP_VEC_ROWS
#pragma unroll
    for (int v = 0; v < FCP_SPAN4 / 4; ++v) {
      const float4 f = *reinterpret_cast<const float4*>(in_t + r * FCP_IN_STRIDE + 4 * v);
      row[4 * v] = f.x; row[4 * v + 1] = f.y; row[4 * v + 2] = f.z; row[4 * v + 3] = f.w;
    }
#else
#pragma unroll
    for (int v = 0; v < FCP_SPAN; ++v) row[v] = in_t[r * FCP_IN_STRIDE + v];
#endif
#pragma unroll
    for (int dy = 0; dy < FCP_P; ++dy) {
      const int p = r - dy * FCP_S;  // kernel row linking input row r to pool row dy
      if (p < 0 || p >= FCP_K) continue;
#pragma unroll
      for (int q = 0; q < FCP_K; ++q) {
        float wv[FCP_MT];
        weights_at(p, q, wv);
#pragma unroll
        for (int j = 0; j < FCP_COLS; ++j)
#pragma unroll
          for (int m = 0; m < FCP_MT; ++m)
            acc[m][dy][j] = fmaf(row[j * FCP_S + q], wv[m], acc[m][dy][j]);
      }
    }
  }
}

// Weights from shared memory, [c][p][q][MB]: one broadcast float4 per 4 channels.
struct FcpSmemWeights {
  const float* w_c;  // this channel's weights + the thread's first channel
  __device__ __forceinline__ void operator()(int p, int q, float (&wv)[FCP_MT]) const {
#if (FCP_MT % 4) == 0
#pragma unroll
    for (int v = 0; v < FCP_MT / 4; ++v) {
      const float4 f = *reinterpret_cast<const float4*>(w_c + (p * FCP_K + q) * FCP_MB + 4 * v);
      wv[4 * v] = f.x; wv[4 * v + 1] = f.y; wv[4 * v + 2] = f.z; wv[4 * v + 3] = f.w;
    }
#else
#pragma unroll
    for (int m = 0; m < FCP_MT; ++m) wv[m] = w_c[(p * FCP_K + q) * FCP_MB + m];
#endif
  }
};

// max(acc) + b == max(acc + b) exactly (rounding is monotonic); ReLU commutes with max.
__device__ __forceinline__ void fcp_store(const float (&acc)[FCP_MT][FCP_P][FCP_COLS],
                                          const float* __restrict__ bias, float* __restrict__ y,
                                          size_t b, int M, int m0, int Hp, int Wp, int ph,
                                          int pw0) {
  if (ph < Hp) {
#pragma unroll
    for (int m = 0; m < FCP_MT; ++m) {
      if (m0 + m >= M) break;
      const float bm = __ldg(&bias[m0 + m]);
#pragma unroll
      for (int k = 0; k < FCP_PW; ++k) {
        if (pw0 + k >= Wp) break;
        float mx = acc[m][0][k * FCP_P];
#pragma unroll
        for (int dy = 0; dy < FCP_P; ++dy)
#pragma unroll
          for (int dx = 0; dx < FCP_P; ++dx) mx = fmax_nan(mx, acc[m][dy][k * FCP_P + dx]);
        y[((b * M + m0 + m) * Hp + ph) * (size_t)Wp + pw0 + k] = fmax_nan(mx + bm, 0.f);
      }
    }
  }
}
