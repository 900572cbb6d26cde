"""File-system helpers shared by everything convolab writes."""

from __future__ import annotations

import os
import re
from pathlib import Path

_STATUS = Path("/proc/self/status")


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux), since setting
    it to read it is not thread-safe."""
    try:
        found = re.search(r"^Umask:\s*([0-7]+)", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def created_file_mode() -> int:
    """The mode a plain open() would give a new file (0666 less the umask): files written
    through a temporary file get the user's normal mode, not mkstemp's 0600."""
    return 0o666 & ~current_umask()
