"""DLPack in, the caller's kind of array out: NumPy's own __dlpack__ and a bare protocol
object prove the path without torch; torch itself when installed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from convolab.errors import InputError, InputTypeError
from convolab.interop import to_xp


class Bare:
    """Exposes only the DLPack protocol, like a foreign framework's tensor."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._a.__dlpack_device__()


def test_dlpack_object_is_shared_not_copied(rng: np.random.Generator) -> None:
    a = rng.random((2, 3), dtype=np.float32)
    arr, kind = to_xp(Bare(a), "x")
    assert kind.device == "cpu" and kind.name == "dlpack"
    a[0, 0] = 42.0
    assert arr[0, 0] == 42.0  # zero-copy: the same memory


def test_float64_converted_and_non_contiguous_made_contiguous(rng: np.random.Generator) -> None:
    a = rng.random((4, 6))
    arr, _ = to_xp(a[:, ::2], "x")
    assert arr.dtype == np.float32 and arr.flags.c_contiguous
    np.testing.assert_array_equal(arr, a[:, ::2].astype(np.float32))


@pytest.mark.parametrize(("value", "error", "needle"), [
    ([[1.0]], InputTypeError, "got list"),
    (np.zeros((1, 1, 2, 2), np.int32), InputTypeError, "int32"),
    (np.zeros((2, 2), np.float32), InputError, "must be 4-D"),
])
def test_bad_arrays_are_one_clear_error(value: Any, error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        to_xp(value, "x", ndim=4)


def test_unknown_dlpack_device_is_refused() -> None:
    class OnTPU(Bare):
        def __dlpack_device__(self) -> tuple[int, int]:
            return (99, 0)

    with pytest.raises(InputError, match="device type 99"):
        to_xp(OnTPU(np.zeros(1, np.float32)), "x")


def test_torch_round_trip(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    import convolab

    x = torch.from_numpy(rng.random((1, 2, 9, 9), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal((3, 2, 3, 3)).astype(np.float32))
    y = convolab.conv2d(x, w, impl="cpu-ref")
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, torch.nn.functional.conv2d(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_torch_cuda_tensors_stay_on_the_gpu(rng: np.random.Generator) -> None:
    """CUDA torch tensors in, CUDA torch tensors out (DLPack both ways), equal to torch's own
    conv2d and to its conv + ReLU + max-pool."""
    torch = pytest.importorskip("torch")
    import convolab

    x = torch.from_numpy(rng.random((3, 4, 40, 40), dtype=np.float32)).cuda()
    w = torch.from_numpy((rng.standard_normal((16, 4, 7, 7)) * 0.1).astype(np.float32)).cuda()
    b = torch.from_numpy((rng.standard_normal(16) * 0.1).astype(np.float32)).cuda()
    F = torch.nn.functional
    y = convolab.conv2d(x, w, b)
    assert isinstance(y, torch.Tensor) and y.is_cuda
    torch.testing.assert_close(y, F.conv2d(x, w, b), rtol=1e-4, atol=1e-4)
    pooled = convolab.conv2d_relu_pool(x, w, b, pool=4)
    assert isinstance(pooled, torch.Tensor) and pooled.is_cuda
    torch.testing.assert_close(pooled, F.max_pool2d(F.relu(F.conv2d(x, w, b)), 4),
                               rtol=1e-4, atol=1e-4)
