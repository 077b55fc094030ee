"""``kvtier evict``: remove chunks by size budget, age, namespace or model, LRU first."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvtier.backends import EntryInfo
from kvtier.cli._common import (
    UsageError,
    add_command,
    add_json_arg,
    add_namespace_filters,
    ago,
    line,
    print_json,
    short_model,
    show,
    size,
    stdout_console,
)
from kvtier.cli._store import delete_in_batches, open_store, resolve_namespaces, snapshot
from kvtier.units import format_age, parse_age, parse_size

EPILOG = """\
examples:
  kvtier evict /data/kvcache --max-bytes 50G --dry-run   show what would go
  kvtier evict /data/kvcache --max-bytes 50G             least recently used out, down to 50 GiB
  kvtier evict /data/kvcache --older-than 7d             chunks not used for a week
  kvtier evict /data/kvcache --model llama-3-8b --all    everything of one model
  kvtier evict /data/kvcache --namespace 9c1e --max-bytes 10G

Say what to remove with --max-bytes and/or --older-than, or --all; --namespace and --model
narrow any of them to some namespaces (then --max-bytes is the budget of those namespaces
together). Order is least recently used first (last save or load), as of the start of the
command. Sizes are the bytes records occupy on disk (whole blocks of a file, whole pages of
LMDB), as the store counts them against its disk_bytes budget ('kvtier stats': occupied).
Runs safely beside a server: deletions go in short write transactions; a chunk evicted is
just a miss (recomputed) the next time it is asked for.
There is no --salt: a request's cache_salt (and LoRA adapter) is hashed into its chunk keys
and not stored, so a tenant's chunks cannot be told apart on disk. Isolation is by key: one
tenant's chunks can never be loaded for another. To remove a tenant's data, evict by
namespace/model or age, or give tenants separate stores.
"""

def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "evict", help="remove chunks by size budget, age, namespace or model (LRU order; --dry-run)",
        description="Remove chunks, least recently used first.",
        epilog=EPILOG, run=run)
    p.add_argument("--max-bytes", metavar="SIZE", help="evict LRU chunks until at most SIZE remain (e.g. 50G, 512M)")
    p.add_argument("--older-than", metavar="AGE", help="evict chunks not used for AGE (e.g. 90m, 12h, 7d, 2w)")
    p.add_argument("--all", action="store_true", help="evict every chunk (of the chosen namespaces/models)")
    add_namespace_filters(p)
    p.add_argument("--dry-run", action="store_true", help="show what would be removed; remove nothing")
    add_json_arg(p)


def choose(entries: list[EntryInfo], *, max_bytes: int | None, older_than: float | None,
           everything: bool, now: float) -> list[EntryInfo]:
    """The victims among ``entries``, least recently used first."""
    lru = sorted(entries, key=lambda e: (e.atime_ns, e.key))
    if everything:
        return lru
    victims: list[EntryInfo] = []
    kept = lru
    if older_than is not None:
        cutoff = int((now - older_than) * 1e9)
        victims = [e for e in lru if e.atime_ns < cutoff]
        kept = [e for e in lru if e.atime_ns >= cutoff]
    if max_bytes is not None:
        total = sum(e.occupied for e in kept)
        i = 0
        while total > max_bytes and i < len(kept):
            victims.append(kept[i])
            total -= kept[i].occupied
            i += 1
    return victims


def run(args: argparse.Namespace) -> int:
    if not (args.max_bytes is not None or args.older_than is not None or args.all):
        raise UsageError("say what to evict: --max-bytes SIZE, --older-than AGE or --all "
                         "(--namespace/--model only narrow it)")
    if args.all and (args.max_bytes is not None or args.older_than is not None):
        raise UsageError("--all removes everything selected; do not combine it with --max-bytes or --older-than")
    max_bytes = parse_size(args.max_bytes, "--max-bytes") if args.max_bytes is not None else None
    older = parse_age(args.older_than, "--older-than") if args.older_than is not None else None
    now = time.time()
    with open_store(args.store, write=not args.dry_run, removes_records=not args.dry_run) as st:
        descriptions = st.backend.namespaces()
        entries = snapshot(st.backend)
        chosen = resolve_namespaces(st.root, {e.namespace_id for e in entries}, descriptions,
                                    args.namespace, args.model)
        selected = [e for e in entries if not chosen or e.namespace_id in chosen]
        victims = choose(selected, max_bytes=max_bytes, older_than=older, everything=args.all, now=now)
        freed = 0 if args.dry_run else delete_in_batches(st.backend, [e.key for e in victims])
        removed = 0 if args.dry_run else len(victims)
        root = str(st.root)
    victim_bytes = sum(e.occupied for e in victims)
    store_bytes = sum(e.occupied for e in entries)
    selected_bytes = sum(e.occupied for e in selected)
    per_ns: dict[bytes, list[int]] = defaultdict(lambda: [0, 0, 0])  # records, bytes, newest use
    for e in victims:
        acc = per_ns[e.namespace_id]
        acc[0] += 1
        acc[1] += e.occupied
        acc[2] = max(acc[2], e.atime_ns)
    out: dict[str, Any] = {
        "store": root, "dry_run": args.dry_run,
        "criteria": {"max_bytes": max_bytes, "older_than_seconds": older, "all": args.all,
                     "namespaces": sorted(i.hex() for i in chosen)},
        "before": {"records": len(entries), "bytes": store_bytes,
                   "selected_records": len(selected), "selected_bytes": selected_bytes},
        "evict": {"records": len(victims), "bytes": victim_bytes},
        "removed": {"records": removed, "bytes": freed},
        "after": {"records": len(entries) - len(victims), "bytes": store_bytes - victim_bytes},
        "namespaces": [{"id": i.hex(), "model": (descriptions.get(i) or {}).get("model"),
                        "records": v[0], "bytes": v[1], "newest_last_use": round(v[2] / 1e9, 3)}
                       for i, v in sorted(per_ns.items())],
    }
    if args.json:
        print_json(out)
        return 0
    con = stdout_console()
    verb = "would remove" if args.dry_run else "removed"
    if victims:
        t = Table(title=f"{verb} (least recently used first)", title_justify="left")
        for col in ("namespace", "model", "chunks", "size", "most recent use"):
            t.add_column(col, justify="right" if col in ("chunks", "size") else "left")
        for i, v in sorted(per_ns.items(), key=lambda kv: -kv[1][1]):
            t.add_row(i.hex()[:12], escape(short_model(str((descriptions.get(i) or {}).get("model", "(unregistered)")))),
                      f"{v[0]:,}", size(v[1]), ago(v[2], now))
        show(con, t)
    what = []
    if args.all:
        what.append("everything selected")
    if older is not None:
        what.append(f"unused for {format_age(older)}")
    if max_bytes is not None:
        what.append(f"down to {size(max_bytes)}")
    scope = f" in {len(chosen)} namespace(s)" if chosen else ""
    line(con, f"{verb} {len(victims):,} of {len(selected):,} chunks{scope} ({size(victim_bytes)}; "
              f"{', '.join(what)}); the store {'would hold' if args.dry_run else 'now holds'} "
              f"{len(entries) - len(victims):,} chunk{'' if len(entries) - len(victims) == 1 else 's'} "
              f"({size(store_bytes - victim_bytes)})")
    if args.dry_run:
        line(con, "dry run: nothing was removed")
    return 0
