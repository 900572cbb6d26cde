// Training rung 37 — conv1 forward on tensor cores (trainer modes tf32 and bf16): rung 31's
// outputs, the pooled maps and one argmax byte per window, from raw bytes, with the
// convolution as mma.sync instead of FFMA.
//
// Against 31: conv1 has 4 filters and one channel, so filters as A's 16 rows would waste 3/4
// of every mma. As in rung 17 the rows are output positions and each filter row enters as a
// banded (Toeplitz) B: 16 input pixels of a row times T[j][n] = w[p][j - n] give 8 adjacent
// outputs. Rows g and g + 8 are two vertically adjacent conv rows and the columns 2t, 2t + 1
// two horizontally adjacent outputs, so a lane's four accumulators of a filter are one whole
// 2x2 pool window: its first maximum needs no shuffle. The block resizes its raw image on
// chip with 31's rule (the same bits) and stores it in the mode's precision; the B fragments
// of the four filters are built once per block from the fp32 master weights and stay in
// registers, and one A fragment (16 pixels of two rows) feeds four mma, one per filter.
//
// Measured (H100, 2026-11-25, with 38, 20 launches captured in a graph): both conv forwards
// 0.048 ms tf32 / 0.036 ms bf16 at batch 256 (31 + 32: 0.065), 0.594 / 0.361 ms at batch 4096
// (0.909); the whole step 11 % (256) to 18 % (4096) faster in bf16, as the fp32 backward
// (34 + 35) stays (benchmarks/results/2026-11-25_h100_train/modes).

#include "train_mma.cuh"

static_assert(C1_M == 4 && C1_P == 2, "four filters; a 2x2 window is one lane's accumulators");
static_assert(C1_K <= 8, "the band of one filter row fits a 16-pixel A row");
static_assert(C1_OUT % 8 == 0, "conv rows split into whole 8-output runs");

#ifndef C1T_THREADS
#define C1T_THREADS 128
#endif
constexpr int C1T_RUNS = C1_OUT / 8;                // 8-output runs per conv row
constexpr int C1T_COMBOS = P1_S * C1T_RUNS;         // (pooled row, run): one A row pair each
constexpr int C1T_MTILES = (C1T_COMBOS + 7) / 8;
constexpr int C1T_KSTEPS = 16 / TP_K;               // k-steps per filter row: 2 (tf32), 1
constexpr int C1T_WORDS = (C1_OUT + 8) / TP_PER_REG;  // words an A row can reach, zero past IN_S
// Words per staged row. bf16: two pooled rows 8 banks apart, so a warp's load stays
// conflict-free where its 8 runs cross into the next pooled row.
constexpr int C1T_RS = TRAIN_PREC == 1 ? C1T_WORDS : C1T_WORDS + 8;

// The shared-memory word of word column w. tf32: a warp's A load reads 4 consecutive words of
// 8 runs 8 words apart, so runs r and r + 4 (32 words apart) would share banks; flipping bit 2
// where bit 5 is set moves one of them to the other half of its 8-word block.
__device__ __forceinline__ int c1t_col(int w) {
  return TRAIN_PREC == 1 ? w ^ ((w >> 3) & 4) : w;
}

// T[j][n] of filter m, row p: the weight w[m][p][j - n] inside the band, else 0.
__device__ __forceinline__ float c1t_band(const float* __restrict__ w1, int m, int p, int q) {
  return q >= 0 && q < C1_K ? __ldg(w1 + (m * C1_K + p) * C1_K + q) : 0.f;
}

extern "C" __global__ void __launch_bounds__(C1T_THREADS)
train_conv1_fwd_mma(const unsigned char* __restrict__ raw, const long long* __restrict__ index,
                    const ResizeTap* __restrict__ taps, const unsigned* __restrict__ salt,
                    const float* __restrict__ w1, const float* __restrict__ b1,
                    float* __restrict__ pool1, unsigned char* __restrict__ arg1) {
  __shared__ float unit[RAW_H * RAW_W];
  __shared__ __align__(16) unsigned xs[IN_S * C1T_RS];
  const int b = blockIdx.x, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const long long src = source_of(index, b);
  // B fragments: b0 = T[k0][g], b1 = T[k0 + TP_K / 2][g] (and the next k for bf16).
  uint2 bf[C1_K][C1T_KSTEPS][C1_M];
#pragma unroll
  for (int p = 0; p < C1_K; ++p)
#pragma unroll
    for (int h = 0; h < C1T_KSTEPS; ++h)
#pragma unroll
      for (int m = 0; m < C1_M; ++m) {
        const int q = h * TP_K + t * TP_PER_REG - g;  // j - n of k0
        bf[p][h][m] = make_uint2(
            tp_operand(c1t_band(w1, m, p, q), c1t_band(w1, m, p, q + 1)),
            tp_operand(c1t_band(w1, m, p, q + TP_K / 2), c1t_band(w1, m, p, q + TP_K / 2 + 1)));
      }
  stage_raw(unit, raw + src * (RAW_H * RAW_W), mirrored(src, salt ? *salt : 0u));
  for (int i = tid; i < IN_S * C1T_WORDS; i += C1T_THREADS) {
    const int y = i / C1T_WORDS, w = i - y * C1T_WORDS, x = w * TP_PER_REG;
    const float lo = x < IN_S ? resized_pixel(unit, RAW_W, taps[y], taps[IN_S + x]) : 0.f;
    const float hi = TP_PER_REG == 2 && x + 1 < IN_S
        ? resized_pixel(unit, RAW_W, taps[y], taps[IN_S + x + 1]) : 0.f;
    xs[y * C1T_RS + c1t_col(w)] = tp_operand(lo, hi);
  }
  __syncthreads();

  float bias[C1_M];
#pragma unroll
  for (int m = 0; m < C1_M; ++m) bias[m] = __ldg(b1 + m);
  for (int mt = warp; mt < C1T_MTILES; mt += C1T_THREADS / 32) {
    const int combo = min(mt * 8 + g, C1T_COMBOS - 1);  // lanes past the end compute a copy
    const int ph = combo / C1T_RUNS, run = combo - ph * C1T_RUNS;
    float acc[C1_M][4] = {};
#pragma unroll
    for (int p = 0; p < C1_K; ++p) {
      const unsigned* row0 = xs + (2 * ph + p) * C1T_RS;  // A row g; row g + 8 is the next
      const unsigned* row1 = row0 + C1T_RS;
#pragma unroll
      for (int h = 0; h < C1T_KSTEPS; ++h) {
        // k = t (tf32) or the pair 2t, 2t + 1 (bf16), then 4 words on (k + TP_K / 2)
        const int w = run * (8 / TP_PER_REG) + h * (TP_K / TP_PER_REG) + t;
        const int c0 = c1t_col(w), c1 = c1t_col(w + 4);
        const uint4 a = make_uint4(row0[c0], row1[c0], row0[c1], row1[c1]);
#pragma unroll
        for (int m = 0; m < C1_M; ++m) tp_mma(acc[m], a, bf[p][h][m].x, bf[p][h][m].y);
      }
    }
    if (mt * 8 + g < C1T_COMBOS) {
      // Registers 0-3: window offsets 0 (row 2ph, column 8 run + 2t), 1, 2 (row 2ph + 1), 3.
      const size_t at = static_cast<size_t>(b) * POOL1 + ph * P1_S + run * 4 + t;
#pragma unroll
      for (int m = 0; m < C1_M; ++m) {
        float best = acc[m][0] + bias[m];
        int off = 0;
#pragma unroll
        for (int e = 1; e < 4; ++e) {
          const float v = acc[m][e] + bias[m];
          if (v > best) best = v, off = e;
        }
        unsigned char a;
        pool1[at + m * P1_N] = relu_arg(best, off, a);
        arg1[at + m * P1_N] = a;
      }
    }
  }
}
