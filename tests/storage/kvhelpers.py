"""Helpers shared by the storage tests and their subprocess side (``_worker.py``).

Everything a test checks loaded KV against comes from :func:`make_kv`: a deterministic
function of each token id and its position, so any process can recompute the exact bytes a
chunk must hold from the chunk's tokens alone.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from kvtier import CacheConfig, KVCache, Namespace
from kvtier.keys import as_token_array, chain_seed, chunk_keys

HERE = Path(__file__).resolve().parent
# tests/diskhelpers.py; also where no conftest put it on the path (the zygote's processes)
sys.path.insert(0, str(HERE.parent))
from diskhelpers import small_tmpfs  # noqa: E402,F401 - the storage tests' name for it

REPO = HERE.parent.parent
WORKER = HERE / "_worker.py"

KV_SHAPE = (2, 2, 4, 32)  # layers, k/v, kv_heads, head_dim -> 512 values per token
CHUNK = 32  # tokens per chunk: 32 KiB per bf16 chunk
TAIL = 8  # tail granularity
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def namespace(dtype: str = "bfloat16", **kw: Any) -> Namespace:
    kw.setdefault("model", "test-model")
    kw.setdefault("weights_fingerprint", "sha256:0123")
    kw.setdefault("kv_shape", KV_SHAPE)
    kw.setdefault("chunk_tokens", CHUNK)
    return Namespace(dtype=dtype, **kw)


def config(path: str | Path, backend: str = "lmdb", **kw: Any) -> CacheConfig:
    kw.setdefault("chunk_tokens", CHUNK)
    kw.setdefault("io_threads", 2)
    return CacheConfig(path=Path(path), backend=backend, **kw)


def open_cache(path: str | Path, backend: str = "lmdb", ns: Namespace | None = None,
               tail: int = TAIL, **kw: Any) -> KVCache:
    ns = ns or namespace()
    kw["chunk_tokens"] = ns.chunk_tokens
    return KVCache.open(path, ns, config(path, backend, **kw), tail_granularity=tail)


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64).astype(np.uint32)


def seq_tokens(i: int) -> np.ndarray:
    """Sequence ``i`` of the crash/concurrency workloads: a 2-chunk prefix shared by every
    fifth sequence, then 0-2 own chunks and a tail of 0-24 tokens (+1 that rounds away)."""
    prefix = tokens(10_000 + i % 5, 2 * CHUNK)
    more = CHUNK * (i % 3) + TAIL * (i % 4) + 1
    return np.concatenate([prefix, tokens(i, more)])


def matrix_tokens(seed: int) -> np.ndarray:
    """3 chunks + a 16-token tail; seed 2 shares the first 2 chunks, then diverges."""
    base = tokens(7, 3 * CHUNK + 16)
    if seed == 1:
        return base
    return np.concatenate([base[: 2 * CHUNK], tokens(8, CHUNK + 8)])


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def make_kv(toks: np.ndarray, dtype: torch.dtype = torch.bfloat16, start: int = 0,
            kv_shape: tuple[int, int, int, int] = KV_SHAPE) -> torch.Tensor:
    """``[layers, 2, len(toks), heads, dim]`` of pseudo-random bits; position ``start + t``
    holds a function of (token id, position) only, so chunks can be regenerated alone."""
    layers, two, heads, dim = kv_shape
    t = np.asarray(toks, dtype=np.uint64)
    pos = np.arange(start, start + len(t), dtype=np.uint64)
    per_tok = _mix(t * np.uint64(0x9E3779B97F4A7C15) + pos)
    cell = np.arange(layers * two * heads * dim, dtype=np.uint64).reshape(layers, two, 1, heads, dim)
    bits = _mix(per_tok.reshape(1, 1, -1, 1, 1) ^ (cell * np.uint64(0xD6E8FEB86659FD93)))
    size = torch.empty((), dtype=dtype).element_size()
    arr = bits.astype({2: np.uint16, 4: np.uint32}[size]).view({2: np.int16, 4: np.int32}[size])
    return torch.from_numpy(np.ascontiguousarray(arr)).view(dtype)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (a is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and bool(np.array_equal(raw_bytes(a), raw_bytes(b))))


def digest(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)}:{xxhash.xxh3_128_hexdigest(raw_bytes(t))}"


@contextmanager
def peak_alloc() -> Iterator[list[int]]:
    """Yields a list that receives, on exit, the peak bytes Python and numpy allocated in the
    block (tracemalloc: bytes, bytearray, numpy buffers; what a copy of a record would use).
    Mapped file pages (LMDB's map, the page cache) are not allocations and do not count."""
    out: list[int] = []
    tracemalloc.start()
    try:
        yield out
        out.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


class Zygote:
    """A subprocess that imports torch and kvtier once, then forks a fresh worker per
    request (a process start costs ~2 s here; a fork, milliseconds). See ``_worker.py``."""

    def __init__(self, hash_seed: str = "1") -> None:
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO),
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "zygote"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = b""

    def request(self, cmd: str, timeout: float = 60.0, **kw: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"zygote: no answer to {cmd!r} within {timeout}s")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"zygote exited (rc={self.proc.wait()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        resp = json.loads(line)
        if isinstance(resp, dict) and "zygote_error" in resp:
            raise RuntimeError(resp["zygote_error"])
        return resp

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Expected:
    """What each key must hold, learned from the writers' logs (an index is logged before
    its sequence is saved, so every key a writer could have stored is known)."""

    def __init__(self, log: Path | None = None, sequences: Iterable[int] = ()) -> None:
        self.log = log
        self.seen: set[int] = set()
        self.where: dict[bytes, tuple[int, int, int]] = {}  # key -> (sequence, start, end)
        self._digests: dict[bytes, str] = {}
        self._seed = chain_seed(namespace())
        self.learn(sequences)

    def learn(self, sequences: Iterable[int] = ()) -> None:
        logged = self.log.read_text().split() if self.log and self.log.exists() else []
        for i in [*sequences, *map(int, logged)]:
            if i not in self.seen:
                self.seen.add(i)
                for r in chunk_keys(as_token_array(seq_tokens(i)), self._seed, CHUNK, TAIL):
                    self.where.setdefault(r.key, (i, r.start, r.end))

    def digest(self, key: bytes) -> str:
        if key not in self._digests:
            i, start, end = self.where[key]
            self._digests[key] = digest(make_kv(seq_tokens(i)[start:end], torch.bfloat16, start))
        return self._digests[key]


def verify_store(store: Path, backend: str, exp: Expected, context: str,
                 cfg: dict[str, Any]) -> int:
    """Reopen the store: every record found must load and hold exactly the expected bytes,
    the backend's totals must agree with its records, and nothing half-written may show."""
    from kvtier import ChunkStore

    with ChunkStore(config(store, backend, **cfg)) as s:
        entries = list(s.backend.entries())
        for e in entries:
            assert e.key in exp.where, f"{context}: a record no writer saved: {e.key.hex()}"
            got = s.get(e.key)
            assert got is not None, f"{context}: record {e.key.hex()[:16]} is listed but does not load"
            assert digest(got) == exp.digest(e.key), f"{context}: wrong bytes under {e.key.hex()[:16]}"
        st = s.counters.snapshot()
        assert st["corrupt_records"] == st["incompatible_records"] == st["io_errors"] == 0, (context, st)
        records, nbytes = s.backend.usage()
        assert (records, nbytes) == (len(entries), sum(e.size for e in entries)), context
        # The index and the payloads agree: every entry's payload is there, and what no
        # entry names (a writer killed between its payload write and its commit) is an
        # orphan the sweep removes (no writer runs now, so no grace period is needed).
        found = set(s.backend.payloads.found())
        named = {(e.key, e.location) for e in entries}
        assert named <= found, f"{context}: index entries without their payload"
        # (the store may already be sweeping in the background: it saw a killed writer)
        assert s.backend.sweep_orphans(grace_s=0) <= len(found - named), context
        assert set(s.backend.payloads.found()) == named, f"{context}: orphans left after the sweep"
        assert s.backend.occupied() == sum(e.occupied for e in entries), context
        if backend == "files":
            assert not list((store / "files" / "tmp").iterdir()), f"{context}: dead writer's temp files kept"
            # (os.walk: a record directory a removal empties may go meanwhile; rglob would raise)
            for dirpath, _, names in os.walk(store / "files"):
                for name in names:
                    p = Path(dirpath) / name
                    assert p.parent.parent.parent.name == "files" and p.suffix == ".kvt", p
    return len(entries)


# -- crafting records ------------------------------------------------------------------------
FIELDS = ("magic", "format_version", "header_len", "codec", "dtype", "layout", "ndim",
          "num_tokens", "token_start", "created_ns", "raw_len", "payload_len", "key",
          "namespace_id", "checksum")


def craft(record: bytes, *, shape: tuple[int, ...] | None = None, payload: bytes | None = None,
          **changes: Any) -> bytes:
    """Re-encode ``record``'s header with ``changes`` and a VALID header checksum (xxh3_64,
    exactly as kvtier.codec computes it), so only the semantic checks can reject it."""
    from kvtier import codec

    f = dict(zip(FIELDS, codec._FIXED.unpack_from(record, 0), strict=True))
    old_len = f["header_len"]
    dims = [codec._U64.unpack_from(record, codec._FIXED.size + 8 * i)[0] for i in range(f["ndim"])]
    if shape is not None:
        dims = list(shape)
        f["ndim"] = len(dims)
        f["header_len"] = codec._FIXED.size + 8 * len(dims) + 8
    body = record[old_len:] if payload is None else payload
    f.update(changes)
    head = codec._FIXED.pack(*(f[n] for n in FIELDS)) + b"".join(codec._U64.pack(d) for d in dims)
    return head + codec._U64.pack(xxhash.xxh3_64_intdigest(head)) + body


def header_fields(record: bytes) -> dict[str, Any]:
    from kvtier import codec

    return dict(zip(FIELDS, codec._FIXED.unpack_from(record, 0), strict=True))


def skip_without_o_direct(where: Path) -> None:
    """Skip the test where the filesystem under ``where`` refuses ``O_DIRECT``."""
    probe = where / "probe"
    probe.write_bytes(bytes(4096))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip("this filesystem refuses O_DIRECT")
        raise
    finally:
        probe.unlink()


def free_list_pages(data: bytes | bytearray) -> list[int]:
    """The pages of LMDB's free-list B-tree (branch, leaf and overflow), as of the meta page
    with the later transaction. (64-bit layout: the meta's free-list ``MDB_db`` at byte 40
    of page 0 or 1, its root at byte 80, the transaction id at byte 144.)"""
    meta = max((data[n * 4096 : (n + 1) * 4096] for n in (0, 1)), key=lambda m: struct.unpack_from("<Q", m, 144)[0])
    pages, todo = [], [struct.unpack_from("<Q", meta, 80)[0]]
    while todo and todo[0] != (1 << 64) - 1:
        pg = todo.pop()
        pages.append(pg)
        _, _, flags, lower, _ = struct.unpack_from("<QHHHH", data, pg * 4096)
        for ptr in struct.unpack_from(f"<{(lower - 16) // 2}H", data, pg * 4096 + 16):
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, pg * 4096 + ptr)
            if flags & 0x01:  # a branch: the child's page number
                todo.append(lo | hi << 16 | nflags << 32)
            elif nflags & 0x01:  # a record in overflow pages
                first = struct.unpack_from("<Q", data, pg * 4096 + ptr + 8 + ksize)[0]
                pages.extend(range(first, first + struct.unpack_from("<I", data, first * 4096 + 12)[0]))
    return pages


def _lmdb_nodes(data: bytes | bytearray, pg: int) -> list[int]:
    """Where page ``pg``'s nodes are in ``data`` (LMDB, 4 KiB pages), in key order."""
    lower = struct.unpack_from("<H", data, pg * 4096 + 12)[0]
    return [pg * 4096 + p for p in struct.unpack_from(f"<{(lower - 16) // 2}H", data, pg * 4096 + 16)]


def lmdb_leaf_nodes(data: bytes | bytearray, name: bytes) -> list[int]:
    """Where the nodes of named database ``name``'s first leaf page are in ``data`` (a
    ``data.mdb``), found from the later meta page: the main database's root (a leaf here)
    holds each named database's ``MDB_db`` record, whose root leads down to its leaves."""
    meta = max((data[n * 4096 : (n + 1) * 4096] for n in (0, 1)), key=lambda m: struct.unpack_from("<Q", m, 144)[0])
    for node in _lmdb_nodes(data, struct.unpack_from("<Q", meta, 128)[0]):
        ksize = struct.unpack_from("<H", data, node + 6)[0]
        if data[node + 8 : node + 8 + ksize] == name:
            depth, pg = struct.unpack_from("<H", data, node + 8 + ksize + 6)[0], struct.unpack_from("<Q", data, node + 8 + ksize + 40)[0]
            for _ in range(depth - 1):  # a branch node's child: lo | hi << 16 | flags << 32
                lo, hi, flags = struct.unpack_from("<HHH", data, _lmdb_nodes(data, pg)[0])
                pg = lo | hi << 16 | flags << 32
            return _lmdb_nodes(data, pg)
    raise KeyError(name)

