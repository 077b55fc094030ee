"""The CLI beside a live writer process: no errors, no corruption, consistent answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from clihelpers import CHUNK, NS_LLAMA, NS_QWEN, Built, one_line_error, run_main, run_many

WRITER = Path(__file__).resolve().parent / "cli_writer.py"


def test_cli_while_a_writer_saves(fresh_store: Built, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    b = fresh_store
    llama, qwen = NS_LLAMA.id.hex(), NS_QWEN.id.hex()
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, str(WRITER), str(b.path), b.backend, str(stop)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read() if writer.stderr else ""
        last_ls = 0
        # ls and verify twice, stats and (LMDB) compact once: each start costs ~2 s.
        rounds = [["ls", "verify", "stats"] + (["compact"] if b.backend == "lmdb" else []), ["ls", "verify"]]
        for names in rounds:
            argv = {"ls": ("ls", b.path, "--json"), "verify": ("verify", b.path, "--json"),
                    "stats": ("stats", b.path, "--json"), "compact": ("compact", b.path)}
            res = dict(zip(names, run_many(*(argv[n] for n in names)), strict=True))
            for name in ("ls", "verify", "stats"):
                if name in res:
                    r = res[name]
                    assert r.returncode == 0 and r.stderr == "", (r.args, r.stdout, r.stderr)
            ls, ver = json.loads(res["ls"].stdout), json.loads(res["verify"].stdout)
            rows = {n["id"]: n for n in ls["namespaces"]}
            # The writer only adds qwen-mini chunks of CHUNK tokens; llama is untouched.
            assert rows[llama]["chunks"] == b.chunks[llama] and rows[llama]["tokens"] == b.tokens[llama]
            added = rows[qwen]["chunks"] - b.chunks[qwen]
            assert added > 0
            assert rows[qwen]["tokens"] == b.tokens[qwen] + CHUNK * added  # whole records only
            assert ls["total"]["unreadable_chunks"] == 0
            assert ls["total"]["chunks"] >= last_ls
            last_ls = ls["total"]["chunks"]
            assert not ver["corrupt"] and not ver["unreadable"] and ver["ok"] == ver["checked"]
            assert ver["checked"] >= b.total_chunks
            if "stats" in res:
                stats = json.loads(res["stats"].stdout)
                assert stats["records"] >= b.total_chunks and stats["unreadable_headers"] == 0
                assert stats["tokens"] == sum(b.tokens.values()) + CHUNK * (stats["records"] - b.total_chunks)
            if "compact" in res:  # compact needs the store to itself: refused, nothing changed
                one_line_error(res["compact"], 1, "in use")
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    counters = report["stats"]
    assert counters["io_errors"] == 0 and counters["dropped_saves"] == 0 and counters["corrupt_records"] == 0
    assert report["chunks"] == counters["saves_committed"]

    # After the writer stops, the CLI sees exactly what it committed.
    final = run_main(capsys, "ls", b.path, "--json")
    assert final.returncode == 0, final.stderr
    rows = {n["id"]: n for n in json.loads(final.stdout)["namespaces"]}
    assert rows[qwen]["chunks"] == b.chunks[qwen] + report["chunks"]
    assert rows[qwen]["chunks"] + b.chunks[llama] >= last_ls
