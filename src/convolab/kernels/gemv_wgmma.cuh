// Kernel 49's PTX (49_gemv_wgmma_bulk.cu includes it after its configuration: TM_MODE, TM_NT,
// GW_N): the warpgroup MMA of N = the batch rounded up to 8, both operands by descriptor, a
// 16-byte store to shared memory by address, and GW_TIMELINE's clock and SM id. Kept apart so
// that the CPU emulator of kernel 49 (tests/test_gpu_gemv_wgmma.py) can stand in for them.

#pragma once

#if TM_MODE == 0
#define GW_TYPES "k16.f32.f16.f16"
#else
#define GW_TYPES "k16.f32.bf16.bf16"
#endif
// scale-d is a predicate operand, here always true: the accumulators start at zero.
#define GW_MMA(N, REGS)                                                                    \
  "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"                                              \
  "wgmma.mma_async.sync.aligned.m64n" #N GW_TYPES " {" REGS "}, %" GW_DA ", %" GW_DB       \
  ", p, 1, 1, 0, 0;\n}\n"
#define GW_F(i) "+f"(d[(i) / 4][(i) % 4])
#define GW_F4(i) GW_F(i), GW_F(i + 1), GW_F(i + 2), GW_F(i + 3)

// d += A x B for one 64 x GW_N x 16 step; d[j][r] is wgmma's register 4j + r, which for warp w
// of the warpgroup is row 16w + g + 8 (r / 2), column 8j + 2t + r % 2: mma.sync's m16n8 layout.
__device__ __forceinline__ void gw_mma(float (&d)[TM_NT][4], unsigned long long da,
                                       unsigned long long db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#if GW_N == 8
#define GW_DA "4"
#define GW_DB "5"
  asm volatile(GW_MMA(8, "%0, %1, %2, %3") : GW_F4(0) : "l"(da), "l"(db));
#elif GW_N == 16
#define GW_DA "8"
#define GW_DB "9"
  asm volatile(GW_MMA(16, "%0, %1, %2, %3, %4, %5, %6, %7") : GW_F4(0), GW_F4(4)
               : "l"(da), "l"(db));
#elif GW_N == 32
#define GW_DA "16"
#define GW_DB "17"
  asm volatile(GW_MMA(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15")
               : GW_F4(0), GW_F4(4), GW_F4(8), GW_F4(12)
               : "l"(da), "l"(db));
#else
#define GW_DA "32"
#define GW_DB "33"
  asm volatile(GW_MMA(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
                          "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, "
                          "%28, %29, %30, %31")
               : GW_F4(0), GW_F4(4), GW_F4(8), GW_F4(12), GW_F4(16), GW_F4(20), GW_F4(24),
                 GW_F4(28)
               : "l"(da), "l"(db));
#endif
#else
  __trap();  // built for a target without wgmma: the host builds this file for sm_90a only
#endif
}

// Four 32-bit words to shared memory at `at` (a shared-space address, 16-byte aligned).
__device__ __forceinline__ void gw_store16(unsigned at, unsigned a, unsigned b, unsigned c,
                                           unsigned d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(a), "r"(b), "r"(c),
               "r"(d)
               : "memory");
}

// GW_TIMELINE's clock and SM id.
__device__ __forceinline__ unsigned long long gw_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned gw_smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
