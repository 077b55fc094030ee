"""Fixtures of the CLI tests (helpers live in ``clihelpers.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from clihelpers import Built, build_store

# tests/conftest.py exports REPO; keep ``from conftest import REPO`` working whichever
# conftest module Python last imported under that name.
REPO = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="session")
def built_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    """One pristine store per backend (lmdb raw, files zstd), shared by read-only tests."""
    base = tmp_path_factory.mktemp("stores")
    return {"lmdb": build_store(base / "lmdb", "lmdb"),
            "files": build_store(base / "files", "files", "zstd")}


@pytest.fixture(params=["lmdb", "files"])
def fresh_store(request: pytest.FixtureRequest, built_stores: dict[str, Built], tmp_path: Path) -> Built:
    """A private copy of a built store, for tests that change it."""
    src = built_stores[request.param]
    dst = tmp_path / "store"
    shutil.copytree(src.path, dst)
    return Built(dst, src.backend, src.compression, dict(src.chunks), dict(src.tokens),
                 {k: list(v) for k, v in src.keys.items()})
