"""``kvtier compact``: give an LMDB store's free pages back to the file system."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape

from kvtier.backends import read_marker
from kvtier.cli._common import add_command, add_json_arg, line, print_json, size, stdout_console
from kvtier.cli._store import open_store, store_root

EPILOG = """\
example:
  kvtier compact /data/kvcache

LMDB reuses the pages of deleted records but never shrinks its file; compact rewrites it
without free pages ('kvtier stats' shows how much that would give back). It needs the store
to itself: it refuses, changing nothing, while a server or another kvtier command has the
store open; stop the server first. The files backend keeps one file per record, so a
deleted record's space is already free: nothing to compact (reports 0 B).
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "compact", help="shrink an LMDB store's file (the store must not be in use)",
        description="Rewrite an LMDB store's data file without free pages.",
        epilog=EPILOG, run=run)
    add_json_arg(p)


def run(args: argparse.Namespace) -> int:
    root = store_root(args.store)
    marker = read_marker(root)
    out: dict[str, Any] = {"store": str(root), "backend": marker["backend"]}
    if marker["backend"] != "lmdb":
        out.update(reclaimed_bytes=0, note="files backend: each record is its own file; nothing to compact")
    else:
        # exclusive: refuses (StoreError) if anyone has the store open
        with open_store(args.store, write=True, exclusive=True) as st:
            data = root / "lmdb" / "data.mdb"
            before = data.stat().st_size
            reclaimed = st.backend.compact()
        out.update(before_bytes=before, after_bytes=data.stat().st_size, reclaimed_bytes=reclaimed)
    if args.json:
        print_json(out)
        return 0
    con = stdout_console()
    if marker["backend"] != "lmdb":
        line(con, f"{escape(str(root))}: {out['note']} (0 B reclaimed)")
    else:
        line(con, f"{escape(str(root))}: compacted lmdb/data.mdb from {size(out['before_bytes'])} to "
                  f"{size(out['after_bytes'])} ({size(out['reclaimed_bytes'])} reclaimed)")
    return 0
