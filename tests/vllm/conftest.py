"""Engine-test fixtures: a tiny local model with random weights, in-process engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# In-process engines: seconds to start instead of tens of seconds (see the brief).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "kvtier-tests-inductor"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.testing.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def other_weights_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.testing.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-b", seed=1)
