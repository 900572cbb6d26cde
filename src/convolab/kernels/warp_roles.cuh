// Warp specialization's primitives (sm_90a): moving registers between warpgroups of different
// roles (setmaxnreg: each warpgroup's role is one branch of an if/else, the kernel compiled
// with a register cap, __launch_bounds__(threads, 1)), and named barriers for handing shared
// memory from one role to another without stopping the whole block.
#pragma once

template <int REGS>
__device__ __forceinline__ void set_max_regs_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}

template <int REGS>
__device__ __forceinline__ void set_max_regs_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}

// Named barrier `id` (1-15; 0 is __syncthreads') completes once `threads` threads (whole
// warps) have reached it: bar_sync waits for that, bar_arrive only counts itself (a producer
// signalling consumers). Both order this thread's earlier shared-memory writes before what the
// waiting threads read after it.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
