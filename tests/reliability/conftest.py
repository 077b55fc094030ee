"""Fixtures of the reliability harness; prints every part's figures at the end of the run."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The storage tests' helpers (kvhelpers, the _worker zygote) serve the harness too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "storage"))

from kvhelpers import Zygote  # noqa: E402
from relhelpers import FIGURES, LONG  # noqa: E402


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """A pre-imported process that forks real worker processes on request."""
    z = Zygote(hash_seed="2" if os.environ.get("PYTHONHASHSEED") == "1" else "1")
    yield z
    z.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not FIGURES:
        return
    terminalreporter.section(f"kvtier reliability figures ({'long' if LONG else 'modest'} run)")
    for part, figs in sorted(FIGURES.items()):
        terminalreporter.write_line(f"{part}: " + ", ".join(f"{k}={v}" for k, v in figs.items()))
    out = os.environ.get("KVTIER_RELIABILITY_REPORT")
    if out:
        Path(out).write_text(json.dumps({"long": LONG, "figures": FIGURES}, indent=1, sort_keys=True))
