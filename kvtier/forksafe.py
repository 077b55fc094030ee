"""The one place that makes kvtier's objects survive ``fork()``.

vLLM and test harnesses fork processes that may already hold an open store. Threads and
locks do not survive a fork, and an LMDB environment must not be used by the child. Each
layer registers its hooks here with a stage number, and the hooks run in stage order: the
LMDB environments first (the child must drop the parent's before anything reopens), then
backends, then stores. ``os.register_at_fork`` is called once, so the order never depends
on which module was imported first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

# Stages, in the order a child runs them.
LMDB = 0
BACKEND = 1
STORE = 2

_before: list[tuple[int, Callable[[], None]]] = []
_parent: list[tuple[int, Callable[[], None]]] = []
_child: list[tuple[int, Callable[[], None]]] = []
_lock = threading.Lock()


def register(stage: int, *, before: Callable[[], None] | None = None,
             after_in_parent: Callable[[], None] | None = None,
             after_in_child: Callable[[], None] | None = None) -> None:
    """Run ``before`` ahead of every fork, and the ``after_*`` hooks after it, by ``stage``."""
    with _lock:
        for hooks, fn in ((_before, before), (_parent, after_in_parent), (_child, after_in_child)):
            if fn is not None:
                hooks.append((stage, fn))
                hooks.sort(key=lambda h: h[0])


def _run(hooks: list[tuple[int, Callable[[], None]]], reverse: bool = False) -> None:
    for _, fn in (reversed(hooks) if reverse else list(hooks)):
        fn()


# Before the fork, the outer layers (stores) quiesce first and LMDB last, so the gate that
# waits for transactions to end is the final step before the fork itself.
os.register_at_fork(before=lambda: _run(_before, reverse=True),
                    after_in_parent=lambda: _run(_parent),
                    after_in_child=lambda: _run(_child))
