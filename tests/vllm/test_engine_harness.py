"""The test engine itself (``kvtier.testing.engine``): what the engine tests rely on."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.engine import Engine


@pytest.fixture
def no_log_records() -> Iterator[None]:
    """No log records while the test runs: vLLM logs its chat-template warm-up failure with a
    traceback, and a record pytest keeps for the test's report keeps that traceback's frames,
    and the engine they hold, alive until the test ends."""
    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(before)


def test_a_closed_engine_is_freed_by_the_next_engines_close(tiny_model: Path, no_log_records: None) -> None:
    """The test engine freezes the garbage collector's heap before an engine starts and runs
    no collection of its own at close (each costs 0.4 s here). A closed engine's KV cache
    must still go at its close, and the rest of it (reference cycles, which a frozen heap
    keeps) at the next engine's close, where vLLM unfreezes and collects: otherwise every
    engine in a test process would stay in memory."""
    first = Engine(tiny_model)
    first.generate([list(range(3, 300))], max_tokens=4)
    core = first.llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    kv_cache = weakref.ref(runner.kv_caches[0])
    engine_core = weakref.ref(core)
    del core, runner
    first.close()
    assert kv_cache() is None
    with Engine(tiny_model) as second:
        second.generate([list(range(3, 300))], max_tokens=4)
    assert engine_core() is None


def test_an_engine_that_fails_to_start_leaves_no_frozen_heap(tiny_model: Path, tmp_path: Path) -> None:
    """A start refused by kvtier (chunk buffers the host cannot hold) never reaches close():
    the heap the test engine froze is unfrozen all the same, or the cycles of everything made
    before would never be collected again in that process."""
    from kvtier.errors import ConfigError
    from kvtier.testing.engine import kv_transfer_config

    gc.unfreeze()
    with pytest.raises(ConfigError, match="cannot reserve its chunk buffers"):
        Engine(tiny_model, kv_transfer_config(tmp_path / "store", host_bytes="100T"))
    assert gc.get_freeze_count() == 0
