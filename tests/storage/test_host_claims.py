"""Workers that reserve their chunk buffers at the same time (the tensor-parallel ranks of a
server) claim their bytes in a ledger every process on the host reads (``kvtier.host_claims``),
so that each sees the room the others' reservations will leave, not the memory before them.

The claimants are real processes, on a real ledger (in the test's own directory, through
``KVTIER_HOST_MEMORY_LEDGER``) against this machine's real available memory; a claim alone
allocates nothing, so these tests claim most of the machine without touching it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.buffer_pool import BufferPool
from kvtier.errors import ConfigError
from kvtier.host_claims import LEDGER_ENV, LEDGER_NAME, MemoryShort, claim, ledger_path
from kvtier.host_memory import available_bytes

CLAIMANT = """
import sys
from kvtier.host_claims import claim
with claim(int(sys.argv[1])):
    print("claimed", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path))
    return tmp_path / LEDGER_NAME


@pytest.fixture
def room() -> int:
    got = available_bytes()
    if got is None:
        pytest.skip("the host's memory is read from Linux's /proc")
    return got


@pytest.fixture
def claimant(ledger: Path) -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    """Start a process that claims ``n`` bytes and holds the claim until its stdin closes."""
    started: list[subprocess.Popen[str]] = []

    def start(n: int) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", CLAIMANT, str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        started.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "claimed"
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def _end(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait(30) == 0


def _claimed_pids(ledger: Path) -> list[int]:
    return [int(line.split()[0]) for line in ledger.read_text().splitlines()]


def test_claims_of_processes_reserving_at_once_add_up(ledger: Path, room: int,
                                                       claimant: Callable[[int], subprocess.Popen[str]]) -> None:
    """Two claims of 40 % each fit, a third of 40 % does not (each alone would: what eight
    ranks checking the memory one by one would all have seen), and it is told the room left
    and that others are reserving. Once the first two are done, it fits."""
    a = claimant(room * 4 // 10)
    b = claimant(room * 4 // 10)
    assert sorted(_claimed_pids(ledger)) == sorted([a.pid, b.pid])
    with pytest.raises(MemoryShort) as short, claim(room * 4 // 10):
        pass
    assert short.value.pending == 2
    assert short.value.room <= room * 2 // 10 + (64 << 20)  # (the machine's own wobble)
    with claim(room // 10):  # (what is left still fits)
        assert os.getpid() in _claimed_pids(ledger)
    assert os.getpid() not in _claimed_pids(ledger)
    _end(a)
    _end(b)
    assert _claimed_pids(ledger) == []
    with claim(room * 4 // 10):
        pass


def test_a_claim_whose_process_was_killed_is_ignored(ledger: Path, room: int,
                                                      claimant: Callable[[int], subprocess.Popen[str]]) -> None:
    """A rank killed while it reserves leaves its line in the ledger; the next reader drops
    it, and a process that reused its pid (here: this one, with another start time) is not
    taken for it. Lines cut short by a killed writer are left out."""
    dead = claimant(room * 8 // 10)
    with pytest.raises(MemoryShort), claim(room // 2):
        pass
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    assert _claimed_pids(ledger) == [dead.pid]  # (nobody has read it since)
    with ledger.open("a") as f:
        f.write(f"{os.getpid()} 1 reused-pid {0}\n12 34 cut")
    with claim(room // 2):
        assert _claimed_pids(ledger) == [os.getpid()]
    assert ledger.read_text() == ""


def test_without_a_ledger_a_reservation_is_checked_on_its_own(tmp_path: Path, room: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger directory that cannot be used (missing here; read-only elsewhere): a claim is
    checked against the available memory alone, as before ledgers."""
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "missing"))
    with pytest.raises(MemoryShort) as short, claim(room * 2):
        pass
    assert short.value.pending == 0
    with claim(room // 10):
        pass
    monkeypatch.delenv(LEDGER_ENV)
    assert ledger_path().parent in (Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp")))


def test_a_pool_reservation_claims_its_bytes_while_it_allocates(
        ledger: Path, room: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BufferPool.reserve`` holds its claim exactly while it allocates and touches its
    slots, and lets go of it after, whether the allocation worked or failed."""
    seen: list[str] = []
    real = BufferPool._new_arena

    def watched(self: BufferPool, nbytes: int, used: int) -> np.ndarray:
        seen.append(ledger.read_text())
        return real(self, nbytes, used)

    monkeypatch.setattr(BufferPool, "_new_arena", watched)
    assert BufferPool(8 << 20, pin=False).reserve((1 << 20,), torch.uint8) == 8
    assert len(seen) == 1 and seen[0].split()[0] == str(os.getpid())
    assert int(seen[0].split()[3]) < room  # (what it leaves: the room less its 8 MiB)
    assert ledger.read_text() == ""

    def refuse(self: BufferPool, nbytes: int, used: int) -> np.ndarray:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(BufferPool, "_new_arena", refuse)
    with pytest.raises(ConfigError, match="allocating"):
        BufferPool(8 << 20, pin=False).reserve((1 << 20,), torch.uint8)
    assert ledger.read_text() == ""


def test_a_pool_that_fits_alone_is_refused_while_another_worker_reserves(
        ledger: Path, room: int, claimant: Callable[[int], subprocess.Popen[str]],
        forbid_pool_allocations: Callable[[], AbstractContextManager[None]]) -> None:
    """What a rank sees when the ranks before it are still reserving: refused before it
    allocates, told why; after they are done, the same pool would pass the check."""
    other = claimant(room * 6 // 10)
    pool = BufferPool(room * 6 // 10, pin=False)
    with forbid_pool_allocations(), pytest.raises(ConfigError) as err:
        pool.reserve((64 << 20,), torch.uint8)
    assert "less what 1 other kvtier worker(s) on this host are reserving at the same time" in str(err.value)
    assert pool.allocated_bytes == 0 and ledger.read_text().split()[0] == str(other.pid)
    _end(other)
    with forbid_pool_allocations(), pytest.raises(AssertionError, match="the check let it through"):
        BufferPool(room * 6 // 10, pin=False).reserve((64 << 20,), torch.uint8)


def test_a_link_or_a_pipe_at_the_ledgers_name_is_not_used(ledger: Path, room: int) -> None:
    """The ledger lives where every user may write: a link planted at its name is not
    followed (the rewrite would empty the file it points to), nor is a named pipe opened (a
    read would hang); the reservation is then checked on its own."""
    victim = ledger.parent / "victim"
    victim.write_text("precious\n")
    ledger.symlink_to(victim)
    with pytest.raises(MemoryShort) as short, claim(room * 2):
        pass
    assert short.value.pending == 0
    with claim(room // 10):
        pass
    assert victim.read_text() == "precious\n"
    ledger.unlink()
    os.mkfifo(ledger)
    with claim(room // 10):
        pass


def test_a_ledger_that_cannot_be_written_leaves_the_check_on_its_own(
        ledger: Path, room: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``/dev/shm`` full (injected: a write that fails with ENOSPC): the ledger is a help to
    the check, not a condition of starting: the reservation is checked on its own."""
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(os, "pwrite", full)
    with claim(room // 10):
        pass
    with pytest.raises(MemoryShort) as short, claim(room * 2):
        pass
    assert short.value.pending == 0
