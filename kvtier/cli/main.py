"""Entry point of the ``kvtier`` command (``kvtier = "kvtier.cli.main:main"``).

Exit status: 0 success; 1 the store cannot be used, something named is not there, or (for
``verify``/``inspect``) corruption was found; 2 a bad command line (unknown option,
malformed size or age, unknown namespace, unusable tokens file). Every failure is one
``kvtier: error: ...`` line on stderr; set ``KVTIER_DEBUG=1`` for a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import lmdb

import kvtier
from kvtier.backends.lmdb_check import full_cause, unusable_store
from kvtier.cli import compact, evict, inspect, ls, prefetch, stats, verify, warmup
from kvtier.cli._common import NotFoundError, Parser, UsageError
from kvtier.errors import ConfigError, KVTierError, StoreDamaged

EPILOG = """\
examples:
  kvtier ls /data/kvcache                     namespaces, chunk counts, sizes, ages
  kvtier stats /data/kvcache                  totals, disk use, compression, free space
  kvtier inspect /data/kvcache 3fa2c1         one record's header and checksum status
  kvtier verify /data/kvcache                 check every checksum (exit 1 if corrupt)
  kvtier evict /data/kvcache --max-bytes 50G  drop least recently used chunks
  kvtier compact /data/kvcache                shrink a store's LMDB files (server stopped)
  kvtier prefetch /data/kvcache --max-bytes 20G  read the hot records into the page cache
  kvtier warmup --model DIR --prompts P.jsonl store the KV of known prompts before traffic

Run 'kvtier COMMAND --help' for each command's options and examples.
Exit status: 0 ok; 1 store unusable, not found, or corruption found; 2 bad command line.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvtier",
        description="Inspect, verify, evict and warm up a kvtier KV cache on disk, offline "
                    "(safe while a server is writing to it).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvtier {kvtier.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (ls, stats, inspect, verify, evict, compact, prefetch, warmup):
        module.add_parser(sub)
    return parser


def _fail(message: str, status: int) -> int:
    line = " ".join(str(message).split())  # one line, whatever the message held
    sys.stderr.write(f"kvtier: error: {line}\n")
    if os.environ.get("KVTIER_DEBUG"):
        traceback.print_exc()
    return status


def _store_of(args: argparse.Namespace) -> str:
    # 'warmup' has no STORE argument (its store is the --config path)
    return str(getattr(args, "store", None) or "the cache's store")


def _no_space(args: argparse.Namespace, exc: BaseException) -> str | None:
    """The message for an error that is (or was raised because of) a full file system."""
    cause = full_cause(exc, Path(args.store).expanduser() if getattr(args, "store", None) else None)
    if cause is None:
        return None
    if getattr(args, "command", None) == "compact":
        advice = "free space (compact writes a copy of the data in use), then retry"
    else:
        advice = "free space (or lower disk_bytes), then retry"
    where = "in the store's LMDB map" if isinstance(cause, lmdb.MapFullError) else "on the store's file system"
    return f"{_store_of(args)}: no space left {where} ({type(cause).__name__}: {cause}); {advice}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        status: int = args.func(args)
        sys.stdout.flush()
        return status
    except (UsageError, ConfigError) as exc:
        return _fail(f"{exc}", 2)
    except StoreDamaged as exc:  # (a full disk under damage: the page check's own report)
        return _fail(_no_space(args, exc) or f"{exc}", 1)
    except (NotFoundError, KVTierError) as exc:
        return _fail(f"{exc}", 1)
    except lmdb.Error as exc:
        return _fail(_no_space(args, exc) or str(unusable_store(Path(_store_of(args)), exc)), 1)
    except BrokenPipeError:
        # The reader of our output went away (e.g. '| head'): stop quietly, status 1 as
        # rich does for its tables (stdout now goes nowhere so exit cannot fail on flush).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as exc:
        full = _no_space(args, exc)
        if full:
            return _fail(full, 1)
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}; check the path and its permissions", 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:  # a bug: still one line for the operator
        return _fail(f"internal error: {type(exc).__name__}: {exc} "
                     "(set KVTIER_DEBUG=1 for a traceback and report it)", 1)


if __name__ == "__main__":
    sys.exit(main())
