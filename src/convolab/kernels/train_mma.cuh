// The tensor-core side of the training forward kernels 37 and 38 (trainer modes tf32 and
// bf16): the mode's operand rounding, its mma, and the pool window's first maximum across the
// lanes that hold it.
//
// TRAIN_PREC 1: tf32 operands (cvt.rna, as the ladder's tf32 rungs), mma m16n8k8, one operand
// a register. TRAIN_PREC 2: bf16 operands (round to nearest even), mma m16n8k16, two operands
// a register (the lower k in the low half). Both accumulate in fp32. The weights stay fp32
// masters in the parameter buffer (kernel 36 updates them); each block rounds the copy it
// builds its fragments from, so no second weight buffer has to follow every update.
#pragma once

#include "common.cuh"
#include "train_lenet.cuh"

#ifndef TRAIN_PREC
#define TRAIN_PREC 1
#endif
static_assert(TRAIN_PREC == 1 || TRAIN_PREC == 2, "TRAIN_PREC: 1 tf32, 2 bf16");

constexpr int TP_K = TRAIN_PREC == 1 ? 8 : 16;  // the k of one mma
constexpr int TP_PER_REG = TRAIN_PREC == 1 ? 1 : 2;  // operands per 32-bit register

// bf16 bits of v, rounded to nearest even. Training values are finite (a NaN weight means the
// run has diverged, which the host reports from the loss), so the NaN case is not special.
__device__ __forceinline__ unsigned bf16_bits(float v) {
  const unsigned u = __float_as_uint(v);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// One operand register from its k-consecutive values (lo = the lower k): a tf32 value, or two
// bf16 values (hi ignored for tf32).
__device__ __forceinline__ unsigned tp_operand(float lo, float hi) {
#if TRAIN_PREC == 1
  (void)hi;
  return __float_as_uint(tf32_round(lo));
#else
  return bf16_bits(lo) | (bf16_bits(hi) << 16);
#endif
}

// d += A B for this warp: A's four registers, B's two (common.cuh's wrappers).
__device__ __forceinline__ void tp_mma(float (&d)[4], const uint4& a, unsigned b0, unsigned b1) {
#if TRAIN_PREC == 1
  mma_tf32_m16n8k8(d, a.x, a.y, a.z, a.w, b0, b1);
#else
  mma_bf16_m16n8k16(d, a.x, a.y, a.z, a.w, b0, b1);
#endif
}

// Keep the better of this lane's (v, at) and the one `mask` lanes away: the larger value, and
// on a tie the smaller window offset, so the window ends with its row-major first maximum
// (pool_relu's rule). Both lanes end with the same pair.
__device__ __forceinline__ void argmax_xor(float& v, int& at, int mask) {
  const float ov = __shfl_xor_sync(0xffffffffu, v, mask);
  const int oat = __shfl_xor_sync(0xffffffffu, at, mask);
  if (ov > v || (ov == v && oat < at)) v = ov, at = oat;
}

// A window's pooled output after ReLU and its argmax byte (ARG_DEAD when the ReLU cut it).
__device__ __forceinline__ float relu_arg(float best, int at, unsigned char& arg) {
  arg = best > 0.f ? static_cast<unsigned char>(at) : ARG_DEAD;
  return best > 0.f ? best : 0.f;
}
