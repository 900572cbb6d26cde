// Kernel 49 with x in fp32 (49_gemv_wgmma_bulk.cu includes it after its configuration): x's
// chunk copied into the stage by cp.async and converted there into the swizzled operand, or x
// converted once a call by a first launch (`gw_x_to_operand`, XPASS in gpu/gemv_wgmma.py) into
// the fp16 / bf16 operand that GW_X16's tensor-copy loop reads.

#pragma once

#define GW_X_PIECES (GW_KT * GW_N * 8)           // 16-byte pieces of x's converted chunk
#define GW_X_LOADS ((GW_X_PIECES + 127) / 128)   // ... a producer thread

#define GW_RAW_LOADS (GW_N * GW_KT * 16 / 128)   // 16-byte cp.asyncs of x's chunk a producer

// Chunk c's copies into a stage, by the producer warpgroup, counted on `loaded`: the block's
// weights (one bulk copy, one run of bytes), and x's chunk in fp32 by cp.async, 16 bytes a
// copy (as bulk copies, x's 64 rows of 256 bytes a chunk ran 3x slower: docs/vgg.md, "Kernel
// 49"), zero-filled past B and past K.
__device__ __forceinline__ void issue_chunk(unsigned char* stage_p, unsigned stage,
                                            unsigned loaded, const unsigned char* w_src,
                                            const float* x, int B, int K, int k0, int ptid) {
  if (ptid == 0) {
    mbar_expect_tx(loaded, GW_A_BYTES);
    bulk_copy(stage, w_src, GW_A_BYTES, loaded);
  }
  float* raw = reinterpret_cast<float*>(stage_p + GW_A_BYTES + GW_X_BYTES);
  const int kn = min(GW_KT * 64, K - k0);
#pragma unroll
  for (int i = 0; i < GW_RAW_LOADS; ++i) {
    const int q = ptid + 128 * i, n = q / (GW_KT * 16), k = 4 * (q % (GW_KT * 16));
    const bool valid = n < B && k < kn;
    cp_async16_zfill(raw + n * GW_KT * 64 + k, valid ? x + (size_t)n * K + k0 + k : x, valid);
  }
  mbar_arrive_cp_async(loaded);
}

__device__ __forceinline__ unsigned gw_pack2(float lo, float hi) {
#if TM_MODE == 0
  const __half2 h = __floats2half2_rn(lo, hi);
#else
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#endif
  return *reinterpret_cast<const unsigned*>(&h);
}

// x's chunk from its fp32 rows in the stage to the operand: piece p = ptid + 128 i is piece j
// of k-tile kt, row n, stored at j ^ (n mod 8).
__device__ __forceinline__ void convert_x_chunk(const unsigned char* stage_p, unsigned x_stage,
                                                int ptid) {
  const float* raw = reinterpret_cast<const float*>(stage_p + GW_A_BYTES + GW_X_BYTES);
#pragma unroll
  for (int i = 0; i < GW_X_LOADS; ++i) {
    const int p = ptid + 128 * i, j = p % 8, n = (p / 8) % GW_N, kt = p / (8 * GW_N);
    if (p >= GW_X_PIECES) break;
    const float4* src = reinterpret_cast<const float4*>(raw + (n * GW_KT + kt) * 64 + 8 * j);
    const float4 a = src[0], b = src[1];
    const unsigned at = x_stage + (kt * GW_N + n) * GW_ROWB + 16 * (j ^ (n % 8));
    gw_store16(at, gw_pack2(a.x, a.y), gw_pack2(a.z, a.w), gw_pack2(b.x, b.y),
               gw_pack2(b.z, b.w));
  }
}

// x (B, K) fp32 -> the (B, K) operand GW_X16 reads, 8 values (two float4s, one 16-byte store)
// a thread; n8 = B K / 8 (K is a multiple of 8). Round to nearest even, as convert_x_chunk.
extern "C" __global__ void gw_x_to_operand(const float4* __restrict__ x, uint4* __restrict__ op,
                                           int n8) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += gridDim.x * blockDim.x) {
    const float4 a = x[2 * i], b = x[2 * i + 1];
    op[i] = make_uint4(gw_pack2(a.x, a.y), gw_pack2(a.z, a.w), gw_pack2(b.x, b.y),
                       gw_pack2(b.z, b.w));
  }
}
