"""Claims on host memory by workers that reserve their chunk buffers at the same time.

Each tensor-parallel rank of a server (and each server on a host) reserves its own pool when
it starts, and they start together. Checked one by one against what the kernel counts as
available (:mod:`kvtier.host_memory`), eight ranks would each see the memory before the
others have touched theirs, and each pass a check that only the first should: then the OOM
killer settles it. So a reservation first claims its bytes in a small ledger that every
process on the host reads, and the room a new claim sees is the least of what is available
now and what each claim still being allocated will leave once it is done (a claim records
that figure when it is made). The ledger's lock is held only to read and rewrite it, never
while allocating: reservations still touch their pages in parallel.

The ledger is a file in ``/dev/shm`` (the ranks of a server share it: vLLM passes their
messages through it), else in the temporary directory, or in the directory
``KVTIER_HOST_MEMORY_LEDGER`` names; processes that share the host's memory must see the
same one. A claim goes when its reservation ends, however it ends; a claim whose process is
gone (killed part-way) is ignored and dropped by the next reader. Where the ledger cannot
be opened, a reservation is checked on its own, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from kvtier.host_memory import available_bytes

log = logging.getLogger(__name__)

LEDGER_ENV = "KVTIER_HOST_MEMORY_LEDGER"
LEDGER_NAME = "kvtier-host-memory-claims"


class MemoryShort(Exception):
    """A claim larger than the room the host has for it."""

    def __init__(self, room: int, pending: int) -> None:
        super().__init__(f"{room} bytes of room")
        self.room = room  # bytes, after the claims being allocated
        self.pending = pending  # claims of other processes being allocated now


class _Claim(NamedTuple):
    pid: int
    started: str  # the process's start time (a pid reused by another process is not it)
    token: str
    after: int  # bytes of room the host has left once this claim is allocated

    def line(self) -> str:
        return f"{self.pid} {self.started} {self.token} {self.after}\n"


@contextlib.contextmanager
def claim(need: int) -> Iterator[None]:
    """Claim ``need`` bytes of host memory for as long as the block allocates them; raises
    :class:`MemoryShort` (nothing claimed) if the room left, after the claims of other
    processes still allocating, is less. Nothing is refused where the room is unknown."""
    fd = _open_ledger()
    mine = None
    try:
        if fd is not None:
            try:
                mine = _record(fd, need)
            except OSError as exc:  # (/dev/shm full, say: the ledger is a help, not a condition)
                log.debug("kvtier: the host-memory ledger failed (%s): the reservation is checked on its own", exc)
                os.close(fd)
                fd = None
        if fd is None:
            room = available_bytes()
            if room is not None and need > room:
                raise MemoryShort(room, 0)
        yield
    finally:
        if fd is not None:
            if mine is not None:
                try:
                    with _locked(fd):
                        _write(fd, [c for c in _live(_read(fd)) if c.token != mine.token])
                except OSError as exc:  # (left for the next reader to drop once this process is gone)
                    log.debug("kvtier: could not take a claim out of the host-memory ledger (%s)", exc)
            os.close(fd)


def _record(fd: int, need: int) -> _Claim | None:
    """(Under the ledger's lock.) Add this process's claim of ``need`` bytes, dropping the
    claims of processes that are gone; raises :class:`MemoryShort` where it does not fit.
    None where there is nothing to check against (nothing recorded)."""
    with _locked(fd):
        claims = _live(_read(fd))
        known = [f for f in (available_bytes(), *(c.after for c in claims)) if f is not None]
        mine = None
        if known:
            least = min(known)
            if need > least:
                _write(fd, claims)
                raise MemoryShort(least, len(claims))
            mine = _Claim(os.getpid(), _started(os.getpid()) or "?", secrets.token_hex(8), least - need)
            claims.append(mine)
        _write(fd, claims)
        return mine


def ledger_path() -> Path:
    """Where this host's claims are kept (see the module's docstring)."""
    named = os.environ.get(LEDGER_ENV, "").strip()
    if named:
        return Path(named) / LEDGER_NAME
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / LEDGER_NAME


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
        log.debug("kvtier: no host-memory ledger at %s (%s): the reservation is checked on its own", path, exc)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        log.debug("kvtier: %s is not a plain file: the reservation is checked on its own", path)
        return None
    return fd


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _read(fd: int) -> list[_Claim]:
    data = b""
    while chunk := os.pread(fd, 1 << 16, len(data)):
        data += chunk
    out = []
    for line in data.decode("ascii", "replace").splitlines():
        parts = line.split()
        # (a line cut short by a process killed while writing: left out)
        if len(parts) == 4 and parts[0].isdigit() and parts[3].lstrip("-").isdigit():
            out.append(_Claim(int(parts[0]), parts[1], parts[2], int(parts[3])))
    return out


def _write(fd: int, claims: list[_Claim]) -> None:
    data = "".join(c.line() for c in claims).encode("ascii")
    os.ftruncate(fd, 0)
    if data:
        os.pwrite(fd, data, 0)


def _live(claims: list[_Claim]) -> list[_Claim]:
    """The claims whose process is still the one that made them."""
    out = []
    for c in claims:
        now = _started(c.pid)
        if now is not None and (now == c.started or "?" in (now, c.started)):
            out.append(c)
    return out


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot): None if it is gone (or a zombie),
    ``"?"`` where there is no /proc to tell."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # (another user's process)
            pass
        return "?"
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # (state is field 3, start time field 22; the name before them may hold spaces)
    return None if fields[0] in ("Z", "X") else fields[19]
