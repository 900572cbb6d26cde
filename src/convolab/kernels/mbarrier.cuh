// mbarriers (shared-memory barriers that count arrivals and, for the copy engines, bytes), the
// bulk copy engine's plain global -> shared copy and the tensor copy engine's 2-D box (also
// multicast to the blocks of a cluster): what rungs 40, 43 and 49 wait on.

#pragma once

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// An arrival on `bar` once every cp.async this thread issued so far has landed; the barrier's
// expected count already includes it (.noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The transaction bytes the current phase of `bar` waits for besides its arrivals (with this
// thread's arrival).
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared `dst`
// by the copy engine, completing as transaction bytes on `bar`.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes,
                                          unsigned bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The barriers just initialised are visible to the copy engine before any copy completes on
// them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// A tensor map written by a copy from the host: ordered before the copy engine reads it.
__device__ __forceinline__ void tma_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map)
               : "memory");
}

// The box of a 2-D tensor map at coordinates (c0 innermost, c1) into shared `dst`, laid out as
// the map says (its swizzle; zeros outside the tensor), completing as transaction bytes (the
// whole box's) on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* map, int c0, int c1,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// tma_load_2d into the same shared address of every block in `blocks` (a bit a cluster rank),
// completing on the barrier at the same address in each: one read from L2 for all of them.
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const void* map, int c0,
                                                      int c1, unsigned bar,
                                                      unsigned short blocks) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(blocks)
      : "memory");
}
