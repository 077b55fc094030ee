"""Small pieces shared by kvtier's background threads (the store's writer, the uploader)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvtier")


class RateLimitedLog:
    """Warn at most once per ``interval`` seconds per message kind; count the rest."""

    def __init__(self, interval: float = 30.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) >= self.interval:
            n = self._suppressed.pop(kind, 0)
            suffix = f" ({n} similar suppressed)" if n else ""
            log.warning(msg + suffix, *args)
            self._last[kind] = now
        else:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1


def wait_while(cv: threading.Condition, busy: Callable[[], bool], deadline: float | None) -> bool:
    """Wait on ``cv`` while ``busy()``, until the monotonic ``deadline`` (None: no limit).
    True if no longer busy."""
    with cv:
        while busy():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            cv.wait(left)
    return True


def take_batch(queue: list, max_bytes: int) -> list:
    """Pop items (with ``nbytes``) from the front of ``queue`` up to ``max_bytes``, at least
    one. A function of its own so that no loop variable of a writer thread keeps the last
    item, and the buffer it holds, alive while the thread waits for more."""
    batch, size = [], 0
    while queue and (not batch or size + queue[0].nbytes <= max_bytes):
        batch.append(queue.pop(0))
        size += batch[-1].nbytes
    return batch
