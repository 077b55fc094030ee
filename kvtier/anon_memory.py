"""Anonymous memory maps: memory of this process alone that goes back to the system as soon
as the map is gone (unlike freed heap memory, which glibc may keep). No torch here: the CLI
uses it through the files backend."""

from __future__ import annotations

import mmap


def anonymous_map(size: int) -> mmap.mmap:
    """``size`` bytes of zeroed, page-aligned memory of this process alone."""
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which a forked child
    # would share with its parent (two processes' writers would fill the same buffer).
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
