"""Fashion-MNIST: finding, downloading and verifying the four IDX files, parsing them, and the
28x28 -> 86x86 bilinear resize the ece408 network expects (docs/spec.md, Data).

Look-up order (first match wins; see `find_dataset`):

1. an explicit ``data_dir`` argument (``--data-dir``),
2. ``$CONVOLAB_DATA``,
3. the user cache: ``$CONVOLAB_CACHE`` if set, else ``$XDG_CACHE_HOME/convolab/fashion-mnist``,
   else ``~/.cache/convolab/fashion-mnist``,
4. ``SYSTEM_DATA_DIR`` (``/usr/share/datasets/fashion-mnist``, Debian ``dataset-fashion-mnist``),
5. a download from the official mirror (``$CONVOLAB_MIRROR`` overrides it) into the user cache.

With a split named (`load_split` always names one), only that split's two files are needed:
`classify` never fetches the 30 MB training set.

A folder named explicitly (1 or 2) must hold all four files; a missing one is an error rather
than a silent fall-through, because the user asked for that folder.

Verification: every file is checked by the SHA-256 of its *decompressed* payload (gzip bytes
differ between distributions, the payload does not) and by its IDX structure (magic number,
28x28 dimensions, item count, exact payload length). Files found locally are verified when they
are first read, not by `find_dataset`, so `classify` never decompresses the training set.
Decompressing dominates the cost (about 0.3 s for the training images, hashing about 0.02 s),
so a persistent stamp file would save almost nothing; instead the parsed, verified arrays are
memoised in-process, keyed by (resolved path, size, mtime_ns), so repeated loads in one process
are free and a file changed on disk is re-read and re-verified. Downloads are verified before
they are moved into the cache, so the cache only ever holds files that passed.

Downloads have an overall deadline (``DOWNLOAD_DEADLINE_S``, overridden by
``$CONVOLAB_DOWNLOAD_DEADLINE_S``) on top of the per-read time-out, so a mirror that trickles
bytes cannot hang a run; progress lines go to stderr when it is a terminal or once a download
has taken more than a second. A file being downloaded is a hidden ``.part`` file beside its
target, held under an flock: SIGTERM and Ctrl-C remove it before the process ends (SIGTERM is
then re-raised), and parts left by a killed run (no lock holder) are removed on the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import math
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import numpy as np

from convolab.errors import DataError, InputError
from convolab.fsutil import created_file_mode
from convolab.shapes import positive_int

Split = Literal["train", "test"]

# SHA-256 of the decompressed payload of each file (docs/spec.md, Data).
FILES: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",  # noqa: E501
    "train-labels-idx1-ubyte.gz": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",  # noqa: E501
    "t10k-images-idx3-ubyte.gz": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte.gz": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}

CLASS_NAMES: tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

# Module constants rather than literals so tests can point them elsewhere.
SYSTEM_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
DEFAULT_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
DOWNLOAD_TIMEOUT_S = 30.0  # per read: no byte for this long is a dead connection
DOWNLOAD_DEADLINE_S = 600.0  # whole download() call: the four files are about 30 MB
DEADLINE_ENV = "CONVOLAB_DOWNLOAD_DEADLINE_S"
MIRROR_ENV = "CONVOLAB_MIRROR"
_MIRROR_SCHEMES = ("http", "https", "file")
# A .part file unlocked and untouched this long belongs to no live download.
_STALE_PART_AGE_S = 5.0
_PROGRESS_AFTER_S = 1.0

IMAGE_SIDE = 28
IMAGES_MAGIC = 0x00000803  # unsigned byte data, 3 dimensions
LABELS_MAGIC = 0x00000801  # unsigned byte data, 1 dimension
SPLIT_SIZES: dict[str, int] = {"train": 60_000, "test": 10_000}
_SPLIT_PREFIX: dict[str, str] = {"train": "train", "test": "t10k"}

# The largest gzip file is about 26 MB; a mirror answering with something far bigger is not
# serving Fashion-MNIST, and reading it all would only waste memory.
_MAX_DOWNLOAD_BYTES = 64 * 1024 * 1024
_DOWNLOAD_CHUNK = 1 << 20


@dataclass(frozen=True)
class _Layout:
    """What a file's IDX header and payload must be."""

    magic: int
    count: int
    is_images: bool

    @property
    def header_bytes(self) -> int:
        return 16 if self.is_images else 8

    @property
    def payload_bytes(self) -> int:
        item = IMAGE_SIDE * IMAGE_SIDE if self.is_images else 1
        return self.header_bytes + self.count * item


def _layout(name: str) -> _Layout:
    split = "train" if name.startswith("train") else "test"
    is_images = "images" in name
    return _Layout(IMAGES_MAGIC if is_images else LABELS_MAGIC, SPLIT_SIZES[split], is_images)


def split_files(split: Split) -> tuple[str, str]:
    """(images file name, labels file name) of a split."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    prefix = _SPLIT_PREFIX[split]
    return f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz"


# ----------------------------------------------------------------------------- reading + checks


def _decompress(gz_path: Path, display: str, max_payload: int) -> bytes:
    """The decompressed bytes, at most max_payload + 1 of them (enough to detect 'too long')."""
    try:
        with gzip.open(gz_path, "rb") as stream:
            return stream.read(max_payload + 1)
    except FileNotFoundError:
        raise DataError(f"{display}: file not found") from None
    except EOFError:
        raise DataError(f"{display}: truncated gzip file (ends before its end marker)") from None
    except (OSError, zlib.error) as exc:
        raise DataError(f"{display}: not a valid gzip file ({exc})") from None


def _check_structure(payload: bytes, name: str, display: str) -> None:
    """Magic number, dimensions, item count and exact payload length of one IDX payload."""
    layout = _layout(name)
    if len(payload) < layout.header_bytes:
        raise DataError(
            f"{display}: payload of {len(payload)} bytes is shorter than the "
            f"{layout.header_bytes}-byte IDX header"
        )
    header = np.frombuffer(payload, dtype=">u4", count=layout.header_bytes // 4)
    magic = int(header[0])
    if magic != layout.magic:
        raise DataError(
            f"{display}: wrong IDX magic number 0x{magic:08x}, expected 0x{layout.magic:08x} "
            f"({'images' if layout.is_images else 'labels'} file)"
        )
    count = int(header[1])
    if count != layout.count:
        raise DataError(f"{display}: header says {count} items, expected {layout.count}")
    if layout.is_images:
        rows, cols = int(header[2]), int(header[3])
        if (rows, cols) != (IMAGE_SIDE, IMAGE_SIDE):
            raise DataError(
                f"{display}: images are {rows}x{cols}, expected {IMAGE_SIDE}x{IMAGE_SIDE}"
            )
    if len(payload) != layout.payload_bytes:
        relation = "longer" if len(payload) > layout.payload_bytes else "shorter"
        shown = f"more than {layout.payload_bytes}" if relation == "longer" else str(len(payload))
        raise DataError(
            f"{display}: wrong length: payload is {shown} bytes ({relation} than the "
            f"{layout.payload_bytes} bytes its header implies)"
        )


def _check_sha256(payload: bytes, name: str, display: str) -> None:
    digest = hashlib.sha256(payload).hexdigest()
    if digest != FILES[name]:
        raise DataError(
            f"{display}: checksum mismatch: SHA-256 of the decompressed payload is {digest}, "
            f"expected {FILES[name]}; the file is corrupt or not Fashion-MNIST (delete it)"
        )


def _read_verified(gz_path: Path, name: str, display: str | None = None) -> np.ndarray:
    """Decompress, check structure and checksum; the items as a read-only uint8 array."""
    display = display or str(gz_path)
    layout = _layout(name)
    payload = _decompress(gz_path, display, layout.payload_bytes)
    _check_structure(payload, name, display)
    _check_sha256(payload, name, display)
    items = np.frombuffer(payload, dtype=np.uint8, offset=layout.header_bytes)
    if layout.is_images:
        return items.reshape(layout.count, IMAGE_SIDE, IMAGE_SIDE)
    if int(items.max()) >= len(CLASS_NAMES):  # unreachable for verified files; a cheap guard
        raise DataError(f"{display}: label {int(items.max())} out of range 0..9")
    return items


# (resolved path, size, mtime_ns) -> verified read-only array; one entry per file name, so the
# memo never holds more than the four files (about 55 MB).
_memo: dict[str, tuple[tuple[str, int, int], np.ndarray]] = {}


def _file_key(path: Path) -> tuple[str, int, int]:
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc})") from None
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def _load_file(folder: Path, name: str) -> np.ndarray:
    path = folder / name
    key = _file_key(path)
    cached = _memo.get(name)
    if cached is not None and cached[0] == key:
        return cached[1]
    array = _read_verified(path, name)
    _memo[name] = (key, array)
    return array


def verify_file(path: Path, name: str | None = None) -> None:
    """Check one file (structure and SHA-256 of the payload); raise DataError naming it if bad.

    `name` is the Fashion-MNIST file name it must be (default: the file's own name).
    """
    path = Path(path)
    name = name or path.name
    if name not in FILES:
        raise ValueError(f"{name!r} is not a Fashion-MNIST file name; expected one of {FILES}")
    if path.name == name:
        _load_file(path.parent, name)
    else:
        _read_verified(path, name)


# ----------------------------------------------------------------------------- look-up


def cache_dir() -> Path:
    """The user cache folder: $CONVOLAB_CACHE, else $XDG_CACHE_HOME/convolab/fashion-mnist,
    else ~/.cache/convolab/fashion-mnist. Not created here."""
    override = os.environ.get("CONVOLAB_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "convolab" / "fashion-mnist"


def mirror_url() -> str:
    """Base URL the four files are downloaded from ($CONVOLAB_MIRROR overrides the official one).

    Raises DataError naming the variable and its value when it is not an http(s):// or
    file:// URL, before anything is fetched."""
    value = os.environ.get(MIRROR_ENV)
    if not value:
        return DEFAULT_MIRROR
    parsed = urlparse(value)
    if parsed.scheme not in _MIRROR_SCHEMES or (parsed.scheme != "file" and not parsed.netloc):
        raise DataError(
            f"${MIRROR_ENV}={value!r} is not a mirror URL: expected "
            f"{' or '.join(f'{scheme}://...' for scheme in _MIRROR_SCHEMES)} "
            f"(unset it to use {DEFAULT_MIRROR})"
        )
    return value


def download_deadline_s() -> float:
    """Seconds one download() may take in all: ${DEADLINE_ENV}, else DOWNLOAD_DEADLINE_S."""
    value = os.environ.get(DEADLINE_ENV)
    if not value:
        return DOWNLOAD_DEADLINE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise DataError(f"${DEADLINE_ENV}={value!r} must be a positive number of seconds")
    return seconds


def _needed(split: Split | None) -> tuple[str, ...]:
    """The files a split needs (all four when no split is named)."""
    return tuple(FILES) if split is None else split_files(split)


def _missing(folder: Path, split: Split | None = None) -> list[str]:
    return [name for name in _needed(split) if not (folder / name).is_file()]


def _explicit_dir(data_dir: Path | str | None) -> tuple[Path, str] | None:
    """The folder the user named (argument, then $CONVOLAB_DATA) and what named it."""
    if data_dir is not None:
        return Path(data_dir).expanduser(), "--data-dir"
    from_env = os.environ.get("CONVOLAB_DATA")
    if from_env:
        return Path(from_env).expanduser(), "$CONVOLAB_DATA"
    return None


def _check_explicit(folder: Path, origin: str, split: Split | None = None) -> None:
    if not folder.is_dir():
        raise DataError(f"{origin} {folder}: no such directory")
    missing = _missing(folder, split)
    if missing:
        needed = _needed(split)
        raise DataError(
            f"{origin} {folder}: missing {', '.join(missing)} "
            f"(need the Fashion-MNIST .gz files {', '.join(needed)})"
        )


def find_dataset(data_dir: Path | str | None = None, split: Split | None = None) -> Path:
    """The folder holding the Fashion-MNIST files (all four, or only `split`'s two when it is
    named), downloading the missing ones into the cache if no folder in the look-up order
    (module docstring) has them.

    Only presence is checked here for local folders; contents are verified when read
    (`load_split`). Downloaded files are verified before they enter the cache.
    Raises DataError naming the folder and file when an explicitly named folder lacks a file,
    or when a download fails.
    """
    if split is not None:
        split_files(split)  # an unknown split is a ValueError before any look-up
    explicit = _explicit_dir(data_dir)
    if explicit is not None:
        folder, origin = explicit
        _check_explicit(folder, origin, split)
        return folder
    cache = cache_dir()
    if not _missing(cache, split):
        return cache
    if SYSTEM_DATA_DIR.is_dir() and not _missing(SYSTEM_DATA_DIR, split):
        return SYSTEM_DATA_DIR
    download(cache, split=split)
    return cache


# ----------------------------------------------------------------------------- download


class _Terminated(BaseException):
    """SIGTERM arrived during a download: unwinds like Ctrl-C so every cleanup runs."""


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """While downloading, SIGTERM unwinds the stack (removing the .part file on the way) and is
    then re-delivered with the handler that was there before, so the process still ends the
    way SIGTERM ends it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def on_term(signum: int, _frame: object) -> None:
        raise _Terminated(signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM) from None  # if the old handler let us live
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT held pending in this thread for the block; delivered when it ends."""
    held = {signal.SIGTERM, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def remove_stale_parts(cache: Path) -> list[Path]:
    """Delete the .part files of downloads that no process is running any more (killed runs):
    a live download holds an flock on its part file. Returns the files removed."""
    removed = []
    for part in cache.glob(".*.part"):
        try:
            if time.time() - part.stat().st_mtime < _STALE_PART_AGE_S:
                continue  # may be a download that has not taken its lock yet
            with open(part, "rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                part.unlink()
            removed.append(part)
        except OSError:  # locked by a live download, or already gone
            continue
    return removed


class _Progress:
    """Periodic 'downloading' lines on stderr: at once on a terminal, else only once a
    download has taken more than a second (tests and logs of fast runs stay quiet)."""

    def __init__(self, name: str, total: int | None) -> None:
        self.name, self.total = name, total
        self.started = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.shown = False

    def update(self, received: int, done: bool = False) -> None:
        now = time.monotonic()
        due = self.tty or now - self.started > _PROGRESS_AFTER_S
        if not due or (not done and now - self.last < _PROGRESS_AFTER_S and self.shown):
            return
        if done and not self.shown:
            return
        of = f" of {self.total / 2**20:.1f}" if self.total else ""
        state = "done" if done else f"{now - self.started:.0f} s"
        print(f"downloading {self.name}: {received / 2**20:.1f}{of} MiB ({state})",
              file=sys.stderr, flush=True)
        self.last, self.shown = now, True


def _fetch(url: str, name: str, out: Any, deadline: float, limit_s: float) -> None:
    """Stream url into out, refusing more than _MAX_DOWNLOAD_BYTES or a run past `deadline`."""
    remaining = deadline - time.monotonic()
    timeout = max(0.001, min(DOWNLOAD_TIMEOUT_S, remaining))
    with urllib.request.urlopen(url, timeout=timeout) as response:
        length = response.headers.get("Content-Length")
        progress = _Progress(name, int(length) if length and length.isdigit() else None)
        received = 0
        # read1: whatever has arrived (at most a chunk), so a trickle still reaches the check.
        while chunk := response.read1(_DOWNLOAD_CHUNK):
            received += len(chunk)
            if received > _MAX_DOWNLOAD_BYTES:
                raise DataError(
                    f"{name}: download from {url} exceeds {_MAX_DOWNLOAD_BYTES} bytes; "
                    "the mirror is not serving Fashion-MNIST"
                )
            out.write(chunk)
            progress.update(received)
            if time.monotonic() > deadline:
                raise DataError(
                    f"{name}: download from {url} did not finish within the {limit_s:g} s "
                    f"deadline ({received} bytes received; set ${DEADLINE_ENV} to allow more)"
                )
        progress.update(received, done=True)


def _download_one(name: str, cache: Path, base_url: str, deadline: float, limit_s: float) -> None:
    url = base_url.rstrip("/") + "/" + name
    destination = cache / name
    temp_path: Path | None = None
    try:
        # Hidden name + .part suffix: never mistaken for a finished file by _missing(). Created
        # with SIGTERM and Ctrl-C held back, so that neither can land between the file's
        # creation and this function knowing its name (it would stay in the cache).
        with _signals_held():
            fd, temp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=cache)
            temp_path = Path(temp_name)
        fcntl.flock(fd, fcntl.LOCK_EX)  # marks the part as live for remove_stale_parts
        with os.fdopen(fd, "wb") as out:
            try:
                _fetch(url, name, out, deadline, limit_s)
            except urllib.error.HTTPError as exc:
                raise DataError(
                    f"{name}: download from {url} failed: HTTP {exc.code} {exc.reason}"
                ) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise DataError(f"{name}: download from {url} failed: {reason}") from None
        _read_verified(temp_path, name, display=f"{name} (downloaded from {url})")
        os.chmod(temp_path, created_file_mode())  # mkstemp's 0600 is not the user's mode
        os.replace(temp_path, destination)
    except BaseException:
        # Also on Ctrl-C and SIGTERM: a half-written file must never stay in the cache.
        if temp_path is not None:
            temp_path.unlink(missing_ok=True)
        raise


def download(
    cache: Path | None = None, base_url: str | None = None, split: Split | None = None
) -> Path:
    """Download the files missing from `cache` (default `cache_dir()`) from `base_url`
    (default `mirror_url()`), each verified before an atomic os.replace into the cache; only
    `split`'s two files when a split is named.

    Files already verified and in place are kept, so a failed run resumes where it stopped.
    On failure, on the deadline (`download_deadline_s`), on Ctrl-C and on SIGTERM the failing
    file leaves nothing behind (no partial or temporary file) and DataError names it and the
    URL. Part files of earlier, killed runs are removed first.
    """
    cache = Path(cache) if cache is not None else cache_dir()
    base_url = base_url or mirror_url()
    limit_s = download_deadline_s()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the dataset cache {cache}: {exc}") from None
    remove_stale_parts(cache)
    deadline = time.monotonic() + limit_s
    with _terminate_cleanly():
        for name in _missing(cache, split):
            _download_one(name, cache, base_url, deadline, limit_s)
    return cache


# ----------------------------------------------------------------------------- loading


def load_split(
    split: Split, data_dir: Path | str | None = None, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) uint8 of a split, the first `limit` if given.

    The arrays are fresh copies (safe to modify). Both files are verified (structure and
    SHA-256) the first time they are read in a process.
    """
    images_name, labels_name = split_files(split)
    total = SPLIT_SIZES[split]
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int | np.integer):
            raise TypeError(f"limit must be an int or None, not {type(limit).__name__}")
        if not 1 <= limit <= total:
            raise ValueError(
                f"limit must be between 1 and {total} for the {split} split, got {limit}"
            )
    folder = find_dataset(data_dir, split=split)
    images = _load_file(folder, images_name)
    labels = _load_file(folder, labels_name)
    if len(images) != len(labels):  # guaranteed by the layouts; kept as the contract's check
        raise DataError(
            f"{folder}: {images_name} has {len(images)} images but {labels_name} "
            f"has {len(labels)} labels"
        )
    count = total if limit is None else int(limit)
    return images[:count].copy(), labels[:count].copy()


def bilinear_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output index: the two source indices and the weight of the second (float64)."""
    scale = in_size / out_size
    src = (np.arange(out_size, dtype=np.float64) + 0.5) * scale - 0.5
    src = np.maximum(src, 0.0)
    lower = np.minimum(np.floor(src).astype(np.intp), in_size - 1)
    upper = np.minimum(lower + 1, in_size - 1)
    weight_upper = src - lower
    return lower, upper, weight_upper


def resize_bilinear(images: np.ndarray, size: int = 86) -> np.ndarray:
    """Resize (N, H, W) images to (N, 1, size, size) float32 in [0, 1], bilinear with PyTorch's
    ``align_corners=False`` (also OpenCV ``INTER_LINEAR``) half-pixel rule.

    The rule, per axis of input length ``n`` and output length ``s``: output index ``d`` reads
    ``x = max((d + 0.5) * n / s - 0.5, 0)``, ``i0 = min(floor(x), n - 1)``,
    ``i1 = min(i0 + 1, n - 1)``, ``t = x - i0``, value ``(1 - t) * in[i0] + t * in[i1]``.
    The axes are separable, so the 2-D result is that rule applied along H, then along W.

    uint8 input is divided by 255 *before* interpolating; float input must already be scaled
    to [0, 1]. Interpolation is a convex combination, so the output stays in [0, 1] (it is also
    clipped there against float32 rounding); a constant image stays exactly constant.

    Implementation: taps and weights are precomputed per axis (weights in float64, used in
    float32); each pass gathers whole rows (``in[i0]``, ``in[i1]``) and evaluates
    ``a + t * (b - a)`` elementwise in float32, on chunks of 128 images so the temporaries stay
    in cache. The W pass runs on the transposed intermediate so it gathers rows too. Only
    elementwise NumPy arithmetic is used (no BLAS), so every image's result is bit-identical
    whatever the batch size or chunking; 70,000 images take about 1.5 s on 2 cores.
    """
    images = np.asarray(images)
    if images.ndim != 3:
        raise InputError(f"images must have shape (N, H, W), got {images.shape}")
    if 0 in images.shape:
        raise InputError(
            f"images must be non-empty on every axis (N, H, W >= 1), got shape {images.shape}"
        )
    size = positive_int(size, "size")
    is_uint8 = images.dtype == np.uint8
    if not is_uint8:
        if not np.issubdtype(images.dtype, np.floating):
            raise TypeError(f"images must be uint8 or floating point, not {images.dtype}")
        if images.size and not (images.min() >= 0.0 and images.max() <= 1.0):  # NaN fails too
            raise ValueError("float images must already be scaled to [0, 1] (or pass uint8)")
    count, in_h, in_w = images.shape
    size = int(size)
    rows_lo, rows_hi, rows_t = bilinear_taps(in_h, size)
    cols_lo, cols_hi, cols_t = bilinear_taps(in_w, size)
    rows_weight = rows_t.astype(np.float32)[None, :, None]
    cols_weight = cols_t.astype(np.float32)[None, :, None]
    out = np.empty((count, 1, size, size), dtype=np.float32)
    chunk = 128
    for start in range(0, count, chunk):
        block = images[start : start + chunk].astype(np.float32)
        if is_uint8:
            block /= np.float32(255.0)  # division (not * 1/255) keeps 255 -> exactly 1.0
        # H pass: (b, size, in_w) = a + t * (b - a) over gathered rows.
        upper_rows = block[:, rows_hi, :]
        lower_rows = block[:, rows_lo, :]
        upper_rows -= lower_rows
        upper_rows *= rows_weight
        upper_rows += lower_rows
        # W pass on the transpose, (b, in_w, size) -> (b, size_w, size_h).
        by_cols = np.ascontiguousarray(upper_rows.transpose(0, 2, 1))
        right = by_cols[:, cols_hi, :]
        left = by_cols[:, cols_lo, :]
        right -= left
        right *= cols_weight
        right += left
        np.clip(right, 0.0, 1.0, out=right)
        out[start : start + chunk, 0] = right.transpose(0, 2, 1)
    return out


def load_images(
    split: Split,
    n: int | None = None,
    size: int = 86,
    data_dir: Path | str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Network-ready input: (N, 1, size, size) float32 in [0, 1] and int64 labels (N,).

    size=28 returns the original images, only scaled by 1/255; any other size resizes with
    `resize_bilinear`.
    """
    size = positive_int(size, "size")
    images, labels = load_split(split, data_dir=data_dir, limit=n)
    if size == IMAGE_SIDE:
        scaled = images.astype(np.float32)
        scaled /= np.float32(255.0)
        return scaled[:, None, :, :], labels.astype(np.int64)
    return resize_bilinear(images, size), labels.astype(np.int64)


# ----------------------------------------------------------------------------- status


def dataset_status(data_dir: Path | str | None = None, verify: bool = True) -> dict[str, Any]:
    """Where the dataset would be found and whether it is usable, for `convolab info`.

    Never downloads. Keys: found (bool), path (str | None), source ('--data-dir',
    '$CONVOLAB_DATA', 'cache', 'system', or None), verified (bool | None; None when not
    checked), reason (str | None, why not found or not verified), cache_dir, mirror,
    and searched (list of [source, folder, missing file names]).
    """
    status: dict[str, Any] = {
        "found": False,
        "path": None,
        "source": None,
        "verified": None,
        "reason": None,
        "cache_dir": str(cache_dir()),
        "mirror": None,
        "searched": [],
    }
    try:
        status["mirror"] = mirror_url()
    except DataError as exc:
        status["mirror_error"] = str(exc)
    explicit = _explicit_dir(data_dir)
    if explicit is not None:
        candidates = [(explicit[1], explicit[0])]
    else:
        candidates = [("cache", cache_dir()), ("system", SYSTEM_DATA_DIR)]
    for source, folder in candidates:
        missing = _missing(folder)
        status["searched"].append([source, str(folder), missing])
        if missing:
            continue
        status.update(found=True, path=str(folder), source=source)
        if verify:
            try:
                for name in FILES:
                    _load_file(folder, name)
                status["verified"] = True
            except DataError as exc:
                status.update(verified=False, reason=str(exc))
        return status
    if explicit is not None:
        origin, folder = explicit[1], explicit[0]
        if not folder.is_dir():
            status["reason"] = (
                f"{origin} {folder}: no such directory; a named folder is never downloaded "
                "into, so runs will fail until it exists and holds the files"
            )
        else:
            status["reason"] = f"{origin} {folder} lacks {', '.join(status['searched'][0][2])}"
    elif "mirror_error" in status:
        status["reason"] = (
            f"not in the cache or {SYSTEM_DATA_DIR}, and cannot be downloaded: "
            f"{status['mirror_error']}"
        )
    else:
        status["reason"] = (
            f"not in the cache or {SYSTEM_DATA_DIR}; it will be downloaded from "
            f"{status['mirror']} into {status['cache_dir']} on first use "
            "(or: apt-get install dataset-fashion-mnist)"
        )
    return status


def describe_dataset(data_dir: Path | str | None = None) -> str:
    """One line for `convolab info`: where the dataset is and whether it verified, else why
    not and what a run will do (the reason includes a checksum or structure failure)."""
    status = dataset_status(data_dir)
    if status["found"] and status["verified"]:
        return f"{status['path']} ({status['source']}, SHA-256 verified)"
    if status["found"]:
        return f"{status['path']} ({status['source']}, FAILED verification: {status['reason']})"
    return f"not found: {status['reason']}"
