"""``kvtier compact``: give the free pages of a store's LMDB files back to the file system."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape

from kvtier.cli._common import add_command, add_json_arg, line, print_json, size, stdout_console
from kvtier.cli._store import open_store

EPILOG = """\
example:
  kvtier compact /data/kvcache

LMDB reuses the pages of deleted records but never shrinks its files; compact rewrites them
without free pages ('kvtier stats' shows how much that would give back): the shared index
(index/data.mdb, both backends) and, on an lmdb store, the records (lmdb/data.mdb). Each
file is reported on its own line. The files backend keeps one file per record, so a deleted
record's space is free already; only its index is compacted. It needs the store to itself:
it refuses, changing nothing, while a server or another kvtier command has the store open;
stop the server first. It needs free space for a copy of the data in use; a compact that
fails (e.g. on a full disk) leaves the store as it was. Each rewritten file keeps its owner
and permissions; run by a user who cannot give a file back to its owner, it refuses (the
server could no longer open it).
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "compact", help="shrink a store's LMDB files (the store must not be in use)",
        description="Rewrite a store's LMDB data files (its index, and an lmdb store's records) "
                    "without free pages.",
        epilog=EPILOG, run=run)
    add_json_arg(p)


def run(args: argparse.Namespace) -> int:
    files: list[dict[str, Any]] = []
    # exclusive: refuses (StoreError) if anyone has the store open
    with open_store(args.store, write=True, exclusive=True) as st:
        root = st.root
        # records first (an lmdb store's big file), then the index: each reported apart
        for handle in sorted(st.backend.lmdb_envs(), key=lambda h: h.path.name != "lmdb"):
            data = handle.path / "data.mdb"
            before = data.stat().st_size
            reclaimed = handle.compact()
            # (the store's own name for it: STORE may be relative, the handle's path is not)
            files.append({"file": f"{handle.path.name}/{data.name}", "before_bytes": before,
                          "after_bytes": data.stat().st_size, "reclaimed_bytes": reclaimed})
        backend = st.backend_name
    out: dict[str, Any] = {
        "store": str(root), "backend": backend, "files": files,
        "before_bytes": sum(f["before_bytes"] for f in files),
        "after_bytes": sum(f["after_bytes"] for f in files),
        "reclaimed_bytes": sum(f["reclaimed_bytes"] for f in files),
    }
    if args.json:
        print_json(out)
        return 0
    con = stdout_console()
    for f in files:
        line(con, f"{escape(str(root))}: compacted {f['file']} from {size(f['before_bytes'])} to "
                  f"{size(f['after_bytes'])} ({size(f['reclaimed_bytes'])} reclaimed)")
    return 0
