"""Run every GPU backward kernel once at small shapes, for compute-sanitizer (memcheck,
racecheck): strides 1-3, both conv methods and both direct dW kernels (GEMM with a workspace
of a few images so several chunks run), max-pool with and without the pooled output,
subsampling, average pool.

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_backward.py
"""

from __future__ import annotations

import numpy as np


def main() -> None:
    import cupy as cp

    from convolab.gpu import backward

    backward.GEMM_WORKSPACE_FLOATS = 2 * 3 * 5 * 5 * 64  # forces several GEMM chunks
    rng = np.random.default_rng(0)

    def arr(*shape: int) -> cp.ndarray:
        return cp.asarray(rng.standard_normal(shape).astype(np.float32))

    for stride in (1, 2, 3):
        for method, max_taps_k in (("gemm", 9), ("direct", 9), ("direct", 0)):
            backward.MAX_TAPS_K = max_taps_k  # 0: the one-block-per-weight dW kernel
            x, w = arr(5, 3, 13, 11), arr(4, 3, 5, 5)
            ho, wo = (13 - 5) // stride + 1, (11 - 5) // stride + 1
            dy = arr(5, 4, ho, wo)
            for need_dx in (True, False):
                backward.conv2d_backward(x, w, dy, stride, method, need_dx=need_dx)
    for k, s in ((2, 2), (4, 4), (3, 2), (2, 1)):
        x = arr(2, 3, 11, 10)
        y = backward.maxpool2d_forward(x, k, s)
        dy = arr(*y.shape)
        backward.maxpool2d_backward(x, y, dy, k, s)
        backward.maxpool2d_backward(x, None, dy, k, s)
        coef, bias = arr(3), arr(3)
        out = backward.subsample_forward(x, coef, bias, k, s)
        backward.subsample_backward(x, out, dy, coef, bias, k, s)
        backward.subsample_backward(x, None, dy, coef, bias, k, s)
        backward.avgpool2d_backward(dy, x.shape, k, s)
    cp.cuda.Device().synchronize()
    print("sanitize_backward: all kernels ran")


if __name__ == "__main__":
    main()
