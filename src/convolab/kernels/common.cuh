// Shared helpers for the ladder's kernels. Tensors are NCHW float32:
//   x (B, C, H, W), w (M, C, K, K), bias (M), y (B, M, Ho, Wo), "valid" convolution, stride S.
// Per-image offsets are size_t: at B=10000 the output of conv1 alone has 256 M elements and
// larger batches or images would overflow 32-bit products.
#pragma once

#define CONVOLAB_X_AT(x, b, c, h, w, C, H, W) \
  ((x)[(((size_t)(b) * (C) + (c)) * (H) + (h)) * (size_t)(W) + (w)])

#define CONVOLAB_Y_AT(y, b, m, h, w, M, Ho, Wo) \
  ((y)[(((size_t)(b) * (M) + (m)) * (Ho) + (h)) * (size_t)(Wo) + (w)])

// ---- Device helpers shared by the fused kernels (13 onward) ------------------------------------
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define CONVOLAB_NEG_INF (__int_as_float(0xff800000u))

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// cp.async global -> shared: no register round trip, every copy of a thread in flight at once.
// The 4/8-byte forms zero-fill when !valid (src is then never read): lanes outside the image
// compute discarded outputs, but from finite values.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(saddr), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(saddr), "l"(src),
               "r"(valid ? 8 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(src) : "memory");
}

// The 16-byte form zero-filled where !valid (src is then not read).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ldmatrix: four (x4) or two (x2) 8 x 8 matrices of 16-bit values from shared memory, lanes
// 8i..8i+7 giving matrix i's row addresses (any 16-byte aligned rows: a gather, not a tile).
// Lane l receives row l / 4, values 2 (l % 4) and + 1 of each: mma.sync's fragment order.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr));
}

__device__ __forceinline__ void ldsm_x2(unsigned (&r)[2], unsigned saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(saddr));
}

// d += A * B on tensor cores, one warp: A 16x16 fp16 (4 registers of half2), B 16x8 (2), fp32 d.
__device__ __forceinline__ void mma_f16_m16n8k16(float (&d)[4], unsigned a0, unsigned a1,
                                                 unsigned a2, unsigned a3, unsigned b0,
                                                 unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with bf16 operands (bf16x2 registers).
__device__ __forceinline__ void mma_bf16_m16n8k16(float (&d)[4], unsigned a0, unsigned a1,
                                                  unsigned a2, unsigned a3, unsigned b0,
                                                  unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with tf32 operands: A 16x8, B 8x8, one 32-bit element a register.
__device__ __forceinline__ void mma_tf32_m16n8k8(float (&d)[4], unsigned a0, unsigned a1,
                                                 unsigned a2, unsigned a3, unsigned b0,
                                                 unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// fp32 -> tf32, round to nearest, ties away from zero (the host packers round the same way).
__device__ __forceinline__ float tf32_round(float v) {
  unsigned u;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(v));
  return __uint_as_float(u);
}

// 3xTF32: v becomes its tf32 part; returns the tf32 rounding of what that part leaves out
// (v ~ big + small to ~2^-22 relative: a*b ~ a_s*b_b + a_b*b_s + a_b*b_b, three tf32 MMAs).
__device__ __forceinline__ float tf32_split(float& v) {
  const float big = tf32_round(v);
  const float small = tf32_round(v - big);
  v = big;
  return small;
}

// IEEE maximum: NaN if either operand is NaN (one FMNMX.NAN on sm_80+). The fused kernels pool
// and apply ReLU with it, so a NaN input gives a NaN output exactly as the unfused layers and
// the CPU paths do; fmaxf would return the other operand and hide it.
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Two fp32 values as one half2 register, the first in the low half (mma's k order).
__device__ __forceinline__ __half2 pack_half2(float lo, float hi) {
  return __floats2half2_rn(lo, hi);
}

// Two fp32 values as one 32-bit register of 16-bit operands, the first in the low half, rounded
// to nearest even: fp16 (MODE 0) or bf16 (MODE 1) (the direct convolutions' rings, 50-52).
template <int MODE>
__device__ __forceinline__ unsigned pack_16bit(float lo, float hi) {
  if constexpr (MODE == 0) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  }
}

// 32 bits at p (two fp16 or one tf32 operand element): one shared-memory load.
template <typename T>
__device__ __forceinline__ unsigned ld_u32(const T* p) {
  return *reinterpret_cast<const unsigned*>(p);
}
