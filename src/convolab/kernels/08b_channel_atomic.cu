// Rung 8b: channel-atomic: input-channel groups on different blocks, summed with atomicAdd.
//
// What it adds over rung 8a (channel-tree): the channel split leaves the block. The grid
// gets one more dimension, the channel group (CGROUP consecutive input channels); a block
// computes, for PIX output pixels and MPT output channels, only its group's share of the
// sum and adds it into y with atomicAdd. Because every group adds, y must start at the bias:
// a tiny kernel (init_bias) writes it first, inside the same run(), so both launches count
// in Op Time.
//
// Why / when it wins: it creates parallelism from C alone, across the whole GPU rather than
// inside one block. When the output is small (a few images, a 7x7 or 14x14 feature map) and
// C is large (hundreds of channels), the tree rung cannot launch enough blocks to occupy
// 132 SMs; this one launches ceil(C / CGROUP) times more. The price: y is read and written
// once per channel group (atomics resolve in L2, so that traffic is cheap but not free),
// the summation order is nondeterministic (results differ in the last bits run to run),
// and an extra launch. On large outputs with small C (LeNet's layers) the tree/direct
// form is faster: there is already plenty of parallelism and the atomics are pure cost.
// Inner loop as in 8a: PPT pixels x MPT output channels per thread, for load reuse.
//
// Measured (H100, best parameters of each rung, Op Time):
//   B=1  C=1024  9x9  M=256 K=3 : atomic 0.128 ms, tree 0.207 ms  (tiny output: atomic wins)
//   B=1  C=512  14x14 M=512 K=3 : atomic 0.191 ms, tree 0.198 ms  (about even)
//   B=4  C=256  16x16 M=128 K=3 : tree 0.101 ms, atomic 0.110 ms
//   B=32 and 256, C=64 32x32    : tree ahead by 2-6%
//   LeNet B=10000 conv1 / conv2 : tree 1.94 / 5.12 ms, atomic 2.89 / 7.08 ms
// Rule of thumb: atomic when B*Ho*Wo is below ~100 and C in the hundreds or more.

#ifndef PIX
#define PIX 128  // output pixels per block
#endif
#ifndef MPT
#define MPT 4  // output channels per thread
#endif
#ifndef PPT
#define PPT 2  // output pixels per thread (PIX apart, so loads stay coalesced)
#endif
#ifndef CGROUP
#define CGROUP 8  // input channels per block
#endif

extern "C" __global__ void init_bias(float* __restrict__ y, const float* __restrict__ bias,
                                     int M, int n_pix, long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = bias[(i / n_pix) % M];
    }
}

extern "C" __global__ void __launch_bounds__(PIX)
conv_channel_atomic(const float* __restrict__ x, const float* __restrict__ w,
                    float* __restrict__ y,
                    int B, int C, int H, int W, int M, int K, int S, int Ho, int Wo) {
    const int n_pix = Ho * Wo;
    const int pix_tiles = (n_pix + PIX * PPT - 1) / (PIX * PPT);
    const int m_tiles = (M + MPT - 1) / MPT;
    int block = blockIdx.x;
    const int pix_tile = block % pix_tiles;
    block /= pix_tiles;
    const int m_tile = block % m_tiles;
    const int b = block / m_tiles;
    const int c_begin = blockIdx.y * CGROUP;
    const int c_end = min(C, c_begin + CGROUP);
    (void)B;

    const int pix0 = pix_tile * PIX * PPT + threadIdx.x;
    if (pix0 >= n_pix) return;
    const int m0 = m_tile * MPT;
    const int kk = K * K;

    size_t x_off[PPT];
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
        const int pix = pix0 + i * PIX;
        const int ho = pix / Wo, wo = pix - (pix / Wo) * Wo;
        x_off[i] = pix < n_pix ? (size_t)ho * S * W + (size_t)wo * S : 0;
    }
    float acc[PPT][MPT];
#pragma unroll
    for (int i = 0; i < PPT; ++i)
#pragma unroll
        for (int j = 0; j < MPT; ++j) acc[i][j] = 0.0f;

    for (int c = c_begin; c < c_end; ++c) {
        const float* xc = x + (size_t)(b * C + c) * H * W;
        const float* wc = w + ((size_t)m0 * C + c) * kk;
        for (int p = 0; p < K; ++p) {
            for (int q = 0; q < K; ++q) {
                float wv[MPT];
#pragma unroll
                for (int j = 0; j < MPT; ++j)
                    wv[j] = (m0 + j < M) ? wc[(size_t)j * C * kk + p * K + q] : 0.0f;
#pragma unroll
                for (int i = 0; i < PPT; ++i) {
                    const float xv = xc[x_off[i] + p * W + q];
#pragma unroll
                    for (int j = 0; j < MPT; ++j) acc[i][j] += xv * wv[j];
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
        const int pix = pix0 + i * PIX;
        if (pix >= n_pix) continue;
#pragma unroll
        for (int j = 0; j < MPT; ++j) {
            if (m0 + j < M) atomicAdd(&y[((size_t)b * M + m0 + j) * n_pix + pix], acc[i][j]);
        }
    }
}
