"""Helpers of the CLI tests: building real stores, running the real console script.

Each ``kvtier`` run is a subprocess of the installed console script (about 0.15 s to start:
the read-only commands do not import torch); tests start independent runs together with
:func:`run_many`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import CacheConfig, KVCache, Namespace, RequestExtras
from kvtier.backends import open_backend

KVTIER = Path(sys.executable).parent / "kvtier"
# Root reads and writes every file: as root, use a store as nobody (setpriv is in util-linux).
AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
CHUNK = 64
SALTED_TOKENS = list(range(1000, 1150))  # saved with cache_salt="tenant-a"
NS_LLAMA = Namespace(model="tiny-llama", weights_fingerprint="sha256:0123456789abcdef",
                     dtype="bfloat16", kv_shape=(2, 2, 4, 32), chunk_tokens=CHUNK)
NS_QWEN = Namespace(model="qwen-mini", weights_fingerprint="sha256:fedcba9876543210",
                    dtype="float16", kv_shape=(2, 2, 2, 16), chunk_tokens=CHUNK, tp_rank=1, tp_size=2)


@dataclass
class Built:
    """A store built by :func:`build_store` and what it must hold."""

    path: Path
    backend: str
    compression: str
    chunks: dict[str, int] = field(default_factory=dict)  # namespace id hex -> chunks
    tokens: dict[str, int] = field(default_factory=dict)
    keys: dict[str, list[bytes]] = field(default_factory=dict)

    @property
    def total_chunks(self) -> int:
        return sum(self.chunks.values())


def cli(*args: object, env: dict[str, str] | None = None, timeout: float = 120,
        prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run the installed ``kvtier`` console script (after ``prefix``, e.g. a setpriv)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("KVTIER_DEBUG", None)
    return subprocess.run([*prefix, str(KVTIER), *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def run_many(*calls: tuple[object, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Run several ``kvtier`` commands at once (each tuple is one command line)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda c: cli(*c), calls))


def one_line_error(r: subprocess.CompletedProcess[str] | Ran, status: int, *needles: str) -> None:
    """The failure contract: exit ``status``, one ``kvtier: error:`` line, no traceback."""
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def build_store(path: Path, backend: str, compression: str = "none") -> Built:
    """Two namespaces: tiny-llama (5 prompts + one salted prompt) and qwen-mini (3 prompts)."""
    built = Built(path, backend, compression)
    cfg = CacheConfig(path=path, backend=backend, chunk_tokens=CHUNK, compression=compression)
    rng = np.random.default_rng(7)
    torch.manual_seed(0)
    plan = [(NS_LLAMA, torch.bfloat16, [200] * 5), (NS_QWEN, torch.float16, [130] * 3)]
    for ns, dtype, lengths in plan:
        layers, two, heads, dim = ns.kv_shape
        keys: list[bytes] = []
        tokens = 0
        with KVCache.open(path, ns, cfg) as cache:
            prompts = [(rng.integers(0, 32000, n), RequestExtras()) for n in lengths]
            if ns is NS_LLAMA:
                prompts.append((np.array(SALTED_TOKENS), RequestExtras(cache_salt="tenant-a")))
            for toks, extras in prompts:
                kv = torch.randn(layers, two, len(toks), heads, dim).to(dtype)
                cache.save(toks, kv, extras)
                refs = cache.chunks(toks, extras)
                keys += [r.key for r in refs]
                tokens += sum(r.num_tokens for r in refs)
            assert cache.flush(30)
        built.chunks[ns.id.hex()] = len(keys)
        built.tokens[ns.id.hex()] = tokens
        built.keys[ns.id.hex()] = keys
    return built


def entries(path: Path, backend: str, *, occupied: bool = False) -> dict[bytes, tuple[int, int]]:
    """key -> (record bytes, or with ``occupied`` the bytes it occupies on disk; last use
    ns), read in this process through the backend interface."""
    b = open_backend(CacheConfig(path=path, backend=backend), readonly=True, create=False)
    try:
        return {e.key: (e.occupied if occupied else e.size, e.atime_ns) for e in b.entries()}
    finally:
        b.close()


def touch(path: Path, backend: str, times: dict[bytes, int]) -> None:
    """Set records' last-use times (what LRU eviction orders by)."""
    b = open_backend(CacheConfig(path=path, backend=backend), create=False)
    try:
        for key, ns in times.items():
            b.touch([key], ns)
    finally:
        b.close()


def corrupt(path: Path, backend: str, key: bytes, where: str) -> None:
    """Flip one byte of ``key``'s record on disk: in its payload or its header."""
    from kvtier.codec import MAGIC, decode_header

    target = path / "lmdb" / "data.mdb" if backend == "lmdb" else next(path.rglob(key.hex() + ".*.kvt"))
    data = bytearray(target.read_bytes())
    at = data.find(MAGIC)
    while at >= 0:
        try:
            h = decode_header(bytes(data[at : at + int.from_bytes(data[at + 10 : at + 12], "little")]))
        except Exception:
            h = None
        if h is not None and h.key == key:
            pos = at + h.header_len + h.payload_len // 2 if where == "payload" else at + 40
            data[pos] ^= 0x5A
            target.write_bytes(bytes(data))  # in place: same size, same inode for LMDB
            return
        at = data.find(MAGIC, at + 1)
    raise AssertionError(f"record {key.hex()} not found in {target}")


@dataclass
class Ran:
    """What an in-process :func:`kvtier.cli.main.main` call returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def run_main(capsys: Any, *args: object) -> Ran:
    """Run the CLI in this process: for output details whose console-script path is
    already covered."""
    from kvtier.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return Ran(rc, out, err)
