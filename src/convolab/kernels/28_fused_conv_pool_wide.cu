// Rung 28 — fused-conv-pool on tensor cores for wide layers: fcp_wide. Rung 18 (fcp_mma_wa)
// with the roles of its operands swapped, for conv2-like layers with many output channels and
// a long reduction (the wider zoo models' conv2: C = 12 -> M = 24, K = 5 or 7).
//
// Why rung 18 cannot take them: it keeps the weights as the 16-row A operand in registers
// (M <= 16, C*K <= 32) and orders k as (c, p, q) with each filter row padded to 8 taps, which
// wastes 3/8 of every MMA at K = 5. Here:
//   * output positions are the 16 A rows and the output channels the n side: M = 24 is three
//     n-tiles of 8, no padding (rung 18's mapping would need two 16-row tiles: 25% idle);
//   * k is ordered (p, q, c), channels innermost, and the block's input is staged channels-last
//     (HWC) in shared memory, so for one position and filter row p the K*C taps are one
//     contiguous run: only the run's tail is padded to the MMA's k (60 -> 64 at K = 5 fp16);
//   * a 32-byte k-chunk is one MMA's k in the PTX order, so each A register is one 4-byte
//     load straight into its slot of the operand quad (lane t: bytes 4t and 16 + 4t of rows g
//     and g+8); the B fragment (weights, packed on the host in the same order) is one 8-byte
//     load per n-tile;
//   * the tiles of a unit are the output rows of its pool windows (FW_RP pooled rows): tile i
//     at filter row p reads input row i + p, so one loaded fragment (shift s) serves tile i
//     with p = s - i for every i: K + T - 1 fragment loads feed T*K MMA columns;
//   * a lane holds rows g and g+8 of each tile: the two left/right outputs of its window's row
//     (pool 2; pool 4: half the window, and one shuffle), so pooling is a max over registers;
//   * the whole image (staged once per image, optionally prefetched by cp.async) and all
//     weights (staged once per block: the grid is persistent) live in shared memory; a warp
//     keeps one k-chunk's weights for all K filter rows in registers while it works through
//     FW_UNITS units; the staged row pitch is padded so that the A loads hit distinct banks.
// FW_PREC 0: fp16 operands (m16n8k16); 1: tf32 (m16n8k8, inputs rounded rna while staged).
// The split precisions that keep fp32 accuracy on these tensor cores (3xTF32, 3xfp16) are
// rung 28b (28b_fused_conv_pool_wide_split.cu): the same staging, k loop and store
// (fused_wide.cuh, fused_wide_kernel.cuh) with two operand parts and three MMAs a step.
// FW_IN_HALF 1: the input is fp16 NCHW (a previous layer's fp16 output), else fp32 NCHW.
// Only finite reads: the padded tail of a run reads the next pixel's channels (weight 0), so a
// NaN input pixel may also spread to the horizontally adjacent window (tensor-core rungs'
// NaN policy: a NaN window is NaN, other images are untouched).
//
// Measured (H100, B = 10000, docs/raw.md). Before, with two 8-byte A row loads that ptxas
// moved into each quad (178 MOV a 60-HMMA loop): conv2 of ece408-mxnet fp16 0.47 ms, tf32
// 0.94; eecs498 0.51 / 0.85. Now (a K = 5 fp16 loop: 60 HMMA, 63 LDS, 11 other): mxnet fp16
// 0.46, tf32 0.79; eecs498 0.47 / 0.77 (FFMA rung: 5.94 / 4.54).
// The moves were not what held fp16 back: ncu shows the tensor pipe 46-57% busy with 3.5
// warps a scheduler and no eligible warp 63% of the cycles (latency, not issue).

#ifndef FW_PREC
#define FW_PREC 0
#endif
#include "fused_wide.cuh"
#include "fused_wide_single.cuh"
#include "fused_wide_kernel.cuh"
