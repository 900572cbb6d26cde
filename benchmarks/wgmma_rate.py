"""The warpgroup MMA's rate against its N: how long one m64nNk16 fp16 wgmma with A in registers
(the form rungs 44 and 45 issue) occupies an SM, for N = 8 ... 256 and 1, 2 or 4 warpgroups an
SM. It answers whether two products that share A cost less as one wgmma of twice the N (a
kernel built from small-N wgmmas gains only if the time per instruction does not grow with N),
and (--chains 2) whether a lone warpgroup reaches the SM's rate when its wgmmas alternate
between two accumulator sets instead of each waiting on the one before.

Each warpgroup runs ITERS groups of U wgmmas (B: N x 16 zeros in shared memory, no swizzle),
wgmma u into accumulator set u % chains, committing and waiting on each group; the grid is one
block of one warpgroup per (SM, slot). Timed by CUDA events, median of REPS launches after a
warm-up.

    PYTHONPATH=src python3 benchmarks/wgmma_rate.py [--json FILE] [--chains 1 2] [--group 4 16]
        [--n 24 48]
"""

from __future__ import annotations

import argparse
import json
import statistics

from convolab.gpu.compile import KERNEL_DIR, _arch_cubin, cuda_include_dirs

N_VALUES = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WARPGROUPS = (1, 2, 4)  # blocks of one warpgroup an SM
U = 4  # wgmmas a commit group
ITERS = 4096
REPS = 21

SOURCE = r"""
#include "wgmma_core.cuh"
extern "C" __global__ void __launch_bounds__(128) rate(float* out, int iters) {
  __shared__ __align__(128) unsigned char bsm[NN * 32];
  for (int i = threadIdx.x; i < NN * 8; i += 128) reinterpret_cast<unsigned*>(bsm)[i] = 0u;
  wg_proxy_fence();
  __syncthreads();
  const unsigned long long d0 =
      wg_desc_interleaved((unsigned)__cvta_generic_to_shared(bsm), 128, 256);
  unsigned a0 = 0x3c003c00u ^ threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3;
  float d[CC * NN / 2];
  for (int i = 0; i < CC * NN / 2; ++i) d[i] = 0.f;
  for (int it = 0; it < iters; ++it) {
    wg_fence();
#pragma unroll
    for (int u = 0; u < UU; ++u) {
      float* dc = d + (u % CC) * (NN / 2);
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %SCALE, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n" NSTR "k16.f32.f16.f16 {" DLIST "}, "
                   "{%AREG0, %AREG1, %AREG2, %AREG3}, %BDESC, p, 1, 1, 0;\n}\n"
                   : DOUT : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(d0), "r"(iters));
    }
    wg_commit();
    wg_wait<0>();
  }
  float s = 0.f;
  for (int i = 0; i < CC * NN / 2; ++i) s += d[i];
  if (s == 12345.f) out[threadIdx.x] = s;  // keeps the wgmmas alive
}
"""


def source_for(n: int, chains: int = 1, group: int = U) -> str:
    regs = n // 2  # fp32 accumulators a thread: 64 x N over 128 threads
    dlist = '"' + ", ".join(f"%{i}" for i in range(regs)) + '"'
    dout = ", ".join(f'"+f"(dc[{i}])' for i in range(regs))
    text = SOURCE.replace("NSTR", f'"{n}"').replace("DLIST", dlist).replace("DOUT", dout)
    for i in range(4):
        text = text.replace(f"%AREG{i}", f"%{regs + i}")
    text = text.replace("%BDESC", f"%{regs + 4}").replace("%SCALE", f"%{regs + 5}")
    return text.replace("NN", str(n)).replace("UU", str(group)).replace("CC", str(chains))


def measure(n: int, wgs: int, chains: int = 1, group: int = U) -> dict[str, float]:
    import cupy as cp

    options = ("--std=c++17", f"-I{KERNEL_DIR}", *(f"-I{d}" for d in cuda_include_dirs()))
    path = _arch_cubin(f"wgmma_rate_{n}_{chains}_{group}.cu", source_for(n, chains, group),
                       options, "sm_90a")
    kernel = cp.RawModule(path=str(path)).get_function("rate")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(128, cp.float32)
    grid = sms * wgs
    kernel((grid,), (128,), (out, cp.int32(ITERS)))  # warm-up
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(REPS):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        kernel((grid,), (128,), (out, cp.int32(ITERS)))
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
    t = statistics.median(times)
    count = grid * ITERS * group
    return {"n": n, "warpgroups_per_sm": wgs, "chains": chains, "group": group, "seconds": t,
            "tflops": 2 * 64 * n * 16 * count / t / 1e12,
            "ns_per_wgmma_per_sm": t * sms / count * 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--chains", type=int, nargs="+", default=[1],
                        help="accumulator sets a warpgroup alternates between (1 or 2)")
    parser.add_argument("--group", type=int, nargs="+", default=[U],
                        help="wgmmas a commit group")
    parser.add_argument("--n", type=int, nargs="+", default=list(N_VALUES), help="N values")
    args = parser.parse_args()
    rows = []
    print(f"{'N':>4} {'wg/SM':>5} {'chains':>6} {'group':>5} {'TFLOP/s':>8} {'ns/wgmma/SM':>12}")
    for n in args.n:
        for chains in args.chains:
            for group in args.group:
                for wgs in WARPGROUPS:
                    row = measure(n, wgs, chains, group)
                    rows.append(row)
                    print(f"{n:4d} {wgs:5d} {chains:6d} {group:5d} {row['tflops']:8.1f} "
                          f"{row['ns_per_wgmma_per_sm']:12.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
