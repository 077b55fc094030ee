"""``kvtier prefetch``: read the most recently used records into the OS page cache.

After a reboot the page cache is empty, so a server's first hits read from disk. Reading the
hot part of the store once, before traffic, makes those hits memory-speed. Every record read
is also verified (header and checksum), as a load would.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rich.markup import escape

from kvtier.backends.base import most_recent
from kvtier.cli._common import (
    UsageError,
    add_command,
    add_json_arg,
    add_namespace_filters,
    line,
    print_json,
    progress,
    size,
    stdout_console,
)
from kvtier.cli._store import (
    RECORD_PROBLEMS,
    check_record,
    open_store,
    resolve_namespaces,
    snapshot,
)
from kvtier.dali_reader import require_dali
from kvtier.units import parse_size

EPILOG = """\
examples:
  kvtier prefetch /data/kvcache --max-bytes 20G          the 20 GiB used most recently
  kvtier prefetch /data/kvcache --max-bytes 5G --model llama-3-8b

Records are read most recently used first (last save or load) until --max-bytes; each one is
verified as it is read. Read-only and safe beside a running server; nothing is deleted (a
corrupt record is counted: run 'kvtier verify --remove-corrupt'). Useful after a reboot, or
after the page cache was reclaimed (idle pages go within minutes on a busy machine).
"""


@dataclass
class Report:
    records: int = 0
    bytes: int = 0
    corrupt: int = 0
    gone: int = 0
    seconds: float = 0.0
    candidates: int = 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "prefetch", help="read the most recently used records into the OS page cache",
        description="Read (and verify) the most recently used records, up to a byte budget, so "
                    "that a server's first hits after a reboot come from memory.",
        epilog=EPILOG, run=run)
    p.add_argument("--max-bytes", metavar="SIZE", required=True, help="how much to read (e.g. 20G, 512M)")
    p.add_argument("--reader", choices=("default", "dali"), default="default",
                   help="read with kvtier's reader (default) or in NVIDIA DALI pipelines "
                        "(files backend; pip install 'kvtier[dali]')")
    add_namespace_filters(p)
    add_json_arg(p)


def run(args: argparse.Namespace) -> int:
    max_bytes = parse_size(args.max_bytes, "--max-bytes")
    rep = Report()
    start = time.monotonic()
    with open_store(args.store) as st:
        entries = snapshot(st.backend)
        chosen = resolve_namespaces(st.root, {e.namespace_id for e in entries}, st.backend.namespaces(),
                                    args.namespace, args.model)
        todo = most_recent([e for e in entries if not chosen or e.namespace_id in chosen], max_bytes)
        rep.candidates = len(todo)
        if args.reader == "dali":
            require_dali()
            if st.backend.payloads.name != "files":
                raise UsageError(f"--reader dali reads record files; {st.root} uses the "
                                 f"{st.backend.payloads.name} backend (use the default reader)")
        with progress("prefetching", enabled=not args.json, unit="records") as bar:
            task = bar.add_task("prefetch", total=len(todo), status="")
            for e, data in _records(st.backend, todo, args.reader):
                if data is GONE:
                    rep.gone += 1
                    bar.update(task, advance=1)
                    continue
                try:
                    header = check_record(st.backend, e.key, data)
                except RECORD_PROBLEMS:
                    rep.corrupt += 1
                else:
                    if header is None:
                        rep.gone += 1
                    else:
                        rep.records += 1
                        rep.bytes += header.record_len
                bar.update(task, advance=1, status=f"  {size(rep.bytes)}")
        root = str(st.root)
    rep.seconds = time.monotonic() - start
    if args.json:
        print_json({"store": root, "max_bytes": max_bytes, "records": rep.records, "bytes": rep.bytes,
                    "seconds": round(rep.seconds, 3), "corrupt_or_unreadable": rep.corrupt,
                    "gone": rep.gone})
    else:
        con = stdout_console()
        rate = f" ({size(rep.bytes / rep.seconds)}/s)" if rep.seconds > 0 else ""
        line(con, f"{escape(root)}: read {rep.records:,} record(s), {size(rep.bytes)}, in "
                  f"{rep.seconds:.2f}s{rate}, most recently used first (budget {size(max_bytes)})")
        if rep.corrupt:
            line(con, f"[yellow]{rep.corrupt} record(s) failed verification or could not be read; "
                      f"run 'kvtier verify {escape(root)}'[/]")
    return 0


GONE = memoryview(b"")  # a record file another process removed before it was read


def _records(backend, todo: list, reader: str) -> Iterator[tuple[object, memoryview | None]]:  # noqa: ANN001
    """``(entry, its bytes)``: None for "read it yourself" (the default reader), or what a
    DALI pipeline read (:data:`GONE` for a file removed meanwhile)."""
    if reader == "default":
        for e in todo:
            yield e, None
        return
    from kvtier.dali_reader import read_files

    paths = [str(backend.payloads.path_of(e.key, e.location)) for e in todo]
    for i, data in read_files(paths):
        yield todo[i], GONE if data is None else data
