"""FusedLeNet's CUDA graphs: the second forward of a plan whose input and output lie where they
lay before is captured, later ones replay it; a replay gives the bits the kernel-by-kernel
forward gives, whatever the input array holds by then.

The bookkeeping (when to capture, replay, evict, drop, and what happens when a capture fails)
is checked without a GPU against a stand-in for CuPy's streams and graphs; the GPU tests check
the bits for every zoo model and mode, from float and raw input, and the streaming path.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_gpu_network_raw import zoo_params

from convolab import data
from convolab.errors import InputError
from convolab.models import MODELS, spec

ZOO = tuple(MODELS)
RAW_HW = (data.IMAGE_SIDE, data.IMAGE_SIDE)


# ---- the bookkeeping, without a GPU --------------------------------------------------------


class _CudaError(Exception):
    pass


class _Stream:
    """Stands for a CUDA stream: whether it captures and what the capture recorded."""

    def __init__(self, log: list[str], fail_end: bool = False, **_: Any) -> None:
        self.log, self.fail_end, self.capturing = log, fail_end, False
        self.recorded: list[str] = []

    def __enter__(self) -> _Stream:
        _FakeCuPy.current.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _FakeCuPy.current.pop()

    def begin_capture(self) -> None:
        assert not self.capturing, "capture inside a capture"
        self.capturing, self.recorded = True, []

    def end_capture(self) -> _Graph:
        assert self.capturing, "end_capture without a capture"
        self.capturing = False
        if self.fail_end:
            raise _CudaError("operation not permitted when stream is capturing")
        return _Graph(self.log, self.recorded)


class _Graph:
    def __init__(self, log: list[str], steps: list[str]) -> None:
        self.log, self.steps = log, list(steps)

    def launch(self, stream: object) -> None:
        self.log.append("replay:" + ",".join(self.steps))


class _FakeCuPy:
    current: list[_Stream] = []

    def __init__(self, log: list[str], fail_end: bool = False) -> None:
        self.cuda = SimpleNamespace(
            Stream=lambda **kw: _Stream(log, fail_end, **kw),
            get_current_stream=lambda: "default",
            runtime=SimpleNamespace(CUDARuntimeError=_CudaError),
            driver=SimpleNamespace(CUDADriverError=_CudaError))


class _Array:
    """What forward_into reads of a device array: its batch size and address."""

    def __init__(self, n: int, ptr: int, ndim: int = 4) -> None:
        self.shape, self.ndim, self.data = (n, 1, 8, 8)[:ndim], ndim, SimpleNamespace(ptr=ptr)


def _graph_net(log: list[str], fail_end: bool = False, run_error: bool = False) -> Any:
    """A FusedLeNet with fake runs that log whether they ran or were recorded by a capture."""
    from convolab.gpu import network

    net = object.__new__(network.FusedLeNet)
    net._cp = _FakeCuPy(log, fail_end)
    net.graphs, net.graph_error, net._graphs, net._capture_stream = True, None, {}, None
    net._outputs = {}

    def step(name: str) -> Any:
        def run(*_: object) -> None:
            stream = _FakeCuPy.current[-1] if _FakeCuPy.current else None
            if stream is not None and stream.capturing:
                if run_error:
                    raise InputError("a run refused its input")
                stream.recorded.append(name)
            else:
                log.append("ran:" + name)
        return run

    plans: dict[tuple[Any, ...], Any] = {}

    def plan(batch: int, slot: int = 0, raw_hw: Any = None) -> Any:
        return plans.setdefault((batch, slot, raw_hw), ([step("c1"), step("c3")],
                                                        [None, "a1", "a3"]))

    net._plans, net._plan, net._head = plans, plan, step("head")
    return net


def test_second_call_captures_and_later_calls_replay() -> None:
    log: list[str] = []
    net = _graph_net(log)
    x, probs = _Array(5, 1000), _Array(5, 2000, 2)
    net.forward_into(x, probs)
    assert log == ["ran:c1", "ran:c3", "ran:head"]  # the first call: kernel by kernel
    log.clear()
    net.forward_into(x, probs)
    net.forward_into(x, probs)
    assert log == ["replay:c1,c3,head"] * 2  # captured once, nothing ran outside the graph
    # another output address, another batch size, another slot: each starts over
    for args in ((x, _Array(5, 3000, 2)), (_Array(7, 1000), _Array(7, 2000, 2))):
        log.clear()
        net.forward_into(*args)
        assert log == ["ran:c1", "ran:c3", "ran:head"]
    log.clear()
    net.forward_into(x, probs, slot=1)
    assert log == ["ran:c1", "ran:c3", "ran:head"]


def test_graphs_are_bounded_and_dropped_with_their_plan() -> None:
    from convolab.gpu.network import GRAPHS_PER_PLAN

    log: list[str] = []
    net = _graph_net(log)
    probs = _Array(5, 2000, 2)
    for ptr in range(GRAPHS_PER_PLAN + 3):  # a caller whose input moves every call
        net.forward_into(_Array(5, 10 * ptr), probs)
    assert len(net._graphs[(5, 0, None)]) == GRAPHS_PER_PLAN
    x = _Array(5, 10)
    net.forward_into(x, probs)
    net.forward_into(x, probs)
    assert any(g is not None for g in net._graphs[(5, 0, None)].values())
    net._drop_plans((5, 0, None))
    assert (5, 0, None) not in net._graphs and (5, 0, None) not in net._plans
    net.forward_into(x, probs)
    net.forward_into(_Array(6, 10), _Array(6, 2000, 2))
    net._drop_plans()
    assert not net._graphs and not net._plans


def test_graphs_off_launches_every_time() -> None:
    log: list[str] = []
    net = _graph_net(log)
    net.graphs = False
    x, probs = _Array(5, 1000), _Array(5, 2000, 2)
    for _ in range(3):
        net.forward_into(x, probs)
    assert log == ["ran:c1", "ran:c3", "ran:head"] * 3 and not net._graphs


def test_a_capture_the_driver_refuses_falls_back_to_launches() -> None:
    log: list[str] = []
    net = _graph_net(log, fail_end=True)
    x, probs = _Array(5, 1000), _Array(5, 2000, 2)
    for _ in range(3):
        net.forward_into(x, probs)
    assert log == ["ran:c1", "ran:c3", "ran:head"] * 3  # every forward still ran
    assert net.graphs is False and "not permitted" in net.graph_error


def test_a_run_that_raises_mid_capture_ends_the_capture_and_raises() -> None:
    log: list[str] = []
    net = _graph_net(log, run_error=True)
    x, probs = _Array(5, 1000), _Array(5, 2000, 2)
    net.forward_into(x, probs)
    with pytest.raises(InputError, match="refused"):
        net.forward_into(x, probs)
    assert not net._capture_stream.capturing  # the stream is usable again


class _Memory:
    pass


class _OutArray:
    """What _output reads of an output array: its memory pointer and memory (a view shares
    both, as CuPy's do)."""

    def __init__(self, data: Any = None) -> None:
        self.data = data or SimpleNamespace(mem=_Memory())

    def view(self) -> _OutArray:
        return _OutArray(self.data)


def _output_net(stream: list[int]) -> Any:
    from convolab.gpu import network

    net = object.__new__(network.FusedLeNet)
    made: list[_OutArray] = []

    def empty(*_: object) -> _OutArray:
        made.append(_OutArray())
        return made[-1]

    net._cp = SimpleNamespace(empty=empty, float32="float32", cuda=SimpleNamespace(
        get_current_stream=lambda: SimpleNamespace(ptr=stream[0])))
    net.classes, net._outputs, net._plans, net._graphs = 10, {}, {}, {}
    net.made = made
    return net


def test_output_is_reused_only_once_nothing_refers_to_it() -> None:
    stream = [0]
    net = _output_net(stream)
    first = net._output(5, None)
    assert net._output(5, None) is not first  # the caller still holds the first
    second = id(net.made[-1])  # ids only from here on: a name would hold the array
    del first
    assert id(net._output(5, None)) == second  # held by no one but the cache: reused
    assert len(net.made) == 2
    kept = net._output(5, None)
    assert id(kept) == second
    # the caller keeps the result, or a view of it, or its memory pointer, or its memory
    for holder in (lambda a: a, lambda a: a.view(), lambda a: a.data, lambda a: a.data.mem):
        held = holder(kept)
        del kept
        kept = net._output(5, None)
        assert id(kept) != second, "a referenced output was handed out again"
        del held
        second = id(kept)
    del kept
    assert id(net._output(5, None)) == second
    assert id(net._output(6, None)) != second  # another batch size, another output
    stream[0] = 7
    assert id(net._output(5, None)) != second  # another stream, another output
    stream[0] = 0
    assert id(net._output(5, None)) == second
    assert len(net.made) == 8


def test_outputs_are_dropped_with_their_plan() -> None:
    net = _output_net([0])
    net._output(5, None)
    net._output(6, None)
    net._output(5, (28, 28))
    net._drop_plans((5, 0, None))
    assert [k[:2] for k in net._outputs] == [(6, None), (5, (28, 28))]
    net._drop_plans()
    assert not net._outputs


# ---- the bits, on the GPU ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("mode", ["exact", "tf32", "fp16"])
@pytest.mark.parametrize("raw", [False, True])
def test_replayed_graph_equals_launches_bit_for_bit(model: str, mode: str, raw: bool,
                                                    rng: np.random.Generator) -> None:
    """One input and one output buffer, refilled with fresh images and poisoned with NaN
    before every forward: the graph's answers equal the launched forward's, bit for bit."""
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = zoo_params(model, int(rng.integers(1 << 30)))
    graphed = FusedLeNet(params, mode=mode, model=model)
    launched = FusedLeNet(params, mode=mode, model=model, graphs=False)
    n = int(rng.integers(1, 400)) | 1
    size = spec(model).input_size
    shape = (n, *RAW_HW) if raw else (n, 1, size, size)
    x = cp.empty(shape, cp.uint8 if raw else cp.float32)
    probs = cp.empty((n, graphed.classes), cp.float32)
    for call in range(4):
        images = (rng.integers(0, 256, shape, dtype=np.uint8) if raw
                  else rng.random(shape, dtype=np.float32))
        x[...] = cp.asarray(images)
        probs.fill(cp.nan)
        graphed.forward_into(x, probs)
        want = launched(cp.asarray(images)).get()
        got = probs.get()
        assert np.all(np.isfinite(got)), (model, mode, raw, call)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (model, mode, raw, call)
    graphs = graphed._graphs[(n, 0, RAW_HW if raw else None)]
    assert any(g is not None for g in graphs.values()), "no graph was captured"
    assert graphed.graph_error is None


@pytest.mark.gpu
def test_call_and_streaming_replay_graphs(rng: np.random.Generator) -> None:
    """Through __call__ (the output it returned before, once dropped) and forward_chunks
    (per-slot buffers): the same answers as launches."""
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = zoo_params("eecs498", int(rng.integers(1 << 30)))
    graphed = FusedLeNet(params, mode="fp16", model="eecs498")
    launched = FusedLeNet(params, mode="fp16", model="eecs498", graphs=False)
    raw = rng.integers(0, 256, (int(rng.integers(300, 900)), *RAW_HW), dtype=np.uint8)
    x = cp.asarray(raw)
    want = launched(x).get()
    for _ in range(3):
        got = graphed(x).get()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    chunk = int(rng.integers(50, 200))
    for _ in range(3):
        labels = graphed.forward_chunks(raw, chunk=chunk, streams=2, labels=True)
        np.testing.assert_array_equal(labels, want.argmax(1))
    assert any(g is not None for graphs in graphed._graphs.values() for g in graphs.values())


@pytest.mark.gpu
def test_call_reuses_only_an_output_nobody_holds(rng: np.random.Generator) -> None:
    """A dropped output's memory comes back (poisoned first, so a forward that wrote nothing
    would show); a kept one, a view of one, or a DLPack export of one is never written again."""
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = zoo_params("ece408-mxnet", int(rng.integers(1 << 30)))
    net = FusedLeNet(params, mode="fp16", model="ece408-mxnet")
    n = int(rng.integers(20, 300))
    images = [cp.asarray(rng.integers(0, 256, (n, *RAW_HW), dtype=np.uint8)) for _ in range(2)]
    want = [net(x).get() for x in images]
    out = net(images[0])
    ptr = out.data.ptr
    out.fill(cp.nan)
    del out
    again = net(images[1])
    assert again.data.ptr == ptr  # nothing held it: reused
    np.testing.assert_array_equal(again.get(), want[1])
    for hold in (lambda a: a, lambda a: a[: n // 2], lambda a: a.__dlpack__()):
        held = hold(again)
        del again
        other = net(images[0])
        np.testing.assert_array_equal(other.get(), want[0])
        assert other.data.ptr != ptr, "a held output was written again"
        if isinstance(held, cp.ndarray):
            np.testing.assert_array_equal(held.get(), want[1][: held.shape[0]])
        ptr = other.data.ptr
        del held, other
        again = net(images[1])
        assert again.data.ptr == ptr
        np.testing.assert_array_equal(again.get(), want[1])
