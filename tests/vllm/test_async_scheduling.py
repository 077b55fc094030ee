"""Engine tests again, with vLLM's asynchronous scheduling, as GPU servers run by default.

vLLM's CPU platform turns asynchronous scheduling off; ``kvtier.testing.engine`` turns it
back on (``KVTIER_TEST_ASYNC_SCHEDULING=1``): the engine core then plans step N+1 before it
has step N's output, so the connector sees each request a step behind. These tests cover
what that changes for kvtier: saves of a step planned before the step before has run (a
restart with identical logprobs), a conversation's answer chunks keyed from tokens appended
a step later, preempted requests resumed and loaded again, failed loads. Run the whole
engine suite that way with ``KVTIER_TEST_ASYNC_SCHEDULING=1 .venv/bin/python -m pytest tests/vllm``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASYNC_SCHEDULING_TESTS = (
    "tests/vllm/test_async_scheduling.py::test_the_engine_schedules_as_the_environment_says",
    "tests/vllm/test_restart.py::test_restart_hits_and_identical_tokens_and_logprobs",
    "tests/vllm/test_restart.py::test_the_next_turn_of_a_conversation_loads_the_previous_answer",
    "tests/vllm/test_scheduling.py::test_a_preempted_request_loads_its_prefix_and_answer_again",
    "tests/vllm/test_scheduling.py::test_a_request_whose_load_failed_is_not_promised_a_load_again",
    "tests/vllm/test_faults.py::test_corrupt_chunk_is_detected_and_recomputed",
)


def test_engine_tests_pass_under_asynchronous_scheduling() -> None:
    env = {**os.environ, "KVTIER_TEST_ASYNC_SCHEDULING": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ASYNC_SCHEDULING_TESTS],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert "7 passed" in r.stdout, r.stdout[-2000:]  # (the preemption test runs twice: both load modes)


def test_the_engine_schedules_as_the_environment_says(tiny_model: Path) -> None:
    """What the tests above rely on: with ``KVTIER_TEST_ASYNC_SCHEDULING=1`` (as the run above
    sets it) vLLM's engine core runs with its batch queue and plans a step before the output
    of the one before (schedule, schedule, update, ...); without it, as vLLM runs on the CPU,
    each step's output comes before the next is planned."""
    from kvtier.testing.engine import Engine, observe

    forced = os.environ.get("KVTIER_TEST_ASYNC_SCHEDULING") == "1"
    with Engine(tiny_model) as e:
        assert e.async_scheduling is forced
        order: list[str] = []
        observe(e.scheduler, "schedule", lambda *a, **k: order.append("S"))
        observe(e.scheduler, "update_from_output", lambda *a, **k: order.append("U"))
        e.generate([list(range(3, 300))], max_tokens=4)
    assert "".join(order).startswith("SSU" if forced else "SUSU"), order
