"""A real vLLM engine reuses KV across a restart, with output identical to no cache at all."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.backends.index import NO_KEY
from kvtier.keys import as_token_array, chain_seed, chunk_keys
from kvtier.testing.engine import Engine, kv_transfer_config, observe

SYSTEM = tokens(512, seed=1)
PROMPTS = [SYSTEM + tokens(120, seed=2), tokens(700, seed=3)]


@pytest.mark.both_schedulings
def test_restart_hits_and_identical_tokens_and_logprobs(tiny_model: Path, store_dir: Path) -> None:
    """Bit-identical logprobs need an identical schedule: CPU matmuls give slightly different
    results for different batch sizes, and an asynchronous load that finishes a step later
    for one request decodes it alone. Synchronous loads keep the no-cache schedule; the
    asynchronous path is checked token for token by the other tests."""
    with Engine(tiny_model) as e:
        base = e.generate(PROMPTS, max_tokens=12, logprobs=True)
    sync = {"load_async": False}
    with Engine(tiny_model, kv_transfer_config(store_dir, **sync)) as e:  # engine A, fresh store
        first = e.generate(PROMPTS, max_tokens=12, logprobs=True)
        e.worker_connector._store.flush()
    assert [r.num_cached_tokens for r in first] == [0, 0]
    with Engine(tiny_model, kv_transfer_config(store_dir, **sync)) as e:  # engine B, "after a restart"
        second = e.generate(PROMPTS, max_tokens=12, logprobs=True)
        stats = e.worker_connector._store.counters.snapshot()
    # Everything block-aligned short of the last prompt token comes from the store.
    assert [r.num_cached_tokens for r in second] == [(len(p) - 1) // 32 * 32 for p in PROMPTS]
    assert stats["hits_disk"] >= 4 and stats["corrupt_records"] == 0
    for b, f, s in zip(base, first, second, strict=True):
        assert b.tokens == f.tokens == s.tokens
        assert b.logprobs == f.logprobs == s.logprobs


def test_shared_system_prompt_hits_exactly_the_shared_part(tiny_model: Path, store_dir: Path) -> None:
    """Also: while the loads are pending, the engine's steps that run no forward pass tell
    the worker so (``idle``: only those wait briefly for the readers), and the steps that
    run one do not. Copies here move every layer of a chunk at once (``device_copy_bytes``,
    grouped as on a GPU), in both engines."""
    grouped = {"device_copy_bytes": "1G"}
    with Engine(tiny_model, kv_transfer_config(store_dir, **grouped)) as e:
        assert e.worker_connector._worker.per_copy == len(e.worker_connector._worker.views) > 1
        e.generate([SYSTEM + tokens(100, seed=10)], max_tokens=2)
        e.worker_connector._store.flush()
    with Engine(tiny_model) as e:
        base = e.generate([SYSTEM + tokens(100, seed=11), SYSTEM[:300] + tokens(90, seed=12)], max_tokens=6)
    with Engine(tiny_model, kv_transfer_config(store_dir, **grouped)) as e:
        flags: list[bool] = []  # get_finished's idle, step by step
        observe(e.worker_connector._worker, "get_finished", lambda _, *a, idle=True, **k: flags.append(idle))
        got = e.generate([SYSTEM + tokens(100, seed=11), SYSTEM[:300] + tokens(90, seed=12)], max_tokens=6)
    assert True in flags and False in flags, flags
    # The shared 512-token system prompt is two 256-token chunks; the suffix differs.
    assert got[0].num_cached_tokens == 512
    # Only the first chunk (256 tokens) is shared when the prompts diverge at 300.
    assert got[1].num_cached_tokens == 256
    assert [r.tokens for r in got] == [r.tokens for r in base]


def test_registered_by_name_through_the_plugin(tiny_model: Path, store_dir: Path) -> None:
    """``{"kv_connector": "KVTierConnector"}`` works with no module path (entry point)."""
    p = tokens(400, seed=20)
    for expect in (0, 384):
        with Engine(tiny_model, kv_transfer_config(store_dir, by_name=True)) as e:
            r = e.generate([p], max_tokens=2)[0]
            e.worker_connector._store.flush()
        assert r.num_cached_tokens == expect


def test_lmdb_backend_restart(tiny_model: Path, store_dir: Path) -> None:
    """The other backend (the tests above use the default, files) through a real restart."""
    p = tokens(600, seed=30)
    with Engine(tiny_model) as e:
        base = e.generate([p], max_tokens=8)[0]
    outs = []
    for _ in range(2):
        with Engine(tiny_model, kv_transfer_config(store_dir, backend="lmdb")) as e:
            outs.append(e.generate([p], max_tokens=8)[0])
            e.worker_connector._store.flush()
    assert [o.num_cached_tokens for o in outs] == [0, 576]
    assert outs[0].tokens == outs[1].tokens == base.tokens
    assert store_dir.joinpath("lmdb", "data.mdb").stat().st_size > 0 and not store_dir.joinpath("files").exists()
    shutil.rmtree(store_dir)


def _leased(e: Engine, settle_s: float = 5.0) -> int:
    """Entries still leased, once the scheduler's releases (on their own thread) had up to
    ``settle_s`` to land."""
    deadline = time.monotonic() + settle_s
    while True:
        now = time.time_ns()
        n = sum(1 for x in e.worker_connector._store.backend.entries() if x.lease_until_ns > now)
        if not n or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def test_a_loads_lease_ends_when_the_load_is_done(tiny_model: Path, store_dir: Path) -> None:
    """A hit leases the chunks promised to its load so that no process evicts them before
    they are read; once read, the lease ends (it used to hold for 120 s, the request's end
    and the server's exit included, so eviction took freshly saved chunks instead)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = tokens(600, seed=40)
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        e.generate([p], max_tokens=2)
        e.worker_connector._store.flush()
    for load_async in (True, False):
        with Engine(tiny_model, kv_transfer_config(store_dir, load_async=load_async)) as e:
            engine = e.llm.llm_engine
            engine.add_request("r", TokensPrompt(prompt_token_ids=p),
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False))
            steps = 0
            while not any(len(o.outputs[0].token_ids) >= 4 for o in engine.step()):
                steps += 1
                assert steps < 40
            # the load is done, the request still decoding: nothing is leased any more
            assert e.scheduler_connector._sched.hit_tokens == 576
            assert _leased(e) == 0, f"load_async={load_async}: a finished load still holds its lease"
            engine.abort_request(["r"])
            e.generate([tokens(300, seed=41)], max_tokens=1)  # ends with a lookup, a miss
            assert _leased(e) == 0


def test_two_requests_loading_one_prompt_leave_nothing_leased(tiny_model: Path, store_dir: Path) -> None:
    """Two requests for one cached prompt, scheduled together, each lease its chunks for
    their loads: once both loads are done, nothing is leased (when the first to lease
    finished first, the chunks stayed leased until its lease's end, up to 120 s)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = tokens(600, seed=42)
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        e.generate([p], max_tokens=2)
        e.worker_connector._store.flush()
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        engine = e.llm.llm_engine
        store = e.scheduler_connector._sched.store
        taken, lease = [], store.lease

        def counted(keys: list[bytes], seconds: float) -> dict:  # (calls the real lease)
            held = lease(keys, seconds)
            taken.append(held)
            return held

        store.lease = counted
        for rid in ("a", "b"):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p),
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False))
        steps = 0
        while True:
            outs = engine.step()
            if sum(len(o.outputs[0].token_ids) >= 4 for o in outs) == 2:
                break
            steps += 1
            assert steps < 60
        assert len(taken) == 2 and all(taken), "both requests were to load from the store"
        assert _leased(e) == 0, "two finished loads of one prompt still hold a lease"
        engine.abort_request(["a", "b"])


def test_a_restart_with_a_larger_block_size_loads_the_tails_saved_before(tiny_model: Path, store_dir: Path) -> None:
    """A prompt's trailing partial chunk is saved rounded down to the saving server's block
    size. After a restart at a larger block size, the lookup finds that tail (it tries every
    16 tokens) and loads the whole blocks it holds, with output identical to no cache; no
    second, shorter copy of the tail is saved."""
    prompts = [tokens(255, seed=43), tokens(630, seed=44)]  # tails saved at 32: 224 and 512 + 96
    with Engine(tiny_model, block_size=64) as e:
        base = e.generate(prompts, max_tokens=6)
    with Engine(tiny_model, kv_transfer_config(store_dir), block_size=32) as e:
        e.generate(prompts, max_tokens=2)
        e.worker_connector._store.flush()
        records = e.worker_connector._store.stats()["disk_records"]
    assert records == 4
    with Engine(tiny_model, kv_transfer_config(store_dir), block_size=64) as e:
        got = e.generate(prompts, max_tokens=6)
        e.worker_connector._store.flush()
        after = e.worker_connector._store.stats()
    # what the blocks of 64 hold, short of the last prompt token (before: 0 and 512)
    assert [r.num_cached_tokens for r in got] == [192, 576]
    assert [r.tokens for r in got] == [r.tokens for r in base]
    assert after["disk_records"] == records and after["corrupt_records"] == 0
    # Every record damaged: the synchronous loads fail, vLLM recomputes, and the server saves
    # its own tails after all, since the longer ones that held their KV are gone.
    for rec in store_dir.joinpath("files").rglob("*.kvt"):
        data = bytearray(rec.read_bytes())
        data[-7] ^= 0x01
        rec.write_bytes(bytes(data))
    with Engine(tiny_model, kv_transfer_config(store_dir, load_async=False), block_size=64) as e:
        assert [r.tokens for r in e.generate(prompts, max_tokens=6)] == [r.tokens for r in base]
        assert e.worker_connector._store.counters.snapshot()["corrupt_records"] >= 2
    with Engine(tiny_model, kv_transfer_config(store_dir), block_size=64) as e:
        assert [r.num_cached_tokens for r in e.generate(prompts, max_tokens=6)] == [192, 576]


@pytest.mark.both_schedulings
def test_the_next_turn_of_a_conversation_loads_the_previous_answer(tiny_model: Path, store_dir: Path) -> None:
    """With ``save_decode_chunks``, the full chunks a request's output completes are saved
    too: the next turn, whose prompt repeats the answer, loads them after a restart, with
    output identical to no cache (only the prompt's chunks and tail were saved before)."""
    turn1 = [tokens(300, seed=50), tokens(100, seed=52)]  # the second is shorter than a chunk
    with Engine(tiny_model) as e:
        answers = [r.tokens for r in e.generate(turn1, max_tokens=260)]
        turn2 = [t + a + tokens(40, seed=51) for t, a in zip(turn1, answers, strict=True)]  # 600 and 400 tokens
        base = e.generate(turn2, max_tokens=6)
    decode = {"save_decode_chunks": True}
    with Engine(tiny_model, kv_transfer_config(store_dir, **decode)) as e:
        assert [r.tokens for r in e.generate(turn1, max_tokens=260)] == answers
        e.worker_connector._store.flush()
        # the first: its chunk, its 32-token tail, and [256, 512) (44 prompt and 212 answer
        # tokens); the second: its 96-token tail and [0, 256) (100 prompt and 156 answer tokens)
        assert e.worker_connector._store.stats()["disk_records"] == 5
        seed = chain_seed(e.scheduler_connector._sched.namespaces[0])
        stored = {x.key: (x.token_start, x.num_tokens, x.parent, x.head) for x in e.worker_connector._store.backend.entries()}
    # keyed and chained as a prompt holding those tokens: the answer's chunk extends the
    # prompt's full chunk (not its tail), in the chain that chunk heads
    one, two = (chunk_keys(as_token_array(t + a), seed, 256, None) for t, a in zip(turn1, answers, strict=True))
    tail1, tail2 = (chunk_keys(as_token_array(t), seed, 256, 32)[-1] for t in turn1)
    assert stored == {one[0].key: (0, 256, NO_KEY, one[0].key), one[1].key: (256, 256, one[0].key, one[0].key),
                      tail1.key: (256, 32, one[0].key, one[0].key), two[0].key: (0, 256, NO_KEY, two[0].key),
                      tail2.key: (0, 96, NO_KEY, tail2.key)}
    with Engine(tiny_model, kv_transfer_config(store_dir, **decode)) as e:  # the first turn again
        assert [r.tokens for r in e.generate(turn1, max_tokens=260)] == answers
        assert e.worker_connector._store.stats()["saves_queued"] == 0  # its answers' chunks are stored
    with Engine(tiny_model, kv_transfer_config(store_dir, **decode)) as e:
        got = e.generate(turn2, max_tokens=6)
    assert [r.num_cached_tokens for r in got] == [512, 256]  # 288 and 96 without the answers' chunks
    assert [r.tokens for r in got] == [r.tokens for r in base]
