"""A KV pipe over kvtier's shared tiers: vLLM's ``KVPipeBase`` contract, keyed in a store.

vLLM's (v0) disaggregated-prefill design passed KV between a prefill and a decode instance
through a *pipe*: ``send_tensor(tensor or None)`` on one side, ``recv_tensor()`` on the
other, first in first out, and ``close()``. Its interface notes that a platform which
already supports key-value lookup can stand on that instead of a stream. This pipe does
exactly that: message ``n`` of pipe ``NAME`` is stored under a key derived from
``(NAME, n)`` in a Redis server or cluster (the remote tier's records: self-verifying,
split into parts) or in a shared directory (one file per message, renamed into place
when complete); two counters, the producer's head and the consumer's tail, live in the same
store, so either side can restart and the FIFO resumes where it was. A message is deleted
once received. Tensors may be of any dtype the record format knows (the KV dtypes, plus
int16/32/64, float64 and bool), any shape up to 8 dimensions, on any device (received on
``device``). ``tensor_key`` addresses a message directly instead of by order.

It is not the connector: the connector shares *prefixes* by content, across any number of
servers; a pipe hands each message from one producer to one consumer, once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier import codec
from kvtier.config import positive_int, seconds
from kvtier.errors import ConfigError, RecordError, RecordTooLarge
from kvtier.remote.nodes import NodeUnavailable
from kvtier.remote.tier import MAX_VALUE_BYTES, DamagedRemoteRecord, RemoteRefused, is_refusal

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier")

_NONE = b"KVTPIPE\x00NONE"
_SKIP = b"KVTPIPE\x00SKIP"  # a place in the order whose message could not be stored
_SKIPPED = object()
_NS = b"kvtier-kv-pipe\x00\x00"  # the records' namespace field (16 bytes)
_POLL_S = (0.0005, 0.05)  # recv polls from 0.5 ms, backing off to 50 ms
_HEAD_CHECK_S = 0.25  # while waiting, how often a receiver looks whether a later place was taken
# Advance a counter to ARGV[1] unless it is there already (or past): a retried advance, after
# a reply lost to a timeout, is then a no-op instead of a second step.
_ADVANCE_BODY = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]); return tonumber(ARGV[1]) end
return cur
"""
# Also on a server over its maxmemory (noeviction): a receiver's advance comes before it
# deletes the message, the one thing that frees memory, so a refused advance stuck the pipe
# for good. The flag needs Redis 7; an older server refuses the first line, and gets the body.
_ADVANCE_LUA = "#!lua flags=allow-oom" + _ADVANCE_BODY


def _names_a_server(where: str) -> bool:
    """Whether ``where`` is meant as a server's address (``SCHEME:/...``, any case, however
    mistyped) rather than a directory: a mistyped address must be an error, not a directory
    of that name where the other side never looks."""
    return re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", where) is not None


def _message_key(name: str, which: str) -> bytes:
    return hashlib.sha256(f"kvtier-pipe\0{name}\0{which}".encode()).digest()


class KVPipe:
    """One named pipe in a shared store: ``where`` is a ``redis://``, ``rediss://`` or
    ``redis+cluster://`` address, or a directory both sides can reach. ``password`` and
    ``tls_ca`` are the remote tier's ``remote_password`` and ``remote_tls_ca``, for a Redis pipe."""

    def __init__(self, where: str | Path, name: str, *, device: str = "cpu",
                 timeout_s: float = 5.0, max_tensor_bytes: int = 1 << 30,
                 skip_after_s: float = 5.0, password: str | None = None,
                 tls_ca: str | None = None) -> None:
        if not isinstance(where, str | os.PathLike):
            raise TypeError(f"KVPipe(where, name): where must be a redis:// address or a directory path, "
                            f"got {type(where).__name__}")
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
            # (".." would put a directory pipe's files beside its directory, "." in it)
            raise ConfigError(f"pipe name {name!r}: must be non-empty, without '/' or NUL, and not '.' or '..'")
        # (None or a string would fail far from here: None blocked a Redis socket for good)
        for setting, value in (("timeout_s", timeout_s), ("skip_after_s", skip_after_s)):
            seconds(f"KVPipe({setting})", value)
        if not timeout_s > 0:
            raise ConfigError(f"KVPipe(timeout_s): must be above 0 seconds, got {timeout_s!r}")
        if skip_after_s < 0:
            raise ConfigError(f"skip_after_s {skip_after_s}: must be >= 0")
        positive_int("KVPipe(max_tensor_bytes)", max_tensor_bytes)
        self.name = name
        self.device = device
        self.max_tensor_bytes = max_tensor_bytes
        self.skip_after_s = skip_after_s
        self._closed = False
        # (head seen, when): every place below that head was taken by then; one still empty
        # skip_after_s later is given up on (its send failed without leaving a skip marker)
        self._gap: tuple[int, float] | None = None
        self._head_seen_at = 0.0  # when _given_up last read the head
        # a message taken whose tail advance failed: (seq, key, outcome), handed out next time
        self._pending: tuple[int, bytes, object] | None = None
        self._counts = {"received": 0, "skipped": 0, "damaged": 0, "too_large": 0}
        self._said_waiting = -1e9  # when _waiting last logged
        _register_with_vllm()
        if _names_a_server(str(where)):  # (parse_remote says what is wrong with a bad address)
            self._store: _Store = _RedisStore(str(where), name, timeout_s, password, tls_ca)
        else:
            if password is not None or tls_ca is not None:
                raise ConfigError("password and tls_ca are for a Redis pipe; a directory pipe has neither")
            self._store = _DirStore(Path(where), name)

    # -- vLLM's KVPipeBase contract ----------------------------------------------------
    def send_tensor(self, tensor: torch.Tensor | None, tensor_key: str = "") -> None:
        """Queue ``tensor`` (or None) for the consumer; returns once it is stored."""
        self._check_open()
        if tensor is not None:
            import torch  # (lazily: kvtier imports without torch)

            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"kvtier pipe: send_tensor takes a torch.Tensor or None, got {type(tensor).__name__}")
        if tensor is None:
            header, payload = _NONE, memoryview(b"")
        else:  # a tensor kvtier cannot store fails here, before it takes a place in the order
            t = tensor.detach()
            if codec.DTYPE_CODES.get(codec.dtype_name(t.dtype)) is None or t.dim() > codec.MAX_NDIM:
                raise ValueError(f"kvtier pipe: cannot send a {t.dtype} tensor of {t.dim()} dimensions "
                                 f"(dtypes: {', '.join(codec.DTYPE_CODES)}; at most {codec.MAX_NDIM} dimensions)")
            limit = min(self.max_tensor_bytes, self._store.max_bytes)
            if t.nbytes > limit:
                raise ValueError(f"kvtier pipe: a tensor of {t.nbytes} bytes is over this pipe's largest "
                                 f"message, {limit} bytes (max_tensor_bytes; in Redis, at most its "
                                 "512 MB per value)")
            if t.device.type != "cpu":
                t = t.to("cpu")
        seq = None if tensor_key else self._store.next_seq("head")
        key = _message_key(self.name, f"key:{tensor_key}" if tensor_key else f"seq:{seq}")
        if tensor is not None:
            header, payload = codec.encode(t.contiguous(), key=key, namespace_id=_NS, token_start=0,
                                           num_tokens=0)
        try:
            self._store.put(key, header, payload)
        except OSError:
            if seq is not None:  # its place in the order is taken: mark it skipped, or the
                with contextlib.suppress(OSError):  # consumer would wait for it for ever
                    self._store.put(key, _SKIP, memoryview(b""))
            raise

    def recv_tensor(self, tensor_key: str = "", timeout: float | None = None) -> torch.Tensor | None:
        """The next tensor (or None) in send order, or the one sent under ``tensor_key``;
        waits for it (up to ``timeout`` seconds, then :class:`TimeoutError`), also while the
        store cannot answer; a server that refuses this client (credentials, a database it
        lacks, an ACL) raises :class:`~kvtier.remote.tier.RemoteRefused` (an ``OSError``) at
        once. A damaged message is consumed and raises :class:`RecordError` once, one over
        ``max_tensor_bytes`` :class:`RecordTooLarge`; the next receive gets the next one."""
        self._check_open()
        if timeout is not None:
            seconds("recv_tensor(timeout)", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if tensor_key:
                key = _message_key(self.name, f"key:{tensor_key}")
                outcome = self._take(key, None, deadline, timeout)
                self._store.delete(key)
            else:
                if self._pending is None:
                    seq = self._peek_tail(deadline, timeout) + 1
                    key = _message_key(self.name, f"seq:{seq}")
                    self._pending = (seq, key, self._take(key, seq, deadline, timeout))
                seq, key, outcome = self._pending
                # the tail first, then the delete: a failure in between leaves the message
                # in the store, never a tail pointing at a deleted one. If the advance fails
                # (OSError), the message stays taken here and the next receive returns it.
                self._store.advance("tail", seq)
                self._pending = None
                self._store.delete(key)
            if outcome is _SKIPPED:
                self._counts["skipped"] += 1
                continue
            if isinstance(outcome, RecordError):
                self._counts["damaged"] += 1
                raise outcome
            if isinstance(outcome, RecordTooLarge):
                self._counts["too_large"] += 1
                raise outcome
            self._counts["received"] += 1
            out: torch.Tensor | None = outcome  # type: ignore[assignment]
            if out is not None and self.device != "cpu":
                out = out.to(self.device)
            return out

    def _peek_tail(self, deadline: float | None, timeout: float | None) -> int:
        """The tail counter, waiting while the store cannot answer (up to the deadline);
        a server that refuses this client raises at once (:class:`RemoteRefused`)."""
        wait = _POLL_S[0]
        while True:
            try:
                return self._store.peek_seq("tail")
            except RemoteRefused:
                raise
            except OSError as exc:
                self._waiting(exc)
                wait = self._pause(wait, deadline, timeout, exc)

    def _take(self, key: bytes, seq: int | None, deadline: float | None, timeout: float | None) -> object:
        """Wait for message ``key`` (place ``seq`` in the order, if by order) and decode it:
        the tensor or None, ``_SKIPPED``, or the :class:`RecordError` of a damaged message."""
        wait = _POLL_S[0]
        last_error: OSError | None = None
        while True:
            try:
                got = self._store.get(key)
            except RecordError as exc:  # there but unreadable: consumed like any message
                return exc
            except RemoteRefused:  # it never will (credentials, permissions): say so now
                raise
            except OSError as exc:  # the store cannot say now (down, slow): wait on
                got, last_error = None, exc
                self._waiting(exc)
            else:
                if got is not None:
                    break
                if seq is not None and self._given_up(seq):
                    log.warning("kvtier pipe %r: message %d is still missing %.1f s after a later "
                                "one's place was taken; skipping it (its send failed)", self.name, seq,
                                self.skip_after_s)
                    return _SKIPPED
            wait = self._pause(wait, deadline, timeout, last_error)
        header, pieces = got
        if header == _SKIP:  # the producer failed to store this one: skip it
            log.warning("kvtier pipe %r: a message was marked skipped by its sender (its send failed)",
                        self.name)
            return _SKIPPED
        if header == _NONE:
            return None
        try:
            return codec.decode_pieces(header, pieces, expect_key=key, max_record_bytes=self.max_tensor_bytes)[1]
        except (RecordError, RecordTooLarge) as exc:  # consumed, raised once: never a wedged FIFO
            return exc

    def _pause(self, wait: float, deadline: float | None, timeout: float | None,
               last_error: OSError | None) -> float:
        """Sleep ``wait`` before polling again, or raise TimeoutError past the deadline;
        the next wait (backing off)."""
        if deadline is not None and time.monotonic() >= deadline:
            why = f" (last error: {last_error})" if last_error is not None else ""
            raise TimeoutError(f"kvtier pipe {self.name!r}: nothing to receive within {timeout} s{why}")
        time.sleep(wait)
        return min(wait * 2, _POLL_S[1])

    def _waiting(self, exc: OSError) -> None:
        """Say, at most every 30 s, that a receive waits for a store that cannot answer."""
        now = time.monotonic()
        if now - self._said_waiting >= 30.0:
            self._said_waiting = now
            log.warning("kvtier pipe %r: the store cannot answer (%s); waiting", self.name, exc)

    def _given_up(self, seq: int) -> bool:
        """Place ``seq`` is empty: give up on it once a later place has been taken for
        ``skip_after_s``. A send takes its place (the head) before storing its message, so a
        later place taken means this send is over, with one producer; the grace period covers
        several producers and a slow store. Absent for other reasons, the wait goes on."""
        now = time.monotonic()
        if self._gap is None or seq >= self._gap[0]:
            if now - self._head_seen_at < _HEAD_CHECK_S:  # an idle wait need not double the polls
                return False
            self._head_seen_at = now
            try:
                head = self._store.peek_seq("head")
            except OSError:
                return False
            if head <= seq:
                return False
            self._gap = (head, now)
        return now - self._gap[1] >= self.skip_after_s

    def stats(self) -> dict[str, int]:
        """Messages this pipe object received, skipped (a failed send: its skip marker, or a
        place left empty past ``skip_after_s``), found damaged (raised as RecordError) and found
        over ``max_tensor_bytes`` (raised as RecordTooLarge)."""
        return dict(self._counts)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"kvtier pipe {self.name!r} is closed")

    def __enter__(self) -> KVPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _register_with_vllm() -> None:
    """Count as a ``KVPipeBase`` where the running vLLM still has that class (checked only
    when vLLM is already imported: kvtier never imports it for this)."""
    if "vllm" not in sys.modules:
        return
    try:
        from vllm.distributed.kv_transfer.kv_pipe.base import KVPipeBase  # type: ignore[import-not-found]
    except Exception:  # vLLM absent, or a version without pipes (V1 has none)
        return
    KVPipeBase.register(KVPipe)


class _Store:
    """``get``: None if absent, RecordError if there but unreadable, OSError if it cannot say."""

    max_bytes = 1 << 62  # the largest tensor a message can hold

    def next_seq(self, counter: str) -> int: ...
    def peek_seq(self, counter: str) -> int: ...
    def advance(self, counter: str, to: int) -> None: ...
    def put(self, key: bytes, header: bytes, payload: memoryview) -> None: ...
    def get(self, key: bytes) -> tuple[bytes, list[bytes | memoryview]] | None: ...
    def delete(self, key: bytes) -> None: ...
    def close(self) -> None: ...


class _RedisStore(_Store):
    """Messages as remote-tier records; counters as Redis integers next to them."""

    max_bytes = MAX_VALUE_BYTES - (64 << 10)  # (room for the manifest and record header)

    def __init__(self, url: str, name: str, timeout_s: float, password: str | None,
                 tls_ca: str | None) -> None:
        from kvtier.metrics import Counters
        from kvtier.remote.tier import RemoteTier

        self.tier = RemoteTier(url=url, password=password, timeout_s=timeout_s, part_bytes=4 << 20,
                               queue_bytes=1, counters=Counters(), writer=False, tls_ca=tls_ca)
        self.name = name
        self._advance_script = _ADVANCE_LUA

    def _counter(self, counter: str, op: str, to: int = 0) -> int:
        k = f"kvpipe:{{{self.name}}}:{counter}"

        def build(p: object) -> None:
            if op == "incr":
                p.incr(k)  # type: ignore[attr-defined]
            elif op == "advance":
                p.eval(self._advance_script, 1, k, to)  # type: ignore[attr-defined]
            else:
                p.get(k)  # type: ignore[attr-defined]

        try:
            routes = self.tier.nodes.route([k])
            if not routes:  # a cluster slot no node serves now (a failover under way)
                raise OSError(f"kvtier pipe {self.name!r}: no cluster node serves its counters now")
            ((node, client, _),) = routes
            (reply,) = self.tier.nodes.run(node, client, build)
        except NodeUnavailable as exc:
            kind = RemoteRefused if exc.refused else OSError
            raise kind(f"kvtier pipe {self.name!r}: the server is unavailable ({exc})") from exc
        if isinstance(reply, Exception) and op == "advance" and self._advance_script is _ADVANCE_LUA \
                and ("near '#'" in str(reply) or "shebang" in str(reply).lower()):  # (before Redis 7)
            self._advance_script = _ADVANCE_BODY
            return self._counter(counter, op, to)
        if isinstance(reply, Exception):
            kind = RemoteRefused if is_refusal(reply) else OSError
            raise kind(f"kvtier pipe {self.name!r}: the server refused a counter update ({reply})")
        return int(reply or 0)

    def next_seq(self, counter: str) -> int:
        return self._counter(counter, "incr")

    def peek_seq(self, counter: str) -> int:
        return self._counter(counter, "get")

    def advance(self, counter: str, to: int) -> None:
        if self._counter(counter, "advance", to) < to:
            raise OSError(f"kvtier pipe {self.name!r}: the {counter} counter did not advance")

    def put(self, key: bytes, header: bytes, payload: memoryview) -> None:
        if self.tier.store_many([(key, header, payload)]) != 1:
            raise OSError(f"kvtier pipe {self.name!r}: the server did not store the message: it is "
                          "unavailable or refusing writes (see the warning logged), or a message "
                          "sent under this tensor_key is still waiting to be received")

    def get(self, key: bytes) -> tuple[bytes, list[bytes | memoryview]] | None:
        # not tier.fetch: that reads a damaged or partly evicted record as "absent", and
        # deletes it, and the consumer would wait for this message for ever
        try:
            rec = self.tier.fetch_checked(key)
        except DamagedRemoteRecord as exc:
            raise RecordError(f"kvtier pipe {self.name!r}: a damaged message ({exc})") from exc
        if rec is None:
            return None
        return rec.header, list(rec.pieces)

    def delete(self, key: bytes) -> None:
        self.tier.delete(key)

    def close(self) -> None:
        self.tier.close(0)


class _DirStore(_Store):
    """Messages as files ``<seq key>.msg`` (written aside, renamed into place); counters as
    small files replaced atomically."""

    def __init__(self, root: Path, name: str) -> None:
        if root.exists() and not root.is_dir():
            raise ConfigError(f"pipe directory {root} exists and is not a directory")
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.msg"

    def peek_seq(self, counter: str) -> int:
        try:
            return int((self.dir / counter).read_text() or 0)
        except FileNotFoundError:
            return 0

    def next_seq(self, counter: str) -> int:
        with self._counters_locked():  # (two producers, in any process, take two places)
            n = self.peek_seq(counter) + 1
            self._replace(self.dir / counter, [str(n).encode()])
        return n

    def advance(self, counter: str, to: int) -> None:
        with self._counters_locked():
            if self.peek_seq(counter) < to:
                self._replace(self.dir / counter, [str(to).encode()])

    @contextlib.contextmanager
    def _counters_locked(self) -> Iterator[None]:
        """The pipe's counters to this thread alone while it reads and rewrites one (a lock
        on a file beside them: every process that can reach the directory honours it)."""
        fd = os.open(self.dir / ".counters.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (and with it the lock)

    def _replace(self, path: Path, parts: list[bytes | memoryview]) -> None:
        # (a name of this thread's own: two threads of one process write side by side)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def put(self, key: bytes, header: bytes, payload: memoryview) -> None:
        self._replace(self._path(key), [len(header).to_bytes(4, "little"), header, payload])

    def get(self, key: bytes) -> tuple[bytes, list[bytes | memoryview]] | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        if len(data) < 4 or int.from_bytes(data[:4], "little") > len(data) - 4:
            raise RecordError(f"pipe message {self._path(key).name} is truncated")
        n = int.from_bytes(data[:4], "little")
        view = memoryview(data)
        return bytes(view[4 : 4 + n]), [view[4 + n :]]

    def delete(self, key: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def close(self) -> None:
        pass

