// Kernel 41: a classifier layer at small batch (1x1 images, B <= 16) as a weight-streaming
// matrix-vector product.
//
// What it changes against rung 27 (split-K implicit GEMM): there, fc6/fc7 at N = B <= 16 run
// m16n8 MMAs whose columns are mostly padding, 2-4 warps a block hold few loads in flight,
// and 3xTF32 reads each weight through shared memory and splits it three ways. fc6 at B=1
// streamed its 411 MB of fp32 weights at 1.8 TB/s (0.226 ms; cuBLAS's GEMV 0.165). At B <= 16
// the layer is bound by reading W once: 4 B FLOP per weight is far below what the FMA pipes
// take, so plain fp32 FFMA is both exact and at the floor (fc6: 0.137 ms at 3 TB/s).
//
// Here W (M x K, K contiguous) is read straight from global memory with 16-byte streaming loads
// (ld.global.cs: evict first, every weight is used once), GV_UNROLL x GV_ROWS of them in flight
// a lane. GV_LANES lanes sweep one row (8: each row's 128-byte lines whole, 4 rows a warp
// instruction; or 32), a warp owns GV_ROWS such row slots. The batch's slice of x (fp32, GV_NB
// columns, zero past B) sits in shared memory; every row a warp instruction covers reads the
// same x, so the read is a broadcast, and each x value read serves GV_ROWS rows: at GV_LANES =
// 32 a 16-column fp16 tile would read 4x the bytes of x per weight and be bound by shared
// memory. W is stored in the operand precision (GV_MODE: fp32, or fp16 / bf16, which halve the
// bytes; converted to fp32 in registers, products and sums in fp32).
//
// GV_MODE 3 stores TF32 weights in 2.5 bytes instead of fp32's 4: a TF32 value has 19
// significant bits. Its upper 16 bits (sign, exponent, 7 mantissa bits: bf16's bits) form an
// M x K 16-bit plane read in 16-byte pieces as bf16's are; the next 3 mantissa bits follow that
// plane as nibbles, one 32-bit word per piece (weight e in bits 4e..4e+2). A lane loads its
// piece's word beside the piece (a row's 8 lanes read 32 contiguous bytes), and widen rebuilds
// (hi << 16) | (nibble << 13), the TF32 value exactly, for the same fp32 FFMA against x in fp32:
// the products of TF32 operands (x unrounded: no less accurate) at 5/8 of the bytes. The host
// rounds W to TF32 once when it prepares the layer (gpu/gemv.py, tf32_planes).
//
// k is cut into gridDim.y slices of k_slice; each row slot ends with GV_ROWS x GV_NB sums spread
// over its lanes, combined by a reduce-scatter (at each shuffle level a lane keeps half of its
// values and adds the partner's copy of them: 14 shuffles for 16 values over 8 lanes instead of
// 48), then written as fp32 partials; the last block of a row tile to finish (an atomic ticket)
// adds the slices in slice order plus the bias: deterministic, one launch, and it resets its ticket
// for the next launch. With one slice the sums go straight to y.
//
// A block owns groups x GV_WARPS x GV_ROWS x (32 / GV_LANES) rows (a warp pass at a time), so
// that staging x is paid once for many rows: at B = 16 with fp16 weights a 32-row tile would
// read as many bytes of x from L2 as of W.
//
// Launch: grid (ceil(M / tile rows), slices), 32 * GV_WARPS threads, dynamic shared memory
// GV_NB * k_slice * 4 bytes; k_slice a multiple of GV_LANES * GV_UNROLL pieces, K of pieces
// (gpu/gemv.py computes all of this). A prepared run serves one stream at a time (the
// partials and tickets are its own).

// Measured (H100 80GB HBM3, 2026-11-25, bench Op Time, copy ceiling 2.97-2.99 TB/s; predicted
// before: fc6 fp32 0.150 ms, fp16 0.080, fc7 0.010), with x's pieces side by side in shared
// memory (before GV_HALVES): fc6 fp32 0.166-0.169 ms at B=1-2 (2.43-2.48 TB/s, 82% of the copy
// ceiling), 0.176-0.188 at B=4-16 (74-78%), cuBLAS SGEMM 0.179-0.327; fp16 0.095-0.101 at
// B=1-4 (68-73%), 0.117 at 8, 0.27 at 12-16 (26%), where split-K (rung 27) is faster: there a
// 512-byte weight load of a warp cost 16 conflicted 128-bit x reads, 128 shared-memory cycles
// against the 40 the stream allows. With the x planes (2026-11-28): 0.105-0.117 at 8, 0.167 at
// 16. fc7 0.018-0.039 ms at B=1-16 (cuBLAS 0.026-0.068), bound by latency, not bytes.
// GV_MODE 3 (TF32 in 2.5 bytes): fc6 0.113-0.118 ms at B=1-4 (predicted 0.105-0.12; gemv-fp32
// 0.161-0.171, cuBLAS TF32 0.152), but 0.175-0.182 at 8-16 like fp32: there the x reads and
// 8-16 FMAs a weight bound the loop, not the bytes.

#include "common.cuh"

#ifndef GV_MODE
#define GV_MODE 0  // weights: 0 fp32, 1 fp16, 2 bf16 (bit patterns), 3 tf32 (two planes)
#endif
#ifndef GV_NB
#define GV_NB 4  // batch columns a thread keeps (a power of two >= B)
#endif
#ifndef GV_ROWS
#define GV_ROWS 4  // rows of W a warp
#endif
#ifndef GV_WARPS
#define GV_WARPS 8
#endif
#ifndef GV_UNROLL
#define GV_UNROLL 2  // 16-byte pieces a row a lane has in flight
#endif
#ifndef GV_LANES
#define GV_LANES 8  // lanes sweeping one row (8: 128-byte lines, 4 rows a warp; or 32)
#endif

#if GV_MODE == 0
#define GV_VEC 4  // weights in one 16-byte piece
#else
#define GV_VEC 8
#endif
#define GV_VALUES (GV_ROWS * GV_NB)
#define GV_SLOTS (32 / GV_LANES)  // rows a warp's load instruction covers
// x in shared memory per batch column as GV_HALVES planes: plane h holds quad h of every
// piece's GV_VEC values, so the lanes of a read take consecutive 16-byte words. (Pieces side by
// side would put a piece's two quads 32 bytes apart for fp16: a 2-way bank conflict on every
// read, 8 wavefronts for a 128-bit read of 8 lanes instead of 4.)
#define GV_HALVES (GV_VEC / 4)

static_assert((GV_VALUES & (GV_VALUES - 1)) == 0, "GV_ROWS x GV_NB must be a power of two");
static_assert(GV_LANES == 8 || GV_LANES == 32, "GV_LANES must be 8 or 32");

// One 16-byte piece of W in fp32. lo: GV_MODE 3's word of the piece (the 3 mantissa bits below
// weight e's upper 16 bits in bits 4e..4e+2), unused otherwise.
__device__ __forceinline__ void widen(const uint4 v, const unsigned lo, float (&f)[GV_VEC]) {
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#if GV_MODE == 0
    f[i] = __uint_as_float(u[i]);
#elif GV_MODE == 1
    const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
    f[2 * i] = h.x;
    f[2 * i + 1] = h.y;
#elif GV_MODE == 2
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
#else
    f[2 * i] = __uint_as_float((u[i] << 16) | ((lo >> (8 * i)) & 7u) << 13);
    f[2 * i + 1] = __uint_as_float((u[i] & 0xffff0000u) | ((lo >> (8 * i + 4)) & 7u) << 13);
#endif
  }
}

// Reduce-scatter of N values over the lanes W, W/2, ..., 1 apart: at a level where N > 1 the
// lanes with bit W set keep the upper half (partner's copy added), the others the lower half;
// once one value is left the remaining levels are plain butterfly sums.
template <int N, int W>
__device__ __forceinline__ void reduce_scatter(float (&v)[GV_VALUES], int lane) {
  if constexpr (W > 0) {
    if constexpr (N == 1) {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], W);
      reduce_scatter<1, W / 2>(v, lane);
    } else {
      const bool upper = lane & W;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float send = upper ? v[i] : v[i + N / 2];
        const float keep = upper ? v[i + N / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, W);
      }
      reduce_scatter<N / 2, W / 2>(v, lane);
    }
  }
}

// Which of its row group's GV_VALUES sums this lane's v[0] holds (v[j] holds that + j).
__device__ __forceinline__ int scattered_index(int lane) {
  int n = GV_VALUES, first = 0;
#pragma unroll
  for (int w = GV_LANES / 2; w >= 1; w >>= 1) {
    if (n > 1) {
      if (lane & w) first += n / 2;
      n /= 2;
    }
  }
  return first;
}

// The warp's GV_ROWS x GV_SLOTS rows from row0 (row row0 + r * GV_SLOTS + slot, slot = lane /
// GV_LANES) over this block's k slice: each slot's GV_VALUES sums, scattered over its lanes,
// written to y (one slice) or to this slice's partials. The slots read the same x, so each
// shared-memory read is a broadcast: one 128-byte wavefront for 4 rows with 8 lanes a row.
__device__ __forceinline__ void warp_rows(const float4* xs4, const char* w, const float* bias,
                                          float* out, int row0, int lane, int B, int M,
                                          int K, int k0, int k_len, int quads, bool single) {
  const int slot = lane / GV_LANES, sub = lane % GV_LANES;
  const char* rows[GV_ROWS];
#pragma unroll
  for (int r = 0; r < GV_ROWS; ++r)  // rows past M re-read row M-1; their sums are dropped
    rows[r] = w + ((size_t)min(row0 + r * GV_SLOTS + slot, M - 1) * K + k0) * (16 / GV_VEC);
#if GV_MODE == 3
  // The second plane follows the M x K 16-bit one: a row's words are K / 8 contiguous words.
  const unsigned* lo_rows[GV_ROWS];
#pragma unroll
  for (int r = 0; r < GV_ROWS; ++r)
    lo_rows[r] = reinterpret_cast<const unsigned*>(w + (size_t)M * K * 2) +
                 ((size_t)min(row0 + r * GV_SLOTS + slot, M - 1) * K + k0) / GV_VEC;
#endif
  const int pieces = k_len / GV_VEC;
  float acc[GV_VALUES];
#pragma unroll
  for (int i = 0; i < GV_VALUES; ++i) acc[i] = 0.f;

  for (int c0 = 0; c0 < pieces; c0 += GV_LANES * GV_UNROLL) {
    uint4 wv[GV_UNROLL][GV_ROWS];
    unsigned lo[GV_UNROLL][GV_ROWS];  // GV_MODE 3's nibble words (0 and unused otherwise)
#pragma unroll
    for (int u = 0; u < GV_UNROLL; ++u) {
      const int c = c0 + GV_LANES * u + sub;
#pragma unroll
      for (int r = 0; r < GV_ROWS; ++r) {
        wv[u][r] = c < pieces ? __ldcs(reinterpret_cast<const uint4*>(rows[r]) + c)
                              : make_uint4(0, 0, 0, 0);
#if GV_MODE == 3
        lo[u][r] = c < pieces ? __ldcs(lo_rows[r] + c) : 0u;
#else
        lo[u][r] = 0u;
#endif
      }
    }
#pragma unroll
    for (int u = 0; u < GV_UNROLL; ++u) {
      const int c = c0 + GV_LANES * u + sub;  // x past k_len is zero in shared memory
      float wf[GV_ROWS][GV_VEC];
#pragma unroll
      for (int r = 0; r < GV_ROWS; ++r) widen(wv[u][r], lo[u][r], wf[r]);
#pragma unroll
      for (int b = 0; b < GV_NB; ++b) {
        float xv[GV_VEC];
#pragma unroll
        for (int h = 0; h < GV_VEC / 4; ++h) {
          const float4 q = xs4[b * quads + h * (quads / GV_HALVES) + c];
          xv[4 * h] = q.x, xv[4 * h + 1] = q.y, xv[4 * h + 2] = q.z, xv[4 * h + 3] = q.w;
        }
#pragma unroll
        for (int r = 0; r < GV_ROWS; ++r)
#pragma unroll
          for (int e = 0; e < GV_VEC; ++e)
            acc[r * GV_NB + b] = fmaf(wf[r][e], xv[e], acc[r * GV_NB + b]);
      }
    }
  }

  reduce_scatter<GV_VALUES, GV_LANES / 2>(acc, sub);
  constexpr int kept = GV_VALUES >= GV_LANES ? GV_VALUES / GV_LANES : 1;
  constexpr int copies = GV_VALUES >= GV_LANES ? 1 : GV_LANES / GV_VALUES;  // same sum held
  if (sub % copies) return;
  const int first = scattered_index(sub);
#pragma unroll
  for (int j = 0; j < kept; ++j) {
    const int r = (first + j) / GV_NB, b = (first + j) % GV_NB;
    const int m = row0 + r * GV_SLOTS + slot;
    if (m < M && b < B) out[(size_t)b * M + m] = acc[j] + (single ? bias[m] : 0.f);
  }
}

extern "C" __global__ void __launch_bounds__(32 * GV_WARPS)
gemv_stream(const float* __restrict__ x, const void* __restrict__ w,
            const float* __restrict__ bias, float* __restrict__ y, float* __restrict__ partial,
            int* __restrict__ tickets, int B, int M, int K, int k_slice, int groups) {
  extern __shared__ float4 xs4[];  // [GV_NB][GV_HALVES][k_slice / GV_VEC]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile_rows = GV_WARPS * GV_ROWS * GV_SLOTS * groups, m0 = blockIdx.x * tile_rows;
  const int k0 = blockIdx.y * k_slice;
  const int k_len = min(K - k0, k_slice);
  const int quads = k_slice / 4;

  for (int i = threadIdx.x; i < GV_NB * quads; i += 32 * GV_WARPS) {
    const int b = i / quads, q = i - b * quads;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (b < B && 4 * q < k_len)
      v = *reinterpret_cast<const float4*>(x + (size_t)b * K + k0 + 4 * q);
    xs4[b * quads + (q % GV_HALVES) * (quads / GV_HALVES) + q / GV_HALVES] = v;
  }
  __syncthreads();

  const bool single = gridDim.y == 1;
  float* out = single ? y : partial + (size_t)blockIdx.y * B * M;
  for (int g = 0; g < groups; ++g)  // the block's row groups share its x slice
    warp_rows(xs4, reinterpret_cast<const char*>(w), bias, out,
              m0 + (g * GV_WARPS + warp) * GV_ROWS * GV_SLOTS, lane, B, M, K, k0, k_len, quads,
              single);
  if (single) return;

  __threadfence();  // this block's partials visible before its ticket is taken
  __syncthreads();
  const bool last =
      threadIdx.x == 0 && atomicAdd(&tickets[blockIdx.x], 1) == (int)gridDim.y - 1;
  if (!__syncthreads_or(last)) return;
  __threadfence();
  for (int i = threadIdx.x; i < tile_rows * B; i += 32 * GV_WARPS) {
    const int b = i / tile_rows, m = m0 + (i - b * tile_rows);
    if (m >= M) continue;
    const float* p = partial + (size_t)b * M + m;
    const size_t plane = (size_t)B * M;
    float s = 0.f;
    int z = 0;
    for (; z + 8 <= (int)gridDim.y; z += 8) {  // 8 loads in flight, added in slice order
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __ldcg(p + (z + i) * plane);
#pragma unroll
      for (int i = 0; i < 8; ++i) s += v[i];
    }
    for (; z < (int)gridDim.y; ++z) s += __ldcg(p + z * plane);
    y[(size_t)b * M + m] = s + bias[m];
  }
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}
