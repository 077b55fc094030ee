"""The read-only commands start without importing torch (``kvtier --help`` and ``ls`` were
~1.5 s, nearly all of it torch; see docs/cli.md for the measured times), and ``ls`` tables
show a short model name with the full identity under ``--json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from clihelpers import Built, run_main

from kvtier import CacheConfig, Namespace
from kvtier.backends import open_backend

NO_TORCH = """
import sys
from kvtier.cli.main import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules, "this command imported torch"
sys.exit(rc)
"""


@pytest.mark.parametrize("command", [["--help"], ["ls"], ["ls", "--json"], ["stats"], ["stats", "--json"], ["verify"],
                                     ["evict", "--max-bytes", "1T", "--dry-run"], ["prefetch", "--max-bytes", "1G"]])
def test_read_only_commands_do_not_import_torch(built_stores: dict[str, Built], command: list[str]) -> None:
    for b in built_stores.values():
        args = command if command == ["--help"] else [command[0], str(b.path), *command[1:]]
        r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout


def test_ls_shows_a_short_model_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM namespace's model is the model's path and its identity has a dozen extras:
    the table shows the directory name; --json keeps everything."""
    store = tmp_path / "store"
    ns = Namespace(model="/srv/models/Llama-3.1-8B-Instruct", weights_fingerprint="sha256:00ff",
                   dtype="bfloat16", kv_shape=(32, 2, 8, 128),
                   extra=(("hf_config", "ab" * 32), ("kv_cache_dtype", "auto"), ("load_format", "auto")))
    backend = open_backend(CacheConfig(path=store))
    backend.register_namespace(ns.id, ns.describe())
    backend.close()
    table = run_main(capsys, "ls", store, "--all")  # (registered, no chunks yet)
    assert table.returncode == 0
    assert "Llama-3.1-8B-Instruct" in table.stdout
    assert "/srv/models" not in table.stdout and "kv_cache_dtype" not in table.stdout
    as_json = run_main(capsys, "ls", store, "--json")
    (row,) = json.loads(as_json.stdout)["namespaces"]
    assert row["model"] == "/srv/models/Llama-3.1-8B-Instruct"
    assert row["extra"]["kv_cache_dtype"] == "auto" and row["extra"]["hf_config"] == "ab" * 32
