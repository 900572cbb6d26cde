"""bench/network.py's whole-network rows (`bench --network`): every job of the issue, for
convolab and PyTorch, from raw bytes and from floats, device -> device and host -> host.

Without a GPU: bench_network's rows through stand-ins for CuPy, FusedLeNet and the PyTorch rows
(names, io, what each convolab job is fed, one torch.compile shared by the device and host
jobs). On the GPU (marker `gpu`): a small real run gives every row, none failing.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from convolab.bench import network as bn
from convolab.bench import torch_network as tn
from convolab.bench.specs import VariantSpec


def expected_names(inputs: str, variants: Sequence[VariantSpec], with_torch: bool,
                   stream: int | None = None) -> dict[str, int]:
    """Row name -> how many rows carry it (PyTorch's streaming rows share the host rows'
    names; their batch tells them apart)."""
    names: dict[str, int] = {}

    def add(name: str) -> None:
        names[name] = names.get(name, 0) + 1

    for v in variants:
        label = f"convolab {v.label}"
        if inputs == "float":
            for name in (label, label + bn.STATIC_OUTPUT, bn.host_row_name(f"{label} float"),
                         label + bn.LAUNCHES):
                add(name)
        else:
            add(f"{label} raw {bn.DEVICE_IO}")
            add(bn.host_row_name(f"{label} raw"))
            add(f"{label} raw stream {stream:,} {bn.HOST_IO} (labels)")
    if with_torch:
        for io in tn.IOS:
            for variant in tn.VARIANTS:
                add(tn.row_name(variant, inputs, io))
        if inputs == "raw":  # the streaming job leaves torch.compile out
            for variant in tn.VARIANTS:
                if "compile" not in variant:
                    add(tn.row_name(variant, "raw", "host"))
    return names


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["name"]] = counts.get(r["name"], 0) + 1
    return counts


class _FakeNet:
    """FusedLeNet's surface that bench_network uses; records what each job was fed."""

    fed: list[tuple[str, np.dtype, tuple[int, ...], bool]] = []

    def __init__(self, params: Any, mode: str = "exact", kernel_params: Any = None,
                 model: str = bn.MODEL, graphs: bool = True) -> None:
        self.classes, self.graph_error = 10, None

    def _probs(self, n: int) -> np.ndarray:
        p = np.full((n, self.classes), 0.05, np.float32)
        p[:, 3] = 0.55
        return p

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.fed.append(("call", x.dtype, x.shape, False))
        return self._probs(len(x))

    def forward_into(self, x: np.ndarray, probs: np.ndarray) -> None:
        self.fed.append(("into", x.dtype, x.shape, False))
        probs[...] = self._probs(len(x))

    def forward_chunks(self, x_host: np.ndarray, chunk: int = 1, streams: int = 1,
                       labels: bool = False) -> np.ndarray:
        self.fed.append(("chunks", x_host.dtype, x_host.shape, labels))
        return np.full(len(x_host), 3, np.int64) if labels else self._probs(len(x_host))


@pytest.mark.parametrize("inputs", bn.INPUTS)
def test_rows_of_every_job_without_a_gpu(inputs: str, seed: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from convolab import backend, timing
    from convolab.gpu import network as gpu_network

    cupy = types.ModuleType("cupy")
    cupy.asarray, cupy.empty, cupy.float32 = np.asarray, np.empty, np.float32
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(backend, "require_cupy", lambda: cupy)
    monkeypatch.setattr(timing, "time_gpu", lambda fn, reps=1, warmup=0: [
        (fn(), 1.0)[1] for _ in range(reps)])
    monkeypatch.setattr(gpu_network, "FusedLeNet", _FakeNet)
    monkeypatch.setattr(gpu_network, "pinned_empty", np.empty)
    monkeypatch.setattr(_FakeNet, "fed", [])
    stream = 24
    monkeypatch.setattr(bn, "STREAM_IMAGES", stream)
    torch_calls: list[dict[str, Any]] = []

    def fake_torch_rows(model: str, params: Any, raw_host: np.ndarray, reps: int,
                        ref: np.ndarray, inputs: str = "raw", io: str = "device",
                        compile: bool = True, compiled: dict | None = None) -> list[dict]:
        torch_calls.append({"n": len(raw_host), "inputs": inputs, "io": io,
                            "compile": compile, "compiled": compiled})
        return [{"name": tn.row_name(v, inputs, io), "variant": v, "median_ms": 2.0,
                 "batch": len(raw_host), "inputs": inputs, "io": io}
                for v in tn.VARIANTS if compile or "compile" not in v]

    monkeypatch.setattr(tn, "torch_rows", fake_torch_rows)
    batch = 8
    rows = bn.bench_network(batch, 3, per_layer=False, seed=seed, inputs=inputs)

    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    assert _counts(rows) == expected_names(inputs, bn.DEFAULT_VARIANTS, True, stream)
    # torch.compile for both jobs of the batch, from one compiled function
    jobs = [c for c in torch_calls if c["n"] == batch]
    assert [(c["io"], c["compile"]) for c in jobs] == [("device", True), ("host", True)]
    assert isinstance(jobs[0]["compiled"], dict) and jobs[0]["compiled"] is jobs[1]["compiled"]
    assert all(not c["compile"] for c in torch_calls if c["n"] != batch)

    host = [r for r in rows if r["name"].startswith("convolab") and bn.HOST_IO in r["name"]]
    assert len(host) == len(bn.DEFAULT_VARIANTS) * (2 if inputs == "raw" else 1)
    for r in host:  # compared with PyTorch on the same job
        assert r["io"] == "host" and r["inputs"] == inputs
        assert r["speedup_vs_torch_eager_fp32"] > 0 and r["argmax_agree_vs_fp64"] >= 0
    chunked = [f for f in _FakeNet.fed if f[0] == "chunks"]
    assert chunked and all(labels for *_, labels in chunked)
    if inputs == "float":  # the floats the device rows get, pinned on the host
        assert {(d, s) for _, d, s, _ in chunked} == {(np.dtype(np.float32), (batch, 1, 86, 86))}
    else:
        assert {(d, s[1:]) for _, d, s, _ in chunked} == {(np.dtype(np.uint8), (28, 28))}


@pytest.mark.gpu
@pytest.mark.parametrize("inputs", bn.INPUTS)
def test_every_row_on_the_gpu(inputs: str, seed: int) -> None:
    """A small run (batch 64, 3 reps): every convolab row and, where PyTorch has CUDA, every
    PyTorch row (torch.compile and the CUDA graph in both io kinds), none failing."""
    try:
        import torch

        with_torch = bool(torch.cuda.is_available())
    except ImportError:  # torch is an optional extra: the convolab rows alone
        with_torch = False
    batch = 64
    rows = bn.bench_network(batch, 3, per_layer=True, torch_rows=with_torch, seed=seed,
                            inputs=inputs)
    failed = [r for r in rows if "error" in r]
    assert not failed, failed
    counts = _counts(rows)
    want = expected_names(inputs, bn.DEFAULT_VARIANTS, with_torch, bn.STREAM_IMAGES)
    assert {n: counts.get(n, 0) for n in want} == want
    if inputs == "float":
        assert any(n.startswith("convolab per-layer") for n in counts), sorted(counts)
    for r in rows:
        assert r["median_ms"] > 0, r
        if r.get("mode") == "exact" or "fp32" in r.get("variant", ""):
            assert r["argmax_agree_vs_fp64"] >= 0.95, r
    if with_torch:
        for io in tn.IOS:
            for variant in ("torch.compile fp32", "fp16 channels-last + CUDA graph"):
                row = next(r for r in rows if r["name"] == tn.row_name(variant, inputs, io)
                           and r["batch"] == batch)
                assert row["io"] == io and row["inputs"] == inputs
