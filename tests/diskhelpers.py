"""A disk that really fills, and one whose reads hang, for every test folder
(tests/conftest.py puts this folder on ``sys.path``)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "4m") mounted under ``parent``: a disk that really fills.
    Needs root (the tests run as root here and in CI); skips the test otherwise."""
    mnt = parent / "small-disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to simulate a full disk (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_disk(where: Path) -> Path:
    """Take every free byte of ``where``'s file system (a file the caller removes)."""
    filler = where / "someone-elses-data"
    filler.write_bytes(bytes(shutil.disk_usage(where).free))
    return filler


def hang_reads(store, hangs: Callable[[bytes], bool] = lambda key: True) -> threading.Event:  # noqa: ANN001
    """Make the reads of the keys ``hangs`` picks block (a hung network mount, a dying disk)
    until the returned event is set, then read. A hung file system cannot be made on these
    machines (no FUSE library, no device-mapper), so the store's backend's own
    ``read_record`` is wrapped: everything above it is the store's real code."""
    release = threading.Event()
    real = store.backend.read_record

    def read_record(entry, fn):  # noqa: ANN001, ANN202
        if hangs(entry.key):
            release.wait(120)
        return real(entry, fn)

    store.backend.read_record = read_record
    return release

