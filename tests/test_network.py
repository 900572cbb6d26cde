"""Network, optimizers, model zoo and weights files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convolab import models, weights
from convolab.errors import WeightsError
from convolab.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Softmax
from convolab.network import CrossEntropyLoss, Network
from convolab.optim import SGD, Adam, cosine_lr


def small_network(rng: np.random.Generator) -> Network:
    net = Network([Conv2d(1, 2, 3, stride=2, name="c1"), ReLU(), MaxPool2d(2), Flatten(),
                   Linear(8, 3, name="f"), Softmax()], "tiny")
    for name, p in net.params().items():
        net.set_param(name, rng.standard_normal(p.shape))
    return net


def test_network_gradient_matches_finite_differences(rng: np.random.Generator) -> None:
    net = small_network(rng)
    x, y = rng.standard_normal((3, 1, 11, 11)), rng.integers(0, 3, 3)
    loss_fn = CrossEntropyLoss()
    _, g = loss_fn(net.logits(x), y)
    net.backward(g)
    grads = net.grads()
    for name, p in net.params().items():
        num = np.zeros_like(p)
        for i in np.ndindex(p.shape):
            old = p[i]
            p[i] = old + 1e-6
            hi = loss_fn(net.logits(x), y)[0]
            p[i] = old - 1e-6
            lo = loss_fn(net.logits(x), y)[0]
            p[i] = old
            num[i] = (hi - lo) / 2e-6
        np.testing.assert_allclose(grads[name], num, rtol=1e-5, atol=1e-8, err_msg=name)


def test_forward_is_softmax_of_logits_and_predict(rng: np.random.Generator) -> None:
    net = small_network(rng)
    x = rng.standard_normal((5, 1, 11, 11))
    logits, probs = net.logits(x), net.forward(x)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0)
    np.testing.assert_array_equal(probs.argmax(axis=1), logits.argmax(axis=1))
    net.to("cpu")  # float32 from here on
    x32 = rng.random((5, 1, 11, 11), dtype=np.float32)  # predict takes pixels in [0, 1]
    np.testing.assert_array_equal(net.predict(x32, batch=2), net.logits(x32).argmax(axis=1))
    assert net.layers[0].training  # predict restores the mode it found


class Quadratic(Network):
    """A 'network' whose one parameter's gradient is A (p - t): the optimizers' test bed."""

    def __init__(self, a: np.ndarray, t: np.ndarray) -> None:
        lin = Linear(len(t), 1, bias=False, name="q")
        lin.weight = np.zeros((1, len(t)))
        super().__init__([lin], "quadratic")
        self.a, self.t = a, t

    def compute_grad(self) -> None:
        lin = self.layers[0]
        lin._grads["weight"] = (lin.weight - self.t) * self.a


@pytest.mark.parametrize("make", [lambda n: SGD(n, lr=0.1, momentum=0.9),
                                  lambda n: SGD(n, lr=0.1, momentum=0.0),
                                  lambda n: Adam(n, lr=0.05)])
def test_optimizers_minimise_a_quadratic(make) -> None:
    t = np.array([1.0, -2.0, 3.0])
    q = Quadratic(np.array([1.0, 2.0, 0.5]), t)
    opt = make(q)
    for _ in range(500):
        q.compute_grad()
        opt.step()
    np.testing.assert_allclose(q.layers[0].weight[0], t, atol=1e-3)


def test_first_steps_are_exact() -> None:
    q = Quadratic(np.ones(2), np.array([1.0, 1.0]))  # gradient at 0 is -1 per element
    opt = SGD(q, lr=0.1, momentum=0.5)
    q.compute_grad()
    opt.step()  # v = -1, p = 0.1
    q.compute_grad()
    opt.step()  # g = -0.9, v = -0.5 - 0.9 = -1.4, p = 0.1 + 0.14
    np.testing.assert_allclose(q.layers[0].weight, 0.24)
    q = Quadratic(np.ones(2), np.array([1.0, 1.0]))
    opt = Adam(q, lr=0.01)
    q.compute_grad()
    opt.step()  # the bias-corrected first Adam step is lr * sign(g)
    np.testing.assert_allclose(q.layers[0].weight, 0.01, rtol=1e-6)


def test_cosine_schedule() -> None:
    assert cosine_lr(1.0, 0, 100) == 1.0
    assert np.isclose(cosine_lr(1.0, 50, 100), 0.5)
    assert np.isclose(cosine_lr(1.0, 100, 100, min_lr=0.1), 0.1)
    assert np.isclose(cosine_lr(1.0, 4, 100, warmup_steps=10), 0.5)


@pytest.mark.parametrize("name", list(models.MODELS))
def test_zoo_shapes(name: str, rng: np.random.Generator) -> None:
    spec = models.spec(name)
    net = models.build(name, seed=1)
    x = rng.random((2, 1, spec.input_size, spec.input_size), np.float32)
    probs = net.forward(x)
    assert probs.shape == (2, 10) and probs.dtype == np.float32
    assert all(v.dtype == np.float32 for v in net.params().values())


def test_ece408_layer_table() -> None:
    """models.py against the course's LeNet-5 table (docs/spec.md, Network): the one test
    that states these shapes; everything else takes them from models.py."""
    assert models.param_shapes("ece408") == {
        "c1.weight": (4, 1, 7, 7), "c1.bias": (4,), "c3.weight": (16, 4, 7, 7), "c3.bias": (16,),
        "f5.weight": (32, 1024), "f5.bias": (32,), "f6.weight": (10, 32), "f6.bias": (10,)}


def test_build_is_seeded_and_unknown_model_is_clear() -> None:
    a, b, c = models.build("ece408", 3), models.build("ece408", 3), models.build("ece408", 4)
    assert all(np.array_equal(a.params()[k], b.params()[k]) for k in a.params())
    assert not np.array_equal(a.params()["c1.weight"], c.params()["c1.weight"])
    with pytest.raises(ValueError, match="known models: ece408, ece408-mxnet, eecs498"):
        models.build("resnet")


def test_weights_round_trip(tmp_path: Path) -> None:
    net = models.build("ece408", seed=5)
    path = weights.save(net, tmp_path / "w.safetensors", {"note": "x"})
    assert not [p for p in tmp_path.iterdir() if p.name != "w.safetensors"]  # no temp left
    other = models.build("ece408", seed=6)
    meta = weights.load_into(other, path)
    assert meta["model"] == "ece408" and meta["note"] == "x" and "convolab_version" in meta
    for k, v in net.params().items():
        np.testing.assert_array_equal(other.params()[k], v)
    loaded = models.load("ece408", path)
    assert not loaded.layers[0].training


def test_weights_mismatch_is_one_clear_error(tmp_path: Path) -> None:
    path = weights.save(models.build("eecs498"), tmp_path / "x.safetensors")
    with pytest.raises(WeightsError, match=r"x\.safetensors.*holds model 'eecs498'"):
        weights.load_into(models.build("ece408"), path)
    # Same name, wrong shapes: a network that claims to be ece408 but is not.
    fake = Network([Conv2d(1, 5, 7, name="c1")], "ece408")
    weights.save(fake, path)
    with pytest.raises(WeightsError, match=r"missing tensors.*c1.weight has shape \(5, 1, 7, 7\)"):
        weights.load_into(models.build("ece408"), path)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match="not a readable"):
        weights.load_into(models.build("ece408"), path)


def test_missing_shipped_weights_say_how_to_train(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(WeightsError, match="convolab train --model ece408"):
        models.load("ece408")


# Images whose predicted class may differ from training's evaluation: the recorded accuracy
# is rounded to 4 digits, and a CPU convolution summing in another order can flip a near tie.
ACCURACY_SLACK_IMAGES = 2


@pytest.mark.parametrize("file", sorted(models.WEIGHTS_DIR.glob("*.safetensors")),
                         ids=lambda f: f.stem)
def test_shipped_weights_have_their_accuracy(file: Path) -> None:
    """Each shipped network, run on the CPU over the test images its JSON says it was
    evaluated on, reaches the test accuracy recorded there."""
    from convolab import data
    from convolab.errors import DataError

    sidecar = json.loads(file.with_suffix(".json").read_text())
    name, n = file.stem, int(sidecar["test_images"])
    assert sidecar["model"] == name
    try:
        x, y = data.load_images("test", n=n, size=models.spec(name).input_size)
    except DataError as err:
        pytest.skip(f"Fashion-MNIST not available here: {err}")
    assert len(y) == n
    net = models.load(name)
    assert net.name == name
    accuracy = float((net.predict(x) == y).mean())
    recorded = float(sidecar["test_accuracy"])
    assert abs(accuracy - recorded) <= ACCURACY_SLACK_IMAGES / n + 5e-5, (accuracy, recorded)


def test_shipped_ece408_beats_the_course_on_1000_test_images() -> None:
    from convolab import data
    from convolab.errors import DataError

    if not models.weights_path("ece408").is_file():
        pytest.skip("no shipped ece408 weights yet")
    try:
        x, y = data.load_images("test", n=1000)
    except DataError as err:
        pytest.skip(f"Fashion-MNIST not available here: {err}")
    accuracy = float((models.load("ece408").predict(x) == y).mean())
    assert accuracy >= 0.886, accuracy  # the course's reference on the first 1000 images
