"""kvtier's connector fits the connector API of the installed vLLM and of the newest CUDA
release (read from its wheel, no GPU needed), and the check itself catches API changes."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from kvtier.testing.vllm_api import BASE, SOURCES, api_problems, fetch_release

REPO = Path(__file__).resolve().parents[2]
NEWEST_CUDA_RELEASE = os.environ.get("KVTIER_VLLM_API_RELEASE", "0.33.0")


def _installed_vllm() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


def test_fits_the_installed_vllm() -> None:
    assert api_problems(_installed_vllm()) == []


def test_fits_the_newest_cuda_release() -> None:
    """Fetched once into .venv-vllm-api/ (a 340 MB wheel, of which 8 files are kept)."""
    from kvtier.vllm.compat import TESTED_VLLM, parse_version

    assert parse_version(NEWEST_CUDA_RELEASE) == TESTED_VLLM[1]
    cache = REPO / ".venv-vllm-api"
    cache.mkdir(exist_ok=True)
    assert api_problems(fetch_release(NEWEST_CUDA_RELEASE, cache)) == []


@pytest.fixture
def vllm_copy(tmp_path: Path) -> Path:
    src = _installed_vllm()
    for rel in SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, tmp_path / rel)
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert re.search(old, text), old
    path.write_text(re.sub(old, new, text, count=1))


def test_check_sees_a_renamed_parameter(vllm_copy: Path) -> None:
    _edit(vllm_copy / BASE, r"def get_num_new_matched_tokens\(\s*self,\s*request",
          "def get_num_new_matched_tokens(self, req")
    assert any("get_num_new_matched_tokens" in p for p in api_problems(vllm_copy))


def test_check_sees_a_new_abstract_method(vllm_copy: Path) -> None:
    _edit(vllm_copy / BASE, r"(\n    @abstractmethod\n)", r"\1    def must_implement(self, x): ...\n\n    @abstractmethod\n")
    assert any("must_implement is abstract" in p for p in api_problems(vllm_copy))


def test_check_sees_a_removed_scheduler_field(vllm_copy: Path) -> None:
    _edit(vllm_copy / "vllm/v1/core/sched/output.py", r"\n    resumed_req_ids: [^\n]*", "\n")
    assert any("resumed_req_ids" in p for p in api_problems(vllm_copy))


def test_check_sees_a_renamed_attention_backend(vllm_copy: Path) -> None:
    _edit(vllm_copy / "vllm/v1/attention/backends/flash_attn.py", r'return "FLASH_ATTN"', 'return "FLASH_ATTN_V4"')
    assert any("FLASH_ATTN is gone" in p for p in api_problems(vllm_copy))


def test_a_directory_without_vllm_sources_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.testing.vllm_api import main

    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no vLLM sources here" in err and "site-packages" in err
