"""The trainer on a few hundred real Fashion-MNIST images: it learns, it is deterministic, and it
writes loadable weights with a sidecar."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convolab import data, models, train, weights
from convolab.errors import DataError


@pytest.fixture(scope="module", autouse=True)
def dataset_present() -> None:
    try:
        data.find_dataset()
    except DataError as err:
        pytest.skip(f"Fashion-MNIST not available here: {err}")


def run(tmp_path: Path, name: str, **kw) -> tuple[dict, Path]:
    out = tmp_path / f"{name}.safetensors"
    args = dict(model="ece408", epochs=1, batch=32, lr=2e-3, optimizer="adam", seed=7,
                device="cpu", limit=256, out=out, data_dir=None, quiet=True, test_limit=200)
    args.update(kw)
    return train.main(**args), out


def test_training_decreases_loss_and_writes_weights(tmp_path: Path) -> None:
    result, out = run(tmp_path, "a", epochs=2)
    first, second = result["history"]
    assert second["train_loss"] < first["train_loss"]
    assert second["test_accuracy"] > 0.3  # 10 classes: chance is 0.1
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["command"].startswith("convolab train --model ece408 --epochs 2")
    assert sidecar["seed"] == 7 and sidecar["test_accuracy"] == result["test_accuracy"]
    net = models.load("ece408", out)
    assert net.name == "ece408"


def test_training_is_deterministic(tmp_path: Path) -> None:
    _, a = run(tmp_path, "a", limit=512, batch=64)
    _, b = run(tmp_path, "b", limit=512, batch=64)
    _, c = run(tmp_path, "c", limit=512, batch=64, seed=8)
    ta, _ = weights.read(a)
    tb, _ = weights.read(b)
    tc, _ = weights.read(c)
    for k in ta:
        assert ta[k].tobytes() == tb[k].tobytes(), k
    assert not np.array_equal(ta["c1.weight"], tc["c1.weight"])


def test_sgd_and_other_models_train(tmp_path: Path) -> None:
    result, _ = run(tmp_path, "s", optimizer="sgd", lr=0.02, limit=128)
    assert np.isfinite(result["history"][0]["train_loss"])
    result, out = run(tmp_path, "m", model="ece408-mxnet", limit=64)
    assert models.load("ece408-mxnet", out).name == "ece408-mxnet"


def test_engine_choice_and_defaults() -> None:
    from convolab.errors import ConvolabError
    from convolab.gpu.trainer import RECIPE

    assert train.pick_engine(None, "gpu", "ece408") == "fused"
    assert train.pick_engine(None, "gpu", "eecs498") == "framework"
    assert train.pick_engine(None, "cpu", "ece408") == "framework"
    assert train.pick_engine("framework", "gpu", "ece408") == "framework"
    for engine, device, model in (("fused", "cpu", "ece408"), ("fused", "gpu", "eecs498"),
                                  ("turbo", "gpu", "ece408")):
        with pytest.raises(ConvolabError, match="engine"):
            train.pick_engine(engine, device, model)
    assert train.resolve_options("fused", None, None, None) == (RECIPE.epochs, RECIPE.batch,
                                                                 RECIPE.lr)
    defaults = train.FRAMEWORK_DEFAULTS
    assert train.resolve_options("framework", None, 32, None) == (defaults["epochs"], 32,
                                                                  defaults["lr"])
    line = train.command_line("ece408", 8, 256, 4e-3, "adam", 0, "gpu", None, Path("w.st"),
                              "fused")
    assert "--engine fused" in line and line.startswith("convolab train --model ece408")


def test_speedrun_needs_the_fused_engine(tmp_path: Path) -> None:
    from convolab.errors import ConvolabError

    with pytest.raises(ConvolabError, match="speedrun"):
        run(tmp_path, "s", speedrun=True)


def test_recipe_options_belong_to_the_fused_engine(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from convolab.cli import app
    from convolab.errors import ConvolabError

    train.check_recipe_options("fused", 0.1, True)
    train.check_recipe_options("framework", None, None)
    for smoothing in (-0.1, 1.0, float("nan")):
        with pytest.raises(ConvolabError, match="smoothing"):
            train.check_recipe_options("fused", smoothing, None)
    with pytest.raises(ConvolabError, match="fused engine"):
        run(tmp_path, "m", mirror=True)  # the CPU trains with the framework engine
    out = tmp_path / "never.safetensors"
    result = CliRunner().invoke(app, ["train", "--device", "cpu", "--smoothing", "0.1",
                                      "--out", str(out)])
    # the command refuses before loading anything (cli.main prints it as one `error:` line)
    assert isinstance(result.exception, ConvolabError)
    assert "fused engine" in str(result.exception)
    assert not out.exists()
