"""``kvtier ls``: the namespaces in a store, with chunk counts, tokens, bytes and ages."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from rich.markup import escape
from rich.table import Table

from kvtier.cli._common import (
    add_command,
    add_json_arg,
    ago,
    line,
    print_json,
    short_model,
    show,
    size,
    stdout_console,
    ts_seconds,
)
from kvtier.cli._store import open_store, scan_headers, snapshot

EPILOG = """\
example:
  kvtier ls /data/kvcache
  kvtier ls /data/kvcache --json | jq '.namespaces[] | {model, chunks, bytes}'

A namespace is everything that changes the KV bytes: model name and weights fingerprint,
dtype, KV shape, chunk size, tensor-parallel rank/size and format version. Per-request
extras (cache_salt, LoRA adapter, multimodal inputs) are hashed into each chunk's key and
are not stored, so chunks cannot be listed by salt or tenant.
Ages: OLDEST/NEWEST are when chunks were written, LAST USE when one was last saved or loaded.
The table leaves out namespaces with no chunks left (--all lists them).
The table shows a short model name (a local model's directory name); the full identity
(path, revision, config digest, loader options, ...) is in --json and 'kvtier inspect'.
"""



@dataclass
class NsRow:
    id: bytes
    description: dict[str, object] | None
    chunks: int = 0
    tokens: int = 0
    bytes: int = 0
    oldest_ns: int | None = None
    newest_ns: int | None = None
    last_use_ns: int | None = None
    unreadable: int = 0

    def to_json(self) -> dict[str, object]:
        d = self.description or {}
        return {
            "id": self.id.hex(),
            "registered": self.description is not None,
            "model": d.get("model"),
            "weights_fingerprint": d.get("weights_fingerprint"),
            "dtype": d.get("dtype"),
            "kv_shape": d.get("kv_shape"),
            "chunk_tokens": d.get("chunk_tokens"),
            "tp_rank": d.get("tp_rank"),
            "tp_size": d.get("tp_size"),
            "format_version": d.get("format_version"),
            "extra": d.get("extra"),
            "chunks": self.chunks,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "oldest_written": ts_seconds(self.oldest_ns),
            "newest_written": ts_seconds(self.newest_ns),
            "last_use": ts_seconds(self.last_use_ns),
            "unreadable_chunks": self.unreadable,
        }


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "ls", help="list the namespaces (model, dtype, TP rank...) in a store with counts and ages",
        description="List the namespaces of a store: chunk counts, tokens, bytes, and ages.",
        epilog=EPILOG, run=run)
    p.add_argument("--all", action="store_true",
                   help="also list namespaces with no chunks left (registered by a server or a warm-up, "
                        "then emptied by eviction); --json always lists them")
    add_json_arg(p)


def collect(store_path: str) -> tuple[str, str, list[NsRow]]:
    with open_store(store_path) as st:
        descriptions = st.backend.namespaces()
        entries = snapshot(st.backend)
        scan = scan_headers(st.backend, entries)
        root, backend = str(st.root), st.backend_name
    rows: dict[bytes, NsRow] = {i: NsRow(i, d) for i, d in descriptions.items()}
    for e in entries:
        h = scan.headers.get(e.key)
        if h is None and e.key not in scan.bad:
            continue  # removed while we looked
        row = rows.setdefault(e.namespace_id, NsRow(e.namespace_id, None))
        row.chunks += 1
        row.bytes += e.size
        row.last_use_ns = max(row.last_use_ns or 0, e.atime_ns)
        if h is None:
            row.unreadable += 1
            continue
        row.tokens += h.num_tokens
        row.oldest_ns = h.created_ns if row.oldest_ns is None else min(row.oldest_ns, h.created_ns)
        row.newest_ns = h.created_ns if row.newest_ns is None else max(row.newest_ns, h.created_ns)
    ordered = sorted(rows.values(), key=lambda r: (-r.bytes, r.id))
    return root, backend, ordered


def run(args: argparse.Namespace) -> int:
    root, backend, rows = collect(args.store)
    total_chunks = sum(r.chunks for r in rows)
    total_bytes = sum(r.bytes for r in rows)
    total_tokens = sum(r.tokens for r in rows)
    unreadable = sum(r.unreadable for r in rows)
    if args.json:
        print_json({
            "store": root, "backend": backend,
            "namespaces": [r.to_json() for r in rows],
            "total": {"namespaces": len(rows), "chunks": total_chunks, "tokens": total_tokens,
                      "bytes": total_bytes, "unreadable_chunks": unreadable},
        })
        return 0
    con = stdout_console()
    now = time.time()
    table = Table(title=f"{escape(root)} ({backend})", title_justify="left")
    for col in ("namespace", "model", "weights", "dtype", "kv shape"):
        table.add_column(col, no_wrap=col == "namespace")
    for col in ("chunk", "tp", "chunks", "tokens", "size", "oldest", "newest", "last use"):
        table.add_column(col, justify="right", no_wrap=col == "size")
    # A namespace stays registered after its last chunk is evicted (a server that registered
    # it may still save to it); the table lists only those holding something, unless --all.
    shown = rows if args.all else [r for r in rows if r.chunks or r.unreadable]
    empty = len(rows) - len(shown)
    for r in shown:
        d = r.description or {}
        shape = d.get("kv_shape")
        table.add_row(
            r.id.hex()[:12], short_model(str(d.get("model", "(unregistered)"))), str(d.get("weights_fingerprint", "-"))[:19], str(d.get("dtype", "-")),
            "×".join(map(str, shape)) if isinstance(shape, list) else "-",
            str(d.get("chunk_tokens", "-")),
            f"{d['tp_rank']}/{d['tp_size']}" if "tp_rank" in d else "-",
            f"{r.chunks:,}" + (f" ({r.unreadable} bad)" if r.unreadable else ""),
            f"{r.tokens:,}", size(r.bytes),
            ago(r.oldest_ns, now), ago(r.newest_ns, now), ago(r.last_use_ns, now),
        )
    if not rows:
        line(con, f"{escape(root)} ({backend}): empty store, no namespaces registered yet")
        return 0
    hidden = f"; {empty} empty namespace(s) not shown (--all lists them)" if empty else ""
    if not shown:
        line(con, f"{escape(root)} ({backend}): no chunks stored{hidden}")
        return 0
    show(con, table, drop=("weights", "chunk", "oldest", "kv shape", "tp", "dtype", "tokens"))
    line(con, f"{len(shown)} namespace(s), {total_chunks:,} chunks, {total_tokens:,} tokens, "
              f"{size(total_bytes)}{hidden}")
    if unreadable:
        line(con, f"[yellow]{unreadable} chunk(s) have unreadable headers; run 'kvtier verify {escape(root)}'[/]")
    return 0
