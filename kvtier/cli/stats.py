"""``kvtier stats``: totals, files on disk, compression, free space and budget use."""

from __future__ import annotations

import argparse
import shutil
import time
from collections import Counter
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvtier.backends.index import budget_of
from kvtier.cli._common import (
    add_command,
    add_json_arg,
    ago,
    print_json,
    ratio,
    show,
    size,
    stdout_console,
    ts_seconds,
)
from kvtier.cli._store import disk_files, lmdb_pages, open_store, scan_headers, snapshot
from kvtier.codec import CODEC_NAMES
from kvtier.units import parse_size

EPILOG = """\
example:
  kvtier stats /data/kvcache
  kvtier stats /data/kvcache --budget 64G --json

RECORD BYTES are the records' header + payload bytes; OCCUPIED is what the store accounts
against its disk_bytes budget (each record rounded to the disk blocks or LMDB pages it
takes); ON DISK is what its files take, including LMDB free pages (which 'kvtier compact'
gives back) and the index. The budget shown is the disk_bytes setting the store's writers
recorded in it; --budget shows the use against another figure.
Hit/miss/corrupt counters live in the serving process (vLLM's connector stats); the store
does not persist them, so they are not shown here.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "stats", help="totals, on-disk size, compression ratio, free disk and budget use",
        description="Summarise a store: records, tokens, bytes, files on disk, compression, free disk.",
        epilog=EPILOG, run=run)
    p.add_argument("--budget", metavar="SIZE",
                   help="show the use against this size (e.g. 64G) instead of the store's own disk_bytes")
    add_json_arg(p)


def collect(store_path: str, budget: int | None) -> dict[str, Any]:
    with open_store(store_path) as st:
        entries = snapshot(st.backend)
        scan = scan_headers(st.backend, entries)
        namespaces = st.backend.namespaces()
        pages = lmdb_pages(st.backend)
        occupied = st.backend.occupied()
        if budget is None:  # the budget eviction enforces (none shown if none is recorded)
            budget = budget_of(st.backend.settings(), None)
        root, marker = st.root, st.marker
    present = [e for e in entries if e.key in scan.headers or e.key in scan.bad]
    record_bytes = sum(e.size for e in present)
    headers = list(scan.headers.values())
    raw = sum(h.raw_len for h in headers)
    payload = sum(h.payload_len for h in headers)
    codecs = Counter(CODEC_NAMES.get(h.codec, str(h.codec)) for h in headers)
    dtypes = Counter(h.dtype_name for h in headers)
    files = disk_files(root)
    du = shutil.disk_usage(root)
    created = [h.created_ns for h in headers]
    last_use = [e.atime_ns for e in present]
    return {
        "store": str(root),
        "backend": marker["backend"],
        "layout_version": marker.get("layout_version"),
        "store_created": marker.get("created"),
        "namespaces": len(namespaces | {e.namespace_id: {} for e in present}),
        "records": len(present),
        "tokens": sum(h.num_tokens for h in headers),
        "record_bytes": record_bytes,
        "occupied_bytes": occupied,
        "payload_raw_bytes": raw,
        "payload_stored_bytes": payload,
        "compression_ratio": ratio(raw, payload),
        "codecs": dict(codecs),
        "dtypes": dict(dtypes),
        "unreadable_headers": len(scan.bad),
        "oldest_written": ts_seconds(min(created) if created else None),
        "newest_written": ts_seconds(max(created) if created else None),
        "last_use": ts_seconds(max(last_use) if last_use else None),
        "on_disk": {
            "bytes": sum(f[2] for f in files),
            "allocated_bytes": sum(f[3] for f in files),
            "parts": [{"path": p, "files": n, "bytes": b, "allocated_bytes": a} for p, n, b, a in files],
        },
        "lmdb": pages,
        "filesystem": {"total_bytes": du.total, "used_bytes": du.used, "free_bytes": du.free},
        "budget": None if budget is None else {
            "bytes": budget, "used_fraction": round(occupied / budget, 4) if budget else None},
        "counters": None,
    }


def run(args: argparse.Namespace) -> int:
    budget = parse_size(args.budget, "--budget") if args.budget is not None else None
    s = collect(args.store, budget)
    if args.json:
        print_json(s)
        return 0
    con = stdout_console()
    now = time.time()
    t = Table(title=f"{escape(str(s['store']))} ({s['backend']}, layout v{s['layout_version']})",
              title_justify="left", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    on_disk = s["on_disk"]
    fs = s["filesystem"]
    t.add_row("namespaces", f"{s['namespaces']}")
    t.add_row("records", f"{s['records']:,}")
    t.add_row("tokens", f"{s['tokens']:,}")
    t.add_row("record bytes", size(s["record_bytes"]))
    t.add_row("occupied", size(s["occupied_bytes"]))
    if s["budget"]:
        b = s["budget"]
        frac = b["used_fraction"]
        t.add_row("budget", f"{size(b['bytes'])} ({frac:.1%} used)" if frac is not None else size(b["bytes"]))
    t.add_row("on disk", f"{size(on_disk['bytes'])} ({size(on_disk['allocated_bytes'])} allocated)")
    if s["lmdb"]:
        pg = s["lmdb"]
        t.add_row("lmdb pages", f"{pg['pages_in_use']:,} of {pg['pages_in_file']:,} in use "
                  f"(≈{size(pg['reclaimable_bytes'])} reclaimable by 'kvtier compact')")
    cr = s["compression_ratio"]
    t.add_row("payload", f"{size(s['payload_raw_bytes'])} raw, {size(s['payload_stored_bytes'])} stored"
              + (f" (ratio {cr:.2f}×)" if cr else ""))
    t.add_row("codecs", ", ".join(f"{k}: {v:,}" for k, v in s["codecs"].items()) or "-")
    t.add_row("dtypes", ", ".join(f"{k}: {v:,}" for k, v in s["dtypes"].items()) or "-")
    t.add_row("written", _span(s, now))
    t.add_row("last use", ago(_ns(s["last_use"]), now))
    t.add_row("filesystem", f"{size(fs['free_bytes'])} free of {size(fs['total_bytes'])}")
    if s["unreadable_headers"]:
        t.add_row("unreadable", f"[yellow]{s['unreadable_headers']} record(s); run 'kvtier verify'[/]")
    show(con, t)
    parts = Table(title="files", title_justify="left")
    for col in ("path", "files", "size", "allocated"):
        parts.add_column(col, justify="left" if col == "path" else "right")
    for p in on_disk["parts"]:
        parts.add_row(escape(p["path"]), f"{p['files']:,}", size(p["bytes"]), size(p["allocated_bytes"]))
    show(con, parts)
    return 0


def _ns(seconds: Any) -> int | None:
    return None if seconds is None else int(float(seconds) * 1e9)


def _span(s: dict[str, Any], now: float) -> str:
    oldest, newest = _ns(s["oldest_written"]), _ns(s["newest_written"])
    if oldest is None:
        return "-"
    return f"oldest {ago(oldest, now)}, newest {ago(newest, now)}"
