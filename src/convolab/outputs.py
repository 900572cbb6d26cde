"""Files convolab writes: checked before the work starts, written whole or not at all, with
the mode any other program of the user's would give them (0o666 less the umask).

Every command names its outputs up front (`plan_outputs`), so a bad path, a path that two
outputs share, or a path onto convolab's shipped weights is refused before minutes of training
or measuring; `write_atomic` then writes each through a temp file in the same folder."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from convolab.errors import ConvolabError
from convolab.fsutil import created_file_mode


def _shipped_dir() -> Path:
    from convolab.models import WEIGHTS_DIR

    return WEIGHTS_DIR.resolve()


def _is_shipped(path: Path) -> bool:
    return path.resolve().parent == _shipped_dir()


def check_file(path: Path | str, option: str, *, force: bool = False) -> Path:
    """`path` as a file convolab may create or replace, or one ConvolabError naming `option`:
    not empty, not a directory, its folder an existing writable directory, not shipped
    weights (unless `force`)."""
    if str(path).strip() == "":
        raise ConvolabError(f"{option}: the path is empty")
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConvolabError(f"{option} {path}: is a directory; name a file")
    parent = path.parent
    for above in (parent, *parent.parents):
        if above.exists():
            if not above.is_dir():
                raise ConvolabError(f"{option} {path}: {above} is a file, not a folder")
            if above != parent:
                raise ConvolabError(f"{option} {path}: folder {parent} does not exist")
            break
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConvolabError(f"{option} {path}: folder {parent} is not writable")
    if _is_shipped(path) and not force:
        raise ConvolabError(f"{option} {path}: that is convolab's shipped weights folder; "
                            "pass --force to replace them")
    return path


def check_dir(path: Path | str, option: str) -> Path:
    """`path` as a folder convolab may create (with its parents) and write into."""
    if str(path).strip() == "":
        raise ConvolabError(f"{option}: the path is empty")
    path = Path(path).expanduser()
    for above in (path, *path.parents):
        if above.exists():
            if not above.is_dir():
                raise ConvolabError(f"{option} {path}: {above} is a file, not a folder")
            if not os.access(above, os.W_OK | os.X_OK):
                raise ConvolabError(f"{option} {path}: folder {above} is not writable")
            return path
    return path


def plan_outputs(outputs: Mapping[str, Path | str | None], *, force: bool = False,
                 ) -> dict[str, Path]:
    """Check every named output file (option -> path; None: not wanted) and that no two of them
    are the same file. Returns option -> checked path."""
    checked = {option: check_file(path, option, force=force)
               for option, path in outputs.items() if path is not None}
    seen: dict[Path, str] = {}
    for option, path in checked.items():
        key = path.resolve()
        if key in seen:
            raise ConvolabError(f"{seen[key]} and {option} are the same file {path}: "
                                "one would overwrite the other")
        seen[key] = option
    return checked


def is_train_sidecar(path: Path) -> bool:
    """Whether `path` holds a JSON sidecar convolab train wrote (safe to replace)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and str(record.get("command", "")).startswith(
        "convolab train")


Writer = Callable[[IO[bytes]], None]


def write_atomic(path: Path | str, content: bytes | str | Writer) -> Path:
    """Write `content` (bytes, text, or a function writing into a binary file) to `path`
    through a temp file in the same folder: the old file stays intact until the new one is
    complete. Any OSError becomes one ConvolabError naming the path."""
    path = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            if callable(content):
                content(fh)
            else:
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; the file should look like any other the user writes.
        os.chmod(tmp, created_file_mode())
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        raise ConvolabError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return path


def write_json(path: Path | str, record: object, indent: int = 2) -> Path:
    """`record` as strict JSON (NaN/Infinity refused: they are not JSON) written atomically."""
    try:
        text = json.dumps(record, indent=indent, allow_nan=False, default=str) + "\n"
    except ValueError as err:
        raise ConvolabError(f"not writing {path}: {err}") from None
    return write_atomic(path, text)
