"""`convolab bench --network`: a zoo model's whole forward at one batch, as rows.

* fused variants: FusedLeNet(params, mode, kernel_params, model) for each `--variant`, from
  float images (`--input float`: on the device, rows replaying its CUDA graph, the default,
  through `net(x)` and into one output buffer, and a row launching every kernel from the
  host; then host->host, pinned floats in, labels out), or from raw uint8 bytes
  (`--input raw`): device->device, host->host (pinned bytes in, labels out, chunks
  overlapping copies and kernels) and streaming 60,000 images host->host;
* per-layer rows: a conv rung per layer (unfused) + CuPy ReLU/pool/linears/softmax, the
  ladder's answer before fusion;
* PyTorch rows (when installed), the same jobs: eager fp32 and tf32, torch.compile fp32, fp16
  channels-last eager and replayed from a CUDA graph, device->device and host->host.

Each row: median and spread (ms), images/s, back-to-back time per forward (host launch latency
hidden behind the previous batch), agreement with the fp64 forward on the first images, and
speed-up over torch eager fp32. Nothing here imports CuPy or torch at module import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from convolab.bench.specs import VariantSpec
from convolab.models import conv_blocks
from convolab.timing import Stats

MODEL = "ece408"
# The fp64 forward is the yardstick: on this many images (all of B would take minutes on the CPU).
REFERENCE_IMAGES = 256
# Rungs tried, in order, for the unfused per-layer row; the first registered one is used.
PER_LAYER_PLAIN = ("register-tiled", "fused-gemm", "tiled", "basic")
PER_LAYER_FUSED = {2: "fused-conv-pool2", 4: "fused-conv-pool4"}
DEFAULT_VARIANTS = (VariantSpec("exact"), VariantSpec("tf32"), VariantSpec("fp16"))
BACK_TO_BACK = 10  # forwards between one pair of events for the back-to-back time
# The row of a variant whose every forward launches its kernels from the host (no CUDA graph).
LAUNCHES = " (kernel launches)"
# ... and one writing into the same output buffer each time (FusedLeNet.forward_into): no
# allocation or checks of a fresh output before the graph's launch.
STATIC_OUTPUT = " (into one output buffer)"


def _error_row(name: str, err: Exception) -> dict[str, Any]:
    return {"name": name, "error": f"{type(err).__name__}: {err}"[:500]}


def stats_row(name: str, samples: list[float], batch: int, **extra: Any) -> dict[str, Any]:
    st = Stats.of(samples)
    row = {"name": name, **st.as_dict(), "batch": batch,
           "images_per_s": batch / (st.median_ms / 1e3) if st.median_ms else None}
    row.update(extra)
    return row


def agreement(probs: Any, ref: np.ndarray) -> dict[str, float]:
    """Argmax agreement and largest probability difference against the fp64 forward."""
    p = np.asarray(probs.get() if hasattr(probs, "get") else probs, np.float64)[: len(ref)]
    return {"argmax_agree_vs_fp64": float((p.argmax(1) == ref.argmax(1)).mean()),
            "max_abs_prob_diff_vs_fp64": float(np.abs(p - ref).max())}


def _cupy_timed(name: str, fn: Callable[[], Any], batch: int, reps: int, ref: np.ndarray
                ) -> dict[str, Any]:
    from convolab.timing import time_gpu

    def many() -> None:
        for _ in range(BACK_TO_BACK):
            fn()

    try:
        out = fn()
        samples = time_gpu(fn, reps=reps, warmup=3)
        b2b = Stats.of(time_gpu(many, reps=max(3, reps // 4), warmup=1)).median_ms / BACK_TO_BACK
        return stats_row(name, samples, batch, **agreement(out, ref), back_to_back_ms=b2b)
    except Exception as err:  # one failing variant must not sink the others
        return _error_row(name, err)


def variant_rows(variants: Sequence[VariantSpec], params: Mapping[str, np.ndarray], x: Any,
                 batch: int, reps: int, ref: np.ndarray, model: str = MODEL,
                 host: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Float input: each variant's device->device rows on x (graph, into one output buffer,
    kernel launches) and, where `host` (the same images in host memory) is given, its
    host->host row: pinned floats in, labels out (forward_chunks)."""
    import cupy as cp

    from convolab.gpu.network import FusedLeNet, pinned_empty

    pinned: np.ndarray | None = None
    pin_error: Exception | None = None
    if host is not None:
        try:  # floats take 38x the bytes of raw images: a large batch may not pin
            pinned = pinned_empty(host.shape, np.float32)
            pinned[...] = host
        except Exception as err:
            pin_error = err
    rows = []
    for v in variants:
        for graphs in (True, False):
            name = f"convolab {v.label}" + ("" if graphs else LAUNCHES)
            try:
                net = FusedLeNet(params, mode=v.mode, kernel_params=v.kernel_params_dict(),
                                 model=model, graphs=graphs)
            except Exception as err:
                rows.append(_error_row(name, err))
                break
            info = {"mode": v.mode, "kernel_params": v.kernel_params_dict(), "inputs": "float",
                    "io": "device", "graphs": graphs}
            row = _cupy_timed(name, lambda net=net: net(x), batch, reps, ref)
            if graphs:  # into one output buffer, as PyTorch's graph row replays into its own
                probs = cp.empty((batch, net.classes), cp.float32)
                rows.append({**row, **info})
                row = _cupy_timed(name + STATIC_OUTPUT, lambda net=net, probs=probs: (
                    net.forward_into(x, probs), probs)[1], batch, reps, ref)
            rows.append({**row, **info,
                         **({"graph_error": net.graph_error} if net.graph_error else {})})
            if graphs and host is not None:
                label = f"convolab {v.label} float"
                row = (_error_row(host_row_name(label), pin_error) if pin_error is not None
                       else host_rows(label, net, pinned, reps, ref))
                rows.append({**row, **info, "io": "host"})
    return rows


def _pool(cp: Any, y: Any, pool: int) -> Any:
    z = cp.maximum(y, 0)
    hp, wp = z.shape[2] // pool, z.shape[3] // pool
    z = z[:, :, : hp * pool, : wp * pool]
    return z.reshape(z.shape[0], z.shape[1], hp, pool, wp, pool).max(axis=(3, 5))


def per_layer_forward(params: Mapping[str, Any], batch: int, fused: bool, plain: str,
                      cp: Any) -> Callable[[Any], Any]:
    """A conv rung per layer (fused conv+pool, or `plain` then CuPy ReLU/pool) + CuPy head."""
    from convolab.registry import get_impl

    layers = []
    for block in conv_blocks(MODEL, batch):
        impl = get_impl(PER_LAYER_FUSED[block.pool] if fused else plain)
        run = impl.prepare(block.shape, params[f"{block.name}.weight"],
                           params[f"{block.name}.bias"], impl.params_for())
        layers.append((run, cp.empty(impl.out_shape(block.shape), cp.float32),
                       0 if impl.pool else block.pool))

    def forward(x: Any) -> Any:
        a = x
        for run, y, pool in layers:
            run(a, y)
            a = _pool(cp, y, pool) if pool else y
        h = cp.maximum(a.reshape(a.shape[0], -1) @ params["f5.weight"].T + params["f5.bias"], 0)
        z = h @ params["f6.weight"].T + params["f6.bias"]
        z = cp.exp(z - z.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)

    return forward


def per_layer_rows(dparams: Mapping[str, Any], x: Any, batch: int, reps: int, ref: np.ndarray,
                   cp: Any) -> list[dict[str, Any]]:
    from convolab.registry import all_impls

    available = {i.name for i in all_impls("gpu")}
    plain = next((n for n in PER_LAYER_PLAIN if n in available), None)
    pairs = [(True, "/".join(PER_LAYER_FUSED[b.pool] for b in conv_blocks(MODEL, 1)))]
    if plain:
        pairs.append((False, f"{plain}/{plain}"))
    rows = []
    for fused, names in pairs:
        name = f"convolab per-layer {names} + CuPy head"
        try:
            fwd = per_layer_forward(dparams, batch, fused, plain or "", cp)
        except Exception as err:
            rows.append(_error_row(name, err))
            continue
        rows.append(_cupy_timed(name, lambda fwd=fwd: fwd(x), batch, reps, ref))
    return rows


INPUTS = ("float", "raw")
STREAM_IMAGES = 60_000  # the streaming row: the training split's size, host -> host
HOST_IO = "host->host"
DEVICE_IO = "device->device"


def _wall_timed(name: str, fn: Callable[[], Any], batch: int, reps: int,
                ref: np.ndarray | None) -> dict[str, Any]:
    """Host -> host rows: wall clock around a call that returns host results (it synchronises
    before returning), warm-up first; labels (1-D) are checked by argmax only."""
    import time

    try:
        for _ in range(2):
            out = fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        extra = {} if ref is None else (
            agreement(out, ref) if out.ndim == 2 else
            {"argmax_agree_vs_fp64": float((out[:len(ref)] == ref.argmax(1)).mean())})
        return stats_row(name, samples, batch, **extra)
    except Exception as err:  # one failing variant must not sink the others
        return _error_row(name, err)


def _inputs(model: str, batch: int, inputs: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw uint8 images (batch, 28, 28), the float images the network sees): random bytes,
    so nothing needs the dataset; float input is their resize (data.resize_bilinear)."""
    from convolab.data import IMAGE_SIDE, resize_bilinear
    from convolab.models import spec

    rng = np.random.default_rng(seed + 1)
    raw = rng.integers(0, 256, (batch, IMAGE_SIDE, IMAGE_SIDE), dtype=np.uint8)
    floats = resize_bilinear(raw, spec(model).input_size) if inputs == "float" else \
        resize_bilinear(raw[:REFERENCE_IMAGES], spec(model).input_size)
    return raw, floats


def host_row_name(label: str) -> str:
    return f"{label} {HOST_IO} (pinned, labels)"


def host_rows(label: str, net: Any, pinned: np.ndarray, reps: int, ref: np.ndarray
              ) -> dict[str, Any]:
    """The host->host row of one network: the batch in pinned host memory (raw bytes or
    floats) to predicted classes in host memory, through forward_chunks."""
    batch = len(pinned)
    chunk = max(1, batch // 4)  # four chunks: copies overlap the kernels of the others
    return _wall_timed(host_row_name(label),
                       lambda: net.forward_chunks(pinned, chunk=chunk, streams=3, labels=True),
                       batch, reps, ref)


def raw_rows(variants: Sequence[VariantSpec], params: Mapping[str, np.ndarray], model: str,
             raw: np.ndarray, reps: int, ref: np.ndarray, stream: np.ndarray | None,
             stream_ref: np.ndarray | None = None) -> list[dict[str, Any]]:
    """convolab from raw bytes: device->device, host->host (pinned input, labels out), and
    the streaming row (all of `stream`, host->host, labels out)."""
    import cupy as cp

    from convolab.gpu.network import FusedLeNet, pinned_empty

    batch = len(raw)
    pinned = pinned_empty(raw.shape, np.uint8)
    pinned[...] = raw
    raw_d = cp.asarray(raw)
    rows = []
    for v in variants:
        label = f"convolab {v.label}"
        try:
            net = FusedLeNet(params, mode=v.mode, kernel_params=v.kernel_params_dict(),
                             model=model)
        except Exception as err:
            rows.append(_error_row(label, err))
            continue
        info = {"mode": v.mode, "kernel_params": v.kernel_params_dict(), "inputs": "raw"}
        rows.append({**_cupy_timed(f"{label} raw {DEVICE_IO}", lambda net=net: net(raw_d),
                                   batch, reps, ref), **info, "io": "device"})
        rows.append({**host_rows(f"{label} raw", net, pinned, reps, ref), **info, "io": "host"})
        if stream is not None:
            rows.append({**_wall_timed(
                f"{label} raw stream {len(stream):,} {HOST_IO} (labels)",
                lambda net=net: net.forward_chunks(stream, labels=True),
                len(stream), max(3, reps // 4), stream_ref), **info, "io": "host"})
    return rows


def bench_network(batch: int, reps: int, variants: Sequence[VariantSpec] = DEFAULT_VARIANTS,
                  per_layer: bool = True, torch_rows: bool = True, seed: int = 0,
                  model: str = MODEL, inputs: str = "float") -> list[dict[str, Any]]:
    """Whole-forward rows at `batch` on random weights and inputs (see the module docstring)."""
    from convolab.backend import require_cupy
    from convolab.conv_cpu import reference_forward
    from convolab.data import resize_bilinear
    from convolab.models import build, spec

    if batch < 1 or reps < 1:
        raise ValueError("bench --network: batch and reps must be >= 1")
    if inputs not in INPUTS:
        raise ValueError(f"bench --network: input must be one of {INPUTS}, got {inputs!r}")
    cp = require_cupy()
    params = {k: np.asarray(v, np.float32) for k, v in build(model, seed).params().items()}
    raw, floats = _inputs(model, batch, inputs, seed)
    ref = np.asarray(reference_forward(params, floats[:REFERENCE_IMAGES], model=model),
                     np.float64)
    stream = stream_ref = None
    if inputs == "raw":
        stream = np.random.default_rng(seed + 2).integers(0, 256, (STREAM_IMAGES, *raw.shape[1:]),
                                                          dtype=np.uint8)
        stream_ref = np.asarray(reference_forward(params, resize_bilinear(
            stream[:REFERENCE_IMAGES], spec(model).input_size), model=model), np.float64)
        rows = raw_rows(variants, params, model, raw, reps, ref, stream, stream_ref)
    else:
        x = cp.asarray(floats)
        rows = variant_rows(variants, params, x, batch, reps, ref, model, host=floats)
        if per_layer and model == MODEL:
            dparams = {k: cp.asarray(v) for k, v in params.items()}
            rows += per_layer_rows(dparams, x, batch, reps, ref, cp)
    if torch_rows:
        from convolab.bench.torch_network import torch_rows as torch_network_rows

        compiled: dict[Any, Any] = {}  # one torch.compile for both jobs (tens of seconds)
        for io in ("device", "host"):
            rows += torch_network_rows(model, params, raw, reps, ref, inputs=inputs, io=io,
                                       compiled=compiled)
        if stream is not None:  # the same streaming job; torch.compile left out (its compile)
            rows += torch_network_rows(model, params, stream, max(3, reps // 4), stream_ref,
                                       inputs="raw", io="host", compile=False)
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Each row's speed-up over PyTorch on the same job (same input kind, io and batch):
    over eager fp32, and over PyTorch's fastest fp16 row."""
    def job(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r.get("inputs", "float"), r.get("io", "device"), r.get("batch"))

    timed = [r for r in rows if r.get("median_ms")]
    torch_rows = [r for r in timed if str(r.get("name", "")).startswith("torch")]
    for r in timed:
        same = [t for t in torch_rows if job(t) == job(r)]
        eager = next((t for t in same if t.get("variant", "eager fp32") == "eager fp32"
                      and "eager fp32" in t["name"]), None)
        fp16 = [t for t in same if "fp16" in t["name"]]
        if eager:
            r["speedup_vs_torch_eager_fp32"] = eager["median_ms"] / r["median_ms"]
        if fp16:
            r["speedup_vs_torch_best_fp16"] = min(t["median_ms"] for t in fp16) / r["median_ms"]
