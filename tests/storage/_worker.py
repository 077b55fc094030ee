"""Subprocess side of the storage tests.

``python _worker.py zygote`` imports torch and kvtier once, then answers JSON requests read
line by line from stdin, one JSON line each on stdout. Every request runs in a freshly
forked child (the zygote itself never opens a store or runs torch ops), so tests get real,
separate processes in milliseconds instead of a ~2 s interpreter start each:

- ``call``: run one function in a child, return its JSON result.
- ``parallel``: run several functions in concurrent children, return all results.
- ``crash``: start a writer child, SIGKILL it ``delay`` seconds after its fork (or, with
  ``after="open"``, after it has opened the store and committed a first save), report how
  far it got.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kvtier import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvhelpers as H  # noqa: E402


# -- workloads (run in forked children) ---------------------------------------------------
def write_matrix(root: str, specs: list[dict[str, str]]) -> dict[str, Any]:
    """Save two sequences (sharing a prefix) into one store per spec; return their keys."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"hash": hash("kvtier"), "pid": os.getpid(), "keys": {}}
    for spec in specs:
        dtype = H.DTYPES[spec["dtype"]]
        ns = H.namespace(spec["dtype"])
        with H.open_cache(Path(root) / spec["name"], spec["backend"], ns,
                          compression=spec["compression"], durability=spec["durability"]) as cache:
            for seed in (1, 2):
                toks = H.matrix_tokens(seed)
                cache.save(toks, H.make_kv(toks, dtype))
            assert cache.flush(60)
            st = cache.stats()
            assert st["dropped_saves"] == 0 and st["io_errors"] == 0, st
            out["keys"][spec["name"]] = [c.key.hex() for c in cache.chunks(H.matrix_tokens(1))]
    return out


def crash_writer(path: str, backend: str, durability: str, first: int, log: str,
                 progress_fd: int, cfg: dict[str, Any]) -> None:
    """Save sequences ``first, first+1, ...`` until killed; log each index before saving it.
    Reports ``o`` once the store is open and a first save is committed (steady state)."""
    torch.set_num_threads(1)
    logfd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    cache = H.open_cache(path, backend, durability=durability, **cfg)
    os.write(logfd, f"{first}\n".encode())
    toks = H.seq_tokens(first)
    cache.save(toks, H.make_kv(toks))
    cache.flush()
    os.write(progress_fd, b"o")
    i = first + 1
    while True:
        os.write(logfd, f"{i}\n".encode())
        toks = H.seq_tokens(i)
        cache.save(toks, H.make_kv(toks))
        os.write(progress_fd, b"s")
        if i % 3 == 0:
            cache.flush()
            os.write(progress_fd, b"f")
        i += 1


def mix_loop(cache: KVCache, seed: int, seconds: float, universe: int) -> dict[str, Any]:
    """Save and load random sequences of a shared universe; check every load bit for bit."""
    rng = random.Random(seed)
    rep: dict[str, Any] = {"pid": os.getpid(), "saves": 0, "loads": 0, "hit_tokens": 0,
                           "mismatches": [], "errors": []}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        i = rng.randrange(universe)
        toks = H.seq_tokens(i)
        try:
            if rng.random() < 0.5:
                cache.save(toks, H.make_kv(toks))
                rep["saves"] += 1
                if rng.random() < 0.3:
                    cache.flush(30)
            else:
                got = cache.load(toks)
                n = got.shape[2]
                if not H.same_bits(got, H.make_kv(toks[:n])):
                    rep["mismatches"].append(i)
                rep["loads"] += 1
                rep["hit_tokens"] += n
        except Exception:
            rep["errors"].append(traceback.format_exc())
    if not cache.flush(30):
        rep["errors"].append("flush did not drain within 30 s")
    rep["stats"] = cache.stats()
    return rep


def mixer(path: str, backend: str, seed: int, seconds: float, universe: int,
          cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    with H.open_cache(path, backend, **cfg) as cache:
        return mix_loop(cache, seed, seconds, universe)


def fork_family(path: str, backend: str, seconds: float, universe: int, children: int,
                cfg: dict[str, Any]) -> dict[str, Any]:
    """Open a cache, fill it, then fork children that keep using the *inherited* cache
    object (or open their own on the same path) while this process goes on using it."""
    torch.set_num_threads(1)
    cache = H.open_cache(path, backend, **cfg)
    for i in range(0, universe, 2):
        toks = H.seq_tokens(i)
        cache.save(toks, H.make_kv(toks))
    assert cache.flush(30)
    backend_obj = cache.store.backend
    env_before = backend_obj.index.env.env
    # a thread keeps reading while we fork: a fork must not catch a transaction mid-flight
    stop = threading.Event()

    def keep_reading() -> None:
        while not stop.is_set():
            for ref in cache.chunks(H.seq_tokens(0)):
                cache.store.backend.read(ref.key, len)
            cache.store.backend.count_present_prefix([c.key for c in cache.chunks(H.seq_tokens(2))])

    reader = threading.Thread(target=keep_reading, daemon=True)
    reader.start()
    time.sleep(0.05)
    kids = []
    for c in range(children):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: keep using the inherited cache, or (odd children) open its own
            os.close(r)
            try:
                mine = cache if c % 2 == 0 else H.open_cache(path, backend, **cfg)
                rep = mix_loop(mine, 100 + c, seconds, universe)
                rep["env_reopened"] = mine.store.backend.index.env.env is not env_before
                rep["inherited"] = mine is cache
                mine.close()
                _send(w, rep)
            except BaseException:
                _send(w, {"errors": [traceback.format_exc()], "mismatches": []})
            finally:
                os._exit(0)
        os.close(w)
        kids.append((pid, r))
    stop.set()
    reader.join()
    rep = mix_loop(cache, 99, seconds, universe)
    children_reps = [_collect(pid, r, seconds + 15) for pid, r in kids]
    cache.close()
    return {"parent": rep, "children": children_reps}


# -- process plumbing ---------------------------------------------------------------------
def _send(fd: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.close(fd)


def _collect(pid: int, fd: int, timeout: float) -> Any:
    """Read a child's JSON answer until EOF (killing it after ``timeout``), then reap it."""
    deadline = time.monotonic() + timeout
    data = b""
    timed_out = False
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"errors": [f"child {pid} did not finish within {timeout}s (killed)"], "mismatches": []}
    try:
        return json.loads(data)
    except ValueError:
        return {"errors": [f"child {pid} exited with status {status} and no answer"], "mismatches": []}


def _spawn(fn_name: str, kwargs: dict[str, Any]) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _send(w, {"result": FUNCTIONS[fn_name](**kwargs)})
        except BaseException:
            _send(w, {"error": traceback.format_exc()})
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _unwrap(answer: Any) -> Any:
    if "result" in answer:
        return answer["result"]
    return {"error": answer.get("error") or "; ".join(answer.get("errors", []))}


def handle(req: dict[str, Any]) -> Any:
    cmd = req["cmd"]
    if cmd == "call":
        pid, r = _spawn(req["fn"], req["kwargs"])
        return _unwrap(_collect(pid, r, req.get("timeout", 60)))
    if cmd == "parallel":
        started = [_spawn(c["fn"], c["kwargs"]) for c in req["calls"]]
        return [_unwrap(_collect(pid, r, req.get("child_timeout", 60))) for pid, r in started]
    if cmd == "crash":
        r, w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                crash_writer(progress_fd=w, **req["kwargs"])
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(3)
        os.close(w)
        progress = b""
        if req.get("after") == "open":  # time the kill from the writer's steady state
            with selectors.DefaultSelector() as sel:
                sel.register(r, selectors.EVENT_READ)
                while b"o" not in progress and time.monotonic() - t0 < 20 and sel.select(1.0):
                    chunk = os.read(r, 1)
                    if not chunk:
                        break
                    progress += chunk
            t0 = time.monotonic()
        time.sleep(max(0.0, req["delay"] - (time.monotonic() - t0)))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        while chunk := os.read(r, 1 << 16):
            progress += chunk
        os.close(r)
        return {"killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
                "status": status, "opened": progress.count(b"o"), "saved": progress.count(b"s"),
                "flushed": progress.count(b"f")}
    raise ValueError(f"unknown command {cmd!r}")


def evict_store(path: str, backend: str, target_bytes: int) -> dict[str, Any]:
    """Another process evicts the store down to ``target_bytes`` (what ``kvtier evict`` and a
    writer's budget do)."""
    from kvtier import ChunkStore

    with ChunkStore(H.config(path, backend), readonly=False) as store:
        n, freed = store.backend.evict_lru(target_bytes)
    return {"evicted": n, "freed": freed}


def lease_keys(path: str, backend: str, keys: list[str], seconds: float,
               release: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Another server's scheduler: lease ``keys`` (hex) for a load, or end the lease
    ``release`` it took before (what ``lease`` returned, in hex)."""
    from kvtier.store_view import StoreView

    view = StoreView(H.config(path, backend))
    try:
        if release is not None:
            view.backend.release({bytes.fromhex(k): (u, t) for k, (u, t) in release.items()})
            return {}
        held = view.backend.lease([bytes.fromhex(k) for k in keys], seconds)
        return {"held": {k.hex(): list(v) for k, v in held.items()}}
    finally:
        view.close()


def ranked_writer(path: str, backend: str, server: int, rank: int, tp: int, prompts: list[int],
                  cfg: dict[str, Any], start_at: float = 0.0) -> dict[str, Any]:
    """One tensor-parallel rank of a server: saves each prompt's chunks under this rank's
    keys, as a connector's worker does (rank group and chain parent given)."""
    from kvtier import ChunkStore
    from kvtier.keys import chain_seed, ranked_chunk_keys

    torch.set_num_threads(1)
    seeds = [chain_seed(H.namespace(tp_rank=r, tp_size=tp)) for r in range(tp)]
    ns_id = H.namespace(tp_rank=rank, tp_size=tp).id
    time.sleep(max(0.0, start_at - time.time()))
    with ChunkStore(H.config(path, backend, **cfg)) as store:
        for p in prompts:
            toks = H.tokens(1000 * server + p, 3 * H.CHUNK)
            chunks = ranked_chunk_keys(toks, seeds, H.CHUNK, None)
            for i, c in enumerate(chunks):
                kv = H.make_kv(toks[c.start:c.end], start=c.start)
                store.put(c.keys[rank], kv, namespace_id=ns_id, token_start=c.start,
                          num_tokens=c.end - c.start, group=c.keys[0],
                          parent=chunks[i - 1].keys[rank] if i else None)
            store.flush(60)
        st = store.stats()
    return {"stats": st}


def killed_mid_commit(path: str, backend: str) -> dict[str, Any]:
    """A writer that dies between writing a record's payload and its index commit: a child
    opens the store (registering as a writer), writes one payload and exits without
    publishing or closing, as a SIGKILL would leave it."""
    from kvtier import ChunkStore, codec
    from kvtier.backends import PutItem
    from kvtier.backends.index import new_location

    pid = os.fork()
    if pid == 0:
        store = ChunkStore(H.config(path, backend))
        kv = H.make_kv(H.tokens(77, H.CHUNK))
        key = bytes(range(32))
        header, payload = codec.encode(kv, key=key, namespace_id=bytes(16), token_start=0, num_tokens=H.CHUNK)
        store.backend.payloads.write_many([PutItem(key, header, payload, bytes(16))], [new_location()])
        os._exit(0)
    os.waitpid(pid, 0)
    return {"writer": pid}


def probe_store(path: str, backend: str, sequences: list[int]) -> dict[str, Any]:
    """Open a (possibly damaged) store and load every sequence: how many loads returned KV
    that differs from what was saved (must be 0), and how many tokens were served."""
    rep: dict[str, Any] = {"wrong": 0, "tokens": 0}
    with H.open_cache(path, backend) as cache:
        for i in sequences:
            toks = H.seq_tokens(i)
            got = cache.load(toks)
            rep["tokens"] += got.shape[2]
            if not H.same_bits(got, H.make_kv(toks[: got.shape[2]])):
                rep["wrong"] += 1
    return rep


def forked_readers(path: str, backend: str) -> dict[str, Any]:
    """Open a cache, then fork two children that use the inherited cache: one only reads and
    leaves with ``os._exit`` (as a worker pool's child does), one saves and then closes.
    Returns the pids, and the writer rows' pids in the index afterwards."""

    torch.set_num_threads(1)
    cache = H.open_cache(path, backend)
    toks = H.seq_tokens(0)
    cache.save(toks, H.make_kv(toks))
    assert cache.flush(30)
    pids = []
    for saves in (False, True):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                got = cache.load(toks)
                if saves:
                    more = H.seq_tokens(1)
                    cache.save(more, H.make_kv(more))
                    assert cache.flush(30)
                    with cache.store.backend.index.env.txn() as txn:
                        rows = cache.store.backend.index._writer_rows(txn)
                    registered = os.getpid() in {p for p, _, _ in rows}
                    cache.close()
                else:
                    registered = None
                _send(w, {"loaded": int(got.shape[2]), "registered_while_saving": registered})
            except BaseException:
                _send(w, {"errors": [traceback.format_exc()]})
            finally:
                os._exit(0)
        os.close(w)
        rep = _collect(pid, r, 60)
        index = cache.store.backend.index
        with index.env.txn() as txn:  # (before anyone's next beat deletes a dead child's row)
            rep["writer_rows_after"] = [p for p, _, _ in index._writer_rows(txn)]
        pids.append((pid, rep))
    cache.close()
    return {"children": [{"pid": pid, **rep} for pid, rep in pids], "parent": os.getpid()}


FUNCTIONS = {"killed_mid_commit": killed_mid_commit, "probe_store": probe_store, "write_matrix": write_matrix, "mixer": mixer, "fork_family": fork_family,
             "forked_readers": forked_readers,
             "evict_store": evict_store, "ranked_writer": ranked_writer, "lease_keys": lease_keys}


def zygote() -> None:
    for line in sys.stdin:
        try:
            resp = handle(json.loads(line))
        except Exception:
            resp = {"zygote_error": traceback.format_exc()}
        sys.stdout.write(json.dumps(resp) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        raise SystemExit("usage: _worker.py zygote")
