// Shared by the pooling kernels for training (21 forward, 24 backward): the argmax rule, the
// window mean and the per-image loop.
//
// Grids are 2-D: grid.y walks the images, grid.x the elements of one image, so index math is
// 32-bit (only the per-image base offsets are 64-bit).
#pragma once

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

// The loops every kernel here shares: image b (grid.y) and element i of that image (grid.x).
#define FOR_EACH_IMAGE_ELEMENT(B, per_image)                                   \
    for (int b = blockIdx.y; b < (B); b += gridDim.y)                          \
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (per_image);   \
             i += gridDim.x * blockDim.x)

// Mean of the K x K window at (oh*S, ow*S) of one channel plane.
__device__ __forceinline__ float window_mean(const float* plane, int W, int K, int S, int oh,
                                             int ow) {
    const float* window = plane + oh * S * W + ow * S;
    float sum = 0.0f;
    for (int p = 0; p < K; ++p)
        for (int q = 0; q < K; ++q) sum += window[p * W + q];
    return sum * (1.0f / (float)(K * K));
}
