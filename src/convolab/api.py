"""The library API (`convolab.conv2d`, `convolab.load_model`, ...): docs/library.md.

Every function takes NumPy, CuPy or any DLPack array (torch, JAX) and answers with the
caller's kind of array; float64/float16 inputs are converted to float32 (a copy), everything
else that is wrong is one ConvolabError (InputError / InputTypeError / WeightsError).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from convolab.errors import ConvolabError, InputError, InputTypeError, WeightsError
from convolab.interop import Kind, as_array, same_device, to_xp
from convolab.network import PREDICT_BATCH
from convolab.shapes import positive_int

# What impl="auto" means on the CPU: the fastest CPU implementation first (docs/library.md).
CPU_AUTO: tuple[str, ...] = ("cpu-fused", "cpu-im2col")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth")


class ImplInfo(NamedTuple):
    name: str
    device: str
    demonstrates: str


def list_impls(device: str | None = None) -> list[ImplInfo]:
    """Every registered convolution implementation (CPU first, then the GPU ladder), or those
    of one device ('cpu' or 'gpu'); GPU ones are listed even where no GPU is usable."""
    from convolab.registry import all_impls

    if device not in (None, "cpu", "gpu"):
        raise InputError(f"device must be 'cpu', 'gpu' or None, got {device!r}")
    return [ImplInfo(i.name, i.device, i.demonstrates) for i in all_impls(device)]



def _operands(x: Any, w: Any, b: Any) -> tuple[Any, Any, Any, Kind]:
    x, kind = to_xp(x, "x", ndim=4)
    w, wkind = to_xp(w, "w", ndim=4)
    same_device(kind, wkind, "w")
    if b is not None:
        b, bkind = to_xp(b, "b", ndim=1)
        same_device(kind, bkind, "b")
    return x, w, b, kind


def _impl(name: str, device: str, pool: int = 0) -> Any:
    """The registry entry for `name` ('auto' resolved per device), checked against the device."""
    from convolab.registry import get_impl

    if name == "auto":
        if device == "gpu":
            if pool:
                from convolab.gpu.fused import fused_conv_pool_impl

                return fused_conv_pool_impl(pool, "fp32")
            return get_impl("auto")
        return get_impl(CPU_AUTO[0])
    try:
        impl = get_impl(name)
    except KeyError as err:
        raise InputError(err.args[0]) from None
    if impl.device != device:
        raise InputError(f"implementation {name!r} runs on the {impl.device.upper()}, but the "
                         f"arrays are on the {device.upper()}")
    return impl


def _run(impl: Any, x: Any, w: Any, b: Any, stride: int) -> Any:
    try:
        return impl.forward(x, w, b, stride)
    except ConvolabError:
        raise
    except (ValueError, TypeError) as err:  # the registry's own checks: one clear message
        raise InputError(f"{impl.name}: {err}") from None


def conv2d(x: Any, w: Any, b: Any = None, stride: int = 1, impl: str = "auto") -> Any:
    """y = conv(x, w) + b, valid padding: x (B, C, H, W), w (M, C, K, K), b (M,) or None.

    impl: a registry name (`list_impls()`), or 'auto': on the GPU the tuned `auto` rung, on
    the CPU `cpu-fused`. float64/float16 arrays are converted to float32 (a copy); the result
    is float32, of the caller's kind (torch in, torch out)."""
    x, w, b, kind = _operands(x, w, b)
    stride = positive_int(stride, "stride")
    chosen = _impl(impl, kind.device)
    if chosen.pool:
        raise InputError(f"{chosen.name!r} fuses ReLU and pooling: use conv2d_relu_pool")
    return kind.back(_run(chosen, x, w, b, stride))


def _relu_pool(y: Any, pool: int) -> Any:
    """max-pool (window = stride = pool, floor) of ReLU(y); NaN propagates like the kernels."""
    from convolab.backend import xp_of

    xp = xp_of(y)
    B, M, H, W = y.shape
    hp, wp = H // pool, W // pool
    windows = y[:, :, :hp * pool, :wp * pool].reshape(B, M, hp, pool, wp, pool)
    return xp.ascontiguousarray(xp.maximum(windows.max(axis=(3, 5)), np.float32(0)))


def conv2d_relu_pool(x: Any, w: Any, b: Any = None, stride: int = 1, pool: int = 2,
                     impl: str = "auto") -> Any:
    """maxpool(relu(conv2d(x, w, b, stride)), pool): pool window = pool stride, floor.

    impl 'auto': the fused conv+ReLU+pool kernel (GPU rung 13 fp32, `cpu-fused`'s pooled
    kernel on the CPU); a plain conv implementation is followed by ReLU and pooling."""
    x, w, b, kind = _operands(x, w, b)
    stride, pool = positive_int(stride, "stride"), positive_int(pool, "pool")
    from convolab.shapes import ConvShape

    shape = ConvShape.of(x.shape, w.shape, stride)
    if shape.H_out < pool or shape.W_out < pool:
        raise InputError(f"pool {pool} is larger than the conv output "
                         f"{shape.H_out}x{shape.W_out}")
    if impl == "auto" and kind.device == "cpu":
        from convolab.conv_cpu import conv_relu_pool_cpu

        return kind.back(conv_relu_pool_cpu(x, w, b, stride, pool))
    chosen = _impl(impl, kind.device, pool)
    if chosen.pool not in (0, pool):
        raise InputError(f"{chosen.name!r} pools {chosen.pool}x{chosen.pool}, not {pool}x{pool}")
    if chosen.pool and not chosen.supports(shape):
        chosen = _impl("auto", kind.device)  # a shape the fused kernel was not built for
    y = _run(chosen, x, w, b, stride)
    return kind.back(y if chosen.pool else _relu_pool(y, pool))


# --------------------------------------------------------------------------- models


def _device(device: str | None) -> str:
    from convolab.backend import gpu_available

    if device is None:
        return "gpu" if gpu_available() else "cpu"
    if device not in ("cpu", "gpu"):
        raise InputError(f"device must be 'cpu', 'gpu' or None, got {device!r}")
    if device == "gpu" and not gpu_available():
        raise ConvolabError("device='gpu': no CUDA GPU is usable here (CuPy missing or no "
                            "device); use device='cpu'")
    return device


def _network(name_or_path: str | os.PathLike, weights: str | os.PathLike | None) -> Any:
    from convolab import models
    from convolab import weights as weights_io

    key = os.fspath(name_or_path)
    if key in models.MODELS:
        return models.load(key, weights)
    path = Path(key)
    if weights is not None:
        raise InputError("weights= goes with a zoo model name; a file path already is the "
                         "weights")
    if path.suffix.lower() == ".onnx":
        if not path.is_file():
            raise WeightsError(f"ONNX file {path} does not exist")
        from convolab.onnx_io import network_from_onnx

        return network_from_onnx(path)
    if path.suffix.lower() in WEIGHT_SUFFIXES:
        return models.load(weights_io.identify(path), path)
    raise InputError(f"{key!r} is neither a zoo model ({', '.join(models.MODELS)}) nor a "
                     f"weights file ({', '.join(WEIGHT_SUFFIXES)}, .onnx)")


def load_model(name_or_path: str | os.PathLike, weights: str | os.PathLike | None = None,
               device: str | None = None, mode: str = "exact") -> Model:
    """A trained model ready to classify.

    name_or_path: a zoo model ('ece408', 'ece408-mxnet', 'eecs498') with its shipped weights
    or `weights` (safetensors or a PyTorch state_dict file); a weights file alone (the zoo
    model its tensor names and shapes fit); or an `.onnx` file. device: 'cpu', 'gpu' or None
    (the GPU if usable). mode: the GPU fused network's precision (exact, tf32, fp16)."""
    from convolab import precision

    dev = _device(device)
    try:
        network_mode = precision.network_mode(mode)
    except ValueError as err:
        raise InputError(str(err)) from None
    return Model(_network(name_or_path, weights).eval(), dev, network_mode)


@dataclass
class Model:
    """A network on one device: `model(x)` gives class probabilities (B, classes), and
    `model.predict(x)` class indices (B,), both as the caller's kind of array.

    x: images (B, C, H, W), floating point scaled to [0, 1], or raw uint8 images (B, h, w)
    as an image file holds them (a zoo model resizes them to its input size with
    `data.resize_bilinear`'s rule — on the GPU inside the first conv kernel, so only the bytes
    travel). A host array is copied to the GPU for a GPU model (the result comes back to the
    host); a GPU array given to a CPU model is refused."""

    network: Any
    device: str
    mode: str = "exact"

    def __post_init__(self) -> None:
        from convolab import models

        self.name = self.network.name
        spec = models.MODELS.get(self.name)
        self.input_shape = (1, spec.input_size, spec.input_size) if spec else None
        self._fused = None
        if self.device == "gpu":
            self.network.to("gpu")
            if spec is not None:
                from convolab.gpu.network import FusedLeNet

                self._fused = FusedLeNet(self.network.params(), mode=self.mode,
                                         model=self.name)

    def _images(self, x: Any) -> tuple[Any, Kind]:
        raw, kind = as_array(x, "images")
        if raw.ndim == 3:
            if raw.dtype != np.uint8:
                raise InputTypeError(f"3-D images (B, H, W) are raw bytes and must be uint8, got "
                                     f"{raw.dtype}; float images are (B, C, H, W)")
            return self._raw_images(raw, kind), kind
        arr, kind = to_xp(x, "images", ndim=4)
        if self.input_shape is not None and tuple(arr.shape[1:]) != self.input_shape:
            raise InputError(f"model {self.name!r} takes images of shape (B, "
                             f"{', '.join(map(str, self.input_shape))}), got "
                             f"{tuple(arr.shape)}")
        if kind.device != self.device:
            if self.device == "cpu":
                raise InputError(f"model {self.name!r} is on the CPU but the images are on "
                                 "the GPU: load it with device='gpu', or pass host arrays")
            from convolab.backend import require_cupy

            arr = require_cupy().asarray(arr)
        low, high = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
        if not (low >= 0.0 and high <= 1.0):
            raise InputError(f"model {self.name!r} expects pixels scaled to [0, 1], got values "
                             f"in [{low:g}, {high:g}]; divide 0..255 pixels by 255")
        return arr, kind

    def _raw_images(self, raw: Any, kind: Kind) -> Any:
        """Raw bytes as the fused network takes them (host or device, unresized), or resized
        to the model's input where the layers run one by one."""
        if self.input_shape is None:
            raise InputError(f"model {self.name!r} has no input size to resize raw images to: "
                             "pass float images (B, C, H, W) scaled to [0, 1]")
        if kind.device == "gpu" and self.device == "cpu":
            raise InputError(f"model {self.name!r} is on the CPU but the images are on the GPU: "
                             "load it with device='gpu', or pass host arrays")
        if self._fused is not None:
            return raw
        from convolab.data import resize_bilinear

        size = self.input_shape[-1]
        if kind.device == "gpu":
            from convolab.gpu.resize import resize_u8

            return resize_u8(raw, size)
        resized = resize_bilinear(raw, size)
        if self.device == "gpu":
            from convolab.backend import require_cupy

            return require_cupy().asarray(resized)
        return resized

    def _answer(self, result: Any, kind: Kind) -> Any:
        from convolab.backend import to_numpy

        if kind.device == "cpu":
            result = to_numpy(result)
        return kind.back(result)

    def _probs(self, arr: Any, batch: int) -> Any:
        if self._fused is not None:
            if isinstance(arr, np.ndarray):  # raw host bytes: streamed, resized on the GPU
                return self._fused.forward_chunks(arr, chunk=max(1, min(batch, len(arr))))
            return self._fused(arr)
        from convolab.backend import xp_of

        xp = xp_of(arr)
        parts = [self.network.forward(arr[i:i + batch]) for i in range(0, len(arr), batch)]
        return xp.concatenate(parts) if parts else xp.zeros((0, 10), np.float32)

    def __call__(self, x: Any, batch: int = PREDICT_BATCH) -> Any:
        """Class probabilities (B, classes), float32, computed `batch` images at a time."""
        batch = positive_int(batch, "batch")
        arr, kind = self._images(x)
        return self._answer(self._probs(arr, batch), kind)

    def predict(self, x: Any, batch: int = PREDICT_BATCH) -> Any:
        """Predicted class index of every image (B,), int64, `batch` images at a time."""
        batch = positive_int(batch, "batch")
        arr, kind = self._images(x)
        if self._fused is None and self.device == "cpu":
            return self._answer(self.network.predict(arr, batch=batch), kind)
        return self._answer(self._probs(arr, batch).argmax(axis=1).astype(np.int64), kind)

    def __repr__(self) -> str:
        path = f"fused {self.mode}" if self._fused is not None else "layers"
        return f"Model({self.name!r}, device={self.device!r}, {path})"
