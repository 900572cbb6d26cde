// Split-K's second kernel for the wgmma rungs (WG_KSLICED=1, wgmma.cuh): the GEMM kernel left
// one slab of fp32 partial sums per k-slice, each in the output's own element order; this adds
// them into the output. Included by wgmma.cuh after the stores it shares with the epilogue.
#pragma once

#if WG_KSLICED
// y = the slabs of partial sums added in slice order (fixed: deterministic), + bias, through
// the activation, in the output's form: NCHW fp32 one element a thread, or channels-last
// OV channels a thread through the epilogue's own store (channels M..Mp-1 written as zeros).
// The slabs hold `slices` planes of y's elements in y's order, so every access is coalesced.
extern "C" __global__ void __launch_bounds__(256)
wg_splitk_reduce(const float* __restrict__ slabs, const float* __restrict__ bias,
                 wg_y_t* __restrict__ y, int M, int N, int pix, int slices) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
#if WG_NHWC
  constexpr int OV = 16 / (int)sizeof(ig_t);
  const int mp = (M + 7) & ~7;
  const size_t plane = (size_t)N * mp;
  for (size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v < plane / OV; v += stride) {
    const size_t at = v * OV;
    const int m = (int)(at % mp);
    float o[OV];
#pragma unroll
    for (int j = 0; j < OV; ++j) o[j] = 0.0f;
    for (int z = 0; z < slices; ++z) {
      const float4* s = reinterpret_cast<const float4*>(slabs + z * plane + at);
#pragma unroll
      for (int q = 0; q < OV / 4; ++q) {
        const float4 f = s[q];
        o[4 * q] += f.x;
        o[4 * q + 1] += f.y;
        o[4 * q + 2] += f.z;
        o[4 * q + 3] += f.w;
      }
    }
#pragma unroll
    for (int j = 0; j < OV; ++j) o[j] = m + j < M ? wg_act(o[j] + bias[m + j]) : 0.0f;
    wg_put_operand(y + at, plane, o);
  }
#else
  const size_t plane = (size_t)M * N;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < plane; i += stride) {
    float s = 0.0f;
    for (int z = 0; z < slices; ++z) s += slabs[z * plane + i];
    y[i] = wg_act(s + bias[(i / pix) % M]);
  }
#endif
}
#endif
