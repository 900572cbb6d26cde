"""Launch every GPU kernel once at a small shape and check each output against fp64, so that a
compute-sanitizer run (memcheck, racecheck, initcheck, synccheck) over this script covers every
kernel and also proves each launch computed the right numbers.

    python3 benchmarks/sanitize.py --list            what it would launch (no CuPy needed)
    python3 benchmarks/sanitize.py [--seed N]        launch and check everything (GPU)
    python3 benchmarks/sanitize.py --only REGEX      only the launches whose name matches
    python3 benchmarks/sanitize.py --summarize DIR   the tools' logs -> DIR/sanitize_summary.txt
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py

Covered: every registered GPU implementation (registry.all_impls("gpu"): each rung, the fused
conv+pool rungs, tensor-core variants, auto) on the first small shape it supports, FusedLeNet in
every network mode from float images and from raw bytes (every zoo model: the dense head of
kernel 30), rung 25's resize, the LeNet head in each tile variant, the training kernels of
gpu/backward.py, and the fused trainer (kernels 31-38) in every mode: its forward against fp64,
and a gradient step at an odd batch (partial slices and head chunks) against the fp64 backward
routed through the device's argmax bytes, followed by a captured epoch (Adam with mirroring and
label smoothing, or SGD) and an evaluation with a partial batch. Nothing here imports Numba
(broken on the device image): the fp64 references are NumPy. Exit status 1 when any launch
misses its tolerance.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convolab.conv_cpu import reference_conv_relu_pool, reference_forward
from convolab.data import IMAGE_SIDE
from convolab.gpu.lenet_head import HEAD_IMGS_CHOICES
from convolab.gpu.trainer import GRADIENT_TOLERANCE
from convolab.models import MODELS
from convolab.precision import NETWORK_MODES, TOLERANCE, TRAIN_MODES
from convolab.registry import ConvImpl, all_impls
from convolab.shapes import ConvShape

SANITIZER_TOOLS: tuple[str, ...] = ("memcheck", "racecheck", "initcheck", "synccheck")
# Small shapes first: an odd, strided one, then one the tensor-core rungs accept (their tiles
# need C*K*K and M to fit an MMA fragment).
CANDIDATE_SHAPES: tuple[ConvShape, ...] = (
    ConvShape(B=3, C=3, H=13, W=11, M=5, K=3, S=2),
    ConvShape(B=2, C=2, H=20, W=20, M=8, K=5, S=1),
    ConvShape(B=2, C=4, H=24, W=24, M=16, K=7, S=1),
    ConvShape(B=3, C=1, H=19, W=17, M=12, K=5, S=1),  # a first block (rung 29: C = 1)
    ConvShape(B=3, C=136, H=1, W=1, M=70, K=1, S=1),  # a linear layer (kernel 41)
    ConvShape(B=3, C=24, H=9, W=12, M=20, K=3, S=1),  # a 3 x 3 filter's taps in shared memory
)                                                     # (kernels 51-52)
NETWORK_BATCH = 19  # not a multiple of any head tile: the last tile is partial
TRAIN_BATCH = 13  # the trainer's step: partial batch slices and head chunks
TRAIN_IMAGES = 70  # its training set; the evaluation takes the first 9 (a partial batch)
BACKWARD_TOLERANCE = TOLERANCE["fp32"]
SUMMARY_FILE = "sanitize_summary.txt"

Rng = np.random.Generator


@dataclass(frozen=True)
class Launch:
    """One checked launch: `check(rng)` runs it and returns its relative L2 error vs fp64."""

    name: str
    what: str
    tolerance: float
    check: Callable[[Rng], float]


def rel_l2(got: Any, want: np.ndarray) -> float:
    from convolab.backend import to_numpy

    got64 = np.asarray(to_numpy(got), np.float64)
    if got64.shape != want.shape:
        raise ValueError(f"output shape {got64.shape}, expected {want.shape}")
    denom = float(np.linalg.norm(want))
    return float(np.linalg.norm(got64 - want)) / (denom if denom > 0 else 1.0)


def _normal(rng: Rng, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def shape_for(impl: ConvImpl) -> ConvShape | None:
    return next((s for s in CANDIDATE_SHAPES if impl.supports(s)), None)


def _conv_launch(impl: ConvImpl, shape: ConvShape) -> Launch:
    def check(rng: Rng) -> float:
        import cupy as cp

        x, w, b = _normal(rng, *shape.x_shape), _normal(rng, *shape.w_shape), _normal(rng, shape.M)
        y = impl.forward(cp.asarray(x), cp.asarray(w), cp.asarray(b), shape.S)
        cp.cuda.Device().synchronize()
        return rel_l2(y, reference_conv_relu_pool(x, w, b, shape.S, impl.pool))

    return Launch(f"conv:{impl.name}", f"rung {impl.rung} {impl.kernel_file} on {shape}",
                  impl.tolerance, check)


def _random_params(rng: Rng, model: str = "ece408") -> dict[str, np.ndarray]:
    from convolab.models import param_shapes

    # Scaled so that activations stay O(1) through both conv blocks and F5.
    return {k: (_normal(rng, *s) / np.sqrt(np.prod(s[1:]) if len(s) > 1 else 1.0)).astype(
        np.float32) for k, s in param_shapes(model).items()}


def _network_launch(mode: str, model: str = "ece408", raw: bool = False) -> Launch:
    """FusedLeNet on float images, or on raw bytes (the resize inside the first conv kernel:
    16/17/19's _raw entry points, or rung 25 in front of a first layer without one)."""
    def check(rng: Rng) -> float:
        import cupy as cp

        from convolab.data import resize_bilinear
        from convolab.gpu.network import FusedLeNet, image_shape

        params = _random_params(rng, model)
        size = image_shape(model)[-1]
        if raw:
            images = rng.integers(0, 256, (NETWORK_BATCH, IMAGE_SIDE, IMAGE_SIDE), dtype=np.uint8)
            x = resize_bilinear(images, size)
        else:
            x = images = rng.random((NETWORK_BATCH, *image_shape(model))).astype(np.float32)
        probs = FusedLeNet(params, mode=mode, model=model)(cp.asarray(images))
        cp.cuda.Device().synchronize()
        return rel_l2(probs, reference_forward(params, x, model=model))

    source = "raw bytes" if raw else "float images"
    return Launch(f"network:{model}:{mode}{':raw' if raw else ''}",
                  f"FusedLeNet {model} mode {mode} from {source}, batch {NETWORK_BATCH}",
                  TOLERANCE[NETWORK_MODES[mode]], check)


def _resize_launch() -> Launch:
    def check(rng: Rng) -> float:
        import cupy as cp

        from convolab.data import resize_bilinear
        from convolab.gpu.resize import resize_u8

        raw = rng.integers(0, 256, (NETWORK_BATCH, IMAGE_SIDE, IMAGE_SIDE), dtype=np.uint8)
        index = rng.integers(0, NETWORK_BATCH, NETWORK_BATCH)
        size = MODELS["ece408"].input_size
        got = resize_u8(cp.asarray(raw), size, index=cp.asarray(index))
        cp.cuda.Device().synchronize()
        return rel_l2(got, resize_bilinear(raw[index], size).astype(np.float64))

    return Launch("resize_u8", f"rung 25: raw bytes resized on the GPU, batch {NETWORK_BATCH}",
                  0.0, check)


def _head_launch(imgs: int) -> Launch:
    def check(rng: Rng) -> float:
        import cupy as cp

        from convolab.gpu.lenet_head import head_defines, prepare_head

        p = _random_params(rng)
        feat = rng.random((NETWORK_BATCH, 1024)).astype(np.float32)
        probs = cp.empty((NETWORK_BATCH, 10), cp.float32)
        dev = {k: cp.asarray(v) for k, v in p.items()}
        prepare_head(head_defines(imgs))(
            cp.asarray(feat), cp.ascontiguousarray(dev["f5.weight"].T), dev["f5.bias"],
            dev["f6.weight"], dev["f6.bias"], probs)
        cp.cuda.Device().synchronize()
        f = {k: v.astype(np.float64) for k, v in p.items()}
        hidden = np.maximum(feat @ f["f5.weight"].T + f["f5.bias"], 0.0)
        a = hidden @ f["f6.weight"].T + f["f6.bias"]
        z = np.exp(a - a.max(axis=1, keepdims=True))
        return rel_l2(probs, z / z.sum(axis=1, keepdims=True))

    return Launch(f"head:imgs{imgs}", f"lenet_head tiles of {imgs}, batch {NETWORK_BATCH}",
                  TOLERANCE["fp32"], check)


# ---- fp64 references of the training kernels -------------------------------------------------
def conv_backward_reference(x: np.ndarray, w: np.ndarray, dy: np.ndarray,
                            stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    k, (ho, wo) = w.shape[2], dy.shape[2:]
    dx = np.zeros_like(x64)
    dw = np.zeros_like(w64)
    for p in range(k):
        for q in range(k):
            xs = x64[:, :, p:p + stride * (ho - 1) + 1:stride, q:q + stride * (wo - 1) + 1:stride]
            dw[:, :, p, q] = np.einsum("bmhw,bchw->mc", dy64, xs)
            dx[:, :, p:p + stride * (ho - 1) + 1:stride, q:q + stride * (wo - 1) + 1:stride] += \
                np.einsum("bmhw,mc->bchw", dy64, w64[:, :, p, q])
    return dx, dw, dy64.sum(axis=(0, 2, 3))


def _pool_windows(x: np.ndarray, k: int, s: int) -> np.ndarray:
    """(B, C, Ho, Wo, k, k) windows of x, floor mode."""
    from numpy.lib.stride_tricks import sliding_window_view

    return sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::s, ::s]


def _spread(per_window: np.ndarray, x_shape: tuple[int, ...], k: int, s: int) -> np.ndarray:
    """Adds (B, C, Ho, Wo, k, k) window values back onto an x-shaped array."""
    out = np.zeros(x_shape, np.float64)
    ho, wo = per_window.shape[2:4]
    for p in range(k):
        for q in range(k):
            out[:, :, p:p + s * (ho - 1) + 1:s, q:q + s * (wo - 1) + 1:s] += per_window[..., p, q]
    return out


def pool_references(x: np.ndarray, dy: np.ndarray, coef: np.ndarray, bias: np.ndarray,
                    k: int, s: int) -> dict[str, np.ndarray]:
    """fp64 max-pool, subsampling and average-pool forward and backward."""
    win = _pool_windows(x.astype(np.float64), k, s)
    b, c, ho, wo = win.shape[:4]
    flat = win.reshape(b, c, ho, wo, k * k)
    first_max = np.zeros_like(flat)
    np.put_along_axis(first_max, flat.argmax(axis=-1)[..., None], 1.0, axis=-1)
    dy64 = dy.astype(np.float64)
    mean = win.mean(axis=(4, 5))
    sig = 1.0 / (1.0 + np.exp(-(coef[None, :, None, None] * mean + bias[None, :, None, None])))
    dz = dy64 * sig * (1.0 - sig)
    ones = np.ones((1, 1, 1, 1, k, k))
    return {
        "maxpool_y": win.max(axis=(4, 5)),
        "maxpool_dx": _spread((first_max * dy64[..., None]).reshape(win.shape), x.shape, k, s),
        "subsample_y": sig,
        "subsample_dx": _spread((dz * coef[None, :, None, None])[..., None, None] * ones / (k * k),
                                x.shape, k, s),
        "subsample_dcoef": (dz * mean).sum(axis=(0, 2, 3)),
        "subsample_dbias": dz.sum(axis=(0, 2, 3)),
        "avgpool_dx": _spread(dy64[..., None, None] * ones / (k * k), x.shape, k, s),
    }


def _conv_backward_launch(stride: int, method: str, max_taps_k: int, need_dx: bool) -> Launch:
    def check(rng: Rng) -> float:
        import cupy as cp

        from convolab.gpu import backward

        backward.GEMM_WORKSPACE_FLOATS = 2 * 3 * 5 * 5 * 64  # forces several GEMM chunks
        backward.MAX_TAPS_K = max_taps_k  # 0: the one-block-per-weight dW kernel
        x, w = _normal(rng, 5, 3, 13, 11), _normal(rng, 4, 3, 5, 5)
        dy = _normal(rng, 5, 4, (13 - 5) // stride + 1, (11 - 5) // stride + 1)
        got = backward.conv2d_backward(cp.asarray(x), cp.asarray(w), cp.asarray(dy), stride,
                                       method, need_dx=need_dx)
        cp.cuda.Device().synchronize()
        want = conv_backward_reference(x, w, dy, stride)
        return max(rel_l2(g, r) for g, r in zip(got, want, strict=True) if g is not None)

    return Launch(f"backward:conv s{stride} {method} taps{max_taps_k} dx={need_dx}",
                  "conv2d_backward x (5,3,13,11) w (4,3,5,5)", BACKWARD_TOLERANCE, check)


def _pool_launch(k: int, s: int) -> Launch:
    def check(rng: Rng) -> float:
        import cupy as cp

        from convolab.gpu import backward as bw

        x = _normal(rng, 2, 3, 11, 10)
        ho, wo = (11 - k) // s + 1, (10 - k) // s + 1
        dy, coef, bias = _normal(rng, 2, 3, ho, wo), _normal(rng, 3), _normal(rng, 3)
        ref = pool_references(x, dy, coef, bias, k, s)
        xd, dyd, cd, bd = (cp.asarray(a) for a in (x, dy, coef, bias))
        y = bw.maxpool2d_forward(xd, k, s)
        sub = bw.subsample_forward(xd, cd, bd, k, s)
        got = {"maxpool_y": y, "maxpool_dx": bw.maxpool2d_backward(xd, y, dyd, k, s),
               "subsample_y": sub, "avgpool_dx": bw.avgpool2d_backward(dyd, x.shape, k, s)}
        errs = [rel_l2(bw.maxpool2d_backward(xd, None, dyd, k, s), ref["maxpool_dx"])]
        for s_in in (sub, None):
            dx, dcoef, dbias = bw.subsample_backward(xd, s_in, dyd, cd, bd, k, s)
            errs += [rel_l2(dx, ref["subsample_dx"]), rel_l2(dcoef, ref["subsample_dcoef"]),
                     rel_l2(dbias, ref["subsample_dbias"])]
        cp.cuda.Device().synchronize()
        return max(errs + [rel_l2(v, ref[key]) for key, v in got.items()])

    return Launch(f"backward:pool k{k} s{s}", "max-pool, subsample, avg-pool x (2,3,11,10)",
                  BACKWARD_TOLERANCE, check)


def _trainer(rng: Rng, mode: str, optimizer: str) -> tuple[Any, np.ndarray, np.ndarray]:
    """A fused trainer on random raw bytes (a black band in some, as real backgrounds)."""
    from convolab.gpu.trainer import Recipe, Trainer

    raw = rng.integers(0, 256, (TRAIN_IMAGES, IMAGE_SIDE, IMAGE_SIDE), dtype=np.uint8)
    raw[: TRAIN_IMAGES // 4, : IMAGE_SIDE // 4] = 0
    labels = rng.integers(0, 10, TRAIN_IMAGES).astype(np.uint8)
    adam = optimizer == "adam"
    recipe = Recipe(batch=TRAIN_BATCH, epochs=1, optimizer=optimizer, lr=3e-3 if adam else 0.01,
                    mirror=adam, smoothing=0.1 if adam else 0.0)
    return Trainer(raw, labels, recipe, seed=int(rng.integers(1 << 16)), mode=mode), raw, labels


def _trainer_state(t: Any) -> dict[str, np.ndarray]:
    return {k: getattr(t, k)[:TRAIN_BATCH].get() for k in ("pool1", "arg1", "feat", "arg2")}


def _trainer_forward_launch(mode: str) -> Launch:
    """Kernels 31/32 (37/38 in tf32 and bf16), each on its own input, against float64 on the
    same operands rounded to the mode's precision (the kernels' arithmetic: fp32 tolerance)."""
    def check(rng: Rng) -> float:
        from convolab.models import conv_blocks
        from convolab.train_reference import conv_block, input_images

        t, raw, _ = _trainer(rng, mode, "adam")
        t.pool1.fill(np.nan)
        t.feat.fill(np.nan)
        index = rng.choice(TRAIN_IMAGES, TRAIN_BATCH, replace=False)
        t.gradients(index)
        got, p = _trainer_state(t), t.state_dict()
        c1, c2 = conv_blocks("ece408", 1)
        x = input_images(raw, index, int(t.salt.get()[0]))
        want1 = conv_block(x, p["c1.weight"], p["c1.bias"], c1.pool, TRAIN_MODES[mode])
        pool1 = got["pool1"].reshape(want1["pool"].shape)
        want2 = conv_block(pool1, p["c3.weight"], p["c3.bias"], c2.pool, TRAIN_MODES[mode])
        return max(rel_l2(pool1, want1["pool"]),
                   rel_l2(got["feat"], want2["pool"].reshape(TRAIN_BATCH, -1)))

    return Launch(f"trainer:{mode}:forward",
                  f"fused trainer {mode}: conv forwards from raw bytes (mirrored), batch "
                  f"{TRAIN_BATCH}, vs fp64 on {TRAIN_MODES[mode]}-rounded operands",
                  TOLERANCE["fp32"], check)


def _trainer_step_launch(mode: str, optimizer: str) -> Launch:
    def check(rng: Rng) -> float:
        from convolab.train_reference import input_images, routed_gradients

        t, raw, labels = _trainer(rng, mode, optimizer)
        index = rng.choice(TRAIN_IMAGES, TRAIN_BATCH, replace=False)
        _, grads = t.gradients(index)
        got = _trainer_state(t)
        x = input_images(raw, index, int(t.salt.get()[0]))
        _, want = routed_gradients(t.state_dict(), x, labels[index], got["pool1"], got["feat"],
                                   got["arg1"], got["arg2"], t.recipe.smoothing)
        err = max(rel_l2(grads[k], v) for k, v in want.items())
        t.run_epoch()  # the captured epoch: every kernel of the step, the optimizer's update
        stats = t.epoch_stats()
        held = t.upload(raw[:9], labels[:9])
        finite = np.isfinite([stats.loss, t.evaluate(*held).loss]).all()
        return err if finite else float("inf")

    return Launch(f"trainer:{mode}:{optimizer}",
                  f"fused trainer {mode}: gradient step vs routed fp64, batch {TRAIN_BATCH}; "
                  f"an epoch ({optimizer}); an evaluation of 9", GRADIENT_TOLERANCE, check)


def launches() -> list[Launch]:
    """Everything the script launches, in order; built without CuPy."""
    out: list[Launch] = []
    for impl in all_impls("gpu"):
        shape = shape_for(impl)
        if shape is None:
            raise ValueError(f"sanitize: no candidate shape fits {impl.name!r}; add one to "
                             "CANDIDATE_SHAPES")
        out.append(_conv_launch(impl, shape))
    out += [_network_launch(mode, raw=raw) for mode in NETWORK_MODES for raw in (False, True)]
    out += [_network_launch(mode, model, raw=True)
            for model in MODELS if model != "ece408" for mode in NETWORK_MODES]
    out.append(_resize_launch())
    out += [_head_launch(imgs) for imgs in HEAD_IMGS_CHOICES]
    out += [_conv_backward_launch(stride, method, taps, need_dx)
            for stride in (1, 2, 3)
            for method, taps in (("gemm", 9), ("direct", 9), ("direct", 0))
            for need_dx in (True, False)]
    out += [_pool_launch(k, s) for k, s in ((2, 2), (4, 4), (3, 2), (2, 1))]
    out += [launch for mode in TRAIN_MODES for launch in (
        _trainer_forward_launch(mode), _trainer_step_launch(mode, "adam"),
        _trainer_step_launch(mode, "sgd"))]
    return out


def selected(only: str | None) -> list[Launch]:
    """The launches whose name matches the regular expression `only` (all without it)."""
    pattern = re.compile(only) if only else None
    chosen = [launch for launch in launches() if pattern is None or pattern.search(launch.name)]
    if not chosen:
        raise ValueError(f"sanitize: no launch name matches {only!r} (see --list)")
    return chosen


def run_all(seed: int, only: str | None = None) -> int:
    """Runs every selected launch; prints one line each; returns how many missed their
    tolerance."""
    rng = np.random.default_rng(seed)
    failed = 0
    chosen = selected(only)
    for launch in chosen:
        err = launch.check(rng)
        ok = bool(np.isfinite(err)) and err <= launch.tolerance
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {launch.name:45s} rel_l2 {err:.2e} "
              f"(tol {launch.tolerance:.0e})  {launch.what}", flush=True)
    print(f"sanitize: {len(chosen)} launches, {failed} failed (seed {seed})")
    return failed


# ---- summary of the sanitizer logs -----------------------------------------------------------
# racecheck reports "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
_ERRORS = re.compile(r"(?:ERROR SUMMARY:\s*|hazards displayed \()(\d+)\s+error")
_HAZARDS = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazard")
_LAUNCHES = re.compile(r"sanitize: (\d+) launches, (\d+) failed")


def summarize_log(tool: str, text: str) -> str:
    """One line for one tool's log: errors (hazards for racecheck), launches checked."""
    errors = _ERRORS.search(text)
    hazards = _HAZARDS.search(text)
    done = _LAUNCHES.search(text)
    parts = [f"{tool:9s}"]
    parts.append(f"errors {errors.group(1) if errors else '?'}")
    if tool == "racecheck":
        parts.append(f"hazards {hazards.group(1) if hazards else '?'}")
    if done:
        parts.append(f"launches {done.group(1)} ({done.group(2)} wrong vs fp64)")
    else:
        parts.append("did not finish (timed out or crashed: see the log)")
    return "  ".join(parts)


def write_summary(folder: Path) -> Path:
    lines = [f"compute-sanitizer over benchmarks/sanitize.py ({len(launches())} launches: "
             f"{len(all_impls('gpu'))} GPU implementations, {len(NETWORK_MODES)} network modes, "
             f"{len(HEAD_IMGS_CHOICES)} head variants, training kernels)"]
    for tool in SANITIZER_TOOLS:
        log = folder / f"sanitize_{tool}.txt"
        lines.append(summarize_log(tool, log.read_text(errors="replace")) if log.is_file()
                     else f"{tool:9s}  not run")
    target = folder / SUMMARY_FILE
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{SUMMARY_FILE}.")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", "--dry-run", action="store_true", dest="list_only",
                        help="print what would be launched; needs no GPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", metavar="REGEX",
                        help="launch only those whose name matches, e.g. 'network|resize'")
    parser.add_argument("--summarize", type=Path, metavar="DIR",
                        help=f"write DIR/{SUMMARY_FILE} from DIR/sanitize_<tool>.txt")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        print(write_summary(args.summarize).read_text(), end="")
        return 0
    if args.list_only:
        for launch in selected(args.only):
            print(f"{launch.name:45s} {launch.what}")
        return 0
    return 1 if run_all(args.seed, args.only) else 0


if __name__ == "__main__":
    sys.exit(main())
