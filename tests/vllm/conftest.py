"""Engine-test fixtures: a tiny local model with random weights, in-process engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# In-process engines: seconds to start instead of tens of seconds (see the brief).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "kvtier-tests-inductor"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``both_schedulings`` runs twice, with vLLM's synchronous and its
    asynchronous scheduling, in this process (see the ``scheduling`` fixture)."""
    if metafunc.definition.get_closest_marker("both_schedulings"):
        metafunc.fixturenames.append("scheduling")
        metafunc.parametrize("scheduling", ["sync", "async"], indirect=True)


@pytest.fixture
def scheduling(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The way the engines a ``both_schedulings`` test builds schedule: ``async`` plans a
    step before the one before has its output, as GPU servers do (``kvtier.testing.engine``
    reads the variable when an engine is built). It overrides
    ``KVTIER_TEST_ASYNC_SCHEDULING`` for that test, in both directions."""
    monkeypatch.setenv("KVTIER_TEST_ASYNC_SCHEDULING", "1" if request.param == "async" else "0")
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.testing.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def other_weights_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.testing.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-b", seed=1)
