// Kernel 51's PTX (51_direct_conv_wgmma.cu includes it after its configuration: DW_MODE, DW_N):
// the warpgroup MMA m64nNk16 with both operands by descriptor, N = a warpgroup's output columns
// (16..128 in steps of 16). Kept apart so that the kernel's CPU emulator
// (tests/test_gpu_direct_wgmma.py) can stand in for it.

#pragma once

#if DW_MODE == 0
#define DW_TYPES "k16.f32.f16.f16"
#else
#define DW_TYPES "k16.f32.bf16.bf16"
#endif
// scale-d is a predicate operand: 0 ignores the accumulators (the first k-step of a pass).
#define DW_MMA(N, REGS, IA, IB, IS)                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                                     \
  "wgmma.mma_async.sync.aligned.m64n" #N DW_TYPES " {" REGS "}, %" #IA ", %" #IB          \
  ", p, 1, 1, 0, 0;\n}\n"
#define DW_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                 "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d (+)= A x B for one 64 x DW_N x 16 step. d[4j + r] is, for warp w of the warpgroup, row
// 16w + g + 8 (r / 2) and column 8j + 2t + r % 2 (g = lane / 4, t = lane % 4).
__device__ __forceinline__ void dw_mma(float (&d)[DW_N / 2], unsigned long long da,
                                       unsigned long long db, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#if DW_N == 16
  asm volatile(DW_MMA(16,
                      "%0, %1, %2, %3, %4, %5, %6, %7",
                      8, 9, 10)
               : DW_D8(0)
               : "l"(da), "l"(db), "r"(scale_d));
#elif DW_N == 32
  asm volatile(DW_MMA(32,
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
                      16, 17, 18)
               : DW_D8(0), DW_D8(8)
               : "l"(da), "l"(db), "r"(scale_d));
#elif DW_N == 48
  asm volatile(DW_MMA(48,
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                      "%17, %18, %19, %20, %21, %22, %23",
                      24, 25, 26)
               : DW_D8(0), DW_D8(8), DW_D8(16)
               : "l"(da), "l"(db), "r"(scale_d));
#elif DW_N == 64
  asm volatile(DW_MMA(64,
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                      "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                      32, 33, 34)
               : DW_D8(0), DW_D8(8), DW_D8(16), DW_D8(24)
               : "l"(da), "l"(db), "r"(scale_d));
#elif DW_N == 80
  asm volatile(DW_MMA(80,
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                      "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                      "%32, %33, %34, %35, %36, %37, %38, %39",
                      40, 41, 42)
               : DW_D8(0), DW_D8(8), DW_D8(16), DW_D8(24), DW_D8(32)
               : "l"(da), "l"(db), "r"(scale_d));
#elif DW_N == 96
  asm volatile(DW_MMA(96,
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                      "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "
                      "%47",
                      48, 49, 50)
               : DW_D8(0), DW_D8(8), DW_D8(16), DW_D8(24), DW_D8(32), DW_D8(40)
               : "l"(da), "l"(db), "r"(scale_d));
#elif DW_N == 112
  asm volatile(DW_MMA(112,
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                      "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "
                      "%47, %48, %49, %50, %51, %52, %53, %54, %55",
                      56, 57, 58)
               : DW_D8(0), DW_D8(8), DW_D8(16), DW_D8(24), DW_D8(32), DW_D8(40), DW_D8(48)
               : "l"(da), "l"(db), "r"(scale_d));
#elif DW_N == 128
  asm volatile(DW_MMA(128,
                      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                      "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "
                      "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
                      "%62, %63",
                      64, 65, 66)
               : DW_D8(0), DW_D8(8), DW_D8(16), DW_D8(24), DW_D8(32), DW_D8(40), DW_D8(48), DW_D8(56)
               : "l"(da), "l"(db), "r"(scale_d));
#else
#error "DW_N must be 16, 32, ..., 128"
#endif
#else
  __trap();  // built for a target without wgmma: the host builds this file for sm_90a only
#endif
}
