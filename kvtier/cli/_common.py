"""Shared pieces of the CLI: its errors, consoles, JSON output and human formatting."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kvtier.errors import KVTierError
from kvtier.units import format_age, format_size


class UsageError(KVTierError):
    """The command line asks for something that cannot be (exit status 2)."""


class NotFoundError(KVTierError):
    """What the command line names is not in the store (exit status 1)."""


def short_model(model: str) -> str:
    """A model's name for a table: a local path's last component; a hub id as it is."""
    if model.startswith(("/", ".", "~")):
        return model.rstrip("/").rsplit("/", 1)[-1] or model
    return model


def stdout_console() -> Console:
    # highlight=False: rich would otherwise colour numbers in our tables at random.
    return Console(highlight=False, soft_wrap=False)


def show(con: Console, table: Table, drop: Sequence[str] = ()) -> None:
    """Print ``table`` whole: wider than the console, it is printed at its natural width
    when output is not a terminal (a pipe or file: no wrapped cells), and on a terminal the
    ``drop`` columns (least useful first) are left out until it fits."""
    need = Measurement.get(con, con.options.update(max_width=100_000), table).maximum
    if need > con.width:
        if not con.is_terminal:
            con.width = need
        else:
            for name in drop:
                table.columns = [c for c in table.columns if c.header != name]
                if Measurement.get(con, con.options.update(max_width=100_000), table).maximum <= con.width:
                    break
    if table.title:  # printed apart: rich pads a table title with spaces to the table's width
        con.print(table.title, soft_wrap=True, style="italic")
        table.title = None
    con.print(table)


def line(con: Console, text: str) -> None:
    """Print a message line; long lines are not broken (terminals wrap them themselves)."""
    con.print(text, soft_wrap=True)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def progress(label: str, *, enabled: bool = True, unit: str = "records") -> Progress:
    """A progress bar on stderr, shown only on a terminal (never in pipes or with --json).
    A task's ``status`` field, when given, is shown after the count."""
    console = stderr_console()
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit + "{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not (enabled and console.is_terminal),
    )


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def size(n: int | float | None) -> str:
    return "-" if n is None else format_size(n)


def ago(ts_ns: int | None, now: float | None = None) -> str:
    """``1.5h ago`` for a time in nanoseconds since the epoch; ``-`` when unknown."""
    if ts_ns is None:
        return "-"
    now = time.time() if now is None else now
    delta = now - ts_ns / 1e9
    if delta < 0:
        return "just now"
    return f"{format_age(delta)} ago"


def ts_seconds(ts_ns: int | None) -> float | None:
    return None if ts_ns is None else round(ts_ns / 1e9, 3)


def ratio(raw: int, stored: int) -> float | None:
    return round(raw / stored, 3) if stored else None


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr (and exit status 2)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        ns, extras = super().parse_known_args(args, namespace)
        # argparse settles an optional positional (nargs='?') as soon as it meets the one
        # before it: in 'inspect STORE --salt x KEY', KEY was left unset and 'KEY' unknown.
        # Such a positional takes the first leftover that is not an option.
        for action in self._actions:
            if action.nargs == "?" and not action.option_strings and getattr(ns, action.dest, None) is None:
                at = next((i for i, a in enumerate(extras) if not a.startswith("-")), None)
                if at is None:
                    break
                setattr(ns, action.dest, extras.pop(at))
        return ns, extras

    def error(self, message: str, *, where: str | None = None) -> Any:  # argparse's says NoReturn
        sys.stderr.write(f"kvtier: error: {self._explain(message)} (see '{where or self.prog} --help')\n")
        raise SystemExit(2)

    def _explain(self, message: str) -> str:
        """argparse reads a negative value ('--max-bytes -5G') as an option and says the
        option has no value: say what is wrong with the value instead."""
        m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        argv = getattr(self, "_argv", [])
        if m and m.group(1) in argv:
            at = argv.index(m.group(1)) + 1
            if at < len(argv) and re.match(r"-\.?\d", argv[at]):
                return f"argument {m.group(1)}: {argv[at]!r} is negative; give a value of 0 or more"
        return message

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        # argparse reports a subcommand's unknown option from the top parser: point to the
        # subcommand's own --help, where its options are
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(ns, "command", None)
            self.error(f"unrecognized arguments: {' '.join(extras)}",
                       where=f"{self.prog} {command}" if command else None)
        return ns


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, *, help: str,
                description: str, epilog: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A subcommand's parser, with its examples epilog, the STORE argument and ``run`` set;
    the caller adds its own options, then :func:`add_json_arg` (so --json is listed last)."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arg(p)
    p.set_defaults(func=run)
    return p


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", help="the store directory (the path a kvtier cache was opened on)")


def add_namespace_filters(p: argparse.ArgumentParser) -> None:
    """``--namespace`` and ``--model`` (repeatable), resolved by ``_store.resolve_namespaces``:
    each one given adds to the selection."""
    p.add_argument("--namespace", metavar="HEXPREFIX", action="append",
                   help="only this namespace (hex id or unique prefix from 'kvtier ls'); repeatable, "
                        "and each --namespace or --model adds to the selection")
    p.add_argument("--model", metavar="NAME", action="append", help="only namespaces of this model; repeatable")


def add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
