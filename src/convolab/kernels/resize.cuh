// Bilinear resize of raw uint8 images, evaluated on chip: the rule and the float32 operation
// order of data.resize_bilinear (half-pixel centres, PyTorch align_corners=False), so an exact
// network that reads raw bytes sees the same input bits as one fed data.resize_bilinear's output.
//
// The host builds one tap per output row and per output column (gpu/resize.py, from
// data.bilinear_taps: float64 positions, float32 weight). Each step below is rounded on its
// own, as NumPy's elementwise passes are: __f*_rn keeps the compiler from contracting
// a + t * (b - a) into an FMA, which would change the last bit.
#pragma once

// The raw image size of the fused kernels that stage a whole raw image (Fashion-MNIST: 28x28).
#ifndef RAW_H
#define RAW_H 28
#endif
#ifndef RAW_W
#define RAW_W 28
#endif

struct ResizeTap {
  int lo, hi;  // the two source indices
  float t;     // weight of `hi`
};

__device__ __forceinline__ float resize_lerp(float a, float b, float t) {
  return __fadd_rn(__fmul_rn(__fsub_rn(b, a), t), a);
}

// A raw pixel in [0, 1]: division (not * 1/255), as data.resize_bilinear does.
__device__ __forceinline__ float raw_to_unit(unsigned char v) {
  return __fdiv_rn(static_cast<float>(v), 255.f);
}

// The resized pixel at (row tap r, column tap c) of an image already scaled to [0, 1] (in
// shared memory: the caller stages it once, so the divisions are paid per raw pixel, not per
// resized one). The row pass runs first, then the column pass, then the clip to [0, 1].
__device__ __forceinline__ float resized_pixel(const float* unit, int in_w, ResizeTap r,
                                               ResizeTap c) {
  const float left = resize_lerp(unit[r.lo * in_w + c.lo], unit[r.hi * in_w + c.lo], r.t);
  const float right = resize_lerp(unit[r.lo * in_w + c.hi], unit[r.hi * in_w + c.hi], r.t);
  return fminf(fmaxf(resize_lerp(left, right, c.t), 0.f), 1.f);
}

// Stage one raw image (n = in_h * in_w bytes) into shared memory as floats in [0, 1]. Every
// thread of the block takes part; the caller synchronises before reading.
__device__ __forceinline__ void stage_unit_image(float* unit, const unsigned char* raw, int n,
                                                 int tid, int threads) {
  for (int i = tid; i < n; i += threads) unit[i] = raw_to_unit(__ldg(raw + i));
}

// The separable form the fused kernels use (the same bits: resized_pixel is this row pass at
// columns c.lo and c.hi, then this column pass). Row pass once per tile row into shared
// memory — rows[r][j] for output rows row0 + r and raw columns j — so each resized pixel costs
// two shared loads and one interpolation instead of four loads and three. Rows past the image
// repeat its last row; the caller zero-fills outside the image.
__device__ __forceinline__ void resize_rows(float* rows, const float* unit,
                                            const ResizeTap* __restrict__ taps, int row0,
                                            int n_rows, int H, int tid, int threads) {
  for (int i = tid; i < n_rows * RAW_W; i += threads) {
    const int r = i / RAW_W, j = i - r * RAW_W;
    const ResizeTap t = taps[min(row0 + r, H - 1)];
    rows[i] = resize_lerp(unit[t.lo * RAW_W + j], unit[t.hi * RAW_W + j], t.t);
  }
}

__device__ __forceinline__ float resized_from_row(const float* row, ResizeTap c) {
  return fminf(fmaxf(resize_lerp(row[c.lo], row[c.hi], c.t), 0.f), 1.f);
}

