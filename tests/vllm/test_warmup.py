"""Offline warm-up, through vLLM and through transformers, followed by a real vLLM engine on
the same store: it hits, and its greedy output equals the output without any cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.errors import ConfigError
from kvtier.testing.engine import Engine, kv_transfer_config
from kvtier.warmup import Prompt, warmup

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
    # the same prompts made in code (the library's form) are the same chunks
    again = warmup(str(tiny_model), [Prompt(token_ids=p) for p in PROMPTS], engine="transformers",
                   config={"path": str(store)}, block_size=32, **F32)
    assert again.errors == [] and again.prompts == 2 and again.chunks_stored == 0
    with pytest.raises(ValueError, match="exactly one of text and token_ids"):
        Prompt(text="a", token_ids=[1])


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


# -- the store's shared settings ------------------------------------------------------------
SERVER_SETTINGS = {"disk_bytes": "500G", "compression": "zstd", "durability": "power", "max_record_bytes": "64M"}


def _codecs(store: Path) -> list[str]:
    """How each record in ``store`` is encoded."""
    from kvtier.cli._store import open_store, read_header, snapshot
    from kvtier.codec import CODEC_NAMES

    with open_store(str(store)) as s:
        return [CODEC_NAMES[read_header(s.backend, e.key).codec] for e in snapshot(s.backend)]


def _recorded(store: Path) -> dict[str, object]:
    from kvtier.backends import STORED_SETTINGS, read_marker, stored_config

    cfg = stored_config(store, str(read_marker(store)["backend"]))
    return {"backend": cfg.backend, **{k: getattr(cfg, k) for k in STORED_SETTINGS}}


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_warmup_keeps_the_settings_the_server_recorded(tiny_model: Path, tmp_path: Path, engine: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A warm-up given only the store's path writes with, and leaves recorded, the settings
    the server opened the store with; it does not impose the defaults on every server."""
    from kvtier import CacheConfig, ChunkStore

    store = tmp_path / "store"
    ChunkStore(CacheConfig.from_dict({"path": str(store), **SERVER_SETTINGS})).close()  # the server's open
    before = _recorded(store)
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in PROMPTS])
    with caplog.at_level("WARNING", logger="kvtier"):
        report = warmup(str(tiny_model), prompts, engine=engine, config={"path": str(store)}, block_size=32,
                        engine_args=VLLM_ARGS if engine == "vllm" else None, **F32)
    assert report.errors == [] and report.chunks_stored == 5
    assert _recorded(store) == before
    assert "store settings changed" not in caplog.text
    assert _codecs(store) == ["zstd+shuffle"] * 5  # written as the server writes them


def test_warmup_settings_given_explicitly_still_win(tiny_model: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """(And a store's backend, left out, is the one it was created with.)"""
    from kvtier import CacheConfig, ChunkStore

    store = tmp_path / "store"
    ChunkStore(CacheConfig.from_dict({"path": str(store), "backend": "lmdb", **SERVER_SETTINGS})).close()
    before = _recorded(store)
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": PROMPTS[1]}])
    with caplog.at_level("WARNING", logger="kvtier"):
        report = warmup(str(tiny_model), prompts, engine="transformers", block_size=32, **F32,
                        config={"path": str(store), "disk_bytes": "1G"})
    assert report.errors == [] and _records_in(store) == 2 and before["backend"] == "lmdb"
    assert _recorded(store) == {**before, "disk_bytes": 1 << 30}
    assert "disk_bytes 536870912000 -> 1073741824" in caplog.text


# -- saves the store cannot take --------------------------------------------------------------
LONG = tokens(2100, seed=302)  # 8 chunks + a 32-token tail: 9 chunks of up to 256 KiB (float32)


def _records_in(store: Path) -> int:
    from kvtier.cli._store import open_store

    with open_store(str(store)) as s:
        return s.backend.usage()[0]


def test_long_prompt_through_a_small_write_queue_is_stored_whole(tiny_model: Path, tmp_path: Path) -> None:
    """A prompt's KV larger than the write queue (which drops what it cannot hold rather than
    wait, as a server must) is saved waiting for room: every chunk is stored, and counted once."""
    store = tmp_path / "store"
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": LONG}, {"prompt_token_ids": PROMPTS[0]}])
    report = warmup(str(tiny_model), prompts, engine="transformers", block_size=32, **F32,
                    # one chunk; a writer that syncs each commit, as a slow disk would be
                    config={"path": str(store), "write_queue_bytes": "256K", "durability": "power"})
    assert report.errors == [] and report.prompts == 2
    assert report.chunks_stored == 9 + 3 == _records_in(store)
    with Engine(tiny_model, kv_transfer_config(store), **F32) as e:
        got = e.generate([LONG], max_tokens=1)
    assert got[0].num_cached_tokens == _hits(len(LONG))


def test_a_vllm_warmup_waits_for_the_disk_instead_of_dropping_saves(tiny_model: Path, tmp_path: Path) -> None:
    """A prefill step saves far more than the write queue holds. A server drops what does not
    fit (its model thread must not wait for the disk); the warm-up engine's connector waits
    (``save_wait_s``), so every chunk is stored."""
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": LONG}])
    small = {"write_queue_bytes": "256K", "durability": "power"}  # one chunk; a sync per commit
    dropping = warmup(str(tiny_model), prompts, engine="vllm", block_size=32, engine_args=VLLM_ARGS, **F32,
                      config={"path": str(tmp_path / "a"), **small, "save_wait_s": 0})
    assert dropping.chunks_stored < 9  # what a server would have done with this step
    report = warmup(str(tiny_model), prompts, engine="vllm", block_size=32, engine_args=VLLM_ARGS, **F32,
                    config={"path": str(tmp_path / "b"), **small})
    assert report.errors == [] and report.chunks_stored == 9 == _records_in(tmp_path / "b")


def _cli(tiny_model: Path, prompts: Path, config: dict[str, object]) -> list[str]:
    return ["warmup", "--model", str(tiny_model), "--prompts", str(prompts), "--engine", "transformers",
            "--config", json.dumps(config), "--dtype", "float32", "--block-size", "32", "--json"]


def test_chunks_larger_than_the_write_queue_are_an_error(tiny_model: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli.main import main

    store = tmp_path / "store"
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": PROMPTS[1]}])
    # < one full chunk (256 KiB): refused before any work (every chunk would be dropped)
    rc = main(_cli(tiny_model, prompts, {"path": str(store), "write_queue_bytes": "128K"}))
    out, err = capsys.readouterr()
    assert rc != 0 and out == "" and _records_in(store) == 0, err
    line = err.strip().splitlines()[-1]  # (after transformers' own progress lines)
    assert line.startswith("kvtier: error: write_queue_bytes: 131072 bytes is smaller than one chunk of "
                           "this namespace (262144 bytes); raise it or lower chunk_tokens"), line


def test_a_store_that_does_not_finish_writing_ends_the_warm_up(tiny_model: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that hangs (the store's writes block for longer than the flush waits; the
    wait is shortened here): the prompt is reported with what to do, and the prompts after it
    are not run, since each would wait as long."""
    import threading

    import kvtier.warmup as warmup_module
    from kvtier.backends.base import Backend

    disk_back = threading.Event()
    real = Backend.put_many

    def hung(self: Backend, items: list) -> object:
        disk_back.wait(30)
        return real(self, items)

    monkeypatch.setattr(Backend, "put_many", hung)
    monkeypatch.setattr(warmup_module, "FLUSH_TIMEOUT_S", 0.5)
    threading.Timer(3.0, disk_back.set).start()  # the disk recovers later: the store closes
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[0]}])
    report = warmup(str(tiny_model), prompts, engine="transformers", block_size=32, **F32,
                    config={"path": str(tmp_path / "store")})
    assert report.prompts == 0 and len(report.errors) == 2, report.errors
    assert report.errors[0].startswith("line 1: ") and "did not finish writing within 0 s" in report.errors[0]
    assert report.errors[1] == "not run: the 1 prompt(s) after line 1"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 4 MiB tmpfs: a disk that fills."""
    from diskhelpers import small_tmpfs

    with small_tmpfs(tmp_path, "4m") as mnt:
        yield mnt


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_full_disk_is_an_error_with_an_honest_count(tiny_model: Path, tmp_path: Path, small_disk: Path,
                                                    backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from kvtier.cli.main import main

    store = small_disk / "store"
    config = {"path": str(store), "backend": backend}
    first = _write(tmp_path / "first.jsonl", [{"prompt_token_ids": PROMPTS[1]}])
    assert main(_cli(tiny_model, first, config)) == 0
    capsys.readouterr()
    free = shutil.disk_usage(small_disk).free  # someone else's data fills the disk
    (small_disk / "other-data").write_bytes(bytes(max(0, free - (64 << 10))))
    prompts = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": LONG}])
    rc = main(_cli(tiny_model, prompts, config))
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert rc == 1 and summary["prompts"] == 0
    assert summary["chunks_stored"] == _records_in(store) - 2 < 9
    [error] = summary["errors"]
    assert error.startswith(f"line 1: {9 - summary['chunks_stored']} of 9 chunk(s) not stored: the disk "
                            f"holding {store} is full"), error
    assert "Traceback" not in err


# -- prompts the engine refuses ------------------------------------------------------------------
def test_vllm_warmup_reports_refused_prompts_and_runs_the_rest(tiny_model: Path, tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """A prompt longer than the engine's max_model_len is reported with its line before any
    call; one vLLM refuses anyway (text, with no tokenizer) fails only itself, not its batch."""
    from kvtier.cli.main import main

    store = tmp_path / "store"
    prompts = _write(tmp_path / "p.jsonl", [
        {"prompt_token_ids": PROMPTS[0]},
        {"prompt_token_ids": tokens(1500, seed=303)},
        {"prompt": "a text prompt, and the engine has no tokenizer"},
        {"prompt_token_ids": PROMPTS[1]},
    ])
    rc = main(["warmup", "--model", str(tiny_model), "--prompts", str(prompts), "--engine", "vllm",
               "--config", json.dumps({"path": str(store)}), "--dtype", "float32", "--block-size", "32",
               "--engine-args", json.dumps({**VLLM_ARGS, "max_model_len": 1024}), "--json"])
    out, err = capfd.readouterr()
    # (the in-process engine of the tests logs into pytest's captured stdout: the summary is last)
    summary = json.loads(out[out.rindex('{\n  "engine"'):])
    assert rc == 1 and "internal error" not in err
    assert summary["prompts"] == 2 and summary["tokens"] == 900 and summary["chunks_stored"] == 5
    assert [e.split(":")[0] for e in summary["errors"]] == ["line 2", "line 3"]
    assert summary["errors"][0] == ("line 2: 1,500 tokens, more than the engine's max_model_len (1,024); "
                                    "shorten the prompt, or warm up with the server's larger max_model_len "
                                    "in --engine-args")
    assert [r.num_cached_tokens for r in _serve(tiny_model, store)] == [_hits(len(p)) for p in PROMPTS]


# -- command lines and inputs that cannot run: one clear line, exit status 2 ---------------------
@pytest.mark.parametrize("case", ["block size 0", "not UTF-8", "a directory", "no tokenizer", "empty model dir",
                                  "no transformers"])
def test_unusable_inputs_are_one_clear_error_line(tiny_model: Path, tmp_path: Path, case: str,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.cli.main import main

    model, prompts, extra = str(tiny_model), _write(tmp_path / "p.jsonl", [{"prompt_token_ids": PROMPTS[1]}]), []
    if case == "block size 0":
        extra, want = ["--block-size", "0"], "argument --block-size: must be a positive integer"
    elif case == "not UTF-8":
        prompts.write_bytes(json.dumps({"prompt": "ok"}).encode() + b'\n{"prompt": "caf\xe9"}\n')  # Latin-1
        want = f"--prompts: {prompts}: line 2 is not UTF-8 text (byte 0xe9 at column 16); save the prompts file as UTF-8"
    elif case == "a directory":
        prompts, want = tmp_path, f"--prompts: {tmp_path}: is a directory; pass a JSON Lines file"
    elif case == "no tokenizer":  # the tiny model has none: text prompts cannot be tokenized
        _write(prompts, [{"prompt": "some text"}])
        want = "the model directory has no tokenizer transformers can load ("
        extra = ["--config", json.dumps({"path": str(tmp_path / "store")})]
    elif case == "no transformers":  # not a dependency of kvtier: the engine says what to install
        monkeypatch.setitem(sys.modules, "transformers", None)
        want = "the transformers engine needs the transformers package: pip install transformers"
    else:
        (tmp_path / "empty").mkdir()
        model, want = str(tmp_path / "empty"), "not a Hugging Face model directory transformers can read ("
    rc = main(["warmup", "--model", model, "--prompts", str(prompts), "--engine", "transformers", *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    [line] = err.strip().splitlines()
    assert line.startswith("kvtier: error: ") and want in line, line
    assert "internal error" not in line and "Traceback" not in err
    if case == "no tokenizer":
        assert line.endswith("give the prompts as prompt_token_ids instead, or add the tokenizer files")
    if case == "empty model dir":
        assert line.endswith("pass the directory the server loads (with its config.json and weights)")


@pytest.mark.parametrize("case", ["missing model dir", "model dir without config.json", "no usable prompt"])
def test_a_vllm_warmup_refuses_what_cannot_run_before_its_engine_starts(
        tiny_model: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM took a missing directory for a hub id (a message about repo ids) and an empty
    one for a bug ("internal error: ValidationError"), after seconds of starting, and
    started an engine for a file of bad lines only. Now: one line, status 2, no engine
    started and no store made."""
    import vllm

    from kvtier.cli.main import main

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("an engine was started")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    store = tmp_path / "store"
    model, prompts = str(tiny_model), _write(tmp_path / "p.jsonl", [{"prompt_token_ids": PROMPTS[1]}])
    if case == "missing model dir":
        model, want = str(tmp_path / "nowhere"), f"{tmp_path / 'nowhere'}: no such directory; pass the directory"
    elif case == "model dir without config.json":
        (tmp_path / "empty").mkdir()
        model, want = str(tmp_path / "empty"), f"{tmp_path / 'empty'}: no config.json in this directory; pass"
    else:
        prompts.write_text("not json\n{}\n")
        want = f"--prompts: {prompts}: no prompt to warm up (2 line(s) skipped, above); fix the file"
    rc = main(["warmup", "--model", model, "--prompts", str(prompts), "--engine", "vllm",
               "--config", json.dumps({"path": str(store)})])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    last = err.strip().splitlines()[-1]  # (after the warnings of skipped lines)
    assert last.startswith("kvtier: error: ") and want in last, last
    assert "Traceback" not in err
    assert not store.exists()
    if case == "no usable prompt":  # the library, given the file: the same refusal, its first bad line
        with pytest.raises(ConfigError, match=r"prompts: none to warm up \(2 line\(s\) skipped, the first: "
                                              r"line 1: .*\); fix the prompts file"):
            warmup(model, prompts, engine="vllm", config={"path": str(store)})
        assert not store.exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompts": 5}, r"prompts=...\): expected the path of a prompts file \(JSON Lines\) or a list of "
                     r"kvtier.warmup.Prompt, got int"),
    ({"prompts": ["hello"]}, r"expected kvtier.warmup.Prompt\(text=...\) or Prompt\(token_ids=\[...\]\) items, got str"),
    ({"prompts": [], "config": ["path"]}, r"warmup\(config=...\): expected a dict of settings, got list"),
    ({"prompts": [], "engine_args": "max_model_len=8"}, r"warmup\(engine_args=...\): expected a dict of settings"),
])
def test_library_warmup_arguments_of_the_wrong_type_say_what_to_give(tmp_path: Path, kwargs: dict,
                                                                     message: str) -> None:
    """Before any model is read: a list of strings (not Prompts) and a list for ``config``
    failed deep inside ("cannot convert dictionary update sequence element #0")."""
    with pytest.raises(TypeError, match=message):
        warmup(str(tmp_path / "no-model"), **kwargs)
    assert not any(tmp_path.iterdir())  # nothing was created
    with pytest.raises(ValueError, match="Prompt: cache_salt must be a non-empty string, got 5"):
        Prompt(token_ids=[1, 2], cache_salt=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Prompt: text must be a non-empty string, got ''"):
        Prompt(text="")
