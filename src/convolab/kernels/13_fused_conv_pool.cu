// Rung 13 — fused-conv-pool: convolution + bias + ReLU + max-pool (window P, stride P, floor)
// in one kernel. Builds on rung 7 (register-tiled): a thread still owns a register tile of
// outputs, but the tile is now whole pool windows, so the P*P convolution outputs of a window
// never leave registers — only the pooled value is written. For the ece408 layers that
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
// Everything that shapes the unrolled loops is a compile-time define; B, C, H, W, M are not.
//
// Kernels:
//   fcp_exact   the register-tiled kernel above (fp32 FFMA, exact to fp32 rounding)
//   fcp_exact_pipe  the same tiles and arithmetic, persistent and double-buffered: a block
//               loops over (image, tile) tasks and stages task t + gridDim.x while it computes
//               task t (single-chunk tiles only: all C channels fit in shared memory);
//               FCP_WREG=1 keeps the thread's weights in registers instead of shared memory
//   fcp_exact_cw    fcp_exact with the weights as a by-value kernel parameter: FFMAs read
//               them straight from the constant bank, no weight loads (conv1-like layers)
//   fcp_simple  one thread per pooled output, straight from global memory: the fallback for
//               pool windows or filters too large to tile in registers (P > 8, K > 15)

// FCP_KERNEL picks the one kernel a host compile needs (NVRTC time is per module):
// 0 all, 1 fcp_exact, 2 fcp_simple, 3 fcp_mma_toe, 4 fcp_mma_wa, 5 fcp_exact_pipe,
// 6 fcp_exact_cw.
#ifndef FCP_KERNEL
#define FCP_KERNEL 0
#endif
#define FCP_WANT(id) (FCP_KERNEL == 0 || FCP_KERNEL == (id))

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
#ifndef FCP_WREG
#define FCP_WREG 0  // fcp_exact_pipe: 1 = the thread's CC*K*K*MT weights live in registers
#endif

#define FCP_NEG_INF (__int_as_float(0xff800000u))
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

#if FCP_WANT(1) || FCP_WANT(5) || FCP_WANT(6)
// Copy n floats (index -> value function) into shared memory with FCP_STAGE_UNROLL
// independent global loads in flight per thread: a plain strided loop waits out one full
// memory latency per element, which in the first version cost half the kernel's time.
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

// 4-byte asynchronous copy global -> shared; src_bytes 0 writes a zero (outside the image:
// lanes there compute discarded outputs, but from finite values).
__device__ __forceinline__ void fcp_cp_async4(float* dst, const float* src, bool valid) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(saddr), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void fcp_cp_async8(float* dst, const float* src, bool valid) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(saddr), "l"(src),
               "r"(valid ? 8 : 0)
               : "memory");
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
      fcp_cp_async8(&dst[row * FCP_IN_STRIDE + 2 * p2],
                    inside ? &xb[((size_t)c * H + gy) * W + gx] : x, inside);
    }
  } else {
    for (int i = tid; i < FCP_CC * FCP_IN_TILE; i += FCP_THREADS) {
      const int cc = i / FCP_IN_TILE, rem = i % FCP_IN_TILE;
      const int r = rem / FCP_IN_STRIDE, col = rem % FCP_IN_STRIDE;
      const int c = c0 + cc, gy = iy0 + r, gx = ix0 + col;
      const bool inside = c < C && gy < H && gx < W;
      fcp_cp_async4(&dst[i], inside ? &xb[((size_t)c * H + gy) * W + gx] : x, inside);
    }
  }
}

// acc += one staged input channel's contribution to the thread's pool windows. in_t: the
// thread's first input pixel; weights_at(p, q, wv) fills wv[m] = w[m0 + m][c][p][q].
// Every FFMA kernel of this file runs this loop; they differ in where the weights come from.
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
          for (int dx = 0; dx < FCP_P; ++dx) mx = fmaxf(mx, acc[m][dy][k * FCP_P + dx]);
        y[((b * M + m0 + m) * Hp + ph) * (size_t)Wp + pw0 + k] = fmaxf(mx + bm, 0.f);
      }
    }
  }
}
#endif

#if FCP_WANT(1)
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
        asm volatile("cp.async.wait_all;\n" ::: "memory");
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
#endif

// ---- fcp_exact_pipe: persistent, double-buffered (single-chunk tiles: C <= FCP_CC) -------
// Why double-buffering helps here: fcp_exact stages its whole tile and then waits for it, so
// each block's warps issue no FFMA for a DRAM round trip plus the copy of every image. conv2
// runs one 8-warp block per SM (191 registers x 256 threads), so nothing hides that bubble;
// here a block issues the cp.async copy of task t + gridDim.x into the other buffer before
// it computes task t, the copy lands under ~10^4 FFMAs per thread, and the weights are
// staged once per block instead of once per image (conv2: 1.449 -> 1.397 ms on H100).
// For conv1 (4 blocks per SM already overlap each other's staging) the second buffer costs
// more than it hides: a block per SM (61 KB each) or registers; only with the weights in
// registers (FCP_WREG, no weight loads at all) is it 1-4 % ahead (gpu/fused.py has numbers).
#if FCP_WANT(5)
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
  asm volatile("cp.async.commit_group;\n" ::: "memory");

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
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // task t's copy has landed
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
#endif

// ---- fcp_exact_cw: the weights as a by-value kernel parameter (FCP_KERNEL 6) -------------
// Why: fcp_exact spends a broadcast float4 shared-memory load on weights for every
// 4 x FCP_COLS FMAs (conv1: 98 loads per 1568 FMAs of a pooled row), and ncu shows its
// shared-memory pipe, not the FMA pipe, setting the pace. Kernel parameters live in the
// constant bank, and an FFMA can take a constant-bank operand directly when every lane reads
// the same address, so weights passed by value cost no instruction at all: the inner loop
// becomes 3 row loads per input row and FFMAs. It needs every weight index to be a
// compile-time constant (C == FCP_CC, all M channels in one thread: FCP_MG == 1, grid.y == 1)
// and the weights to fit the 4 KB parameter space: conv1-like layers.
#if FCP_WANT(6)
struct FcpParamWeights {
  float w[FCP_CC][FCP_K * FCP_K][FCP_MT];  // [c][p * K + q][m]
};

struct FcpConstWeights {
  const float (&wc)[FCP_K * FCP_K][FCP_MT];
  __device__ __forceinline__ void operator()(int p, int q, float (&wv)[FCP_MT]) const {
#pragma unroll
    for (int m = 0; m < FCP_MT; ++m) wv[m] = wc[p * FCP_K + q][m];
  }
};

extern "C" __global__ void __launch_bounds__(FCP_THREADS, FCP_MINB)
fcp_exact_cw(const float* __restrict__ x, const FcpParamWeights wp,
             const float* __restrict__ bias, float* __restrict__ y, int C, int H, int W, int M,
             int Hp, int Wp, int tiles_w, int tiles_per_image) {
  static_assert(FCP_MG == 1, "fcp_exact_cw: one channel group per block");
  static_assert(sizeof(FcpParamWeights) <= 3900, "fcp_exact_cw: weights exceed the 4 KB params");
  __shared__ __align__(16) float in_s[FCP_CC * FCP_IN_TILE];
  const int tile = blockIdx.x % tiles_per_image;
  const size_t b = blockIdx.x / tiles_per_image;
  const int tile_y = tile / tiles_w, tile_x = tile % tiles_w;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * FCP_TX + tx;
  const int pw0 = (tile_x * FCP_TX + tx) * FCP_PW;
  const int iy0 = tile_y * FCP_TY * FCP_RPT * FCP_P * FCP_S;
  const int ix0 = tile_x * FCP_TX * FCP_COL_STEP;
  fcp_stage_tile(in_s, x, x + b * C * (size_t)H * W, 0, C, H, W, iy0, ix0, tid,
                 (W % 2 == 0) && (ix0 % 2 == 0));
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  for (int rr = 0; rr < FCP_RPT; ++rr) {
    const int ty_in_tile = rr * FCP_TY + ty;
    float acc[FCP_MT][FCP_P][FCP_COLS] = {};  // zeros
    const float* in_t = in_s + (ty_in_tile * FCP_P * FCP_S) * FCP_IN_STRIDE + tx * FCP_COL_STEP;
#pragma unroll
    for (int cc = 0; cc < FCP_CC; ++cc)  // C == FCP_CC: every weight index is a constant
      fcp_accumulate(acc, in_t + cc * FCP_IN_TILE, FcpConstWeights{wp.w[cc]});
    fcp_store(acc, bias, y, b, M, 0, Hp, Wp, tile_y * FCP_TY * FCP_RPT + ty_in_tile, pw0);
  }
}
#endif

// One thread per pooled output (b, m, ph, pw); every size is a run-time argument.
#if FCP_WANT(2)
extern "C" __global__ void fcp_simple(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ bias, float* __restrict__ y,
                                      long long total, int C, int H, int W, int M, int K, int S,
                                      int P, int Hp, int Wp) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int pw = i % Wp, ph = (i / Wp) % Hp, m = (i / ((long long)Wp * Hp)) % M;
    const size_t b = i / ((long long)Wp * Hp * M);
    float mx = FCP_NEG_INF;
    for (int dy = 0; dy < P; ++dy)
      for (int dx = 0; dx < P; ++dx) {
        const int oh = ph * P + dy, ow = pw * P + dx;
        float acc = 0.f;
        for (int c = 0; c < C; ++c)
          for (int p = 0; p < K; ++p)
            for (int q = 0; q < K; ++q)
              acc = fmaf(x[((b * C + c) * H + oh * S + p) * (size_t)W + ow * S + q],
                         w[(((size_t)m * C + c) * K + p) * K + q], acc);
        mx = fmaxf(mx, acc);
      }
    y[i] = fmaxf(mx + bias[m], 0.f);
  }
}

#endif

// =============================================================================================
// Tensor-core variants (fused-conv-pool*-tc / -tf32): the same fusion on mma.sync.
//
// Two mappings, because the two ece408 layers have opposite shapes:
//  * fcp_mma_wa (conv2: M=16 output channels): weights are the 16-row A operand and stay in
//    registers for the whole kernel; B is the implicit im2col of the input (8 positions per
//    n-tile), gathered straight from the shared-memory tile. The GEMM k axis is the filter
//    taps with each filter row padded to 8 columns (q = 7 has weight 0), so a k pair
//    (2t, 2t+1) is two adjacent input pixels: one 32-bit shared load. Pixel pairs starting at
//    an odd column are read from a second copy of the tile shifted by one element.
//    Positions are ordered so that a pool window's outputs sit in lanes of one quad (pool 2)
//    or in two n-tiles of one quad (pool 4): pooling is a max over registers and 1-2 shuffles.
//  * fcp_mma_toe (conv1: M=4, C=1): an M=16 weight operand would waste 3/4 of every MMA, so
//    rows are output positions instead. Each row is a run of 8 adjacent outputs and the
//    weights enter as a banded (Toeplitz) 16x8 matrix per filter row: row of input pixels
//    ow0..ow0+15 times T[j][dx] = w[j - dx] gives the 8 outputs ow0+dx. Rows g and g+8 are
//    vertically adjacent outputs and columns 2t, 2t+1 horizontally adjacent, so a 2x2 pool
//    window is exactly the 4 accumulators one lane holds: no shuffles at all.
// TC_PREC 0: fp16 inputs, m16n8k16; 1: tf32 inputs (rounded rna), m16n8k8. Accumulate fp32.
// Fragment-ordered weights are prepared on the host (gpu/fused.py) and loaded once per warp.
// =============================================================================================

#include <cuda_fp16.h>

#ifndef TC_PREC
#define TC_PREC 0
#endif
#ifndef TC_C
#define TC_C 1
#endif
#ifndef TC_K
#define TC_K 7
#endif
#ifndef TC_P
#define TC_P 2
#endif
#ifndef TC_M
#define TC_M 4
#endif
#ifndef TC_TPH
#define TC_TPH 8  // pooled rows per block
#endif
#ifndef TC_TPW
#define TC_TPW 40  // pooled columns per block
#endif
#ifndef TC_WARPS
#define TC_WARPS 4
#endif
#ifndef TC_MINB
#define TC_MINB 1
#endif
#ifndef TC_OUT_CL
// 1: fcp_mma_toe writes its pooled map as fp16 channels-last [b][ph][pw][TC_M] instead of fp32
// NCHW. The fused network's fp16 path uses it: half the bytes out, and the next layer can
// stage it with plain 16-byte copies (kernels/16_lenet_tc_cl.cu).
#define TC_OUT_CL 0
#endif

#define TC_THREADS (TC_WARPS * 32)
#ifndef TC_STAGE_UNROLL
#define TC_STAGE_UNROLL 16  // global loads in flight per thread while staging
#endif

#if TC_PREC == 0
typedef __half tc_elem;
#else
typedef float tc_elem;
#endif

#define TC_R (TC_C * TC_K)  // filter rows (c, p): one (fp16) or two (tf32) k-steps each

__device__ __forceinline__ void tc_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                       unsigned a3, unsigned b0, unsigned b1) {
#if TC_PREC == 0
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ tc_elem tc_convert(float v) {
#if TC_PREC == 0
  return __float2half_rn(v);
#else
  unsigned u;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(v));
  return __uint_as_float(u);
#endif
}

// Two adjacent input values -> shared memory in the kernel's element type (4/8-byte store).
__device__ __forceinline__ void tc_store2(tc_elem* dst, float a, float b) {
#if TC_PREC == 0
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
#else
  *reinterpret_cast<float2*>(dst) = make_float2(tc_convert(a), tc_convert(b));
#endif
}

// x[gx], x[gx+1] of one input row (zero past W); one 8-byte load when the row allows it.
__device__ __forceinline__ float2 tc_load2(const float* row, int gx, int W, bool vec) {
  float2 v = make_float2(0.f, 0.f);
  if (vec) {
    if (gx < W) v = __ldg(reinterpret_cast<const float2*>(row + gx));  // W even
  } else {
    if (gx < W) v.x = __ldg(row + gx);
    if (gx + 1 < W) v.y = __ldg(row + gx + 1);
  }
  return v;
}

template <typename T>
__device__ __forceinline__ unsigned tc_ld32(const T* p) {
  return *reinterpret_cast<const unsigned*>(p);
}

// ---- conv1-style: positions as rows, banded weights as B --------------------------------------
#define TOE_NG ((2 * TC_TPW + 7) / 8)          // 8-wide output runs per pooled-row pair
#define TOE_IR ((TC_TPH * 2 - 1) + TC_K)      // input rows of the tile
#define TOE_RS (TOE_NG * 8 + 8)               // input columns (j reaches ow0 + 15)
#define TOE_COMBOS (TC_TPH * TOE_NG)          // (pooled row, run) pairs = 8 per m-tile
#define TOE_MTILES ((TOE_COMBOS + 7) / 8)
#if TC_PREC == 0
#define TOE_KSTEPS 1
#else
#define TOE_KSTEPS 2
#endif

#if FCP_WANT(3)
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_MINB)
fcp_mma_toe(const float* __restrict__ x, const uint2* __restrict__ bfrag,
            const float* __restrict__ bias, float* __restrict__ y, int H, int W, int Hp, int Wp,
            int tiles_h) {
  __shared__ __align__(16) tc_elem in_s[TC_C * TOE_IR * TOE_RS];
  const size_t b = blockIdx.x / tiles_h;
  const int tile_y = blockIdx.x % tiles_h;
  const int iy0 = tile_y * TC_TPH * 2;
  // Weight fragments first: their loads overlap the staging below.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint2 bf[TC_R][TOE_KSTEPS][TC_M];
#pragma unroll
  for (int r = 0; r < TC_R; ++r)
#pragma unroll
    for (int h = 0; h < TOE_KSTEPS; ++h)
#pragma unroll
      for (int n = 0; n < TC_M; ++n)
        bf[r][h][n] = __ldg(&bfrag[((r * TOE_KSTEPS + h) * TC_M + n) * 32 + lane]);
  float bm[TC_M];
#pragma unroll
  for (int n = 0; n < TC_M; ++n) bm[n] = __ldg(&bias[n]);
  // Stage the tile in pixel pairs with TC_STAGE_UNROLL loads in flight per thread.
  {
    constexpr int HS = TOE_RS / 2, NP = TC_C * TOE_IR * HS;
    const bool vec = W % 2 == 0;
    for (int base = threadIdx.x; base < NP; base += TC_THREADS * TC_STAGE_UNROLL) {
      float2 v[TC_STAGE_UNROLL];
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        const int row = i / HS, p2 = i - row * HS;
        const int c = TC_C == 1 ? 0 : row / TOE_IR, r = row - c * TOE_IR, gy = iy0 + r;
        v[u] = make_float2(0.f, 0.f);
        if (i < NP && gy < H)
          v[u] = tc_load2(x + ((b * TC_C + c) * H + gy) * (size_t)W, 2 * p2, W, vec);
      }
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        if (i < NP) tc_store2(in_s + 2 * i, v[u].x, v[u].y);  // row * RS + 2 p2 == 2 i
      }
    }
  }
  __syncthreads();

  for (int mt = warp; mt < TOE_MTILES; mt += TC_WARPS) {
    const int combo = min(mt * 8 + g, TOE_COMBOS - 1);
    const int ph_l = combo / TOE_NG, ow0 = (combo % TOE_NG) * 8;
    float acc[TC_M][4];
#pragma unroll
    for (int n = 0; n < TC_M; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int r = 0; r < TC_R; ++r) {
      const int c = r / TC_K, p = r % TC_K;
      const tc_elem* row0 = in_s + (c * TOE_IR + 2 * ph_l + p) * TOE_RS + ow0;
      const tc_elem* row1 = row0 + TOE_RS;
#pragma unroll
      for (int h = 0; h < TOE_KSTEPS; ++h) {
#if TC_PREC == 0
        const unsigned a0 = tc_ld32(row0 + 2 * t), a1 = tc_ld32(row1 + 2 * t);
        const unsigned a2 = tc_ld32(row0 + 2 * t + 8), a3 = tc_ld32(row1 + 2 * t + 8);
#else
        const unsigned a0 = tc_ld32(row0 + 8 * h + t), a1 = tc_ld32(row1 + 8 * h + t);
        const unsigned a2 = tc_ld32(row0 + 8 * h + t + 4), a3 = tc_ld32(row1 + 8 * h + t + 4);
#endif
#pragma unroll
        for (int n = 0; n < TC_M; ++n) tc_mma(acc[n], a0, a1, a2, a3, bf[r][h][n].x, bf[r][h][n].y);
      }
    }
    const int ph = tile_y * TC_TPH + ph_l, pw = ow0 / 2 + t;
    if (mt * 8 + g < TOE_COMBOS && ph_l < TC_TPH && ph < Hp && pw < Wp) {
      float out[TC_M];
#pragma unroll
      for (int n = 0; n < TC_M; ++n) {
        const float v = fmaxf(fmaxf(acc[n][0], acc[n][1]), fmaxf(acc[n][2], acc[n][3]));
        out[n] = fmaxf(v + bm[n], 0.f);
      }
#if TC_OUT_CL
      static_assert(TC_M % 2 == 0, "channels-last fp16 output stores channel pairs");
      __half2* yc = reinterpret_cast<__half2*>(y) + ((b * Hp + ph) * (size_t)Wp + pw) * (TC_M / 2);
#pragma unroll
      for (int n = 0; n < TC_M; n += 2) yc[n / 2] = __floats2half2_rn(out[n], out[n + 1]);
#else
#pragma unroll
      for (int n = 0; n < TC_M; ++n) y[((b * TC_M + n) * Hp + ph) * (size_t)Wp + pw] = out[n];
#endif
    }
  }
}

#endif

// ---- conv2-style: weights as A (16 output channels), implicit im2col as B ---------------------
#define WA_IR (TC_TPH * TC_P - 1 + TC_K)
#define WA_RS (((TC_TPW * TC_P - 1 + 8) + 1) / 2 * 2 + 2)
#define WA_TILE (TC_C * WA_IR * WA_RS)
#if TC_PREC == 0
#define WA_STEPS ((TC_R + 1) / 2)
#define WA_COPIES 2
#else
#define WA_STEPS TC_R
#define WA_COPIES 1
#endif
#define WA_WINDOWS (TC_TPH * TC_TPW)
#if TC_P == 4
#define WA_UNITS WA_WINDOWS  // one window = two n-tiles
#define WA_NJ 2
#else
#define WA_UNITS ((WA_WINDOWS + 1) / 2)  // one n-tile = two windows
#define WA_NJ 1
#endif

// Shared-memory offset of filter row r = (c, p) relative to a position's top-left pixel.
__device__ __forceinline__ int wa_row_off(int r) {
  const int rr = r < TC_R ? r : 0;  // padded k rows have zero weights: read anything finite
  return ((rr / TC_K) * WA_IR + rr % TC_K) * WA_RS;
}

#if FCP_WANT(4)
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, TC_MINB)
fcp_mma_wa(const float* __restrict__ x, const uint4* __restrict__ afrag,
           const float* __restrict__ bias, float* __restrict__ y, int M, int H, int W, int Hp,
           int Wp, int tiles_w, int tiles_per_image) {
  __shared__ __align__(16) tc_elem in_s[WA_COPIES * WA_TILE];
  const int tile = blockIdx.x % tiles_per_image;
  const size_t b = blockIdx.x / tiles_per_image;
  const int tile_y = tile / tiles_w, tile_x = tile % tiles_w;
  const int iy0 = tile_y * TC_TPH * TC_P, ix0 = tile_x * TC_TPW * TC_P;
  // Weight fragments first: their loads overlap the staging below.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint4 af[WA_STEPS];
#pragma unroll
  for (int s = 0; s < WA_STEPS; ++s) af[s] = __ldg(&afrag[s * 32 + lane]);
  const float b_lo = g < M ? __ldg(&bias[g]) : 0.f;
  const float b_hi = g + 8 < M ? __ldg(&bias[g + 8]) : 0.f;
  // Stage the tile in pixel pairs; the shifted copy's pair (x[gx+1], x[gx+2]) reuses the
  // pair's second value and one more (L1-resident) load.
  {
    constexpr int HS = WA_RS / 2, NP = TC_C * WA_IR * HS;
    const bool vec = W % 2 == 0;  // ix0 is even (pool 2 or 4), so pairs are 8-byte aligned
    for (int base = threadIdx.x; base < NP; base += TC_THREADS * TC_STAGE_UNROLL) {
      float2 v[TC_STAGE_UNROLL];
      float e[TC_STAGE_UNROLL];
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        const int row = i / HS, p2 = i - row * HS;
        const int c = TC_C == 1 ? 0 : row / WA_IR, r = row - c * WA_IR;
        const int gy = iy0 + r, gx = ix0 + 2 * p2;
        v[u] = make_float2(0.f, 0.f);
        e[u] = 0.f;
        if (i < NP && gy < H) {
          const float* src_row = x + ((b * TC_C + c) * H + gy) * (size_t)W;
          v[u] = tc_load2(src_row, gx, W, vec);
#if WA_COPIES == 2
          if (gx + 2 < W) e[u] = __ldg(src_row + gx + 2);
#endif
        }
      }
#pragma unroll
      for (int u = 0; u < TC_STAGE_UNROLL; ++u) {
        const int i = base + u * TC_THREADS;
        if (i >= NP) break;
        tc_store2(in_s + 2 * i, v[u].x, v[u].y);
#if WA_COPIES == 2
        tc_store2(in_s + WA_TILE + 2 * i, v[u].y, e[u]);
#else
        (void)e[u];
#endif
      }
    }
  }
  __syncthreads();

  for (int u = warp; u < WA_UNITS; u += TC_WARPS) {
    float vmax_lo = FCP_NEG_INF, vmax_hi = FCP_NEG_INF;
#pragma unroll
    for (int j = 0; j < WA_NJ; ++j) {
      // This lane's B column n = g: which position of which window it gathers.
#if TC_P == 4
      const int wi = u, dy = 2 * j + (g >> 2), dx = g & 3;
#else
      const int wi = min(2 * u + (g >> 2), WA_WINDOWS - 1), dy = (g >> 1) & 1, dx = g & 1;
#endif
      const int oh = (wi / TC_TPW) * TC_P + dy, ow = (wi % TC_TPW) * TC_P + dx;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#if TC_PREC == 0
      // pixel pair (ow + 2t, ow + 2t + 1): from the shifted copy when it starts on an odd column
      const tc_elem* base = in_s + (ow & 1) * WA_TILE + oh * WA_RS + (ow & ~1) + 2 * t;
#pragma unroll
      for (int s = 0; s < WA_STEPS; ++s) {
        const unsigned b0 = tc_ld32(base + wa_row_off(2 * s));
        const unsigned b1 = tc_ld32(base + wa_row_off(2 * s + 1));
        tc_mma(acc, af[s].x, af[s].y, af[s].z, af[s].w, b0, b1);
      }
#else
      const tc_elem* base = in_s + oh * WA_RS + ow + t;
#pragma unroll
      for (int s = 0; s < WA_STEPS; ++s) {
        const unsigned b0 = tc_ld32(base + wa_row_off(s));
        const unsigned b1 = tc_ld32(base + wa_row_off(s) + 4);
        tc_mma(acc, af[s].x, af[s].y, af[s].z, af[s].w, b0, b1);
      }
#endif
      vmax_lo = fmaxf(vmax_lo, fmaxf(acc[0], acc[1]));  // channel g, columns 2t, 2t+1
      vmax_hi = fmaxf(vmax_hi, fmaxf(acc[2], acc[3]));  // channel g + 8
    }
    vmax_lo = fmaxf(vmax_lo, __shfl_xor_sync(0xffffffffu, vmax_lo, 1));
    vmax_hi = fmaxf(vmax_hi, __shfl_xor_sync(0xffffffffu, vmax_hi, 1));
#if TC_P == 4
    vmax_lo = fmaxf(vmax_lo, __shfl_xor_sync(0xffffffffu, vmax_lo, 2));
    vmax_hi = fmaxf(vmax_hi, __shfl_xor_sync(0xffffffffu, vmax_hi, 2));
    const bool writer = t == 0;
    const int wi = u;
#else
    const bool writer = (t & 1) == 0;
    const int wi = 2 * u + (t >> 1);
#endif
    const int ph = tile_y * TC_TPH + wi / TC_TPW, pw = tile_x * TC_TPW + wi % TC_TPW;
    if (writer && wi < WA_WINDOWS && ph < Hp && pw < Wp) {
      if (g < M) y[((b * M + g) * Hp + ph) * (size_t)Wp + pw] = fmaxf(vmax_lo + b_lo, 0.f);
      if (g + 8 < M) y[((b * M + g + 8) * Hp + ph) * (size_t)Wp + pw] = fmaxf(vmax_hi + b_hi, 0.f);
    }
  }
}
#endif
