"""Weights on disk: safetensors with the model name and convolab version in the metadata.

Loading checks the model name and every tensor's name and shape before touching the network,
so a file that does not fit gives one WeightsError naming the file and the problem."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from convolab import __version__
from convolab.backend import to_numpy, xp_of
from convolab.errors import WeightsError
from convolab.network import Network
from convolab.outputs import write_atomic


def save(network: Network, path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
         ) -> Path:
    """Write the network's parameters atomically (temp file in the same folder + os.replace),
    with the user's normal file mode; parameters holding NaN/Inf are refused."""
    from safetensors.numpy import save as to_bytes

    path = Path(path)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update(model=network.name, convolab_version=__version__)
    tensors = {k: np.ascontiguousarray(to_numpy(v), dtype=np.float32)
               for k, v in network.params().items()}
    bad = [k for k, v in tensors.items() if not np.isfinite(v).all()]
    if bad:
        raise WeightsError(f"not writing {path}: {', '.join(bad)} hold NaN or Inf")
    return write_atomic(path, to_bytes(tensors, metadata=meta))


TORCH_SUFFIXES = (".pt", ".pth")


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as err:  # safetensors raises its own types for truncated/garbled files
        raise WeightsError(
            f"weights file {path} is not a readable safetensors file: {err}") from None
    return tensors, meta


def _read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """A PyTorch state_dict saved with torch.save, read with weights_only=True (no code runs)."""
    try:
        import torch
    except ModuleNotFoundError:
        raise WeightsError(f"weights file {path} is a PyTorch file: reading it needs torch "
                           "(pip install torch), or save it as safetensors instead") from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle/zip errors, or objects weights_only refuses
        raise WeightsError(f"weights file {path} is not a readable PyTorch state_dict: "
                           f"{err}") from None
    if not isinstance(state, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"weights file {path} holds a {type(state).__name__}, not a "
                           "state_dict (a mapping of names to tensors)")
    return {str(k): v.detach().cpu().contiguous().numpy() for k, v in state.items()}


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of a safetensors file or a PyTorch state_dict (`.pt`/`.pth`, no
    metadata); WeightsError if it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist")
    if path.suffix.lower() in TORCH_SUFFIXES:
        return _read_state_dict(path), {}
    return _read_safetensors(path)


def mismatches(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
               ) -> list[str]:
    """Every way `tensors` fails to fit parameters of `shapes`: missing, unexpected,
    mis-shaped, not float32, non-finite (empty when it fits)."""
    problems = []
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    for name in sorted(set(shapes) & set(tensors)):
        want, got = tuple(shapes[name]), tuple(tensors[name].shape)
        if want != got:
            problems.append(f"{name} has shape {got}, the model needs {want}")
        elif tensors[name].dtype != np.float32:
            problems.append(f"{name} is {tensors[name].dtype}, expected float32")
        elif not np.isfinite(tensors[name]).all():
            problems.append(f"{name} holds NaN or Inf")
    return problems


def identify(path: str | os.PathLike) -> str:
    """The zoo model a weights file is for: its `model` metadata tag, or else the one model
    whose parameter names and shapes it matches."""
    from convolab.models import MODELS, param_shapes

    tensors, meta = read(path)
    if "model" in meta:
        if meta["model"] not in MODELS:
            raise WeightsError(f"weights file {path} is tagged for model {meta['model']!r}, "
                               f"which is not in the zoo ({', '.join(MODELS)})")
        return meta["model"]
    names = set(tensors)
    for name in MODELS:
        shapes = param_shapes(name)
        if set(shapes) == names and all(
                tuple(tensors[k].shape) == v for k, v in shapes.items()):
            return name
    held = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items())
    raise WeightsError(f"weights file {path} fits none of the zoo models "
                       f"({', '.join(MODELS)}): it holds {held}")


def load_into(network: Network, path: str | os.PathLike) -> dict[str, str]:
    """Check `path` fits `network` exactly, then copy its tensors in; returns the metadata.

    A file without convolab's `model` metadata tag (saved by torch, say) loads when its
    tensor names and shapes fit; a tag that names another model is refused."""
    tensors, meta = read(path)
    params = network.params()
    problems = []
    if "model" in meta and meta["model"] != network.name:
        problems.append(f"it holds model {meta['model']!r}, not {network.name!r}")
    problems += mismatches(tensors, {k: tuple(v.shape) for k, v in params.items()})
    if problems:
        raise WeightsError(f"weights file {path} does not fit model {network.name!r}: "
                           + "; ".join(problems))
    for name, current in params.items():
        xp = xp_of(current)
        network.set_param(name, xp.ascontiguousarray(xp.asarray(tensors[name]), dtype=np.float32))
    return meta
