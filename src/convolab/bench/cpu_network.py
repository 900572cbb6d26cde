"""`convolab bench --network --device cpu`: the whole CPU forward against ONNX Runtime.

Rows, timed alternately in one process so both see the same machine load:

* ``convolab cpu fused``: ``Network.forward`` in eval mode (each conv + ReLU + max-pool block
  one fused kernel, the head BLAS GEMMs), what ``Network.predict`` runs;
* ``onnxruntime cpu``: the same weights exported with ``convolab.onnx_io.export_onnx``, run by
  an ``InferenceSession`` with its default (all cores) threads; a row with a ``skipped`` note
  when onnx/onnxruntime or the exporter is missing.

The images are the first `batch` test images (repeated past 10,000) with the shipped weights
when both are installed, else random images and weights (each row says which).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from convolab.bench.network import REFERENCE_IMAGES, agreement, stats_row

ORT_ROW = "onnxruntime cpu"
CONVOLAB_ROW = "convolab cpu fused"


def _inputs(model: str, batch: int, seed: int) -> tuple[Any, np.ndarray, str]:
    """(network, images, what they are): shipped weights and test images where installed."""
    from convolab import data, models
    from convolab.errors import ConvolabError

    size = models.spec(model).input_size
    try:
        network = models.load(model)
        x, _ = data.load_images("test", n=min(batch, data.SPLIT_SIZES["test"]), size=size)
        reps = -(-batch // len(x))
        x = np.ascontiguousarray(np.concatenate([x] * reps)[:batch]) if reps > 1 else x
        return network, x, "shipped weights, test images"
    except ConvolabError:
        network = models.build(model, seed).eval()
        x = np.random.default_rng(seed + 1).random((batch, 1, size, size), dtype=np.float32)
        return network, x, "random weights and images (shipped weights or dataset missing)"


def ort_session(network: Any, input_size: int) -> tuple[Any, str | None]:
    """(session, None), or (None, why not) when onnx/onnxruntime/the exporter is missing."""
    try:
        import onnxruntime

        from convolab.onnx_io import export_onnx
    except ImportError as err:
        return None, f"skipped: {err} (pip install 'convolab[onnx]')"
    with tempfile.TemporaryDirectory() as tmp:
        path = export_onnx(network, Path(tmp) / "model.onnx", input_size)
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session, None


def _threads() -> int:
    try:
        import numba
    except ImportError:
        return os.cpu_count() or 1
    return int(numba.get_num_threads())


def bench_network_cpu(model: str, batch: int, reps: int, seed: int = 0) -> list[dict[str, Any]]:
    """The two rows of the module docstring, median and spread of `reps` alternating runs."""
    from convolab.conv_cpu import reference_forward
    from convolab.models import spec

    if batch < 1 or reps < 1:
        raise ValueError("bench --network: batch and reps must be >= 1")
    network, x, source = _inputs(model, batch, seed)
    ref = reference_forward(network.params(), x[:REFERENCE_IMAGES], model=model)
    session, why = ort_session(network, spec(model).input_size)
    feed = session.get_inputs()[0].name if session is not None else ""
    runners = {CONVOLAB_ROW: lambda: network.forward(x)}
    if session is not None:
        runners[ORT_ROW] = lambda: session.run(None, {feed: x})[0]
    outputs = {name: fn() for name, fn in runners.items()}  # warm-up (and the kernel load)
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(reps):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    common = {"model": model, "inputs": source, "cpu_count": os.cpu_count()}
    rows = [stats_row(CONVOLAB_ROW, samples[CONVOLAB_ROW], batch, threads=_threads(),
                      **agreement(outputs[CONVOLAB_ROW], ref), **common)]
    if session is None:
        rows.append({"name": ORT_ROW, "note": why, **common})
        return rows
    ort_out = outputs[ORT_ROW]
    rows.append(stats_row(ORT_ROW, samples[ORT_ROW], batch, threads=os.cpu_count(),
                          **agreement(ort_out, ref), **common))
    ours = np.asarray(outputs[CONVOLAB_ROW])
    rows[0]["argmax_agree_vs_onnxruntime"] = float((ours.argmax(1) == ort_out.argmax(1)).mean())
    rows[0]["time_vs_onnxruntime"] = rows[0]["median_ms"] / rows[1]["median_ms"]
    return rows
