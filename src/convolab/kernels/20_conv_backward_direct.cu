// 20_conv_backward_direct.cu — convolution backward, computed straight from the definition.
//
// The forward is Y[b,m,oh,ow] = sum_{c,p,q} X[b,c,oh*S+p,ow*S+q] * W[m,c,p,q] (valid, no flip).
// Differentiating that sum gives the two gradients training needs:
//
//   dX[b,c,h,w]  = sum over every (m, oh, ow, p, q) with oh*S+p == h and ow*S+q == w of
//                  dY[b,m,oh,ow] * W[m,c,p,q]
//   dW[m,c,p,q]  = sum over (b, oh, ow) of dY[b,m,oh,ow] * X[b,c,oh*S+p,ow*S+q]
//
// The textbook writes dX as a scatter: each dY element adds into K*K input pixels. On a GPU a
// scatter needs atomics (slow under contention and not bit-reproducible), so conv_bwd_dx_direct
// turns it around: one thread owns one dX element and *gathers*. For a fixed input row h, only
// kernel rows p with p == h (mod S) and 0 <= (h - p) / S < H_out reach it, so the thread walks
// p = h % S, h % S + S, ... and skips the rest without testing every p. Each element is written
// once, in a fixed order, so the result does not depend on scheduling.
//
// dW is a reduction over B*H_out*W_out products per weight — huge for a few hundred weights.
// conv_bwd_dw_direct gives each weight a row of blocks (grid.y splits the batch so the GPU has
// enough blocks even when there are few weights); every block reduces its slice with a
// register sum, then warp shuffles, then one shared-memory step, and writes one partial. The host
// sums the grid.y partials afterwards. No atomics: the summation order is fixed by the launch
// shape, so the same launch gives the same bits every run.
//
// Indices that can exceed 2^31 (B*C*H*W at large batch) are 64-bit.

#ifndef DIRECT_BLOCK
#define DIRECT_BLOCK 256  // threads per block for both kernels (a multiple of 32)
#endif

extern "C" __global__ void conv_bwd_dx_direct(const float* __restrict__ dy,
                                              const float* __restrict__ w,
                                              float* __restrict__ dx,
                                              int B, int M, int C, int H, int W, int K, int S,
                                              int H_out, int W_out) {
    const long long total = (long long)B * C * H * W;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int col = (int)(i % W);
        long long rest = i / W;
        const int row = (int)(rest % H);
        rest /= H;
        const int c = (int)(rest % C);
        const int b = (int)(rest / C);

        float acc = 0.0f;
        for (int p = row % S; p < K && p <= row; p += S) {
            const int oh = (row - p) / S;
            if (oh >= H_out) continue;  // larger p only lowers oh, so later p may still fit
            for (int q = col % S; q < K && q <= col; q += S) {
                const int ow = (col - q) / S;
                if (ow >= W_out) continue;
                const float* dy_at = dy + (((long long)b * M) * H_out + oh) * W_out + ow;
                const float* w_at = w + ((long long)c * K + p) * K + q;
                for (int m = 0; m < M; ++m)
                    acc += dy_at[(long long)m * H_out * W_out] * w_at[(long long)m * C * K * K];
            }
        }
        dx[i] = acc;
    }
}

// grid.x = M*C*K*K (one weight each), grid.y = number of batch slices.
// partial[slice * M*C*K*K + weight] = sum over the slice's (b, oh, ow) of dY * X.
extern "C" __global__ void conv_bwd_dw_direct(const float* __restrict__ x,
                                              const float* __restrict__ dy,
                                              float* __restrict__ partial,
                                              int B, int M, int C, int H, int W, int K, int S,
                                              int H_out, int W_out, int batch_per_slice) {
    const int weight = blockIdx.x;
    const int q = weight % K;
    const int p = (weight / K) % K;
    const int c = (weight / (K * K)) % C;
    const int m = weight / (K * K * C);

    const int b0 = blockIdx.y * batch_per_slice;
    const int b1 = min(B, b0 + batch_per_slice);
    const int plane = H_out * W_out;
    const long long count = (long long)(b1 > b0 ? b1 - b0 : 0) * plane;

    float acc = 0.0f;
    for (long long j = threadIdx.x; j < count; j += blockDim.x) {
        const int b = b0 + (int)(j / plane);
        const int pos = (int)(j % plane);
        const int oh = pos / W_out;
        const int ow = pos - oh * W_out;
        const float g = dy[((long long)b * M + m) * plane + pos];
        const float v = x[(((long long)b * C + c) * H + oh * S + p) * W + ow * S + q];
        acc += g * v;
    }

    // Block reduction in a fixed order: warps first, then the warp sums in one warp.
    for (int offset = 16; offset > 0; offset >>= 1)
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    __shared__ float warp_sums[DIRECT_BLOCK / 32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x >> 5;
        acc = lane < n_warps ? warp_sums[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1)
            acc += __shfl_down_sync(0xffffffffu, acc, offset);
        if (lane == 0) partial[(long long)blockIdx.y * gridDim.x + weight] = acc;
    }
}
