"""Helpers of the engine tests (a module of its own: ``conftest`` is a name every test folder
has, so importing helpers from it depends on which folder pytest collected last)."""

from __future__ import annotations

import random


def tokens(n: int, seed: int) -> list[int]:
    """``n`` reproducible token ids of the tiny test models' vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]
