"""What host memory a process can still take (``kvtier.host_memory``), which a worker's pool
reservation is checked against: the kernel's MemAvailable, within the memory limits of the
process's cgroup and its ancestors. The container cases are /proc and cgroup files written as
the kernel writes them (a limit cannot be set on this machine without privileges)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.host_memory import available_bytes

GIB = 1 << 30


def _proc(tmp_path: Path, cgroup: str, mem_available: int | None = 100 * GIB) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    if mem_available is not None:
        (proc / "meminfo").write_text(f"MemTotal:       {200 * GIB // 1024} kB\n"
                                      f"MemFree:        {GIB // 1024} kB\n"
                                      f"MemAvailable:   {mem_available // 1024} kB\n")
    return proc


def _cgroup(d: Path, files: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)


def test_this_machine_has_some_memory_available() -> None:
    if not Path("/proc/meminfo").exists():
        pytest.skip("Linux's /proc")
    got = available_bytes()
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    assert got is not None and 0 < got <= total


def test_a_limit_on_a_parent_cgroup_v2_bounds_it_its_page_cache_not_counted(tmp_path: Path) -> None:
    """Kubernetes sets the pod's limit on the pod's cgroup, above the container's: 8 GiB
    with 6 GiB used, 2 GiB of it page cache, leaves 4 GiB, less than MemAvailable."""
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    fs = tmp_path / "cgroup"
    _cgroup(fs / "kubepods" / "pod1" / "ctr", {"memory.max": "max\n", "memory.current": f"{5 * GIB}\n",
                                               "memory.stat": f"anon {3 * GIB}\nfile {2 * GIB}\n"})
    _cgroup(fs / "kubepods" / "pod1", {"memory.max": f"{8 * GIB}\n", "memory.current": f"{6 * GIB}\n",
                                       "memory.stat": f"anon {4 * GIB}\nfile {2 * GIB}\n"})
    assert available_bytes(proc, fs) == 4 * GIB
    # shared memory (/dev/shm) is in "file" but cannot be dropped; reclaimable slab can
    (fs / "kubepods" / "pod1" / "memory.stat").write_text(
        f"anon {3 * GIB}\nfile {2 * GIB}\nshmem {GIB}\nslab_reclaimable {GIB // 2}\n")
    assert available_bytes(proc, fs) == 8 * GIB - (6 * GIB - (2 * GIB - GIB + GIB // 2))


def test_a_cgroup_v1_limit_seen_from_inside_a_container(tmp_path: Path) -> None:
    """Without a cgroup namespace the kernel names the host's path (``/docker/abc``), which the
    container's mount does not have: its root is the container's cgroup. 2 GiB limit, 1.5 GiB
    used of which 1 GiB page cache: 1.5 GiB left. A limit of "none" (the largest value) counts
    as none."""
    proc = _proc(tmp_path, "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    fs = tmp_path / "cgroup"
    # (the hierarchy's totals count, not the cgroup's own figures; shared memory is not freed)
    _cgroup(fs / "memory", {"memory.limit_in_bytes": f"{2 * GIB}\n", "memory.usage_in_bytes": f"{3 * GIB // 2}\n",
                            "memory.stat": f"cache {GIB // 4}\nshmem 0\nrss {GIB // 2}\ntotal_cache {GIB}\n"
                                           f"total_shmem {GIB // 4}\n"})
    assert available_bytes(proc, fs) == 2 * GIB - (3 * GIB // 2 - 3 * GIB // 4)
    (fs / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert available_bytes(proc, fs) == 100 * GIB  # (MemAvailable)


def test_what_cannot_be_read_is_left_out(tmp_path: Path) -> None:
    """A limit that is not a number: that cgroup is left out; a missing memory.stat: all its
    usage counts; no /proc at all (not Linux): unknown, and no reservation is refused for it."""
    proc = _proc(tmp_path, "0::/a\n", mem_available=7 * GIB)
    fs = tmp_path / "cgroup"
    _cgroup(fs / "a", {"memory.max": "lots\n", "memory.current": "1\n", "memory.stat": "file 0\n"})
    _cgroup(fs, {"memory.max": f"{8 * GIB}\n", "memory.current": f"{3 * GIB}\n"})  # (no memory.stat)
    assert available_bytes(proc, fs) == 5 * GIB
    (fs / "memory.max").write_text("max\n")
    assert available_bytes(proc, fs) == 7 * GIB
    assert available_bytes(tmp_path / "nothing", tmp_path / "nothing") is None


def test_zfs_cache_counts_as_available_above_its_floor(tmp_path: Path) -> None:
    """ZFS's cache (the ARC) gives memory back under pressure, but ``MemAvailable`` leaves it
    out: on a ZFS host it can be half the RAM, and a check on ``MemAvailable`` alone would
    refuse a pool that fits. What is above the ARC's floor (``c_min``) counts."""
    proc = _proc(tmp_path, "0::/\n", mem_available=10 * GIB)
    arc = proc / "spl" / "kstat" / "zfs"
    arc.mkdir(parents=True)
    (arc / "arcstats").write_text("9 1 0x01 147 39984 4066522806 15573733475066\n"
                                  "name                            type data\n"
                                  f"hits                            4    123456\n"
                                  f"c_min                           4    {GIB}\n"
                                  f"size                            4    {9 * GIB}\n")
    assert available_bytes(proc, tmp_path / "cgroup") == 18 * GIB


def test_a_hybrid_hierarchy_and_paths_outside_the_namespace(tmp_path: Path) -> None:
    """systemd's hybrid layout: the v1 memory hierarchy holds the limit, and the v2 line
    ("0::") points at a tree with no memory files; a path with ".." (a process outside the
    namespace's root) is not followed out of the cgroup mount."""
    proc = _proc(tmp_path, "4:memory:/user.slice\n0::/../etc\n1:name=systemd:/user.slice\n")
    fs = tmp_path / "cgroup"
    _cgroup(fs / "memory" / "user.slice", {"memory.limit_in_bytes": f"{4 * GIB}\n",
                                           "memory.usage_in_bytes": f"{GIB}\n", "memory.stat": "total_cache 0\n"})
    _cgroup(fs / "unified", {})
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "memory.max").write_text("1\n")  # (a trap: never read)
    (tmp_path / "etc" / "memory.current").write_text("0\n")
    assert available_bytes(proc, fs) == 3 * GIB


def test_a_cgroup_this_process_cannot_look_into_is_left_out(tmp_path: Path) -> None:
    """A cgroup directory whose check fails with an error other than "not there" (a sandbox
    that denies cgroupfs gives EACCES; here a name too long for the file system, which this
    suite can raise as root too): it is left out, and the worker is not stopped by it."""
    proc = _proc(tmp_path, "0::/" + "x" * 300 + "\n", mem_available=7 * GIB)
    fs = tmp_path / "cgroup"
    _cgroup(fs, {"memory.max": f"{4 * GIB}\n", "memory.current": f"{GIB}\n"})
    assert available_bytes(proc, fs) == 3 * GIB
