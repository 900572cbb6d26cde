// Rung 8a: channel-tree: the input-channel sum split across the threads of a block.
//
// What it adds over rungs 1-7: there, one thread walks the whole C*K*K reduction of an
// output element by itself. Here a block is a 2-D team: threadIdx.x picks an output pixel
// (PIX of them per block) and threadIdx.y picks a slice of the input channels (CSPLIT
// slices, channels interleaved c = slice, slice + CSPLIT, ...). Each thread accumulates its
// partial sums for MPT output channels in registers, writes them to shared memory, and the
// CSPLIT partials of one pixel are added pairwise in log2(CSPLIT) steps (a tree).
//
// Why: for layers with many input channels and few output pixels (deep layers, small
// images or small batches) one-thread-per-output leaves most of the GPU idle and each
// thread runs a long serial chain of dependent adds. Splitting C gives CSPLIT times more
// threads and CSPLIT shorter chains, at the cost of one shared-memory reduction per block.
// When C is small (LeNet's C=1 and C=4) the slices are empty or one channel long and the
// tree is pure overhead: then CSPLIT=1 (the host default picks CSPLIT from C; the tuner
// confirms it: 1.9 ms vs 10 ms with CSPLIT=4 on conv1) and this rung degenerates to
// a direct kernel with MPT-way output-channel coarsening (each input value loaded once is
// used for MPT output channels).
//
// channel-tree vs channel-atomic (08b): the tree keeps the whole reduction on chip and
// writes each output once, so it wins whenever there are enough output pixels to fill the
// GPU with blocks (large B*Ho*Wo). The atomic rung spreads channel groups over *blocks*
// instead, which is the only way to get parallelism when the output is too small to fill
// the SMs even with CSPLIT threads per pixel (small output, very large C).
//
// Each thread also computes PPT pixels (PIX apart, so warp loads stay coalesced) for MPT
// output channels: a weight loaded once feeds PPT FMAs and an input value feeds MPT,
// which is what keeps the loop from being bound by load instructions.
//
// Grid: x = pixel tiles * M tiles * B (flattened, so no 65535 limit on B).

#ifndef PIX
#define PIX 64  // output pixels per block (threadIdx.x)
#endif
#ifndef CSPLIT
#define CSPLIT 4  // channel slices per block (threadIdx.y); a power of two
#endif
#ifndef MPT
#define MPT 4  // output channels per thread
#endif
#ifndef PPT
#define PPT 2  // output pixels per thread (PIX apart, so loads stay coalesced)
#endif

#if (CSPLIT & (CSPLIT - 1)) != 0
#error "CSPLIT must be a power of two (the tree halves it)"
#endif

extern "C" __global__ void __launch_bounds__(PIX * CSPLIT)
conv_channel_tree(const float* __restrict__ x, const float* __restrict__ w,
                  const float* __restrict__ bias, float* __restrict__ y,
                  int B, int C, int H, int W, int M, int K, int S, int Ho, int Wo) {
    __shared__ float partial[CSPLIT][MPT][PPT * PIX];

    const int n_pix = Ho * Wo;
    const int pix_tiles = (n_pix + PIX * PPT - 1) / (PIX * PPT);
    const int m_tiles = (M + MPT - 1) / MPT;
    int block = blockIdx.x;
    const int pix_tile = block % pix_tiles;
    block /= pix_tiles;
    const int m_tile = block % m_tiles;
    const int b = block / m_tiles;
    (void)B;

    const int pix0 = pix_tile * PIX * PPT + threadIdx.x;
    const int m0 = m_tile * MPT;
    const int slice = threadIdx.y;
    const int kk = K * K;

    // Each thread owns PPT pixels x MPT output channels: a weight loaded once feeds PPT
    // FMAs and an input value feeds MPT. Pixels outside the image read offset 0 (in
    // bounds) and are never written.
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

    for (int c = slice; c < C; c += CSPLIT) {
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
    for (int i = 0; i < PPT; ++i)
#pragma unroll
        for (int j = 0; j < MPT; ++j) partial[slice][j][i * PIX + threadIdx.x] = acc[i][j];
    __syncthreads();

#pragma unroll
    for (int half = CSPLIT / 2; half > 0; half >>= 1) {
        if (slice < half) {
#pragma unroll
            for (int j = 0; j < MPT; ++j)
#pragma unroll
                for (int i = 0; i < PPT; ++i)
                    partial[slice][j][i * PIX + threadIdx.x] +=
                        partial[slice + half][j][i * PIX + threadIdx.x];
        }
        __syncthreads();
    }

    if (slice == 0) {
#pragma unroll
        for (int i = 0; i < PPT; ++i) {
            const int pix = pix0 + i * PIX;
            if (pix >= n_pix) continue;
#pragma unroll
            for (int j = 0; j < MPT; ++j) {
                if (m0 + j < M)
                    y[((size_t)b * M + m0 + j) * n_pix + pix] =
                        partial[0][j][i * PIX + threadIdx.x] + bias[m0 + j];
            }
        }
    }
}
