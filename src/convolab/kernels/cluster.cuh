// Thread-block clusters (sm_90): a block's shared memory as seen from another block of its
// cluster, loads from there, the cluster-wide barrier, and the sum over a cluster's blocks that
// kernels 48, 52 and 54 add their k slices with; a block's rank and an arrival on another
// block's mbarrier (kernel 49's row tiles share x's copies).
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

// The float4 at `p` (this block's shared memory) added over blocks 0 .. RANKS - 1 of the cluster
// in rank order, so the same sum every run; RANKS = 1: this block's own, no cluster needed.
template <int RANKS>
__device__ __forceinline__ float4 cluster_sum4(const float* p) {
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int rank = 0; rank < RANKS; ++rank) {
    const float4 v = RANKS > 1 ? cluster_load4(cluster_address(p, rank))
                               : *reinterpret_cast<const float4*>(p);
    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
  }
  return s;
}

// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// An arrival on the mbarrier at shared address `bar` of block `rank` of the cluster (the same
// offset as in this block). The default (CTA-scope) release: what it orders are wgmma reads of
// a stage, already retired, before the copy engine's next writes into it, which the barrier
// itself orders. A cluster-scope release is a fence on every arrival: kernel 49's consumers
// took twice as long a chunk with it (docs/vgg.md, "fc6's split-k sum, and three feeds that
// did not help").
__device__ __forceinline__ void mbar_arrive_remote(unsigned bar, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
