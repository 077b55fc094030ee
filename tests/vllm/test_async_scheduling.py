"""Engine tests with vLLM's asynchronous scheduling, as GPU servers run by default.

vLLM's CPU platform turns asynchronous scheduling off; ``kvtier.testing.engine`` turns it
back on (``KVTIER_TEST_ASYNC_SCHEDULING=1``): the engine core then plans step N+1 before it
has step N's output, so the connector sees each request a step behind. The engine tests
marked ``both_schedulings`` run both ways, in this process (the ``scheduling`` fixture in
``conftest.py``), and cover what that changes for kvtier: saves of a step planned before the
step before has run (a restart with identical logprobs), a conversation's answer chunks keyed
from tokens appended a step later, preempted requests resumed and loaded again, failed loads,
a corrupt record. Run the whole engine suite that way with
``KVTIER_TEST_ASYNC_SCHEDULING=1 .venv/bin/python -m pytest tests/vllm``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.testing.engine import Engine, observe


@pytest.mark.both_schedulings
def test_the_engine_schedules_as_the_environment_says(tiny_model: Path) -> None:
    """What the ``both_schedulings`` tests rely on: with ``KVTIER_TEST_ASYNC_SCHEDULING=1``
    vLLM's engine core runs with its batch queue and plans a step before the output of the
    one before (schedule, schedule, update, ...); without it, as vLLM runs on the CPU, each
    step's output comes before the next is planned."""
    forced = os.environ.get("KVTIER_TEST_ASYNC_SCHEDULING") == "1"
    with Engine(tiny_model) as e:
        assert e.async_scheduling is forced
        order: list[str] = []
        observe(e.scheduler, "schedule", lambda *a, **k: order.append("S"))
        observe(e.scheduler, "update_from_output", lambda *a, **k: order.append("U"))
        e.generate([list(range(3, 300))], max_tokens=4)
    assert "".join(order).startswith("SSU" if forced else "SUSU"), order


# What the suite runs both ways; a marker dropped from one of them fails the test below.
BOTH_WAYS = {"test_the_engine_schedules_as_the_environment_says",
             "test_restart_hits_and_identical_tokens_and_logprobs",
             "test_the_next_turn_of_a_conversation_loads_the_previous_answer",
             "test_a_preempted_request_loads_its_prefix_and_answer_again",
             "test_a_request_whose_load_failed_is_not_promised_a_load_again",
             "test_corrupt_chunk_is_detected_and_recomputed"}


def test_both_ways_are_run(request: pytest.FixtureRequest) -> None:
    """Each of ``BOTH_WAYS`` that this run collected is collected once per way of scheduling,
    so an asynchronous run cannot silently drop out of the suite."""
    items = [i for i in request.session.items if getattr(i, "originalname", None) in BOTH_WAYS]
    if not items:
        pytest.skip("none of the tests run both ways was collected in this run")
    ways = {(i.originalname, getattr(i, "callspec", None) and i.callspec.params.get("scheduling")) for i in items}
    assert ways == {(name, way) for name, _ in ways for way in ("sync", "async")}
