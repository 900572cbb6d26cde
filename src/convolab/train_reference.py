"""fp64 yardsticks of the fused training step (kernels 31-38, gpu/trainer.py), NumPy only.

`forward_blocks` is the network's two conv blocks with each window's argmax byte, as the
forward kernels keep them; `routed_gradients` is the whole backward in float64 *routed through
the device's own argmax bytes and activations*. A tf32 or bf16 forward moves near-tied pool
windows to a neighbouring maximum; routed through the same choices, the backward (fp32 in every
mode) must still match float64 to fp32 rounding, whatever the mode.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from convolab import data, models
from convolab.conv_cpu import conv_reference
from convolab.precision import TOLERANCE

ARG_DEAD = 0xFF  # train_lenet.cuh: the window's maximum was <= 0 (the ReLU cut it)
MODEL = "ece408"


def round_to(x: np.ndarray, precision: str) -> np.ndarray:
    """float32 values rounded as the kernels round operands (tf32: to nearest, ties away,
    cvt.rna; bf16: to nearest even), returned as float64; fp32 is unchanged."""
    if precision not in TOLERANCE:
        raise ValueError(f"unknown precision {precision!r}")
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    if precision == "tf32":
        u = (u + 0x1000) & 0xFFFFE000
    elif precision == "bf16":
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return (u & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)


def mirrored(src: np.ndarray, salt: int) -> np.ndarray:
    """train_lenet.cuh's `mirrored`: whether training image `src` is flipped under `salt`."""
    if salt == 0:
        return np.zeros(np.shape(src), bool)
    s = np.asarray(src).astype(np.uint64) & 0xFFFFFFFF
    m = 0xFFFFFFFF
    h = ((s * 0x9E3779B1) & m) ^ ((salt * 0x85EBCA6B) & m)
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & m
    h ^= h >> 12
    return (h & 1).astype(bool)


def input_images(raw: np.ndarray, index: np.ndarray, salt: int = 0,
                 model: str = MODEL) -> np.ndarray:
    """(B, 1, S, S) float32: the batch raw[index] as kernels 31/35/37 resize it on chip
    (mirrored left-right where the epoch's salt says so)."""
    images = raw[index].copy()
    flip = mirrored(index, salt)
    images[flip] = images[flip][:, :, ::-1]
    return data.resize_bilinear(images, models.spec(model).input_size)


def pool_argmax(y: np.ndarray, pool: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Max-pool (floor) of the conv output y after ReLU: (pooled, argmax bytes, margin). The
    byte is the window's row-major first maximum, ARG_DEAD where that maximum is <= 0; the
    margin is how far the window is from changing its byte (top-two gap, or |max| when the
    ReLU decides), so a lower-precision kernel must agree wherever it is large."""
    b, m, ho, wo = y.shape
    hp, wp = ho // pool, wo // pool
    win = y[:, :, :hp * pool, :wp * pool].reshape(b, m, hp, pool, wp, pool)
    win = win.transpose(0, 1, 2, 4, 3, 5).reshape(b, m, hp, wp, pool * pool)
    arg = win.argmax(axis=-1)
    best = np.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    top2 = np.sort(win, axis=-1)[..., -2:]
    margin = np.minimum(top2[..., 1] - top2[..., 0], np.abs(best))
    alive = best > 0
    return np.where(alive, best, 0.0), np.where(alive, arg, ARG_DEAD).astype(np.uint8), margin


def conv_block(a: np.ndarray, w: np.ndarray, b: np.ndarray, pool: int,
               precision: str = "fp32") -> dict[str, np.ndarray]:
    """One conv block in float64 on its input and weights rounded to `precision` (as kernels
    37 and 38 round them; the bias stays fp32): the conv output, the pooled map after ReLU,
    the argmax bytes and their margins (pool_argmax)."""
    y = conv_reference(round_to(a, precision), round_to(w, precision),
                       np.asarray(b, np.float64))
    pooled, arg, margin = pool_argmax(y, pool)
    return {"conv": y, "pool": pooled, "arg": arg, "margin": margin}


def forward_blocks(params: Mapping[str, np.ndarray], x: np.ndarray, model: str = MODEL,
                   precision: str = "fp32") -> dict[str, np.ndarray]:
    """The two conv blocks chained (conv_block), keyed conv1, pool1, arg1, margin1, conv2, ..."""
    c1, c2 = models.conv_blocks(model, 1)
    out: dict[str, np.ndarray] = {}
    a = np.asarray(x, np.float32)
    for name, block, layer in (("1", c1, "c1"), ("2", c2, "c3")):
        got = conv_block(a, params[f"{layer}.weight"], params[f"{layer}.bias"], block.pool,
                         precision)
        out.update({f"{key}{name}": value for key, value in got.items()})
        a = got["pool"].astype(np.float32)  # the next kernel reads fp32 maps
    return out


def _head(params: Mapping[str, np.ndarray], feat: np.ndarray, labels: np.ndarray,
          smoothing: float) -> tuple[float, dict[str, np.ndarray], np.ndarray]:
    """Loss, the head's gradients and dfeat in float64 from the features."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    f = np.asarray(feat, np.float64).reshape(len(feat), -1)
    pre = f @ p["f5.weight"].T + p["f5.bias"]
    hid = np.maximum(pre, 0.0)
    z = hid @ p["f6.weight"].T + p["f6.bias"]
    logp = z - z.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    classes = z.shape[1]
    target = np.full_like(z, smoothing / classes)
    target[np.arange(len(z)), labels.astype(np.int64)] += 1.0 - smoothing
    loss = float(-(target * logp).sum(axis=1).mean())
    dz = (np.exp(logp) - target) / len(z)
    dh = (dz @ p["f6.weight"]) * (pre > 0)
    grads = {"f6.weight": dz.T @ hid, "f6.bias": dz.sum(0), "f5.weight": dh.T @ f,
             "f5.bias": dh.sum(0)}
    return loss, grads, dh @ p["f5.weight"]


def _unpool(dpool: np.ndarray, arg: np.ndarray, pool: int, out_hw: tuple[int, int]) -> np.ndarray:
    """The conv output's gradient: each window's gradient at its argmax, none where dead."""
    b, m, hp, wp = dpool.shape
    dy = np.zeros((b, m, *out_hw))
    bb, mm, py, px = np.nonzero(arg != ARG_DEAD)
    a = arg[bb, mm, py, px].astype(np.int64)
    dy[bb, mm, py * pool + a // pool, px * pool + a % pool] = dpool[bb, mm, py, px]
    return dy


def _conv_grads(x: np.ndarray, w: np.ndarray, dy: np.ndarray,
                need_dx: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    k, (ho, wo) = w.shape[2], dy.shape[2:]
    dw = np.zeros_like(w)
    dx = np.zeros_like(x) if need_dx else None
    for p in range(k):
        for q in range(k):
            dw[:, :, p, q] = np.einsum("bmhw,bchw->mc", dy, x[:, :, p:p + ho, q:q + wo])
            if dx is not None:
                dx[:, :, p:p + ho, q:q + wo] += np.einsum("bmhw,mc->bchw", dy, w[:, :, p, q])
    return dw, dy.sum(axis=(0, 2, 3)), dx


def routed_gradients(params: Mapping[str, np.ndarray], x: np.ndarray, labels: np.ndarray,
                     pool1: np.ndarray, feat: np.ndarray, arg1: np.ndarray, arg2: np.ndarray,
                     smoothing: float = 0.0, model: str = MODEL
                     ) -> tuple[float, dict[str, np.ndarray]]:
    """(mean loss, every parameter's gradient) in float64, from the device's forward state:
    its pooled maps `pool1` (B, C, H, W), features `feat` and argmax bytes `arg1`, `arg2`
    (shaped as pool1 and as the pooled conv2 output); `x` the images as the kernels saw them."""
    c1, c2 = models.conv_blocks(model, 1)
    b = len(x)
    side1 = c1.shape.H_out // c1.pool
    pool1 = np.asarray(pool1).reshape(b, c1.shape.M, side1, side1)
    loss, grads, dfeat = _head(params, feat, labels, smoothing)
    side2 = c2.shape.H_out // c2.pool
    arg2 = arg2.reshape(b, c2.shape.M, side2, side2)
    dy2 = _unpool(dfeat.reshape(arg2.shape), arg2, c2.pool, (c2.shape.H_out, c2.shape.W_out))
    w2 = np.asarray(params["c3.weight"], np.float64)
    grads["c3.weight"], grads["c3.bias"], dpool1 = _conv_grads(
        np.asarray(pool1, np.float64), w2, dy2, True)
    dy1 = _unpool(dpool1, arg1.reshape(dpool1.shape), c1.pool, (c1.shape.H_out, c1.shape.W_out))
    grads["c1.weight"], grads["c1.bias"], _ = _conv_grads(
        np.asarray(x, np.float64), np.asarray(params["c1.weight"], np.float64), dy1, False)
    return loss, grads
