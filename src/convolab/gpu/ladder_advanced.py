"""Rungs 8-12 of the GPU ladder: channel reductions, fp16, tensor cores, streams, FFT.

Each rung's kernel lives in kernels/NN_name.cu (read its header for what it adds and why);
this module is the host side: parameter spaces, `supports`, and `prepare`, which compiles,
lays out the weights, allocates workspace and returns a `run(x, y)` that only launches.
CuPy is imported inside `prepare` only, so this module imports on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convolab.backend import require_cupy
from convolab.gpu.compile import get_kernel, pairwise_points
from convolab.gpu.device import SMEM_STATIC_LIMIT
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, get_impl, register
from convolab.shapes import ConvShape, ceil_div

MAX_THREADS = 1024


def _i32(*values: int) -> tuple[np.int32, ...]:
    return tuple(np.int32(v) for v in values)


def _dims(shape: ConvShape) -> tuple[np.int32, ...]:
    return _i32(
        shape.B, shape.C, shape.H, shape.W, shape.M, shape.K, shape.S, shape.H_out, shape.W_out
    )


def _device_weights(w: Any, b: Any) -> tuple[Any, Any]:
    cp = require_cupy()
    return (
        cp.ascontiguousarray(cp.asarray(w, dtype=cp.float32)),
        cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32)),
    )


# --------------------------------------------------------------------------------------
# Rung 8a: channel-tree
# --------------------------------------------------------------------------------------

TREE_FILE = "08_channel_tree.cu"
TREE_SPACE: dict[str, tuple[int, ...]] = {
    "PIX": (64, 128),
    "CSPLIT": (1, 4, 8),
    "MPT": (2, 4, 8),
    "PPT": (1, 2, 4),
}
# CSPLIT=0: chosen from C by tree_split() (the measured LeNet optimum is CSPLIT=1, PPT=4).
TREE_DEFAULTS = {"PIX": 64, "CSPLIT": 0, "MPT": 4, "PPT": 4}


def tree_split(C: int) -> int:
    """Default channel slices per block: splitting pays only once each slice keeps several
    channels (C=1 or 4 on 4 slices leaves threads idle; measured 10 ms vs 2 ms on conv1)."""
    if C < 16:
        return 1
    return 4 if C < 32 else 8


def tree_defines(params: Mapping[str, Any]) -> dict[str, int]:
    pix, csplit, mpt = int(params["PIX"]), int(params["CSPLIT"]), int(params["MPT"])
    ppt = int(params.get("PPT", 1))
    if min(pix, mpt, ppt) < 1:
        raise ValueError(f"channel-tree: PIX, MPT and PPT must be >= 1, got {pix}, {mpt}, {ppt}")
    if csplit < 1 or csplit & (csplit - 1):
        raise ValueError(f"channel-tree: CSPLIT must be a power of two, got {csplit}")
    if pix * csplit > MAX_THREADS:
        raise ValueError(f"channel-tree: PIX*CSPLIT = {pix * csplit} threads > {MAX_THREADS}")
    if 4 * pix * csplit * mpt * ppt > SMEM_STATIC_LIMIT:
        raise ValueError(
            "channel-tree: PIX*CSPLIT*MPT*PPT partial sums exceed the static shared-memory limit"
        )
    return {"PIX": pix, "CSPLIT": csplit, "MPT": mpt, "PPT": ppt}


def _tree_variants() -> list[dict[str, int]]:
    return pairwise_points(TREE_SPACE, tree_defines)


def prepare_channel_tree(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    params = dict(params)
    if int(params["CSPLIT"]) == 0:
        params["CSPLIT"] = tree_split(shape.C)
    defines = tree_defines(params)
    kernel = get_kernel(TREE_FILE, "conv_channel_tree", defines)
    w_d, b_d = _device_weights(w, b)
    pix, csplit, mpt = defines["PIX"], defines["CSPLIT"], defines["MPT"]
    grid = (
        ceil_div(shape.H_out * shape.W_out, pix * defines["PPT"])
        * ceil_div(shape.M, mpt)
        * shape.B,
    )
    block = (pix, csplit)
    dims = _dims(shape)

    def run(x: Any, y: Any) -> None:
        kernel(grid, block, (x, w_d, b_d, y, *dims))

    return run


# --------------------------------------------------------------------------------------
# Rung 8b: channel-atomic
# --------------------------------------------------------------------------------------

ATOMIC_FILE = "08b_channel_atomic.cu"
ATOMIC_SPACE: dict[str, tuple[int, ...]] = {
    "PIX": (128, 256),
    "MPT": (2, 4, 8),
    "CGROUP": (1, 4, 16),
    "PPT": (1, 2, 4),
}
ATOMIC_DEFAULTS = {"PIX": 128, "MPT": 4, "CGROUP": 4, "PPT": 4}
_INIT_BLOCK = 256


def atomic_defines(params: Mapping[str, Any]) -> dict[str, int]:
    pix, mpt, group = int(params["PIX"]), int(params["MPT"]), int(params["CGROUP"])
    ppt = int(params.get("PPT", 1))
    if not (1 <= pix <= MAX_THREADS) or min(mpt, group, ppt) < 1:
        raise ValueError(
            f"channel-atomic: bad parameters PIX={pix} MPT={mpt} CGROUP={group} PPT={ppt}"
        )
    return {"PIX": pix, "MPT": mpt, "CGROUP": group, "PPT": ppt}


def prepare_channel_atomic(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    defines = atomic_defines(params)
    conv = get_kernel(ATOMIC_FILE, "conv_channel_atomic", defines)
    init = get_kernel(ATOMIC_FILE, "init_bias", defines)
    w_d, b_d = _device_weights(w, b)
    pix, mpt, group = defines["PIX"], defines["MPT"], defines["CGROUP"]
    n_pix = shape.H_out * shape.W_out
    total = shape.B * shape.M * n_pix
    grid = (
        ceil_div(n_pix, pix * defines["PPT"]) * ceil_div(shape.M, mpt) * shape.B,
        ceil_div(shape.C, group),
    )
    if grid[1] > 65535:
        raise ValueError("channel-atomic: more than 65535 channel groups; raise CGROUP")
    init_grid = (min(ceil_div(total, _INIT_BLOCK), 65535 * 8),)
    dims = _dims(shape)
    init_args = (np.int32(shape.M), np.int32(n_pix), np.int64(total))

    def run(x: Any, y: Any) -> None:
        init(init_grid, (_INIT_BLOCK,), (y, b_d, *init_args))
        conv(grid, (pix,), (x, w_d, y, *dims))

    return run


# --------------------------------------------------------------------------------------
# Rung 9: fp16
# --------------------------------------------------------------------------------------

FP16_FILE = "09_fp16.cu"
FP16_SPACE: dict[str, tuple[int, ...]] = {
    "TILE": (16, 32),
    "MPAIRS": (1, 2, 4),
    "HALF_ACCUM": (0, 1),
    "PPT": (1, 2, 4),
}
FP16_DEFAULTS = {"TILE": 16, "MPAIRS": 2, "HALF_ACCUM": 1, "PPT": 4}


def _fp16_shared_bytes(shape: ConvShape, tile: int, mpairs: int) -> int:
    in_tile = (tile - 1) * shape.S + shape.K
    return 4 * mpairs * shape.K * shape.K + 2 * in_tile * in_tile


def fp16_defines(params: Mapping[str, Any]) -> dict[str, int]:
    tile, mpairs, accum = int(params["TILE"]), int(params["MPAIRS"]), int(params["HALF_ACCUM"])
    ppt = int(params.get("PPT", 1))
    if tile < 1 or mpairs < 1 or accum not in (0, 1) or ppt < 1 or tile % ppt:
        raise ValueError(
            f"fp16: bad parameters TILE={tile} MPAIRS={mpairs} HALF_ACCUM={accum} PPT={ppt} "
            "(TILE must be a multiple of PPT)"
        )
    if tile * (tile // ppt) > MAX_THREADS:
        raise ValueError(f"fp16: TILE*TILE/PPT = {tile * tile // ppt} threads > {MAX_THREADS}")
    return {"TILE": tile, "MPAIRS": mpairs, "HALF_ACCUM": accum, "PPT": ppt}


def _fp16_variants() -> list[dict[str, int]]:
    return pairwise_points(FP16_SPACE, fp16_defines)


def _fp16_supports(shape: ConvShape) -> bool:
    largest = _fp16_shared_bytes(shape, FP16_DEFAULTS["TILE"], max(FP16_SPACE["MPAIRS"]))
    return largest <= SMEM_STATIC_LIMIT


def prepare_fp16(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    cp = require_cupy()
    defines = fp16_defines(params)
    tile, mpairs = defines["TILE"], defines["MPAIRS"]
    shared = _fp16_shared_bytes(shape, tile, mpairs)
    if shared > SMEM_STATIC_LIMIT:
        raise ValueError(
            f"fp16: input tile needs {shared} B of shared memory "
            f"(> {SMEM_STATIC_LIMIT} B); lower TILE"
        )
    kernel = get_kernel(FP16_FILE, "conv_fp16", defines)
    w_d, b_d = _device_weights(w, b)
    # Pack output channels in pairs {w[2j], w[2j+1]} as half2; an odd M gets a zero partner.
    m2 = ceil_div(shape.M, 2)
    padded = cp.zeros((2 * m2, shape.C, shape.K, shape.K), dtype=cp.float32)
    padded[: shape.M] = w_d
    w2 = cp.ascontiguousarray(cp.stack([padded[0::2], padded[1::2]], axis=-1).astype(cp.float16))
    grid = (
        ceil_div(shape.W_out, tile) * ceil_div(shape.H_out, tile) * ceil_div(m2, mpairs) * shape.B,
    )
    dims = _dims(shape)

    def run(x: Any, y: Any) -> None:
        kernel(grid, (tile * (tile // defines["PPT"]),), (x, w2, b_d, y, *dims), shared_mem=shared)

    return run


# --------------------------------------------------------------------------------------
# Rung 10: tensor-core (tf32, fp16, bf16, 3xtf32)
# --------------------------------------------------------------------------------------

TC_FILE = "10_tensor_core.cu"
TC_MODES = {"tf32": 0, "fp16": 1, "bf16": 2, "3xtf32": 3}
TC_SPACE: dict[str, tuple[int, ...]] = {
    "NFRAG": (1, 2, 4),
    "WARPS": (4,),
    "BK": (16, 32),
    "PREFETCH": (0, 1),
}
# The tuner's pick on both LeNet layers, every operand mode (H100).
TC_DEFAULTS = {"NFRAG": 4, "WARPS": 4, "BK": 16, "PREFETCH": 0}


def tc_defines(mode: str, params: Mapping[str, Any]) -> dict[str, int]:
    nfrag, warps, bk = int(params["NFRAG"]), int(params["WARPS"]), int(params["BK"])
    prefetch = int(params.get("PREFETCH", 1))
    if nfrag not in (1, 2, 4) or warps not in (1, 2, 4, 8) or bk % 16 or bk <= 0:
        raise ValueError(f"tensor-core: bad parameters NFRAG={nfrag} WARPS={warps} BK={bk}")
    elem = 4 if mode in ("tf32", "3xtf32") else 2
    bn = 16 * nfrag * warps
    shared = 16 * (bk + 8) * elem + 128 + bk * (bn + 8) * elem
    if shared > SMEM_STATIC_LIMIT or 16 * (bn + 4) * 4 > SMEM_STATIC_LIMIT:
        raise ValueError(
            f"tensor-core: block tile {bn} x {bk} exceeds the static shared-memory limit"
        )
    if prefetch not in (0, 1):
        raise ValueError(f"tensor-core: PREFETCH must be 0 or 1, got {prefetch}")
    return {
        "TC_MODE": TC_MODES[mode],
        "NFRAG": nfrag,
        "WARPS": warps,
        "BK": bk,
        "PREFETCH": prefetch,
    }


def _tc_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        return pairwise_points(TC_SPACE, lambda p: tc_defines(mode, p))

    return variants


def _tc_prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        defines = tc_defines(mode, params)
        kernel = get_kernel(TC_FILE, "conv_tensor_core", defines)
        w_d, b_d = _device_weights(w, b)
        bn = 16 * defines["NFRAG"] * defines["WARPS"]
        n_total = shape.B * shape.H_out * shape.W_out
        grid = (ceil_div(n_total, bn), ceil_div(shape.M, 16))
        if grid[1] > 65535:
            raise ValueError("tensor-core: too many output channels for the grid")
        block = (32 * defines["WARPS"],)
        dims = _dims(shape)

        def run(x: Any, y: Any) -> None:
            kernel(grid, block, (x, w_d, b_d, y, *dims))

        return run

    return prepare


# --------------------------------------------------------------------------------------
# Rung 11: streams (Layer Time: host arrays in, host array out)
# --------------------------------------------------------------------------------------

STREAMS_SPACE: dict[str, tuple[Any, ...]] = {"chunks": (4, 8, 16), "streams": (2, 3, 4)}
STREAMS_DEFAULTS: dict[str, Any] = {
    "chunks": 8,
    "streams": 3,
    "inner": "channel-tree",
    "inner_params": None,
}


def _chunks(total: int, n_chunks: int) -> list[tuple[int, int]]:
    size = ceil_div(total, max(1, min(n_chunks, total)))
    return [(b0, min(total, b0 + size)) for b0 in range(0, total, size)]


def _streams_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    p = dict(STREAMS_DEFAULTS)
    p.update(params or {})
    if int(p["chunks"]) < 1 or int(p["streams"]) < 1:
        raise ValueError(
            f"streams: chunks and streams must be >= 1, got {p['chunks']}, {p['streams']}"
        )
    inner = get_impl(str(p["inner"]))
    if inner.device != "gpu" or inner.pool or inner.name in ("streams", "auto"):
        raise ValueError(f"streams: inner kernel must be a plain GPU conv rung, not {inner.name!r}")
    return p


def _inner_runs(
    shape: ConvShape, w_d: Any, b_d: Any, p: Mapping[str, Any], spans: list[tuple[int, int]]
) -> dict[int, Run]:
    """One prepared inner run per distinct chunk size (all equal except maybe the last)."""
    inner = get_impl(str(p["inner"]))
    inner_params = inner.params_for(p.get("inner_params"))
    runs: dict[int, Run] = {}
    for b0, b1 in spans:
        n = b1 - b0
        if n not in runs:
            chunk_shape = shape.with_batch(n)
            inner.check(chunk_shape)
            runs[n] = inner.prepare(chunk_shape, w_d, b_d, inner_params)
    return runs


def prepare_streams(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    """On device arrays the chunks are simply launched one after another (Op Time of the
    inner kernel plus per-launch overhead); the overlap lives in layer_forward_streams."""
    p = _streams_params(params)
    w_d, b_d = _device_weights(w, b)
    spans = _chunks(shape.B, int(p["chunks"]))
    runs = _inner_runs(shape, w_d, b_d, p, spans)

    def run(x: Any, y: Any) -> None:
        for b0, b1 in spans:
            runs[b1 - b0](x[b0:b1], y[b0:b1])

    return run


def _check_host_input(x_host: Any, w: Any, b: Any, stride: int) -> ConvShape:
    if not isinstance(x_host, np.ndarray):
        raise TypeError(
            f"layer forward: the input must be a NumPy array, got {type(x_host).__name__}"
        )
    if x_host.dtype != np.float32:
        raise TypeError(f"layer forward: the input must be float32, got {x_host.dtype}")
    for label, a in (("weights", w), ("bias", b)):
        if getattr(a, "dtype", None) != np.float32:
            raise TypeError(f"layer forward: {label} must be float32")
    shape = ConvShape.of(x_host.shape, tuple(w.shape), stride)
    if tuple(b.shape) != (shape.M,):
        raise ValueError(f"layer forward: bias must have shape ({shape.M},), got {tuple(b.shape)}")
    return shape


def layer_forward_streams(
    x_host: np.ndarray, w: Any, b: Any, stride: int = 1, params: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Layer Time path: host x in, host y out, batch chunks pipelined over CUDA streams.

    Per chunk, on stream i % streams: copy the NumPy chunk into a pinned staging buffer
    (CPU), async H2D from it, the inner kernel, async D2H straight into the pinned result.
    While one chunk computes, the next one's H2D and the previous one's D2H are in flight
    (H100 copies both directions at once), and the CPU fills the next staging buffer.
    The returned array is a NumPy view of pinned memory (no final host copy).
    """
    cp = require_cupy()
    import cupyx

    shape = _check_host_input(x_host, w, b, stride)
    p = _streams_params(params)
    x_host = np.ascontiguousarray(x_host)
    w_d, b_d = _device_weights(w, b)
    spans = _chunks(shape.B, int(p["chunks"]))
    n_streams = min(int(p["streams"]), len(spans))
    # One prepared inner run per stream: a rung with workspace (fft) must not share it.
    runs = [_inner_runs(shape, w_d, b_d, p, spans) for _ in range(n_streams)]
    cp.cuda.Device().synchronize()  # weights/workspace made on the default stream are ready
    chunk = spans[0][1] - spans[0][0]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(n_streams)]
    staging = [cupyx.empty_pinned((chunk, shape.C, shape.H, shape.W), np.float32) for _ in streams]
    x_dev = [cp.empty((chunk, shape.C, shape.H, shape.W), np.float32) for _ in streams]
    y_dev = [cp.empty((chunk, *shape.y_shape[1:]), np.float32) for _ in streams]
    y_host = cupyx.empty_pinned(shape.y_shape, np.float32)
    staged: list[Any] = [None] * n_streams  # event: staging buffer i may be overwritten
    for i, (b0, b1) in enumerate(spans):
        s = i % n_streams
        n = b1 - b0
        if staged[s] is not None:
            staged[s].synchronize()
        np.copyto(staging[s][:n], x_host[b0:b1])
        with streams[s]:
            x_dev[s][:n].set(staging[s][:n], stream=streams[s])
            staged[s] = streams[s].record()
            runs[s][n](x_dev[s][:n], y_dev[s][:n])
            y_dev[s][:n].get(stream=streams[s], out=y_host[b0:b1])
    for stream in streams:
        stream.synchronize()
    return y_host


def layer_forward_plain(
    x_host: np.ndarray,
    w: Any,
    b: Any,
    stride: int = 1,
    inner: str = "channel-tree",
    inner_params: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """The same layer without streams: one blocking H2D, one kernel, one D2H (the baseline)."""
    cp = require_cupy()
    shape = _check_host_input(x_host, w, b, stride)
    impl = get_impl(inner)
    impl.check(shape)
    w_d, b_d = _device_weights(w, b)
    run = impl.prepare(shape, w_d, b_d, impl.params_for(inner_params))
    x_d = cp.asarray(x_host)
    y_d = cp.empty(shape.y_shape, dtype=cp.float32)
    run(x_d, y_d)
    return y_d.get()


# --------------------------------------------------------------------------------------
# Rung 12: fft
# --------------------------------------------------------------------------------------

FFT_FILE = "12_fft.cu"
FFT_SPACE: dict[str, tuple[int, ...]] = {"fft_size": (16, 32, 64), "MPT": (2, 4, 8)}
FFT_DEFAULTS = {"fft_size": 32, "MPT": 4, "workspace_mb": 1024}
_FFT_BLOCK = 256
_MAX_FFT = 256


def fft_plan(shape: ConvShape, fft_size: int) -> tuple[int, int, int, int]:
    """(N, L, tiles_h, tiles_w): FFT size grown until each block keeps L >= K outputs."""
    n = int(fft_size)
    if n < 4 or n & (n - 1):
        raise ValueError(f"fft: fft_size must be a power of two >= 4, got {fft_size}")
    while n - shape.K + 1 < shape.K and n < _MAX_FFT:
        n *= 2
    block = n - shape.K + 1
    if block < 1:
        raise ValueError(f"fft: kernel K={shape.K} too large for FFT size {n}")
    return n, block, ceil_div(shape.H, block), ceil_div(shape.W, block)


def _fft_supports(shape: ConvShape) -> bool:
    return 2 * shape.K - 1 <= _MAX_FFT


def prepare_fft(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
    cp = require_cupy()
    n, block, tiles_h, tiles_w = fft_plan(shape, params["fft_size"])
    mpt = int(params["MPT"])
    if mpt < 1:
        raise ValueError(f"fft: MPT must be >= 1, got {mpt}")
    workspace = int(params.get("workspace_mb", FFT_DEFAULTS["workspace_mb"])) * 2**20
    defines = {"MPT": mpt}
    extract = get_kernel(FFT_FILE, "extract_tiles", defines)
    mac = get_kernel(FFT_FILE, "channel_mac", defines)
    gather = get_kernel(FFT_FILE, "overlap_add_crop", defines)
    w_d, b_d = _device_weights(w, b)
    C, M, K = shape.C, shape.M, shape.K
    T = tiles_h * tiles_w
    F = n * (n // 2 + 1)
    # Correlation = convolution with the flipped kernel; its transform is computed once.
    padded = cp.zeros((M, C, n, n), dtype=cp.float32)
    padded[:, :, :K, :K] = w_d[:, :, ::-1, ::-1]
    w_hat = cp.ascontiguousarray(cp.fft.rfft2(padded).astype(cp.complex64))
    per_image = C * T * (n * n * 4 + F * 8) + M * T * (F * 8 + n * n * 4)
    chunk = max(1, min(shape.B, 65535, workspace // per_image))
    tiles = cp.empty((chunk, C, T, n, n), dtype=cp.float32)
    y_hat = cp.empty((chunk, M, T, n, n // 2 + 1), dtype=cp.complex64)
    Ho, Wo = shape.H_out, shape.W_out

    def run(x: Any, y: Any) -> None:
        for b0 in range(0, shape.B, chunk):
            nb = min(chunk, shape.B - b0)
            t = tiles[:nb]
            total_in = nb * C * T * n * n
            extract(
                (min(ceil_div(total_in, _FFT_BLOCK), 1 << 20),),
                (_FFT_BLOCK,),
                (x[b0 : b0 + nb], t, *_i32(nb * C, shape.H, shape.W, block, n, tiles_h, tiles_w)),
            )
            x_hat = cp.fft.rfft2(t)
            yh = y_hat[:nb]
            mac(
                (ceil_div(T * F, _FFT_BLOCK), ceil_div(M, mpt), nb),
                (_FFT_BLOCK,),
                (x_hat, w_hat, yh, *_i32(C, M, T, F)),
            )
            y_tiles = cp.fft.irfft2(yh, s=(n, n))
            total_out = nb * M * Ho * Wo
            gather(
                (min(ceil_div(total_out, _FFT_BLOCK), 1 << 20),),
                (_FFT_BLOCK,),
                (
                    y_tiles,
                    b_d,
                    y[b0 : b0 + nb],
                    *_i32(nb * M, M, Ho, Wo, K, shape.S, block, n, tiles_h, tiles_w),
                ),
            )

    return run


def _fft_variants() -> list[dict[str, int]]:
    return [{"MPT": m} for m in FFT_SPACE["MPT"]]


# --------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------

register(
    ConvImpl(
        name="channel-tree",
        rung=8,
        device="gpu",
        kernel_file=TREE_FILE,
        demonstrates="input channels split over a block's threads, summed by a shared-memory tree",
        prepare=prepare_channel_tree,
        space=TREE_SPACE,
        defaults=TREE_DEFAULTS,
        compile_variants=_tree_variants,
        tolerance=TOLERANCE["fp32"],
    )
)
register(
    ConvImpl(
        name="channel-atomic",
        rung=8,
        device="gpu",
        kernel_file=ATOMIC_FILE,
        demonstrates="input-channel groups on separate blocks, summed into y with atomicAdd",
        prepare=prepare_channel_atomic,
        space=ATOMIC_SPACE,
        defaults=ATOMIC_DEFAULTS,
        compile_variants=lambda: pairwise_points(ATOMIC_SPACE, atomic_defines),
        tolerance=TOLERANCE["fp32"],
    )
)
register(
    ConvImpl(
        name="fp16",
        rung=9,
        device="gpu",
        kernel_file=FP16_FILE,
        demonstrates="fp16 operands, half2 math on output-channel pairs, fp32 accumulation",
        prepare=prepare_fp16,
        space=FP16_SPACE,
        defaults=FP16_DEFAULTS,
        supports=_fp16_supports,
        compile_variants=_fp16_variants,
        tolerance=TOLERANCE["fp16"],
    )
)
for _mode, _what in (
    ("tf32", "implicit GEMM on tensor cores (WMMA), TF32 operands"),
    ("fp16", "implicit GEMM on tensor cores (WMMA), FP16 operands, FP32 accumulation"),
    ("bf16", "implicit GEMM on tensor cores (WMMA), BF16 operands, FP32 accumulation"),
    ("3xtf32", "tensor cores at fp32 accuracy: operands split in big+small TF32, 3 MMAs"),
):
    register(
        ConvImpl(
            name=f"tensor-core-{_mode}",
            rung=10,
            device="gpu",
            kernel_file=TC_FILE,
            demonstrates=_what,
            prepare=_tc_prepare(_mode),
            space=TC_SPACE,
            defaults=TC_DEFAULTS,
            compile_variants=_tc_variants(_mode),
            tolerance=TOLERANCE[_mode],
        )
    )
register(
    ConvImpl(
        name="streams",
        rung=11,
        device="gpu",
        kernel_file=TREE_FILE,
        demonstrates="batch chunks on CUDA streams, pinned memory, copies overlapped (Layer Time)",
        prepare=prepare_streams,
        space=STREAMS_SPACE,
        defaults=STREAMS_DEFAULTS,
        compile_variants=lambda: [tree_defines(dict(TREE_DEFAULTS, CSPLIT=c)) for c in (1, 4, 8)],
        tolerance=TOLERANCE["fp32"],
    )
)
register(
    ConvImpl(
        name="fft",
        rung=12,
        device="gpu",
        kernel_file=FFT_FILE,
        demonstrates="FFT convolution (cuFFT), overlap-add tiles, channel sum in frequency space",
        prepare=prepare_fft,
        space=FFT_SPACE,
        defaults=FFT_DEFAULTS,
        supports=_fft_supports,
        compile_variants=_fft_variants,
        tolerance=TOLERANCE["fp32"],
    )
)

__all__ = ["fft_plan", "layer_forward_plain", "layer_forward_streams"]
