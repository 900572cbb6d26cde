// 21_conv_backward_gemm.cu — the data-movement halves of a GEMM-based convolution backward.
//
// Both gradients of a convolution are matrix products once the input is unrolled (im2col):
// with U_b the unrolled image b — one row per output pixel (oh, ow), one column per kernel tap
// (c, p, q) — the forward is Y_b = W_mat · U_b^T, so
//
//   dW_mat   = sum_b dY_b · U_b           (M x L) · (L x C*K*K), summed over the batch
//   dCols_b  = W_mat^T · dY_b             (C*K*K x M) · (M x L), then col2im folds it into dX_b
//
// The products go to cuBLAS (cupy.matmul, fp32, TF32 off). This file holds the two kernels
// around them:
//
// im2col_rows writes U in (b, pixel, tap) order. That is the layout in which dY_b (M x L, as it
// already lies in memory) multiplies U_b with no transpose, so the dW GEMM needs no copy of dY.
// Threads run fastest along the tap index, so the (large) U writes are coalesced; the X reads
// repeat across neighbouring taps and hit in L1/L2.
//
// col2im_gather is the adjoint of an im2col: every input pixel receives the column entries that
// were copied from it. As in the direct dX kernel it is written as a gather — one thread per dX
// element, visiting only the taps p == h (mod S) that can reach it — so there are no atomics and
// the result is bit-reproducible. It reads dCols in (b, tap, pixel) order, the layout the
// W_mat^T · dY_b product produces.
//
// The unrolled matrix is K*K/S^2 times larger than X, so the host runs both kernels on batch
// chunks with a bounded workspace. Indices are 64-bit: one chunk may hold more than 2^31 floats.

#ifndef GEMM_BLOCK
#define GEMM_BLOCK 256  // threads per block (the host launches with this)
#endif

// cols[b, oh*W_out+ow, (c*K+p)*K+q] = x[b, c, oh*S+p, ow*S+q], for the B images of the chunk.
extern "C" __global__ void im2col_rows(const float* __restrict__ x, float* __restrict__ cols,
                                       int B, int C, int H, int W, int K, int S, int H_out,
                                       int W_out) {
    const int taps = C * K * K;
    const int plane = H_out * W_out;
    const long long total = (long long)B * plane * taps;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int tap = (int)(i % taps);
        const long long rest = i / taps;
        const int pos = (int)(rest % plane);
        const int b = (int)(rest / plane);
        const int q = tap % K;
        const int p = (tap / K) % K;
        const int c = tap / (K * K);
        const int oh = pos / W_out;
        const int ow = pos - oh * W_out;
        cols[i] = x[(((long long)b * C + c) * H + oh * S + p) * W + ow * S + q];
    }
}

// dx[b, c, h, w] = sum of dcols[b, (c*K+p)*K+q, oh*W_out+ow] over the taps with
// oh*S+p == h and ow*S+q == w.
extern "C" __global__ void col2im_gather(const float* __restrict__ dcols, float* __restrict__ dx,
                                         int B, int C, int H, int W, int K, int S, int H_out,
                                         int W_out) {
    const int plane = H_out * W_out;
    const long long total = (long long)B * C * H * W;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int col = (int)(i % W);
        long long rest = i / W;
        const int row = (int)(rest % H);
        rest /= H;
        const int c = (int)(rest % C);
        const int b = (int)(rest / C);
        const float* image = dcols + (long long)b * C * K * K * plane;

        float acc = 0.0f;
        for (int p = row % S; p < K && p <= row; p += S) {
            const int oh = (row - p) / S;
            if (oh >= H_out) continue;
            for (int q = col % S; q < K && q <= col; q += S) {
                const int ow = (col - q) / S;
                if (ow >= W_out) continue;
                acc += image[(long long)((c * K + p) * K + q) * plane + oh * W_out + ow];
            }
        }
        dx[i] = acc;
    }
}
