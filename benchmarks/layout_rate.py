"""How fast rungs 39-40's layout pass (NCHW fp32 -> channels-last operands) moves its bytes, at
each block tile, on the layers whose NCHW rows pay for it (conv5_x, conv1_2).

    PYTHONPATH=src python3 benchmarks/layout_rate.py [--reps 30] [--default-only]

For each layer, mode and (channels, pixels) tile: the median of R event timings of one pass
(microseconds) and its rate (bytes read + written over that time), then the D2D copy of the
same bytes as the ceiling. `--default-only` times only the package's own tile (with an older
`src/` on PYTHONPATH, whose layout pass takes no tile: the before of a change).
"""

from __future__ import annotations

import argparse
import inspect
import statistics

import numpy as np

SHAPES = {"conv5_x B=16": (16, 512, 16, 16), "conv5_x B=32": (32, 512, 16, 16),
          "conv1_2 B=16": (16, 64, 226, 226)}
TILES = ((32, 32), (64, 32), (32, 64), (32, 128), (64, 64))
MODES = ("fp16", "tf32")


def main() -> None:
    import cupy as cp

    from convolab.gpu import implicit_gemm as ig
    from convolab.gpu import implicit_gemm_wgmma as wg
    from convolab.shapes import ConvShape
    from convolab.timing import time_gpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--default-only", action="store_true")
    args = parser.parse_args()
    takes_tile = "tile" in inspect.signature(wg.layout_pass).parameters
    tiles = TILES if takes_tile and not args.default_only else (None,)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, medians of {args.reps}")
    print(f"{'layer':<14} {'mode':<5} {'tile':>8} {'us':>8} {'TB/s':>6}")
    for label, (b, c, h, w) in SHAPES.items():
        shape = ConvShape(b, c, h, w, 64, 3)
        x = cp.random.standard_normal((b, c, h, w), dtype=cp.float32)
        for mode in MODES:
            out_bytes = b * h * w * ig.padded_channels(c) * ig.elem_bytes(mode) * wg.planes(mode)
            moved = x.nbytes + out_bytes
            for tile in tiles:
                convert = wg.layout_pass(shape, mode) if tile is None else \
                    wg.layout_pass(shape, mode, tile)
                us = statistics.median(time_gpu(lambda f=convert, x=x: f(x), args.reps)) * 1e3
                name = "default" if tile is None else f"{tile[0]}x{tile[1]}"
                print(f"{label:<14} {mode:<5} {name:>8} {us:8.1f} {moved / us / 1e6:6.2f}",
                      flush=True)
        src = cp.empty(moved // 8, dtype=np.float32)  # read + written: the last mode's bytes
        dst = cp.empty_like(src)
        us = statistics.median(time_gpu(
            lambda s=src, d=dst: d.data.copy_from_device_async(s.data, s.nbytes), args.reps)) * 1e3
        print(f"{label:<14} D2D copy, {moved / 1e6:.1f} MB read + written: {us:.1f} us "
              f"({2 * src.nbytes / us / 1e6:.2f} TB/s)")


if __name__ == "__main__":
    main()
