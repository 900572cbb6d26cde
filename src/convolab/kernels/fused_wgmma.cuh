// Rung 44's geometry and operand plumbing (kernels/44_fused_conv_pool_wgmma.cu includes it
// after rung 28's headers): the weight blocks' layout and descriptors, the packed tails, the
// A loads of a shift and of a tail chunk, and accumulator helpers.
#pragma once

static_assert(FW_PREC == 0 || FW_PREC == 3, "rung 44 runs fp16 (0) and 3xfp16 (3)");
static_assert(FW_P == 2 && FW_RP == 1, "rung 44: units of one pooled row, pool 2");
static_assert(!FW_PREFETCH, "rung 44 stages from global memory");
static_assert(FW_NT >= 1 && FW_NT <= 4, "rung 44: wgmma N = 8 NT or 16 NT, M <= 32");
static_assert(FW_LEAD >= 1 && FW_RING >= FW_LEAD + 2, "rung 44: 1 <= FW_LEAD <= FW_RING - 2");

// FW_TAILS 1: a filter row's run is FW_JM whole k-chunks plus a tail of FW_TL elements, and
// the K tails are packed together into FW_TCH chunks of their own (eecs498: 84 = 5 x 16 + 4,
// seven tails in two chunks: 37 chunk MMAs a tile instead of 42); 0: each run padded to FW_J.
#ifndef FW_TAILS
#define FW_TAILS 0
#endif
#define FW_JM (FW_TAILS ? FW_RUN / FW_CH : FW_J)          // chunks the shift loop runs
#define FW_TL (FW_RUN - FW_JM * FW_CH)                     // a row's tail (FW_TAILS 1)
#define FW_TCH (FW_TAILS ? (FW_K * FW_TL + FW_CH - 1) / FW_CH : 0)
#define FW_CORE2 256                          // two core matrices: 8 channels x 16 k
#define FW_PART_BYTES (FW_NT * FW_CORE2)      // one part of a (chunk, filter row) block
#define FW_BLOCK_BYTES (FW_PARTS * FW_PART_BYTES)
#define FW_B_BYTES ((FW_JM * FW_K + FW_TCH) * FW_BLOCK_BYTES)
#define FW_NG ((FW_NUNITS + 3) / 4)  // m-tiles (4 units) of one image
#define FW_STEPS (FW_JM * FW_SHIFTS)
static_assert(!FW_TAILS || (FW_JM >= 1 && FW_TL > 0 && FW_TL % 2 == 0),
              "rung 44: packed tails need a whole chunk a row and an even tail");
#define FW_ALIGN 128
// Dynamic shared memory: the weights' alignment slack, the weights, the image(s).
#define FW44_SMEM_BYTES (FW_ALIGN + FW_B_BYTES + FW_IMG_BYTES)

// The dynamic shared memory's first FW_ALIGN-aligned byte, where the weights start; addr: its
// shared-window address (the descriptors' base).
__device__ __forceinline__ unsigned char* fw_aligned(unsigned char* smem, unsigned& addr) {
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  const unsigned pad = (FW_ALIGN - (base & (FW_ALIGN - 1))) & (FW_ALIGN - 1);
  addr = base + pad;
  return smem + pad;
}

typedef float FwTile[FW_T][FW_NT][4];  // [tile][n-tile][register]

template <int R>
__device__ __forceinline__ void fw_zero(float (&d)[R][4]) {
#pragma unroll
  for (int n = 0; n < R; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) d[n][r] = 0.f;
}

// The A quads (hi; 3xfp16 also lo) of step st = (chunk j, shift s) for this lane's rows.
__device__ __forceinline__ void fw_load_step(FwA (&a)[FW_PARTS], const fw_t* img,
                                             const FwRows& rows, int st) {
  const int j = st / FW_SHIFTS, s = st % FW_SHIFTS;
  const fw_t* lo = img + rows.lo + j * FW_CH + s * FW_ROW;
  const fw_t* hi = img + rows.hi + j * FW_CH + s * FW_ROW;
#pragma unroll
  for (int part = 0; part < FW_PARTS; ++part)
    a[part] = fw_lda(lo + part * FW_IMG1, hi + part * FW_IMG1);
}

// The descriptor of the weights' first block (wsm: their shared-window address), which the
// others are offsets of.
__device__ __forceinline__ unsigned long long fw_b0(unsigned wsm) {
  return wg_desc_interleaved(wsm, 128, FW_CORE2);
}

// The B descriptor of block (chunk j, filter row p) from part `part` on (3xfp16: lo 0, hi 1),
// over N = 8 NT rows a part that follows (d0 = fw_b0).
__device__ __forceinline__ unsigned long long fw_b(unsigned long long d0, int j, int p,
                                                   int part) {
  return wg_desc_add(d0, (j * FW_K + FW_K - 1 - p) * FW_BLOCK_BYTES + part * FW_PART_BYTES);
}

// The B descriptor of packed tail chunk c (FW_TAILS).
__device__ __forceinline__ unsigned long long fw_b_tail(unsigned long long d0, int c,
                                                        int part) {
  return wg_desc_add(d0, (FW_JM * FW_K + c) * FW_BLOCK_BYTES + part * FW_PART_BYTES);
}

// The A quads of packed tail chunk c for tile i: lane t's k pairs t and 4 + t of the chunk are
// tail pairs 8c + t and 8c + 4 + t, each in the tail of its own filter row p (input row i + p);
// pairs past the last tail read row K - 1 (their weights are zero).
__device__ __forceinline__ void fw_load_tail(FwA (&a)[FW_PARTS], const fw_t* img,
                                             const FwRows& rows, int i, int c, int t) {
  int off[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int e = 2 * (8 * c + 4 * h + t);
    int p = e / (FW_TL > 0 ? FW_TL : 1), o = e - p * FW_TL;
    if (p >= FW_K) p = FW_K - 1, o = 0;
    off[h] = (i + p) * FW_ROW + FW_JM * FW_CH + o - t * FW_WORD;  // rows.lo/hi include t
  }
#pragma unroll
  for (int part = 0; part < FW_PARTS; ++part) {
    const fw_t* lo = img + part * FW_IMG1 + rows.lo;
    const fw_t* hi = img + part * FW_IMG1 + rows.hi;
    a[part] = FwA{{fw_ld32(lo + off[0]), fw_ld32(hi + off[0]), fw_ld32(lo + off[1]),
                   fw_ld32(hi + off[1])}};
  }
}
