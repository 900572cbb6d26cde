"""Kernel 49 (`gemv-wg-fp16`, `gemv-wg-bf16`): a classifier layer at batch 16-64 on Hopper's
warpgroup MMA, fed by a producer warpgroup (kernels/49_gemv_wgmma_bulk.cu).

Kernel 43 at 32-64 columns reads x's chunk from shared memory once a warp (64 KB a chunk for
32 KB of weights) after converting it through registers between two block barriers; here wgmma
reads both operands from shared memory by descriptor, and a third warpgroup fills the ring: the
block's chunk of weights by the bulk copy engine, x's chunk in fp32 by cp.async, then x
converted within shared memory. Layout of both operands in a stage: each k-tile of 64 values is
a row of 128 bytes in wgmma's 128-byte swizzle (16-byte piece j of row r at j ^ (r mod 8)).
`pack_weights` puts a block's rows in the order that gives warp w of warpgroup g kernel 42's
m-tiles of warp 4g + w, so the kernel ends with kernel 42's `finish`.

`x16=1` takes x already in the operand type, (B, C) fp16 (bf16 as its bit pattern, uint16), as a
library's fp16 GEMM takes it (`to_operand` makes it): the tensor copy engine then brings x's
chunks in the swizzled layout, and there is nothing to convert. It is the caller's input that
decides it, so the tuner does not search it and `auto` (NCHW fp32 in) never runs it. y is fp32
with the bias either way. With x in fp32, `XPASS=1` (a tunable) runs a first launch that
converts x into such an operand once a call, then the same tensor-copy loop: one pass over x
instead of each row tile converting its chunks. In either x16 loop `CLUSTER=2` makes two row
tiles of a k slice one thread-block cluster that take turns copying x's chunk into both by the
tensor copy engine's multicast: half of x's reads from L2. Everything above `prepare` is pure
Python, tested on the CPU; CuPy is imported inside `prepare` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import require_cupy, xp_of
from convolab.gpu import device, gemv_mma
from convolab.gpu.compile import get_kernel
from convolab.gpu.implicit_gemm_wgmma import encode_tensor_map, wgmma_ruled_out
from convolab.precision import TOLERANCE
from convolab.registry import ConvImpl, Run, register
from convolab.shapes import ConvShape, ceil_div

KERNEL_FILE = "49_gemv_wgmma_bulk.cu"
# gemv_mma.cuh's TM_MODE values, the 16-bit operand types only
MODES: dict[str, int] = {m: gemv_mma.MODES[m] for m in ("fp16", "bf16")}
ROW_BYTES = 128  # one operand row of a k-tile: the 128-byte swizzle's span
K_TILE = ROW_BYTES // 2  # k values in one row (16-bit operands)
WARPGROUPS = 2  # consumers; a third copies
THREADS = 128 * (WARPGROUPS + 1)
# MT: 64-row wgmmas a warpgroup (a block's rows: 128 MT); KT: k-tiles a chunk; STAGES: chunks
# in the ring; MINB: the launch bound's blocks an SM; SPLIT: k slices (0: chosen,
# `gemv_mma.slice_chunks`); XPASS: x converted by a first launch; CLUSTER: row tiles sharing x's
# copies, x16 or XPASS only (module docstring); INTERLEAVE: the packed weights chunk-major
# (`pack_weights`).
SPACE: dict[str, tuple[int, ...]] = {"MT": (1, 2), "KT": (1, 2),
                                     "STAGES": (2, 3, 4, 5, 6, 7, 8),
                                     "SPLIT": (0, 4, 8, 16, 32, 64), "MINB": (1, 2),
                                     "XPASS": (0, 1), "CLUSTER": (1, 2),
                                     "INTERLEAVE": (0, 1)}
# Not searched: x16 (x in the operand type, module docstring); TIMELINE (each block's SM and
# times recorded, for benchmarks/block_timeline.py).
FIXED: dict[str, int] = {"x16": 0, "TIMELINE": 0}
DEFAULTS: dict[str, int] = {"MT": 1, "KT": 1, "STAGES": 4, "SPLIT": 0, "MINB": 1, "XPASS": 0,
                            "CLUSTER": 1, "INTERLEAVE": 0, **FIXED}
PASS_THREADS, PASS_BLOCKS = 256, 2048  # XPASS's conversion launch: 8 values a thread
# x16: tensor maps kept (128 bytes of device memory each), one per x buffer, the least recently
# used dropped. A caller cycling through more buffers than this pays an encode and a copy every
# call (fc6 B = 16 then runs 92-122 us instead of ~62); the bench rotates up to 256.
X16_MAPS = 256


def supports(shape: ConvShape) -> bool:
    """Kernel 42's layers (a linear layer, B <= 64, C a multiple of 8) on a GPU that runs
    sm_90a code."""
    return gemv_mma.supports(shape) and not wgmma_ruled_out()


def defines(mode: str, B: int, params: Mapping[str, Any]) -> dict[str, int]:
    """The -D set of one configuration; ValueError names what is wrong with it."""
    if mode not in MODES:
        raise ValueError(f"gemv-wg: unknown mode {mode!r}; known: {', '.join(MODES)}")
    keys = ("MT", "KT", "STAGES", "MINB", "INTERLEAVE")
    if any(int(params[k]) not in SPACE[k] for k in keys):
        raise ValueError(f"gemv-wg: MT, KT, STAGES, MINB and INTERLEAVE must be in "
                         f"{', '.join(str(SPACE[k]) for k in keys)}, got "
                         f"{', '.join(str(params[k]) for k in keys)}")
    x16, xpass = int(params.get("x16", 0)), int(params.get("XPASS", 0))
    if x16 not in (0, 1) or xpass not in (0, 1):
        raise ValueError(f"gemv-wg: x16 is 0 (x in fp32) or 1 (x in the operand type) and XPASS "
                         f"0 or 1, got x16={x16}, XPASS={xpass}")
    if x16 and xpass:
        raise ValueError("gemv-wg: XPASS converts an fp32 x; with x16=1 x is already converted")
    cluster = int(params.get("CLUSTER", 1))
    if cluster not in SPACE["CLUSTER"] or (cluster > 1 and not (x16 or xpass)):
        raise ValueError(f"gemv-wg: CLUSTER is 1, or 2 where x comes by the tensor copy engine "
                         f"(x16=1 or XPASS=1), got CLUSTER={cluster}, x16={x16}, XPASS={xpass}")
    return {"TM_MODE": MODES[mode], "TM_NT": gemv_mma.n_tiles(B), "TM_MT": int(params["MT"]),
            "TM_WARPS": 4 * WARPGROUPS, "TM_MINB": int(params["MINB"]),
            "GW_KT": int(params["KT"]), "GW_STAGES": int(params["STAGES"]),
            **({"GW_X16": 1} if x16 or xpass else {}),
            **({"GW_CLUSTER": cluster} if cluster > 1 else {}),
            **({"GW_INTERLEAVE": 1} if int(params.get("INTERLEAVE", 0)) else {}),
            **({"GW_TIMELINE": 1} if int(params.get("TIMELINE", 0)) else {})}


def tile_rows(d: Mapping[str, int]) -> int:
    return WARPGROUPS * 64 * d["TM_MT"]


def a_bytes(d: Mapping[str, int]) -> int:
    """A block's chunk of weights: KT k-tiles of its rows."""
    return d["GW_KT"] * tile_rows(d) * ROW_BYTES


def x_bytes(d: Mapping[str, int]) -> int:
    """x's chunk in a stage: KT k-tiles of 8 TM_NT rows in the operand type, and (unless x16)
    the same rows in fp32 as copied."""
    copied = 0 if d.get("GW_X16") else 4 * K_TILE
    return d["GW_KT"] * 8 * d["TM_NT"] * (ROW_BYTES + copied)


def smem_bytes(d: Mapping[str, int]) -> int:
    """The ring, and 1 KB to align it (the swizzle repeats on 1 KB boundaries)."""
    return d["GW_STAGES"] * (a_bytes(d) + x_bytes(d)) + 1024


@dataclass(frozen=True)
class LaunchPlan:
    defines: dict[str, int]
    tiles: int  # gridDim.x: row tiles of tile_rows
    chunks: int  # chunks of KT k-tiles along k (packed, zero past C)
    slice_chunks: int  # chunks a block
    slices: int  # gridDim.y
    smem: int

    @property
    def grid(self) -> tuple[int, int]:
        return self.tiles, self.slices

    @property
    def parked_floats(self) -> int:
        """The split-k partials (gemv_mma.cuh `finish_parked`): each slice's blocks' consumer
        threads' sums as held, MT NT float4s a thread; none unsplit."""
        if self.slices == 1:
            return 0
        held = 4 * self.defines["TM_MT"] * self.defines["TM_NT"]
        return self.slices * self.tiles * 128 * WARPGROUPS * held


def launch_plan(shape: ConvShape, mode: str, params: Mapping[str, Any],
                sms: int = gemv_mma.DEFAULT_SMS) -> LaunchPlan:
    """Row tiles and k slices, by kernel 42's model (`gemv_mma.slice_chunks`) on the blocks an
    SM holds: MINB, or fewer where the ring does not fit twice."""
    d = defines(mode, shape.B, params)
    smem = smem_bytes(d)
    if smem > gemv_mma.SMEM_LIMIT:
        raise ValueError(f"gemv-wg: {d['GW_STAGES']} stages of {a_bytes(d) + x_bytes(d)} bytes "
                         f"need {smem} B of shared memory, over {gemv_mma.SMEM_LIMIT}: fewer "
                         f"STAGES, KT or MT")
    resident = max(1, min(d["TM_MINB"], device.resident_blocks(1, THREADS, smem)))
    tiles = ceil_div(shape.M, tile_rows(d))
    cluster = d.get("GW_CLUSTER", 1)
    if tiles % cluster:
        raise ValueError(f"gemv-wg: CLUSTER={cluster} pairs row tiles, but M = {shape.M} makes "
                         f"{tiles} tiles of {tile_rows(d)} rows")
    chunks = ceil_div(shape.C, K_TILE * d["GW_KT"])
    per_slice = gemv_mma.slice_chunks(chunks, tiles, sms * resident, a_bytes(d), tile_rows(d),
                                      shape.B, int(params["SPLIT"]))
    return LaunchPlan(d, tiles, chunks, per_slice, ceil_div(chunks, per_slice), smem)


# --------------------------------------------------------------------------------------
# The operands (NumPy or CuPy)
# --------------------------------------------------------------------------------------


def swizzle_128b(a: Any) -> Any:
    """(..., rows, 8 pieces, 8 values) with rows a multiple of 8 -> the 128-byte swizzle:
    piece j of row r stored at j ^ (r mod 8)."""
    xp = xp_of(a)
    rows = a.shape[-3]
    r = xp.arange(rows)[:, None]
    return a[..., r, xp.arange(8)[None, :] ^ (r % 8), :]


def pack_weights(w2: Any, mode: str, d: Mapping[str, int]) -> Any:
    """(M, C) fp32 -> kernel 49's weights, uint8: for each row tile and each chunk (each chunk
    and each row tile with GW_INTERLEAVE), one contiguous run of KT k-tiles, each 2 MT wgmma A
    tiles (warpgroup g, its wgmma mi) of 64 rows x 128 bytes, swizzled. Row 16 w + r of tile
    (g, mi) is row 16 ((4 g + w) MT + mi) + r of the row tile: kernel 42's m-tile mi of warp
    4 g + w. Zero past M and C."""
    xp = xp_of(w2)
    if w2.ndim != 2 or w2.shape[1] % gemv_mma.CHANNEL_ALIGN:
        raise ValueError(f"gemv-wg: weights must be (M, C) with C a multiple of "
                         f"{gemv_mma.CHANNEL_ALIGN}, got shape {w2.shape}")
    values = gemv_mma.sixteen_bit(w2, mode)
    M, C = values.shape
    mt, kt = d["TM_MT"], d["GW_KT"]
    rows = tile_rows(d)
    tiles, chunks = ceil_div(M, rows), ceil_div(C, K_TILE * kt)
    padded = xp.zeros((tiles * rows, chunks * kt * K_TILE), dtype=values.dtype)
    padded[:M, :C] = values
    a = padded.reshape(tiles, WARPGROUPS, 4, mt, 16, chunks, kt, 8, 8)
    a = a.transpose(0, 5, 6, 1, 3, 2, 4, 7, 8).reshape(tiles, chunks, kt, WARPGROUPS * mt, 64, 8, 8)
    if d.get("GW_INTERLEAVE"):
        a = a.swapaxes(0, 1)
    return xp.ascontiguousarray(swizzle_128b(a)).view(xp.uint8).reshape(-1)


def x_map_geometry(shape: ConvShape, d: Mapping[str, int]
                   ) -> tuple[tuple[int, int], tuple[int], tuple[int, int]]:
    """(dims, byte strides, box) of x16's operand (B, C) as a 2-D tensor map, innermost first:
    one box is a k-tile of the stage's 8 TM_NT rows (rows past B arrive as zeros)."""
    return (shape.C, shape.B), (2 * shape.C,), (K_TILE, 8 * d["TM_NT"])


def to_operand(x: Any, mode: str) -> Any:
    """x (B, C, 1, 1) or (B, C) fp32 -> the (B, C) operand an x16 run takes: fp16, or bf16 as
    its bit pattern (uint16), rounded to nearest even."""
    return gemv_mma.sixteen_bit(x.reshape(x.shape[0], -1), mode)


# Where `auto` runs kernel 49 without a cache entry (H200, 2026-11-29, docs/vgg.md "Kernel 49"
# and "FP16 at B = 64 on the libraries' terms"; event time of one call / device time of calls
# queued back to back, us): fc6 in FP16 at B = 32 63.5 / 56.8 with 128-row tiles and 6 stages
# (kernel 42 72.9 / 64.2, cuBLAS 72.2 / 54.8; XPASS 67.0 / 60.0); at 64 x converted by a first
# launch (XPASS) into the tensor-copy loop with 8 stages, 71.4 / 66.3 (converting in the ring,
# 256-row tiles and 4 stages: 76.2 / 71.2; cuBLAS 66.0 / 55.7), and in the bench 68.8 / 70.7 us
# at 48 / 64 against 75.2 / 76.4; at 16 59.0 / 54.5 against kernel 42's 57.8 / 50.8, which keeps
# B <= 16. With the parked split-k sum ("fc6's split-k sum"): at 64 XPASS 73.9 / 62.7 (the
# ring form at 32: 66.0 / 59.7; XPASS there 65.7 / 58.6, within the runs' spread of it).
AUTO_MODES = ("fp16",)
AUTO_FROM_BATCH = 17
AUTO_TILES: tuple[tuple[int, dict[str, int]], ...] = ((32, {"STAGES": 6}),
                                                     (64, {"STAGES": 8, "XPASS": 1}))


def auto_choice(shape: ConvShape, mode: str) -> tuple[str, dict[str, int]] | None:
    """The implementation and parameters `auto` runs for this layer in this mode, or None where
    kernel 49 is not its choice: layers of gemv_mma.BIG_LAYER weights (fc6) in AUTO_MODES from
    AUTO_FROM_BATCH, with AUTO_TILES' first entry that holds B."""
    if (mode not in AUTO_MODES or not gemv_mma.supports(shape) or shape.B < AUTO_FROM_BATCH
            or shape.M * shape.C < gemv_mma.BIG_LAYER):
        return None
    params = next(p for up_to, p in AUTO_TILES if up_to >= shape.B)
    return f"gemv-wg-{mode}", dict(params)


# What CI's nvcc check builds: each mode at the fewest and the most batch tiles (TM_NT changes
# the wgmma's N) with the defaults, with x16 and with x16 in clusters, and in fp16 each other
# value of MT, KT and STAGES once.
def compile_variants(mode: str) -> Callable[[], list[dict[str, int]]]:
    def variants() -> list[dict[str, int]]:
        points = [(8, DEFAULTS), (gemv_mma.MAX_BATCH, DEFAULTS),
                  (gemv_mma.MAX_BATCH, {**DEFAULTS, "x16": 1}),
                  (gemv_mma.MAX_BATCH, {**DEFAULTS, "x16": 1, "CLUSTER": 2,
                                        "INTERLEAVE": 1})]
        if mode == "fp16":
            points += [(gemv_mma.MAX_BATCH, {**DEFAULTS, k: v}) for k in ("MT", "KT", "STAGES")
                       for v in SPACE[k] if v != DEFAULTS[k]]
        out: list[dict[str, int]] = []
        for batch, point in points:
            d = defines(mode, batch, point)
            if d not in out:
                out.append(d)
        return out

    return variants


# --------------------------------------------------------------------------------------
# prepare / run (CuPy from here on)
# --------------------------------------------------------------------------------------


def _prepare(mode: str) -> Callable[[ConvShape, Any, Any, Mapping[str, Any]], Run]:
    name = f"gemv-wg-{mode}"

    def prepare(shape: ConvShape, w: Any, b: Any, params: Mapping[str, Any]) -> Run:
        cp = require_cupy()
        from convolab.gpu.device import sm_count
        from convolab.gpu.launch import BoundLaunch

        w2 = gemv_mma.layer_weights(name, shape, w, supports(shape))
        plan = launch_plan(shape, mode, params, sm_count())
        d = plan.defines
        w_op = pack_weights(w2, mode, d)
        kernel = get_kernel(KERNEL_FILE, "gemv_wgmma", d)
        kernel.max_dynamic_shared_size_bytes = plan.smem
        b_d = cp.ascontiguousarray(cp.asarray(b, dtype=cp.float32))
        partial = cp.empty(plan.parked_floats, dtype=cp.float32)
        tickets = cp.zeros(plan.tiles, dtype=cp.int32)
        launch = BoundLaunch(kernel, plan.grid, (THREADS,),
                             (None, w_op, b_d, None, partial, tickets,
                              *(np.int32(v) for v in (shape.B, shape.M, shape.C, plan.chunks,
                                                      plan.slice_chunks))),
                             per_call=(0, 3), shared_mem=plan.smem)
        if "GW_X16" not in d:
            def run(x: Any, y: Any) -> None:
                launch(x, y)

            return run

        want = (shape.B, shape.C)
        x_dtype = np.dtype(np.float16 if mode == "fp16" else np.uint16)
        geometry = x_map_geometry(shape, d)
        if int(params["XPASS"]):
            x_op = cp.empty(want, dtype=x_dtype)  # one buffer, so one map, made here
            x_map = encode_tensor_map("x", x_op, *geometry)
            n8 = shape.B * shape.C // 8
            convert_x = BoundLaunch(get_kernel(KERNEL_FILE, "gw_x_to_operand", d),
                                    (min(ceil_div(n8, PASS_THREADS), PASS_BLOCKS),),
                                    (PASS_THREADS,), (None, x_op, np.int32(n8)), per_call=(0,))

            def run_pass(x: Any, y: Any) -> None:
                convert_x(x)
                launch(x_map, y)

            return run_pass

        maps: dict[int, Any] = {}  # x's address -> its tensor map, most recent last

        def run_x16(x: Any, y: Any) -> None:
            if (tuple(x.shape) != want or x.dtype != x_dtype or not x.flags.c_contiguous
                    or x.data.ptr % 16):
                raise ValueError(f"{name} (x16=1): x must be a C-contiguous, 16-byte aligned "
                                 f"{want} {x_dtype.name} operand (gemv_wgmma.to_operand), got "
                                 f"{tuple(x.shape)} {x.dtype}")
            x_map = maps.pop(x.data.ptr, None)
            if x_map is None:
                x_map = encode_tensor_map("x", x, *geometry)
                if len(maps) >= X16_MAPS:
                    del maps[next(iter(maps))]
            maps[x.data.ptr] = x_map
            launch(x_map, y)

        return run_x16

    return prepare


WHAT = {"fp16": "fp16 weights and x", "bf16": "bf16 weights and x"}

for _mode in MODES:
    register(ConvImpl(
        name=f"gemv-wg-{_mode}", rung=49, device="gpu", kernel_file=KERNEL_FILE,
        demonstrates=f"classifier layer at batch 16-64 on the warpgroup MMA (sm_90a), a producer "
                     f"warpgroup filling a ring on mbarriers: the weights (packed in wgmma's "
                     f"swizzled layout) by the bulk copy engine, x in fp32 by cp.async, converted "
                     f"in shared memory; no block barrier in the loop ({WHAT[_mode]}, fp32 "
                     f"accumulate)",
        prepare=_prepare(_mode), supports=supports, space=SPACE, defaults=DEFAULTS,
        compile_variants=compile_variants(_mode), tolerance=TOLERANCE[_mode]))

__all__ = ["a_bytes", "auto_choice", "defines", "launch_plan", "pack_weights", "smem_bytes",
           "supports", "swizzle_128b", "to_operand", "x_bytes", "x_map_geometry"]
