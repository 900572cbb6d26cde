// The entry points of a row-pair kernel (29c, 45): the includer defines fr_b_t (its weights'
// element type), fr_conv_pool(input, weights, bias, y, w_e, tiles_h) and FR_ENTRY(kind), the
// kernel's name for float and raw input.
#pragma once

// x: (B, 1, FF_H, FF_W) fp32; y: (B, FR_M, HP, WP). Grid: B * tiles_h blocks.
extern "C" __global__ void __launch_bounds__(FR_THREADS, FF_MINB)
FR_ENTRY(f32)(const float* __restrict__ x, const fr_b_t* __restrict__ bfrag,
              const float* __restrict__ bias, ff_out* __restrict__ y, int w_e, int tiles_h) {
  fr_conv_pool(FrFloatInput{x}, bfrag, bias, y, w_e, tiles_h);
}

// raw: (B, RAW_H, RAW_W) uint8: the image's bytes and taps in one round trip (ff_raw_rows), the
// row pass of the block's rows, and the column pass as the tile is staged.
extern "C" __global__ void __launch_bounds__(FR_THREADS, FF_MINB)
FR_ENTRY(raw)(const unsigned char* __restrict__ raw, const ResizeTap* __restrict__ taps,
              const fr_b_t* __restrict__ bfrag, const float* __restrict__ bias,
              ff_out* __restrict__ y, int w_e, int tiles_h) {
  __shared__ __align__(16) FfRawRows raw_s;
  __shared__ float rows[FR_IR * RAW_W];
  const int row0 = (blockIdx.x % tiles_h) * FR_TPH * 2;
  ff_raw_rows(rows, raw_s, raw + (size_t)(blockIdx.x / tiles_h) * FF_RAW_BYTES, taps, row0,
              FR_IR, threadIdx.x, FR_THREADS);
  __syncthreads();
  fr_conv_pool(FrRawInput{rows, raw_s.taps, row0}, bfrag, bias, y, w_e, tiles_h);
}
