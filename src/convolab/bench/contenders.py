"""Contenders: registered implementations (each with its own parameters) and the PyTorch/cuDNN
and cuBLAS anchors the speed-ups are measured against. Nothing here imports CuPy or torch at
module import time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from convolab.backend import cupy_or_none
from convolab.bench.specs import ImplSpec
from convolab.check import poison
from convolab.errors import ConvolabError
from convolab.precision import TOLERANCE
from convolab.shapes import ConvShape

# Compiled with Numba, which must not be loaded on the GPU hosts (see conv_cpu's docstring).
NUMBA_IMPLS = frozenset({"cpu-loops", "cpu-fused"})


@dataclass
class Prepared:
    """A contender bound to one shape and weights: `op(x)` launches, `fetch()` reads the output."""

    op: Callable[[Any], None]
    fetch: Callable[[], np.ndarray]
    poison: Callable[[], None] = lambda: None
    layer: Callable[[np.ndarray], np.ndarray] | None = None  # host in -> host out (GPU only)


@dataclass
class Contender:
    name: str  # the row label: the implementation's name, with its parameters if any
    device: str  # "cpu" or "gpu"
    precision: str  # which compute ceiling bounds it: fp32, tf32 or fp16
    tolerance: float
    prepare: Callable[[ConvShape, Any, Any], Prepared]
    supports: Callable[[ConvShape], bool] = lambda _: True
    rung: int | None = None
    pool: int = 0
    anchor: bool = False  # PyTorch/cuBLAS: the yardsticks the speed-ups are against
    impl: Any = None  # the registry entry behind it (None for the anchors)
    params: dict[str, Any] | None = None
    raw_hw: tuple[int, int] | None = None  # reads raw uint8 images of this size (raw_contender)


def precision_of(tolerance: float) -> str:
    """Which compute ceiling bounds a rung: the loosest precision whose tolerance it needs. A
    tensor-core rung that recovers fp32 accuracy (3xTF32) is still bounded by TF32, which the
    registry states by its tolerance or name."""
    if tolerance > TOLERANCE["tf32"]:
        return "fp16"
    if tolerance > TOLERANCE["fp32"]:
        return "tf32"
    return "fp32"


def out_shape(shape: ConvShape, pool: int) -> tuple[int, int, int, int]:
    if pool:
        return (shape.B, shape.M, shape.H_out // pool, shape.W_out // pool)
    return shape.y_shape


def _gpu_layer(impl: Any, run: Callable, w: Any, b: Any, shape: ConvShape,
               params: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
    """Layer Time: host input in, device allocation, H2D, run, D2H."""
    cp = cupy_or_none()
    if impl.name == "streams":  # its whole point is the overlapped host<->device path
        from convolab.gpu.ladder_advanced import layer_forward_streams

        return lambda x_host: layer_forward_streams(x_host, w, b, shape.S, params)

    def layer(x_host: np.ndarray) -> np.ndarray:
        y_dev = cp.empty(impl.out_shape(shape), dtype=np.float32)
        run(cp.asarray(x_host), y_dev)
        return y_dev.get()

    return layer


def _once_per_buffer(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`convert`, run once per input buffer and kept: the bench warms every rotated buffer
    before timing, so a contender that takes its input in another form converts it outside
    the timed region, as the libraries' anchors do."""
    seen: dict[int, Any] = {}

    def converted(x: Any) -> Any:
        got = seen.get(id(x))
        if got is None:
            got = seen[id(x)] = convert(x)
        return got

    return converted


def _channels_last_prepare(impl: Any, params: dict[str, Any]
                           ) -> Callable[[ConvShape, Any, Any], Prepared]:
    """A wgmma rung with `layout=nhwc` on cuDNN fp16-cl's terms: the input converted to the
    rung's channels-last operand once per buffer outside the timed region, the output left
    channels-last in the operand type (converted to NCHW fp32 for the check only)."""
    from convolab.gpu import implicit_gemm_wgmma as wg

    mode = wg.MODE_OF[impl.name]

    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        run = impl.prepare(shape, w, b, params)
        y = wg.output_buffer(shape, mode)
        operand = _once_per_buffer(lambda x: wg.to_operand(x, mode))

        def op(x: Any) -> None:
            run(operand(x), y)

        return Prepared(op, lambda: wg.from_operand(y, shape.M, mode).get(),
                        lambda: wg.poison_operand(y, mode))

    return prepare


def _operand_x_prepare(impl: Any, params: dict[str, Any]
                       ) -> Callable[[ConvShape, Any, Any], Prepared]:
    """Kernel 49 with `x16=1` on cuBLAS fp16's terms: x converted to the (B, C) 16-bit operand
    once per buffer outside the timed region; y fp32 with the bias, as in every other row."""
    from convolab.gpu import gemv_wgmma

    mode = impl.name.rsplit("-", 1)[1]

    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        run = impl.prepare(shape, w, b, params)
        y = cupy_or_none().empty(impl.out_shape(shape), dtype=np.float32)
        operand = _once_per_buffer(lambda x: gemv_wgmma.to_operand(x, mode))

        def op(x: Any) -> None:
            run(operand(x), y)

        return Prepared(op, lambda: y.get(), lambda: poison(y))

    return prepare


def from_impl(impl: Any, params: dict[str, Any]) -> Contender:
    """A registered implementation as a contender, run with `params` (its defaults + overrides)."""
    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        run = impl.prepare(shape, w, b, params)
        if impl.device == "cpu":
            y = np.empty(impl.out_shape(shape), np.float32)
            return Prepared(lambda x: run(x, y), lambda: y.copy(), lambda: poison(y))
        y = cupy_or_none().empty(impl.out_shape(shape), dtype=np.float32)
        return Prepared(lambda x: run(x, y), lambda: y.get(), lambda: poison(y),
                        _gpu_layer(impl, run, w, b, shape, params))

    tolerance = impl.tolerance
    if impl.name == "auto":  # its promise is its mode's: auto:mode=fp16 may run an fp16 rung
        tolerance = TOLERANCE[str(params.get("mode", "fp32"))]
    precision = precision_of(tolerance)
    if precision == "fp32" and "3xfp16" in impl.name:  # split fp16 products: fp16-bound
        precision = "fp16"
    elif precision == "fp32" and ("tf32" in impl.name or "tensor-core" in impl.name):
        precision = "tf32"
    if params.get("layout") == "nhwc":
        prepare = _channels_last_prepare(impl, params)
    elif int(params.get("x16", 0)):
        prepare = _operand_x_prepare(impl, params)
    return Contender(impl.name, impl.device, precision, tolerance, prepare, impl.supports,
                     impl.rung, impl.pool, impl=impl, params=params)


def _torch_prepare(torch: Any, device: str, tf32: bool) -> Callable[[ConvShape, Any, Any],
                                                                    Prepared]:
    import torch.nn.functional as F

    def to_torch(a: Any) -> Any:
        return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)

    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        w_t, b_t = to_torch(w), to_torch(b)
        tensor = _once_per_buffer(to_torch)
        out: dict[str, Any] = {}

        def op(x: Any) -> None:
            # The flags are process-wide: set them on every call so TF32 never leaks.
            torch.backends.cudnn.allow_tf32 = tf32
            out["y"] = F.conv2d(tensor(x), w_t, b_t, stride=shape.S)

        def layer(x_host: np.ndarray) -> np.ndarray:
            torch.backends.cudnn.allow_tf32 = tf32
            x_t = torch.from_numpy(x_host).to("cuda")
            return F.conv2d(x_t, w_t, b_t, stride=shape.S).cpu().numpy()

        return Prepared(op, lambda: out["y"].cpu().numpy(),
                        layer=layer if device == "gpu" else None)

    return prepare


def _torch_half_prepare(torch: Any) -> Callable[[ConvShape, Any, Any], Prepared]:
    """cuDNN at its fastest: fp16 operands, channels-last. Input and weights are converted
    once per buffer outside the timed region (the rungs convert inside theirs)."""
    import torch.nn.functional as F

    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        cl = torch.channels_last
        w_t = torch.from_dlpack(w).half().to(memory_format=cl)
        b_t = torch.from_dlpack(b).half()
        tensor = _once_per_buffer(lambda x: torch.from_dlpack(x).half().to(memory_format=cl))
        out: dict[str, Any] = {}

        def op(x: Any) -> None:
            out["y"] = F.conv2d(tensor(x), w_t, b_t, stride=shape.S)

        return Prepared(op, lambda: out["y"].float().contiguous().cpu().numpy())

    return prepare


def _torch_gemm_prepare(torch: Any, half: bool) -> Callable[[ConvShape, Any, Any], Prepared]:
    """cuBLAS through torch.matmul in TF32 or fp16 (operands converted outside the timing)."""
    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        dtype = torch.float16 if half else torch.float32
        w_t = torch.from_dlpack(w).reshape(shape.M, shape.C).t().to(dtype)
        tensor = _once_per_buffer(
            lambda x: torch.from_dlpack(x).reshape(shape.B, shape.C).to(dtype))
        out: dict[str, Any] = {}

        def op(x: Any) -> None:
            torch.backends.cuda.matmul.allow_tf32 = not half
            out["y"] = torch.matmul(tensor(x), w_t)

        def fetch() -> np.ndarray:
            y = out["y"].float() + torch.from_dlpack(b)[None, :]
            return y.reshape(shape.y_shape).cpu().numpy()

        return Prepared(op, fetch)

    return prepare


def _is_gemm(shape: ConvShape) -> bool:
    return shape.K == 1 and shape.H == 1 and shape.W == 1


def torch_contenders(gpu: bool) -> list[Contender]:
    """torch-cpu, and on a GPU cuDNN fp32, TF32 and fp16 channels-last (with cuDNN autotuning:
    a fair anchor) and, for the GEMM-shaped layers, cuBLAS in TF32 and fp16."""
    try:
        import torch
    except Exception:  # torch is an optional extra: no anchor rows without it
        return []
    torch.backends.cudnn.benchmark = True
    rows = [Contender("torch-cpu", "cpu", "fp32", TOLERANCE["fp32"],
                      _torch_prepare(torch, "cpu", False), anchor=True)]
    if gpu and torch.cuda.is_available():
        rows += [
            Contender("torch-cudnn-fp32", "gpu", "fp32", TOLERANCE["fp32"],
                      _torch_prepare(torch, "gpu", False), anchor=True),
            Contender("torch-cudnn-tf32", "gpu", "tf32", TOLERANCE["tf32"],
                      _torch_prepare(torch, "gpu", True), anchor=True),
            Contender("torch-cudnn-fp16-cl", "gpu", "fp16", TOLERANCE["fp16"],
                      _torch_half_prepare(torch), anchor=True),
            Contender("cublas-tf32", "gpu", "tf32", TOLERANCE["tf32"],
                      _torch_gemm_prepare(torch, False), _is_gemm, anchor=True),
            Contender("cublas-fp16", "gpu", "fp16", TOLERANCE["fp16"],
                      _torch_gemm_prepare(torch, True), _is_gemm, anchor=True),
        ]
    return rows


def cublas_contender() -> Contender:
    """The VGG classifier layers are GEMMs: cuBLAS SGEMM (cupy.matmul, fp32) is their anchor.

    Op Time is the GEMM alone; the bias is added outside the timed region for the check.
    """
    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        cp = cupy_or_none()
        w_t = w.reshape(shape.M, shape.C).T
        out: dict[str, Any] = {}

        def op(x: Any) -> None:
            out["y"] = cp.matmul(x.reshape(shape.B, shape.C), w_t)

        def fetch() -> np.ndarray:
            return (out["y"] + b[None, :]).reshape(shape.y_shape).get()

        return Prepared(op, fetch)

    return Contender("cublas-sgemm", "gpu", "fp32", TOLERANCE["fp32"], prepare, _is_gemm,
                     anchor=True)


def raw_contender(c: Contender, raw_hw: tuple[int, int]) -> Contender:
    """`c` reading raw uint8 images (n, *raw_hw) resized to the layer's square input: through
    the implementation's own raw entry where it has one (rung 29), else rung 25's resize into
    a float buffer first (the path before rung 29)."""
    from convolab.gpu import fused_first

    native = c.impl is not None and c.impl.name in fused_first.REGISTERED
    params = c.params or {}

    def prepare(shape: ConvShape, w: Any, b: Any) -> Prepared:
        cp = cupy_or_none()
        if native:
            run = fused_first.prepare_registered(c.impl.name, shape, w, b, params, raw_hw)
            y = cp.empty(out_shape(shape, c.pool), dtype=np.float32)
            return Prepared(lambda raw: run(raw, y), lambda: y.get(), lambda: poison(y))
        from convolab.gpu.resize import resize_u8

        inner = c.prepare(shape, w, b)
        x = cp.empty(shape.x_shape, dtype=np.float32)

        def op(raw: Any) -> None:
            resize_u8(raw, shape.H, out=x)
            inner.op(x)

        return Prepared(op, inner.fetch, inner.poison)

    def supports(shape: ConvShape) -> bool:
        return (shape.C == 1 and shape.H == shape.W and bool(c.supports(shape))
                and (not native or fused_first.supports(shape, c.pool, raw_hw)))

    name = f"{c.name} (raw)" if native else f"rung 25 + {c.name}"
    return dataclasses.replace(c, name=name, prepare=prepare, supports=supports, raw_hw=raw_hw)


def named_contender(spec: ImplSpec, gpu: bool) -> Contender:
    """`--impl NAME[:k=v,...]` -> its contender; unknown names/keys and unusable devices raise."""
    from convolab.registry import get_impl

    try:
        impl = get_impl(spec.name)
    except KeyError as err:
        raise ConvolabError(err.args[0]) from None
    if impl.reference_only:
        raise ConvolabError(f"{spec.name!r} is the reference, not a contender: it is not timed")
    if impl.device == "gpu" and not gpu:
        raise ConvolabError(f"{spec.name!r} runs on the GPU, and no CUDA GPU is usable here")
    try:
        params = impl.params_for(dict(spec.params))
    except ValueError as err:
        raise ConvolabError(f"--impl {spec.label}: {err}") from None
    contender = from_impl(impl, params)
    contender.name = spec.label
    return contender


def default_contenders(gpu: bool) -> tuple[list[Contender], list[str]]:
    """Every registered implementation usable here at its defaults (+ anchors), and notes."""
    from convolab.registry import all_impls

    notes: list[str] = []
    impls = [i for i in all_impls(include_reference=False) if gpu or i.device == "cpu"]
    if gpu:
        skipped = [i.name for i in impls if i.name in NUMBA_IMPLS]
        impls = [i for i in impls if i.name not in NUMBA_IMPLS]
        if skipped:
            notes.append(f"skipped {', '.join(skipped)}: Numba is not loaded on GPU hosts "
                         "(name them with --impl to force)")
    return [from_impl(i, i.params_for()) for i in impls], notes


def select_contenders(specs: Sequence[ImplSpec] | None, gpu: bool,
                      anchors: bool | None = None) -> tuple[list[Contender], list[str]]:
    """Named contenders (or every one usable here), plus the anchors unless `anchors` is False
    (default: anchors only when no implementation is named); also why some were left out."""
    if specs:
        contenders, notes = [named_contender(s, gpu) for s in specs], []
    else:
        contenders, notes = default_contenders(gpu)
    if not specs if anchors is None else anchors:
        torch_rows = torch_contenders(gpu)
        if specs and all(c.device == "gpu" for c in contenders):
            # Named GPU rungs are measured against the GPU anchors only (torch-CPU on the VGG
            # layers alone would cost minutes a batch).
            torch_rows = [c for c in torch_rows if c.device == "gpu"]
        if not torch_rows:
            notes.append("PyTorch is not installed: no cuDNN/torch-CPU anchor rows")
        contenders += torch_rows + ([cublas_contender()] if gpu else [])
    if not contenders:
        raise ConvolabError("no implementation is available to benchmark here")
    return contenders, notes
