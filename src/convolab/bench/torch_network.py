"""PyTorch rows of `bench --network`: any zoo model's forward in torch.nn.functional, generated
from its layer list (conv blocks from `models.conv_blocks`, the head from `models.head_layers`),
on the same weights and images, as eager fp32/tf32, torch.compile fp32, fp16 channels-last
eager and replayed from a CUDA graph. torch is an optional extra: without it, one row says so.

What a row times (CUDA events around the whole job, after warm-up; median of reps):
* inputs "raw": the job starts from the uint8 (N, 28, 28) bytes: /255 and a bilinear resize to
  the model's input size on the GPU (`F.interpolate`, align_corners=False, no antialias: the
  rule of `data.resize_bilinear`), in the row's precision, then the network;
  inputs "float": the job starts from the resized image (`data.resize_bilinear`, computed once
  outside the timing) already in the row's dtype and layout (fp16 channels-last for the fp16
  rows): PyTorch's best case.
* io "device": the input is on the GPU, the probabilities stay there;
  io "host": the input is in pinned host memory, uploaded with non_blocking copies, and the
  labels (argmax, int64) come back into a pinned host buffer: host -> host.
The CUDA-graph row captures the whole job, the copies included; where the capture refuses the
copies, it captures the device part and says so in the row's `note`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convolab.bench.network import BACK_TO_BACK, agreement, stats_row
from convolab.models import conv_blocks, head_layers, spec

INPUTS = ("raw", "float")
IOS = ("device", "host")
EAGER_FP32 = "eager fp32"  # the row the speed-ups are taken against
VARIANTS = (EAGER_FP32, "eager tf32", "torch.compile fp32", "fp16 channels-last",
            "fp16 channels-last + CUDA graph")


def row_name(variant: str, inputs: str, io: str) -> str:
    where = "pinned host -> host" if io == "host" else "device -> device"
    what = "raw uint8" if inputs == "raw" else "float"
    return f"{_torch_name(variant)} ({what}, {where})"


def _torch_name(variant: str) -> str:
    return variant if variant.startswith("torch") else f"torch {variant}"


def _error_row(name: str, err: BaseException, **extra: Any) -> dict[str, Any]:
    return {"name": name, "error": f"{type(err).__name__}: {err}"[:500], **extra}


def torch_forward(torch: Any, model: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """fwd(x, p) -> fp32 probabilities: the model's conv blocks (conv, ReLU, max-pool) then its
    head (Linear [+ReLU] ..., softmax), from its layer list, in x's dtype and layout."""
    import torch.nn.functional as F

    blocks, head = conv_blocks(model, 1), head_layers(model)

    def fwd(x: Any, p: Mapping[str, Any]) -> Any:
        for b in blocks:
            x = F.relu(F.conv2d(x, p[f"{b.name}.weight"], p.get(f"{b.name}.bias"),
                                stride=b.shape.S))
            if b.pool:
                x = F.max_pool2d(x, b.pool)
        x = x.flatten(1)
        for layer in head:
            x = F.linear(x, p[f"{layer.name}.weight"], p.get(f"{layer.name}.bias"))
            if layer.relu:
                x = F.relu(x)
        return torch.softmax(x.float(), dim=1)

    return fwd


def torch_resize(torch: Any, size: int, dtype: Any, channels_last: bool = False
                 ) -> Callable[[Any], Any]:
    """pre(u8) -> (N, 1, size, size) `dtype` images: uint8 (N, H, W) / 255, bilinear resize with
    `data.resize_bilinear`'s rule."""
    import torch.nn.functional as F

    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def pre(u8: Any) -> Any:
        x = u8.unsqueeze(1).to(dtype).div_(255)
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                          antialias=False)
        return x.contiguous(memory_format=fmt)

    return pre


def events_ms(torch: Any, fn: Callable[[], Any], per_sample: int = 1) -> float:
    """Milliseconds per call of fn, `per_sample` calls between one pair of CUDA events."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(per_sample):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / per_sample


def _timed(torch: Any, name: str, job: tuple[Callable[[], Any], Callable[[], Any]], batch: int,
           reps: int, ref: np.ndarray, host_labels: bool, **extra: Any) -> dict[str, Any]:
    """job = (run, probs): run() does the whole job once and returns its output (the labels in
    host memory where host_labels); probs() the last run's probabilities on the device (for the
    agreement with fp64). extra: more fields for the row."""
    run, probs = job
    try:
        with torch.no_grad():
            for _ in range(3):
                out = run()
            torch.cuda.synchronize()
            samples = [events_ms(torch, run) for _ in range(reps)]
            many = [events_ms(torch, run, BACK_TO_BACK) for _ in range(max(3, reps // 4))]
            out = run()
            torch.cuda.synchronize()
            p = probs().float().cpu().numpy()
        agree = agreement(p, ref)
        if host_labels:  # what the job delivers
            labels = out.numpy()[: len(ref)]
            agree["argmax_agree_vs_fp64"] = float((labels == ref.argmax(1)).mean())
        return stats_row(name, samples, batch, **agree, back_to_back_ms=float(np.median(many)),
                         **extra)
    except Exception as err:  # one failing baseline must not sink the others
        return _error_row(name, err, **extra)


def _job(torch: Any, net: Callable[[Any], Any], src: Any, io: str
         ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(run, probs) for net (device input -> probabilities) on src: device -> device, or
    pinned host -> upload -> net -> argmax -> pinned host."""
    state: dict[str, Any] = {}
    if io == "device":
        def run() -> Any:
            state["p"] = net(src)
            return state["p"]
    else:
        out = torch.empty(len(src), dtype=torch.int64, pin_memory=True)

        def run() -> Any:
            state["p"] = net(src.to("cuda", non_blocking=True))
            out.copy_(state["p"].argmax(1), non_blocking=True)
            return out
    return run, lambda: state["p"]


def _graphed(torch: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` captured once into a CUDA graph (after warm-up on a side stream); replay returns
    the captured output tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fn()

    def replay() -> Any:
        graph.replay()
        return out

    return replay


def _graph_job(torch: Any, net: Callable[[Any], Any], src: Any, io: str
               ) -> tuple[tuple[Callable[[], Any], Callable[[], Any]], str | None]:
    """The whole job as one CUDA graph; for io "host", if the capture refuses the copies, the
    device part as a graph between eager copies (and a note saying so)."""
    run, probs = _job(torch, net, src, io)
    try:
        return (_graphed(torch, run), probs), None
    except Exception as err:
        if io != "host":
            raise
        torch.cuda.synchronize()
        note = (f"copies run outside the graph (capturing them failed: "
                f"{type(err).__name__}: {err})")[:300]
    x = src.to("cuda")
    inner, inner_probs = _job(torch, net, x, "device")
    replay = _graphed(torch, inner)
    out = torch.empty(len(src), dtype=torch.int64, pin_memory=True)

    def job() -> Any:
        x.copy_(src, non_blocking=True)
        out.copy_(replay().argmax(1), non_blocking=True)
        return out

    return (job, inner_probs), note


def _set_tf32(torch: Any, on: bool) -> None:
    torch.backends.cudnn.allow_tf32 = on
    torch.backends.cuda.matmul.allow_tf32 = on


def _inputs(torch: Any, model: str, raw_host: np.ndarray, inputs: str, io: str
            ) -> Callable[[Any, bool], tuple[Any, Callable[[Any], Any]]]:
    """source(dtype, channels_last) -> (src, pre): the job's input tensor where the job starts
    (pinned host or device) and the device-side preprocessing in front of the network."""
    size = spec(model).input_size
    if inputs == "float":
        from convolab.data import resize_bilinear

        resized = torch.from_numpy(resize_bilinear(raw_host, size))
    else:
        u8 = torch.from_numpy(np.ascontiguousarray(raw_host))

    def source(dtype: Any, channels_last: bool) -> tuple[Any, Callable[[Any], Any]]:
        if inputs == "float":
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            src = resized.to(dtype).contiguous(memory_format=fmt)
            pre: Callable[[Any], Any] = lambda x: x  # noqa: E731
        else:
            src, pre = u8, torch_resize(torch, size, dtype, channels_last)
        return (src.pin_memory() if io == "host" else src.to("cuda")), pre

    return source


def _check_args(model: str, raw_host: Any, reps: int, inputs: str, io: str) -> None:
    spec(model)
    if inputs not in INPUTS:
        raise ValueError(f"torch rows: inputs must be one of {INPUTS}, got {inputs!r}")
    if io not in IOS:
        raise ValueError(f"torch rows: io must be one of {IOS}, got {io!r}")
    if (not isinstance(raw_host, np.ndarray) or raw_host.dtype != np.uint8
            or raw_host.ndim != 3 or 0 in raw_host.shape):
        raise ValueError("torch rows: raw_host must be a non-empty (N, H, W) uint8 array, got "
                         f"{getattr(raw_host, 'dtype', type(raw_host).__name__)} "
                         f"{getattr(raw_host, 'shape', '')}")
    if not (isinstance(reps, int) and reps >= 1):
        raise ValueError(f"torch rows: reps must be an int >= 1, got {reps!r}")


def torch_rows(model: Any, params: Any, raw_host: Any, reps: int, ref_probs: np.ndarray,
               inputs: str = "raw", io: str = "device", compile: bool = True,
               compiled: dict[Any, Any] | None = None) -> list[dict[str, Any]]:
    """PyTorch's rows for `model` on `params` (Network.params() names, host arrays) and the
    images raw_host (N, H, W) uint8 (see the module docstring for inputs and io); ref_probs:
    the fp64 forward's probabilities of the first images. compile=False leaves out the
    torch.compile row (its compile takes tens of seconds). compiled: a dict the caller passes
    to every call on the same images (device and host io): the compiled forward is kept there
    and reused, so the jobs share one compile.

    Also accepted: torch_rows(params, x, batch, reps, ref), the ece408 float input x already on
    the device (CuPy), device -> device."""
    if not isinstance(model, str):
        return _device_float_rows(model, params, raw_host, reps, ref_probs)
    _check_args(model, raw_host, reps, inputs, io)
    try:
        import torch
    except Exception as err:  # torch is an optional extra
        return [{"name": "torch", "error": f"PyTorch unavailable: {err}"}]
    if not torch.cuda.is_available():
        return [{"name": "torch", "error": "PyTorch has no CUDA device"}]
    try:
        source = _inputs(torch, model, raw_host, inputs, io)
        tp = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)).cuda()
              for k, v in params.items()}
    except Exception as err:
        return [_error_row(row_name(EAGER_FP32, inputs, io), err)]
    return _variant_rows(torch, model, tp, source, len(raw_host), reps,
                         np.asarray(ref_probs, np.float64), inputs, io, compile, compiled)


def _variant_rows(torch: Any, model: str, tp: Mapping[str, Any], source: Callable, batch: int,
                  reps: int, ref: np.ndarray, inputs: str, io: str, compile: bool,
                  compiled: dict[Any, Any] | None = None) -> list[dict[str, Any]]:
    fwd = torch_forward(torch, model)
    cl = torch.channels_last
    tph = {k: (v.half().contiguous(memory_format=cl) if v.ndim == 4 else v.half())
           for k, v in tp.items()}
    meta = {"model": model, "inputs": inputs, "io": io,
            "host_memory": "pinned" if io == "host" else None}
    tf32_before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = True
    rows = []

    def add(variant: str, make: Callable[[], Any], tf32: bool = False) -> None:
        name = row_name(variant, inputs, io)
        try:
            _set_tf32(torch, tf32)
            job, note = make()
            extra = {**meta, "variant": variant, **({"note": note} if note else {})}
            rows.append(_timed(torch, name, job, batch, reps, ref, io == "host", **extra))
        except Exception as err:  # one failing baseline must not sink the others
            rows.append(_error_row(name, err, **meta, variant=variant))

    def plain(params: Mapping[str, Any], half: bool) -> Any:
        src, pre = source(torch.float16 if half else torch.float32, half)

        def net(x: Any) -> Any:
            return fwd(pre(x), params)

        return _job(torch, net, src, io), None

    cache = compiled if compiled is not None else {}

    def compiled_fp32() -> Any:
        src, pre = source(torch.float32, False)
        # The weights are an argument, not captured: a later call's own copies of them pass
        # the compiled forward's guards, so it is not compiled again.
        fn = cache.get((model, inputs))
        if fn is None:
            fn = cache[(model, inputs)] = torch.compile(lambda x, p: fwd(pre(x), p))
        return _job(torch, lambda x: fn(x, tp), src, io), None

    try:
        add(EAGER_FP32, lambda: plain(tp, False))
        add("eager tf32", lambda: plain(tp, False), tf32=True)
        if compile:
            add("torch.compile fp32", compiled_fp32)
        add("fp16 channels-last", lambda: plain(tph, True))

        def graphed() -> Any:
            src, pre = source(torch.float16, True)
            return _graph_job(torch, lambda x: fwd(pre(x), tph), src, io)

        add("fp16 channels-last + CUDA graph", graphed)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32_before
    return rows


def _device_float_rows(params: Mapping[str, np.ndarray], x: Any, batch: int, reps: int,
                       ref: np.ndarray) -> list[dict[str, Any]]:
    """ece408 rows on its float input already on the device: device -> device."""
    try:
        import torch
    except Exception as err:  # torch is an optional extra
        return [{"name": "torch", "error": f"PyTorch unavailable: {err}"}]
    model = "ece408"
    xt = torch.from_dlpack(x)
    tp = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)).cuda()
          for k, v in params.items()}

    def source(dtype: Any, channels_last: bool) -> tuple[Any, Callable[[Any], Any]]:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        return xt.to(dtype).contiguous(memory_format=fmt), lambda v: v

    rows = _variant_rows(torch, model, tp, source, batch, reps, np.asarray(ref, np.float64),
                         "float", "device", True)
    for r in rows:  # this form's names: "torch eager fp32", ... (bench.network's speed-ups)
        r["name"] = _torch_name(r["variant"])
    return rows
