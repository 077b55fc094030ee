"""The test engine itself (``kvtier.testing.engine``): what the engine tests rely on."""

from __future__ import annotations

import weakref
from pathlib import Path

from kvtier.testing.engine import Engine


def test_a_closed_engine_is_freed_by_the_next_engines_close(tiny_model: Path) -> None:
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
