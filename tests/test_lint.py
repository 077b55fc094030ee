"""The code base stays ruff-clean (ruff is part of the test extra)."""

import shutil
import subprocess
import sys
from pathlib import Path

# not ``from conftest import REPO``: another directory's conftest may hold that name
REPO = Path(__file__).resolve().parent.parent


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(REPO / ".venv" / "bin" / "ruff")
    r = subprocess.run([ruff, "check", "kvtier", "tests", "benchmarks", "examples"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_without_vllm() -> None:
    """kvtier imports without vLLM (and never imports it as a side effect)."""
    code = "import sys, kvtier, kvtier.cache, kvtier.store; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
