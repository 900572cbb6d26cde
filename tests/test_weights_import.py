"""Weights from elsewhere: tag-less safetensors and PyTorch state_dicts whose names and
shapes fit a zoo model load; everything that does not fit is named in one message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from convolab import models, weights
from convolab.errors import WeightsError


def _tensors(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(v).astype(np.float32)
            for k, v in models.param_shapes(name).items()}


def test_untagged_safetensors_load_when_they_fit(tmp_path: Path,
                                                 rng: np.random.Generator) -> None:
    tensors = _tensors("ece408", rng)
    path = tmp_path / "from_torch.safetensors"
    save_file(tensors, str(path))  # no metadata at all, as torch's safetensors writer leaves it
    network = models.load("ece408", path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(network.params()[k], v)
    assert weights.identify(path) == "ece408"


def test_every_mismatch_in_one_message(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = _tensors("ece408", rng)
    tensors.pop("f6.bias")
    tensors["conv1.weight"] = tensors.pop("c1.weight")
    tensors["c3.bias"] = np.zeros(3, np.float32)
    path = tmp_path / "odd.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(WeightsError) as err:
        models.load("ece408", path)
    message = str(err.value)
    for needle in ("missing tensors ['c1.weight', 'f6.bias']", "unexpected tensors "
                   "['conv1.weight']", "c3.bias has shape (3,), the model needs (16,)"):
        assert needle in message, message
    with pytest.raises(WeightsError, match="fits none of the zoo models"):
        weights.identify(path)


def test_tag_when_present_is_still_checked(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "tagged.safetensors"
    save_file(_tensors("ece408", rng), str(path), metadata={"model": "eecs498"})
    with pytest.raises(WeightsError, match="holds model 'eecs498'"):
        models.load("ece408", path)


def test_non_finite_still_refused(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = _tensors("ece408", rng)
    tensors["f5.weight"][0, 0] = np.nan
    path = tmp_path / "nan.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match="f5.weight holds NaN or Inf"):
        models.load("ece408", path)


def test_pytorch_state_dict(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "model.pt"
    try:
        import torch
    except ModuleNotFoundError:
        path.write_bytes(b"PK not really")
        with pytest.raises(WeightsError, match="needs torch"):
            models.load("ece408", path)
        return
    tensors = _tensors("ece408", rng)
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, path)
    network = models.load("ece408", path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(network.params()[k], v)
    torch.save({"c1.weight": torch.zeros(2)}, path)
    with pytest.raises(WeightsError, match="missing tensors"):
        models.load("ece408", path)
