"""How much host memory this process can still take: what the kernel counts as available
(``MemAvailable``), and no more than its container's memory limit leaves (cgroup v2 or v1).

A serving worker reserves all its chunk buffers when it starts (``BufferPool.reserve``) and
touches every page. Asking for more than is there does not fail cleanly: the kernel lets the
allocation through and the OOM killer ends the process (or a neighbour) part-way through the
touching, with nothing said about why. So the pool asks here first, and refuses with a
message. Every figure is read fresh (other processes come and go); one that cannot be read
is left out, and with none the answer is None (unknown: not Linux).
"""

from __future__ import annotations

from pathlib import Path

# a cgroup v1 "no limit" is the largest page-aligned 64-bit value; anything this large is none
_NO_LIMIT = 1 << 60


def available_bytes(proc: Path = Path("/proc"), cgroup_fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The least of ``MemAvailable`` and the room left under each memory limit of this
    process's cgroup and its ancestors; None if none of them can be read."""
    figures = [_mem_available(proc / "meminfo"), *(_room(d) for d in _cgroup_dirs(proc, cgroup_fs))]
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # (in kB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs(proc: Path, cgroup_fs: Path) -> list[Path]:
    """This process's memory cgroup directories, itself first, then each ancestor up to the
    mount's root (a limit set on any of them applies). In a container the path the kernel
    names may not exist under the mount (which shows the container's own cgroup as its
    root): what exists of the chain is used, the root always."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    dirs: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":  # cgroup v2 (the unified hierarchy)
            root = cgroup_fs
        elif "memory" in parts[1].split(","):  # cgroup v1, the memory controller's hierarchy
            root = cgroup_fs / "memory"
        else:
            continue
        d = root / parts[2].lstrip("/")
        while True:
            if d.is_dir() and d not in dirs:
                dirs.append(d)
            if d == root or root not in d.parents:
                break
            d = d.parent
    return dirs


def _room(d: Path) -> int | None:
    """What the memory limit of cgroup ``d`` leaves: the limit less what its processes use,
    their page cache not counted (the kernel reclaims it before it kills); None if ``d`` has
    no limit or its files cannot be read."""
    v2 = (d / "memory.max").exists()
    limit_file, usage_file, cache_keys = (("memory.max", "memory.current", ("file",)) if v2 else
                                          ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                           ("total_cache", "cache")))
    try:
        raw = (d / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= _NO_LIMIT:
            return None
        limit, usage = int(raw), int((d / usage_file).read_text())
    except (OSError, ValueError):
        return None
    try:
        stat = dict(line.split()[:2] for line in (d / "memory.stat").read_text().splitlines() if " " in line)
        cache = next((int(stat[k]) for k in cache_keys if k in stat), 0)
    except (OSError, ValueError):  # (then all of the usage counts)
        cache = 0
    return max(0, limit - max(0, usage - cache))
