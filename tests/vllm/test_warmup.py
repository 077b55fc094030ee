"""Offline warm-up, through vLLM and through transformers, followed by a real vLLM engine on
the same store: it hits, and its greedy output equals the output without any cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.testing.engine import Engine, kv_transfer_config
from kvtier.warmup import warmup

PROMPTS = [tokens(600, seed=300), tokens(300, seed=301)]
# What the test engines use (kvtier.testing.engine): the server's settings for warm-up.
F32 = {"dtype": "float32"}
VLLM_ARGS = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 4096, "enforce_eager": True,
             "distributed_executor_backend": "uni", "skip_tokenizer_init": True, "seed": 0,
             "max_num_batched_tokens": 2048, "max_num_seqs": 8}


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _hits(n: int) -> int:
    return (n - 1) // 32 * 32  # block-aligned, at least one token left to compute


@pytest.fixture(scope="module")
def baseline(tiny_model: Path) -> list[list[float]]:
    with Engine(tiny_model, **F32) as e:
        return e.generate(PROMPTS, max_tokens=8, logprobs=True)


def _serve(tiny_model: Path, store: Path, salts: list[str | None] | None = None):
    with Engine(tiny_model, kv_transfer_config(store), **F32) as e:
        return e.generate(PROMPTS, max_tokens=8, logprobs=True, salts=salts)


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_warmup_then_serve_hits_with_identical_output(tiny_model: Path, tmp_path: Path, engine: str,
                                                      baseline: list) -> None:
    store = tmp_path / "store"
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in PROMPTS])
    report = warmup(str(tiny_model), prompts, engine=engine, config={"path": str(store)}, block_size=32,
                    engine_args=VLLM_ARGS if engine == "vllm" else None, **F32)
    assert report.errors == [] and report.prompts == 2 and report.tokens == 900
    # 600 tokens: 2 chunks + a 64-token tail (88 rounded down to the block size); 300: 1 + a 32-token tail.
    assert report.chunks_stored == 3 + 2
    got = _serve(tiny_model, store)
    assert [r.num_cached_tokens for r in got] == [_hits(len(p)) for p in PROMPTS]
    assert [r.tokens for r in got] == [r.tokens for r in baseline]
    worst = max(abs(a - b) for r, s in zip(got, baseline, strict=True) for a, b in zip(r.logprobs, s.logprobs, strict=True))
    # float32; the served run computes only the prompt's last tokens over loaded KV, in other
    # batch shapes than a full prefill: observed 4e-6 (transformers) and 6e-6 (vllm).
    assert worst <= 1e-4, worst
    print(f"{engine} warm-up: max |logprob difference| {worst:.2e}")


def test_warmup_again_stores_nothing_and_computes_nothing(tiny_model: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.warmup import hf_engine

    store = tmp_path / "store"
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in PROMPTS])
    first = warmup(str(tiny_model), prompts, engine="transformers", config={"path": str(store)}, block_size=32, **F32)
    assert first.chunks_stored == 5

    def no_forward(self: object, token_ids: list[int]) -> None:
        raise AssertionError("a fully stored prompt ran a forward pass")

    monkeypatch.setattr(hf_engine.HFModel, "kv", no_forward)
    again = warmup(str(tiny_model), prompts, engine="transformers", config={"path": str(store)}, block_size=32, **F32)
    assert again.errors == [] and again.prompts == 2 and again.chunks_stored == 0


def test_salted_warmup_is_seen_only_with_that_salt(tiny_model: Path, tmp_path: Path, baseline: list) -> None:
    store = tmp_path / "store"
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": p, "cache_salt": "tenant-a"} for p in PROMPTS])
    warmup(str(tiny_model), prompts, engine="transformers", config={"path": str(store)}, block_size=32, **F32)
    assert [r.num_cached_tokens for r in _serve(tiny_model, store)] == [0, 0]
    assert [r.num_cached_tokens for r in _serve(tiny_model, store, salts=["tenant-b"] * 2)] == [0, 0]
    salted = _serve(tiny_model, store, salts=["tenant-a"] * 2)
    assert [r.num_cached_tokens for r in salted] == [_hits(len(p)) for p in PROMPTS]
    assert [r.tokens for r in salted] == [r.tokens for r in baseline]


def test_cli_reports_bad_lines_and_still_warms_the_rest(tiny_model: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli.main import main

    store = tmp_path / "store"
    prompts = _write(tmp_path / "p.jsonl", [
        {"prompt_token_ids": PROMPTS[0]},
        "{not json",
        {"prompt": "x", "prompt_token_ids": [1, 2]},
        {"prompt_token_ids": PROMPTS[1], "cache_salt": ""},
        {"prompt_token_ids": PROMPTS[1]},
    ])
    rc = main(["warmup", "--model", str(tiny_model), "--prompts", str(prompts), "--engine", "transformers",
               "--config", json.dumps({"path": str(store)}), "--dtype", "float32", "--block-size", "32", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1
    summary = json.loads(out)
    assert summary["prompts"] == 2 and summary["tokens"] == 900 and summary["chunks_stored"] == 5
    assert summary["seconds"] > 0
    assert [e.split(":")[0] for e in summary["errors"]] == ["line 2", "line 3", "line 4"]
    assert "line 2: not JSON" in err and "(skipped)" in err


def test_models_transformers_cannot_match_are_refused(tiny_model: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from kvtier.cli.main import main

    model = tmp_path / "yarn"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 2048}
    (model / "config.json").write_text(json.dumps(cfg))
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": PROMPTS[1]}])
    rc = main(["warmup", "--model", str(model), "--prompts", str(prompts), "--engine", "transformers",
               "--config", json.dumps({"path": str(tmp_path / "store")})])
    err = capsys.readouterr().err
    assert rc == 2 and "rope type 'yarn'" in err and "--engine vllm" in err
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.kvt"))


def test_prefetch_bytes_serves_first_hits_from_host_memory(tiny_model: Path, store_dir: Path,
                                                           baseline: list) -> None:
    """A restarted server with prefetch_bytes loads its most recently used chunks into the
    host tier in the background; its first requests then hit memory, not the disk."""
    with Engine(tiny_model, kv_transfer_config(store_dir), **F32) as e:
        e.generate(PROMPTS, max_tokens=1)
        e.worker_connector._store.flush()
    runs = {}
    for prefetch in (None, "4M"):
        extra = {"prefetch_bytes": prefetch} if prefetch else {}
        with Engine(tiny_model, kv_transfer_config(store_dir, **extra), **F32) as e:
            if prefetch:
                assert e.worker_connector.prefetch.result(timeout=120) == 5  # every chunk of both prompts
            else:
                assert e.worker_connector.prefetch is None
            got = e.generate(PROMPTS, max_tokens=8, logprobs=True)
            runs[prefetch] = e.worker_connector._store.counters.snapshot()
        assert [r.tokens for r in got] == [r.tokens for r in baseline]
        assert [r.num_cached_tokens for r in got] == [_hits(len(p)) for p in PROMPTS]
    assert runs[None]["hits_disk"] >= 4 and runs[None]["hits_host"] == 0
    assert runs["4M"]["hits_host"] >= 4 and runs["4M"]["hits_disk"] == 5  # the 5 reads were the prefetch


def test_prefetch_through_dali_serves_first_hits_from_host_memory(tiny_model: Path, tmp_path: Path,
                                                                  baseline: list) -> None:
    """The same with ``prefetch_reader: "dali"`` (files backend; DALI's CPU file reader)."""
    store = tmp_path / "store"
    with Engine(tiny_model, kv_transfer_config(store, backend="files"), **F32) as e:
        e.generate(PROMPTS, max_tokens=1)
        e.worker_connector._store.flush()
    extra = {"backend": "files", "prefetch_bytes": "4M", "prefetch_reader": "dali"}
    with Engine(tiny_model, kv_transfer_config(store, **extra), **F32) as e:
        assert e.worker_connector.prefetch.result(timeout=120) == 5
        got = e.generate(PROMPTS, max_tokens=8, logprobs=True)
        stats = e.worker_connector._store.counters.snapshot()
    assert [r.tokens for r in got] == [r.tokens for r in baseline]
    assert [r.num_cached_tokens for r in got] == [_hits(len(p)) for p in PROMPTS]
    assert stats["hits_host"] >= 4 and stats["hits_disk"] == 5 and stats["corrupt_records"] == 0
