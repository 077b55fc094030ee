"""Claims on host memory by workers that reserve their chunk buffers at the same time.

Each tensor-parallel rank of a server reserves its own pool when it starts, and the ranks
start together. Checked one by one against what the kernel counts as available
(:mod:`kvtier.host_memory`), eight ranks would each see the memory before the others have
touched theirs, and each pass a check that only some should: then the OOM killer settles it.
So a reservation first claims its bytes in a small ledger that the other processes read, and
the room a new claim sees is the least of what is available now and what each claim in the
ledger said it would leave (``after``, recorded when it was made). The ledger's lock is held
only to read and rewrite it, never while allocating: reservations still touch their pages in
parallel.

A claim that is done stays in the ledger, marked done, until every claim made before it is
done too: its ``after`` is what still accounts for an earlier claim that has not touched its
pages yet (once all before it are done, everything it stood for is in ``MemAvailable``). A
claim whose process is gone (killed part-way) is dropped by the next reader: its memory went
with it. The ``after`` figures are snapshots: memory freed meanwhile is seen once the claims
before it are done (an error towards refusing, with a message that says so).

The ledger is a file in ``/dev/shm`` (the ranks of a server share it: vLLM passes their
messages through it), else in the temporary directory, or in the directory
``KVTIER_HOST_MEMORY_LEDGER`` names. Only processes that can tell whether each other is alive
(one PID namespace) and whose room is the same figure (the same cgroups) share a ledger: its
name holds both. It is a help to the check, never a condition of starting: where it cannot be
used (a link or a pipe at its name, a directory that cannot be written, a lock held for
seconds, content too large), a reservation is checked on its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from kvtier.backends.index import pid_alive, pid_scope
from kvtier.host_memory import available_bytes

log = logging.getLogger(__name__)

LEDGER_ENV = "KVTIER_HOST_MEMORY_LEDGER"
LEDGER_NAME = "kvtier-host-memory-claims"
LOCK_WAIT_S = 10.0  # (the lock is held for a read and a rewrite: microseconds, unless someone holds it on purpose)
_MAX_LEDGER_BYTES = 1 << 20  # (a few claims: a larger file is not ours to trust)
_LINE = re.compile(r"(\d{1,10}) (\d{1,20}|\?) ([0-9a-f]{16}) (\d{1,20}) (run|done)")


class MemoryShort(Exception):
    """A claim larger than the room the host has for it."""

    def __init__(self, room: int, pending: int) -> None:
        super().__init__(f"{room} bytes of room")
        self.room = room  # bytes, after the claims in the ledger
        self.pending = pending  # claims of other reservations still allocating


class _Claim(NamedTuple):
    pid: int
    started: str  # the process's start time (a pid reused by another process is not it)
    token: str
    after: int  # bytes of room the host has left once this claim (and those before it) are allocated
    done: bool

    def line(self) -> str:
        return f"{self.pid} {self.started} {self.token} {self.after} {'done' if self.done else 'run'}\n"


@contextlib.contextmanager
def claim(need: int) -> Iterator[None]:
    """Claim ``need`` bytes of host memory for as long as the block allocates them; raises
    :class:`MemoryShort` (nothing claimed) if the room left, after the claims of other
    reservations, is less. Nothing is refused where the room is unknown."""
    fd = _open_ledger()
    mine = None
    try:
        if fd is not None:
            try:
                mine = _record(fd, need)
            except MemoryShort:
                raise
            except Exception as exc:  # (the ledger is a help, not a condition: /dev/shm full, garbage)
                log.warning("kvtier: the host-memory ledger %s cannot be used (%s): this reservation is "
                            "checked on its own", ledger_path(), exc)
                os.close(fd)
                fd = None
        if fd is None:
            _room_for(need, [])
        yield
    finally:
        try:
            if fd is not None and mine is not None and mine.pid == os.getpid():  # (not in a forked child)
                _finish(fd, mine)
        finally:
            if fd is not None:
                os.close(fd)


def ledger_path() -> Path:
    """This process's ledger (see the module's docstring)."""
    named = os.environ.get(LEDGER_ENV, "").strip()
    if named:
        base = Path(named)
    else:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"{LEDGER_NAME}-{_memory_domain()}"


def _memory_domain() -> str:
    """What the processes sharing a ledger have in common: the host and PID namespace (where
    their pids can be checked) and the cgroups (whose limits their room is measured within)."""
    try:
        cgroups = Path("/proc/self/cgroup").read_bytes()
    except OSError:
        cgroups = b"-"
    return hashlib.sha256(pid_scope() + cgroups).hexdigest()[:16]


def _record(fd: int, need: int) -> _Claim | None:
    """Add this process's claim of ``need`` bytes (tidying the ledger); raises
    :class:`MemoryShort` where it does not fit. None where there is nothing to check
    against (nothing recorded)."""
    with _locked(fd):
        claims = _tidy(_read(fd))
        try:
            room = _room_for(need, claims)
        except MemoryShort:
            _write(fd, claims)  # (tidied all the same)
            raise
        mine = None if room is None else _Claim(os.getpid(), _started(os.getpid()) or "?",
                                                secrets.token_hex(8), room - need, False)
        _write(fd, claims if mine is None else [*claims, mine])
        return mine


def _room_for(need: int, claims: list[_Claim]) -> int | None:
    """The room a claim of ``need`` bytes has: the least of what is available now and what
    each of ``claims`` leaves; raises :class:`MemoryShort` if less than ``need``. None where
    none of it is known (nothing is refused then)."""
    room = min((f for f in (available_bytes(), *(c.after for c in claims)) if f is not None), default=None)
    if room is not None and need > room:
        raise MemoryShort(room, sum(not c.done for c in claims))
    return room


def _finish(fd: int, mine: _Claim) -> None:
    """Mark this process's claim done (see the module's docstring)."""
    try:
        with _locked(fd):
            _write(fd, _tidy([c._replace(done=True) if c.token == mine.token else c for c in _read(fd)]))
    except Exception as exc:  # (left running: it counts until this process is gone)
        log.warning("kvtier: could not mark a claim done in the host-memory ledger %s (%s)", ledger_path(), exc)


def _tidy(claims: list[_Claim]) -> list[_Claim]:
    """Drop the claims of processes that are gone, then the done claims no running claim is
    before: both are in ``MemAvailable`` now (what a killed process had taken is free)."""
    kept = [c for c in claims if c.done or _is_alive(c)]
    first_running = next((i for i, c in enumerate(kept) if not c.done), len(kept))
    return kept[first_running:]


def _open_ledger() -> int | None:
    """The ledger, opened for reading and writing; None where it cannot be used. It lives in
    a directory every user may write to, so a link or anything but a plain file found at its
    name is not followed or used (it could point the rewrite at another file), and one another
    user made is opened as it is (the kernel may refuse to create over it there)."""
    path = ledger_path()
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:  # (another worker made it just now)
                fd = os.open(path, flags)
            else:
                with contextlib.suppress(OSError):  # (every user's workers share it; umask would narrow it)
                    os.fchmod(fd, 0o666)
    except OSError as exc:  # (a link, a read-only directory, another user's file not shared)
        log.warning("kvtier: no host-memory ledger at %s (%s): the reservation is checked on its own", path, exc)
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # (a hard link: another file's name)
        os.close(fd)
        log.warning("kvtier: %s is not a plain file of its own: the reservation is checked on its own", path)
        return None
    return fd


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"its lock was held for over {LOCK_WAIT_S:.0f} s") from None
            time.sleep(0.005)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _read(fd: int) -> list[_Claim]:
    size = os.fstat(fd).st_size
    if size > _MAX_LEDGER_BYTES:
        raise ValueError(f"it holds {size} bytes, more than any ledger kvtier writes")
    data = b""
    while len(data) < size and (piece := os.pread(fd, size - len(data), len(data))):
        data += piece
    out = []
    for line in data.decode("ascii", "replace").splitlines():
        m = _LINE.fullmatch(line)  # (a line cut short by a process killed while writing: left out)
        if m:
            out.append(_Claim(int(m[1]), m[2], m[3], int(m[4]), m[5] == "done"))
    return out


def _write(fd: int, claims: list[_Claim]) -> None:
    """Rewrite the ledger: the new content first, then cut what is left of the old (a write
    that fails leaves the claims as they were, not an empty ledger)."""
    data = "".join(c.line() for c in claims).encode("ascii")
    at = 0
    while at < len(data):
        at += os.pwrite(fd, data[at:], at)
    os.ftruncate(fd, len(data))


def _is_alive(c: _Claim) -> bool:
    """Whether the process that made claim ``c`` is still running."""
    now = _started(c.pid)
    return now is not None and (now == c.started or "?" in (now, c.started))


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot): None if it is gone (or a zombie),
    ``"?"`` where there is no /proc to tell."""
    if not Path("/proc/self/stat").exists():
        return "?" if pid_alive(pid) else None
    try:
        # (state is field 3, start time field 22; the name before them may hold spaces, or
        # bytes that are not UTF-8)
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        state, started = fields[0], fields[19].decode("ascii")
    except (OSError, IndexError, ValueError):
        return None
    return None if state in (b"Z", b"X") else started
