"""PyTorch rows of `bench --network`: the same ece408 forward in torch.nn.functional on the same
weights and input, eager fp32/tf32, torch.compile, and fp16 channels-last (eager and a CUDA
graph replay). torch is an optional extra: without it, one row says so."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convolab.bench.network import BACK_TO_BACK, agreement, stats_row
from convolab.models import conv_blocks

MODEL = "ece408"


def _events_ms(torch: Any, fn: Callable[[], Any], per_sample: int = 1) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(per_sample):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / per_sample


def _timed(torch: Any, name: str, fn: Callable[[], Any], batch: int, reps: int,
           ref: np.ndarray) -> dict[str, Any]:
    try:
        with torch.no_grad():
            for _ in range(3):
                out = fn()
            torch.cuda.synchronize()
            samples = [_events_ms(torch, fn) for _ in range(reps)]
            many = [_events_ms(torch, fn, BACK_TO_BACK) for _ in range(max(3, reps // 4))]
        return stats_row(name, samples, batch, **agreement(out.float().cpu().numpy(), ref),
                         back_to_back_ms=float(np.median(many)))
    except Exception as err:  # one failing baseline must not sink the others
        return {"name": name, "error": f"{type(err).__name__}: {err}"[:500]}


def _forward(torch: Any) -> Callable[[Any, dict[str, Any]], Any]:
    import torch.nn.functional as F

    blocks = conv_blocks(MODEL, 1)

    def fwd(x: Any, p: dict[str, Any]) -> Any:
        for b in blocks:
            x = F.max_pool2d(F.relu(F.conv2d(x, p[f"{b.name}.weight"], p[f"{b.name}.bias"],
                                             stride=b.shape.S)), b.pool)
        x = F.relu(F.linear(x.flatten(1), p["f5.weight"], p["f5.bias"]))
        return torch.softmax(F.linear(x, p["f6.weight"], p["f6.bias"]).float(), dim=1)

    return fwd


def _set_tf32(torch: Any, on: bool) -> None:
    torch.backends.cudnn.allow_tf32 = on
    torch.backends.cuda.matmul.allow_tf32 = on


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


def torch_rows(params: Mapping[str, np.ndarray], x: Any, batch: int, reps: int,
               ref: np.ndarray) -> list[dict[str, Any]]:
    try:
        import torch
    except Exception as err:  # torch is an optional extra
        return [{"name": "torch", "error": f"PyTorch unavailable: {err}"}]
    dev = torch.device("cuda")
    tp = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in params.items()}
    xt = torch.from_dlpack(x)
    torch.backends.cudnn.benchmark = True
    fwd = _forward(torch)
    rows = []
    _set_tf32(torch, False)
    rows.append(_timed(torch, "torch eager fp32", lambda: fwd(xt, tp), batch, reps, ref))
    _set_tf32(torch, True)
    rows.append(_timed(torch, "torch eager tf32", lambda: fwd(xt, tp), batch, reps, ref))
    _set_tf32(torch, False)
    try:
        compiled = torch.compile(fwd)
        rows.append(_timed(torch, "torch.compile fp32", lambda: compiled(xt, tp), batch, reps,
                           ref))
    except Exception as err:
        rows.append({"name": "torch.compile fp32", "error": f"{type(err).__name__}: {err}"[:500]})
    cl = torch.channels_last
    tph = {k: (v.half().contiguous(memory_format=cl) if v.ndim == 4 else v.half())
           for k, v in tp.items()}
    xh = xt.half().contiguous(memory_format=cl)
    rows.append(_timed(torch, "torch fp16 channels-last", lambda: fwd(xh, tph), batch, reps, ref))
    try:
        replay = _graphed(torch, lambda: fwd(xh, tph))
        rows.append(_timed(torch, "torch fp16 channels-last + CUDA graph", replay, batch, reps,
                           ref))
    except Exception as err:
        rows.append({"name": "torch fp16 channels-last + CUDA graph",
                     "error": f"{type(err).__name__}: {err}"[:500]})
    return rows
