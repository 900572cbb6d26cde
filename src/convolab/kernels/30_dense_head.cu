// Kernel 30 — dense_head: the layers after the last conv block of ANY zoo model (Flatten, then
// Linear [+ReLU] ... Linear, softmax) in one launch, generated from the model's layer list by
// defines. Kernel 20 does the same for ece408 alone (F5 1024 -> 32, F6 32 -> 10) with all F5
// weights resident in shared memory; that does not carry over: ece408-mxnet's first linear
// layer has 4704 x 10 weights (188 KB) and eecs498's 2904 x 10, and a head of another shape
// would need its own hand tuning. Here the first linear layer (the only large one) is a
// register-tiled skinny GEMM over k chunks, and the layers after it are small loops on a tile's
// activations in shared memory.
//
// Work split: a block finishes a tile of DH_IMGS images (one tile a block). The first layer's
// k runs in chunks of DH_KC: the chunk's features (DH_IMGS x DH_KC) and weights (DH_KC x N1P,
// pre-transposed and zero-padded on the host to N1P = DH_OG * DH_TO outputs and a whole number
// of chunks) are staged in shared memory, double-buffered through registers (the next chunk's
// global loads are in flight while this one is multiplied; one barrier a chunk). Thread
// (kg, ig, og) accumulates DH_TI images x DH_TO outputs over the chunk's k = kg, kg + KS, ...:
// each weight read from shared memory serves DH_TI images and each feature DH_TO outputs, and
// the KS k groups meet at the end of the tile in shared memory (fixed order). Then bias (+ReLU),
// the remaining layers (weights from L1/L2, tiny), softmax, and the argmax, each image's sums in
// a fixed order whatever its tile: results are deterministic and independent of B.
//
// What it costs: reading the features, F x 4 bytes an image from HBM (188 MB for ece408-mxnet
// at B=10000, ~60 us at 3.2 TB/s); the first layer's weights are re-read from L2 once a tile,
// F x N1P x 4 / DH_IMGS bytes an image (1.2-4 B per feature at the zoo's shapes), and its
// F x N1 FMAs an image are 0.1-0.5 G at B=10000 (5-15 us of FMA pipes). Outputs: N_classes x 4
// bytes of probabilities and/or 1 byte of label an image, staged in shared memory and written
// coalesced.
//
// NaN policy (conv_cpu): a NaN feature makes every first-layer output of its image NaN (NaN
// times any weight, zero included, is NaN), ReLU is fmax_nan, so the image's probabilities are
// NaN and its label is DH_NAN_LABEL; no other image is touched. Features past F in the last
// chunk are zeros, not reads; images past B read the last image's row and write nothing.
//
// Launch: grid ceil(B / DH_IMGS), DH_THREADS threads, smem_bytes() of dynamic shared memory
// (gpu/dense_head.py computes the same number).
//
// Measured (H100, B=10000, imgs 32, kc 64, probs + labels): ece408 0.057 ms (kernel 20: 0.037,
// its 128 KB of F5 weights stay in shared memory), ece408-mxnet 0.100 ms (1.9 TB/s of
// features), eecs498 0.069 ms (1.7 TB/s); max |p - p_fp64| <= 4e-7. Not the feature bytes:
// Nsight Compute (H200, mxnet, 91 us) has DRAM at 43 % and L1 at 82 % (the k loop's 9
// shared-memory reads for 20 FMAs a thread), and 313 tiles fill 2-3 of the 4 blocks an SM
// holds (SMs active 79 % of the time); fp16 features were slower (99 us). 40-image tiles with 5
// images a thread and k chunks of 128 (250 tiles, 1.9 an SM: the host's default now) took
// 80.7 / 53.0 us against 89.7 / 58.8 (H100, mxnet / eecs498); 8 images a thread 104.8 / 68.2
// (docs/raw.md; rows of KC + 4 below: 34.0 / 52.8 us on the H200, 3.4-3.6 TB/s of features).

#include "common.cuh"

#ifndef DH_F
#define DH_F 1024  // features an image (the flattened pooled output of the last conv block)
#endif
#ifndef DH_L
#define DH_L 2  // linear layers (1..4)
#endif
#ifndef DH_N1
#define DH_N1 32  // outputs of linear layer 1..4 (0 past DH_L); the last one is the classes
#endif
#ifndef DH_N2
#define DH_N2 10
#endif
#ifndef DH_N3
#define DH_N3 0
#endif
#ifndef DH_N4
#define DH_N4 0
#endif
#ifndef DH_RELU
#define DH_RELU 1  // bit l: a ReLU follows linear layer l (0-based)
#endif
#ifndef DH_IMGS
#define DH_IMGS 32  // images a tile
#endif
#ifndef DH_TI
#define DH_TI 4  // images a thread (first layer)
#endif
#ifndef DH_TO
#define DH_TO 4  // outputs a thread (first layer)
#endif
#ifndef DH_OG
#define DH_OG 8  // output groups: N1P = DH_OG * DH_TO >= DH_N1
#endif
#ifndef DH_KC
#define DH_KC 64  // k a chunk
#endif
#ifndef DH_VEC
#define DH_VEC 4  // features loaded 4 at a time (needs DH_F % 4 == 0 and 16-byte aligned rows)
#endif

#define DH_THREADS 256
#define DH_NAN_LABEL 255
#define DH_N1P (DH_OG * DH_TO)
#define DH_IG (DH_IMGS / DH_TI)                 // image groups
#define DH_KS (DH_THREADS / (DH_IG * DH_OG))    // k groups
#define DH_KCH ((DH_F + DH_KC - 1) / DH_KC)     // chunks (the packed weights have DH_KCH * DH_KC rows)
// Feature row stride: KC + 4 keeps rows 16-byte aligned (float4 stores) and puts a warp's reads
// of (image group ig, k group kg) on banks 4 ig + kg, distinct (KC + 1: ig + kg, up to 4 a bank).
#define DH_XS (DH_KC + 4)
#define DH_XFL (DH_IMGS * DH_XS)                // floats a feature buffer
#define DH_WFL (DH_KC * DH_N1P)                 // floats a weight buffer
#define DH_XLD (DH_IMGS * DH_KC / (DH_VEC * DH_THREADS))            // feature loads a thread
#define DH_WLD ((DH_WFL + 4 * DH_THREADS - 1) / (4 * DH_THREADS))  // weight float4s a thread
#define DH_MAXW_A (DH_N1 > DH_N2 ? DH_N1 : DH_N2)
#define DH_MAXW_B (DH_N3 > DH_N4 ? DH_N3 : DH_N4)
#define DH_MAXW (DH_MAXW_A > DH_MAXW_B ? DH_MAXW_A : DH_MAXW_B)  // widest activation
#define DH_STAGE_FL (2 * (DH_XFL + DH_WFL))
#define DH_RED_FL (DH_KS * DH_IMGS * DH_N1P)
#define DH_UNION_FL (DH_STAGE_FL > DH_RED_FL ? DH_STAGE_FL : DH_RED_FL)
#define DH_SMEM_BYTES (4 * (DH_UNION_FL + 2 * DH_IMGS * DH_MAXW))

#if DH_L < 1 || DH_L > 4
#error "DH_L must be 1..4"
#endif
#if DH_N1P < DH_N1 || DH_IMGS % DH_TI != 0 || DH_KS * DH_IG * DH_OG != DH_THREADS
#error "DH_OG * DH_TO must cover DH_N1 and DH_IMGS / DH_TI * DH_OG must divide 256"
#endif
#if DH_KC % DH_KS != 0 || DH_KC % 4 != 0 || (DH_IMGS * DH_KC) % (DH_VEC * DH_THREADS) != 0
#error "DH_KC must be a multiple of 4 and of the k groups, and the feature chunk split evenly"
#endif
#if DH_VEC != 1 && DH_VEC != 4
#error "DH_VEC must be 1 or 4"
#endif
#if DH_VEC == 4 && DH_F % 4 != 0
#error "DH_VEC 4 needs DH_F % 4 == 0"
#endif
#if DH_SMEM_BYTES > 227 * 1024
#error "shared memory over the 227 KB a block may have on sm_90"
#endif
#ifdef DH_EXPECT_SMEM  // tests: the host's smem_bytes() agrees
static_assert(DH_SMEM_BYTES == DH_EXPECT_SMEM, "host and kernel disagree on shared memory");
#endif

// Layer widths, input first, and where each later layer's weights start in wtail / btail.
__device__ constexpr int dh_dim(int l) {
  return l == 0 ? DH_F : l == 1 ? DH_N1 : l == 2 ? DH_N2 : l == 3 ? DH_N3 : DH_N4;
}
__device__ constexpr int dh_woff(int l) {  // layer l >= 1 (0-based), weights (N_{l+1}, N_l)
  return l <= 1 ? 0 : dh_woff(l - 1) + dh_dim(l) * dh_dim(l - 1);
}
__device__ constexpr int dh_boff(int l) { return l <= 1 ? 0 : dh_boff(l - 1) + dh_dim(l); }

// flags: bit 0 write probs (B, N_classes) fp32; bit 1 write labels (B,) uint8.
extern "C" __global__ void __launch_bounds__(DH_THREADS)
dense_head(const float* __restrict__ feat, const float* __restrict__ w1t,
           const float* __restrict__ b1, const float* __restrict__ wtail,
           const float* __restrict__ btail, float* __restrict__ probs,
           unsigned char* __restrict__ labels, int B, int flags) {
  extern __shared__ __align__(16) float dh_smem[];
  float* const xs = dh_smem;                  // [2][IMGS][XS] features
  float* const ws = dh_smem + 2 * DH_XFL;     // [2][KC][N1P] first-layer weights
  float* const red = dh_smem;                 // [KS][IMGS][N1P], after the k loop
  float* const act = dh_smem + DH_UNION_FL;   // [2][IMGS][MAXW] activations
  const int t = threadIdx.x;
  const int og = t % DH_OG, ig = (t / DH_OG) % DH_IG, kg = t / (DH_OG * DH_IG);
  const int img0 = blockIdx.x * DH_IMGS;

  float xr[DH_XLD * DH_VEC];
  float4 wr[DH_WLD];
  auto fetch = [&](int c) {  // chunk c into registers
    const int k0 = c * DH_KC;
#pragma unroll
    for (int r = 0; r < DH_XLD; ++r) {
      const int e = t + r * DH_THREADS;
      const int row = e / (DH_KC / DH_VEC), k = k0 + (e % (DH_KC / DH_VEC)) * DH_VEC;
      const long long img = min(img0 + row, B - 1);
      const float* src = feat + img * DH_F + k;
#if DH_VEC == 4
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (k < DH_F) v = __ldg(reinterpret_cast<const float4*>(src));
      xr[4 * r] = v.x;
      xr[4 * r + 1] = v.y;
      xr[4 * r + 2] = v.z;
      xr[4 * r + 3] = v.w;
#else
      xr[r] = k < DH_F ? __ldg(src) : 0.f;
#endif
    }
#pragma unroll
    for (int r = 0; r < DH_WLD; ++r) {
      const int e = t + r * DH_THREADS;
      if (4 * e < DH_WFL)
        wr[r] = __ldg(reinterpret_cast<const float4*>(w1t + (long long)k0 * DH_N1P) + e);
    }
  };
  auto stage = [&](int buf) {  // registers into shared buffer buf
    float* const x = xs + buf * DH_XFL;
#pragma unroll
    for (int r = 0; r < DH_XLD; ++r) {
      const int e = t + r * DH_THREADS;
      const int row = e / (DH_KC / DH_VEC), kk = (e % (DH_KC / DH_VEC)) * DH_VEC;
#if DH_VEC == 4
      *reinterpret_cast<float4*>(x + row * DH_XS + kk) =
          make_float4(xr[4 * r], xr[4 * r + 1], xr[4 * r + 2], xr[4 * r + 3]);
#else
      x[row * DH_XS + kk] = xr[r];
#endif
    }
    float4* const w = reinterpret_cast<float4*>(ws + buf * DH_WFL);
#pragma unroll
    for (int r = 0; r < DH_WLD; ++r) {
      const int e = t + r * DH_THREADS;
      if (4 * e < DH_WFL) w[e] = wr[r];
    }
  };

  float acc[DH_TI][DH_TO];
#pragma unroll
  for (int i = 0; i < DH_TI; ++i)
#pragma unroll
    for (int o = 0; o < DH_TO; ++o) acc[i][o] = 0.f;

  fetch(0);
  stage(0);
  __syncthreads();
  for (int c = 0; c < DH_KCH; ++c) {
    if (c + 1 < DH_KCH) fetch(c + 1);  // in flight during this chunk's FMAs
    const float* const x = xs + (c & 1) * DH_XFL + ig * DH_XS;
    const float* const w = ws + (c & 1) * DH_WFL + og * DH_TO;
#pragma unroll
    for (int k = kg; k < DH_KC; k += DH_KS) {
      float xv[DH_TI], wv[DH_TO];
#pragma unroll
      for (int i = 0; i < DH_TI; ++i) xv[i] = x[i * DH_IG * DH_XS + k];
#pragma unroll
      for (int o = 0; o < DH_TO; ++o) wv[o] = w[k * DH_N1P + o];
#pragma unroll
      for (int i = 0; i < DH_TI; ++i)
#pragma unroll
        for (int o = 0; o < DH_TO; ++o) acc[i][o] = fmaf(xv[i], wv[o], acc[i][o]);
    }
    if (c + 1 < DH_KCH) stage((c + 1) & 1);  // the other buffer: read by nobody since the
                                             // barrier that ended chunk c - 1
    __syncthreads();
  }

  // The k groups meet (the staging buffers are free: the last barrier ended every read).
#pragma unroll
  for (int i = 0; i < DH_TI; ++i)
#pragma unroll
    for (int o = 0; o < DH_TO; ++o)
      red[(kg * DH_IMGS + ig + DH_IG * i) * DH_N1P + og * DH_TO + o] = acc[i][o];
  __syncthreads();
  for (int e = t; e < DH_IMGS * DH_N1; e += DH_THREADS) {
    const int i = e / DH_N1, o = e % DH_N1;
    float s = 0.f;
#pragma unroll
    for (int g = 0; g < DH_KS; ++g) s += red[(g * DH_IMGS + i) * DH_N1P + o];
    s += __ldg(&b1[o]);
    act[i * DH_MAXW + o] = (DH_RELU & 1) ? fmax_nan(s, 0.f) : s;
  }
  __syncthreads();

  // The small layers: activations ping-pong between act[0] and act[1].
#pragma unroll
  for (int l = 1; l < DH_L; ++l) {
    const int nin = dh_dim(l), nout = dh_dim(l + 1);
    const float* const in = act + ((l - 1) & 1) * DH_IMGS * DH_MAXW;
    float* const out = act + (l & 1) * DH_IMGS * DH_MAXW;
    const float* const wl = wtail + dh_woff(l);
    for (int e = t; e < DH_IMGS * nout; e += DH_THREADS) {
      const int i = e / nout, o = e % nout;
      float s = 0.f;
      for (int j = 0; j < nin; ++j) s = fmaf(in[i * DH_MAXW + j], __ldg(&wl[o * nin + j]), s);
      s += __ldg(&btail[dh_boff(l) + o]);
      out[i * DH_MAXW + o] = ((DH_RELU >> l) & 1) ? fmax_nan(s, 0.f) : s;
    }
    __syncthreads();
  }

  // Softmax and argmax, a thread an image, in place; then coalesced stores of the tile.
  constexpr int NC = dh_dim(DH_L);
  float* const z = act + ((DH_L - 1) & 1) * DH_IMGS * DH_MAXW;
  unsigned char* const lab = reinterpret_cast<unsigned char*>(dh_smem);  // red's place, unread now
  if (t < DH_IMGS) {
    float* const zi = z + t * DH_MAXW;
    float mx = CONVOLAB_NEG_INF;
    for (int o = 0; o < NC; ++o) mx = fmaxf(mx, zi[o]);
    float sum = 0.f;
    for (int o = 0; o < NC; ++o) {
      zi[o] = expf(zi[o] - mx);
      sum += zi[o];
    }
    const float inv = 1.f / sum;
    int best = 0;
    float top = zi[0] * inv;
    for (int o = 0; o < NC; ++o) {
      zi[o] *= inv;
      if (zi[o] > top) {  // first index of the largest, as numpy's argmax
        top = zi[o];
        best = o;
      }
    }
    lab[t] = sum == sum ? (unsigned char)best : (unsigned char)DH_NAN_LABEL;  // NaN: no class
  }
  __syncthreads();
  const int nimg = min(DH_IMGS, B - img0);
  if (flags & 1) {
    for (int e = t; e < nimg * NC; e += DH_THREADS)
      probs[(long long)img0 * NC + e] = z[(e / NC) * DH_MAXW + e % NC];
  }
  if ((flags & 2) && t < nimg) labels[img0 + t] = lab[t];
}
