// The warpgroup MMA with its A operand in registers (fp16, m64nNk16, N = 8 NR for NR = 1, 2,
// 3, 4, 6, 8 n-tiles of 8): d[n][r] = a * B (+ d[n][r] where scale_d is nonzero), a this thread's A quad (the m16n8k16 A fragment
// of its warp's 16 rows), B (K-major, N x 16) by descriptor. The accumulators are d[n][0..3]
// in the mma.sync C layout of n-tile n: rows g, g, g+8, g+8, columns 2t, 2t+1, 2t, 2t+1.
// Written out per N because the instruction names its shape and lists every register.
#pragma once

template <int NR>
__device__ __forceinline__ void wg_mma_rs(float (&d)[NR][4], const unsigned (&a)[4],
                                          unsigned long long b, int scale_d);

template <>
__device__ __forceinline__ void wg_mma_rs<1>(float (&d)[1][4], const unsigned (&a)[4],
                                             unsigned long long b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {"
               "%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
#else
  __trap();  // built for a target without wgmma: the host builds these kernels for sm_90a only
#endif
}

template <>
__device__ __forceinline__ void wg_mma_rs<2>(float (&d)[2][4], const unsigned (&a)[4],
                                             unsigned long long b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                 "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
#else
  __trap();  // built for a target without wgmma: the host builds these kernels for sm_90a only
#endif
}

template <>
__device__ __forceinline__ void wg_mma_rs<3>(float (&d)[3][4], const unsigned (&a)[4],
                                             unsigned long long b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                 "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                 "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
#else
  __trap();  // built for a target without wgmma: the host builds these kernels for sm_90a only
#endif
}

template <>
__device__ __forceinline__ void wg_mma_rs<4>(float (&d)[4][4], const unsigned (&a)[4],
                                             unsigned long long b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11,  "
               "%12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                 "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                 "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                 "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
#else
  __trap();  // built for a target without wgmma: the host builds these kernels for sm_90a only
#endif
}

template <>
__device__ __forceinline__ void wg_mma_rs<6>(float (&d)[6][4], const unsigned (&a)[4],
                                             unsigned long long b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11,  "
               "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                 "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                 "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                 "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
                 "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
                 "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
#else
  __trap();  // built for a target without wgmma: the host builds these kernels for sm_90a only
#endif
}

template <>
__device__ __forceinline__ void wg_mma_rs<8>(float (&d)[8][4], const unsigned (&a)[4],
                                             unsigned long long b, int scale_d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11,  "
               "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23,  "
               "%24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                 "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                 "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                 "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
                 "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
                 "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
                 "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
                 "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
#else
  __trap();  // built for a target without wgmma: the host builds these kernels for sm_90a only
#endif
}
