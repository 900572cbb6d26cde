// 23_conv_backward_gemm.cu — the data-movement halves of a GEMM-based convolution backward.
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
// chunks with a bounded workspace. Grids are 2-D (grid.y walks the images) so all index math
// inside an image is 32-bit; only per-image base offsets are 64-bit.

#ifndef GEMM_BLOCK
#define GEMM_BLOCK 256  // threads per block (the host launches with this)
#endif

// cols[b, oh*W_out+ow, (c*K+p)*K+q] = x[b, c, oh*S+p, ow*S+q], for the B images of the chunk.
extern "C" __global__ void im2col_rows(const float* __restrict__ x, float* __restrict__ cols,
                                       int B, int C, int H, int W, int K, int S, int H_out,
                                       int W_out) {
    const int taps = C * K * K;
    const int per_image = H_out * W_out * taps;
    for (int b = blockIdx.y; b < B; b += gridDim.y) {
        const float* image = x + (long long)b * C * H * W;
        float* out = cols + (long long)b * per_image;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < per_image;
             i += gridDim.x * blockDim.x) {
            const int tap = i % taps;
            const int pos = i / taps;
            const int q = tap % K;
            const int p = (tap / K) % K;
            const int c = tap / (K * K);
            const int oh = pos / W_out;
            const int ow = pos - oh * W_out;
            out[i] = image[(c * H + oh * S + p) * W + ow * S + q];
        }
    }
}

// dx[b, c, h, w] = sum of dcols[b, (c*K+p)*K+q, oh*W_out+ow] over the taps with
// oh*S+p == h and ow*S+q == w.
extern "C" __global__ void col2im_gather(const float* __restrict__ dcols, float* __restrict__ dx,
                                         int B, int C, int H, int W, int K, int S, int H_out,
                                         int W_out) {
    const int plane = H_out * W_out;
    const int image_size = C * H * W;
    for (int b = blockIdx.y; b < B; b += gridDim.y) {
        const float* image = dcols + (long long)b * C * K * K * plane;
        float* out = dx + (long long)b * image_size;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < image_size;
             i += gridDim.x * blockDim.x) {
            const int col = i % W;
            const int row = (i / W) % H;
            const int c = i / (W * H);
            float acc = 0.0f;
            for (int p = row % S; p < K && p <= row; p += S) {
                const int oh = (row - p) / S;
                if (oh >= H_out) continue;
                for (int q = col % S; q < K && q <= col; q += S) {
                    const int ow = (col - q) / S;
                    if (ow >= W_out) continue;
                    acc += image[((c * K + p) * K + q) * plane + oh * W_out + ow];
                }
            }
            out[i] = acc;
        }
    }
}
