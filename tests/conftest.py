"""Shared fixtures. Engine sockets and temp files stay under pytest's tmp dir."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# vLLM and torch write sockets/caches under TMPDIR; keep them out of the shared /tmp.
_TMP = Path(tempfile.gettempdir()) / f"kvtier-tests-{os.getuid()}"
_TMP.mkdir(exist_ok=True)
os.environ.setdefault("VLLM_RPC_BASE_PATH", str(_TMP))

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # diskhelpers, for every folder


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"
