"""GPU backward kernels (convolab.gpu.backward) against float64 NumPy references, the CPU
layers' own backward and central finite differences; plus a short GPU training run."""

from __future__ import annotations

import numpy as np
import pytest

from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.models import conv_blocks
from convolab.precision import TOLERANCE

pytestmark = pytest.mark.gpu

FP32_TOL = TOLERANCE["fp32"]  # fp32 paths against an fp64 reference
C3 = conv_blocks("ece408", 1)[1].shape  # the ece408 model's second conv layer
IMAGE = conv_blocks("ece408", 1)[0].shape.x_shape[1:]  # (1, H, W) of one input image
# The conv backward variants: 'direct' runs the register-tap dW kernel for K <= MAX_TAPS_K,
# 'direct-per-weight' forces the one-block-per-weight dW kernel used beyond that.
VARIANTS = ["direct", "direct-per-weight", "gemm"]


@pytest.fixture
def conv_method(request, monkeypatch) -> str:
    """The `method` argument for a VARIANTS entry (patching the module where needed)."""
    from convolab.gpu import backward

    variant = request.param
    if variant == "direct-per-weight":
        monkeypatch.setattr(backward, "MAX_TAPS_K", 0)
        return "direct"
    return variant


# ----------------------------------------------------------------- float64 references


def conv_backward_ref(x: np.ndarray, w: np.ndarray, dy: np.ndarray, s: int):
    """dX, dW, db of the convolution (conv_reference) in float64, written as the textbook's
    scatter (figs. 16.8/16.9)."""
    x, w, dy = (a.astype(np.float64) for a in (x, w, dy))
    k = w.shape[2]
    ho, wo = dy.shape[2:]
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    for p in range(k):
        for q in range(k):
            rows = slice(p, p + s * (ho - 1) + 1, s)
            cols = slice(q, q + s * (wo - 1) + 1, s)
            dx[:, :, rows, cols] += np.einsum("bmhw,mc->bchw", dy, w[:, :, p, q])
            dw[:, :, p, q] = np.einsum("bmhw,bchw->mc", dy, x[:, :, rows, cols])
    return dx, dw, dy.sum(axis=(0, 2, 3))


def random_conv_case(rng: np.random.Generator, stride: int):
    k = int(rng.integers(1, 6))
    h = int(rng.integers(k, k + 12))
    w = int(rng.integers(k, k + 12))
    b, c, m = (int(v) for v in rng.integers(1, 5, size=3))
    x = rng.standard_normal((b, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((m, c, k, k)).astype(np.float32)
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    dy = rng.standard_normal((b, m, ho, wo)).astype(np.float32)
    return x, wt, dy


# ----------------------------------------------------------------- convolution


@pytest.mark.parametrize("conv_method", VARIANTS, indirect=True)
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv_backward_matches_fp64_reference(rng, conv_method, stride):
    import cupy as cp

    method = conv_method
    from convolab.gpu.backward import conv2d_backward

    for _ in range(4):  # several random shapes per (method, stride)
        x, w, dy = random_conv_case(rng, stride)
        dx, dw, db = conv2d_backward(cp.asarray(x), cp.asarray(w), cp.asarray(dy), stride,
                                     method=method)
        dx_ref, dw_ref, db_ref = conv_backward_ref(x, w, dy, stride)
        shape = f"x {x.shape} w {w.shape} stride {stride}"
        assert rel_l2(dx, dx_ref) <= FP32_TOL, f"dX {method} {shape}"
        assert rel_l2(dw, dw_ref) <= FP32_TOL, f"dW {method} {shape}"
        assert rel_l2(db, db_ref) <= FP32_TOL, f"db {method} {shape}"


@pytest.mark.parametrize("conv_method", VARIANTS, indirect=True)
def test_conv_backward_large_batch_chunks_and_slices(rng, conv_method, monkeypatch):
    """Enough images that the GEMM path runs several workspace chunks and the direct dW
    kernel several batch slices; the layer shapes of ece408's C3."""
    import cupy as cp

    from convolab.gpu import backward

    shape = C3.with_batch(10)
    taps = shape.C * shape.K * shape.K
    monkeypatch.setattr(backward, "GEMM_WORKSPACE_FLOATS",
                        3 * taps * shape.H_out * shape.W_out)  # 3 images per chunk
    x = rng.standard_normal(shape.x_shape).astype(np.float32)
    w = rng.standard_normal(shape.w_shape).astype(np.float32)
    dy = rng.standard_normal(shape.y_shape).astype(np.float32)
    dx, dw, db = backward.conv2d_backward(cp.asarray(x), cp.asarray(w), cp.asarray(dy), 1,
                                          method=conv_method)
    dx_ref, dw_ref, db_ref = conv_backward_ref(x, w, dy, 1)
    assert rel_l2(dx, dx_ref) <= FP32_TOL
    assert rel_l2(dw, dw_ref) <= FP32_TOL
    assert rel_l2(db, db_ref) <= FP32_TOL


@pytest.mark.parametrize("conv_method", VARIANTS, indirect=True)
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv_backward_matches_finite_differences(rng, conv_method, stride):
    """dL/dx and dL/dw for L = <conv(x, w), G> against central differences of the fp64 forward
    at random coordinates (the reference above could share a mistake with the kernels)."""
    import cupy as cp

    from convolab.gpu.backward import conv2d_backward

    x, w, g = random_conv_case(rng, stride)
    dx, dw, _ = conv2d_backward(cp.asarray(x), cp.asarray(w), cp.asarray(g), stride,
                                conv_method)
    dx, dw = dx.get(), dw.get()
    x64, w64, g64 = x.astype(np.float64), w.astype(np.float64), g.astype(np.float64)

    def loss(xv: np.ndarray, wv: np.ndarray) -> float:
        return float((conv_reference(xv, wv, None, stride) * g64).sum())

    eps = 1e-5
    for _ in range(6):
        i = tuple(int(rng.integers(0, n)) for n in x.shape)
        plus, minus = x64.copy(), x64.copy()
        plus[i] += eps
        minus[i] -= eps
        numeric = (loss(plus, w64) - loss(minus, w64)) / (2 * eps)
        assert dx[i] == pytest.approx(numeric, rel=1e-4, abs=1e-4), f"dX{i}"
        j = tuple(int(rng.integers(0, n)) for n in w.shape)
        plus, minus = w64.copy(), w64.copy()
        plus[j] += eps
        minus[j] -= eps
        numeric = (loss(x64, plus) - loss(x64, minus)) / (2 * eps)
        assert dw[j] == pytest.approx(numeric, rel=1e-4, abs=1e-4), f"dW{j}"


def test_conv_backward_skips_dx_and_rejects_bad_input(rng):
    import cupy as cp

    from convolab.gpu.backward import conv2d_backward

    x, w, dy = (cp.asarray(a) for a in random_conv_case(rng, 1))
    dx, dw, _ = conv2d_backward(x, w, dy, 1, need_dx=False)
    assert dx is None and dw.shape == w.shape
    with pytest.raises(ValueError, match="method"):
        conv2d_backward(x, w, dy, 1, method="fft")
    with pytest.raises(ValueError, match="dy has shape"):
        conv2d_backward(x, w, dy[:, :, :-1], 1)
    with pytest.raises(TypeError, match="float32"):
        conv2d_backward(x.astype(cp.float64), w, dy, 1)
    with pytest.raises(TypeError, match="CuPy"):
        conv2d_backward(x.get(), w, dy, 1)


@pytest.mark.parametrize("method", ["direct", "gemm"])
def test_conv_layer_on_gpu_matches_cpu_layer(rng, method):
    """The Conv2d layer's GPU backward (through the dispatch hook) equals its CPU backward."""
    import cupy as cp

    from convolab.layers import Conv2d

    cpu, gpu = Conv2d(3, 5, 3, stride=2), Conv2d(3, 5, 3, stride=2)
    cpu.weight = rng.standard_normal(cpu.weight.shape).astype(np.float32)
    cpu.bias = rng.standard_normal(cpu.bias.shape).astype(np.float32)
    gpu.weight, gpu.bias = cp.asarray(cpu.weight), cp.asarray(cpu.bias)
    gpu.backward_method = method
    x = rng.standard_normal((3, 3, 13, 11)).astype(np.float32)
    y_cpu = cpu.forward(x)
    y_gpu = gpu.forward(cp.asarray(x))
    assert rel_l2(y_gpu, y_cpu) <= FP32_TOL
    dy = rng.standard_normal(y_cpu.shape).astype(np.float32)
    dx_cpu = cpu.backward(dy)
    dx_gpu = gpu.backward(cp.asarray(dy))
    assert rel_l2(dx_gpu, dx_cpu) <= FP32_TOL
    for name in ("weight", "bias"):
        assert rel_l2(gpu.grads()[name], cpu.grads()[name]) <= FP32_TOL, name


# ----------------------------------------------------------------- pooling


@pytest.mark.parametrize("kernel,stride", [(2, 2), (4, 4), (3, 2), (2, 3), (3, 1)])
@pytest.mark.parametrize("pass_output", [False, True])
def test_maxpool_backward_matches_cpu_layer(rng, kernel, stride, pass_output):
    """Integer-valued inputs make ties common: the first maximum must win, as on the CPU."""
    import cupy as cp

    from convolab.gpu.backward import maxpool2d_backward, maxpool2d_forward
    from convolab.layers import MaxPool2d

    x = rng.integers(0, 4, size=(2, 3, 11, 10)).astype(np.float32)
    layer = MaxPool2d(kernel, stride)
    y = layer.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx_cpu = layer.backward(dy)
    x_gpu = cp.asarray(x)
    y_gpu = maxpool2d_forward(x_gpu, kernel, stride)
    np.testing.assert_array_equal(y_gpu.get(), y)
    dx_gpu = maxpool2d_backward(x_gpu, y_gpu if pass_output else None, cp.asarray(dy),
                                kernel, stride)
    np.testing.assert_allclose(dx_gpu.get(), dx_cpu, rtol=1e-6, atol=1e-6)


def test_maxpool_backward_random_values_and_errors(rng):
    import cupy as cp

    from convolab.gpu.backward import maxpool2d_backward

    x = rng.standard_normal((4, 16, 34, 34)).astype(np.float32)
    windows = x[:, :, :32, :32].reshape(4, 16, 8, 4, 8, 4).transpose(0, 1, 2, 4, 3, 5)
    flat = windows.reshape(4, 16, 8, 8, 16)
    dy = rng.standard_normal((4, 16, 8, 8)).astype(np.float32)
    ref = np.zeros((4, 16, 8, 8, 16), np.float32)
    np.put_along_axis(ref, flat.argmax(-1)[..., None], dy[..., None], axis=-1)
    dx_ref = np.zeros_like(x)
    dx_ref[:, :, :32, :32] = ref.reshape(4, 16, 8, 8, 4, 4).transpose(0, 1, 2, 4, 3, 5).reshape(
        4, 16, 32, 32)
    dx = maxpool2d_backward(cp.asarray(x), None, cp.asarray(dy), 4)
    np.testing.assert_array_equal(dx.get(), dx_ref)  # routing copies values: exact
    with pytest.raises(ValueError, match="dy has shape"):
        maxpool2d_backward(cp.asarray(x), None, cp.asarray(dy[:, :, :7]), 4)
    with pytest.raises(ValueError, match="positive int"):
        maxpool2d_backward(cp.asarray(x), None, cp.asarray(dy), 0)


@pytest.mark.parametrize("kernel,stride", [(2, 2), (4, 4), (3, 2), (2, 1)])
@pytest.mark.parametrize("pass_output", [False, True])
def test_subsample_backward_matches_cpu_layer(rng, kernel, stride, pass_output):
    import cupy as cp

    from convolab.gpu.backward import subsample_backward, subsample_forward
    from convolab.layers import AvgPool2d

    channels = 3
    layer = AvgPool2d(kernel, stride, subsample=True, channels=channels)
    layer.weight = rng.standard_normal(channels).astype(np.float32)
    layer.bias = rng.standard_normal(channels).astype(np.float32)
    x = rng.standard_normal((2, channels, 12, 9)).astype(np.float32)
    s_cpu = layer.forward(x)
    ds = rng.standard_normal(s_cpu.shape).astype(np.float32)
    dx_cpu = layer.backward(ds)
    coef, bias, x_gpu = cp.asarray(layer.weight), cp.asarray(layer.bias), cp.asarray(x)
    s_gpu = subsample_forward(x_gpu, coef, bias, kernel, stride)
    assert rel_l2(s_gpu, s_cpu) <= FP32_TOL
    dx, dcoef, dbias = subsample_backward(x_gpu, s_gpu if pass_output else None,
                                          cp.asarray(ds), coef, bias, kernel, stride)
    assert rel_l2(dx, dx_cpu) <= FP32_TOL
    assert rel_l2(dcoef, layer.grads()["weight"]) <= FP32_TOL
    assert rel_l2(dbias, layer.grads()["bias"]) <= FP32_TOL


def test_subsample_backward_matches_finite_differences(rng):
    import cupy as cp

    from convolab.gpu.backward import subsample_backward

    k = 2
    x = rng.standard_normal((2, 2, 6, 6))
    coef, bias = rng.standard_normal(2), rng.standard_normal(2)
    g = rng.standard_normal((2, 2, 3, 3))

    def loss(xv, cv, bv) -> float:
        mean = xv.reshape(2, 2, 3, k, 3, k).mean(axis=(3, 5))
        s = 1 / (1 + np.exp(-(mean * cv[:, None, None] + bv[:, None, None])))
        return float((s * g).sum())

    f32 = [cp.asarray(a.astype(np.float32)) for a in (x, g, coef, bias)]
    dx, dcoef, dbias = (a.get() for a in subsample_backward(f32[0], None, f32[1], f32[2],
                                                            f32[3], k))
    eps = 1e-6
    for c in range(2):
        e = np.zeros(2)
        e[c] = eps
        assert dcoef[c] == pytest.approx(
            (loss(x, coef + e, bias) - loss(x, coef - e, bias)) / (2 * eps), rel=1e-4, abs=1e-5)
        assert dbias[c] == pytest.approx(
            (loss(x, coef, bias + e) - loss(x, coef, bias - e)) / (2 * eps), rel=1e-4, abs=1e-5)
    for _ in range(5):
        i = tuple(int(rng.integers(0, n)) for n in x.shape)
        plus, minus = x.copy(), x.copy()
        plus[i] += eps
        minus[i] -= eps
        numeric = (loss(plus, coef, bias) - loss(minus, coef, bias)) / (2 * eps)
        assert dx[i] == pytest.approx(numeric, rel=1e-4, abs=1e-5)


def test_avgpool_backward_spreads_evenly(rng):
    import cupy as cp

    from convolab.gpu.backward import avgpool2d_backward
    from convolab.layers import AvgPool2d

    layer = AvgPool2d(3, 2)
    x = rng.standard_normal((2, 2, 9, 8)).astype(np.float32)
    dy = rng.standard_normal(layer.forward(x).shape).astype(np.float32)
    dx = avgpool2d_backward(cp.asarray(dy), x.shape, 3, 2)
    assert rel_l2(dx, layer.backward(dy)) <= FP32_TOL


# ----------------------------------------------------------------- determinism and training


def test_backward_is_bit_reproducible(rng):
    import cupy as cp

    from convolab.gpu.backward import conv2d_backward

    shape = C3.with_batch(64)
    x = cp.asarray(rng.standard_normal(shape.x_shape).astype(np.float32))
    w = cp.asarray(rng.standard_normal(shape.w_shape).astype(np.float32))
    dy = cp.asarray(rng.standard_normal(shape.y_shape).astype(np.float32))
    for method in ("direct", "gemm"):  # per-weight dW: same reduction pattern, no atomics
        first = conv2d_backward(x, w, dy, 1, method)
        again = conv2d_backward(x, w, dy, 1, method)
        for a, b in zip(first, again, strict=True):
            assert bool((a == b).all()), method


def test_short_gpu_training_run_lowers_the_loss(rng):
    """A few Adam steps of ece408 on the GPU on a learnable synthetic task (class = which
    quadrant is bright) must lower the loss: the backward's sign and scale are right."""
    import cupy as cp

    from convolab import models
    from convolab.network import CrossEntropyLoss
    from convolab.optim import Adam

    n = 128
    labels = rng.integers(0, 4, n)
    images = rng.uniform(0, 0.2, (n, *IMAGE)).astype(np.float32)
    half = IMAGE[1] // 2
    for i, label in enumerate(labels):
        r, c = divmod(int(label), 2)
        images[i, 0, r * half:(r + 1) * half, c * half:(c + 1) * half] += 0.8
    net = models.build("ece408", seed=int(rng.integers(0, 1000))).to("gpu").train()
    x, y = cp.asarray(images), cp.asarray(labels)
    optimizer = Adam(net, lr=3e-3)
    loss_fn = CrossEntropyLoss()
    losses = []
    for _ in range(25):
        loss, grad = loss_fn(net.logits(x), y)
        net.backward(grad)
        optimizer.step()
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < 0.5 * losses[0], losses


def test_gpu_training_is_bit_reproducible(rng):
    """Same seed, same batches, same GPU: two short training runs end with identical weights
    (no atomics anywhere in the step; cuBLAS and CuPy reductions run in a fixed order)."""
    import cupy as cp

    from convolab import models
    from convolab.network import CrossEntropyLoss
    from convolab.optim import Adam

    images = cp.asarray(rng.uniform(0, 1, (64, *IMAGE)).astype(np.float32))
    labels = cp.asarray(rng.integers(0, 10, 64))
    seed = int(rng.integers(0, 1000))

    def train_briefly() -> dict[str, np.ndarray]:
        net = models.build("ece408", seed=seed).to("gpu").train()
        optimizer, loss_fn = Adam(net, lr=1e-3), CrossEntropyLoss()
        for step in range(6):
            batch = slice(step % 2 * 32, step % 2 * 32 + 32)
            _, grad = loss_fn(net.logits(images[batch]), labels[batch])
            net.backward(grad)
            optimizer.step()
        return {k: cp.asnumpy(v) for k, v in net.params().items()}

    first, second = train_briefly(), train_briefly()
    for name, value in first.items():
        np.testing.assert_array_equal(second[name], value, err_msg=name)
