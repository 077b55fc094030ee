"""Flushing a file or a directory to the disk, by its path."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: the names in it, such as a
    rename into it, survive a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
