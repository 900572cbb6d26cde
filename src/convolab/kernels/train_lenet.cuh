// Shapes and helpers of the fused training kernels (31-38) for the ece408 LeNet: conv1 K7 on
// the resized input + ReLU + max-pool, conv2 K7 + ReLU + max-pool (floor), f5 + ReLU, f6.
// The host passes every shape as a -D define taken from models.conv_blocks / param_shapes
// (gpu/trainer.py); the defaults here are ece408's, so each file also compiles standalone.
//
// What the forward keeps for the backward: the pooled activations (the next layer's input)
// and one byte per pooled output, the window offset of its maximum, or ARG_DEAD where the
// window's maximum is <= 0 (the ReLU cut the gradient). The pre-pool activations are never
// written.
#pragma once

#include "resize.cuh"  // also RAW_H x RAW_W, the raw image size
#ifndef IN_S
#define IN_S 86  // the network's input side (the resize target)
#endif
#ifndef C1_M
#define C1_M 4
#endif
#ifndef C1_K
#define C1_K 7
#endif
#ifndef C1_P
#define C1_P 2
#endif
#ifndef C2_M
#define C2_M 16
#endif
#ifndef C2_K
#define C2_K 7
#endif
#ifndef C2_P
#define C2_P 4
#endif
#ifndef HID
#define HID 32
#endif
#ifndef CLS
#define CLS 10
#endif

constexpr int C1_OUT = IN_S - C1_K + 1;  // 80
constexpr int P1_S = C1_OUT / C1_P;      // 40: pooled side, conv2's input side
constexpr int C2_OUT = P1_S - C2_K + 1;  // 34
constexpr int P2_S = C2_OUT / C2_P;      // 8 (floor: the last conv2 rows/columns feed nothing)
constexpr int C1_TAPS = C1_K * C1_K;
constexpr int C2_TAPS = C2_K * C2_K;
constexpr int P1_N = P1_S * P1_S;              // pooled positions per conv1 channel
constexpr int P2_N = P2_S * P2_S;              // pooled positions per conv2 channel
constexpr int POOL1 = C1_M * P1_N;             // conv2's input per image (6400)
constexpr int FEAT = C2_M * P2_N;              // f5's input per image (1024)
constexpr int C1_W = C1_M * C1_TAPS;           // conv1 weights (196), then C1_M biases
constexpr int C2_W = C2_M * C1_M * C2_TAPS;    // conv2 weights (3136), then C2_M biases
constexpr int F5_W = HID * FEAT;               // f5 weights (32768), then HID biases
constexpr int F6_W = CLS * HID;                // f6 weights (320), then CLS biases

constexpr unsigned char ARG_DEAD = 0xff;

static_assert(C1_M == 4, "conv1 keeps its filters in one float4 per tap");
static_assert(C2_M % 4 == 0, "conv2 gives each thread four filters (one float4 per tap)");
static_assert(C1_P * C1_P < ARG_DEAD && C2_P * C2_P < ARG_DEAD, "window offsets fit a byte");
static_assert(HID == 32, "the head gives one lane per hidden unit");
static_assert(CLS <= 32, "the head gives one lane per class");

// Max-pool of one window's conv outputs (bias added, ReLU folded in): the pooled value and
// the offset of the window's first maximum (row-major, as the CPU layer breaks ties), or
// ARG_DEAD when that maximum is <= 0.
template <int P>
__device__ __forceinline__ float pool_relu(const float (&acc)[P][P], float bias,
                                           unsigned char& arg) {
  float best = acc[0][0] + bias;
  int at = 0;
#pragma unroll
  for (int i = 0; i < P; ++i)
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const float v = acc[i][j] + bias;
      if (v > best) best = v, at = i * P + j;
    }
  arg = best > 0.f ? static_cast<unsigned char>(at) : ARG_DEAD;
  return best > 0.f ? best : 0.f;
}

// One training example's raw bytes into `unit` (RAW_H x RAW_W floats in [0, 1]), optionally
// mirrored left-right (an augmentation: the raw columns are read backwards). All threads take
// part; ends synced.
__device__ __forceinline__ void stage_raw(float* unit, const unsigned char* raw, bool mirror) {
  const int tid = threadIdx.x, threads = blockDim.x;
  if (mirror) {
    for (int i = tid; i < RAW_H * RAW_W; i += threads) {
      const int y = i / RAW_W, x = i - y * RAW_W;
      unit[i] = raw_to_unit(__ldg(raw + y * RAW_W + (RAW_W - 1 - x)));
    }
  } else {
    stage_unit_image(unit, raw, RAW_H * RAW_W, tid, threads);
  }
  __syncthreads();
}

// The input image of one training example, resized on chip from its raw bytes into `img`
// (IN_S x IN_S floats) through `unit` (stage_raw). All threads take part; ends synced.
__device__ __forceinline__ void stage_input(float* img, float* unit, const unsigned char* raw,
                                            const ResizeTap* taps, bool mirror) {
  stage_raw(unit, raw, mirror);
  for (int i = threadIdx.x; i < IN_S * IN_S; i += blockDim.x) {
    const int y = i / IN_S, x = i - y * IN_S;
    img[i] = resized_pixel(unit, RAW_W, taps[y], taps[IN_S + x]);
  }
  __syncthreads();
}

// Whether example `src` is mirrored in this epoch: a hash of (image, epoch salt), so each
// image flips in about half the epochs with no random state on the device. salt 0: never.
__device__ __forceinline__ bool mirrored(long long src, unsigned salt) {  // salt: per epoch
  if (salt == 0u) return false;
  unsigned h = static_cast<unsigned>(src) * 0x9e3779b1u ^ salt * 0x85ebca6bu;
  h ^= h >> 15;
  h *= 0x2c1b3c6du;
  h ^= h >> 12;
  return (h & 1u) != 0u;
}

// The source row of batch position b: index[b] when the batch is a shuffled gather, else b.
__device__ __forceinline__ long long source_of(const long long* index, int b) {
  return index ? index[b] : static_cast<long long>(b);
}
