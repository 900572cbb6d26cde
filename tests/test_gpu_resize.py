"""Raw uint8 images resized on the GPU (kernels/25_resize_u8.cu) against data.resize_bilinear:
bit for bit, on every Fashion-MNIST image and on random sizes, with and without a gather index."""

from __future__ import annotations

import numpy as np
import pytest

from convolab import data
from convolab.errors import InputError
from convolab.gpu.resize import TAP_DTYPE, resize_taps
from convolab.models import MODELS


def test_tap_table_matches_the_cpu_rule(rng: np.random.Generator) -> None:
    in_h, in_w, out_h, out_w = (int(v) for v in rng.integers(1, 120, 4))
    taps = resize_taps(in_h, in_w, out_h, out_w)
    assert TAP_DTYPE.itemsize == 12  # struct ResizeTap {int lo, hi; float t;}
    for part, n_in, n_out in ((taps[:out_h], in_h, out_h), (taps[out_h:], in_w, out_w)):
        lo, hi, t = data.bilinear_taps(n_in, n_out)
        assert np.array_equal(part["lo"], lo) and np.array_equal(part["hi"], hi)
        assert np.array_equal(part["t"], t.astype(np.float32))
        assert part["lo"].min() >= 0 and part["hi"].max() <= n_in - 1


ZOO_SIZES = sorted({m.input_size for m in MODELS.values()})  # what the zoo resizes to


@pytest.mark.gpu
@pytest.mark.parametrize("size", ZOO_SIZES)
def test_every_dataset_image_resizes_bit_identically(size: int) -> None:
    import cupy as cp

    from convolab.gpu.resize import resize_u8

    for split in ("train", "test"):
        raw, _ = data.load_split(split)
        want = data.resize_bilinear(raw, size)
        got = cp.full(want.shape, cp.nan, cp.float32)  # poisoned: a skipped pixel fails
        resize_u8(cp.asarray(raw), size, out=got)
        got = cp.asnumpy(got)
        mismatched = int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32)))
        assert mismatched == 0, f"{split}, {size}x{size}: {mismatched} pixels differ"


@pytest.mark.gpu
def test_random_sizes_and_gather_index(rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.resize import resize_u8

    for _ in range(6):
        n = int(rng.integers(1, 40))
        in_h, in_w, size = (int(v) for v in rng.integers(1, 100, 3))
        raw = rng.integers(0, 256, (n, in_h, in_w), dtype=np.uint8)
        index = rng.integers(0, n, int(rng.integers(1, 50)))
        want = data.resize_bilinear(raw[index], size)
        got = cp.asnumpy(resize_u8(cp.asarray(raw), size, index=cp.asarray(index)))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (in_h, in_w, size)


@pytest.mark.gpu
def test_resize_refuses_what_is_not_raw_bytes() -> None:
    import cupy as cp

    from convolab.gpu.resize import resize_u8

    with pytest.raises(InputError, match="uint8"):
        resize_u8(cp.zeros((2, 28, 28), cp.float32), 86)
    with pytest.raises(InputError, match=r"\(N, H, W\)"):
        resize_u8(cp.zeros((2, 1, 28, 28), cp.uint8), 86)
