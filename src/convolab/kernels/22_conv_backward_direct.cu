// 22_conv_backward_direct.cu — convolution backward, computed straight from the definition.
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
// dW is a reduction over B*H_out*W_out products per weight. Two kernels:
// - conv_bwd_dw_direct: one block per weight (grid.y splits the batch so small layers still
//   fill the GPU). Simple, any K, but every product costs two loads, one of them of dY, which
//   all K*K*C blocks of a filter m read again.
// - conv_bwd_dw_taps (K fixed at compile time, KSIZE): one block per (m, c) filter slice; each
//   thread keeps all K*K tap sums in registers, so it loads each dY value once and reuses it for
//   K*K products whose X loads are neighbours (L1 hits). About K*K times fewer dY loads.
// Both reduce in a fixed order: registers, warp shuffles, one shared-memory step, one partial
// per block; the host sums the grid.y partials. No atomics: the same launch gives the same bits.
//
// Grids are 2-D: grid.y walks the images, grid.x the elements of one image, so the index math
// is 32-bit (64-bit division costs several times more). Only
// the per-image base offsets are 64-bit.

#ifndef DIRECT_BLOCK
#define DIRECT_BLOCK 256  // threads per block for every kernel here (a multiple of 32)
#endif
#ifndef KSIZE
#define KSIZE 7  // kernel width of conv_bwd_dw_taps (the host compiles one variant per K)
#endif

extern "C" __global__ void conv_bwd_dx_direct(const float* __restrict__ dy,
                                              const float* __restrict__ w,
                                              float* __restrict__ dx,
                                              int B, int M, int C, int H, int W, int K, int S,
                                              int H_out, int W_out) {
    const int image_size = C * H * W;
    const int plane = H_out * W_out;
    for (int b = blockIdx.y; b < B; b += gridDim.y) {
        const float* dy_image = dy + (long long)b * M * plane;
        float* dx_image = dx + (long long)b * image_size;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < image_size;
             i += gridDim.x * blockDim.x) {
            const int col = i % W;
            const int row = (i / W) % H;
            const int c = i / (W * H);
            float acc = 0.0f;
            for (int p = row % S; p < K && p <= row; p += S) {
                const int oh = (row - p) / S;
                if (oh >= H_out) continue;  // larger p lowers oh, so a later p may still fit
                for (int q = col % S; q < K && q <= col; q += S) {
                    const int ow = (col - q) / S;
                    if (ow >= W_out) continue;
                    const float* dy_at = dy_image + oh * W_out + ow;
                    const float* w_at = w + (c * K + p) * K + q;
                    for (int m = 0; m < M; ++m) acc += dy_at[m * plane] * w_at[m * C * K * K];
                }
            }
            dx_image[i] = acc;
        }
    }
}

// Sums `value` over the block in a fixed order; the total is valid in thread 0.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
    for (int offset = 16; offset > 0; offset >>= 1)
        value += __shfl_down_sync(0xffffffffu, value, offset);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    value = 0.0f;
    if (warp == 0) {
        value = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1)
            value += __shfl_down_sync(0xffffffffu, value, offset);
    }
    __syncthreads();  // scratch may be reused by the next call
    return value;
}

// grid.x = M*C*K*K (one weight each), grid.y = batch slices of batch_per_slice images.
// partial[slice * M*C*K*K + weight] = sum over the slice's (b, oh, ow) of dY * X.
extern "C" __global__ void conv_bwd_dw_direct(const float* __restrict__ x,
                                              const float* __restrict__ dy,
                                              float* __restrict__ partial,
                                              int B, int M, int C, int H, int W, int K, int S,
                                              int H_out, int W_out, int batch_per_slice) {
    __shared__ float scratch[DIRECT_BLOCK / 32];
    const int weight = blockIdx.x;
    const int q = weight % K;
    const int p = (weight / K) % K;
    const int c = (weight / (K * K)) % C;
    const int m = weight / (K * K * C);
    const int plane = H_out * W_out;
    const int b_end = min(B, (blockIdx.y + 1) * batch_per_slice);

    float acc = 0.0f;
    for (int b = blockIdx.y * batch_per_slice; b < b_end; ++b) {
        const float* dy_plane = dy + ((long long)b * M + m) * plane;
        const float* x_plane = x + ((long long)b * C + c) * H * W + p * W + q;
        for (int pos = threadIdx.x; pos < plane; pos += blockDim.x) {
            const int oh = pos / W_out;
            const int ow = pos - oh * W_out;
            acc += dy_plane[pos] * x_plane[oh * S * W + ow * S];
        }
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[(long long)blockIdx.y * gridDim.x + weight] = acc;
}

// grid.x = M*C (one filter slice (m, c) each), grid.y = batch slices. KSIZE == K.
// partial[slice * M*C*K*K + (m*C + c)*K*K + p*K + q].
extern "C" __global__ void conv_bwd_dw_taps(const float* __restrict__ x,
                                            const float* __restrict__ dy,
                                            float* __restrict__ partial,
                                            int B, int M, int C, int H, int W, int S,
                                            int H_out, int W_out, int batch_per_slice) {
    __shared__ float scratch[DIRECT_BLOCK / 32];
    const int c = blockIdx.x % C;
    const int m = blockIdx.x / C;
    const int plane = H_out * W_out;
    const int b_end = min(B, (blockIdx.y + 1) * batch_per_slice);

    float acc[KSIZE * KSIZE];
#pragma unroll
    for (int t = 0; t < KSIZE * KSIZE; ++t) acc[t] = 0.0f;

    for (int b = blockIdx.y * batch_per_slice; b < b_end; ++b) {
        const float* dy_plane = dy + ((long long)b * M + m) * plane;
        const float* x_plane = x + ((long long)b * C + c) * H * W;
        for (int pos = threadIdx.x; pos < plane; pos += blockDim.x) {
            const int oh = pos / W_out;
            const int ow = pos - oh * W_out;
            const float g = dy_plane[pos];
            const float* window = x_plane + oh * S * W + ow * S;
#pragma unroll
            for (int p = 0; p < KSIZE; ++p)
#pragma unroll
                for (int q = 0; q < KSIZE; ++q) acc[p * KSIZE + q] += g * window[p * W + q];
        }
    }

    float* out = partial + (long long)blockIdx.y * gridDim.x * KSIZE * KSIZE
                 + (long long)blockIdx.x * KSIZE * KSIZE;
#pragma unroll
    for (int t = 0; t < KSIZE * KSIZE; ++t) {
        const float total = block_sum(acc[t], scratch);
        if (threadIdx.x == 0) out[t] = total;
    }
}
