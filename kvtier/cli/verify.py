"""``kvtier verify``: check every record's header and payload checksum."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvtier.backends import Backend, EntryInfo
from kvtier.cli._common import (
    add_command,
    add_json_arg,
    line,
    print_json,
    progress,
    show,
    size,
    stdout_console,
)
from kvtier.cli._store import (
    RECORD_PROBLEMS,
    check_record,
    open_store,
    problem,
    snapshot,
)

EPILOG = """\
examples:
  kvtier verify /data/kvcache
  kvtier verify /data/kvcache --remove-corrupt
  kvtier verify /data/kvcache --json > report.json || echo "corruption found"

Every record is read and its header checksum, lengths, key and payload checksum (xxh3-128)
are checked, one short read at a time, so a server can keep writing meanwhile (records it
adds after the start are not checked; records evicted meanwhile are counted as 'gone').
A serving kvtier never loads a corrupt record (it counts a miss and recomputes), so
corruption costs only cache hits; --remove-corrupt frees their space. A record whose file
was removed behind the store's back (the index still names it) is 'missing': it can never
load, and --remove-corrupt drops it from the index too. Records of another format version
are intact and reported as incompatible, not removed.
Exit status: 0 all records verify; 1 corrupt, missing or unreadable records were found (even
if --remove-corrupt removed them); 2 bad command line.
"""

# How many corrupt records a table shows (JSON lists them all).
SHOW = 50


@dataclass
class Report:
    ok: int = 0
    bytes_checked: int = 0
    gone: int = 0
    corrupt: dict[bytes, str] = field(default_factory=dict)
    incompatible: dict[bytes, str] = field(default_factory=dict)
    unreadable: dict[bytes, str] = field(default_factory=dict)
    # index entries whose payload is gone though the index still names it (removed by hand)
    missing: dict[bytes, str] = field(default_factory=dict)
    removed: int = 0
    removed_bytes: int = 0
    seconds: float = 0.0

    @property
    def checked(self) -> int:
        """Records read (all but those gone meanwhile)."""
        return self.ok + len(self.corrupt) + len(self.incompatible) + len(self.unreadable) + len(self.missing)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "verify", help="check every record's checksum; exit status 1 if corruption is found",
        description="Check every record's checksum (with a progress bar on a terminal).",
        epilog=EPILOG, run=run)
    p.add_argument("--remove-corrupt", action="store_true",
                   help="delete the corrupt records found (opens the store for writing)")
    add_json_arg(p)


def _status(backend: Backend, entry: EntryInfo) -> tuple[str, str, int]:
    """``(kind, why, record bytes)`` of this version of a record, with kind ok, gone,
    missing, corrupt, incompatible or unreadable."""
    try:
        header = backend.read_entry(entry, lambda view: check_record(backend, entry.key, view))
    except RECORD_PROBLEMS as exc:
        return (*problem(exc), 0)
    if header is None:  # evicted or replaced meanwhile: gone; else its file was removed
        if backend.still_names(entry):
            return "missing", "the index names a record file that is not there (removed by hand?)", 0
        return "gone", "", 0
    return "ok", "", header.record_len


def verify(store_path: str, *, remove: bool, show_progress: bool) -> Report:
    rep = Report()
    start = time.monotonic()
    with open_store(store_path, write=remove, removes_records=remove) as st:
        entries = snapshot(st.backend)
        with progress("verifying", enabled=show_progress) as bar:
            task = bar.add_task("verify", total=len(entries), status="")
            corrupt: list[EntryInfo] = []
            for e in entries:
                kind, why, nbytes = _status(st.backend, e)
                if kind == "ok":
                    rep.ok += 1
                    rep.bytes_checked += nbytes
                elif kind == "gone":
                    rep.gone += 1
                else:
                    getattr(rep, kind)[e.key] = why
                    rep.bytes_checked += e.size if kind != "missing" else 0
                    if kind in ("corrupt", "missing"):  # proven unloadable
                        corrupt.append(e)
                bar.advance(task)
        if remove:
            for e in corrupt:  # exactly the version found corrupt: one a writer saved since stays
                if st.backend.delete_entry(e):
                    rep.removed += 1
                    rep.removed_bytes += e.size
    rep.seconds = time.monotonic() - start
    return rep


def run(args: argparse.Namespace) -> int:
    rep = verify(args.store, remove=args.remove_corrupt, show_progress=not args.json)
    bad = bool(rep.corrupt or rep.unreadable or rep.missing)
    if args.json:
        out: dict[str, Any] = {
            "store": args.store, "checked": rep.checked, "ok": rep.ok, "gone": rep.gone,
            "bytes_checked": rep.bytes_checked, "seconds": round(rep.seconds, 3),
            "corrupt": [{"key": k.hex(), "error": v} for k, v in rep.corrupt.items()],
            "incompatible": [{"key": k.hex(), "error": v} for k, v in rep.incompatible.items()],
            "unreadable": [{"key": k.hex(), "error": v} for k, v in rep.unreadable.items()],
            "missing": [{"key": k.hex(), "error": v} for k, v in rep.missing.items()],
            "removed": rep.removed, "removed_bytes": rep.removed_bytes,
        }
        print_json(out)
        return 1 if bad else 0
    con = stdout_console()
    problems = [("corrupt", k, v) for k, v in rep.corrupt.items()] + \
               [("unreadable", k, v) for k, v in rep.unreadable.items()] + \
               [("missing", k, v) for k, v in rep.missing.items()] + \
               [("incompatible", k, v) for k, v in rep.incompatible.items()]
    if problems:
        t = Table(title="records that failed", title_justify="left")
        for col in ("key", "problem", "detail"):
            t.add_column(col, no_wrap=col == "key")
        for kind, k, why in problems[:SHOW]:
            t.add_row(k.hex()[:16] + "…", kind, escape(why))
        show(con, t)
        if len(problems) > SHOW:
            line(con, f"… and {len(problems) - SHOW} more (use --json for all)")
    rate = rep.bytes_checked / rep.seconds if rep.seconds > 0 else 0.0
    line(con, f"checked {rep.checked:,} records ({size(rep.bytes_checked)}) in {rep.seconds:.2f}s "
              f"({size(rate)}/s): {rep.ok:,} ok, {len(rep.corrupt):,} corrupt, "
              f"{len(rep.unreadable):,} unreadable, {len(rep.incompatible):,} incompatible"
              + (f", {len(rep.missing):,} missing" if rep.missing else "")
              + (f", {rep.gone:,} gone while checking" if rep.gone else ""))
    if args.remove_corrupt:
        what = "corrupt or missing" if rep.missing else "corrupt"
        line(con, f"removed {rep.removed:,} {what} records ({size(rep.removed_bytes)})")
    elif rep.corrupt or rep.missing:
        line(con, f"[yellow]run 'kvtier verify {escape(args.store)} --remove-corrupt' to remove them[/]")
    if not bad and rep.incompatible:  # (intact, and kept: not "all records verify", none of them did)
        line(con, f"[green]no corrupt records[/]; {len(rep.incompatible):,} incompatible record(s) kept "
                  "for the kvtier version or max_record_bytes that can read them")
    elif not bad:
        line(con, "[green]all records verify[/]")
    return 1 if bad else 0
