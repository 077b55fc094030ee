"""Helpers shared by the benchmark workers: kvtier's (in .venv) and LMCache's (in .venv-lmcache).

Only the standard library and torch: this module is imported by both environments, and the
LMCache venv does not have kvtier installed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

GIB = 1 << 30
MIB = 1 << 20
RESULT_PREFIX = "RESULT "


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache (needs root). True if it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def evict(path: Path | str) -> bool:
    """Write back and evict every file under ``path`` from the page cache (posix_fadvise
    DONTNEED; checked with ``fincore``). Unlike dropping all caches this keeps the Python and
    torch libraries cached, so a worker that starts next does not spend seconds re-reading
    them. True if every file was evicted."""
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    ok = True
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def fill_kv(kv: torch.Tensor, seed: int, chunk_tokens: int = 256, token_axis: int = 2) -> torch.Tensor:
    """Fill ``kv`` with deterministic normal(0, 1) values, chunk by chunk along ``token_axis``.

    One chunk's worth of random normals is generated once and every chunk gets it rotated by
    a different amount: no chunk repeats within itself (so zstd sees data as hard as real
    normal-distributed KV, not a tiled pattern), chunks differ from each other (so a chunk
    loaded into the wrong place fails verification), and 1 GiB takes well under a second
    instead of ~7 s for ``torch.randn`` on these cores.
    """
    n_tok = kv.shape[token_axis]
    first = kv.narrow(token_axis, 0, min(chunk_tokens, n_tok))
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randn(first.numel(), generator=g).to(kv.dtype)
    for i, s in enumerate(range(0, n_tok, chunk_tokens)):
        dst = kv.narrow(token_axis, s, min(chunk_tokens, n_tok - s))
        src = torch.roll(pattern, shifts=i * 99_991 + 1)[: dst.numel()]
        dst.copy_(src.view(dst.shape))
    return kv


def fill_flat(buf: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill a 1-D tensor with deterministic normal(0, 1) values (raw-disk source data)."""
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randn(buf.numel(), generator=g).to(buf.dtype))
    return buf


def tokens_for(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128_000, (n,), generator=g).tolist()


def dir_bytes(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (du)."""
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=False)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else 0


def time_calls(fn: Callable[[], object], runs: int, warmup: int = 3) -> dict[str, float]:
    """Median, p10 and p90 of ``fn``'s wall time in milliseconds over ``runs`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "p10_ms": samples[len(samples) // 10],
        "p90_ms": samples[(len(samples) * 9) // 10],
        "runs": runs,
    }


def emit(result: dict[str, object]) -> None:
    """Hand a worker's result to the parent process (one JSON line)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)
