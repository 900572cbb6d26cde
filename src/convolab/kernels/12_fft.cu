// Rung 12: fft: convolution as pointwise products in the frequency domain, overlap-add.
//
// What it adds: a different algorithm, not a faster loop. By the convolution theorem a
// K x K correlation becomes, after a 2-D FFT of size N x N, one complex multiply per
// frequency, and the sum over input channels stays a sum (FFT is linear), so
//   Yhat[b, m, tile, f] = sum_c Xhat[b, c, tile, f] * What[m, c, f].
// Overlap-add: the image is cut into non-overlapping L x L blocks (L = N - K + 1), each is
// zero-padded to N x N so that its full (linear, not circular) convolution with the flipped
// K x K kernel fits; the N x N results of neighbouring blocks overlap by K - 1 and are added.
// The "valid" correlation is the full convolution cropped by K - 1 on each side; a stride S
// keeps every S-th output (the FFT computes them all: strided layers pay S^2 extra).
//
// The host code (gpu/ladder_advanced.py) runs: extract_tiles -> cupy.fft.rfft2 (cuFFT)
// -> channel_mac (this file) -> cupy.fft.irfft2 -> overlap_add_crop (this file, bias here).
// The weights' transform What is computed once in prepare.
//
// Cost versus direct: per tile, direct needs M*C*K^2*L^2 multiply-adds; FFT needs
// C + M transforms of ~2.5 N^2 log2 N flops each plus M*C*N*(N/2+1) complex MACs (4 real
// FMAs each). For K=7, N=32 (L=26): direct 33,124 MACs per (m, c, tile), FFT ~2,200 for
// the MAC part: about 15x less arithmetic per channel pair. But the intermediates are large
// complex arrays (Xhat is ~2.6x the input, Yhat and the inverse ~6x the output for N=32)
// that make several round trips through DRAM, so on LeNet's layers, where C*M is 4 or 64
// and the direct kernels are memory-bound already, FFT is several times slower. It wins
// for large K (the arithmetic saving grows with K^2) and large C*M (the transforms are
// amortised over the channel sum), i.e. for layers unlike these. Measured (H100, B=10000):
// conv1 15.6 ms and conv2 15.3 ms (best FFT size 64) against 1.9 and 5.1 ms for the direct
// channel-tree rung; the error stays fp32-like (rel. L2 ~1e-7).


#ifndef MPT
#define MPT 4  // output channels per thread in channel_mac
#endif

// tiles[b, c, t, r, s] = x[b, c, ty*L + r, tx*L + s] for r, s < L inside the image, else 0.
extern "C" __global__ void extract_tiles(const float* __restrict__ x, float* __restrict__ tiles,
                                         int BC, int H, int W, int L, int N, int tiles_h,
                                         int tiles_w) {
    const long long per_image = (long long)tiles_h * tiles_w * N * N;
    const long long total = (long long)BC * per_image;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long bc = i / per_image;
        long long rest = i - bc * per_image;
        const int t = (int)(rest / (N * N));
        const int rs = (int)(rest - (long long)t * N * N);
        const int r = rs / N, s = rs - (rs / N) * N;
        const int ty = t / tiles_w, tx = t - (t / tiles_w) * tiles_w;
        const int h = ty * L + r, w = tx * L + s;
        tiles[i] = (r < L && s < L && h < H && w < W) ? x[(bc * H + h) * W + w] : 0.0f;
    }
}

// yhat[b, m, t, f] = sum_c xhat[b, c, t, f] * what[m, c, f]; complex as float2.
// Grid: x over (t, f) pairs, y over output-channel groups of MPT, z over images.
extern "C" __global__ void channel_mac(const float2* __restrict__ xhat,
                                       const float2* __restrict__ what,
                                       float2* __restrict__ yhat, int C, int M, int T, int F) {
    const int tf = blockIdx.x * blockDim.x + threadIdx.x;
    if (tf >= T * F) return;
    const int f = tf % F;
    const int m0 = blockIdx.y * MPT;
    const int b = blockIdx.z;
    float2 acc[MPT];
#pragma unroll
    for (int j = 0; j < MPT; ++j) acc[j] = make_float2(0.0f, 0.0f);
    for (int c = 0; c < C; ++c) {
        const float2 xv = xhat[((size_t)b * C + c) * T * F + tf];
#pragma unroll
        for (int j = 0; j < MPT; ++j) {
            if (m0 + j < M) {
                const float2 wv = what[((size_t)(m0 + j) * C + c) * F + f];
                acc[j].x += xv.x * wv.x - xv.y * wv.y;
                acc[j].y += xv.x * wv.y + xv.y * wv.x;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MPT; ++j) {
        if (m0 + j < M) yhat[((size_t)b * M + m0 + j) * T * F + tf] = acc[j];
    }
}

// y[b, m, ho, wo] = bias[m] + sum of the overlapping tile outputs at full-convolution
// position (ho*S + K-1, wo*S + K-1). A gather (each output reads its <= ceil(N/L)^2 tile
// contributions), so no atomics and a deterministic sum.
extern "C" __global__ void overlap_add_crop(const float* __restrict__ ytiles,
                                            const float* __restrict__ bias,
                                            float* __restrict__ y, int BM, int M, int Ho,
                                            int Wo, int K, int S, int L, int N, int tiles_h,
                                            int tiles_w) {
    const long long total = (long long)BM * Ho * Wo;
    const int T = tiles_h * tiles_w;
    for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < total;
         o += (long long)gridDim.x * blockDim.x) {
        const long long bm = o / ((long long)Ho * Wo);
        const int pix = (int)(o - bm * Ho * Wo);
        const int ho = pix / Wo, wo = pix - (pix / Wo) * Wo;
        const int i = ho * S + K - 1, j = wo * S + K - 1;
        const int ty_hi = min(i / L, tiles_h - 1), tx_hi = min(j / L, tiles_w - 1);
        const int ty_lo = max(0, (i - N + L) / L), tx_lo = max(0, (j - N + L) / L);
        float sum = bias[(int)(bm % M)];
        const float* base = ytiles + (size_t)bm * T * N * N;
        for (int ty = ty_lo; ty <= ty_hi; ++ty) {
            const int r = i - ty * L;
            if (r < 0 || r >= N) continue;
            for (int tx = tx_lo; tx <= tx_hi; ++tx) {
                const int s = j - tx * L;
                if (s < 0 || s >= N) continue;
                sum += base[((size_t)(ty * tiles_w + tx) * N + r) * N + s];
            }
        }
        y[o] = sum;
    }
}
