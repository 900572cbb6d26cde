"""Launch each kernel under study once at B=10000, for `ncu` (benchmarks/device_ncu.sh).

    PYTHONPATH=src python3 benchmarks/ncu_targets.py

conv1 and conv2 through their registered rung-13 entries (default plans), the fp16 network
kernels and the head through FusedLeNet. Inputs are random; nothing is checked
here (the correctness runs live beside the timing scripts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from convolab.gpu import fused  # noqa: E402
from convolab.gpu import network as gnet  # noqa: E402
from convolab.shapes import ConvShape  # noqa: E402


def main() -> None:
    import cupy as cp

    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    rng = np.random.default_rng(0)
    B = 10000
    params = gnet.random_params(0)
    x = cp.asarray(rng.random((B, 1, 86, 86), dtype=np.float32))
    for shape, pool, key in ((ConvShape(B, 1, 86, 86, 4, 7), 2, "c1"),
                             (ConvShape(B, 4, 40, 40, 16, 7), 4, "c3")):
        impl = fused.fused_conv_pool_impl(pool, "fp32")
        run = impl.prepare(shape, params[f"{key}.weight"], params[f"{key}.bias"], {})
        xin = x if key == "c1" else cp.asarray(rng.random((B, 4, 40, 40), dtype=np.float32))
        y = cp.empty(impl.out_shape(shape), cp.float32)
        run(xin, y)
    net = gnet.FusedLeNet(params, mode="fp16")
    net(x)
    cp.cuda.Device().synchronize()
    print("launched", flush=True)


if __name__ == "__main__":
    main()
