"""How fast one block an SM reads a buffer that does not fit in L2 through the bulk copy engine
(cp.async.bulk global -> shared, completing on mbarriers), as kernels 43, 49 and 54 stream their
weights: is a ring of copies in flight at once, or does the engine take them one by one?

    PYTHONPATH=src python3 benchmarks/bulk_rate.py [--mb 205] [--reps 20]

One block an SM, each reading its own contiguous range (as a split-k GEMV block reads its
slice) in copies of SIZE bytes into a ring of STAGES stages; ISSUERS threads each run their own
ring over an equal share of the block's range (1: one thread issues every copy, as the kernels
do). Nothing computes: a stage is refilled as soon as its copy has landed. Prints the medians of
R event timings of one launch (TB/s) at every point, and the plain ld.global stream beside it
(each thread 8 16-byte loads in flight). docs/vgg.md, "Kernel 55", has the H200's numbers.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import Any

from convolab.gpu.compile import KERNEL_DIR
from convolab.timing import time_gpu

SOURCE = r"""
#include "mbarrier.cuh"
#ifndef BR_SIZE  // the plain-load kernel's build
#define BR_SIZE 16
#define BR_STAGES 1
#define BR_ISSUERS 1
#endif

extern "C" __global__ void bulk_rate(const unsigned char* __restrict__ src, long long per_block,
                                     unsigned* out) {
  extern __shared__ __align__(1024) unsigned char ring[];
  __shared__ __align__(8) unsigned long long bars[BR_ISSUERS * BR_STAGES];
  const int t = threadIdx.x;
  if (t < BR_ISSUERS) {
    const unsigned bar0 = static_cast<unsigned>(__cvta_generic_to_shared(bars)) +
                          8 * BR_STAGES * t;
    const unsigned ring0 = static_cast<unsigned>(__cvta_generic_to_shared(ring)) +
                           BR_STAGES * BR_SIZE * t;
    for (int s = 0; s < BR_STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
    fence_barrier_init();
    const long long share = per_block / BR_ISSUERS;
    const unsigned char* p = src + blockIdx.x * per_block + t * share;
    const long long copies = share / BR_SIZE;
    for (long long i = 0; i < copies; ++i) {
      const int s = (int)(i % BR_STAGES);
      if (i >= BR_STAGES) mbar_wait(bar0 + 8 * s, (unsigned)((i / BR_STAGES - 1) & 1));
      mbar_expect_tx(bar0 + 8 * s, BR_SIZE);
      bulk_copy(ring0 + s * BR_SIZE, p + i * BR_SIZE, BR_SIZE, bar0 + 8 * s);
    }
    for (long long i = copies > BR_STAGES ? copies - BR_STAGES : 0; i < copies; ++i)
      mbar_wait(bar0 + 8 * (int)(i % BR_STAGES), (unsigned)((i / BR_STAGES) & 1));
    if (blockIdx.x == 0 && t == 0) out[0] = ring[0];
  }
}

extern "C" __global__ void load_rate(const uint4* __restrict__ src, long long per_block,
                                     unsigned* out) {
  const uint4* p = src + blockIdx.x * (per_block / 16);
  unsigned acc = 0;
  for (long long i = threadIdx.x; i < per_block / 16; i += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
      v[u] = i + u * blockDim.x < per_block / 16 ? __ldg(p + i + u * blockDim.x) : uint4{};
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
"""


def _median_ms(launch: Any, reps: int) -> float:
    return statistics.median(time_gpu(launch, reps=reps, warmup=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=205, help="bytes read, MB")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    import cupy as cp

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    blocks = 128  # as kernel 49 launches at fc6: 128 blocks, one an SM
    per_block = (args.mb * 10**6 // blocks) // 65536 * 65536
    buf = cp.random.randint(0, 255, size=blocks * per_block, dtype=cp.int32).astype(cp.uint8)
    out = cp.zeros(1, cp.uint32)
    total = blocks * per_block
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs, {blocks} "
          f"blocks, {total / 1e6:.0f} MB")
    print(f"{'size':>6} {'stages':>6} {'issuers':>7} {'ms':>8} {'TB/s':>6}")
    for size, stages, issuers in itertools.product((4096, 16384, 32768), (1, 2, 4, 8),
                                                   (1, 2, 4)):
        smem = size * stages * issuers
        if smem > 200 * 1024:
            continue
        kernel = cp.RawKernel(SOURCE, "bulk_rate", options=(
            "-std=c++17", f"-I{KERNEL_DIR}", f"-DBR_SIZE={size}", f"-DBR_STAGES={stages}",
            f"-DBR_ISSUERS={issuers}"))
        kernel.max_dynamic_shared_size_bytes = smem

        def launch(kernel: Any = kernel, smem: int = smem) -> None:
            kernel((blocks,), (32,), (buf, cp.int64(per_block), out), shared_mem=smem)

        ms = _median_ms(launch, args.reps)
        print(f"{size:6d} {stages:6d} {issuers:7d} {ms:8.4f} {total / ms / 1e9:6.2f}",
              flush=True)
    loads = cp.RawKernel(SOURCE, "load_rate", options=("-std=c++17", f"-I{KERNEL_DIR}"))
    for threads in (256, 512):
        ms = _median_ms(lambda t=threads: loads((blocks,), (t,), (buf, cp.int64(per_block),
                                                                  out)), args.reps)
        print(f"ld.global, {threads} threads a block, 8 loads in flight: {ms:.4f} ms, "
              f"{total / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
