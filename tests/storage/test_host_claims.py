"""Workers that reserve their chunk buffers at the same time (the tensor-parallel ranks of a
server) claim their bytes in a ledger the others read (``kvtier.host_claims``), so that each
sees the room the others' reservations will leave, not the memory before them.

The claimants are real processes, on a real ledger (in the test's own directory, through
``KVTIER_HOST_MEMORY_LEDGER``) against this machine's real available memory; a claim alone
allocates nothing, so these tests claim most of the machine without touching it. Figures
are compared with what the ledger recorded, not with a reading taken earlier: the machine's
available memory moves by tens of MiB between two readings."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier import host_claims
from kvtier.buffer_pool import BufferPool
from kvtier.errors import ConfigError
from kvtier.host_claims import LEDGER_ENV, MemoryShort, claim, ledger_path
from kvtier.host_memory import available_bytes

# claims `argv[1]` bytes once a line arrives on stdin (so that several start at once), says
# whether it got them, and holds them until stdin closes
CLAIMANT = """
import sys
from kvtier.host_claims import MemoryShort, claim
print("ready", flush=True)
sys.stdin.readline()
try:
    with claim(int(sys.argv[1])):
        print("claimed", flush=True)
        sys.stdin.readline()
except MemoryShort:
    print("short", flush=True)
"""

Claimant = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path))
    return ledger_path()


@pytest.fixture
def room() -> int:
    got = available_bytes()
    if got is None:
        pytest.skip("the host's memory is read from Linux's /proc")
    return got


@pytest.fixture
def claimant(ledger: Path) -> Iterator[Claimant]:
    """``claimant(n)``: a process that has claimed ``n`` bytes and holds them until
    :func:`_end`; ``claimant(n, go=False)``: one that waits to be told (``_go``)."""
    started: list[subprocess.Popen[str]] = []

    def start(n: int, go: bool = True) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", CLAIMANT, str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        started.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        if go:
            assert _go(p) == "claimed"
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def _go(p: subprocess.Popen[str]) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("go\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def _end(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait(30) == 0


def _lines(ledger: Path) -> list[list[str]]:
    """The ledger's claims: pid, start time, token, room after, run/done."""
    return [line.split() for line in ledger.read_text().splitlines()]


def test_claims_of_processes_reserving_at_once_add_up(ledger: Path, room: int, claimant: Claimant) -> None:
    """Two claims of 40 % each fit, a third of 40 % does not (each alone would: what ranks
    checking the memory one by one would all have seen), and it is told the room the first
    two leave and that two others are reserving. Once they are done, it fits."""
    a = claimant(room * 4 // 10)
    b = claimant(room * 4 // 10)
    recorded = _lines(ledger)
    assert [int(c[0]) for c in recorded] == [a.pid, b.pid] and {c[4] for c in recorded} == {"run"}
    with pytest.raises(MemoryShort) as short, claim(room * 4 // 10):
        pass
    assert short.value.pending == 2 and short.value.room <= int(recorded[1][3])
    with claim(room // 10):  # (what is left still fits)
        assert int(_lines(ledger)[-1][0]) == os.getpid()
    # (done, but kept while claims made before it run: see the next test)
    assert [(int(c[0]), c[4]) for c in _lines(ledger)] == [(a.pid, "run"), (b.pid, "run"), (os.getpid(), "done")]
    _end(a)
    _end(b)
    assert _lines(ledger) == []
    with claim(room * 4 // 10):
        pass


def test_a_claim_done_before_an_earlier_one_still_counts_it(ledger: Path, room: int,
                                                            claimant: Claimant) -> None:
    """A claims, B claims after it, B finishes first while A has touched nothing yet: B's
    record stays (marked done), since its figure is what still accounts for A's bytes; a
    third claim is refused until A is done too, then both records go."""
    a = claimant(room * 4 // 10)
    b = claimant(room * 4 // 10)
    _end(b)
    assert [(int(c[0]), c[4]) for c in _lines(ledger)] == [(a.pid, "run"), (b.pid, "done")]
    with pytest.raises(MemoryShort) as short, claim(room * 4 // 10):
        pass
    assert short.value.pending == 1
    _end(a)
    assert _lines(ledger) == []
    with claim(room * 4 // 10):
        pass


def test_ranks_that_claim_at_the_same_instant_are_admitted_only_as_far_as_the_room_goes(
        ledger: Path, room: int, claimant: Claimant) -> None:
    """Eight processes told to claim 30 % each at once: three get it, five are refused (the
    ledger's lock orders them; without it, several read the ledger before any wrote)."""
    ps = [claimant(room * 3 // 10, go=False) for _ in range(8)]
    for p in ps:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    said = [p.stdout.readline().strip() for p in ps if p.stdout is not None]
    assert sorted(said) == ["claimed"] * 3 + ["short"] * 5, said


def test_a_claim_whose_process_was_killed_is_ignored(ledger: Path, room: int, claimant: Claimant) -> None:
    """A rank killed while it reserves leaves its record in the ledger; the next reader drops
    it, unreaped (a zombie) or reaped, and a process that reused its pid (here: this one,
    with another start time) is not taken for it. Lines cut short or out of shape (a number
    too long to be one kvtier wrote) are left out."""
    zombie = claimant(room * 8 // 10)
    os.kill(zombie.pid, signal.SIGKILL)
    while Path(f"/proc/{zombie.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
        time.sleep(0.01)
    with ledger.open("a") as f:
        f.write(f"{os.getpid()} 1 {'ab' * 8} 0 run\n{os.getpid()} ? {'cd' * 8} {'9' * 5000} run\n12 34 cut")
    with claim(room // 2):
        assert [int(c[0]) for c in _lines(ledger)] == [os.getpid()]
    zombie.wait()
    dead = claimant(room * 8 // 10)
    dead.kill()
    dead.wait()
    with claim(room // 2):
        assert [int(c[0]) for c in _lines(ledger)] == [os.getpid()]
    assert ledger.read_text() == ""


def test_claims_of_one_process_and_of_a_forked_child_are_kept_apart(ledger: Path, room: int) -> None:
    """Two pools reserving in one process each take their own claim out; a child forked
    while a claim is held does not take it out when it unwinds."""
    child = False
    try:
        with claim(room // 10):
            with claim(room // 10):
                assert len(_lines(ledger)) == 2
            assert [c[4] for c in _lines(ledger)] == ["run", "done"]
            pid = os.fork()
            if pid == 0:  # (the child unwinds the block, then leaves without pytest's clean-up)
                child = True
                raise SystemExit
            os.waitpid(pid, 0)
            assert [c[4] for c in _lines(ledger)] == ["run", "done"]
    finally:
        if child:
            os._exit(0)
    assert _lines(ledger) == []


def test_without_a_ledger_a_reservation_is_checked_on_its_own(tmp_path: Path, room: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger directory that cannot be used (missing here; read-only elsewhere): a claim is
    checked against the available memory alone, as before ledgers. By default the ledger is
    in /dev/shm (else the temporary directory), named for this PID namespace and cgroup."""
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "missing"))
    with pytest.raises(MemoryShort) as short, claim(room * 2):
        pass
    assert short.value.pending == 0
    with claim(room // 10):
        pass
    monkeypatch.delenv(LEDGER_ENV)
    default = ledger_path()
    assert default.parent in (Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp")))
    assert default.name.startswith(host_claims.LEDGER_NAME)


def test_a_ledger_that_cannot_be_used_leaves_the_check_on_its_own(
        ledger: Path, room: int, claimant: Claimant, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The ledger is a help to the check, never a condition of starting, nor a way to hang
    a worker: a link at its name (not followed: its target is untouched), a hard link, a named pipe, its
    lock held by someone else, a file larger than any ledger, a rewrite that fails
    (``/dev/shm`` full, injected; the claims recorded before stay as they were): each time
    the reservation is checked on its own, and the reason is logged."""
    caplog.set_level(logging.WARNING, logger="kvtier.host_claims")

    def on_its_own() -> None:
        with pytest.raises(MemoryShort) as short, claim(room * 2):
            pass
        assert short.value.pending == 0
        with claim(room // 10):
            pass

    victim = ledger.parent / "victim"
    victim.write_text("precious\n")
    ledger.symlink_to(victim)
    on_its_own()
    assert victim.read_text() == "precious\n" and "no host-memory ledger at" in caplog.text
    ledger.unlink()
    os.link(victim, ledger)
    on_its_own()
    assert victim.read_text() == "precious\n" and "is not a plain file of its own" in caplog.text
    ledger.unlink()
    caplog.clear()
    os.mkfifo(ledger)
    on_its_own()
    assert "is not a plain file" in caplog.text
    ledger.unlink()
    ledger.write_bytes(b"1 1 x 1 run\n" * (1 << 17))
    on_its_own()
    assert "more than any ledger kvtier writes" in caplog.text
    ledger.unlink()

    other = claimant(room // 10)
    before = ledger.read_text()
    monkeypatch.setattr(host_claims, "LOCK_WAIT_S", 0.2)
    with ledger.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t = time.monotonic()
        on_its_own()
        assert time.monotonic() - t < 10
    assert "its lock was held" in caplog.text

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(os, "pwrite", full)
    on_its_own()
    assert ledger.read_text() == before and int(_lines(ledger)[0][0]) == other.pid


def test_a_pool_reservation_claims_its_bytes_while_it_allocates(
        ledger: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BufferPool.reserve`` holds its claim exactly while it allocates and touches its
    slots, and lets go of it after, whether the allocation worked or failed."""
    seen: list[list[list[str]]] = []
    real = BufferPool._new_arena

    def watched(self: BufferPool, nbytes: int, used: int) -> np.ndarray:
        seen.append(_lines(ledger))
        return real(self, nbytes, used)

    monkeypatch.setattr(BufferPool, "_new_arena", watched)
    assert BufferPool(8 << 20, pin=False).reserve((1 << 20,), torch.uint8) == 8
    assert len(seen) == 1 and [(int(c[0]), c[4]) for c in seen[0]] == [(os.getpid(), "run")]
    assert _lines(ledger) == []

    def refuse(self: BufferPool, nbytes: int, used: int) -> np.ndarray:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(BufferPool, "_new_arena", refuse)
    with pytest.raises(ConfigError, match="allocating"):
        BufferPool(8 << 20, pin=False).reserve((1 << 20,), torch.uint8)
    assert _lines(ledger) == []


def test_a_pool_that_fits_alone_is_refused_while_another_worker_reserves(
        ledger: Path, room: int, claimant: Claimant,
        forbid_pool_allocations: Callable[[], AbstractContextManager[None]]) -> None:
    """What a rank sees when the ranks before it are still reserving: refused before it
    allocates, told why; after they are done, the same pool passes the check."""
    other = claimant(room * 6 // 10)
    pool = BufferPool(room * 6 // 10, pin=False)
    with forbid_pool_allocations(), pytest.raises(ConfigError) as err:
        pool.reserve((64 << 20,), torch.uint8)
    assert "less what 1 other kvtier worker(s) on this host are reserving at the same time" in str(err.value)
    assert pool.allocated_bytes == 0 and [int(c[0]) for c in _lines(ledger)] == [other.pid]
    _end(other)
    with forbid_pool_allocations(), pytest.raises(AssertionError, match="the check let it through"):
        BufferPool(room * 6 // 10, pin=False).reserve((64 << 20,), torch.uint8)


def test_only_processes_of_one_pid_namespace_and_cgroup_share_a_ledger(ledger: Path) -> None:
    """A rank of this server (same PID namespace and cgroups) finds the same ledger; a
    process in another PID namespace (a container sharing /dev/shm) another one, so it
    never takes this namespace's live pids for dead."""
    show = [sys.executable, "-c", "from kvtier.host_claims import ledger_path; print(ledger_path())"]
    rank = subprocess.run(show, capture_output=True, text=True, check=True)
    assert rank.stdout.strip() == str(ledger)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here to start a process in another PID namespace")
    other = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *show], capture_output=True, text=True)
    if other.returncode != 0:
        pytest.skip(f"this machine does not let a test make a PID namespace: {other.stderr.strip()}")
    elsewhere = Path(other.stdout.strip())
    assert elsewhere.parent == ledger.parent and elsewhere.name != ledger.name
