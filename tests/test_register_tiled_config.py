"""Rung 7's launch configuration (`ladder.register_tiled_config`) on the CPU: whatever it picks
for a shape, the block respects the kernel's thread limit, the staged channels fit the static
shared-memory limit, the tiles cover the whole output, and explicit parameters are honoured.
"""

from __future__ import annotations

import numpy as np
import pytest

from convolab.gpu import ladder
from convolab.gpu.device import SMEM_STATIC_LIMIT
from convolab.models import MODELS, conv_blocks
from convolab.shapes import ConvShape, ceil_div

N_SHAPES = 2000


def random_shape(rng: np.random.Generator) -> ConvShape:
    k, s = int(rng.integers(1, 12)), int(rng.integers(1, 6))
    return ConvShape(int(rng.integers(1, 5)), int(rng.integers(1, 65)),
                     int(rng.integers(k, 300)), int(rng.integers(k, 300)),
                     int(rng.integers(1, 65)), k, s)


def random_params(rng: np.random.Generator) -> dict[str, int]:
    choices = {"TM": (0, 4, 8, 16), "TN": (0, 1, 2, 4, 8), "BX": (0, 16, 32, 64, 128),
               "BY": (0, 1, 2, 4), "CCH": (0, 1, 4, 16), "PIPE": (0, 1), "QU": (0, 1)}
    return {k: int(rng.choice(v)) for k, v in choices.items() if rng.random() < 0.5}


def assert_rules(shape: ConvShape, params: dict[str, int], cfg: dict[str, int]) -> None:
    tm, tn, bx, by, cch = cfg["TM"], cfg["TN"], cfg["BX"], cfg["BY"], cfg["CCH"]
    assert tm in (4, 8, 16) and tn in (1, 2, 4, 8)
    assert 1 <= bx * by <= ladder.REGISTER_TILED_MAX_THREADS
    copies = 2 if cfg["PIPE"] else 1
    per_channel = ladder.register_tiled_channel_bytes(shape, tm, tn, bx, by)
    assert 1 <= cch <= shape.C
    assert cch * per_channel <= SMEM_STATIC_LIMIT // copies - 16 or cch == 1
    assert per_channel <= SMEM_STATIC_LIMIT // copies - 16
    # The grid (ceil(W_out/BX) x ceil(H_out/(BY*TN)) tiles, ceil(M/TM) channel groups)
    # covers every output element, and no whole tile row/column lies past the output.
    tiles_w, tiles_h = ceil_div(shape.W_out, bx), ceil_div(shape.H_out, by * tn)
    assert tiles_w * bx >= shape.W_out > (tiles_w - 1) * bx
    assert tiles_h * by * tn >= shape.H_out > (tiles_h - 1) * by * tn
    assert ceil_div(shape.M, tm) * tm >= shape.M
    assert cfg["STRIDE"] == (1 if shape.S == 1 else 0)
    for key in ("TM", "TN", "PIPE", "QU"):  # never shrunk to fit
        if params.get(key):
            assert cfg[key] == params[key]
    if not params.get("TM"):  # the smallest channel tile that covers M
        assert tm == min(t for t in (4, 8, 16) if t >= min(shape.M, 16))


def test_random_shapes_follow_the_rules(rng: np.random.Generator) -> None:
    fitted = 0
    for _ in range(N_SHAPES):
        shape, params = random_shape(rng), random_params(rng)
        try:
            cfg = ladder.register_tiled_config(shape, params)
        except ValueError as err:
            assert "register-tiled" in str(err)
            continue
        fitted += 1
        assert_rules(shape, params, cfg)
    assert fitted > N_SHAPES // 2


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("pipe", [0, 1])
def test_zoo_layers_get_a_config(model: str, pipe: int) -> None:
    for block in conv_blocks(model, 10_000):
        cfg = ladder.register_tiled_config(block.shape, {"PIPE": pipe})
        assert_rules(block.shape, {"PIPE": pipe}, cfg)


def test_bad_parameters_are_refused() -> None:
    shape = conv_blocks("ece408", 1)[1].shape
    for params in ({"TM": 5}, {"TN": 3}, {"BX": 300}, {"BX": 64, "BY": 8}, {"PIPE": 2}):
        with pytest.raises(ValueError, match="register-tiled"):
            ladder.register_tiled_config(shape, params)
