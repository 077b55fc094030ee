"""Shared fixtures. Engine sockets and temp files stay under pytest's tmp dir."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
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


@pytest.fixture
def beyond_this_machine() -> int:
    """Twice this machine's memory and swap, in bytes: chunk-buffer budgets no host here can
    hold (Linux: read from /proc)."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        pytest.skip("the host's memory is read from Linux's /proc")
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
    return 2 * sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))


@pytest.fixture
def forbid_pool_allocations() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context in which a chunk-buffer pool that allocates fails the test: a reservation
    that had to be refused before allocating would otherwise bring the OOM killer onto the
    machine running the tests, not a failure."""
    from kvtier.buffer_pool import BufferPool

    def refuse(self: BufferPool, nbytes: int, used: int) -> None:
        raise AssertionError(f"allocated {nbytes} bytes: the check let it through")

    @contextlib.contextmanager
    def forbidden() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(BufferPool, "_new_arena", refuse)
            yield

    return forbidden
