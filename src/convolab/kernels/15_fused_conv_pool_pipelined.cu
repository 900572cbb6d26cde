// Rung 15 — fused-conv-pool, pipelined: fcp_exact_pipe. Same tiles and arithmetic as rung 13's
// fcp_exact; changes how tiles are scheduled. The kernel is persistent (a block loops over
// (image, tile) tasks) and double-buffered: it issues the cp.async copy of task t + gridDim.x
// into the other buffer before it computes task t. Single-chunk tiles only (all C channels
// fit one buffer).
//
// Why: fcp_exact stages its whole tile and then waits for it, so each block's warps issue no
// FFMA for a DRAM round trip plus the copy of every image. conv2 runs one 8-warp block per SM
// (191 registers x 256 threads), so nothing hides that bubble; here the copy lands under ~10^4
// FFMAs per thread, and the weights are staged once per block instead of once per image.
// For conv1 (4 blocks per SM already overlap each other's staging) the second buffer costs
// more than it hides unless the weights live in registers (FCP_WREG=1, no weight loads at
// all): the default for conv1-like layers whose C*K*K weights fit the register budget.
// Measured: conv2 1.397 ms vs 1.449 fcp_exact; conv1 (FCP_WREG) 0.670 vs 0.696 (H100, B=10000).
//
// Launch: dynamic shared memory 2 * FCP_BUF (+ FCP_CC * FCP_W_TILE without FCP_WREG) floats.

#include "fused_conv_pool.cuh"

#ifndef FCP_WREG
#define FCP_WREG 0  // 1 = the thread's CC*K*K*MT weights live in registers
#endif

#define FCP_BUF (FCP_CC * FCP_IN_TILE)  // floats of one input buffer (a multiple of 4)

#if FCP_WREG
// Weights in registers: wr[pq][m] of one input channel, indices compile-time after unrolling.
struct FcpRegWeights {
  const float (&wr)[FCP_K * FCP_K][FCP_MT];
  __device__ __forceinline__ void operator()(int p, int q, float (&wv)[FCP_MT]) const {
#pragma unroll
    for (int m = 0; m < FCP_MT; ++m) wv[m] = wr[p * FCP_K + q][m];
  }
};
#endif

extern "C" __global__ void __launch_bounds__(FCP_THREADS, FCP_MINB)
fcp_exact_pipe(const float* __restrict__ x, const float* __restrict__ w,
               const float* __restrict__ bias, float* __restrict__ y, int C, int H, int W,
               int M, int Hp, int Wp, int tiles_w, int tiles_per_image, int tasks) {
  // [buffer 0][buffer 1][weights (shared-memory variant)]: 2 * FCP_BUF (+ FCP_CC * FCP_W_TILE)
  extern __shared__ __align__(16) float fcp_smem[];
  float* const w_s = fcp_smem + 2 * FCP_BUF;
  const int mb0 = blockIdx.y * FCP_MB;
  const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
  const int m0 = mb0 + tz * FCP_MT;
  const int tid = (tz * FCP_TY + ty) * FCP_TX + tx;

  auto stage = [&](int task, float* buf) {
    const int tile = task % tiles_per_image;
    const size_t b = task / tiles_per_image;
    const int iy0 = (tile / tiles_w) * FCP_TY * FCP_RPT * FCP_P * FCP_S;
    const int ix0 = (tile % tiles_w) * FCP_TX * FCP_COL_STEP;
    fcp_stage_tile(buf, x, x + b * C * (size_t)H * W, 0, C, H, W, iy0, ix0, tid,
                   (W % 2 == 0) && (ix0 % 2 == 0));
  };
  int t = blockIdx.x;
  if (t < tasks) stage(t, fcp_smem);
  cp_async_commit();

#if FCP_WREG
  float wr[FCP_CC][FCP_K * FCP_K][FCP_MT];
#pragma unroll
  for (int cc = 0; cc < FCP_CC; ++cc)
#pragma unroll
    for (int pq = 0; pq < FCP_K * FCP_K; ++pq)
#pragma unroll
      for (int m = 0; m < FCP_MT; ++m)
        wr[cc][pq][m] = (cc < C && m0 + m < M)
                            ? __ldg(&w[((size_t)(m0 + m) * C + cc) * (FCP_K * FCP_K) + pq])
                            : 0.f;
#else
  auto weight_at = [&](int i) -> float {
    const int cc = i / FCP_W_TILE, rem = i % FCP_W_TILE;
    const int pq = rem / FCP_MB, m = mb0 + rem % FCP_MB;
    return (cc < C && m < M) ? __ldg(&w[((size_t)m * C + cc) * (FCP_K * FCP_K) + pq]) : 0.f;
  };
  FCP_STAGE(FCP_CC * FCP_W_TILE, tid, w_s, weight_at)  // visible after the loop's first barrier
#endif

  for (int k = 0; t < tasks; t += gridDim.x, k ^= 1) {
    const int next = t + gridDim.x;
    if (next < tasks) stage(next, fcp_smem + (k ^ 1) * FCP_BUF);  // read last iteration
    cp_async_commit();
    cp_async_wait<1>();  // task t's copy has landed
    __syncthreads();

    const float* in_s = fcp_smem + k * FCP_BUF;
    const int tile = t % tiles_per_image;
    const size_t b = t / tiles_per_image;
    const int tile_y = tile / tiles_w, tile_x = tile % tiles_w;
    const int pw0 = (tile_x * FCP_TX + tx) * FCP_PW;
    for (int rr = 0; rr < FCP_RPT; ++rr) {
      const int ty_in_tile = rr * FCP_TY + ty;
      float acc[FCP_MT][FCP_P][FCP_COLS] = {};  // zeros
      const float* in_t =
          in_s + (ty_in_tile * FCP_P * FCP_S) * FCP_IN_STRIDE + tx * FCP_COL_STEP;
#if FCP_WREG
#pragma unroll
      for (int cc = 0; cc < FCP_CC; ++cc)  // unrolled: wr[cc] must be a compile-time index
        if (cc < C) fcp_accumulate(acc, in_t + cc * FCP_IN_TILE, FcpRegWeights{wr[cc]});
#else
      for (int cc = 0; cc < C; ++cc)
        fcp_accumulate(acc, in_t + cc * FCP_IN_TILE,
                       FcpSmemWeights{w_s + cc * FCP_W_TILE + tz * FCP_MT});
#endif
      fcp_store(acc, bias, y, b, M, m0, Hp, Wp, tile_y * FCP_TY * FCP_RPT + ty_in_tile, pw0);
    }
    __syncthreads();  // everyone is done with buffer k before the next iteration refills it
  }
}
