// 22_pool_backward.cu — pooling layers for training: max-pool and the textbook's subsampling.
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
// Only 32-bit shape arguments; flat indices are 64-bit.

#ifndef POOL_BLOCK
#define POOL_BLOCK 256  // threads per block (the host launches with this)
#endif

// NumPy's argmax order: NaN beats everything, and among equals the first one wins.
__device__ __forceinline__ bool beats(float candidate, float best) {
    return candidate > best || (candidate != candidate && best == best);
}

__device__ __forceinline__ bool same_value(float a, float b) {
    return a == b || (a != a && b != b);
}

// One thread per output: y[b,c,oh,ow] = max over the K x K window at (oh*S, ow*S).
extern "C" __global__ void maxpool_forward(const float* __restrict__ x, float* __restrict__ y,
                                           long long planes, int H, int W, int K, int S,
                                           int H_out, int W_out) {
    const long long total = planes * H_out * W_out;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int ow = (int)(i % W_out);
        const int oh = (int)((i / W_out) % H_out);
        const float* window = x + (i / ((long long)W_out * H_out)) * H * W
                              + (long long)oh * S * W + ow * S;
        float best = window[0];
        for (int p = 0; p < K; ++p)
            for (int q = 0; q < K; ++q)
                if (beats(window[p * W + q], best)) best = window[p * W + q];
        y[i] = best;
    }
}

// dx[b,c,h,w] = sum of dy over the windows whose first maximum is (h, w). y may be NULL.
extern "C" __global__ void maxpool_backward_gather(const float* __restrict__ x,
                                                   const float* __restrict__ y,
                                                   const float* __restrict__ dy,
                                                   float* __restrict__ dx, long long planes,
                                                   int H, int W, int K, int S, int H_out,
                                                   int W_out) {
    const long long total = planes * H * W;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int col = (int)(i % W);
        const int row = (int)((i / W) % H);
        const long long plane = i / ((long long)W * H);
        const float* image = x + plane * H * W;
        const long long out_base = plane * H_out * W_out;

        // Windows oh with oh*S <= row < oh*S + K, clipped to the output.
        const int oh_lo = row >= K ? (row - K) / S + 1 : 0;
        const int oh_hi = min(row / S, H_out - 1);
        const int ow_lo = col >= K ? (col - K) / S + 1 : 0;
        const int ow_hi = min(col / S, W_out - 1);

        float acc = 0.0f;
        for (int oh = oh_lo; oh <= oh_hi; ++oh) {
            for (int ow = ow_lo; ow <= ow_hi; ++ow) {
                const float* window = image + (long long)oh * S * W + ow * S;
                int arg_p = 0, arg_q = 0;
                if (y != nullptr) {
                    const float target = y[out_base + (long long)oh * W_out + ow];
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
                    acc += dy[out_base + (long long)oh * W_out + ow];
            }
        }
        dx[i] = acc;
    }
}

// One thread per output: s = sigmoid(coef[c] * mean + bias[c]).
extern "C" __global__ void subsample_forward(const float* __restrict__ x,
                                             const float* __restrict__ coef,
                                             const float* __restrict__ bias,
                                             float* __restrict__ s, long long planes, int C,
                                             int H, int W, int K, int S, int H_out, int W_out) {
    const long long total = planes * H_out * W_out;
    const long long step = (long long)gridDim.x * blockDim.x;
    const float inv_area = 1.0f / (float)(K * K);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int ow = (int)(i % W_out);
        const int oh = (int)((i / W_out) % H_out);
        const long long plane = i / ((long long)W_out * H_out);
        const int c = (int)(plane % C);
        const float* window = x + plane * H * W + (long long)oh * S * W + ow * S;
        float sum = 0.0f;
        for (int p = 0; p < K; ++p)
            for (int q = 0; q < K; ++q) sum += window[p * W + q];
        const float z = coef[c] * (sum * inv_area) + bias[c];
        s[i] = 1.0f / (1.0f + expf(-z));
    }
}

// One thread per output: dz = ds * s * (1 - s) and dz * mean (for dE/dcoef). s may be NULL,
// then it is recomputed from x, coef and bias.
extern "C" __global__ void subsample_dz(const float* __restrict__ x, const float* __restrict__ s,
                                        const float* __restrict__ ds,
                                        const float* __restrict__ coef,
                                        const float* __restrict__ bias, float* __restrict__ dz,
                                        float* __restrict__ dz_mean, long long planes, int C,
                                        int H, int W, int K, int S, int H_out, int W_out) {
    const long long total = planes * H_out * W_out;
    const long long step = (long long)gridDim.x * blockDim.x;
    const float inv_area = 1.0f / (float)(K * K);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int ow = (int)(i % W_out);
        const int oh = (int)((i / W_out) % H_out);
        const long long plane = i / ((long long)W_out * H_out);
        const int c = (int)(plane % C);
        const float* window = x + plane * H * W + (long long)oh * S * W + ow * S;
        float sum = 0.0f;
        for (int p = 0; p < K; ++p)
            for (int q = 0; q < K; ++q) sum += window[p * W + q];
        const float mean = sum * inv_area;
        const float out = s != nullptr ? s[i] : 1.0f / (1.0f + expf(-(coef[c] * mean + bias[c])));
        const float g = ds[i] * out * (1.0f - out);
        dz[i] = g;
        dz_mean[i] = g * mean;
    }
}

// dx[b,c,h,w] = sum over the windows containing (h, w) of dz * scale[c] / K^2 (scale NULL: 1),
// i.e. the backward of an average pool when scale is NULL and of subsampling otherwise.
extern "C" __global__ void pool_spread_gather(const float* __restrict__ dz,
                                              const float* __restrict__ scale,
                                              float* __restrict__ dx, long long planes, int C,
                                              int H, int W, int K, int S, int H_out, int W_out) {
    const long long total = planes * H * W;
    const long long step = (long long)gridDim.x * blockDim.x;
    const float inv_area = 1.0f / (float)(K * K);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int col = (int)(i % W);
        const int row = (int)((i / W) % H);
        const long long plane = i / ((long long)W * H);
        const int oh_lo = row >= K ? (row - K) / S + 1 : 0;
        const int oh_hi = min(row / S, H_out - 1);
        const int ow_lo = col >= K ? (col - K) / S + 1 : 0;
        const int ow_hi = min(col / S, W_out - 1);
        const float* grad = dz + plane * H_out * W_out;
        float acc = 0.0f;
        for (int oh = oh_lo; oh <= oh_hi; ++oh)
            for (int ow = ow_lo; ow <= ow_hi; ++ow) acc += grad[oh * W_out + ow];
        const float factor = (scale != nullptr ? scale[(int)(plane % C)] : 1.0f) * inv_area;
        dx[i] = acc * factor;
    }
}
