"""The fused trainer's precision modes (`convolab train --mode exact|tf32|bf16`): kernels 37
and 38 (the conv forwards on tensor cores) run on the CPU by an emulator against float64 on
identically rounded operands; on the GPU every mode's forward against float64, the whole
step's gradients against a float64 backward routed through the device's own argmax bytes,
and a short run per mode that must learn."""

from __future__ import annotations

import numpy as np
import pytest
import train_emulator as emu

from convolab import data, models
from convolab import train_reference as ref
from convolab.check import rel_l2
from convolab.conv_cpu import conv_reference
from convolab.gpu import trainer as tr
from convolab.precision import TOLERANCE, TRAIN_MODES

MMA_MODES = [m for m in TRAIN_MODES if m != "exact"]


def _emulator(tmp_path, layer: str, mode: str):
    """(binary, threads) of the mode's forward kernel for conv block `layer` (conv1_fwd or
    conv2_fwd), with the trainer's own defines."""
    filename, name = tr.kernel_files(mode)[layer]
    io = emu.CONV1 if layer == "conv1_fwd" else emu.CONV2
    return (emu.build(tmp_path, filename, name, io, tr.mode_defines(mode)),
            tr.threads(layer, mode))


def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """models.build's init with random biases (a zero bias would hide a bias bug)."""
    p = {k: np.asarray(v, np.float32)
         for k, v in models.build(tr.MODEL, int(rng.integers(1 << 30))).params().items()}
    for k in p:
        if k.endswith(".bias"):
            p[k] = (0.1 * rng.standard_normal(p[k].shape)).astype(np.float32)
    return p


def _check_block(got: np.ndarray, arg: np.ndarray, want: dict[str, np.ndarray], block: str,
                 tol: float, margin: float, ties: bool = False) -> None:
    """Pooled outputs within `tol` of float64 and every argmax byte equal where the window's
    float64 margin exceeds `margin` (relative to the conv output's RMS). With `ties`, the
    inputs hold all-zero regions: windows of exactly equal live outputs (each the bias) must
    name their first position, as on the CPU."""
    pooled, want_arg = want[f"pool{block}"], want[f"arg{block}"]
    assert np.isfinite(got).all(), "unwritten or non-finite outputs"
    assert rel_l2(got.reshape(pooled.shape), pooled) <= tol
    clear = want[f"margin{block}"] > margin * np.sqrt(np.mean(want[f"conv{block}"] ** 2))
    assert clear.mean() > 0.3, "the check would cover too few windows"
    got_arg = arg.reshape(want_arg.shape)
    np.testing.assert_array_equal(got_arg[clear], want_arg[clear])
    if ties:
        tied = (want[f"margin{block}"] == 0) & (want_arg != ref.ARG_DEAD)
        assert tied.any(), "no tied window to check"
        np.testing.assert_array_equal(got_arg[tied], want_arg[tied])


# ------------------------------------------------------------------ emulated on the CPU


@pytest.mark.skipif(emu.GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("mode", list(TRAIN_MODES))
def test_conv1_forward_emulated(mode: str, tmp_path, rng) -> None:
    """Kernel 37 (31 for exact) on random raw bytes through a shuffled index, mirrored by the
    hash, against float64 on the same rounded operands: only the fp32 summation order differs."""
    exe, threads = _emulator(tmp_path, "conv1_fwd", mode)
    params = _params(rng)
    n, blocks = 5, 2
    raw = rng.integers(0, 256, (n, tr.RAW_SIDE, tr.RAW_SIDE), dtype=np.uint8)
    raw[:, :tr.RAW_SIDE // 3] = 0  # a black band: tied windows (the bias alone)
    params["c1.bias"] = np.abs(params["c1.bias"])  # ...alive
    index = rng.choice(n, blocks, replace=False).astype(np.int64)
    salt = np.array([rng.integers(1, 1 << 32)], np.uint32)
    pooled1, _ = tr._pool_side(tr.MODEL)
    out = emu.run(exe, tmp_path, blocks, threads,
                  {"raw": raw, "index": index, "taps": emu.taps_bytes(), "salt": salt,
                   "w1": params["c1.weight"], "b1": params["c1.bias"]},
                  {"pool1": ((blocks, pooled1), np.float32), "arg1": ((blocks, pooled1), np.uint8)},
                  str(n))
    x = ref.input_images(raw, index, int(salt[0]))
    want = ref.forward_blocks(params, x, precision=TRAIN_MODES[mode])
    _check_block(out["pool1"], out["arg1"], want, "1", 1e-6, 1e-4, ties=True)


@pytest.mark.skipif(emu.GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("mode", list(TRAIN_MODES))
def test_conv2_forward_emulated(mode: str, tmp_path, rng) -> None:
    """Kernel 38 (32 for exact) on random non-negative maps (as a ReLU leaves them) against
    float64 on the same rounded operands."""
    exe, threads = _emulator(tmp_path, "conv2_fwd", mode)
    params = _params(rng)
    c1, c2 = models.conv_blocks(tr.MODEL, 1)
    side = c1.shape.H_out // c1.pool
    blocks = 2
    pool1 = np.maximum(rng.standard_normal((blocks, c1.shape.M, side, side)), 0).astype(np.float32)
    pool1[:, :, : side // 3] = 0  # a dead band: tied windows (the bias alone)
    params["c3.bias"] = np.abs(params["c3.bias"])  # ...alive
    pooled1, feat = tr._pool_side(tr.MODEL)
    out = emu.run(exe, tmp_path, blocks, threads,
                  {"pool1": pool1, "w2": params["c3.weight"], "b2": params["c3.bias"]},
                  {"feat": ((blocks, feat), np.float32), "arg2": ((blocks, feat), np.uint8)})
    y = conv_reference(ref.round_to(pool1, TRAIN_MODES[mode]),
                           ref.round_to(params["c3.weight"], TRAIN_MODES[mode]),
                           params["c3.bias"].astype(np.float64))
    pooled, arg, margin = ref.pool_argmax(y, c2.pool)
    want = {"pool2": pooled, "arg2": arg, "margin2": margin, "conv2": y}
    _check_block(out["feat"], out["arg2"], want, "2", 1e-6, 1e-4, ties=True)
