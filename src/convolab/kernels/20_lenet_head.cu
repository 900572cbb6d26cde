// Rung 20 — lenet_head: the fused LeNet's layers after the two fused conv+pool layers (rungs
// 17-19 do C1 and C3): F5 (1024 -> 32) + ReLU, F6 (32 -> 10), softmax in one kernel, so the
// 1024 features of an image are read once and only 10 probabilities are written.
//
// F5 is a skinny GEMM (B x 1024) . (1024 x 32): 41 MB of features and 0.33 G FMAs at
// B=10000, ~0.014 ms of HBM and ~0.012 ms of FMA pipes on an H100. What limits it is the
// weights, not the FLOPs: 128 KB of them do not stay in L1, so a kernel that re-reads them per
// tile of images waits on L2 (docs/fused.md has the variants that did).
//
// The kernel is persistent: one block per SM (grid = min(SMs, tiles)) keeps all F5 weights
// (1024 x 32 fp32 = 128 KB, pre-transposed on the host) in shared memory, loaded once, and
// walks tiles of HEAD_IMGS images (tile = block, block + grid, ...: 625 tiles of 16 at
// B=10000 are 4.7 per SM, so the last round wastes ~5 %). Warp w owns the k slice
// [128w, 128w + 128) for every tile: its weights and its features are read by no other warp,
// so the k loop needs no block barrier, only a per-warp cp.async ring of HEAD_NS chunks
// (HEAD_IMGS x HEAD_KC features) and __syncwarp. A lane holds a HEAD_TIL x HEAD_LO tile
// (images x outputs): per 4 k it reads HEAD_TIL float4 of features and 4 x HEAD_LO/4 float4
// of weights from shared memory (broadcasts, no bank conflicts) for 4 x HEAD_TIL x HEAD_LO
// FMAs. At the end of a tile the 8 warps' partial sums meet in shared memory (one barrier,
// double-buffered when it fits) and the block finishes the tile: bias + ReLU, F6 (each image
// shared by HEAD_THREADS / HEAD_IMGS lanes, partial logits summed by xor shuffles) and the
// softmax, fp32, expf, fixed summation order (deterministic). Images past B read the last
// image's row (no branch in the copies) and write nothing.
//
// Launch: grid min(SMs, ceil(B / HEAD_IMGS)), HEAD_THREADS threads, head_smem_bytes() of
// dynamic shared memory (gpu/lenet_head.py computes the same number and raises the limit).
//
// Measured: 0.032 ms with the features from HBM vs 0.050-0.063 for cuBLAS' F5 matmul alone
// (H100, B=10000); 108 registers, 214 KB shared memory.

#include "common.cuh"

#ifndef HEAD_IMGS
#define HEAD_IMGS 16  // images per tile
#endif
#ifndef HEAD_LO
#define HEAD_LO 4  // outputs per lane (4 or 8); HEAD_LO image groups x 32 / HEAD_LO output groups
#endif
#ifndef HEAD_KC
#define HEAD_KC 32  // k per ring chunk
#endif
#ifndef HEAD_NS
#define HEAD_NS 3  // ring chunks per warp (HEAD_NS - 1 in flight while one is consumed)
#endif
#ifndef HEAD_RB
#define HEAD_RB 2  // partial-sum buffers: 2 = one barrier a tile, 1 = two (less shared memory)
#endif

#define HEAD_WARPS 8
#define HEAD_THREADS (32 * HEAD_WARPS)
#define HEAD_IN 1024
#define HEAD_HID 32
#define HEAD_OUT 10
#define HEAD_KW (HEAD_IN / HEAD_WARPS)       // k slice of a warp
#define HEAD_CPT (HEAD_KW / HEAD_KC)         // ring chunks per tile
#define HEAD_OG (HEAD_HID / HEAD_LO)         // output groups in a warp
#define HEAD_IG (32 / HEAD_OG)               // image groups in a warp
#define HEAD_TIL (HEAD_IMGS / HEAD_IG)       // images per lane
#define HEAD_XS (HEAD_KC + 4)                // feature row stride: IG consecutive rows hit
                                             // different bank quads
#define HEAD_CHUNK (HEAD_IMGS * HEAD_XS)     // floats per ring chunk
#define HEAD_EPT (HEAD_THREADS / HEAD_IMGS)  // epilogue threads per image
#define HEAD_HPT (HEAD_HID / HEAD_EPT)       // hidden units per epilogue thread
#define HEAD_WS_FLOATS (HEAD_IN * HEAD_HID)
#define HEAD_RING_FLOATS (HEAD_WARPS * HEAD_NS * HEAD_CHUNK)
#define HEAD_RED_FLOATS (HEAD_WARPS * HEAD_IMGS * HEAD_HID)
#define HEAD_SMEM_BYTES (4 * (HEAD_WS_FLOATS + HEAD_RING_FLOATS + HEAD_RB * HEAD_RED_FLOATS))

#if HEAD_LO != 4 && HEAD_LO != 8
#error "HEAD_LO must be 4 or 8"
#endif
#if HEAD_IMGS % HEAD_IG != 0 || HEAD_THREADS % HEAD_IMGS != 0 || HEAD_HID % HEAD_EPT != 0
#error "HEAD_IMGS must be a multiple of HEAD_LO and divide 256 into >= 1 hidden unit a thread"
#endif
#if HEAD_KW % HEAD_KC != 0 || HEAD_KC % 4 != 0 || 128 % HEAD_KC != 0
#error "HEAD_KC must be a multiple of 4 dividing 128"
#endif
#if HEAD_NS < 2 || (HEAD_RB != 1 && HEAD_RB != 2)
#error "HEAD_NS >= 2, HEAD_RB 1 or 2"
#endif
#if HEAD_SMEM_BYTES > 227 * 1024
#error "shared memory over the 227 KB a block may have on sm_90"
#endif
#ifdef HEAD_EXPECT_SMEM  // tests/test_gpu_head.py: the host's head_smem_bytes() agrees
static_assert(HEAD_SMEM_BYTES == HEAD_EXPECT_SMEM, "host and kernel disagree on shared memory");
#endif

__device__ __forceinline__ float head_pick(const float4 v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

extern "C" __global__ void __launch_bounds__(HEAD_THREADS, 1)
lenet_head(const float* __restrict__ feat, const float* __restrict__ w5t,
           const float* __restrict__ b5, const float* __restrict__ w6,
           const float* __restrict__ b6, float* __restrict__ probs, int B) {
  extern __shared__ __align__(16) float head_smem[];
  float* const ws = head_smem;                                   // [1024][32] F5 weights
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* const ring = head_smem + HEAD_WS_FLOATS + warp * HEAD_NS * HEAD_CHUNK;
  float* const red = head_smem + HEAD_WS_FLOATS + HEAD_RING_FLOATS;  // [RB][warp][img][32]
  const int ntiles = (B + HEAD_IMGS - 1) / HEAD_IMGS;
  const int mytiles =
      ntiles > (int)blockIdx.x ? (ntiles - (int)blockIdx.x + (int)gridDim.x - 1) / gridDim.x : 0;
  const int nchunks = mytiles * HEAD_CPT;

  // Copy ring chunk s (tile s / CPT of this block, k chunk s % CPT of this warp's slice),
  // and with the first tile's chunks this warp's weights. One commit group per s, empty past
  // the end, so wait_group counts stay uniform.
  auto load = [&](int s) {
    if (s < nchunks) {
      const int tile = (int)blockIdx.x + (s / HEAD_CPT) * (int)gridDim.x;
      const int k0 = warp * HEAD_KW + (s % HEAD_CPT) * HEAD_KC;
      float* const dst = ring + (s % HEAD_NS) * HEAD_CHUNK;
#pragma unroll
      for (int e = lane; e < HEAD_IMGS * HEAD_KC / 4; e += 32) {
        const int r = e / (HEAD_KC / 4), q = e % (HEAD_KC / 4);
        const long long img = min(tile * HEAD_IMGS + r, B - 1);
        cp_async16(dst + r * HEAD_XS + 4 * q, feat + img * HEAD_IN + k0 + 4 * q);
      }
      if (s < HEAD_CPT) {
#pragma unroll
        for (int e = lane; e < HEAD_KC * HEAD_HID / 4; e += 32)
          cp_async16(ws + k0 * HEAD_HID + 4 * e, w5t + k0 * HEAD_HID + 4 * e);
      }
    }
    cp_async_commit();
  };

  // Epilogue constants: thread (eimg, q) sums hidden units q + EPT m over the warps.
  const int q = threadIdx.x % HEAD_EPT, eimg = threadIdx.x / HEAD_EPT;
  float b5r[HEAD_HPT], w6r[HEAD_OUT][HEAD_HPT], b6r[HEAD_OUT];
#pragma unroll
  for (int m = 0; m < HEAD_HPT; ++m) {
    b5r[m] = __ldg(&b5[q + HEAD_EPT * m]);
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) w6r[o][m] = __ldg(&w6[o * HEAD_HID + q + HEAD_EPT * m]);
  }
#pragma unroll
  for (int o = 0; o < HEAD_OUT; ++o) b6r[o] = __ldg(&b6[o]);

  const int og = lane % HEAD_OG, ig = lane / HEAD_OG;  // outputs og*LO.., images i*IG + ig
  float acc[HEAD_TIL][HEAD_LO];
#pragma unroll
  for (int i = 0; i < HEAD_TIL; ++i)
#pragma unroll
    for (int j = 0; j < HEAD_LO; ++j) acc[i][j] = 0.f;

#pragma unroll
  for (int s = 0; s < HEAD_NS - 1; ++s) load(s);
  int n = 0;  // tiles finished by this block
  for (int s = 0; s < nchunks; ++s) {
    cp_async_wait<HEAD_NS - 2>();
    __syncwarp();  // chunk s visible to all lanes; all lanes are done with chunk s - 1
    load(s + HEAD_NS - 1);  // into chunk s - 1's slot
    const float* const xs = ring + (s % HEAD_NS) * HEAD_CHUNK + ig * HEAD_XS;
    const float* const wk = ws + (warp * HEAD_KW + (s % HEAD_CPT) * HEAD_KC) * HEAD_HID +
                            og * HEAD_LO;
#pragma unroll
    for (int kk = 0; kk < HEAD_KC; kk += 4) {
      float4 xv[HEAD_TIL];
#pragma unroll
      for (int i = 0; i < HEAD_TIL; ++i)
        xv[i] = *reinterpret_cast<const float4*>(xs + i * HEAD_IG * HEAD_XS + kk);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
#pragma unroll
        for (int v = 0; v < HEAD_LO / 4; ++v) {
          const float4 wv = *reinterpret_cast<const float4*>(wk + (kk + e) * HEAD_HID + 4 * v);
#pragma unroll
          for (int i = 0; i < HEAD_TIL; ++i) {
            const float x = head_pick(xv[i], e);
            acc[i][4 * v] = fmaf(x, wv.x, acc[i][4 * v]);
            acc[i][4 * v + 1] = fmaf(x, wv.y, acc[i][4 * v + 1]);
            acc[i][4 * v + 2] = fmaf(x, wv.z, acc[i][4 * v + 2]);
            acc[i][4 * v + 3] = fmaf(x, wv.w, acc[i][4 * v + 3]);
          }
        }
      }
    }
    if (s % HEAD_CPT != HEAD_CPT - 1) continue;

    // Tile done: partial sums out, one barrier, then the block finishes the tile.
    float* const rb = red + (n % HEAD_RB) * HEAD_RED_FLOATS;
#pragma unroll
    for (int i = 0; i < HEAD_TIL; ++i) {
#pragma unroll
      for (int v = 0; v < HEAD_LO / 4; ++v)
        *reinterpret_cast<float4*>(rb + (warp * HEAD_IMGS + i * HEAD_IG + ig) * HEAD_HID +
                                   og * HEAD_LO + 4 * v) =
            make_float4(acc[i][4 * v], acc[i][4 * v + 1], acc[i][4 * v + 2], acc[i][4 * v + 3]);
#pragma unroll
      for (int j = 0; j < HEAD_LO; ++j) acc[i][j] = 0.f;
    }
    __syncthreads();
    float logit[HEAD_OUT];
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) logit[o] = 0.f;
#pragma unroll
    for (int m = 0; m < HEAD_HPT; ++m) {
      float h = b5r[m];
#pragma unroll
      for (int w = 0; w < HEAD_WARPS; ++w) h += rb[(w * HEAD_IMGS + eimg) * HEAD_HID + q + HEAD_EPT * m];
      h = fmax_nan(h, 0.f);
#pragma unroll
      for (int o = 0; o < HEAD_OUT; ++o) logit[o] = fmaf(h, w6r[o][m], logit[o]);
    }
    // Sum the partial logits over the image's EPT lanes (xor keeps them inside the group,
    // and a + b == b + a, so every lane ends with the same bits).
#pragma unroll
    for (int off = HEAD_EPT / 2; off > 0; off /= 2)
#pragma unroll
      for (int o = 0; o < HEAD_OUT; ++o) logit[o] += __shfl_xor_sync(0xffffffffu, logit[o], off);
    float mx = __int_as_float(0xff800000u);  // -inf (NVRTC has no INFINITY)
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) {
      logit[o] += b6r[o];
      mx = fmaxf(mx, logit[o]);
    }
    float sum = 0.f;
#pragma unroll
    for (int o = 0; o < HEAD_OUT; ++o) {
      logit[o] = expf(logit[o] - mx);
      sum += logit[o];
    }
    const float inv = 1.f / sum;
    const int img = ((int)blockIdx.x + n * (int)gridDim.x) * HEAD_IMGS + eimg;
    if (img < B) {
#pragma unroll
      for (int o = 0; o < HEAD_OUT; ++o)
        if (o % HEAD_EPT == q) probs[(long long)img * HEAD_OUT + o] = logit[o] * inv;
    }
#if HEAD_RB == 1
    __syncthreads();  // the next tile's partial sums overwrite this buffer
#endif
    ++n;
  }
  cp_async_wait_all();
}
