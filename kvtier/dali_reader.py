"""Bulk reads of record files through NVIDIA DALI (the optional ``dali`` extra).

An alternative to kvtier's own reader for *prefetch* from the files backend: the connector's
``prefetch_reader: "dali"`` (most recently used chunks into the host tier at start-up) and
``kvtier prefetch --reader dali`` (records into the OS page cache). DALI reads the files of a
batch in parallel on its own threads (``fn.readers.file``); kvtier then verifies each record
exactly as a load does. It is never on the default path, and never imported unless asked
for.

GPUDirect Storage: DALI reads straight into GPU memory only through its numpy reader
(``fn.readers.numpy(device="gpu")``), which needs ``.npy`` files. kvtier's records carry
their own checked header, so DALI can only read them with its CPU file reader; see
docs/warmup.md for what a GPU path would take.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Sequence

from kvtier.backends.payloads import open_regular_file
from kvtier.errors import ConfigError

INSTALL_HINT = "the DALI reader needs NVIDIA DALI: pip install 'kvtier[dali]'"


def dali_available() -> bool:
    """Whether DALI can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no "nvidia" namespace package at all
        return False


def require_dali() -> None:
    if not dali_available():
        raise ConfigError(INSTALL_HINT)


def read_files(paths: Sequence[str], *, threads: int = 4, batch: int = 16) -> Iterator[tuple[int, memoryview | None]]:
    """Read ``paths`` with a DALI pipeline; yield ``(index, contents)`` in order. A file that
    is gone by the time its batch is read (another process evicted it) yields None."""
    require_dali()
    from nvidia.dali import fn, pipeline_def

    for start in range(0, len(paths), batch):
        idx = range(start, min(start + batch, len(paths)))
        part = [(i, paths[i]) for i in idx if os.path.exists(paths[i])]
        got: dict[int, memoryview | None] = {}
        if part:

            @pipeline_def(batch_size=len(part), num_threads=max(1, threads), device_id=None,
                          prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
            def pipe(files: list[str]):  # noqa: ANN202 - a DALI graph
                data, _ = fn.readers.file(files=files, random_shuffle=False, name="records")
                return data

            p = pipe([path for _, path in part])
            try:
                p.build()
                (out,) = p.run()
                got = {i: memoryview(out.at(j)).cast("B") for j, (i, _) in enumerate(part)}
            except RuntimeError:  # a file vanished between the check and the read: read what is left
                got = {i: _read_plain(path) for i, path in part}
            del p
        for i in idx:  # in order; a file gone before the batch was read: None
            yield i, got.get(i)


def _read_plain(path: str) -> memoryview | None:
    try:
        with open(path, "rb", buffering=0, opener=lambda p, f: open_regular_file(p)) as f:
            return memoryview(f.read())
    except FileNotFoundError:
        return None
