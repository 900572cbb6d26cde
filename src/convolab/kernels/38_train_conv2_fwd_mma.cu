// Training rung 38 — conv2 forward on tensor cores (trainer modes tf32 and bf16): rung 32's
// outputs, the pooled features and one argmax byte per window, from mma.sync instead of FFMA.
//
// Against 32: per image the convolution is one GEMM, D (16 filters x 1024 conv outputs) =
// A (16 x K weights) B (K x 1024, the implicit im2col), K = 7 filter rows x 8 columns (the 8th
// weight 0) x 4 channels, with fp32 accumulators. The pooled maps are staged channels-last in
// the mode's precision, so one 32-bit shared load is a B register for either k order the mma
// wants (tf32: one channel; bf16: a channel pair), never a misaligned pixel pair. The block
// builds its A fragments once, from the fp32 master weights, rounded (train_mma.cuh). A warp
// owns one pooled row: 8 windows of 4x4 conv outputs, two n-tiles each, 64 accumulators; per
// k-step one A fragment (a 16-byte shared load) feeds 16 mma. A filter's 16 outputs of a
// window sit in the 4 lanes of a quad (n = 2t, 2t+1 of each tile), so the window's first
// maximum is a register scan and two shuffles.
//
// Measured (H100, 2026-11-25, with 37, 20 launches captured in a graph): both conv forwards
// 0.048 ms tf32 / 0.036 ms bf16 at batch 256 (31 + 32: 0.065), 0.594 / 0.361 ms at batch 4096
// (0.909); the whole step 11 % (256) to 18 % (4096) faster in bf16, as the fp32 backward
// (34 + 35) stays (benchmarks/results/2026-11-25_h100_train/modes).

#include "train_mma.cuh"

static_assert(C2_M == 16, "the filters are A's 16 rows");
static_assert(C1_M == 4, "k runs over the 4 input channels innermost");
static_assert(C2_P == 4, "a pool window is two 8-position n-tiles");
static_assert(C2_K <= 8, "a filter row fits 8 k columns");
static_assert(P2_S * C2_P + 7 <= P1_S, "the padded 8th column stays inside the image");

constexpr int C2T_THREADS = 32 * P2_S;     // a warp per pooled row
constexpr int C2T_COLS = TP_K / C1_M;      // filter columns per k-step: 2 (tf32), 4 (bf16)
constexpr int C2T_SPR = 8 / C2T_COLS;      // k-steps per filter row
constexpr int C2T_STEPS = C2_K * C2T_SPR;  // 28 (tf32) or 14 (bf16)
constexpr int C2T_E = C1_M / TP_PER_REG;   // 32-bit words per staged pixel: 4 or 2

// Words per staged row: the two conv rows of one n-tile land 16 banks apart, so a warp's B
// load (8 positions x 4 operands) touches 32 distinct banks.
constexpr int c2t_row_pixels() {
  int rs = P1_S;
  while ((rs * C2T_E) % 32 != 16) ++rs;
  return rs;
}
constexpr int C2T_RS = c2t_row_pixels();

// A[m][k] of k-step (p, q0): k = (q - q0) * C1_M + c; 0 for the padded column.
__device__ __forceinline__ float c2t_weight(const float* __restrict__ w2, int m, int k, int p,
                                            int q0) {
  const int c = k % C1_M, q = q0 + k / C1_M;
  return q < C2_K ? __ldg(w2 + ((m * C1_M + c) * C2_K + p) * C2_K + q) : 0.f;
}

extern "C" __global__ void __launch_bounds__(C2T_THREADS)
train_conv2_fwd_mma(const float* __restrict__ pool1, const float* __restrict__ w2,
                    const float* __restrict__ b2, float* __restrict__ feat,
                    unsigned char* __restrict__ arg2) {
  __shared__ __align__(16) unsigned xs[P1_S * C2T_RS * C2T_E];
  __shared__ uint4 afrag[C2T_STEPS * 32];
  const int b = blockIdx.x, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  // A fragments (row g or g + 8; k = t, t + 4 for tf32, pairs 2t, 2t + 8 for bf16).
  for (int i = tid; i < C2T_STEPS * 32; i += C2T_THREADS) {
    const int s = i / 32, gg = (i % 32) >> 2, tt = i & 3;
    const int p = s / C2T_SPR, q0 = (s % C2T_SPR) * C2T_COLS;
    unsigned r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = gg + 8 * (j & 1), k = (j >> 1) * (TP_K / 2) + tt * TP_PER_REG;
      r[j] = tp_operand(c2t_weight(w2, m, k, p, q0), c2t_weight(w2, m, k + 1, p, q0));
    }
    afrag[i] = make_uint4(r[0], r[1], r[2], r[3]);
  }
  // The image channels-last, one pixel's C1_M channels per thread.
  const float* in = pool1 + static_cast<size_t>(b) * POOL1;
  for (int pix = tid; pix < P1_N; pix += C2T_THREADS) {
    const int y = pix / P1_S, x = pix - y * P1_S;
    float v[C1_M];
#pragma unroll
    for (int c = 0; c < C1_M; ++c) v[c] = in[c * P1_N + pix];
    unsigned* dst = xs + (y * C2T_RS + x) * C2T_E;
#pragma unroll
    for (int e = 0; e < C2T_E; ++e)
      dst[e] = tp_operand(v[e * TP_PER_REG], v[e * TP_PER_REG + TP_PER_REG - 1]);
  }
  __syncthreads();

  // This lane's B register at window 0, tile 0, k-step 0: position n = g is (g >> 2, g & 3) of
  // the window's top half; word t of the pixel's k block (tf32: channel t; bf16: pixel t >> 1,
  // channel pair t & 1). The second register (k + TP_K / 2) is 4 words further in both modes.
  const int wy = warp;
  const unsigned* base = xs + ((wy * C2_P + (g >> 2)) * C2T_RS + (g & 3)) * C2T_E + t;
  float acc[P2_S][2][4] = {};
#pragma unroll 1
  for (int s = 0; s < C2T_STEPS; ++s) {
    const uint4 a = afrag[s * 32 + lane];
    const int p = s / C2T_SPR, q0 = (s % C2T_SPR) * C2T_COLS;
    const unsigned* src = base + (p * C2T_RS + q0) * C2T_E;
#pragma unroll
    for (int wx = 0; wx < P2_S; ++wx)
#pragma unroll
      for (int j = 0; j < 2; ++j) {  // tile j: window rows 2j, 2j + 1
        const unsigned* at = src + (2 * j * C2T_RS + wx * C2_P) * C2T_E;
        tp_mma(acc[wx][j], a, at[0], at[4]);
      }
  }

  // Pool: lane (g, t) holds filters g (registers 0, 1) and g + 8 (2, 3) at window offsets
  // 8j + 2t and 8j + 2t + 1, scanned in increasing order (the row-major first maximum).
  const float bias[2] = {__ldg(b2 + g), __ldg(b2 + g + 8)};
  float* out = feat + static_cast<size_t>(b) * FEAT;
  unsigned char* arg = arg2 + static_cast<size_t>(b) * FEAT;
#pragma unroll
  for (int wx = 0; wx < P2_S; ++wx) {
    float best[2];
    int at[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      best[h] = acc[wx][0][2 * h] + bias[h];
      at[h] = 2 * t;
#pragma unroll
      for (int q = 1; q < 4; ++q) {
        const int j = q >> 1, e = q & 1;
        const float v = acc[wx][j][2 * h + e] + bias[h];
        if (v > best[h]) best[h] = v, at[h] = 8 * j + 2 * t + e;
      }
      argmax_xor(best[h], at[h], 1);
      argmax_xor(best[h], at[h], 2);
    }
    if (t == 0) {
      const int win = wy * P2_S + wx;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned char a;
        out[(g + 8 * h) * P2_N + win] = relu_arg(best[h], at[h], a);
        arg[(g + 8 * h) * P2_N + win] = a;
      }
    }
  }
}
