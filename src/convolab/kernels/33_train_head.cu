// Training rung 33 — the head in one kernel: f5 + bias + ReLU, f6 + bias, softmax
// cross-entropy (with label smoothing), its gradient, f6 and f5 backward, and dX of f5 (the
// gradient of conv2's pooled features). Evaluation runs the same kernel without `dfeat`.
//
// Against the framework step (cuBLAS GEMMs plus ~15 CuPy element-wise kernels, the loss read
// back to the host): one launch, nothing leaves the chip but dfeat, each block's share of the
// weight gradients and two running sums (loss, correct) that the host reads once per epoch.
//
// Each block takes a contiguous slice of the batch, HEAD_CHUNK images at a time (one warp per
// image for the small per-image work). The f5 weight gradient (32x1024) stays in registers
// across the slice — each thread owns four input columns for all 32 hidden units — and is
// written once as the block's partial; the optimizer kernel (36) adds the partials in a fixed
// order, so no atomics touch a gradient. Only the loss sum and the correct count use atomics
// (statistics, not gradients).
//
// Measured (H100, 2026-11-25): 0.040 ms at batch 256, 0.075 ms at batch 4096.

#include "train_lenet.cuh"

constexpr int HEAD_THREADS = 256;
constexpr int HEAD_CHUNK = HEAD_THREADS / 32;  // images per pass: one warp each
constexpr int COLS = FEAT / HEAD_THREADS;       // f5 input columns per thread
constexpr int KSPAN = FEAT / HEAD_CHUNK;        // f5 inputs per warp in the forward dot
static_assert(FEAT % HEAD_THREADS == 0, "each thread owns whole f5 input columns");
static_assert(KSPAN % 4 == 0, "float4 rows");

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The lane of the first maximum of v (ties go to the smaller lane, as numpy's argmax).
__device__ __forceinline__ int warp_argmax(float v) {
  int at = threadIdx.x & 31;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oat = __shfl_xor_sync(0xffffffffu, at, o);
    if (ov > v || (ov == v && oat < at)) v = ov, at = oat;
  }
  return at;
}

struct HeadSmem {
  float4 fs[HEAD_CHUNK][FEAT / 4];             // the chunk's features
  float part[HEAD_CHUNK][HEAD_CHUNK][HID];     // per-warp partial dots [warp][image][unit]
  float hid[HEAD_CHUNK][HID];                  // ReLU(f5)
  float4 dh[HEAD_CHUNK][HID / 4];              // dLoss/d(f5 pre-activation)
  float dl[HEAD_CHUNK][CLS];                   // dLoss/dlogits
  float w6[F6_W + CLS];
  float loss[HEAD_CHUNK];
  unsigned correct[HEAD_CHUNK];
};

// The chunk's per-image work, warp `i` on image i: f5 sums, ReLU, logits, loss, dlogits, dh.
__device__ void head_image(HeadSmem& s, int i, bool valid, int label, const float* b5,
                           float smoothing, float inv_batch, bool train) {
  const int lane = threadIdx.x & 31;
  float h = b5[lane];
#pragma unroll
  for (int w = 0; w < HEAD_CHUNK; ++w) h += s.part[w][i][lane];
  s.hid[i][lane] = fmaxf(h, 0.f);
  __syncwarp();
  float z = __int_as_float(0xff800000u);  // -inf (NVRTC has no INFINITY)
  if (lane < CLS) {
    z = s.w6[F6_W + lane];
#pragma unroll 8
    for (int o = 0; o < HID; ++o) z = fmaf(s.w6[lane * HID + o], s.hid[i][o], z);
  }
  const float zmax = warp_max(z);
  const float e = lane < CLS ? expf(z - zmax) : 0.f;
  const float log_sum = logf(warp_sum(e));
  const float target = (lane == label ? 1.f - smoothing : 0.f) + smoothing / CLS;
  const float logp = z - zmax - log_sum;
  const float loss = warp_sum(lane < CLS ? -target * logp : 0.f);
  const int guess = warp_argmax(z);
  if (lane == 0) {
    s.loss[i] += valid ? loss : 0.f;
    s.correct[i] += valid && guess == label ? 1u : 0u;
  }
  if (!train) return;
  if (lane < CLS) s.dl[i][lane] = valid ? (expf(logp) - target) * inv_batch : 0.f;
  __syncwarp();
  float d = 0.f;
#pragma unroll
  for (int c = 0; c < CLS; ++c) d = fmaf(s.w6[c * HID + lane], s.dl[i][c], d);
  reinterpret_cast<float*>(s.dh[i])[lane] = h > 0.f ? d : 0.f;
}

extern "C" __global__ void __launch_bounds__(HEAD_THREADS, 1)
train_head(const float* __restrict__ feat, const unsigned char* __restrict__ labels,
           const long long* __restrict__ index, const float* __restrict__ f5,
           const float* __restrict__ f6, float* __restrict__ dfeat, float* __restrict__ part5,
           float* __restrict__ part6, float* __restrict__ loss_sum,
           unsigned* __restrict__ correct_sum, int batch, int per_block, float smoothing,
           float inv_batch) {
  __shared__ HeadSmem s;
  const bool train = dfeat != nullptr;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int first = blockIdx.x * per_block, last = min(batch, first + per_block);
  const float* b5 = f5 + F5_W;
  for (int i = tid; i < F6_W + CLS; i += HEAD_THREADS) s.w6[i] = f6[i];
  if (tid < HEAD_CHUNK) s.loss[tid] = 0.f, s.correct[tid] = 0u;
  float g5[COLS][HID] = {};
  float g6[2] = {};
  float gb5 = 0.f;
  for (int base = first; base < last; base += HEAD_CHUNK) {
    for (int q = tid; q < HEAD_CHUNK * FEAT / 4; q += HEAD_THREADS) {
      const int i = q / (FEAT / 4), k = q - i * (FEAT / 4);
      s.fs[i][k] = base + i < last
          ? reinterpret_cast<const float4*>(feat + static_cast<size_t>(base + i) * FEAT)[k]
          : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncthreads();
    {  // f5 forward: warp w sums inputs [w*KSPAN, (w+1)*KSPAN) of every image, lane = unit
      float acc[HEAD_CHUNK] = {};
      const float4* wrow = reinterpret_cast<const float4*>(f5 + lane * FEAT + warp * KSPAN);
#pragma unroll 4
      for (int k4 = 0; k4 < KSPAN / 4; ++k4) {
        const float4 w = __ldg(wrow + k4);
#pragma unroll
        for (int i = 0; i < HEAD_CHUNK; ++i) {
          const float4 f = s.fs[i][warp * (KSPAN / 4) + k4];
          acc[i] = fmaf(w.x, f.x, fmaf(w.y, f.y, fmaf(w.z, f.z, fmaf(w.w, f.w, acc[i]))));
        }
      }
#pragma unroll
      for (int i = 0; i < HEAD_CHUNK; ++i) s.part[warp][i][lane] = acc[i];
    }
    __syncthreads();
    const int b = base + warp;
    const bool valid = b < last;
    head_image(s, warp, valid, valid ? labels[source_of(index, b)] : 0, b5, smoothing,
               inv_batch, train);
    __syncthreads();
    if (!train) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // f6: dW6 = dl^T hid, db6 = sum dl
      const int q = tid + j * HEAD_THREADS;
      if (q < F6_W) {
        const int c = q / HID, o = q - c * HID;
        for (int i = 0; i < HEAD_CHUNK; ++i) g6[j] = fmaf(s.dl[i][c], s.hid[i][o], g6[j]);
      } else if (q < F6_W + CLS) {
        for (int i = 0; i < HEAD_CHUNK; ++i) g6[j] += s.dl[i][q - F6_W];
      }
    }
    if (tid < HID)
      for (int i = 0; i < HEAD_CHUNK; ++i) gb5 += reinterpret_cast<float*>(s.dh[i])[tid];
#pragma unroll 1
    for (int i = 0; i < HEAD_CHUNK; ++i) {  // f5: dW5 += dh^T feat, thread owns COLS columns
      float f[COLS];
#pragma unroll
      for (int j = 0; j < COLS; ++j)
        f[j] = reinterpret_cast<const float*>(s.fs[i])[tid + j * HEAD_THREADS];
#pragma unroll
      for (int o4 = 0; o4 < HID / 4; ++o4) {
        const float4 d = s.dh[i][o4];
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
          g5[j][o4 * 4 + 0] = fmaf(d.x, f[j], g5[j][o4 * 4 + 0]);
          g5[j][o4 * 4 + 1] = fmaf(d.y, f[j], g5[j][o4 * 4 + 1]);
          g5[j][o4 * 4 + 2] = fmaf(d.z, f[j], g5[j][o4 * 4 + 2]);
          g5[j][o4 * 4 + 3] = fmaf(d.w, f[j], g5[j][o4 * 4 + 3]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < COLS; ++j) {  // dfeat = dh W5, coalesced over the columns
      const int k = tid + j * HEAD_THREADS;
      float acc[HEAD_CHUNK] = {};
#pragma unroll 2
      for (int o4 = 0; o4 < HID / 4; ++o4) {
        const float* col = f5 + (o4 * 4) * FEAT + k;
        const float w0 = __ldg(col), w1 = __ldg(col + FEAT);
        const float w2 = __ldg(col + 2 * FEAT), w3 = __ldg(col + 3 * FEAT);
#pragma unroll
        for (int i = 0; i < HEAD_CHUNK; ++i) {
          const float4 d = s.dh[i][o4];
          acc[i] = fmaf(d.w, w3, fmaf(d.z, w2, fmaf(d.y, w1, fmaf(d.x, w0, acc[i]))));
        }
      }
#pragma unroll
      for (int i = 0; i < HEAD_CHUNK; ++i)
        if (base + i < last) dfeat[static_cast<size_t>(base + i) * FEAT + k] = acc[i];
    }
    __syncthreads();  // fs and dh are rewritten by the next chunk
  }
  __syncthreads();  // every warp's loss and count are in (evaluation skips the loop's sync)
  if (tid == 0) {
    float loss = 0.f;
    unsigned correct = 0u;
    for (int i = 0; i < HEAD_CHUNK; ++i) loss += s.loss[i], correct += s.correct[i];
    atomicAdd(loss_sum, loss);
    atomicAdd(correct_sum, correct);
  }
  if (!train) return;
  float* p5 = part5 + static_cast<size_t>(blockIdx.x) * (F5_W + HID);
#pragma unroll
  for (int j = 0; j < COLS; ++j)
#pragma unroll
    for (int o = 0; o < HID; ++o) p5[o * FEAT + tid + j * HEAD_THREADS] = g5[j][o];
  if (tid < HID) p5[F5_W + tid] = gb5;
  float* p6 = part6 + static_cast<size_t>(blockIdx.x) * (F6_W + CLS);
#pragma unroll
  for (int j = 0; j < 2; ++j)
    if (tid + j * HEAD_THREADS < F6_W + CLS) p6[tid + j * HEAD_THREADS] = g6[j];
}
