"""Raw uint8 images through the fused forward of every zoo model (issue: raw bytes in).

The first conv kernel resizes raw bytes on chip with data.resize_bilinear's rule, so a raw
forward must give the same bits as the float forward of resize_bilinear's output, in every
mode; both are checked against the fp64 framework forward. Streaming from the host (pageable
or pinned, probabilities or labels) must equal the one-shot device forward.
"""

from __future__ import annotations

import numpy as np
import pytest

from convolab import data
from convolab.check import rel_l2
from convolab.conv_cpu import reference_forward
from convolab.errors import InputError, InputTypeError
from convolab.models import MODELS, build, spec
from convolab.precision import TOLERANCE

ZOO = tuple(MODELS)
ECE408_SIZE = spec("ece408").input_size
RAW_HW = (data.IMAGE_SIDE, data.IMAGE_SIDE)
MODE_TOLERANCE = {"exact": TOLERANCE["fp32"], "tf32": 2 * TOLERANCE["tf32"],
                  "fp16": TOLERANCE["fp16"]}


def zoo_params(model: str, seed: int) -> dict[str, np.ndarray]:
    """models.build's init plus random biases (a zero bias would hide a bias bug)."""
    rng = np.random.default_rng(seed)
    params = {k: np.asarray(v, np.float32) for k, v in build(model, seed).params().items()}
    for name in params:
        if name.endswith(".bias"):
            params[name] = (0.1 * rng.standard_normal(params[name].shape)).astype(np.float32)
    return params


def raw_batch(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, (n, *RAW_HW), dtype=np.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("mode", ["exact", "tf32", "fp16"])
def test_raw_forward_equals_float_forward_bits(model: str, mode: str,
                                               rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = zoo_params(model, int(rng.integers(1 << 30)))
    net = FusedLeNet(params, mode=mode, model=model)
    n = int(rng.integers(1, 300)) | 1  # odd sizes leave partial tiles and chunks
    raw = raw_batch(rng, n)
    x = data.resize_bilinear(raw, spec(model).input_size)
    from_raw = net(cp.asarray(raw)).get()
    from_float = net(cp.asarray(x)).get()
    assert np.array_equal(from_raw.view(np.uint32), from_float.view(np.uint32)), (model, mode, n)
    ref = reference_forward(params, x[:64], model=model)
    assert rel_l2(from_raw[:64], ref) <= MODE_TOLERANCE[mode]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ZOO)
def test_every_zoo_model_exact_matches_fp64(model: str, rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = zoo_params(model, int(rng.integers(1 << 30)))
    size = spec(model).input_size
    for n in (1, 2, 3, 17, 128):
        x = rng.random((n, 1, size, size), dtype=np.float32)
        net = FusedLeNet(params, mode="exact", model=model)
        probs_d = cp.full((n, net.classes), cp.nan, cp.float32)  # poisoned
        net.forward_into(cp.asarray(x), probs_d)
        probs = probs_d.get()
        ref = reference_forward(params, x, model=model)
        assert np.all(np.isfinite(probs))
        assert rel_l2(probs, ref) <= TOLERANCE["fp32"], (model, n)
        assert np.abs(probs - ref).max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("model", ZOO)
def test_every_dataset_image_raw_equals_float_exact(model: str) -> None:
    """All 70,000 images: the exact forward from raw bytes gives the same bits as from
    resize_bilinear's floats (the on-chip resize is the CPU resize, image for image), for
    every zoo model's input size and first-block kernel."""
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    net = FusedLeNet(zoo_params(model, 0), mode="exact", model=model)
    size = spec(model).input_size
    for split in ("train", "test"):
        raw, _ = data.load_split(split)
        for start in range(0, len(raw), 10_000):
            part = raw[start:start + 10_000]
            a = net(cp.asarray(part)).get()
            b = net(cp.asarray(data.resize_bilinear(part, size))).get()
            bad = int(np.count_nonzero((a.view(np.uint32) != b.view(np.uint32)).any(1)))
            assert bad == 0, f"{model} {split}[{start}:]: {bad} images differ"


@pytest.mark.gpu
def test_shipped_weights_raw_gpu_equals_cpu_on_every_test_image() -> None:
    """Accuracy unchanged: the exact raw GPU forward predicts what the CPU framework does."""
    from convolab.gpu.network import FusedLeNet
    from convolab.models import load

    network = load("ece408")
    raw, labels = data.load_split("test")
    gpu = FusedLeNet(network.params(), mode="exact").forward_chunks(raw, labels=True)
    cpu = network.predict(data.resize_bilinear(raw, ECE408_SIZE))
    assert np.array_equal(gpu, cpu)
    assert (gpu == labels).mean() > 0.85


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [False, True])
def test_streaming_raw_host_equals_device_forward(pinned: bool,
                                                  rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet, is_pinned, pinned_empty

    net = FusedLeNet(zoo_params("ece408", int(rng.integers(1 << 30))), mode="fp16")
    n = int(rng.integers(500, 2000))
    raw = raw_batch(rng, n)
    if pinned:
        host = pinned_empty(raw.shape, np.uint8)
        host[...] = raw
        raw = host
    assert is_pinned(raw) == pinned
    single = net(cp.asarray(raw)).get()
    chunk = int(rng.integers(100, 700))
    probs = net.forward_chunks(raw, chunk=chunk, streams=3)
    np.testing.assert_array_equal(probs, single)
    labels = net.forward_chunks(raw, chunk=chunk, streams=2, labels=True)
    np.testing.assert_array_equal(labels, single.argmax(1))
    got, rate = net.throughput(raw, chunk=chunk, labels=True, repeats=3)
    np.testing.assert_array_equal(got, labels)
    assert rate > 0
    with pytest.raises(InputError, match="repeats"):
        net.throughput(raw, chunk=chunk, repeats=0)


@pytest.mark.gpu
def test_raw_input_is_checked() -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    net = FusedLeNet(zoo_params("ece408", 0))
    with pytest.raises(InputTypeError, match="uint8"):
        net(cp.zeros((2, 28, 28), cp.float32))
    with pytest.raises(InputError, match="pixels"):
        net(cp.zeros((2, 200, 200), cp.uint8))
    with pytest.raises(InputError, match=r"x\[:, 0\]"):
        net(cp.zeros((2, 1, 28, 28), cp.uint8))
    with pytest.raises(InputTypeError, match="float64"):
        net(cp.zeros((2, 1, ECE408_SIZE, ECE408_SIZE), cp.float64))
    with pytest.raises(InputTypeError, match="forward_chunks"):
        net(np.zeros((2, *RAW_HW), np.uint8))
    with pytest.raises(InputTypeError, match=r"net\(x\)"):
        net.forward_chunks(cp.zeros((2, *RAW_HW), cp.uint8))
    with pytest.raises(InputError, match="uint8"):
        net.forward_chunks(np.zeros((2, 1, *RAW_HW), np.uint8))


def test_parallel_copy_copies_every_byte(rng: np.random.Generator) -> None:
    from convolab.gpu.network import COPY_SLICE_BYTES, parallel_copy

    for n in (0, 1, 7, int(rng.integers(3, 9)) * COPY_SLICE_BYTES // (RAW_HW[0] * RAW_HW[1]) + 13):
        src = rng.integers(0, 256, (n, *RAW_HW), dtype=np.uint8)
        dst = np.zeros_like(src)
        parallel_copy(dst, src)
        assert np.array_equal(dst, src), n


def test_bytes_per_image_counts_raw_input() -> None:
    from convolab.gpu.network import bytes_per_image, image_shape

    for model in ZOO:
        floats = int(np.prod(image_shape(model)))
        with_float = bytes_per_image("exact", True, model)
        with_raw = bytes_per_image("exact", True, model, raw_hw=RAW_HW)
        # the raw bytes come on top of the resized copy's floats
        assert with_raw == with_float + RAW_HW[0] * RAW_HW[1]
        assert bytes_per_image("exact", False, model, RAW_HW) == with_float - 4 * floats


def every_size(model: str) -> list[int]:
    """ece408: every size to 40 (its head takes 16 images a tile). The wider models cost
    several times more a forward: every size to 17, then either side of their head's image
    tiles (kernel 30's default tiles), which 1..17 does not reach."""
    if model == "ece408":
        return list(range(1, 41))
    from convolab.gpu.dense_head import DEFAULT_TILES

    around = {t + d for t, *_ in DEFAULT_TILES for d in (-1, 0, 1)}
    return sorted(set(range(1, 18)) | around)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("mode", ["exact", "tf32", "fp16"])
def test_raw_batches_of_every_size(model: str, mode: str, rng: np.random.Generator) -> None:
    """Batch sizes 1..N (partial tiles, partial head tiles, odd counts) from raw bytes
    equals the float forward of the same images, and each image's answer does not depend on
    the batch it came in."""
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    net = FusedLeNet(zoo_params(model, int(rng.integers(1 << 30))), mode=mode, model=model)
    size = spec(model).input_size
    sizes = every_size(model)
    raw = raw_batch(rng, max(sizes))
    whole = net(cp.asarray(raw)).get()
    for n in sizes:
        part = net(cp.asarray(raw[:n])).get()
        floats = net(cp.asarray(data.resize_bilinear(raw[:n], size))).get()
        assert np.array_equal(part.view(np.uint32), floats.view(np.uint32)), (model, mode, n)
        assert np.array_equal(part.view(np.uint32), whole[:n].view(np.uint32)), (model, mode, n)


@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("mode", ["exact", "fp16"])
@pytest.mark.parametrize("raw_first", ["fused", "resize", None])
def test_plan_chains_the_blocks(model: str, mode: str, raw_first: str | None,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's runs and buffers, without a GPU: run i reads buffer i and writes buffer i+1;
    a raw input gets the fused first run, or rung 25's resize in front of the float one."""
    from types import SimpleNamespace

    from convolab.gpu import network
    from convolab.models import conv_blocks

    net = object.__new__(network.FusedLeNet)
    net._cp = SimpleNamespace(empty=np.empty, float16=np.float16, float32=np.float32)
    net.model, net.mode, net._kernel_params = model, mode, {}
    net.channels_last = network._channels_last_pair(model, mode)
    net.params = zoo_params(model, 0)
    monkeypatch.setattr(net, "_float_run", lambda i, block: ("float", i))
    monkeypatch.setattr(net, "_first_run", lambda block, hw, out_dtype: None)
    monkeypatch.setattr(net, "_staged_pair", lambda blocks, hw: None)
    monkeypatch.setattr(net, "_merged_pair", lambda blocks, hw: None)
    monkeypatch.setattr(net, "_raw_first_block",
                        lambda block, hw: ("raw", 0) if raw_first == "fused" else None)
    blocks = conv_blocks(model, 5)
    runs, buffers = net._new_plan(5, None if raw_first is None else RAW_HW)
    resized = raw_first == "resize"
    assert len(runs) == len(blocks) + resized and len(buffers) == len(runs) + 1
    assert buffers[0] is None
    if resized:
        assert buffers[1].shape == blocks[0].shape.x_shape and buffers[1].dtype == np.float32
    assert runs[resized] == (("raw", 0) if raw_first == "fused" else ("float", 0))
    assert runs[resized + 1:] == [("float", i) for i in range(1, len(blocks))]
    for block, out in zip(blocks, buffers[1 + resized:], strict=True):
        s = block.shape
        hp, wp = s.H_out // block.pool, s.W_out // block.pool
        cl = net.channels_last and block is blocks[0]
        assert out.shape == ((5, hp, wp, s.M) if cl else (5, s.M, hp, wp))
        assert out.dtype == (np.float16 if cl else np.float32)


class _FakeRun:
    """A prepared run as the plan sees it: what it reads and writes, and who it is."""

    def __init__(self, tag: tuple[str, int], in_dtype: str | None = None,
                 out_dtype: str | None = None) -> None:
        self.tag = tag
        if in_dtype:
            self.in_dtype = in_dtype
        if out_dtype:
            self.out_dtype = out_dtype

    def __call__(self, x: object, out: object) -> None:
        raise AssertionError("not run in the plan test")


def _fake_net(model: str, mode: str) -> object:
    from types import SimpleNamespace

    from convolab.gpu import network

    net = object.__new__(network.FusedLeNet)
    net._cp = SimpleNamespace(empty=np.empty, float16=np.float16, float32=np.float32)
    net.model, net.mode, net._kernel_params = model, mode, {}
    net.channels_last = network._channels_last_pair(model, mode)
    net.params = zoo_params(model, 0)
    return net


@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("next_reads", ["float32", "float16"])
@pytest.mark.parametrize("first_writes", ["asked", "float32"])
def test_plan_buffer_dtype_follows_the_next_run(model: str, raw: bool, next_reads: str,
                                                first_writes: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Rung 29 as the first run (raw or float input): the buffer after it has the dtype the
    next run declares it reads (`in_dtype`), which the first run is asked to write; a first run
    that writes fp32 anyway gets a cast run and an fp16 buffer after it."""
    from convolab.gpu import network
    from convolab.models import conv_blocks

    net = _fake_net(model, "fp16")
    if net.channels_last:
        pytest.skip("ece408's fp16 pair has its own channels-last buffer")
    asked: list[str] = []

    def first_run(block: object, hw: object, out_dtype: str) -> _FakeRun:
        asked.append(out_dtype)
        assert hw == (RAW_HW if raw else None)
        return _FakeRun(("first", 0), out_dtype=out_dtype if first_writes == "asked"
                        else "float32")

    monkeypatch.setattr(net, "_first_run", first_run)
    monkeypatch.setattr(net, "_float_run", lambda i, block: _FakeRun(
        ("float", i), in_dtype=next_reads if i == 1 else None))
    monkeypatch.setattr(net, "_raw_first_block", lambda block, hw: pytest.fail("not asked"))
    monkeypatch.setattr(net, "_staged_pair", lambda blocks, hw: None)
    monkeypatch.setattr(net, "_merged_pair", lambda blocks, hw: None)
    blocks = conv_blocks(model, 7)
    runs, buffers = net._new_plan(7, RAW_HW if raw else None)
    assert asked == [next_reads]
    cast = first_writes == "float32" and next_reads == "float16"
    assert [getattr(r, "tag", r) for r in runs] == (
        [("first", 0)] + ([network.cast_into] if cast else [])
        + [("float", i) for i in range(1, len(blocks))])
    assert len(buffers) == len(runs) + 1 and buffers[0] is None
    s, pool = blocks[0].shape, blocks[0].pool
    pooled = (7, s.M, s.H_out // pool, s.W_out // pool)
    assert buffers[1].shape == pooled
    assert buffers[1].dtype == (np.float16 if next_reads == "float16" and not cast
                                else np.float32)
    if cast:
        assert buffers[2].shape == pooled and buffers[2].dtype == np.float16
    assert all(b.dtype == np.float32 for b in buffers[2 + cast:])


def test_cast_into_rounds_to_nearest_even(rng: np.random.Generator) -> None:
    from convolab.gpu.network import cast_into

    src = rng.standard_normal((3, 5, 7)).astype(np.float32) * 1e3
    out = np.empty(src.shape, np.float16)
    cast_into(src, out)
    assert np.array_equal(out.view(np.uint16), src.astype(np.float16).view(np.uint16))


BAD_BATCHES = [  # (shape, dtype, error class, what the message must name)
    ((2, 28, 28), np.float32, InputTypeError, r"must be uint8 .* got float32"),
    ((2, 200, 200), np.uint8, InputError, "pixels"),
    ((2, 0, 28), np.uint8, InputError, "pixels"),
    ((2, 1, 28, 28), np.uint8, InputError, r"raw images \(B, H, W\).*x\[:, 0\]"),
    ((28, 28), np.uint8, InputError, r"batch axis \(x\[None\]\)"),
    ((2, 1, 28, 28), np.float32, InputError, r"\(B, 1, S, S\) float32.*\(2, 1, 28, 28\)"),
    ((2, 4, 4, 4, 4), np.float32, InputError, r"\(2, 4, 4, 4, 4\)"),
    ((2, 1, "S", "S"), np.float64, InputTypeError, r"float32, got float64.*astype"),
    ((2, 1, "S", "S"), np.float16, InputTypeError, r"float32, got float16.*astype"),
    ((2, 1, "S", "S"), np.int64, InputTypeError, r"float32, got int64"),
]


@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("shape,dtype,error,message", BAD_BATCHES)
def test_bad_batches_get_one_clear_error(model: str, shape: tuple, dtype: type,
                                         error: type, message: str) -> None:
    """FusedLeNet's input check, without a GPU: an input error class (never a bare
    ValueError/TypeError), the network named, the problem and the fix in the message."""
    from convolab.gpu.network import check_batch, image_shape

    size = spec(model).input_size
    shape = tuple(size if d == "S" else d for d in shape)
    message = message.replace("S, S", f"{size}, {size}")
    with pytest.raises(error, match=message) as err:
        check_batch(shape, dtype, image_shape(model), model)
    assert str(err.value).startswith("FusedLeNet"), str(err.value)


@pytest.mark.parametrize("model", ZOO)
def test_good_batches_pass_the_check(model: str) -> None:
    from convolab.gpu.network import check_batch, image_shape

    size = spec(model).input_size
    for shape, dtype in (((5, *RAW_HW), np.uint8), ((1, 96, 96), np.uint8),
                         ((3, 1, size, size), np.float32), ((0, 1, size, size), np.float32)):
        check_batch(shape, dtype, image_shape(model), model)


def test_call_and_forward_chunks_refuse_the_other_memory() -> None:
    """net(x) takes device arrays and forward_chunks host arrays; each refusal names the
    other call (checked with a stand-in for CuPy, before anything reaches the GPU)."""
    from types import SimpleNamespace

    from convolab.gpu import network

    net = _fake_net("ece408", "exact")
    net._cp = SimpleNamespace(ndarray=type("DeviceArray", (), {}))
    net.image_shape = network.image_shape("ece408")
    with pytest.raises(InputTypeError, match=r"got a NumPy array.*forward_chunks.*cupy.asarray"):
        net(np.zeros((2, *RAW_HW), np.uint8))
    with pytest.raises(InputTypeError, match="got a list"):
        net([[0]])
    with pytest.raises(InputTypeError, match=r"got a list: call net\(x\)"):
        net.forward_chunks([[0]])
    with pytest.raises(InputError, match="pixels"):  # the same check as net(x)
        net.forward_chunks(np.zeros((2, 200, 200), np.uint8))


@pytest.mark.gpu
def test_classify_throughput_streams_raw_bytes_and_scores_those_images(
        tmp_path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """classify --device gpu --throughput n, n beyond the images loaded: the fused network
    streams the raw uint8 bytes (the loaded images repeated), and the throughput's accuracy is
    over exactly those n images, not over the loaded ones."""
    import json

    from convolab import classify, models
    from convolab.gpu.network import FusedLeNet

    network = models.build("ece408", int(rng.integers(1 << 30))).eval()
    batch = int(rng.integers(30, 60))
    n = 2 * batch + int(rng.integers(1, batch))  # the last pass over the images is partial
    raw = raw_batch(rng, batch)
    pred = FusedLeNet(network.params(), mode="exact").forward_chunks(raw, labels=True)
    # The first `right` images labelled as predicted, the rest not: the accuracy over the
    # repeated images then differs from the accuracy over the loaded ones.
    right = int(rng.integers(1, batch))
    labels = np.where(np.arange(batch) < right, pred, (pred + 1) % 10).astype(np.uint8)
    idx = np.arange(n) % batch

    monkeypatch.setattr(models, "load", lambda name, weights=None: network)
    monkeypatch.setattr(data, "load_split", lambda *a, **k: (raw.copy(), labels.copy()))
    fed: list[np.ndarray] = []
    real = FusedLeNet.forward_chunks

    def spy(self: FusedLeNet, x_host: np.ndarray, *args: object, **kwargs: object) -> object:
        fed.append(np.array(x_host))
        return real(self, x_host, *args, **kwargs)

    monkeypatch.setattr(FusedLeNet, "forward_chunks", spy)
    out = tmp_path / "report.json"
    classify.main(model="ece408", batch=batch, impl=None, device="gpu", weights=None,
                  data_dir=None, per_layer=False, mode=None, throughput=n, self_test=False,
                  json_out=out)
    report = json.loads(out.read_text())
    t = report["throughput"]
    assert (t["images"], t["source_images"], t["path"]) == (n, batch, "fused network (exact)")
    assert report["accuracy"] == pytest.approx(right / batch)
    want = float((pred[idx] == labels[idx]).mean())
    assert t["accuracy"] == pytest.approx(want)
    assert want != pytest.approx(right / batch)
    assert fed and all(x.dtype == np.uint8 and x.shape[1:] == RAW_HW for x in fed)
    streamed = [x for x in fed if len(x) == n]
    assert streamed and all(np.array_equal(x, raw[idx]) for x in streamed)


@pytest.mark.parametrize("raw", [False, True])
def test_plan_hands_staged_records_to_the_next_run(raw: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `_staged_pair` gives the first two runs, the buffer between them is the first
    run's records (uint16, its out_tail an image, zeroed: padding is never written), read by
    the second run as it is (no cast); the rest of the plan follows as before."""
    from types import SimpleNamespace

    from convolab.models import conv_blocks

    net = _fake_net("eecs498", "exact")
    net._cp = SimpleNamespace(empty=np.empty, zeros=np.zeros, uint16=np.uint16,
                              float16=np.float16, float32=np.float32)
    first = _FakeRun(("first", 0), out_dtype="uint16")
    first.out_tail = (1234,)  # type: ignore[attr-defined]
    second = _FakeRun(("staged", 1), in_dtype="staged")
    monkeypatch.setattr(net, "_staged_pair", lambda blocks, hw: (first, second))
    monkeypatch.setattr(net, "_merged_pair", lambda blocks, hw: None)
    monkeypatch.setattr(net, "_float_run", lambda i, block: _FakeRun(("float", i)))
    monkeypatch.setattr(net, "_first_run", lambda *a: pytest.fail("not asked"))
    blocks = conv_blocks("eecs498", 7)
    runs, buffers = net._new_plan(7, RAW_HW if raw else None)
    assert [r.tag for r in runs] == [("first", 0), ("staged", 1)] + [
        ("float", i) for i in range(2, len(blocks))]
    assert buffers[1].dtype == np.uint16 and buffers[1].shape == (7, 1234)
    assert not buffers[1].any()
    last = blocks[-1].shape
    assert buffers[-1].shape == (7, last.M, last.H_out // 2, last.W_out // 2)


@pytest.mark.parametrize("model", ["eecs498", "ece408-mxnet"])
@pytest.mark.parametrize("mode", ["exact", "fp16"])
@pytest.mark.parametrize("kp", [{}, {"c3": {"staged": -1}}])
def test_staged_pair_where_both_kernels_take_it(model: str, mode: str, kp: dict,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`_staged_pair` gives (rung 45 writing records, rung 46 reading them) in exact mode where
    conv1's K is at least STAGED_MIN_K (eecs498, not mxnet's K = 5), unless `c3.staged` is -1;
    the first run is asked for the second's record layout."""
    from convolab.gpu import fused_first, fused_wgmma
    from convolab.models import conv_blocks

    net = _fake_net(model, mode)
    net._kernel_params = kp
    asked: dict[str, object] = {}

    def prepare_second(shape, w, b, kp2, precision, in_dtype):  # noqa: ANN001, ANN202
        asked.update(second=(precision, in_dtype))
        run = _FakeRun(("second", 1), in_dtype="staged")
        run.staged = {"layout": 1}  # type: ignore[attr-defined]  # its record layout
        return run

    def prepare_first(shape, pool, w, b, kp1, hw, out_dtype, precision,  # noqa: ANN001, ANN202
                      staged=None):
        asked.update(first=(precision, staged))
        return _FakeRun(("first", 0), out_dtype="uint16")

    monkeypatch.setattr(fused_wgmma, "prepare", prepare_second)
    monkeypatch.setattr(fused_first, "prepare", prepare_first)
    pair = net._staged_pair(conv_blocks(model, 3), None)
    takes = model == "eecs498" and mode == "exact" and not kp
    assert (pair is not None) == takes, asked
    if takes:
        assert [r.tag for r in pair] == [("first", 0), ("second", 1)]
        assert asked == {"second": ("3xfp16", fused_wgmma.STAGED),
                         "first": ("3xfp16", {"layout": 1})}


@pytest.mark.parametrize("model", ["eecs498", "ece408-mxnet"])
@pytest.mark.parametrize("mode", ["exact", "fp16"])
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("kp", [{}, {"c3": {"merge": -1}}, {"c3": {"staged": -1}},
                                {"c1": {"minb": 2}}, {"c3": {"consumers": 3}},
                                {"c3": {"merge": 1, "first_wgs": 1}}])
def test_merged_pair_where_kernel_47_takes_it(model: str, mode: str, raw: bool, kp: dict,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`_merged_pair` gives kernel 47 for the first two blocks in exact mode from float input
    where the staged pair would run them (eecs498), unless `c3.merge` is -1, `c3.staged` is -1,
    or either block names parameters kernel 47 does not take; its own (first_wgs) reach it.
    The plan then has one run and one buffer for both blocks."""
    from types import SimpleNamespace

    from convolab.gpu import fused_pair
    from convolab.models import conv_blocks

    net = _fake_net(model, mode)
    net._kernel_params = kp
    net._cp = SimpleNamespace(empty=np.empty, zeros=np.zeros, uint16=np.uint16,
                              float16=np.float16, float32=np.float32)
    asked: dict[str, object] = {}

    def prepare_pair(s1, w1, b1, s2, w2, b2, params):  # noqa: ANN001, ANN202
        asked.update(shapes=(s1, s2), params=params)
        return _FakeRun(("pair", 0))

    monkeypatch.setattr(fused_pair, "prepare_pair", prepare_pair)
    monkeypatch.setattr(net, "_float_run", lambda i, block: _FakeRun(("float", i)))
    blocks = conv_blocks(model, 7)
    got = net._merged_pair(blocks, RAW_HW if raw else None)
    takes = model == "eecs498" and mode == "exact" and not raw and kp in (
        {}, {"c3": {"merge": 1, "first_wgs": 1}})
    assert (got is not None) == takes, asked
    if not takes:
        return
    assert asked["shapes"] == (blocks[0].shape, blocks[1].shape)
    assert asked["params"] == {k: v for k, v in kp.get("c3", {}).items() if k != "merge"}
    monkeypatch.setattr(net, "_merged_pair", lambda b, hw: got)
    monkeypatch.setattr(net, "_staged_pair", lambda b, hw: pytest.fail("not asked"))
    monkeypatch.setattr(net, "_first_run", lambda *a: pytest.fail("not asked"))
    runs, buffers = net._new_plan(7, None)
    assert [r.tag for r in runs] == [("pair", 0)] + [("float", i)
                                                     for i in range(1, len(blocks) - 1)]
    second = blocks[1].shape
    assert buffers[1].shape == (7, second.M, second.H_out // 2, second.W_out // 2)
    assert len(buffers) == len(blocks)
