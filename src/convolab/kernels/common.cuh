// Shared helpers for the ladder's kernels. Tensors are NCHW float32:
//   x (B, C, H, W), w (M, C, K, K), bias (M), y (B, M, Ho, Wo), "valid" convolution, stride S.
// Per-image offsets are size_t: at B=10000 the output of conv1 alone has 256 M elements and
// larger batches or images would overflow 32-bit products.
#pragma once

#define CONVOLAB_X_AT(x, b, c, h, w, C, H, W) \
  ((x)[(((size_t)(b) * (C) + (c)) * (H) + (h)) * (size_t)(W) + (w)])

#define CONVOLAB_Y_AT(y, b, m, h, w, M, Ho, Wo) \
  ((y)[(((size_t)(b) * (M) + (m)) * (Ho) + (h)) * (size_t)(Wo) + (w)])
