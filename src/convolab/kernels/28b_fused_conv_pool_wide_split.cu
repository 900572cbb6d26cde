// Rung 28b — rung 28 (fcp_wide) in the split precisions: fp32 accuracy on the tensor cores,
// the exact mode's kernel for the wider zoo models' conv2. The same staging, k loop, store and
// persistent kernel (fused_wide.cuh, fused_wide_kernel.cuh); what changes is the operands: two
// parts each, three MMAs a step, each k-chunk summed from zero and added into a separate total.
//
// FW_PREC 2: 3xTF32 (each operand split big + small) in 3 tf32 MMAs, or (FW_SPLIT 2) big x big
// in tf32 plus both cross terms as one bf16 MMA; the split truncates (big = the top 19 bits,
// small = the exact rest, whose low bits the MMA drops: ~2^-21 an operand, 2 instructions);
// 3: 3xfp16, exact like 3xTF32 at twice the MMA rate: each operand is scaled by a power of two
// into fp16's range and split hi + lo (11 significant bits each), three m16n8k16 MMAs
// (hi x lo, lo x hi, hi x hi). The weights are scaled and split on the host (max |w| s_w in
// [2^14, 2^15)); each image is scaled by its own max |x| (a block reduction while staging) and
// split once as it is staged into two images, hi and lo; the pooled sum is multiplied by
// 1 / (s_w s_a), exactly (powers of two). Accumulation is fp32.
//
// Measured (H100, B = 10000, docs/raw.md): 3xTF32 with a rounding split (compare-and-select
// code) took 2.60 / 2.75 ms on the conv2 of ece408-mxnet / eecs498; truncating, 1.87 / 2.07;
// 3xfp16 1.17 / 1.32 (the FFMA rung: 5.94 / 4.54).

#ifndef FW_PREC
#define FW_PREC 3
#endif
#include "fused_wide.cuh"
#include "fused_wide_split.cuh"
#include "fused_wide_kernel.cuh"
