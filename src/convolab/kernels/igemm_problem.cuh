// The implicit-GEMM problem as kernels 26, 27, 39 and 40 receive it, their operand type, and
// the 16-byte copy their loaders issue: one tap's channels are contiguous in the channels-last
// input, so every operand piece is one cp.async, zero-filled past the tile edges.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Operand modes (IG_MODE): 0 tf32, 1 fp16, 2 bf16, 3 3xtf32 (tf32 big + small planes), 4 3xfp16
// (fp16 hi + lo planes of operands scaled by powers of two; the wgmma rungs only).
#ifndef IG_MODE
#define IG_MODE 1
#endif
#if IG_MODE == 1 || IG_MODE == 4
typedef __half ig_t;
#elif IG_MODE == 2
typedef __nv_bfloat16 ig_t;
#else
typedef float ig_t;
#endif

// The problem, as the kernels receive it (passed by value).
struct IgProblem {
  int N;      // B * Ho * Wo
  int M;
  int Kd;     // K * K * Cp
  int Cp;
  int H, W, K, S, Ho, Wo;
};
// Kernel parameters as plain ints (what the host launcher passes), gathered into IgProblem.
#define IG_PROBLEM_ARGS int N_, int M_, int Kd_, int Cp_, int H_, int W_, int K_, int S_, \
                        int Ho_, int Wo_
#define IG_PROBLEM (IgProblem{N_, M_, Kd_, Cp_, H_, W_, K_, S_, Ho_, Wo_})

__device__ __forceinline__ void ig_cp16(unsigned saddr, const void* src, bool valid) {
  // src-size 0 zero-fills the 16 bytes and reads nothing: tile edges need no branch.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
