// Rung 7 — register tiling + shared-memory tiling + thread coarsening.
// Rung 6 computes one output per thread and pays two shared-memory loads per FMA; in the
// ece408 layers M is tiny (4 and 16), so a square GEMM tile also wastes most of its rows on M
// padding. Here the GEMM is tiled to the layer instead: a block's M-extent is TM output
// channels (TM = 4, 8 or 16 picked >= M, so conv1 and conv2 pad nothing) and its N-extent is a
// (BY*TN) x BX patch of output pixels of one image. Each thread computes TM channels x TN
// vertically adjacent pixels held in registers (acc[TM][TN]). Per channel chunk (the GEMM's BK
// = CCH*K*K), the block stages the input patch + halo and the weights in shared memory; then
// for each (c, q) a thread loads one input column strip of (TN-1)*S+K values into registers
// and reuses each value for up to K*TM FMAs, while the weights for all TM channels arrive as
// float4 broadcasts. Per strip that is K*TN*TM FMAs against (TN-1)*S+K + K*TM/4 loads, so the
// SM runs near its FMA rate instead of its load/store rate. conv2 (TM=16, TN=2): 224 FMAs per
// 36 loads. conv1 (C=1, M=4: TM=4, TN=8): 224 FMAs per 21 loads; with a single channel every
// block is one short load-compute-store burst and 1.3 GB must cross DRAM, so conv1 is bound by
// memory latency/bandwidth more than by FMAs (H100: 1.17 ms = 1.1 TB/s and 21 TFLOP/s).
// Threads are laid out along output columns, so neighbouring lanes read neighbouring shared-
// memory words (no bank conflicts at stride 1) and write coalesced rows of y.
// Staging uses cp.async (global -> shared without passing through registers, zero-fill for
// the padding): a plain load-then-store loop waits out one DRAM latency per element, which
// cost 1.35x on both ece408 layers (H100). The host pre-arranges the weights as
// [M/TM][C][q][p][TM] so their staging is a straight 16-byte copy.
// conv_register_tiled_pipelined (PIPE=1 on the host) is the same computation in persistent
// blocks that walk many tiles with two shared-memory buffers, copying the next tile while
// computing this one. Measured, it loses (conv1 1.28 vs 1.17 ms, conv2 3.31 vs 2.73 ms on
// H100): the one-shot kernel already hides DRAM latency with 5-6 resident blocks per SM, and
// the second buffer halves the channels staged per pass. It stays as a tuner option.
// Compile-time: KSIZE, TM, TN, QUNROLL and STRIDE (0 = stride passed at run time: the strip
// then reads shared memory per tap instead of registers, still correct for any S).
#include "common.cuh"

#ifndef KSIZE
#define KSIZE 7
#endif
#ifndef STRIDE
#define STRIDE 1
#endif
#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 8
#endif
#ifndef QUNROLL
#define QUNROLL 0  // 1: unroll the q loop too (next strip's loads overlap this one's FMAs)
#endif
#ifndef MAX_THREADS
#define MAX_THREADS 256
#endif

#if TM % 4 != 0
#error "TM must be a multiple of 4 (weights are read as float4)"
#endif

struct Tile {
  int b, ho0, wo0;
};

__device__ __forceinline__ Tile tile_at(long long t, int tiles_w, int tiles_per_image, int by) {
  const int b = (int)(t / tiles_per_image), tile = (int)(t % tiles_per_image);
  return Tile{b, (tile / tiles_w) * by * TN, (tile % tiles_w) * (int)blockDim.x};
}

// Issue the cp.async copies of one channel chunk [c0, c0+nc) of a tile into s_w / s_in.
// Out-of-range input (only the padding rows/columns of edge tiles) becomes zero so the
// compute loop needs no bounds checks; those outputs are never stored.
__device__ __forceinline__ void stage_chunk(const float* __restrict__ x,
                                            const float* __restrict__ w_arranged, float* s_w,
                                            float* s_in, Tile t, int c0, int nc, int C, int H,
                                            int W, int S, int in_rows, int in_cols) {
  constexpr int KK = KSIZE * KSIZE;
  const int bx = blockDim.x, by = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * bx + tx, nthreads = bx * by;
  // Weights of this chunk: one contiguous, 16-byte aligned run of w_arranged (zero-padded
  // for channels m >= M by the host).
  const float* w_src = w_arranged + ((size_t)blockIdx.y * C + c0) * KK * TM;
  for (int i = tid; i < nc * KK * TM / 4; i += nthreads) cp_async16(s_w + 4 * i, w_src + 4 * i);
  const int hi0 = t.ho0 * S, wi0 = t.wo0 * S;
  for (int cl = 0; cl < nc; ++cl) {
    const float* x_c = x + ((size_t)t.b * C + c0 + cl) * H * (size_t)W;
    float* dst = s_in + cl * in_rows * in_cols;
    for (int r = ty; r < in_rows; r += by) {
      const int hi = hi0 + r;
      for (int col = tx; col < in_cols; col += bx) {
        const int wi = wi0 + col;
        const bool valid = hi < H && wi < W;
        cp_async4(dst + r * in_cols + col, valid ? x_c + (size_t)hi * W + wi : x, valid);
      }
    }
  }
}

// acc[m][j] += sum over the staged channels, p, q of input * weight (see the header).
__device__ __forceinline__ void accumulate_chunk(const float* s_w, const float* s_in, int nc,
                                                 int S, int in_rows, int in_cols,
                                                 float (&acc)[TM][TN]) {
  constexpr int KK = KSIZE * KSIZE;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int cl = 0; cl < nc; ++cl) {
    const float* in_c = s_in + ((size_t)cl * in_rows + ty * TN * S) * in_cols + tx * S;
    const float4* w_c = reinterpret_cast<const float4*>(s_w + cl * KK * TM);
#if QUNROLL
#pragma unroll
#else
#pragma unroll 1
#endif
    for (int q = 0; q < KSIZE; ++q) {
#if STRIDE > 0
      float strip[(TN - 1) * STRIDE + KSIZE];
#pragma unroll
      for (int i = 0; i < (TN - 1) * STRIDE + KSIZE; ++i) strip[i] = in_c[i * in_cols + q];
#define CONVOLAB_TAP(j, p) strip[(j) * STRIDE + (p)]
#else
#define CONVOLAB_TAP(j, p) in_c[((j) * S + (p)) * in_cols + q]
#endif
#pragma unroll
      for (int p = 0; p < KSIZE; ++p) {
        float wv[TM];
#pragma unroll
        for (int v = 0; v < TM / 4; ++v) {
          const float4 f = w_c[(q * KSIZE + p) * (TM / 4) + v];
          wv[4 * v] = f.x;
          wv[4 * v + 1] = f.y;
          wv[4 * v + 2] = f.z;
          wv[4 * v + 3] = f.w;
        }
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const float in = CONVOLAB_TAP(j, p);
#pragma unroll
          for (int mm = 0; mm < TM; ++mm) acc[mm][j] = fmaf(in, wv[mm], acc[mm][j]);
        }
      }
#undef CONVOLAB_TAP
    }
  }
}

__device__ __forceinline__ void store_tile(float* __restrict__ y, const float* __restrict__ bias,
                                           const float (&acc)[TM][TN], Tile t, int M, int Ho,
                                           int Wo) {
  const int wo = t.wo0 + threadIdx.x, m0 = blockIdx.y * TM;
  if (wo >= Wo) return;
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    const int ho = t.ho0 + threadIdx.y * TN + j;
#pragma unroll
    for (int mm = 0; mm < TM; ++mm) {
      const int m = m0 + mm;
      if (ho < Ho && m < M) CONVOLAB_Y_AT(y, t.b, m, ho, wo, M, Ho, Wo) = acc[mm][j] + bias[m];
    }
  }
}

__device__ __forceinline__ void zero(float (&acc)[TM][TN]) {
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
}

// One block per (tile, channel group): grid (B * tiles_per_image, ceil(M / TM)).
extern "C" __global__ void __launch_bounds__(MAX_THREADS)
conv_register_tiled(const float* __restrict__ x, const float* __restrict__ w_arranged,
                    const float* __restrict__ bias, float* __restrict__ y,
                    int B, int C, int H, int W, int M, int stride, int Ho, int Wo,
                    int cch, int tiles_w, int tiles_per_image) {
  extern __shared__ float4 smem4[];
  const int S = STRIDE > 0 ? STRIDE : stride;
  const int in_rows = ((int)blockDim.y * TN - 1) * S + KSIZE;
  const int in_cols = ((int)blockDim.x - 1) * S + KSIZE;
  // [cch][q][p][TM]: for a fixed (c, q) the K*TM weights a strip needs are contiguous float4s.
  float* s_w = reinterpret_cast<float*>(smem4);
  float* s_in = s_w + cch * KSIZE * KSIZE * TM;  // [cch][in_rows][in_cols]
  const Tile t = tile_at(blockIdx.x, tiles_w, tiles_per_image, blockDim.y);

  float acc[TM][TN];
  zero(acc);
  for (int c0 = 0; c0 < C; c0 += cch) {
    const int nc = min(cch, C - c0);
    stage_chunk(x, w_arranged, s_w, s_in, t, c0, nc, C, H, W, S, in_rows, in_cols);
    cp_async_wait_all();
    __syncthreads();
    accumulate_chunk(s_w, s_in, nc, S, in_rows, in_cols, acc);
    __syncthreads();
  }
  store_tile(y, bias, acc, t, M, Ho, Wo);
}

// Persistent blocks: grid (a few waves of resident blocks, ceil(M / TM)); block i takes tiles
// i, i + gridDim.x, ... Work is a flat list of stages (tile, channel chunk); stage s+1 is
// copied into the other buffer while stage s is computed. buffer_floats (a multiple of 4, so
// both buffers stay 16-byte aligned) = cch * (K*K*TM + in_rows*in_cols) rounded up.
extern "C" __global__ void __launch_bounds__(MAX_THREADS)
conv_register_tiled_pipelined(const float* __restrict__ x, const float* __restrict__ w_arranged,
                              const float* __restrict__ bias, float* __restrict__ y,
                              int B, int C, int H, int W, int M, int stride, int Ho, int Wo,
                              int cch, int tiles_w, int tiles_per_image, int buffer_floats) {
  extern __shared__ float4 smem4[];
  const int S = STRIDE > 0 ? STRIDE : stride;
  const int in_rows = ((int)blockDim.y * TN - 1) * S + KSIZE;
  const int in_cols = ((int)blockDim.x - 1) * S + KSIZE;
  float* buffers = reinterpret_cast<float*>(smem4);
  const int w_floats = cch * KSIZE * KSIZE * TM;
  const int n_chunks = (C + cch - 1) / cch;
  const long long total_tiles = (long long)B * tiles_per_image;
  if ((long long)blockIdx.x >= total_tiles) return;  // whole block: no barrier is skipped
  const long long my_tiles = (total_tiles - 1 - blockIdx.x) / gridDim.x + 1;
  const long long n_stages = my_tiles * n_chunks;

  auto stage = [&](long long s) {
    float* buf = buffers + (s & 1) * buffer_floats;
    const long long t_index = blockIdx.x + (s / n_chunks) * (long long)gridDim.x;
    const int c0 = (int)(s % n_chunks) * cch;
    stage_chunk(x, w_arranged, buf, buf + w_floats,
                tile_at(t_index, tiles_w, tiles_per_image, blockDim.y), c0, min(cch, C - c0),
                C, H, W, S, in_rows, in_cols);
    cp_async_commit();
  };

  float acc[TM][TN];
  zero(acc);
  stage(0);
  for (long long s = 0; s < n_stages; ++s) {
    if (s + 1 < n_stages) {
      stage(s + 1);  // its buffer was released by the barrier that ended stage s - 1
      cp_async_wait<1>();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();
    const float* buf = buffers + (s & 1) * buffer_floats;
    const int chunk = (int)(s % n_chunks), c0 = chunk * cch;
    accumulate_chunk(buf, buf + w_floats, min(cch, C - c0), S, in_rows, in_cols, acc);
    if (chunk == n_chunks - 1) {
      const long long t_index = blockIdx.x + (s / n_chunks) * (long long)gridDim.x;
      store_tile(y, bias, acc, tile_at(t_index, tiles_w, tiles_per_image, blockDim.y), M, Ho, Wo);
      zero(acc);
    }
    __syncthreads();
  }
}
