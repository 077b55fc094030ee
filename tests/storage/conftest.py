"""Fixtures of the storage-core tests (helpers live in ``kvhelpers.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvhelpers import Zygote, small_tmpfs

# tests/conftest.py exports REPO; keep ``from conftest import REPO`` working whichever
# conftest module Python last imported under that name.
REPO = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """A pre-imported process that forks real worker processes on request. It runs under
    another PYTHONHASHSEED than this process, so keys are compared across hash seeds."""
    z = Zygote(hash_seed="2" if os.environ.get("PYTHONHASHSEED") == "1" else "1")
    yield z
    z.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted under tmp_path (needs root: tests run as root here and in CI)."""
    with small_tmpfs(tmp_path, "4m") as mnt:
        yield mnt
