"""Shared pieces of the reliability harness: the run's scale, and the figures it reports.

Counts are modest in the normal test run; ``KVTIER_RELIABILITY=long`` (see
docs/reliability.md) multiplies them for long runs. Every part records figures (kills,
mutations, faults, operations), printed at the end of the run and written as JSON to
``$KVTIER_RELIABILITY_REPORT`` when that is set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

LONG = os.environ.get("KVTIER_RELIABILITY", "") == "long"
FIGURES: dict[str, dict[str, object]] = {}


def fuzz_seed() -> int:
    """A random seed for a fuzz or fault test, printed in its failures; KVTIER_SEED=N runs
    that seed again."""
    import time

    return int(os.environ.get("KVTIER_SEED", time.time_ns() % 100_000))


def scale(modest: int, long: int) -> int:
    """A count for this run: ``modest`` in the normal test run, ``long`` in a long run."""
    return long if LONG else modest


def record(part: str, **figures: object) -> None:
    """Add figures under ``part`` (numbers add up across calls, other values are replaced)."""
    mine = FIGURES.setdefault(part, {})
    for k, v in figures.items():
        old = mine.get(k)
        mine[k] = old + v if isinstance(v, int) and isinstance(old, int) else v


def kvtier_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the ``kvtier`` command line in its own process, as an operator would."""
    return subprocess.run([sys.executable, "-m", "kvtier", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
