// Kernel 48: a classifier layer at batch 1-64 in one launch whose k slices are the blocks of
// one thread-block cluster, their partial sums added through distributed shared memory.
//
// What it changes against kernel 42: there a row tile's k slices write fp32 partials to global
// memory and the last block to take an atomic ticket adds them all alone, while each block
// keeps one chunk of x and weights in flight through registers. On a layer as small as fc7
// (4096 -> 1024: 8 MB of fp16 weights, 16 row tiles) both are latency, not bytes: the lone sum
// waits on L2 for every slice of its tile, and one chunk in flight leaves the SM idle for most
// of each round trip. Here:
// - the slices of a row tile are one cluster (TC_SPLIT blocks, gridDim.x); each parks its tile
//   of sums in its own shared memory, and after one cluster barrier every block adds 1/TC_SPLIT
//   of the tile across the cluster's blocks (ld.shared::cluster), in rank order, so the sum
//   is the same every run; no partials in global memory, no tickets, nothing to reset;
// - weights and x come by cp.async into a ring of TC_STAGES chunks (TC_STAGES - 1 in flight),
//   so a block has ~80 KB on the way instead of one chunk.
//
// W is packed in fragment order (gpu/gemv_cluster.py): for each 16-row m-tile and each k piece,
// 32 lanes x 16 bytes, a lane's 16 bytes its A registers (fp16 / bf16: one k16 step; TF32: one
// k8 step of 4 fp32 values already rounded to TF32). x (fp32, B x K row-major) is converted to
// the operand type once a chunk into a buffer every warp reads (TC_XONCE), or as each warp reads
// its B fragments. Both, and splitting an m-tile's batch columns across TC_NSPLIT warps, are
// tunables: none of them moved the kernel's time at B = 64, whose bound is still open.
//
// A block: TC_WARPS m-tiles x TC_NSPLIT column groups, a warp each; all 8 TC_NT batch columns;
// one k slice of slice_pieces pieces. Launch: grid (TC_SPLIT, ceil(m_tiles / TC_WARPS)),
// 32 TC_WARPS TC_NSPLIT threads, dynamic shared memory TC_STAGES x (stage bytes) plus the
// converted chunk, at least the tile of sums. K a multiple of 4.

#include "common.cuh"
#include "cluster.cuh"
#include <cuda_bf16.h>

#ifndef TC_MODE
#define TC_MODE 0  // 0 fp16, 1 bf16, 2 tf32
#endif
#ifndef TC_NT
#define TC_NT 8  // n-tiles of 8 batch columns (B <= 8 TC_NT)
#endif
#ifndef TC_WARPS
#define TC_WARPS 4  // m-tiles a block
#endif
#ifndef TC_NSPLIT
#define TC_NSPLIT 1  // warps an m-tile, each 1/TC_NSPLIT of the n-tiles
#endif
#ifndef TC_CP
#define TC_CP 4  // k pieces a chunk
#endif
#ifndef TC_STAGES
#define TC_STAGES 4
#endif
#ifndef TC_SPLIT
#define TC_SPLIT 8  // k slices = blocks of a cluster (8: the portable maximum)
#endif

#define TC_THREADS (32 * TC_WARPS * TC_NSPLIT)
#define TC_NTW (TC_NT / TC_NSPLIT)  // n-tiles a warp
#define TC_PK (TC_MODE == 2 ? 8 : 16)  // k a piece
#define TC_KC (TC_CP * TC_PK)          // k a chunk
#define TC_ROWS (8 * TC_NT)            // batch rows of x a chunk
#define TC_BM (16 * TC_WARPS)          // W rows a block
// x's row stride in floats (set by the host, gemv_cluster.x_row). fp16 / bf16 read (k, k + 1)
// pairs: lanes (g, t) at 2t + g XROW must cover the 32 banks per half-warp, so XROW = 8 mod 32;
// TF32 reads single words at t + g XROW: XROW = 4 mod 32.
#ifndef TC_XROW
#define TC_XROW (TC_KC + (TC_MODE == 2 ? 4 : 8))
#endif
#ifndef TC_XONCE
#define TC_XONCE 1  // x converted once a chunk into an operand buffer (0: as each warp reads it)
#endif
// The operand buffer's row stride in 32-bit words (set by the host, gemv_cluster.operand_row):
// 4 mod 8, so a B fragment's lanes (g, t) at t + g OROW read 32 different banks.
#ifndef TC_OROW
#define TC_OROW ((TC_MODE == 2 ? TC_KC : TC_KC / 2) + 4)
#endif
#define TC_W_STAGE (TC_WARPS * TC_CP * 32)  // uint4s of weights a stage
#define TC_X_STAGE (TC_ROWS * TC_XROW)      // floats of x a stage
#define TC_XQUADS (TC_ROWS * TC_KC / 4)     // float4s of x a chunk

static_assert(TC_XROW >= TC_KC && TC_XROW % 32 == (TC_MODE == 2 ? 4 : 8),
              "x's row stride must hold a chunk and spread a B fragment over the banks");
static_assert(TC_OROW % 8 == 4 && TC_OROW >= (TC_MODE == 2 ? TC_KC : TC_KC / 2),
              "the operand row must hold a chunk and spread a B fragment over the banks");
static_assert(TC_NT % TC_NSPLIT == 0, "the n-tiles must split evenly across an m-tile's warps");
static_assert(TC_SPLIT >= 1 && TC_SPLIT <= 8, "a portable cluster holds at most 8 blocks");

// One chunk (pieces p .. p + TC_CP of the slice, k from 'k') into a ring slot. Tiles past the
// last one (M not a multiple of the block's rows) re-read the last; their sums are dropped.
__device__ __forceinline__ void load_chunk(uint4* ws, float* xs, const uint4* __restrict__ w,
                                           const float* __restrict__ x, int tile0, int m_tiles,
                                           int pieces, int p, int p_end, int k, int k_end, int B,
                                           int K) {
  for (int i = threadIdx.x; i < TC_W_STAGE; i += TC_THREADS) {
    const int q = (i / 32) % TC_CP, tile = min(tile0 + i / (32 * TC_CP), m_tiles - 1);
    const bool valid = p + q < p_end;
    cp_async16_zfill(ws + i, w + ((size_t)tile * pieces + (valid ? p + q : 0)) * 32 + i % 32,
                     valid);
  }
  for (int i = threadIdx.x; i < TC_XQUADS; i += TC_THREADS) {
    const int row = i / (TC_KC / 4), kk = k + 4 * (i % (TC_KC / 4));
    const bool valid = row < B && kk < k_end;  // zeros past the slice: 0 x NaN would poison
    cp_async16_zfill(xs + row * TC_XROW + 4 * (i % (TC_KC / 4)),
                     x + (valid ? (size_t)row * K + kk : 0), valid);
  }
}

// One chunk's MMAs: acc[j] += m-tile wm x x's n-tile (wn TC_NTW + j).
__device__ __forceinline__ void chunk_mma(float (&acc)[TC_NTW][4], const uint4* ws,
                                          const float* xs, int wm, int wn, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < TC_CP; ++q) {
    const uint4 a = ws[(wm * TC_CP + q) * 32 + lane];
#pragma unroll
    for (int j = 0; j < TC_NTW; ++j) {
      const float* row = xs + (8 * (wn * TC_NTW + j) + g) * TC_XROW + TC_PK * q;
#if TC_MODE == 2
      const unsigned b0 = __float_as_uint(tf32_round(row[t]));
      const unsigned b1 = __float_as_uint(tf32_round(row[t + 4]));
      mma_tf32_m16n8k8(acc[j], a.x, a.y, a.z, a.w, b0, b1);
#else
      const float2 lo = *reinterpret_cast<const float2*>(row + 2 * t);
      const float2 hi = *reinterpret_cast<const float2*>(row + 8 + 2 * t);
#if TC_MODE == 0
      const __half2 h0 = __floats2half2_rn(lo.x, lo.y), h1 = __floats2half2_rn(hi.x, hi.y);
      mma_f16_m16n8k16(acc[j], a.x, a.y, a.z, a.w, ld_u32(&h0), ld_u32(&h1));
#else
      const __nv_bfloat162 h0 = __floats2bfloat162_rn(lo.x, lo.y);
      const __nv_bfloat162 h1 = __floats2bfloat162_rn(hi.x, hi.y);
      mma_bf16_m16n8k16(acc[j], a.x, a.y, a.z, a.w, ld_u32(&h0), ld_u32(&h1));
#endif
#endif
    }
  }
}

// TC_XONCE: the chunk's x, fp32 in the ring, converted once into the operand buffer (fp16 /
// bf16 pairs or TF32-rounded words), so that no warp converts what another already has.
__device__ __forceinline__ void convert_x(unsigned* xo, const float* xs) {
  for (int i = threadIdx.x; i < TC_XQUADS; i += TC_THREADS) {
    const int row = i / (TC_KC / 4), c = i % (TC_KC / 4);
    const float4 v = *reinterpret_cast<const float4*>(xs + row * TC_XROW + 4 * c);
#if TC_MODE == 2
    *reinterpret_cast<float4*>(xo + row * TC_OROW + 4 * c) =
        make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
#elif TC_MODE == 0
    const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(xo + row * TC_OROW + 2 * c) = make_uint2(ld_u32(&a), ld_u32(&b));
#else
    const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(xo + row * TC_OROW + 2 * c) = make_uint2(ld_u32(&a), ld_u32(&b));
#endif
  }
}

// ... and the MMAs from it: k piece q's B fragment is words 8q + t and 8q + t + 4 of row g of
// each n-tile in every mode (fp16 / bf16: k pairs of a k16 step; TF32: the k8 step).
__device__ __forceinline__ void chunk_mma_converted(float (&acc)[TC_NTW][4], const uint4* ws,
                                                    const unsigned* xo, int wm, int wn,
                                                    int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < TC_CP; ++q) {
    const uint4 a = ws[(wm * TC_CP + q) * 32 + lane];
#pragma unroll
    for (int j = 0; j < TC_NTW; ++j) {
      const unsigned* row = xo + (8 * (wn * TC_NTW + j) + g) * TC_OROW + 8 * q + t;
#if TC_MODE == 2
      mma_tf32_m16n8k8(acc[j], a.x, a.y, a.z, a.w, row[0], row[4]);
#elif TC_MODE == 0
      mma_f16_m16n8k16(acc[j], a.x, a.y, a.z, a.w, row[0], row[4]);
#else
      mma_bf16_m16n8k16(acc[j], a.x, a.y, a.z, a.w, row[0], row[4]);
#endif
    }
  }
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
#if TC_SPLIT > 1
__cluster_dims__(TC_SPLIT, 1, 1)
#endif
gemv_cluster(const float* __restrict__ x, const uint4* __restrict__ w,
             const float* __restrict__ bias, float* __restrict__ y, int B, int M, int K,
             int m_tiles, int pieces, int slice_pieces) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ws = reinterpret_cast<uint4*>(smem);  // [TC_STAGES][TC_WARPS][TC_CP][32]
  float* xs = reinterpret_cast<float*>(ws + TC_STAGES * TC_W_STAGE);  // [TC_STAGES][ROWS][XROW]
  unsigned* xo = reinterpret_cast<unsigned*>(xs + TC_STAGES * TC_X_STAGE);  // [ROWS][OROW]
  const int lane = threadIdx.x & 31, wm = (threadIdx.x >> 5) % TC_WARPS;
  const int wn = (threadIdx.x >> 5) / TC_WARPS, tile0 = blockIdx.y * TC_WARPS;
  const int p0 = blockIdx.x * slice_pieces, p1 = min(pieces, p0 + slice_pieces);
  const int k_end = min(K, p1 * TC_PK);
  const int chunks = p1 > p0 ? (p1 - p0 + TC_CP - 1) / TC_CP : 0;

  float acc[TC_NTW][4];
#pragma unroll
  for (int j = 0; j < TC_NTW; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.f;

#pragma unroll
  for (int s = 0; s < TC_STAGES - 1; ++s) {
    if (s < chunks)
      load_chunk(ws + s * TC_W_STAGE, xs + s * TC_X_STAGE, w, x, tile0, m_tiles, pieces,
                 p0 + s * TC_CP, p1, (p0 + s * TC_CP) * TC_PK, k_end, B, K);
    cp_async_commit();
  }
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait<TC_STAGES - 2>();
    __syncthreads();  // chunk c is in, and every warp is done with the slot it refills next
    const int n = c + TC_STAGES - 1, slot = n % TC_STAGES;
    if (n < chunks)
      load_chunk(ws + slot * TC_W_STAGE, xs + slot * TC_X_STAGE, w, x, tile0, m_tiles, pieces,
                 p0 + n * TC_CP, p1, (p0 + n * TC_CP) * TC_PK, k_end, B, K);
    cp_async_commit();
#if TC_XONCE
    convert_x(xo, xs + (c % TC_STAGES) * TC_X_STAGE);
    __syncthreads();  // (the next chunk's first barrier keeps xo until every warp has read it)
    chunk_mma_converted(acc, ws + (c % TC_STAGES) * TC_W_STAGE, xo, wm, wn, lane);
#else
    chunk_mma(acc, ws + (c % TC_STAGES) * TC_W_STAGE, xs + (c % TC_STAGES) * TC_X_STAGE, wm, wn,
              lane);
#endif
  }
  cp_async_wait_all();

  // acc[j][r]: row 16 wm + g + 8 (r / 2), batch column 8 (wn TC_NTW + j) + 2 t + r % 2 of the
  // block's tile.
  const int g = lane >> 2, t = lane & 3, m0 = blockIdx.y * TC_BM;
#if TC_SPLIT == 1
#pragma unroll
  for (int j = 0; j < TC_NTW; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int m = m0 + 16 * wm + g + 8 * (r / 2), n = 8 * (wn * TC_NTW + j) + 2 * t + r % 2;
      if (m < M && n < B) y[(size_t)n * M + m] = acc[j][r] + bias[m];
    }
#else
  __syncthreads();  // the ring is read: it becomes the tile of sums, [column][row]
  float* sums = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < TC_NTW; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      sums[(8 * (wn * TC_NTW + j) + 2 * t + r % 2) * TC_BM + 16 * wm + g + 8 * (r / 2)] =
          acc[j][r];
  cluster_sync();
  // This block's share of the tile: float4s of rows, TC_ROWS * TC_BM / 4 in all.
  constexpr int QUADS = TC_ROWS * TC_BM / 4, SHARE = (QUADS + TC_SPLIT - 1) / TC_SPLIT;
  const int q_end = min(QUADS, (int)(blockIdx.x + 1) * SHARE);
  for (int q = blockIdx.x * SHARE + threadIdx.x; q < q_end; q += TC_THREADS) {
    const int n = q / (TC_BM / 4), m = m0 + 4 * (q % (TC_BM / 4));
    if (n >= B) continue;
    const float4 s = cluster_sum4<TC_SPLIT>(sums + 4 * q);
    float* out = y + (size_t)n * M;
    if (m < M) out[m] = s.x + bias[m];
    if (m + 1 < M) out[m + 1] = s.y + bias[m + 1];
    if (m + 2 < M) out[m + 2] = s.z + bias[m + 2];
    if (m + 3 < M) out[m + 3] = s.w + bias[m + 3];
  }
  cluster_sync();  // no block leaves while another still reads its sums
#endif
}
