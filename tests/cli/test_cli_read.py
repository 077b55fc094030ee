"""ls, stats and inspect through the console script on both backends (JSON, checked in
full); the human tables of the same commands in-process (same code, no ~2 s start each)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clihelpers import NS_LLAMA, NS_QWEN, SALTED_TOKENS, Built, cli, entries, run_main, run_many

from kvtier.cli.main import main


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_read_commands(backend: str, built_stores: dict[str, Built], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    b = built_stores[backend]
    before = entries(b.path, backend)
    llama, qwen = NS_LLAMA.id.hex(), NS_QWEN.id.hex()
    key = b.keys[llama][0]
    tokens_file = tmp_path / "prompt.json"
    tokens_file.write_text(json.dumps(SALTED_TOKENS))
    # `python -m kvtier` for one of them (the same entry point as the console script)
    with subprocess.Popen([sys.executable, "-m", "kvtier", "ls", str(b.path), "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as dash_m:
        results = run_many(
            ("stats", b.path, "--json", "--budget", "4M"),
            ("inspect", b.path, key.hex(), "--json"),
            ("inspect", b.path, "--tokens", tokens_file, "--model", "tiny-llama", "--salt", "tenant-a", "--json"),
        )
        out, err = dash_m.communicate(timeout=120)
    results.insert(0, subprocess.CompletedProcess(dash_m.args, dash_m.returncode, out, err))
    for r in results:
        assert r.returncode == 0, (r.args, r.stdout, r.stderr)
        assert r.stderr == ""
    ls_j, st_j, in_j, tok_salt = results

    # ls: every namespace with its chunk and token counts.
    ls = json.loads(ls_j.stdout)
    assert ls["backend"] == backend
    rows = {n["id"]: n for n in ls["namespaces"]}
    assert set(rows) == {llama, qwen}
    for ns_id in (llama, qwen):
        assert rows[ns_id]["chunks"] == b.chunks[ns_id]
        assert rows[ns_id]["tokens"] == b.tokens[ns_id]
        assert rows[ns_id]["oldest_written"] <= rows[ns_id]["newest_written"]
    assert rows[qwen]["tp_rank"] == 1 and rows[qwen]["tp_size"] == 2 and rows[qwen]["dtype"] == "float16"
    assert rows[llama]["weights_fingerprint"] == "sha256:0123456789abcdef"
    assert ls["total"]["chunks"] == b.total_chunks
    assert ls["total"]["bytes"] == sum(size for size, _ in before.values())

    # stats: totals, compression from the headers, disk and budget.
    st = json.loads(st_j.stdout)
    assert st["records"] == b.total_chunks
    assert st["tokens"] == sum(b.tokens.values())
    assert st["record_bytes"] == ls["total"]["bytes"]
    assert st["budget"]["bytes"] == 4 << 20
    assert st["budget"]["used_fraction"] == pytest.approx(st["occupied_bytes"] / (4 << 20), abs=1e-3)
    assert st["occupied_bytes"] >= st["record_bytes"]
    assert st["filesystem"]["free_bytes"] > 0
    assert st["on_disk"]["bytes"] >= st["record_bytes"]
    if b.compression == "zstd":
        assert st["codecs"] == {"zstd+shuffle": b.total_chunks}
        assert st["compression_ratio"] > 1.05
        assert st["payload_stored_bytes"] < st["payload_raw_bytes"]
    else:
        assert st["codecs"] == {"raw": b.total_chunks} and st["compression_ratio"] == 1.0
    assert st["lmdb"] is not None  # the index is LMDB for both backends
    assert st["dtypes"] == {"bfloat16": b.chunks[llama], "float16": b.chunks[qwen]}

    # inspect by full key: the record's header, checksum verified.
    ins = json.loads(in_j.stdout)
    assert ins["key"] == key.hex() and ins["status"] == "ok" and ins["model"] == "tiny-llama"
    h = ins["header"]
    assert h["shape"] == [2, 2, 64, 4, 32] and h["dtype"] == "bfloat16" and h["layout"] == "LKTHD"
    assert h["token_start"] == 0 and h["num_tokens"] == 64 and h["namespace"] == llama
    assert h["codec"] == ("zstd+shuffle" if b.compression == "zstd" else "raw")
    assert h["record_bytes"] == before[key][0]

    # inspect --tokens: the salted prompt's chunks are found with its salt (and only with it).
    salted = json.loads(tok_salt.stdout)
    assert salted["cached_prefix_tokens"] == 144 and salted["tokens"] == 150
    assert [c["status"] for c in salted["chunks"]] == ["ok", "ok", "ok"]
    assert [(c["start"], c["end"]) for c in salted["chunks"]] == [(0, 64), (64, 128), (128, 144)]
    unsalted = run_main(capsys, "inspect", b.path, "--tokens", tokens_file, "--namespace", llama[:6], "--json")
    assert unsalted.returncode == 0, unsalted.stderr
    assert json.loads(unsalted.stdout)["cached_prefix_tokens"] == 0

    # The human tables.
    r = run_main(capsys, "ls", b.path)
    assert r.returncode == 0 and r.stderr == ""
    assert "tiny-llama" in r.stdout and "qwen-mini" in r.stdout and llama[:12] in r.stdout
    assert f"2 namespace(s), {b.total_chunks} chunks" in r.stdout and "ago" in r.stdout
    r = run_main(capsys, "stats", b.path)
    assert r.returncode == 0 and r.stderr == ""
    for label in ("records", "on disk", "payload", "filesystem", "files"):
        assert label in r.stdout
    assert "lmdb pages" in r.stdout
    # without --budget: the disk_bytes its writer recorded (the default, 64G), as eviction reads it
    assert re.search(r"budget\s+│ 64\.0 GiB \(\d+\.\d% used\)", r.stdout), r.stdout
    r = run_main(capsys, "stats", b.path, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["budget"]["bytes"] == 64 << 30
    r = run_main(capsys, "inspect", b.path, key.hex()[:10])
    assert r.returncode == 0 and r.stderr == ""
    assert key.hex() in r.stdout and "ok (checksum verified)" in r.stdout
    assert "[2, 2, 64, 4, 32] bfloat16" in r.stdout
    # the key after an option is still the key (argparse would call it unrecognized)
    r2 = run_main(capsys, "inspect", b.path, "--json", key.hex()[:10])
    assert r2.returncode == 0 and json.loads(r2.stdout)["key"] == key.hex(), r2
    r = run_main(capsys, "inspect", b.path, "--tokens", tokens_file, "--model", "tiny-llama", "--salt", "tenant-a")
    assert r.returncode == 0 and "cached prefix: 144 of 150 tokens" in r.stdout

    # None of this changed the store (opened read-only): same records, same last-use times.
    assert entries(b.path, backend) == before


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    r = cli("--help")
    assert r.returncode == 0 and "examples:" in r.stdout
    for cmd in ("ls", "stats", "inspect", "verify", "evict", "compact"):
        assert cmd in r.stdout
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert "example" in out and f"kvtier {cmd} " in out, cmd
    assert main(["evict", "--help"]) == 0
    assert "cache_salt" in capsys.readouterr().out  # says plainly why there is no --salt
