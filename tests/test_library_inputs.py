"""The library API under bad input: one ConvolabError (also a ValueError/TypeError/RuntimeError)
naming the problem, never a silent wrong answer or a stray IndexError/AttributeError."""

from __future__ import annotations

import numpy as np
import pytest

from convolab import conv_cpu
from convolab.errors import CallOrderError, ConvolabError, InputError, InputTypeError
from convolab.layers import AvgPool2d, Conv2d, Flatten, Linear, MaxPool2d, ReLU, Softmax
from convolab.network import CrossEntropyLoss, Network
from convolab.registry import get_impl


def tiny_network(rng: np.random.Generator) -> Network:
    net = Network([Conv2d(1, 2, 3, name="c1"), ReLU(), MaxPool2d(2), Flatten(),
                   Linear(2 * 4 * 4, 3, name="f"), Softmax()], "tiny")
    for name, p in net.params().items():
        net.set_param(name, rng.standard_normal(p.shape).astype(np.float32))
    return net


@pytest.mark.parametrize("stride", [1.9, 1.0, True, False, "2", None, 0, -1, np.float32(2)])
@pytest.mark.parametrize("impl", ["cpu-ref", "cpu-loops", "cpu-im2col", "cpu-fused"])
def test_forward_refuses_a_non_int_stride(
    rng: np.random.Generator, impl: str, stride: object
) -> None:
    x = rng.random((1, 1, 8, 8), dtype=np.float32)
    w = rng.random((2, 1, 3, 3), dtype=np.float32)
    with pytest.raises(ConvolabError, match="stride must be a positive int"):
        get_impl(impl).forward(x, w, stride=stride)


def test_numpy_integer_stride_is_accepted(rng: np.random.Generator) -> None:
    x = rng.random((1, 1, 9, 9), dtype=np.float32)
    w = rng.random((2, 1, 3, 3), dtype=np.float32)
    got = get_impl("cpu-im2col").forward(x, w, stride=np.int64(2))
    np.testing.assert_allclose(got, conv_cpu.conv_reference(x, w, None, 2), rtol=1e-5)


@pytest.mark.parametrize("batch", [-1, 0, 2.5, "10", None, True])
def test_predict_refuses_a_bad_batch(rng: np.random.Generator, batch: object) -> None:
    net = tiny_network(rng)
    with pytest.raises(ConvolabError, match="batch must be a positive int"):
        net.predict(rng.random((3, 1, 10, 10), dtype=np.float32), batch=batch)


def test_predict_chunks_match_one_batch(rng: np.random.Generator) -> None:
    net = tiny_network(rng)
    x = rng.random((7, 1, 10, 10), dtype=np.float32)
    np.testing.assert_array_equal(net.predict(x, batch=3), net.predict(x, batch=7))


@pytest.mark.parametrize("kind", ["uint8", "int64", "float>1", "negative", "nan"])
def test_predict_refuses_unscaled_pixels(rng: np.random.Generator, kind: str) -> None:
    net = tiny_network(rng)
    pixels = rng.integers(0, 256, (2, 1, 10, 10))
    x = {"uint8": pixels.astype(np.uint8), "int64": pixels,
         "float>1": pixels.astype(np.float32) + 1, "negative": -rng.random((2, 1, 10, 10)),
         "nan": np.full((2, 1, 10, 10), np.nan, np.float32)}[kind]
    with pytest.raises(ConvolabError, match=r"\[0, 1\]|255"):
        net.predict(x)
    if kind in ("uint8", "int64"):
        with pytest.raises(InputTypeError, match="floating-point"):
            net.forward(x)


@pytest.mark.parametrize(
    ("labels", "error", "match"),
    [
        (np.array([0, -1]), InputError, r"label -1 is outside \[0, 3\)"),
        (np.array([0, 3]), InputError, r"label 3 is outside \[0, 3\)"),
        (np.array([0.0, 1.0]), InputTypeError, "integer"),
        (np.array([True, False]), InputTypeError, "integer"),
        (np.array([0, 1, 2]), InputError, "labels"),
        (np.array([[0], [1]]), InputError, "labels"),
    ],
    ids=["minus1", "classes", "float", "bool", "too-many", "2d"],
)
def test_cross_entropy_refuses_bad_labels(
    rng: np.random.Generator, labels: np.ndarray, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        CrossEntropyLoss()(rng.standard_normal((2, 3)), labels)


def test_cross_entropy_refuses_an_empty_batch() -> None:
    with pytest.raises(InputError, match="empty batch"):
        CrossEntropyLoss()(np.zeros((0, 3)), np.zeros((0,), np.int64))


@pytest.mark.parametrize(
    "layer",
    [Conv2d(1, 2, 3), ReLU(), MaxPool2d(2), AvgPool2d(2), AvgPool2d(2, subsample=True, channels=1),
     Linear(4, 2), Flatten(), Softmax()],
    ids=lambda layer: repr(layer),
)
def test_backward_before_forward_is_one_clear_error(layer: object) -> None:
    with pytest.raises(CallOrderError, match="backward called before forward"):
        layer.backward(np.ones((1, 1, 2, 2)))  # type: ignore[attr-defined]


def test_network_backward_before_forward() -> None:
    net = Network([Flatten(), Linear(4, 2)], "n")
    with pytest.raises(CallOrderError, match="before forward"):
        net.backward(np.ones((1, 2)))


@pytest.mark.parametrize("layer", [MaxPool2d(2), AvgPool2d(2), Flatten()], ids=repr)
@pytest.mark.parametrize("shape", [(1, 8, 8), (8,), (1, 1, 1, 8, 8)])
def test_layers_expecting_4d_name_the_shape(layer: object, shape: tuple[int, ...]) -> None:
    with pytest.raises(InputError, match=r"4-D input \(B, C, H, W\)"):
        layer.forward(np.zeros(shape, np.float32))  # type: ignore[attr-defined]


def test_conv_refuses_3d_input() -> None:
    with pytest.raises(InputError, match="4-D"):
        Conv2d(1, 2, 3).forward(np.zeros((1, 8, 8), np.float32))


def _nan_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rng.random((2, 1, 12, 12), dtype=np.float32)
    x[0, 0, 3, 4] = np.nan  # one bad pixel in image 0 only
    w = rng.standard_normal((3, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    return x, w, b


def test_nan_propagates_the_same_way_in_fused_and_unfused_cpu_paths(
    rng: np.random.Generator,
) -> None:
    x, w, b = _nan_case(rng)
    fused = conv_cpu.conv_relu_pool_cpu(x, w, b, 1, 2)
    conv = Conv2d(1, 3, 3).eval()
    conv.weight, conv.bias = w, b
    unfused = MaxPool2d(2).eval().forward(ReLU().forward(conv.forward(x)))
    reference = conv_cpu.reference_conv_relu_pool(x, w, b, 1, 2)
    nan_ref = np.isnan(reference)
    # Every 3x3 conv output touching (3, 4) is NaN: rows 1..3, columns 2..4, in every channel.
    assert nan_ref[0].any() and not nan_ref[1].any()
    np.testing.assert_array_equal(np.isnan(fused), nan_ref)
    np.testing.assert_array_equal(np.isnan(unfused), nan_ref)
    np.testing.assert_allclose(fused[~nan_ref], reference[~nan_ref], rtol=1e-5, atol=1e-6)
