// Rung 25 — raw bytes in: uint8 images (N, h, w) -> float32 (N, 1, S, S) in [0, 1], bilinear,
// bit-identical to data.resize_bilinear (resize.cuh holds the rule and why each step is rounded
// on its own). A raw Fashion-MNIST image is 784 bytes against 29,584 for its 86x86 float32
// form, so a network fed bytes moves 38x less over PCIe and through HBM.
//
// This standalone kernel is the general fallback and the yardstick of the fused variants,
// which evaluate resized_pixel inside their own input staging instead (no resized image is
// ever written). `index` (may be null) picks the source image of each output: a shuffled
// training batch gathers its images without a copy.

#include "resize.cuh"

extern "C" __global__ void resize_u8(const unsigned char* __restrict__ raw,
                                     const long long* __restrict__ index,
                                     const ResizeTap* __restrict__ taps,  // S_h rows, then S_w
                                     float* __restrict__ out, int in_h, int in_w, int out_h,
                                     int out_w) {
  extern __shared__ float unit[];  // one image, in_h * in_w floats
  const size_t b = blockIdx.x;
  const size_t src = index ? static_cast<size_t>(index[b]) : b;
  const int tid = threadIdx.x;
  stage_unit_image(unit, raw + src * in_h * in_w, in_h * in_w, tid, blockDim.x);
  __syncthreads();
  float* o = out + b * out_h * (size_t)out_w;
  for (int i = tid; i < out_h * out_w; i += blockDim.x) {
    const int y = i / out_w, x = i - y * out_w;
    o[i] = resized_pixel(unit, in_w, taps[y], taps[out_h + x]);
  }
}
