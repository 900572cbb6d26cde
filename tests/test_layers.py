"""Every layer's forward against an independent fp64 loop computation, and every backward
against central finite differences in float64."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from convolab.layers import (
    AvgPool2d,
    Conv2d,
    Flatten,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    Softmax,
    col2im,
    im2col,
)
from convolab.network import CrossEntropyLoss

# ----------------------------------------------------------------- independent references


def conv_loops(x: np.ndarray, w: np.ndarray, b: np.ndarray, s: int) -> np.ndarray:
    """The textbook's sequential convolution (no flip, valid), in float64."""
    B, C, H, W = x.shape
    M, _, K, _ = w.shape
    Ho, Wo = (H - K) // s + 1, (W - K) // s + 1
    y = np.zeros((B, M, Ho, Wo))
    for bi, m, h, v in itertools.product(range(B), range(M), range(Ho), range(Wo)):
        acc = b[m]
        for c, p, q in itertools.product(range(C), range(K), range(K)):
            acc += x[bi, c, h * s + p, v * s + q] * w[m, c, p, q]
        y[bi, m, h, v] = acc
    return y


def pool_loops(x: np.ndarray, k: int, s: int, reduce) -> np.ndarray:
    B, C, H, W = x.shape
    Ho, Wo = (H - k) // s + 1, (W - k) // s + 1
    y = np.zeros((B, C, Ho, Wo))
    for bi, c, h, v in itertools.product(range(B), range(C), range(Ho), range(Wo)):
        y[bi, c, h, v] = reduce(x[bi, c, h * s:h * s + k, v * s:v * s + k])
    return y


def numeric_grad(f, a: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar f() with respect to every element of a (in place)."""
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        old = a[i]
        a[i] = old + eps
        hi = f()
        a[i] = old - eps
        lo = f()
        a[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


def check_layer_grads(layer: Layer, x: np.ndarray, rng: np.random.Generator) -> None:
    """dE/dX and every dE/dparam of E = sum(forward(x) * R) against finite differences."""
    for name, p in layer.params().items():
        layer.set_param(name, rng.standard_normal(p.shape))
    r = rng.standard_normal(layer.forward(x).shape)

    def energy() -> float:
        return float((layer.forward(x) * r).sum())

    layer.forward(x)
    dx = layer.backward(r)
    grads = layer.grads()
    np.testing.assert_allclose(dx, numeric_grad(energy, x), rtol=1e-6, atol=1e-7)
    for name, p in layer.params().items():
        np.testing.assert_allclose(grads[name], numeric_grad(energy, p), rtol=1e-6, atol=1e-7,
                                   err_msg=f"d/d{name}")


# ----------------------------------------------------------------------------- forwards


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv_forward_matches_loops(rng: np.random.Generator, stride: int) -> None:
    conv = Conv2d(3, 4, 3, stride=stride)
    conv.weight = rng.standard_normal(conv.weight.shape).astype(np.float32)
    conv.bias = rng.standard_normal(4).astype(np.float32)
    x = rng.standard_normal((2, 3, 11, 10)).astype(np.float32)
    want = conv_loops(x.astype(np.float64), conv.weight.astype(np.float64),
                      conv.bias.astype(np.float64), stride)
    for training in (True, False):  # the registry impl: per call, and as a cached plan
        conv.train(training)
        got = conv.forward(x)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    conv.weight, conv.bias = conv.weight.astype(np.float64), conv.bias.astype(np.float64)
    own = conv.forward(x.astype(np.float64))  # float64: this module's own chunked unroll
    assert own.dtype == np.float64
    np.testing.assert_allclose(own, want, rtol=1e-12, atol=1e-12)
    conv._CPU_CHUNK_BYTES = 1  # one image per chunk: the chunk loop must cover the batch
    np.testing.assert_allclose(conv.forward(x.astype(np.float64)), want, rtol=1e-12, atol=1e-12)


def test_conv_eval_plan_follows_new_weights(rng: np.random.Generator) -> None:
    conv = Conv2d(1, 2, 3).eval()
    x = rng.standard_normal((1, 1, 6, 6)).astype(np.float32)
    conv.weight = rng.standard_normal(conv.weight.shape).astype(np.float32)
    first = conv.forward(x)
    conv.weight = rng.standard_normal(conv.weight.shape).astype(np.float32)
    assert not np.allclose(conv.forward(x), first)


def test_im2col_col2im_are_adjoint(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, 9, 8))
    c = rng.standard_normal(im2col(x, 3, 2).shape)
    assert np.isclose((im2col(x, 3, 2) * c).sum(), (x * col2im(c, x.shape, 3, 2)).sum())


@pytest.mark.parametrize("k,s", [(2, 2), (4, 4), (3, 2), (2, 1)])
def test_pool_forward_matches_loops(rng: np.random.Generator, k: int, s: int) -> None:
    x = rng.standard_normal((2, 3, 11, 9))  # odd sizes exercise floor mode
    np.testing.assert_array_equal(MaxPool2d(k, s).forward(x), pool_loops(x, k, s, np.max))
    np.testing.assert_allclose(AvgPool2d(k, s).forward(x), pool_loops(x, k, s, np.mean))
    sub = AvgPool2d(k, s, subsample=True, channels=3)
    sub.weight, sub.bias = rng.standard_normal(3), rng.standard_normal(3)
    z = pool_loops(x, k, s, np.mean) * sub.weight[:, None, None] + sub.bias[:, None, None]
    np.testing.assert_allclose(sub.forward(x), 1 / (1 + np.exp(-z)))


def test_linear_relu_flatten_softmax_forward(rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 5))
    lin = Linear(5, 4)
    lin.weight, lin.bias = rng.standard_normal((4, 5)), rng.standard_normal(4)
    want = np.array([[sum(x[i, j] * lin.weight[o, j] for j in range(5)) + lin.bias[o]
                      for o in range(4)] for i in range(3)])
    np.testing.assert_allclose(lin.forward(x), want)
    np.testing.assert_array_equal(ReLU().forward(x), np.where(x > 0, x, 0))
    img = rng.standard_normal((2, 3, 4, 5))
    np.testing.assert_array_equal(Flatten().forward(img)[1], img[1].ravel())  # (C, H, W) order
    p = Softmax().forward(x)
    np.testing.assert_allclose(p, np.exp(x) / np.exp(x).sum(axis=1, keepdims=True))


# ---------------------------------------------------------------------------- backwards


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv_backward(rng: np.random.Generator, stride: int) -> None:
    check_layer_grads(Conv2d(2, 3, 3, stride=stride), rng.standard_normal((2, 2, 8, 7)), rng)
    one_image_chunks = Conv2d(2, 3, 3, stride=stride)
    one_image_chunks._CPU_CHUNK_BYTES = 1
    check_layer_grads(one_image_chunks, rng.standard_normal((3, 2, 8, 7)), rng)


@pytest.mark.parametrize("k,s", [(2, 2), (3, 2), (2, 1)])
def test_maxpool_backward(rng: np.random.Generator, k: int, s: int) -> None:
    check_layer_grads(MaxPool2d(k, s), rng.standard_normal((2, 2, 7, 6)), rng)


def test_maxpool_gives_a_tied_window_gradient_once(rng: np.random.Generator) -> None:
    pool = MaxPool2d(2)
    pool.forward(np.zeros((1, 1, 2, 2)))
    assert pool.backward(np.ones((1, 1, 1, 1))).sum() == 1


@pytest.mark.parametrize("subsample", [False, True])
def test_avgpool_backward(rng: np.random.Generator, subsample: bool) -> None:
    check_layer_grads(AvgPool2d(2, subsample=subsample, channels=2),
                      rng.standard_normal((2, 2, 5, 6)), rng)


def test_linear_relu_flatten_softmax_backward(rng: np.random.Generator) -> None:
    check_layer_grads(Linear(5, 3), rng.standard_normal((4, 5)), rng)
    x = rng.standard_normal((3, 4))
    x[np.abs(x) < 1e-3] = 0.5  # keep finite differences away from ReLU's kink
    check_layer_grads(ReLU(), x, rng)
    check_layer_grads(Flatten(), rng.standard_normal((2, 2, 3, 2)), rng)
    check_layer_grads(Softmax(), rng.standard_normal((3, 4)), rng)


def test_cross_entropy_loss_and_grad(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((4, 5)) * 3
    labels = rng.integers(0, 5, 4)
    loss, grad = CrossEntropyLoss()(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert np.isclose(loss, -np.log(p[np.arange(4), labels]).mean())
    np.testing.assert_allclose(grad, numeric_grad(lambda: CrossEntropyLoss()(logits, labels)[0],
                                                  logits), rtol=1e-6, atol=1e-8)
    big, _ = CrossEntropyLoss()(np.array([[1000.0, 0.0]]), np.array([1]))
    assert np.isfinite(big) and np.isclose(big, 1000.0)  # no overflow in the fused form


def test_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="channels"):
        Conv2d(2, 3, 3).forward(np.zeros((1, 1, 5, 5), np.float32))
    with pytest.raises(ValueError, match="smaller"):
        MaxPool2d(4).forward(np.zeros((1, 1, 3, 3)))
    with pytest.raises(ValueError, match="Linear|expected"):
        Linear(4, 2).forward(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="positive"):
        Conv2d(1, 0, 3)
