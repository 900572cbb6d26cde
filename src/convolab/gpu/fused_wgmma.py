"""Host side of rung 44 (kernels/44_fused_conv_pool_wgmma.cu, `fcp_wgmma`): rung 28's fused
conv + bias + ReLU + max-pool 2 for wide layers with its MMAs on Hopper's warpgroup MMA
(wgmma, sm_90a), in fp16 or the fp32-exact 3xfp16.

Rung 28's geometry (gpu/fused_wide.py: staged image, row pitch, k run order, units) is reused
as it is; what is new is the weights' form: `wgmma_blocks` packs each (k-chunk, filter row)
block of 8 NT channels x 16 k as core matrices in falling filter row order (and, where
`default_tails` says so, the rows' run tails packed into shared chunks), the layout the
kernel's wgmma descriptors read. `prepare` returns run(x, out) with rung 28's contract. The
registry entries `fused-conv-pool2-wgmma-{tc,3xfp16}` wrap it for fp32 input. Nothing here
imports CuPy at module import time.

Rung 46 (kernels/46_fused_conv_pool_wgmma_ws.cu, `fcp_wgmma_ws`) is the same loop
warp-specialized: a producer warpgroup stages the next image (by the bulk copy engine into a
raw buffer, then split into one of two staged slots) while two consumer warpgroups compute;
same weights, same defines for the loop, one block an SM (`fused-conv-pool2-wgmma-ws-*`).
`prepare`'s `rung` parameter picks between them (0: `default_rung`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.errors import InputError
from convolab.gpu import fused_wide
from convolab.gpu.device import SM_SMEM_BYTES
from convolab.gpu.implicit_gemm import SMEM_LIMIT
from convolab.gpu.implicit_gemm_wgmma import wgmma_ruled_out
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "44_fused_conv_pool_wgmma.cu"
KERNEL = "fcp_wgmma"
PRECISIONS: dict[str, int] = {"fp16": 0, "3xfp16": 3}  # -> FW_PREC
POOL = 2
MAX_M = 32  # wgmma N = 8 * n-tiles, written out for 1-4 n-tiles
CORE_PAIR = 256  # two 8 x 16-byte core matrices: 8 channels x 16 k
ALIGN = 128  # FW_ALIGN: the kernel aligns the weights to it
SPACE: dict[str, list[int]] = {
    "wgs": [1, 2],  # warpgroups a block (they share the staged image and the weights)
    "minb": [1, 2],  # blocks per SM the registers must allow (__launch_bounds__)
    "bps": [0, 1, 2],  # persistent blocks per SM (0: as many as fit)
    "pitch": [0],  # staged row pitch in pixels (0: default_pitch)
    "ring": [3, 4, 5, 6],  # A slots (0: DEFAULT_RING)
    "lead": [1, 2, 3],  # shifts ahead A is loaded: ring - lead - 1 groups run meanwhile
    "sum": [1, 2, 3, 6],  # 3xfp16: k-chunks a sum from zero before it joins the fp32 total
    "tails": [-1, 1],  # 1: pack the filter rows' run tails into shared chunks; -1 never
}
DEFAULT_SUM = 2  # 1 spills at ring 5 (255 registers)
DEFAULT_LEAD = 2
# fp16 with one warpgroup a block needs ~230 registers (the image staged in one pass by 128
# threads): two blocks an SM, 0.66 ms on eecs498's conv2; two warpgroups a block share the
# staging, fit 16 warps an SM and took 0.42-0.44 ms (H100, docs/raw.md).
DEFAULT_WGS = {"fp16": 2, "3xfp16": 1}
# 3xfp16 at 4 slots spills (ptxas, 255 registers at two blocks an SM); 5 does not.
DEFAULT_RING = {"fp16": 4, "3xfp16": 5}
BLOCKS_PER_SM = 2  # one block stages its next image while the other computes
_SUFFIX = {"fp16": "tc", "3xfp16": "3xfp16"}

WS_KERNEL_FILE = "46_fused_conv_pool_wgmma_ws.cu"
WS_KERNEL = "fcp_wgmma_ws"
WS_CONSUMERS = 2  # FW_WGS of rung 46: the warpgroups that compute (one more stages)
# Fed staged records, the producer only copies them, so its issue share goes to a third
# consumer: while one stores its m-tile, two still issue wgmmas. H200, eecs498's conv2 (ncu,
# docs/raw.md "Three consumers"): 690 -> 661 us; where the producer stages floats it lost
# (mxnet's exact conv2 777 -> 788, eecs498's fp16 325 -> 342).
WS_STAGED_CONSUMERS = 3
WS_TAIL_BYTES = 32  # FWS_TAIL_BYTES: the mbarrier, two exponents, the producer's maxima
WS_SPACE: dict[str, list[int]] = {
    **{key: SPACE[key] for key in ("pitch", "ring", "lead", "sum", "tails")},
    # computing warpgroups (0: WS_CONSUMERS); three get 152 registers a thread (setmaxnreg),
    # in which 3xfp16's loop fits at ring 4 with one sum over every chunk (ring 5 spills)
    "consumers": [2, 3],
}
WS_THREE_CONSUMERS = {"ring": 4, "sum": 6}
STAGED = "staged"  # prepare's in_dtype for rung 46 fed staged records (FWS_STAGED_IN)
# The second block's parameters that choose its handoff from conv1 (FusedLeNet's): staged
# records or fp32 maps, and kernel 47 (gpu/fused_pair.py) or the pair apart
PAIR_KEYS = ("staged", "merge", "first_wgs")
RECORD_TAIL = 16  # a record's bytes after its two parts: the image's scale exponent
RUNGS = (44, 46)
# The rung FusedLeNet and `prepare` run where both take a layer, per precision (rung: 0).
DEFAULT_RUNG = {"fp16": 46, "3xfp16": 46}


@dataclass(frozen=True)
class WgmmaPlan:
    defines: dict[str, int]
    smem: int
    threads: int
    bps: int  # blocks an SM (0: as many as fit)
    rung: int = 44

    @property
    def kernel(self) -> tuple[str, str]:
        return (WS_KERNEL_FILE, WS_KERNEL) if self.rung == 46 else (KERNEL_FILE, KERNEL)


def chunk_counts(shape: ConvShape, precision: str, tails: bool) -> tuple[int, int]:
    """(k-chunks a filter row's shift loop runs FW_JM, packed tail chunks FW_TCH): with tails,
    each row's run is its whole chunks plus a tail, and the K tails share chunks of their own;
    without, each run is padded to whole chunks (rung 28's J) and there are no tail chunks."""
    cs, ch, chunks = fused_wide.run_layout(shape.C, shape.K, precision)
    if not tails:
        return chunks, 0
    whole = shape.K * cs // ch
    return whole, ceil_div(shape.K * (shape.K * cs - whole * ch), ch)


def default_tails(shape: ConvShape, precision: str) -> bool:
    """Pack the tails where that saves at least a tenth of the chunk MMAs (eecs498's conv2:
    37 instead of 42 a tile; mxnet's 19 instead of 20 would cost more A loads than it saves)."""
    cs, ch, chunks = fused_wide.run_layout(shape.C, shape.K, precision)
    whole, tail = shape.K * cs // ch, shape.K * cs % ch
    if whole == 0 or tail == 0:
        return False
    main, packed = chunk_counts(shape, precision, True)
    return main * shape.K + packed <= 0.9 * chunks * shape.K


def weight_bytes(shape: ConvShape, precision: str, tails: bool = False) -> int:
    """The packed weights: parts x (chunk, filter row) blocks (and packed tail chunks) of NT x 2
    core matrices."""
    main, packed = chunk_counts(shape, precision, tails)
    return (fused_wide.parts(precision) * (main * shape.K + packed) * ceil_div(shape.M, 8)
            * CORE_PAIR)


def smem_bytes(shape: ConvShape, precision: str, pitch: int, in_dtype: Any = "float32",
               tails: bool = False) -> int:
    """FW44_SMEM_BYTES: the alignment slack, the weights, the staged image(s)."""
    geo = fused_wide.geometry(shape, POOL, precision, 1, in_dtype, pitch)
    return ALIGN + weight_bytes(shape, precision, tails) + geo.image_bytes


def ws_smem_bytes(shape: ConvShape, precision: str, pitch: int, in_dtype: Any = "float32",
                  tails: bool = False) -> int:
    """FWS_SMEM_BYTES (rung 46): the alignment slack, the weights, two staged images (without
    rung 44's reduction slots), the raw image's 16-byte granules plus one, the tail."""
    geo = fused_wide.geometry(shape, POOL, precision, 1, in_dtype, pitch)
    slot = geo.image_bytes - (fused_wide.REDUCE_BYTES if precision == "3xfp16" else 0)
    raw = ceil_div(geo.raw_bytes, 16) * 16 + 16
    return ALIGN + weight_bytes(shape, precision, tails) + 2 * slot + raw + WS_TAIL_BYTES


def staged_record(defines: Mapping[str, int]) -> dict[str, int]:
    """The staged-record layout of a 3xfp16 plan (its defines), as rung 45 writes it (FR_STG_*
    defines): the staged row pitch and channels, one part's fp16 elements (FW_IMG1) and the
    record's bytes (both parts, then RECORD_TAIL bytes holding the scale exponent)."""
    shape = ConvShape(1, defines["FW_C"], defines["FW_H"], defines["FW_W"], defines["FW_M"],
                      defines["FW_K"])
    geo = fused_wide.geometry(shape, POOL, "3xfp16", 1, "float32", defines["FW_WS"])
    part = (geo.image_bytes - fused_wide.REDUCE_BYTES) // 2
    return {"FR_STG_WS": defines["FW_WS"], "FR_STG_CS": geo.cs, "FR_STG_IMG1": part // 2,
            "FR_STG_REC": 2 * part + RECORD_TAIL}


def default_pitch(shape: ConvShape, precision: str, in_dtype: Any = "float32") -> int:
    """The staged row pitch with the fewest A-load bank conflicts (fused_wide.load_cost) among
    those that leave room for BLOCKS_PER_SM blocks an SM (eecs498's conv2 in 3xfp16: the
    conflict-free pitch 35 needs 118 KB, one block an SM; 29 takes 1.56 wavefronts a load)."""
    tails = default_tails(shape, precision)
    fits = [p for p in range(shape.W, shape.W + fused_wide.MAX_PITCH_PAD + 1)
            if BLOCKS_PER_SM * (smem_bytes(shape, precision, p, in_dtype, tails) + 1024)
            <= SM_SMEM_BYTES] or [shape.W]
    return min(fits, key=lambda p: (fused_wide.load_cost(shape, POOL, precision, 1, p), p))


def why_not(shape: ConvShape, pool: int, precision: str) -> str | None:
    """None where fcp_wgmma takes the layer, else the reason it does not."""
    if precision not in PRECISIONS:
        return f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}"
    if pool != POOL:
        return f"pool must be {POOL}, got {pool}"
    if wgmma_ruled_out():
        return "this GPU cannot run sm_90a code (wgmma)"
    reason = fused_wide.why_not(shape, pool, precision)
    if reason is not None:
        return reason
    if shape.M > MAX_M:
        return f"M <= {MAX_M} (got M={shape.M})"
    smem = smem_bytes(shape, precision, shape.W)
    if smem > SMEM_LIMIT:
        return f"the image and weights need {smem} bytes of shared memory (> {SMEM_LIMIT})"
    return None


def supports(shape: ConvShape, pool: int, precision: str) -> bool:
    return why_not(shape, pool, precision) is None


def ws_why_not(shape: ConvShape, pool: int, precision: str) -> str | None:
    """None where rung 46 takes the layer (rung 44 does, and its shared memory fits at rung
    44's widest default pitch with fp32 input), else the reason it does not."""
    reason = why_not(shape, pool, precision)
    if reason is not None:
        return reason
    pitch = shape.W + fused_wide.MAX_PITCH_PAD
    smem = ws_smem_bytes(shape, precision, pitch, "float32", default_tails(shape, precision))
    if smem > SMEM_LIMIT:
        return (f"two staged images, the raw image and the weights need {smem} bytes of shared "
                f"memory (> {SMEM_LIMIT})")
    return None


def ws_supports(shape: ConvShape, pool: int, precision: str) -> bool:
    return ws_why_not(shape, pool, precision) is None


def default_rung(shape: ConvShape, precision: str) -> int:
    """The rung `prepare` runs without a `rung` parameter: DEFAULT_RUNG where it takes the
    layer, else 44."""
    want = DEFAULT_RUNG.get(precision, 44)
    return 46 if want == 46 and ws_supports(shape, POOL, precision) else 44


def _check_params(params: Mapping[str, Any], space: Mapping[str, list[int]] = SPACE) -> None:
    unknown = sorted(set(params) - set(space))
    if unknown:
        raise InputError(f"fcp_wgmma: unknown parameter(s) {unknown} (known: {list(space)})")
    for key, value in params.items():
        if not isinstance(value, int | np.integer) or (value < 0 and key != "tails"):
            raise InputError(f"fcp_wgmma: {key} must be an int >= 0, got {value!r}")
    for key in ("wgs", "ring", "sum", "lead", "consumers"):
        values = space.get(key, SPACE.get(key))
        if params.get(key) and values is not None and params[key] not in values:
            raise InputError(f"fcp_wgmma: {key} must be one of {values}, got {params[key]}")


def wgmma_plan(shape: ConvShape, precision: str, params: Mapping[str, Any] | None = None,
               in_dtype: Any = "float32") -> WgmmaPlan:
    """Defines and launch geometry; params (SPACE) may fix wgs, minb, bps, pitch (0: chosen
    here)."""
    reason = why_not(shape, POOL, precision)
    if reason is not None:
        raise InputError(f"fcp_wgmma does not take {shape} with pool {POOL}: {reason}")
    params = params or {}
    _check_params(params)
    in_name = np.dtype(in_dtype).name
    if in_name not in fused_wide.IN_DTYPES:
        raise InputError(f"fcp_wgmma: input dtype must be one of {fused_wide.IN_DTYPES}, "
                         f"got {in_name}")
    defines = _plan_defines(shape, precision, params, in_name)
    _check_ring(defines)
    smem = smem_bytes(shape, precision, defines["FW_WS"], in_name, bool(defines["FW_TAILS"]))
    return WgmmaPlan(defines, smem, 128 * defines["FW_WGS"], int(params.get("bps") or 0))


def ws_plan(shape: ConvShape, precision: str, params: Mapping[str, Any] | None = None,
            in_dtype: Any = "float32") -> WgmmaPlan:
    """Rung 46's defines and launch geometry: rung 44's loop defines (WS_SPACE may fix pitch,
    ring, lead, sum, tails) with `consumers` computing warpgroups (WS_CONSUMERS, fed staged
    records WS_STAGED_CONSUMERS), one block an SM."""
    reason = ws_why_not(shape, POOL, precision)
    if reason is not None:
        raise InputError(f"fcp_wgmma_ws does not take {shape} with pool {POOL}: {reason}")
    params = params or {}
    _check_params(params, WS_SPACE)
    staged = isinstance(in_dtype, str) and in_dtype == STAGED
    if staged and precision != "3xfp16":
        raise InputError(f"fcp_wgmma_ws: staged records are 3xfp16's, not {precision}'s")
    in_name = "float32" if staged else np.dtype(in_dtype).name
    if in_name not in fused_wide.IN_DTYPES:
        raise InputError(f"fcp_wgmma_ws: input dtype must be one of {fused_wide.IN_DTYPES} or "
                         f"{STAGED!r}, got {in_name}")
    consumers = int(params.get("consumers") or (WS_STAGED_CONSUMERS if staged else WS_CONSUMERS))
    if consumers == 3:  # what fits 152 registers a thread (WS_SPACE), unless params say
        params = {**WS_THREE_CONSUMERS, **params}
    defines = _plan_defines(shape, precision, {k: v for k, v in params.items()
                                               if k != "consumers"}, in_name)
    del defines["FW_MINB"]
    defines["FW_WGS"] = consumers
    _check_ring(defines)
    smem = ws_smem_bytes(shape, precision, defines["FW_WS"], in_name,
                         bool(defines["FW_TAILS"]))
    if staged:
        defines["FWS_STAGED_IN"] = 1
        smem = (ALIGN + weight_bytes(shape, precision, bool(defines["FW_TAILS"]))
                + 2 * staged_record(defines)["FR_STG_REC"] + 16)
    return WgmmaPlan(defines, smem, 128 * (consumers + 1), 1, rung=46)


def _check_ring(defines: Mapping[str, int]) -> None:
    if defines["FW_RING"] < defines["FW_LEAD"] + 2:
        raise InputError(f"fcp_wgmma: ring ({defines['FW_RING']}) must be at least lead "
                         f"({defines['FW_LEAD']}) + 2: a slot is loaded only after the group "
                         "that read it has retired")


def wgmma_blocks(w: np.ndarray, precision: str, tails: bool = False) -> np.ndarray:
    """Weights (M, C, K, K) as the kernel's B operand: uint16 (blocks, parts, NT, 2, 8, 8), the
    fp16 bits of w (3xfp16: lo then hi of w * 2^weight_exponent(w)).

    Block (j, p) (k-chunk j of filter row p's (q, c) run, 16 deep, rung 28's run order) is
    block j K + K - 1 - p: the filter rows fall, so that fp16's blocks p = s and s - 1 are one
    B operand of 16 NT rows, and 3xfp16's lo and hi parts of a block one of [lo | hi]. A part
    is NT x 2 core matrices of 8 channels x 8 k (128 bytes each, the second 8 k 128 bytes after
    the first, the next 8 channels 256 bytes on). With tails, the runs' whole chunks come first
    and packed tail chunk c follows as block JM K + c: its element e is element e % T of row
    e // T's tail (T = the tail's length; zero past the last row)."""
    M, C, K, _ = w.shape
    shape = ConvShape(1, C, K, K, M, K)
    cs, ch, chunks = fused_wide.run_layout(C, K, precision)
    main, packed = chunk_counts(shape, precision, tails)
    nt = ceil_div(M, 8)
    taps = np.zeros((nt * 8, K, K, cs), np.float32)  # (m, p, q, c)
    taps[:M, :, :, :C] = np.asarray(w, np.float32).transpose(0, 2, 3, 1)
    run = np.zeros((nt * 8, K, chunks * ch), np.float32)
    run[:, :, :K * cs] = taps.reshape(nt * 8, K, K * cs)
    # (n, p, j, k) -> (j, p falling, n, k)
    blocks = run[:, :, :main * ch].reshape(nt * 8, K, main, ch).transpose(2, 1, 0, 3)[:, ::-1]
    blocks = blocks.reshape(main * K, nt * 8, ch)
    if packed:
        tail = K * cs - main * ch
        flat = np.zeros((nt * 8, packed * ch), np.float32)
        flat[:, :K * tail] = run[:, :, main * ch:K * cs].reshape(nt * 8, K * tail)
        blocks = np.concatenate([blocks, flat.reshape(nt * 8, packed, ch).transpose(1, 0, 2)])
    # (block, n, k) -> (block, nt, half, row, e)
    blocks = blocks.reshape(-1, nt, 8, 2, 8).transpose(0, 1, 3, 2, 4)
    blocks = np.ascontiguousarray(blocks)
    if precision == "fp16":
        return blocks.astype(np.float16).view(np.uint16)[:, None]
    scaled = blocks * np.float32(2.0 ** fused_wide.weight_exponent(w))  # exact
    hi = scaled.astype(np.float16)
    lo = (scaled - hi.astype(np.float32)).astype(np.float16)  # the difference is exact
    return np.stack([lo.view(np.uint16), hi.view(np.uint16)], axis=1)


def prepare(shape: ConvShape, weight: Any, bias: Any, kernel_params: Mapping[str, Any],
            precision: str, in_dtype: Any = "float32") -> Run:
    """run(x, out): x (B, C, H, W) NCHW in `in_dtype` (float32 or float16), out
    (B, M, Ho // 2, Wo // 2) float32, written with maxpool(relu(conv(x, weight) + bias)).
    kernel_params may name the rung (44 or 46) beside that rung's parameters (SPACE,
    WS_SPACE); without it, parameters only rung 44 has (wgs, minb, bps) pick rung 44, else
    `default_rung` decides."""
    from convolab.backend import require_cupy, to_numpy
    from convolab.gpu.compile import get_kernel
    from convolab.gpu.device import occupancy, sm_count

    params = dict(kernel_params)
    for key in PAIR_KEYS:  # FusedLeNet's choices of the handoff from conv1, not a kernel's
        params.pop(key, None)
    rung = _chosen_rung(shape, precision, params)
    params.pop("rung", None)
    if rung not in RUNGS:
        raise InputError(f"fcp_wgmma: rung must be one of {RUNGS} (or 0), got {rung!r}")
    plan = (ws_plan if rung == 46 else wgmma_plan)(shape, precision, params, in_dtype)
    w_h = np.asarray(to_numpy(weight), np.float32)
    if w_h.shape != shape.w_shape:
        raise InputError(f"fcp_wgmma: weights have shape {w_h.shape}, {shape} needs "
                         f"{shape.w_shape}")
    cp = require_cupy()
    packed = cp.asarray(wgmma_blocks(w_h, precision, bool(plan.defines["FW_TAILS"])))
    b_d = cp.ascontiguousarray(cp.asarray(bias, dtype=cp.float32))
    if b_d.shape != (shape.M,):
        raise InputError(f"fcp_wgmma: bias has shape {b_d.shape}, needs ({shape.M},)")
    kernel = get_kernel(*plan.kernel, plan.defines)
    kernel.max_dynamic_shared_size_bytes = plan.smem
    kernel.preferred_shared_memory_carveout = 100  # rung 28's reason (gpu/fused_wide.py)
    per_sm = plan.bps or max(1, occupancy(kernel, plan.threads, plan.smem))
    grid = (max(1, min(shape.B, sm_count() * per_sm)),)
    batch = np.int32(shape.B)
    w_unscale = np.float32(2.0 ** -fused_wide.weight_exponent(w_h)
                           if precision == "3xfp16" else 1.0)

    staged = plan.defines.get("FWS_STAGED_IN") == 1
    layout = staged_record(plan.defines) if staged else {}
    record = layout.get("FR_STG_REC", 0) // 2  # uint16 elements of one image's record

    def run(x: Any, y: Any) -> None:
        if staged and (x.dtype != np.uint16 or x.size < shape.B * record):
            raise InputError(f"fcp_wgmma_ws: staged input must be uint16 records of "
                             f"{record} elements for {shape.B} images")
        if shape.B:
            kernel(grid, (plan.threads,), (x, packed, b_d, y, batch, w_unscale),
                   shared_mem=plan.smem)

    run.grid = grid  # type: ignore[attr-defined]  # for tests and benchmarks
    # FusedLeNet reads these: what the run reads, and a staged record's layout (rung 45's)
    run.in_dtype = STAGED if staged else np.dtype(in_dtype).name  # type: ignore[attr-defined]
    run.staged = layout  # type: ignore[attr-defined]
    return run


# ---- the fused network's choice ------------------------------------------------------------

# FusedLeNet runs a wide block on rung 44 instead of rung 28 where this is on and rung 44 takes
# the block in the precision rung 28 would run (fp16, exact mode's 3xfp16): on the H100
# eecs498's conv2 took 0.40 / 0.79 ms on rung 44 against 0.48 / 1.31 on rung 28 (fp16 /
# 3xfp16), mxnet's 0.48 / 0.87 against 0.47 / 1.17, and the whole forward is faster in both
# modes for both models (docs/raw.md "Rung 44").
NETWORK = True


def network_takes(shape: ConvShape, pool: int, precision: str,
                  kernel_params: Mapping[str, Any]) -> bool:
    """Whether FusedLeNet runs this block on rung 44 or 46 (`prepare` picks which; kernel
    parameters other than theirs name rung 28's, which then keeps the block)."""
    return (NETWORK and precision in PRECISIONS
            and set(kernel_params) <= {*SPACE, *WS_SPACE, "rung", *PAIR_KEYS}
            and supports(shape, pool, precision))


def staged_takes(shape: ConvShape, pool: int, precision: str,
                 kernel_params: Mapping[str, Any]) -> bool:
    """Whether FusedLeNet feeds this block staged records from the block before (rung 45
    writing rung 46's staged form, exact mode's 3xfp16): where rung 46 runs it (`prepare`'s
    choice) and `staged` is not -1."""
    params = {k: v for k, v in kernel_params.items() if k not in PAIR_KEYS}
    if precision != "3xfp16" or int(kernel_params.get("staged") or 0) < 0 \
            or not network_takes(shape, pool, precision, params):
        return False
    return _chosen_rung(shape, precision, params) == 46


def _chosen_rung(shape: ConvShape, precision: str, params: Mapping[str, Any]) -> int:
    """The rung `prepare` runs: params' `rung` where given (nonzero), else 44 where params name
    a parameter only rung 44 has (wgs, minb, bps), else `default_rung`."""
    rung = params.get("rung") or 0
    if rung:
        return rung
    own = set(params) - {"rung"}
    return (default_rung(shape, precision)
            if precision in PRECISIONS and own <= set(WS_SPACE) else 44)


# ---- registry -------------------------------------------------------------------------------


def compile_variants(precision: str, rung: int = 44) -> list[dict[str, int]]:
    """The define sets the host compiles for a rung: each zoo wide layer's default plan, fp32
    input (the registry entry) and fp16 input (the network's fp16 mode); the emulator tests
    build the other parameters' paths."""
    out: list[dict[str, int]] = []
    for shape, pool in fused_wide.zoo_wide_layers():
        if pool != POOL or fused_wide.why_not(shape, pool, precision) is not None \
                or shape.M > MAX_M:
            continue
        for in_dtype in fused_wide.IN_DTYPES:
            if rung == 46:
                if not ws_supports(shape, pool, precision):
                    continue
                defines = ws_plan(shape, precision, {}, in_dtype).defines
                if precision == "3xfp16" and in_dtype == "float32":  # and fed records
                    staged = ws_plan(shape, precision, {}, STAGED).defines
                    if staged not in out:
                        out.append(staged)
            else:
                defines = _plan_defines(shape, precision, {}, in_dtype)
            if defines not in out:
                out.append(defines)
    return out


def _tails(shape: ConvShape, precision: str, params: Mapping[str, Any]) -> bool:
    asked = int(params.get("tails") or 0)
    if asked > 0:
        main, _ = chunk_counts(shape, precision, True)
        cs, ch, _ = fused_wide.run_layout(shape.C, shape.K, precision)
        if main == 0 or shape.K * cs % ch == 0:
            raise InputError(f"fcp_wgmma: tails=1 needs a filter row of at least one whole "
                             f"k-chunk and a tail ({shape.K * cs} elements, chunks of {ch})")
        return True
    return asked == 0 and default_tails(shape, precision)


def _plan_defines(shape: ConvShape, precision: str, params: Mapping[str, Any],
                  in_dtype: str) -> dict[str, int]:
    """The kernel's defines (no device check: CI's compile list has no GPU). minb by default:
    the blocks shared memory lets an SM hold, at most BLOCKS_PER_SM (3xfp16's loop takes
    ~200 registers)."""
    pitch = max(shape.W, int(params.get("pitch") or default_pitch(shape, precision, in_dtype)))
    tails = _tails(shape, precision, params)
    smem = smem_bytes(shape, precision, pitch, in_dtype, tails)
    wgs = int(params.get("wgs") or DEFAULT_WGS[precision])
    return {
        "FW_PREC": PRECISIONS[precision], "FW_IN_HALF": int(in_dtype == "float16"),
        "FW_C": shape.C, "FW_H": shape.H, "FW_W": shape.W, "FW_WS": pitch,
        "FW_M": shape.M, "FW_K": shape.K, "FW_WGS": wgs,
        "FW_RING": int(params.get("ring") or DEFAULT_RING[precision]),
        "FW_LEAD": int(params.get("lead") or DEFAULT_LEAD),
        "FW_SUM": int(params.get("sum") or DEFAULT_SUM),
        "FW_TAILS": int(tails),
        "FW_MINB": int(params.get("minb") or max(1, min(BLOCKS_PER_SM,
                                                         SM_SMEM_BYTES // (smem + 1024) // wgs))),
    }


@functools.cache
def wgmma_impl(precision: str, rung: int = 44) -> ConvImpl:
    """The registry entry of rung 44 or 46 for one precision (fp32 input)."""
    if precision not in PRECISIONS:
        raise ValueError(f"fcp_wgmma takes precision in {tuple(PRECISIONS)}, got {precision!r}")
    if rung not in RUNGS:
        raise ValueError(f"fcp_wgmma: rung must be one of {RUNGS}, got {rung!r}")
    what = {"fp16": "fp16 operands",
            "3xfp16": "3xfp16: operands scaled by powers of two and split hi + lo, fp32-exact"}

    def prepare_fp32(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        return prepare(shape, w, b, {**params, "rung": rung}, precision, "float32")

    if rung == 46:
        name = f"fused-conv-pool2-wgmma-ws-{_SUFFIX[precision]}"
        demonstrates = ("rung 44 warp-specialized: a producer warpgroup brings the next image "
                        "by the bulk copy engine and stages it into one of two slots while two "
                        "consumer warpgroups run rung 44's wgmma loop on the other; named "
                        f"barriers hand the slots over, setmaxnreg moves registers to the "
                        f"consumers ({what[precision]})")
        space, file = WS_SPACE, WS_KERNEL_FILE
        takes = ws_supports
    else:
        name = f"fused-conv-pool2-wgmma-{_SUFFIX[precision]}"
        demonstrates = ("rung 28 on Hopper's warpgroup MMA: a warpgroup's 64 rows are four "
                        "units' windows, A from registers, the weights as B by descriptor from "
                        "core-matrix blocks that one N = 48 wgmma reads two of, A loaded two "
                        f"shifts ahead, run tails packed ({what[precision]})")
        space, file = SPACE, KERNEL_FILE
        takes = supports
    return ConvImpl(
        name=name,
        demonstrates=demonstrates,
        device="gpu",
        prepare=prepare_fp32,
        supports=lambda s: takes(s, POOL, precision),
        space=space,
        defaults={key: 0 for key in space},
        tolerance=TOLERANCE[precision],
        rung=rung,
        kernel_file=file,
        compile_variants=lambda: compile_variants(precision, rung),
        pool=POOL,
    )


for _rung in RUNGS:
    for _precision in PRECISIONS:
        register(wgmma_impl(_precision, _rung))
