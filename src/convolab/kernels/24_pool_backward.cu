// 24_pool_backward.cu — pooling layers' backward for training: max-pool and the textbook's
// subsampling (their forward kernels: 21_pool_forward.cu).
//
// Max-pool backward routes each output gradient to the one input that was the window's maximum.
// Frameworks usually store that argmax during the forward (an index per output); here the
// backward recomputes it from the input instead, which costs a few cached re-reads but no
// index buffer and no extra forward write. Ties go to the FIRST maximum in row-major window
// order and a NaN counts as larger than any number (NumPy/CuPy argmax's rules), so the GPU
// routes gradients exactly like the CPU layer. When the caller passes the pooled output y, the
// maximum is already known and the scan stops at the first element equal to it.
//
// The backward is a gather: one thread per input element looks at every window that contains
// it (more than one when stride < kernel, none for the rows that floor-mode pooling drops) and
// adds the gradient of each window whose argmax it is. No atomics, one write per element, so
// overlapping windows need no special case and the result is bit-reproducible.
//
// Subsampling (LeNet's S-layers, PMPP fig. 16.5): s = sigmoid(coef[c] * mean(window) + bias[c]).
// With z the pre-sigmoid value, dE/dz = dE/ds * s * (1 - s); then
//   dE/dcoef[c] = sum over (b, oh, ow) of dE/dz * mean,  dE/dbias[c] = sum of dE/dz,
//   dE/dx       = dE/dz * coef[c] / K^2 spread over the window.
// subsample_dz computes dE/dz and dE/dz * mean per output (the host reduces those per channel);
// pool_spread_gather spreads dE/dz back over the windows, again as a gather.
//
// Grids are 2-D: grid.y walks the images, grid.x the elements of one image, so index math is
// 32-bit (only the per-image base offsets are 64-bit).

#include "pool.cuh"

// Windows oh with oh*S <= row < oh*S + K, clipped to the output: [*lo, *hi].
__device__ __forceinline__ void windows_of(int row, int K, int S, int n_out, int* lo, int* hi) {
    *lo = row >= K ? (row - K) / S + 1 : 0;
    *hi = min(row / S, n_out - 1);
}

// dx[b,c,h,w] = sum of dy over the windows whose first maximum is (h, w). y may be NULL.
extern "C" __global__ void maxpool_backward_gather(const float* __restrict__ x,
                                                   const float* __restrict__ y,
                                                   const float* __restrict__ dy,
                                                   float* __restrict__ dx, int B, int C,
                                                   int H, int W, int K, int S, int H_out,
                                                   int W_out) {
    FOR_EACH_IMAGE_ELEMENT(B, C * H * W) {
        const int col = i % W;
        const int row = (i / W) % H;
        const long long plane = (long long)b * C + i / (W * H);
        const float* image = x + plane * H * W;
        const long long out_base = plane * H_out * W_out;
        int oh_lo, oh_hi, ow_lo, ow_hi;
        windows_of(row, K, S, H_out, &oh_lo, &oh_hi);
        windows_of(col, K, S, W_out, &ow_lo, &ow_hi);

        float acc = 0.0f;
        for (int oh = oh_lo; oh <= oh_hi; ++oh) {
            for (int ow = ow_lo; ow <= ow_hi; ++ow) {
                const float* window = image + oh * S * W + ow * S;
                int arg_p = 0, arg_q = 0;
                if (y != nullptr) {
                    const float target = y[out_base + oh * W_out + ow];
                    bool found = false;
                    for (int p = 0; p < K && !found; ++p)
                        for (int q = 0; q < K && !found; ++q)
                            if (same_value(window[p * W + q], target)) {
                                arg_p = p;
                                arg_q = q;
                                found = true;
                            }
                } else {
                    float best = window[0];
                    for (int p = 0; p < K; ++p)
                        for (int q = 0; q < K; ++q)
                            if (beats(window[p * W + q], best)) {
                                best = window[p * W + q];
                                arg_p = p;
                                arg_q = q;
                            }
                }
                if (oh * S + arg_p == row && ow * S + arg_q == col)
                    acc += dy[out_base + oh * W_out + ow];
            }
        }
        dx[(long long)b * C * H * W + i] = acc;
    }
}

// One thread per output: dz = ds * s * (1 - s) and dz * mean (for dE/dcoef). s may be NULL,
// then it is recomputed from x, coef and bias.
extern "C" __global__ void subsample_dz(const float* __restrict__ x, const float* __restrict__ s,
                                        const float* __restrict__ ds,
                                        const float* __restrict__ coef,
                                        const float* __restrict__ bias, float* __restrict__ dz,
                                        float* __restrict__ dz_mean, int B, int C, int H, int W,
                                        int K, int S, int H_out, int W_out) {
    FOR_EACH_IMAGE_ELEMENT(B, C * H_out * W_out) {
        const int ow = i % W_out;
        const int oh = (i / W_out) % H_out;
        const int c = i / (W_out * H_out);
        const long long at = (long long)b * C * H_out * W_out + i;
        const float mean = window_mean(x + ((long long)b * C + c) * H * W, W, K, S, oh, ow);
        const float out = s != nullptr ? s[at] : 1.0f / (1.0f + expf(-(coef[c] * mean + bias[c])));
        const float g = ds[at] * out * (1.0f - out);
        dz[at] = g;
        dz_mean[at] = g * mean;
    }
}

// dx[b,c,h,w] = sum over the windows containing (h, w) of dz * scale[c] / K^2 (scale NULL: 1),
// i.e. the backward of an average pool when scale is NULL and of subsampling otherwise.
extern "C" __global__ void pool_spread_gather(const float* __restrict__ dz,
                                              const float* __restrict__ scale,
                                              float* __restrict__ dx, int B, int C, int H, int W,
                                              int K, int S, int H_out, int W_out) {
    FOR_EACH_IMAGE_ELEMENT(B, C * H * W) {
        const int col = i % W;
        const int row = (i / W) % H;
        const int c = i / (W * H);
        const float* grad = dz + ((long long)b * C + c) * H_out * W_out;
        int oh_lo, oh_hi, ow_lo, ow_hi;
        windows_of(row, K, S, H_out, &oh_lo, &oh_hi);
        windows_of(col, K, S, W_out, &ow_lo, &ow_hi);
        float acc = 0.0f;
        for (int oh = oh_lo; oh <= oh_hi; ++oh)
            for (int ow = ow_lo; ow <= ow_hi; ++ow) acc += grad[oh * W_out + ow];
        const float factor = (scale != nullptr ? scale[c] : 1.0f) * (1.0f / (float)(K * K));
        dx[(long long)b * C * H * W + i] = acc * factor;
    }
}
