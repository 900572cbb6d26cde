// Thread-block clusters (sm_90): a block's shared memory as seen from another block of its
// cluster, loads from there, and the cluster-wide barrier (kernel 48 adds its k slices' sums
// with them); a block's rank, arrivals on another block's mbarriers and the copy engine's
// multicast to several blocks (kernel 52 shares its weight stream between two images).
#pragma once

// Distributed shared memory: this block's shared address as seen in block 'rank' of the
// cluster, a float4 loaded from there, and the cluster-wide barrier (release / acquire, so
// the sums stored before it are what the other blocks read after it).
__device__ __forceinline__ unsigned cluster_address(const void* p, unsigned rank) {
  unsigned out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(out)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(rank));
  return out;
}

__device__ __forceinline__ float4 cluster_load4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// An arrival on the mbarrier at this block's shared address `bar` as seen in block `rank` of the
// cluster (release at cluster scope: what this thread did before is seen by that block's
// waiters).
__device__ __forceinline__ void mbar_arrive_remote(unsigned bar, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote)
               : "memory");
}

// `bytes` from global `src` to shared `dst` in every block of the cluster whose bit is set in
// `mask`, by the copy engine: each completes them as transaction bytes on its own barrier at
// `bar` (the same shared address in every block).
__device__ __forceinline__ void bulk_copy_multicast(unsigned dst, const void* src, unsigned bytes,
                                                    unsigned bar, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(mask)
      : "memory");
}
