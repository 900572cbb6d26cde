"""The tuner cache under concurrent writers: every process's entries survive, and the files
get the user's normal mode."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from convolab.gpu import tune
from convolab.shapes import ConvShape

PROCESSES = 4
ENTRIES_EACH = 100


def _entry(writer: int, index: int) -> tune.TuneEntry:
    shape = ConvShape(B=index + 1, C=1, H=86, W=86, M=4, K=7)
    return tune.TuneEntry(f"gpu-{writer}", shape, "fp32", "shared-tiled", {"TILE": 16})


def _writer(path: str, writer: int, start: multiprocessing.synchronize.Event) -> None:
    start.wait()  # all writers begin together, so their read-merge-writes interleave
    for index in range(ENTRIES_EACH):
        tune.update_cache([_entry(writer, index)], Path(path))


def test_concurrent_updates_lose_no_entries(tmp_path: Path) -> None:
    path = tmp_path / "cache" / tune.CACHE_FILE
    context = multiprocessing.get_context("fork")
    start = context.Event()
    workers = [context.Process(target=_writer, args=(str(path), w, start))
               for w in range(PROCESSES)]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    found = {(e.gpu, e.shape.B) for e in tune.load_cache(path)}
    expected = {(f"gpu-{w}", i + 1) for w in range(PROCESSES) for i in range(ENTRIES_EACH)}
    assert found == expected, f"{len(expected - found)} of {len(expected)} entries lost"
    names = {p.name for p in path.parent.iterdir()}
    assert names == {tune.CACHE_FILE, tune.CACHE_FILE + ".lock"}  # no temporaries left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_cache_file_mode_follows_the_umask(tmp_path: Path, umask: int) -> None:
    path = tmp_path / tune.CACHE_FILE
    old = os.umask(umask)
    try:
        tune.update_cache([_entry(0, 0)], path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
