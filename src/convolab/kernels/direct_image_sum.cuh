// Kernel 52's sum of its slices when they are one thread-block cluster (DI_SPLIT > 1; included
// by 52_direct_conv_image_wgmma.cu after its configuration): each block parks its sums in its
// own shared memory, then the cluster adds them through distributed shared memory.
#pragma once

#if DI_SPLIT > 1
// The consumers' accumulators into this block's tile of sums, [channel][pixel]: every stage,
// buffer and the staged chunk are consumed (all the producers' writes came before the last
// buffer's "full"), and once both warpgroups' wgmmas retired (the barrier) the shared memory is
// free for it.
__device__ __forceinline__ void park_sums(unsigned char* smem, const float (&acc)[DW_N / 2],
                                          int a_row, int n_base, int warp, int lane) {
  bar_sync(1, DI_CONSUMERS);
  float* sums = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* row = sums + (a_row + 16 * warp + g + 8 * h) * DI_SUM_ROW + n_base + 2 * t4;
#pragma unroll
    for (int j = 0; j < DW_N / 8; ++j)
      *reinterpret_cast<float2*>(row + 8 * j) = make_float2(acc[4 * j + 2 * h],
                                                            acc[4 * j + 2 * h + 1]);
  }
}

// The cluster's sum, by each block's threads (after the consumers parked their sums; beside
// 128-row tiles the consumers alone: the producers' 56 registers only wait at the barriers): the
// block of rank r takes every DI_SPLIT-th output channel of the tile from r, adds its pixels'
// quads over the cluster's blocks in rank order (the same sum every run) and the bias, and
// stores the valid pixels in NCHW.
#define DI_SUMMERS (DI_TM == 128 ? DI_CONSUMERS : DI_THREADS)
__device__ __forceinline__ void cluster_sum(unsigned char* smem, const float* __restrict__ bias,
                                            float* __restrict__ y, int M, int W, int tile,
                                            int b) {
  const float* sums = reinterpret_cast<const float*>(smem);
  const int Wo = W - DI_K + 1, rank = blockIdx.z;
  constexpr int QUADS = DI_HO * DI_PW / 4;  // a channel's pixel quads, dropped pixels included
  cluster_sync();  // every block's sums are parked
  for (int q = threadIdx.x; threadIdx.x < DI_SUMMERS; q += DI_SUMMERS) {
    const int r = rank + DI_SPLIT * (q / QUADS), n = 4 * (q % QUADS);
    if (r >= DI_TM) break;
    const int m = DI_TM * tile + r, oh = n / DI_PW, ow = n % DI_PW;
    if (m >= M || ow >= Wo) continue;
    const float4 s = cluster_sum4<DI_SPLIT>(sums + r * DI_SUM_ROW + n);
    const float bm = bias[m], v[4] = {s.x, s.y, s.z, s.w};
    float* out = y + (((size_t)b * M + m) * DI_HO + oh) * Wo;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (ow + e < Wo) out[ow + e] = v[e] + bm;
  }
  cluster_sync();  // no block leaves while another still reads its sums
}
#endif
