// 21_pool_forward.cu — pooling layers' forward for training: max-pool and the textbook's
// subsampling (LeNet's S-layers, PMPP fig. 16.5): s = sigmoid(coef[c] * mean(window) + bias[c]).
// Max-pool takes the FIRST maximum in row-major window order and a NaN counts as larger than
// any number (NumPy/CuPy argmax's rules), the same rule 24_pool_backward.cu routes gradients
// by.

#include "pool.cuh"

// One thread per output: y[b,c,oh,ow] = max over the K x K window at (oh*S, ow*S).
extern "C" __global__ void maxpool_forward(const float* __restrict__ x, float* __restrict__ y,
                                           int B, int C, int H, int W, int K, int S,
                                           int H_out, int W_out) {
    FOR_EACH_IMAGE_ELEMENT(B, C * H_out * W_out) {
        const int ow = i % W_out;
        const int oh = (i / W_out) % H_out;
        const int c = i / (W_out * H_out);
        const float* window = x + ((long long)b * C + c) * H * W + oh * S * W + ow * S;
        float best = window[0];
        for (int p = 0; p < K; ++p)
            for (int q = 0; q < K; ++q)
                if (beats(window[p * W + q], best)) best = window[p * W + q];
        y[(long long)b * C * H_out * W_out + i] = best;
    }
}

// One thread per output: s = sigmoid(coef[c] * mean + bias[c]).
extern "C" __global__ void subsample_forward(const float* __restrict__ x,
                                             const float* __restrict__ coef,
                                             const float* __restrict__ bias,
                                             float* __restrict__ s, int B, int C, int H, int W,
                                             int K, int S, int H_out, int W_out) {
    FOR_EACH_IMAGE_ELEMENT(B, C * H_out * W_out) {
        const int ow = i % W_out;
        const int oh = (i / W_out) % H_out;
        const int c = i / (W_out * H_out);
        const float mean = window_mean(x + ((long long)b * C + c) * H * W, W, K, S, oh, ow);
        s[(long long)b * C * H_out * W_out + i] = 1.0f / (1.0f + expf(-(coef[c] * mean + bias[c])));
    }
}
