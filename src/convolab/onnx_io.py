"""ONNX in and out: a convolab Network as an ONNX graph, and LeNet-class ONNX graphs as Networks.

Export writes the layers one node each (Conv, Relu, MaxPool, AveragePool, Flatten, Gemm with
transB=1, Softmax), weights as initializers named like `Network.params()`, a dynamic batch
dimension, checked by `onnx.checker` before the file is written atomically.

Import accepts a chain of nodes, each reading the previous one's output, and maps it onto
convolab's layers; weights come from initializers or Constant nodes. Anything the layers
cannot compute exactly (padding, dilation, groups, ceil mode, a non-chain graph, an op with no
layer) is one ConvolabError naming the node and the reason. When the layers and their shapes
are those of a zoo model, the parameters take that model's names (c1.weight, ...), so the zoo's
fused GPU network and weights files take them as they are.

onnx (and onnxruntime, for the checks) is the optional extra `convolab[onnx]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convolab import __version__
from convolab.backend import to_numpy
from convolab.errors import ConvolabError
from convolab.layers import AvgPool2d, Conv2d, Flatten, Layer, Linear, MaxPool2d, ReLU, Softmax
from convolab.network import Network
from convolab.outputs import write_atomic
from convolab.shapes import positive_int

INPUT_NAME = "images"
PROBS_NAME = "probabilities"
LOGITS_NAME = "logits"
BATCH_DIM = "N"
MIN_OPSET = 13  # Softmax over the last axis only (opset 13 semantics), Reshape allowzero
SUPPORTED_OPS = ("Conv", "Relu", "MaxPool", "AveragePool", "Gemm", "MatMul", "Add", "Flatten",
                 "Reshape", "Softmax", "Identity", "Dropout", "Constant")
EXTRA_HINT = "pip install 'convolab[onnx]'"


def require_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ConvolabError(f"ONNX support needs the onnx package: {EXTRA_HINT}") from None
    return onnx


# ----------------------------------------------------------------------------- export


@dataclass
class _Builder:
    """The graph being written: nodes, initializers, the current tensor and its shape."""

    onnx: Any
    shape: tuple[int, ...]  # one image's shape: (C, H, W), or (features,) after Flatten
    tensor: str = INPUT_NAME
    nodes: list[Any] = field(default_factory=list)
    inits: list[Any] = field(default_factory=list)

    def add(self, op: str, name: str, params: dict[str, np.ndarray], **attrs: Any) -> None:
        inputs = [self.tensor]
        for key, value in params.items():
            full = f"{name}.{key}"
            self.inits.append(self.onnx.numpy_helper.from_array(
                np.ascontiguousarray(to_numpy(value), dtype=np.float32), full))
            inputs.append(full)
        out = f"{name}_out"
        self.nodes.append(self.onnx.helper.make_node(op, inputs, [out], name=name, **attrs))
        self.tensor = out


def _export_window(b: _Builder, layer: Layer, k: int, stride: int) -> tuple[int, int]:
    c, h, w = _need_map(b.shape, layer)
    if h < k or w < k:
        raise ConvolabError(f"export: layer {layer.name!r}: its {k}x{k} window does not fit "
                            f"the {h}x{w} input")
    return (h - k) // stride + 1, (w - k) // stride + 1


def _need_map(shape: tuple[int, ...], layer: Layer) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ConvolabError(f"export: layer {layer.name!r} needs a (C, H, W) input, "
                            f"got features {shape}")
    return shape  # type: ignore[return-value]


def _export_conv(b: _Builder, layer: Conv2d, name: str) -> None:
    c = _need_map(b.shape, layer)[0]
    if c != layer.in_channels:
        raise ConvolabError(f"export: layer {layer.name!r} takes {layer.in_channels} channels, "
                            f"its input has {c}")
    k, s = layer.kernel_size, layer.stride
    ho, wo = _export_window(b, layer, k, s)
    b.add("Conv", name, layer.params(), kernel_shape=[k, k], strides=[s, s],
          pads=[0, 0, 0, 0], dilations=[1, 1], group=1)
    b.shape = (layer.out_channels, ho, wo)


def _export_pool(b: _Builder, layer: MaxPool2d | AvgPool2d, name: str) -> None:
    if isinstance(layer, AvgPool2d) and layer.subsample:
        raise ConvolabError(f"export: layer {layer.name!r} is a trainable subsampling "
                            "AvgPool2d (sigmoid(w * mean + b)); ONNX export takes plain "
                            "average pooling only")
    k, s = layer.kernel_size, layer.stride
    ho, wo = _export_window(b, layer, k, s)
    op = "MaxPool" if isinstance(layer, MaxPool2d) else "AveragePool"
    b.add(op, name, {}, kernel_shape=[k, k], strides=[s, s], pads=[0, 0, 0, 0])
    b.shape = (b.shape[0], ho, wo)


def _export_linear(b: _Builder, layer: Linear, name: str) -> None:
    if len(b.shape) != 1 or b.shape[0] != layer.in_features:
        raise ConvolabError(f"export: layer {layer.name!r} takes {layer.in_features} features, "
                            f"its input has shape {b.shape}")
    b.add("Gemm", name, layer.params(), transB=1)
    b.shape = (layer.out_features,)


def _export_layer(b: _Builder, layer: Layer, name: str) -> None:
    if isinstance(layer, Conv2d):
        _export_conv(b, layer, name)
    elif isinstance(layer, MaxPool2d | AvgPool2d):
        _export_pool(b, layer, name)
    elif isinstance(layer, Linear):
        _export_linear(b, layer, name)
    elif isinstance(layer, ReLU):
        b.add("Relu", name, {})
    elif isinstance(layer, Flatten):
        _need_map(b.shape, layer)
        b.add("Flatten", name, {}, axis=1)
        b.shape = (int(np.prod(b.shape)),)
    elif isinstance(layer, Softmax):
        b.add("Softmax", name, {}, axis=-1)
    else:
        raise ConvolabError(f"export: layer {layer.name!r} ({type(layer).__name__}) has no "
                            "ONNX mapping")


def to_onnx_model(network: Network, input_size: int, opset: int = 17) -> Any:
    """The network as a checked onnx.ModelProto (what `export_onnx` writes)."""
    onnx = require_onnx()
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise ConvolabError(f"--opset must be between {MIN_OPSET} and {newest}, got {opset}")
    input_size = positive_int(input_size, "export: input size")
    first = next((la for la in network.layers if isinstance(la, Conv2d)), None)
    channels = first.in_channels if first is not None else 1
    b = _Builder(onnx, (channels, input_size, input_size))
    seen: dict[str, int] = {}
    for layer in network.layers:
        count = seen[layer.name] = seen.get(layer.name, 0) + 1
        name = layer.name if count == 1 else f"{layer.name}_{count}"
        _export_layer(b, layer, name)
    h = onnx.helper
    out_name = PROBS_NAME if isinstance(network.layers[-1], Softmax) else LOGITS_NAME
    b.nodes.append(h.make_node("Identity", [b.tensor], [out_name], name="output"))
    graph = h.make_graph(
        b.nodes, network.name,
        [h.make_tensor_value_info(INPUT_NAME, onnx.TensorProto.FLOAT,
                                  [BATCH_DIM, channels, input_size, input_size])],
        [h.make_tensor_value_info(out_name, onnx.TensorProto.FLOAT, [BATCH_DIM, *b.shape])],
        initializer=b.inits)
    opsets = [h.make_opsetid("", opset)]
    # The oldest IR version that carries this opset: newer onnx writes IR versions that
    # released runtimes refuse, though nothing in this graph needs them.
    model = h.make_model(graph, opset_imports=opsets, producer_name="convolab",
                         producer_version=__version__,
                         ir_version=h.find_min_ir_version_for(opsets))
    h.set_model_props(model, {"convolab_model": network.name, "input_size": str(input_size)})
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as err:
        raise ConvolabError(f"export: onnx.checker refused the graph: {err}") from None
    return model


def export_onnx(network: Network, path: Path, input_size: int, opset: int = 17) -> Path:
    """Write `network` to `path` as ONNX (input `images` float32 [N, C, S, S], output
    `probabilities` [N, classes]), checked by onnx.checker, atomically."""
    model = to_onnx_model(network, input_size, opset)
    return write_atomic(Path(path), model.SerializeToString())


# ----------------------------------------------------------------------------- import


@dataclass
class Imported:
    """An imported graph: the network, its input image side, and the zoo model it matches."""

    network: Network
    input_size: int
    channels: int
    zoo_model: str | None


class _Reader:
    """Walks the node chain, turning each node into a layer (or nothing: Identity, Constant)."""

    def __init__(self, onnx: Any, model: Any, where: str) -> None:
        self.onnx, self.where = onnx, where
        graph = model.graph
        self.consts: dict[str, np.ndarray] = {
            t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
        inputs = [i for i in graph.input if i.name not in self.consts]
        if len(inputs) != 1:
            raise ConvolabError(f"{where}: expected one image input, found "
                                f"{[i.name for i in inputs]}")
        self.channels, self.size = self._input_shape(inputs[0])
        self.tensor = inputs[0].name
        self.shape: tuple[int, ...] = (self.channels, self.size, self.size)
        self.layers: list[Layer] = []
        self.node: Any = None

    def _input_shape(self, value: Any) -> tuple[int, int]:
        dims = [d.dim_value if d.HasField("dim_value") else None
                for d in value.type.tensor_type.shape.dim]
        if len(dims) != 4 or None in dims[1:] or dims[2] != dims[3]:
            raise ConvolabError(f"{self.where}: input {value.name!r} must be [N, C, S, S] with "
                                f"C and S fixed, got {dims}")
        if value.type.tensor_type.elem_type != self.onnx.TensorProto.FLOAT:
            raise ConvolabError(f"{self.where}: input {value.name!r} must be float32")
        return int(dims[1]), int(dims[2])

    def fail(self, reason: str) -> ConvolabError:
        node = self.node
        label = f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"
        return ConvolabError(f"{self.where}: {label}: {reason}")

    def attrs(self) -> dict[str, Any]:
        h = self.onnx.helper
        return {a.name: h.get_attribute_value(a) for a in self.node.attribute}

    def const(self, name: str, what: str) -> np.ndarray:
        if name not in self.consts:
            raise self.fail(f"its {what} {name!r} must be an initializer or Constant")
        value = self.consts[name]
        if not np.issubdtype(value.dtype, np.floating) and what != "shape":
            raise self.fail(f"its {what} {name!r} is {value.dtype}, not floating point")
        return value

    def data_input(self) -> None:
        if not self.node.input or self.node.input[0] != self.tensor:
            raise self.fail(f"it does not read the previous node's output {self.tensor!r} "
                            "(only a chain of nodes is supported)")

    def map_shape(self) -> tuple[int, int, int]:
        if len(self.shape) != 3:
            raise self.fail(f"it needs a (C, H, W) input, got features {self.shape}")
        return self.shape  # type: ignore[return-value]

    def emit(self, layer: Layer | None, shape: tuple[int, ...] | None = None) -> None:
        if layer is not None:
            self.layers.append(layer)
        if shape is not None:
            self.shape = shape
        self.tensor = self.node.output[0]


def _window(r: _Reader, attrs: dict[str, Any], kernel: tuple[int, int]) -> tuple[int, int, int]:
    """Kernel side and stride of a Conv/pool node, refusing what the layers cannot compute."""
    kshape = tuple(attrs.get("kernel_shape", kernel))
    if kshape != kernel:
        raise r.fail(f"kernel_shape {list(kshape)} does not match the weights' {list(kernel)}")
    if len(kshape) != 2 or kshape[0] != kshape[1]:
        raise r.fail(f"kernel_shape {list(kshape)}: only square 2-D windows are supported")
    strides = tuple(attrs.get("strides", (1, 1)))
    if len(strides) != 2 or strides[0] != strides[1] or strides[0] < 1:
        raise r.fail(f"strides {list(strides)}: only equal positive strides are supported")
    checks = (("pads", any(attrs.get("pads", ())), "padding is unsupported (pads must be 0)"),
              ("auto_pad", attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"),
               "padding is unsupported (auto_pad must be NOTSET or VALID)"),
              ("dilations", any(d != 1 for d in attrs.get("dilations", ())),
               "dilations must be 1"),
              ("ceil_mode", attrs.get("ceil_mode", 0) != 0, "ceil_mode must be 0"),
              ("group", attrs.get("group", 1) != 1, "group must be 1"),
              ("storage_order", attrs.get("storage_order", 0) != 0, "storage_order must be 0"))
    for key, bad, reason in checks:
        if bad:
            raise r.fail(f"{key} {attrs[key]!r}: {reason}")
    c, h, w = r.map_shape()
    k, s = kshape[0], strides[0]
    if h < k or w < k:
        raise r.fail(f"its {k}x{k} window does not fit the {h}x{w} input")
    return k, s, (h - k) // s + 1


def _conv(r: _Reader) -> None:
    attrs = r.attrs()
    w = r.const(r.node.input[1], "weight")
    if w.ndim != 4:
        raise r.fail(f"weight shape {list(w.shape)}: a 2-D convolution needs 4 dimensions")
    m, c, kh, kw = w.shape
    k, s, out = _window(r, attrs, (kh, kw))
    if c != r.shape[0]:
        raise r.fail(f"weight takes {c} channels, its input has {r.shape[0]}")
    has_bias = len(r.node.input) > 2 and r.node.input[2] != ""
    layer = Conv2d(int(c), int(m), int(k), int(s), bias=has_bias)
    layer.weight = np.ascontiguousarray(w, dtype=np.float32)
    if has_bias:
        layer.bias = _vector(r, r.node.input[2], int(m), "bias")
    r.emit(layer, (int(m), out, out))


def _vector(r: _Reader, name: str, n: int, what: str) -> np.ndarray:
    value = r.const(name, what)
    if value.size != n or value.ndim > 2:
        raise r.fail(f"its {what} {name!r} has shape {list(value.shape)}, expected [{n}]")
    return np.ascontiguousarray(value.reshape(n), dtype=np.float32)


def _pool(r: _Reader) -> None:
    attrs = r.attrs()
    if len([o for o in r.node.output if o]) > 1:
        raise r.fail("the Indices output is unsupported")
    kernel = tuple(attrs.get("kernel_shape", ()))
    if len(kernel) != 2:
        raise r.fail(f"kernel_shape {list(kernel)}: only 2-D pooling is supported")
    k, s, out = _window(r, attrs, kernel)  # type: ignore[arg-type]
    cls = MaxPool2d if r.node.op_type == "MaxPool" else AvgPool2d
    r.emit(cls(int(k), int(s)), (r.shape[0], out, out))


def _flatten(r: _Reader) -> None:
    if r.node.op_type == "Flatten":
        if r.attrs().get("axis", 1) != 1:
            raise r.fail("only axis=1 (keep the batch) is supported")
    else:
        _check_reshape(r)
    if len(r.shape) == 1:
        r.emit(None)  # already (N, features)
        return
    r.emit(Flatten(), (int(np.prod(r.shape)),))


def _check_reshape(r: _Reader) -> None:
    if len(r.node.input) < 2:
        raise r.fail("it has no shape input")
    shape = [int(v) for v in r.const(r.node.input[1], "shape").reshape(-1)]
    features = int(np.prod(r.shape))
    if r.attrs().get("allowzero", 0) != 0:
        raise r.fail("allowzero=1 is unsupported")
    if len(shape) != 2 or shape[0] not in (0, -1) or shape[1] not in (-1, features) or (
            shape == [-1, -1]):
        raise r.fail(f"shape {shape}: only (N, -1) flattening, e.g. [0, -1] or "
                     f"[-1, {features}], is supported")


def _linear(r: _Reader, weight: np.ndarray, bias_name: str | None, scale: float = 1.0,
            bias_scale: float = 1.0) -> None:
    """weight is (in, out) as MatMul multiplies it."""
    if weight.ndim != 2:
        raise r.fail(f"weight shape {list(weight.shape)}: expected 2 dimensions")
    n_in, n_out = weight.shape
    if r.shape != (n_in,):
        raise r.fail(f"weight takes {n_in} features, its input has shape {r.shape}"
                     + (" (flatten first)" if len(r.shape) == 3 else ""))
    layer = Linear(int(n_in), int(n_out), bias=bias_name is not None)
    layer.weight = np.ascontiguousarray(weight.T * scale, dtype=np.float32)
    if bias_name is not None:
        layer.bias = _vector(r, bias_name, int(n_out), "bias") * np.float32(bias_scale)
    r.emit(layer, (int(n_out),))


def _gemm(r: _Reader) -> None:
    attrs = r.attrs()
    if attrs.get("transA", 0) != 0:
        raise r.fail("transA=1 is unsupported (the images are the rows)")
    w = r.const(r.node.input[1], "weight")
    if attrs.get("transB", 0):
        w = w.T
    bias = r.node.input[2] if len(r.node.input) > 2 and r.node.input[2] else None
    _linear(r, w, bias, float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0)))


def _matmul(r: _Reader) -> None:
    _linear(r, r.const(r.node.input[1], "weight"), None)


def _add(r: _Reader) -> None:
    last = r.layers[-1] if r.layers else None
    if not isinstance(last, Linear) or last.bias is not None or r.node.input[0] != r.tensor:
        raise r.fail("Add is supported only as the bias right after a MatMul")
    last.bias = _vector(r, r.node.input[1], last.out_features, "bias")
    r.layers[-1] = _with_bias(last)
    r.emit(None)


def _with_bias(layer: Linear) -> Linear:
    out = Linear(layer.in_features, layer.out_features, bias=True)
    out.weight, out.bias = layer.weight, layer.bias
    return out


def _softmax(r: _Reader) -> None:
    axis = r.attrs().get("axis", -1)
    if len(r.shape) != 1 or axis not in (-1, 1):
        raise r.fail(f"axis {axis} on shape {r.shape}: only the class axis of (N, classes)")
    r.emit(Softmax())


def _identity(r: _Reader) -> None:
    if r.node.op_type == "Dropout":
        if r.attrs().get("training_mode") or (len(r.node.input) > 2 and r.node.input[2]):
            raise r.fail("training_mode is unsupported (inference only)")
        if len([o for o in r.node.output if o]) > 1:
            raise r.fail("the mask output is unsupported")
    r.emit(None)


def _constant(r: _Reader) -> None:
    attrs = r.attrs()
    if set(attrs) != {"value"}:
        raise r.fail(f"only a tensor 'value' is supported, got {sorted(attrs)}")
    r.consts[r.node.output[0]] = r.onnx.numpy_helper.to_array(attrs["value"])


_HANDLERS: dict[str, Callable[[_Reader], None]] = {
    "Conv": _conv, "Relu": lambda r: r.emit(ReLU()), "MaxPool": _pool, "AveragePool": _pool,
    "Flatten": _flatten, "Reshape": _flatten, "Gemm": _gemm, "MatMul": _matmul, "Add": _add,
    "Softmax": _softmax, "Identity": _identity, "Dropout": _identity,
}


def _read_model(onnx: Any, path: Path) -> Any:
    if not path.is_file():
        raise ConvolabError(f"ONNX file {path} does not exist")
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as err:  # protobuf and the checker raise their own types
        raise ConvolabError(f"ONNX file {path} is not a valid ONNX model: {err}") from None
    domains = {o.domain for o in model.opset_import if o.domain not in ("", "ai.onnx")}
    if domains:
        raise ConvolabError(f"ONNX file {path}: custom op domains {sorted(domains)} "
                            "are unsupported")
    return model


def _walk(r: _Reader, graph: Any) -> None:
    for node in graph.node:
        r.node = node
        if node.op_type == "Constant":
            _constant(r)
            continue
        handler = _HANDLERS.get(node.op_type)
        if handler is None:
            raise r.fail(f"unsupported op {node.op_type}; convolab imports "
                         f"{', '.join(SUPPORTED_OPS)}")
        r.data_input()
        handler(r)
    outputs = [o.name for o in graph.output]
    if outputs != [r.tensor]:
        raise ConvolabError(f"{r.where}: the graph's outputs {outputs} are not the end of its "
                            f"node chain ({r.tensor!r})")
    if not any(isinstance(la, Conv2d | Linear) for la in r.layers):
        raise ConvolabError(f"{r.where}: the graph has no Conv, Gemm or MatMul: nothing to run")


def _signature(layers: list[Layer]) -> list[tuple[Any, ...]]:
    sig = []
    for layer in layers:
        shapes = tuple((k, tuple(v.shape)) for k, v in layer.params().items())
        sig.append((type(layer).__name__, getattr(layer, "kernel_size", None),
                    getattr(layer, "stride", None), shapes))
    return sig


def _name_layers(layers: list[Layer], channels: int, size: int) -> str | None:
    """Give the layers a zoo model's names where they match it (returns the model name), else
    conv1, conv2, ..., fc1, ... (returns None)."""
    from convolab.models import MODELS

    for spec in MODELS.values():
        zoo = spec.layers()
        first = next(la for la in zoo if isinstance(la, Conv2d))
        if (spec.input_size, first.in_channels) == (size, channels) and (
                _signature(zoo) == _signature(layers)):
            for mine, theirs in zip(layers, zoo, strict=True):
                mine.name = theirs.name
            return spec.name
    counts: dict[str, int] = {}
    for layer in layers:
        prefix = {"Conv2d": "conv", "Linear": "fc"}.get(type(layer).__name__)
        if prefix is not None:
            counts[prefix] = counts.get(prefix, 0) + 1
            layer.name = f"{prefix}{counts[prefix]}"
    return None


def import_onnx(path: Path) -> Imported:
    """Read a LeNet-class ONNX graph as a convolab Network (in eval mode, on the CPU)."""
    onnx = require_onnx()
    path = Path(path)
    model = _read_model(onnx, path)
    reader = _Reader(onnx, model, f"ONNX file {path}")
    _walk(reader, model.graph)
    zoo = _name_layers(reader.layers, reader.channels, reader.size)
    # A graph that is not a zoo model must not pass for one (weights files and the fused GPU
    # network go by the network's name).
    name = zoo if zoo is not None else f"onnx:{model.graph.name or path.stem}"
    network = Network(reader.layers, name).eval()
    return Imported(network, reader.size, reader.channels, zoo)


def network_from_onnx(path: Path) -> Network:
    """The graph at `path` as a convolab Network; see `import_onnx` for its input size."""
    return import_onnx(path).network


# ----------------------------------------------------------------------------- commands


def export_command(model: str, weights: Path | None, out: Path, opset: int) -> Path:
    """`convolab export`: the output path is checked before anything is loaded."""
    from convolab import models
    from convolab.outputs import check_file

    spec = models.spec(model)
    out = check_file(out, "OUT")
    require_onnx()
    network = models.load(model, weights)
    return export_onnx(network, out, spec.input_size, opset)


def classify_command(path: Path, *, images: int, device: str, data_dir: Path | None,
                     mode: str | None, json_out: Path | None) -> None:
    """`convolab classify --onnx`: the imported network on the first `images` test images; on
    the GPU only an ece408-shaped graph runs (the fused network), anything else is refused."""
    from dataclasses import asdict

    from convolab import classify, data, outputs

    if json_out is not None:
        json_out = outputs.check_file(json_out, "--json")
    imported = import_onnx(path)
    fused = device == "gpu" and imported.zoo_model == "ece408"
    if device == "gpu" and not fused:
        raise ConvolabError(f"--device gpu: {path} is not ece408-shaped, and only the ece408 "
                            "graph has a GPU path here; use --device cpu")
    network_mode = classify.resolve_mode(mode, device, imported.zoo_model or "onnx", fused)
    x, labels = data.load_images("test", n=images, size=imported.input_size, data_dir=data_dir)
    report = classify.Report(model=f"{imported.network.name} ({path.name})", device=device,
                             batch=images, path="")
    if fused:
        from convolab.gpu.device import gpu_name

        report.gpu = gpu_name()
        report.path = f"fused network ({mode or 'exact'})"
        classify.run_fused(imported.network, network_mode, x, labels, report)
    else:
        chosen = classify.choose_impl(None, "cpu")
        report.path = f"per layer ({chosen.name})"
        classify.run_per_layer(imported.network, chosen, "cpu", x, labels, report)
    classify.print_report(report)
    if json_out is not None:
        outputs.write_json(json_out, asdict(report))
        classify.say(f"wrote {json_out}")
