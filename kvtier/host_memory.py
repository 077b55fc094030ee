"""How much host memory this process can still take: what the kernel counts as available
(``MemAvailable``, plus what ZFS's cache would give back, which it leaves out), and no more
than its container's memory limit leaves (cgroup v2 or v1).

A serving worker reserves all its chunk buffers when it starts (``BufferPool.reserve``) and
touches every page. Asking for more than is there does not fail cleanly: the kernel lets the
allocation through and the OOM killer ends the process (or a neighbour) part-way through the
touching, with nothing said about why. So the pool asks here first, and refuses with a
message. Every figure is read fresh (other processes come and go). A figure that cannot be
read is left out, never guessed low: a wrong refusal stops a server that would have run.
With none, the answer is None (unknown: not Linux).
"""

from __future__ import annotations

from pathlib import Path

# a cgroup v1 "no limit" is the largest page-aligned 64-bit value; anything this large is none
_NO_LIMIT = 1 << 60


def available_bytes(proc: Path = Path("/proc"), cgroup_fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The least of the host's available memory and the room left under each memory limit
    of this process's cgroup and its ancestors; None if none of them can be read."""
    host = _mem_available(proc / "meminfo")
    if host is not None:
        host += _zfs_arc_reclaimable(proc / "spl" / "kstat" / "zfs" / "arcstats")
    figures = [host, *(_room(d) for d in _cgroup_dirs(proc, cgroup_fs))]
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


def _zfs_arc_reclaimable(arcstats: Path) -> int:
    """What ZFS's cache (the ARC) would shrink by under memory pressure: its size above its
    floor. ``MemAvailable`` counts none of it, though it gives it back like the page cache
    (up to half the RAM, by default)."""
    try:
        stats = _table(arcstats.read_text(), value_at=2)
        return max(0, stats["size"] - stats["c_min"])
    except (OSError, ValueError, KeyError):
        return 0


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
        if len(parts) != 3 or ".." in parts[2].split("/"):  # (outside this namespace's root)
            continue
        if parts[0] == "0" and parts[1] == "":  # cgroup v2 (the unified hierarchy)
            root = cgroup_fs
        elif "memory" in parts[1].split(","):  # cgroup v1, the memory controller's hierarchy
            root = cgroup_fs / "memory"
        else:
            continue
        d = root / parts[2].lstrip("/")
        while True:
            try:
                if d.is_dir() and d not in dirs:
                    dirs.append(d)
            except OSError:  # (a directory this process may not look into: left out)
                pass
            if d == root or root not in d.parents:
                break
            d = d.parent
    return dirs


def _room(d: Path) -> int | None:
    """What the memory limit of cgroup ``d`` leaves: the limit less what its processes use,
    less what the kernel reclaims before it kills (page cache, but not shared memory, which
    it cannot drop; v2 also counts reclaimable kernel caches); None if ``d`` has no limit or
    its files cannot be read."""
    try:
        v2 = (d / "memory.max").exists()
        limit_file, usage_file = (("memory.max", "memory.current") if v2 else
                                  ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        raw = (d / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= _NO_LIMIT:
            return None
        limit, usage = int(raw), int((d / usage_file).read_text())
    except (OSError, ValueError):
        return None
    try:
        stat = _table((d / "memory.stat").read_text(), value_at=1)
    except (OSError, ValueError):  # (then all of the usage counts)
        stat = {}
    if v2:
        reclaimable = stat.get("file", 0) - stat.get("shmem", 0) + stat.get("slab_reclaimable", 0)
    else:  # (the hierarchy's totals where the kernel gives them)
        reclaimable = (stat.get("total_cache", stat.get("cache", 0))
                       - stat.get("total_shmem", stat.get("shmem", 0)))
    return max(0, limit - max(0, usage - max(0, reclaimable)))


def _table(text: str, *, value_at: int) -> dict[str, int]:
    """``name ... value`` lines (the value in column ``value_at``) as a dict; lines whose
    value is not a number (headers) are left out."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) > value_at and cols[value_at].isdigit():
            out[cols[0]] = int(cols[value_at])
    return out
