"""Fashion-MNIST data layer: real files, look-up order, verified downloads from a local HTTP
server (never the internet), corruption handling, and the half-pixel bilinear resize."""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from convolab import data, models
from convolab.errors import DataError, InputError

SIZE = models.spec("ece408").input_size  # the course network's input side
REAL_DIR = data.SYSTEM_DATA_DIR  # captured before any test monkeypatches it
needs_real = pytest.mark.skipif(
    not all((REAL_DIR / name).is_file() for name in data.FILES),
    reason=f"Fashion-MNIST not installed in {REAL_DIR} (apt-get install dataset-fashion-mnist)",
)
LABELS = "t10k-labels-idx1-ubyte.gz"
IMAGES = "t10k-images-idx3-ubyte.gz"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets an empty cache, no $CONVOLAB_DATA, and a mirror nobody listens on, so no
    test can touch the user's cache or the internet by accident."""
    cache = tmp_path / "cache"
    monkeypatch.delenv("CONVOLAB_DATA", raising=False)
    monkeypatch.setenv("CONVOLAB_CACHE", str(cache))
    monkeypatch.setenv("CONVOLAB_MIRROR", "http://127.0.0.1:9/")  # discard port: refused
    for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return cache


def linked_copy(folder: Path, skip: tuple[str, ...] = ()) -> Path:
    """A folder holding the real files as symlinks (cheap), except those in `skip`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in data.FILES:
        if name not in skip:
            (folder / name).symlink_to(REAL_DIR / name)
    return folder


def real_payload(name: str) -> bytes:
    return gzip.decompress((REAL_DIR / name).read_bytes())


# Each builder turns the real labels payload into the bytes of a broken .gz file, with the
# fragment the error message must contain.
def truncated_gzip(payload: bytes) -> bytes:
    packed = gzip.compress(payload)
    return packed[: len(packed) // 2]


def wrong_magic(payload: bytes) -> bytes:
    return gzip.compress(data.IMAGES_MAGIC.to_bytes(4, "big") + payload[4:])


def wrong_length(payload: bytes) -> bytes:
    return gzip.compress(payload[:-1])


def too_long(payload: bytes) -> bytes:
    return gzip.compress(payload + b"\x00")


def one_byte_changed(payload: bytes) -> bytes:
    changed = bytearray(payload)
    changed[8 + 123] = (changed[8 + 123] + 1) % 10  # still a valid label: only the hash can tell
    return gzip.compress(bytes(changed))


def not_gzip(payload: bytes) -> bytes:
    return payload


CORRUPTIONS: list[tuple[Callable[[bytes], bytes], str]] = [
    (truncated_gzip, "truncated gzip"),
    (wrong_magic, "magic"),
    (wrong_length, "wrong length"),
    (too_long, "wrong length"),
    (one_byte_changed, "checksum mismatch"),
    (not_gzip, "not a valid gzip"),
]
CORRUPTION_IDS = [builder.__name__ for builder, _ in CORRUPTIONS]


# ----------------------------------------------------------------------------- local HTTP mirror


@dataclass
class Mirror:
    root: Path
    url: str
    statuses: dict[str, int] = field(default_factory=dict)  # file name -> forced HTTP error
    stall_s: float = 0.0
    trickle_s: float = 0.0  # > 0: send one byte per this many seconds, claiming 1 MB
    requests: list[str] = field(default_factory=list)


class _MirrorHandler(SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        mirror: Mirror = self.server.mirror  # type: ignore[attr-defined]
        name = self.path.lstrip("/")
        mirror.requests.append(name)
        try:
            if mirror.stall_s:
                time.sleep(mirror.stall_s)
            if name in mirror.statuses:
                self.send_error(mirror.statuses[name])
                return
            if mirror.trickle_s:
                self._trickle(mirror.trickle_s)
                return
            super().do_GET()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up first (the time-out test): expected, not worth a trace

    def _trickle(self, every_s: float) -> None:
        """A mirror that never stalls long enough for a per-read time-out, and never ends."""
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        for _ in range(1 << 20):
            self.wfile.write(b"\x1f")
            self.wfile.flush()
            time.sleep(every_s)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (base signature)
        pass


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mirror]:
    """An HTTP server on 127.0.0.1 (free port, own thread) serving tmp_path/mirror; the system
    folder is pointed at an empty directory so look-up must download."""
    root = tmp_path / "mirror"
    root.mkdir()
    handler = functools.partial(_MirrorHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    host, port = server.server_address[:2]
    served = Mirror(root=root, url=f"http://{host}:{port}/")
    server.mirror = served  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("CONVOLAB_MIRROR", served.url)
    empty_system = tmp_path / "no-system-data"
    empty_system.mkdir()
    monkeypatch.setattr(data, "SYSTEM_DATA_DIR", empty_system)
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# ----------------------------------------------------------------------------- real files


@needs_real
def test_real_files_match_their_published_payload_hashes() -> None:
    for name, expected in data.FILES.items():
        assert hashlib.sha256(real_payload(name)).hexdigest() == expected, name
        data.verify_file(REAL_DIR / name)  # the module's own check agrees


@needs_real
def test_real_test_split_loads_with_correct_shapes_and_labels() -> None:
    assert data.find_dataset() == REAL_DIR  # empty cache, nothing explicit: the system folder
    images, labels = data.load_split("test")
    assert images.shape == (10_000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10_000,) and labels.dtype == np.uint8
    assert set(np.unique(labels)) == set(range(10))
    assert len(data.CLASS_NAMES) == 10
    # Independent parse of the same payload: header skipped, bytes as they are.
    payload = real_payload(IMAGES)
    expected = np.frombuffer(payload, np.uint8, offset=16).reshape(10_000, 28, 28)
    np.testing.assert_array_equal(images, expected)
    images[0, 0, 0] ^= 0xFF  # callers get copies: mutating one must not leak into the memo
    again, _ = data.load_split("test")
    assert again[0, 0, 0] == expected[0, 0, 0]


@needs_real
def test_real_train_split_and_limit() -> None:
    images, labels = data.load_split("train", limit=500)
    assert images.shape == (500, 28, 28) and labels.shape == (500,)
    full_labels = np.frombuffer(real_payload("train-labels-idx1-ubyte.gz"), np.uint8, offset=8)
    assert len(full_labels) == 60_000
    np.testing.assert_array_equal(labels, full_labels[:500])


@needs_real
def test_load_images_scales_and_resizes() -> None:
    x86, y = data.load_images("test", n=64)
    assert x86.shape == (64, 1, SIZE, SIZE) and x86.dtype == np.float32
    assert y.dtype == np.int64 and y.shape == (64,)
    assert x86.min() >= 0.0 and x86.max() <= 1.0
    raw, raw_labels = data.load_split("test", limit=64)
    np.testing.assert_array_equal(y, raw_labels.astype(np.int64))
    x28, _ = data.load_images("test", n=64, size=28)
    assert x28.shape == (64, 1, 28, 28)
    np.testing.assert_array_equal(x28[:, 0], raw.astype(np.float32) / np.float32(255))


@pytest.mark.parametrize("limit", [0, -1, 10_001])
@needs_real
def test_limit_out_of_range_is_rejected(limit: int) -> None:
    with pytest.raises(ValueError, match="limit"):
        data.load_split("test", limit=limit)


def test_unknown_split_is_rejected() -> None:
    with pytest.raises(ValueError, match="split"):
        data.load_split("validation")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- look-up order


@needs_real
def test_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated: Path) -> None:
    explicit = linked_copy(tmp_path / "explicit")
    from_env = linked_copy(tmp_path / "env")
    cache = linked_copy(isolated)
    system = linked_copy(tmp_path / "system")
    monkeypatch.setattr(data, "SYSTEM_DATA_DIR", system)
    monkeypatch.setenv("CONVOLAB_DATA", str(from_env))

    assert data.find_dataset(explicit) == explicit  # explicit beats env
    assert data.find_dataset() == from_env  # env beats cache
    monkeypatch.delenv("CONVOLAB_DATA")
    assert data.find_dataset() == cache  # cache beats system
    (cache / LABELS).unlink()  # an incomplete cache is not used...
    assert data.find_dataset() == system  # ...the system folder is
    (system / IMAGES).unlink()
    # Nothing complete anywhere: a download is attempted (the mirror refuses) and names a file.
    with pytest.raises(DataError, match=r"ubyte\.gz.*download from http://127\.0\.0\.1:9/"):
        data.find_dataset()
    assert not any(p.name.endswith(".part") for p in cache.iterdir())


@needs_real
def test_xdg_cache_home_used_without_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONVOLAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    expected = tmp_path / "xdg" / "convolab" / "fashion-mnist"
    assert data.cache_dir() == expected
    linked_copy(expected)
    assert data.find_dataset() == expected


@pytest.mark.parametrize("via_env", [False, True], ids=["data_dir", "CONVOLAB_DATA"])
@needs_real
def test_named_folder_missing_a_file_is_an_error_not_a_fall_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via_env: bool
) -> None:
    folder = linked_copy(tmp_path / "partial", skip=(LABELS,))
    if via_env:
        monkeypatch.setenv("CONVOLAB_DATA", str(folder))
    origin = "CONVOLAB_DATA" if via_env else "data-dir"
    with pytest.raises(DataError, match=rf"{origin}.*missing {LABELS}") as caught:
        data.find_dataset(None if via_env else folder)
    assert str(folder) in str(caught.value)
    status = data.dataset_status(None if via_env else folder)
    assert status["found"] is False and LABELS in status["reason"]


def test_named_folder_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such directory"):
        data.find_dataset(tmp_path / "nowhere")


@needs_real
def test_dataset_status_reports_location_and_verification(tmp_path: Path) -> None:
    status = data.dataset_status()
    assert status["found"] and status["source"] == "system" and status["verified"] is True
    broken = linked_copy(tmp_path / "broken", skip=(LABELS,))
    (broken / LABELS).write_bytes(one_byte_changed(real_payload(LABELS)))
    status = data.dataset_status(broken)
    assert status["found"] and status["verified"] is False
    assert LABELS in status["reason"] and "checksum mismatch" in status["reason"]


# ----------------------------------------------------------------------------- corrupt local files


@pytest.mark.parametrize(("corrupt", "message"), CORRUPTIONS, ids=CORRUPTION_IDS)
@needs_real
def test_corrupt_local_file_raises_naming_it(
    tmp_path: Path, corrupt: Callable[[bytes], bytes], message: str
) -> None:
    folder = linked_copy(tmp_path / "local", skip=(LABELS,))
    bad = folder / LABELS
    bad.write_bytes(corrupt(real_payload(LABELS)))
    with pytest.raises(DataError, match=message) as caught:
        data.load_split("test", data_dir=folder)
    assert str(bad) in str(caught.value)


def test_images_with_wrong_dimensions_are_rejected(tmp_path: Path) -> None:
    header = np.array([data.IMAGES_MAGIC, 10_000, 28, 27], dtype=">u4").tobytes()
    bad = tmp_path / IMAGES
    bad.write_bytes(gzip.compress(header + bytes(10_000 * 28 * 27), compresslevel=1))
    with pytest.raises(DataError, match="28x27, expected 28x28") as caught:
        data.verify_file(bad)
    assert str(bad) in str(caught.value)


def test_wrong_item_count_is_rejected(tmp_path: Path) -> None:
    header = np.array([data.LABELS_MAGIC, 9_999], dtype=">u4").tobytes()
    bad = tmp_path / LABELS
    bad.write_bytes(gzip.compress(header + bytes(9_999)))
    with pytest.raises(DataError, match="9999 items, expected 10000"):
        data.verify_file(bad)


def test_file_changed_on_disk_is_verified_again(tmp_path: Path) -> None:
    labels = np.arange(10_000, dtype=np.uint8) % 10
    payload = np.array([data.LABELS_MAGIC, 10_000], dtype=">u4").tobytes() + labels.tobytes()
    target = tmp_path / LABELS
    target.write_bytes(gzip.compress(payload))
    with pytest.raises(DataError, match="checksum mismatch"):
        data.verify_file(target)
    if (REAL_DIR / LABELS).is_file():
        target.write_bytes((REAL_DIR / LABELS).read_bytes())
        os.utime(target, ns=(1, 1))  # a different (size, mtime) key than before
        data.verify_file(target)  # the memo must not keep the old failure or skip the check


# ----------------------------------------------------------------------------- downloads


def cache_names(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.exists() else set()


@needs_real
def test_download_from_local_mirror_fills_the_cache(mirror: Mirror, isolated: Path) -> None:
    linked_copy(mirror.root)
    folder = data.find_dataset()
    assert folder == isolated
    assert cache_names(isolated) == set(data.FILES)  # the four files, no temporaries
    assert sorted(mirror.requests) == sorted(data.FILES)
    for name in data.FILES:
        assert not (isolated / name).is_symlink()
        assert (isolated / name).read_bytes() == (REAL_DIR / name).read_bytes()
    images, labels = data.load_split("test", limit=20)
    assert images.shape == (20, 28, 28) and labels.shape == (20,)
    # A second look-up uses the cache and downloads nothing.
    mirror.requests.clear()
    assert data.find_dataset() == isolated and mirror.requests == []


@needs_real
def test_download_only_fetches_missing_files(mirror: Mirror, isolated: Path) -> None:
    linked_copy(mirror.root)
    linked_copy(isolated, skip=(LABELS,))
    assert data.find_dataset() == isolated
    assert mirror.requests == [LABELS]
    assert cache_names(isolated) == set(data.FILES)


@pytest.mark.parametrize(("corrupt", "message"), CORRUPTIONS, ids=CORRUPTION_IDS)
@needs_real
def test_corrupt_download_leaves_nothing_in_the_cache(
    mirror: Mirror, isolated: Path, corrupt: Callable[[bytes], bytes], message: str
) -> None:
    linked_copy(mirror.root, skip=(LABELS,))
    (mirror.root / LABELS).write_bytes(corrupt(real_payload(LABELS)))
    seeded = linked_copy(isolated, skip=(LABELS,))  # only the broken file needs downloading
    with pytest.raises(DataError, match=message) as caught:
        data.find_dataset()
    assert LABELS in str(caught.value) and mirror.url in str(caught.value)
    assert cache_names(seeded) == set(data.FILES) - {LABELS}  # no bad file, no temp file


@pytest.mark.parametrize("code", [404, 500])
@needs_real
def test_http_error_leaves_nothing_in_the_cache(mirror: Mirror, isolated: Path, code: int) -> None:
    linked_copy(mirror.root)
    mirror.statuses[LABELS] = code
    with pytest.raises(DataError, match=rf"{LABELS}.*HTTP {code}"):
        data.download()
    # Files before the failing one are verified and kept (a rerun resumes); the failing one
    # leaves no trace.
    names = cache_names(isolated)
    assert LABELS not in names
    assert not any(name.endswith(".part") or name.startswith(".") for name in names)
    assert names <= set(data.FILES)


def test_missing_file_on_mirror_is_a_404(mirror: Mirror, isolated: Path) -> None:
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz.*HTTP 404"):
        data.find_dataset()
    assert cache_names(isolated) == set()


def test_stalled_mirror_times_out(
    mirror: Mirror, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror.stall_s = 2.0
    monkeypatch.setattr(data, "DOWNLOAD_TIMEOUT_S", 0.3)
    started = time.perf_counter()
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz.*timed out"):
        data.find_dataset()
    assert time.perf_counter() - started < 1.5
    assert cache_names(isolated) == set()


# ----------------------------------------------------------------------------- resize


def resize_reference(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Straight per-pixel fp64 loop of the align_corners=False half-pixel rule."""
    in_h, in_w = image.shape

    def taps(d: int, n_in: int, n_out: int) -> tuple[int, int, float]:
        x = (d + 0.5) * n_in / n_out - 0.5
        x = max(x, 0.0)
        i0 = min(int(math.floor(x)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        return i0, i1, x - i0

    out = np.empty((out_h, out_w), dtype=np.float64)
    for r in range(out_h):
        r0, r1, tr = taps(r, in_h, out_h)
        for c in range(out_w):
            c0, c1, tc = taps(c, in_w, out_w)
            top = (1 - tc) * image[r0, c0] + tc * image[r0, c1]
            bottom = (1 - tc) * image[r1, c0] + tc * image[r1, c1]
            out[r, c] = (1 - tr) * top + tr * bottom
    return out


@pytest.mark.parametrize(("in_side", "out_side"), [(28, SIZE), (28, 13), (5, 7), (28, 28), (3, 1)])
def test_resize_matches_per_pixel_reference(
    rng: np.random.Generator, in_side: int, out_side: int
) -> None:
    images = rng.integers(0, 256, size=(3, in_side, in_side), dtype=np.uint8)
    images[0, 0, 0], images[0, -1, -1] = 0, 255  # the extremes are present
    resized = data.resize_bilinear(images, out_side)
    assert resized.shape == (3, 1, out_side, out_side) and resized.dtype == np.float32
    for image, got in zip(images, resized, strict=True):
        expected = resize_reference(image.astype(np.float64) / 255.0, out_side, out_side)
        np.testing.assert_allclose(got[0], expected, rtol=0, atol=1e-6)
    assert resized.min() >= 0.0 and resized.max() <= 1.0


def test_resize_float_input_is_taken_as_scaled(rng: np.random.Generator) -> None:
    images = rng.random((2, 28, 28))
    resized = data.resize_bilinear(images, SIZE)
    for image, got in zip(images, resized, strict=True):
        np.testing.assert_allclose(got[0], resize_reference(image, SIZE, SIZE), rtol=0, atol=1e-6)


def test_resize_preserves_corners_and_constants(rng: np.random.Generator) -> None:
    images = rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    resized = data.resize_bilinear(images, SIZE)[:, 0]
    scaled = images / 255.0
    # Upsampling: the outermost output centres fall outside the input centres, so they clamp.
    for row, col in [(0, 0), (0, -1), (-1, 0), (-1, -1)]:
        np.testing.assert_allclose(resized[:, row, col], scaled[:, row, col], atol=1e-6)
    for value in (0, 1, 77, 254, 255):
        constant = np.full((2, 28, 28), value, dtype=np.uint8)
        out = data.resize_bilinear(constant, SIZE)
        # a + t * (a - a) == a exactly: constants survive bit for bit.
        np.testing.assert_array_equal(out, np.float32(value) / np.float32(255))


def test_resize_28_is_exactly_the_scaled_input(rng: np.random.Generator) -> None:
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    out = data.resize_bilinear(images, 28)
    np.testing.assert_array_equal(out[:, 0], images.astype(np.float32) / np.float32(255))


def test_resize_many_images_is_fast_and_batch_independent(rng: np.random.Generator) -> None:
    images = rng.integers(0, 256, size=(3000, 28, 28), dtype=np.uint8)  # spans many chunks
    started = time.perf_counter()
    out = data.resize_bilinear(images, SIZE)
    assert time.perf_counter() - started < 5.0  # ~0.07 s expected; generous for a busy machine
    for index in (0, 127, 128, 2999):  # chunk boundaries included
        alone = data.resize_bilinear(images[index : index + 1])[0]
        np.testing.assert_array_equal(out[index], alone)  # bit-identical at any batch size


def test_resize_matches_torch_when_installed(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch", reason="optional cross-check against PyTorch")
    images = rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    ours = data.resize_bilinear(images, SIZE)
    theirs = torch.nn.functional.interpolate(
        torch.from_numpy(images.astype(np.float64) / 255.0)[:, None],
        size=(SIZE, SIZE),
        mode="bilinear",
        align_corners=False,
    ).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("images", "size", "error", "match"),
    [
        (np.zeros((28, 28), np.uint8), SIZE, ValueError, "shape"),
        (np.zeros((1, 28, 28), np.uint8), 0, ValueError, "size"),
        (np.zeros((1, 28, 28), np.int16), SIZE, TypeError, "uint8"),
        (np.full((1, 28, 28), 2.0), SIZE, ValueError, r"\[0, 1\]"),
        (np.full((1, 28, 28), np.nan), SIZE, ValueError, r"\[0, 1\]"),
    ],
    ids=["2d", "size0", "int16", "float>1", "nan"],
)
def test_resize_rejects_bad_input(
    images: np.ndarray, size: int, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        data.resize_bilinear(images, size)


# ----------------------------------------------------------------------------- robust downloads


def part_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.part")) + sorted(
        p.name for p in folder.glob(".*.part"))


def test_trickling_mirror_hits_the_overall_deadline(
    mirror: Mirror, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror.trickle_s = 0.02  # far below the per-read time-out: only a deadline can stop it
    monkeypatch.setenv(data.DEADLINE_ENV, "0.6")
    started = time.perf_counter()
    with pytest.raises(DataError, match=rf"{IMAGES}.*0\.6 s deadline.*{data.DEADLINE_ENV}"):
        data.find_dataset(split="test")
    assert time.perf_counter() - started < 3.0
    assert cache_names(isolated) == set()  # no .part, no half file


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "inf"])
def test_bad_deadline_setting_is_named(
    mirror: Mirror, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(data.DEADLINE_ENV, value)
    with pytest.raises(DataError, match=rf"\${data.DEADLINE_ENV}='{value}'"):
        data.download()


@pytest.mark.parametrize("value", ["notaurl", "ftp//x", "http:/", "://nothing", "gopher://x"])
def test_bad_mirror_setting_is_named(
    monkeypatch: pytest.MonkeyPatch, isolated: Path, value: str
) -> None:
    monkeypatch.setenv("CONVOLAB_MIRROR", value)
    monkeypatch.setattr(data, "SYSTEM_DATA_DIR", isolated / "no-system")
    with pytest.raises(DataError, match=rf"\$CONVOLAB_MIRROR='{re.escape(value)}'"):
        data.load_split("test")
    assert "$CONVOLAB_MIRROR" in data.dataset_status()["reason"]  # info says so, never raises


_DOWNLOAD_SCRIPT = """
import sys
from pathlib import Path
from convolab import data
data.download(Path(sys.argv[1]), base_url=sys.argv[2], split="test")
"""


_TERM_AT_CREATION_SCRIPT = """
import os, signal, sys, tempfile
from pathlib import Path
from convolab import data
real_mkstemp = tempfile.mkstemp
def mkstemp(*args, **kwargs):  # SIGTERM the instant the part exists, before its name is known
    made = real_mkstemp(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return made
tempfile.mkstemp = mkstemp
data.download(Path(sys.argv[1]), base_url=sys.argv[2], split="test")
"""


def test_sigterm_as_the_part_is_created_leaves_no_part(mirror: Mirror, isolated: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[1])}
    child = subprocess.run([sys.executable, "-c", _TERM_AT_CREATION_SCRIPT, str(isolated),
                            mirror.url], env=env, capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGTERM, child.stderr.decode()[-2000:]
    assert isolated.is_dir() and part_files(isolated) == []


def test_sigterm_mid_download_leaves_no_part_and_next_run_cleans_stale_parts(
    mirror: Mirror, isolated: Path, tmp_path: Path
) -> None:
    mirror.trickle_s = 0.01
    env = {**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[1])}
    child = subprocess.Popen([sys.executable, "-c", _DOWNLOAD_SCRIPT, str(isolated), mirror.url],
                             env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not (isolated.is_dir() and part_files(isolated)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert part_files(isolated), "the child never started its download"
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=20)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGTERM  # terminated by the signal, not a traceback
    assert part_files(isolated) == []
    # A part left by a run killed harder (SIGKILL): old and unlocked, removed on the next start.
    stale = isolated / f".{LABELS}.abc123.part"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    mirror.trickle_s = 0.0
    mirror.statuses = {name: 404 for name in data.FILES}
    with pytest.raises(DataError, match="HTTP 404"):
        data.download(isolated, split="test")
    assert part_files(isolated) == []


@needs_real
def test_test_split_fetches_only_the_test_files(mirror: Mirror, isolated: Path) -> None:
    linked_copy(mirror.root)
    images, labels = data.load_split("test", limit=10)  # what classify does
    assert images.shape == (10, 28, 28) and labels.shape == (10,)
    assert sorted(mirror.requests) == sorted(data.split_files("test"))
    assert cache_names(isolated) == set(data.split_files("test"))
    mirror.requests.clear()
    data.load_split("train", limit=10)  # training then fetches its own split only
    assert sorted(mirror.requests) == sorted(data.split_files("train"))


@needs_real
def test_info_line_names_checksum_failure_and_missing_folder(tmp_path: Path) -> None:
    broken = linked_copy(tmp_path / "broken", skip=(LABELS,))
    (broken / LABELS).write_bytes(one_byte_changed(real_payload(LABELS)))
    line = data.describe_dataset(broken)
    assert "FAILED" in line and "checksum mismatch" in line and LABELS in line
    missing = tmp_path / "missing"
    line = data.describe_dataset(missing)
    assert "no such directory" in line and str(missing) in line
    assert "download" not in line.replace("never downloaded", "")


@pytest.mark.parametrize("shape", [(1, 0, 28), (0, 28, 28), (2, 28, 0)])
def test_resize_refuses_empty_axes(shape: tuple[int, int, int]) -> None:
    with pytest.raises(InputError, match="non-empty"):
        data.resize_bilinear(np.zeros(shape, np.uint8))


def test_resize_of_many_images_stays_in_bounded_memory(rng: np.random.Generator) -> None:
    images = rng.integers(0, 256, size=(5000, 28, 28), dtype=np.uint8)
    out_bytes = 5000 * SIZE * SIZE * 4
    tracemalloc.start()
    try:
        out = data.resize_bilinear(images, SIZE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (5000, 1, SIZE, SIZE)
    # The output itself plus chunk-sized temporaries, not a second copy of the batch.
    assert peak < out_bytes + 64 * 2**20, f"peak {peak / 2**20:.0f} MiB"
