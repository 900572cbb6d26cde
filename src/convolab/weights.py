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


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of a safetensors file; WeightsError if it cannot be read."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as err:  # safetensors raises its own types for truncated/garbled files
        raise WeightsError(
            f"weights file {path} is not a readable safetensors file: {err}") from None
    return tensors, meta


def load_into(network: Network, path: str | os.PathLike) -> dict[str, str]:
    """Check `path` fits `network` exactly, then copy its tensors in; returns the metadata."""
    tensors, meta = read(path)
    problems = []
    if meta.get("model") != network.name:
        problems.append(f"it holds model {meta.get('model')!r}, not {network.name!r}")
    params = network.params()
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    for name in sorted(set(params) & set(tensors)):
        want, got = tuple(params[name].shape), tuple(tensors[name].shape)
        if want != got:
            problems.append(f"{name} has shape {got}, the model needs {want}")
        elif tensors[name].dtype != np.float32:
            problems.append(f"{name} is {tensors[name].dtype}, expected float32")
        elif not np.isfinite(tensors[name]).all():
            problems.append(f"{name} holds NaN or Inf")
    if problems:
        raise WeightsError(f"weights file {path} does not fit model {network.name!r}: "
                           + "; ".join(problems))
    for name, current in params.items():
        xp = xp_of(current)
        network.set_param(name, xp.ascontiguousarray(xp.asarray(tensors[name]), dtype=np.float32))
    return meta
