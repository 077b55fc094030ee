"""Tensor parallelism: each rank stores its own heads; a hit needs every rank's chunk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from enginehelpers import tokens

from kvtier import CacheConfig, ChunkStore, Namespace
from kvtier.keys import as_token_array, chain_seed, chunk_keys
from kvtier.store_view import StoreView
from kvtier.vllm.identity import LoraFingerprints
from kvtier.vllm.scheduler_side import SchedulerSide

HERE = Path(__file__).parent


def _run_tp(model: Path, store: str, prompts_file: Path, **extra: object) -> list[list]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    r = subprocess.run([sys.executable, str(HERE / "_tp_engine.py"), str(model), store, str(prompts_file),
                        json.dumps(extra)], capture_output=True, text=True, env=env, timeout=400)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    assert "checking the other ranks' loads failed" not in r.stderr + r.stdout
    return json.loads(lines[-1][len("RESULT "):])


def test_tp2_engine_saves_per_rank_and_hits_after_restart(tiny_model: Path, tmp_path: Path) -> None:
    prompts = [tokens(600, seed=100), tokens(300, seed=101)]
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(prompts))
    store = tmp_path / "store"
    first = _run_tp(tiny_model, str(store), pf)
    # Each rank registered its own namespace (its own heads).
    with ChunkStore(CacheConfig(path=store)) as s:
        ranks = sorted(d["tp_rank"] for d in s.backend.namespaces().values())
        records, _ = s.backend.usage()
    assert ranks == [0, 1]
    assert records >= 2 * 3
    # synchronous loads: each rank then tells the others whether its load failed (a step's
    # forward pass over a rank's unfilled blocks spoils every rank's KV), here that none did
    second = _run_tp(tiny_model, str(store), pf, load_async=False)
    assert [c for _, c in first] == [0, 0]
    assert [c for _, c in second] == [576, 288]
    assert [t for t, _ in first] == [t for t, _ in second]


def _namespaces() -> list[Namespace]:
    return [Namespace(model="m", weights_fingerprint="w", dtype="bfloat16", kv_shape=(2, 2, 1, 32),
                      chunk_tokens=64, tp_rank=r, tp_size=2) for r in range(2)]


def test_hit_requires_every_ranks_chunk(tmp_path: Path) -> None:
    """The scheduler side promises only the prefix that every rank has stored."""
    nss = _namespaces()
    prompt = tokens(300, seed=5)
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64, host_bytes=0))
    arr = as_token_array(prompt)
    refs = [chunk_keys(arr, chain_seed(ns), 64, None) for ns in nss]
    kv = torch.zeros(2, 2, 64, 1, 32, dtype=torch.bfloat16)
    for i in range(4):  # rank 0 has 4 chunks, rank 1 only 2
        store.put(refs[0][i].key, kv.clone(), namespace_id=nss[0].id, token_start=i * 64, num_tokens=64)
    for i in range(2):
        store.put(refs[1][i].key, kv.clone(), namespace_id=nss[1].id, token_start=i * 64, num_tokens=64)
    store.flush()
    view = StoreView(store.config)  # what the scheduler side reads: the store's shared index
    side = SchedulerSide(view, nss, 32, LoraFingerprints(None), can_load=True, can_save=True, save_partial=False)
    req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, cache_salt=None, lora_request=None,
                          mm_features=[], prompt_embeds=None)
    assert side.get_num_new_matched_tokens(req, 0) == (128, True)
    single = SchedulerSide(view, nss[:1], 32, LoraFingerprints(None), can_load=True, can_save=True, save_partial=False)
    assert single.get_num_new_matched_tokens(req, 0) == (256, True)
    view.close()
    store.close()


def test_a_waiting_requests_tail_lengths_are_hashed_once(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """vLLM asks about a waiting request every step; the tail lengths a lookup tries (up to
    chunk_tokens / 16 hashes per rank) are kept with the request, and a tail stored on every
    rank is found among them."""
    import kvtier.vllm.scheduler_side as scheduler_side

    nss = _namespaces()
    prompt = tokens(150, seed=6)  # two full chunks of 64, then 22 tokens: tails of 16 tried
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64, host_bytes=0))
    arr = as_token_array(prompt)
    kv = torch.zeros(2, 2, 64, 1, 32, dtype=torch.bfloat16)
    for ns in nss:
        refs = chunk_keys(arr, chain_seed(ns), 64, 16)  # (a server at block size 16 saved it)
        for ref in refs:
            store.put(ref.key, kv.narrow(2, 0, ref.num_tokens).clone(), namespace_id=ns.id,
                      token_start=ref.start, num_tokens=ref.num_tokens)
    store.flush()
    hashed = []
    real = scheduler_side.tail_candidates
    monkeypatch.setattr(scheduler_side, "tail_candidates", lambda *a: hashed.append(a[2]) or real(*a))
    view = StoreView(store.config)
    side = SchedulerSide(view, nss, 16, LoraFingerprints(None), can_load=True, can_save=True, save_partial=True)
    req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, cache_salt=None, lora_request=None,
                          mm_features=[], prompt_embeds=None)
    for _ in range(3):  # the full chunks and the 16-token tail
        assert side.get_num_new_matched_tokens(req, 0) == (144, True)
    assert hashed == [128]
    view.close()
    store.close()


def test_a_consumer_reports_a_use_of_a_longer_tail_its_own_cache_served(tmp_path: Path) -> None:
    """A consumer saves nothing, so what vLLM's own prefix cache served is reported as a use
    (for the store's LRU): a tail saved at a smaller block size counts once the blocks it
    fills are served, though it ends inside a block (it went unreported and aged out)."""
    nss = _namespaces()
    prompt = tokens(124, seed=8)  # a full chunk of 64, then a tail of 60: saved as 48 at block size 16
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64, host_bytes=0))
    kv = torch.zeros(2, 2, 64, 1, 32, dtype=torch.bfloat16)
    refs = [chunk_keys(as_token_array(prompt), chain_seed(ns), 64, 16) for ns in nss]
    for ns, rank_refs in zip(nss, refs, strict=True):
        for ref in rank_refs:
            store.put(ref.key, kv.narrow(2, 0, ref.num_tokens).clone(), namespace_id=ns.id,
                      token_start=ref.start, num_tokens=ref.num_tokens)
    store.flush()
    view = StoreView(store.config)
    side = SchedulerSide(view, nss, 32, LoraFingerprints(None), can_load=True, can_save=False, save_partial=True)
    req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, cache_salt=None, lora_request=None,
                          mm_features=[], prompt_embeds=None)
    assert side.get_num_new_matched_tokens(req, 96) == (0, False)  # vLLM's cache held [0, 96): nothing to load
    chunk, tail = (tuple(r[i].key for r in refs) for i in (0, 1))
    from vllm.v1.core.sched.output import SchedulerOutput

    assert side.build_connector_meta(SchedulerOutput.make_empty()).uses == [chunk, tail]
    view.close()
    store.close()


@pytest.mark.parametrize("resumable", [False, True])
def test_a_streaming_session_is_cached_by_its_first_prompt_only(tmp_path: Path, resumable: bool) -> None:
    """vLLM's streaming input (a realtime session) reuses one request id for every input
    chunk: later turns append prompt tokens, with audio or images, that the keys made at the
    first turn do not cover. With save_decode_chunks they were taken for output, keyed from
    token ids alone (an audio placeholder is the same id for any audio), and loaded: a
    session could get another's KV. (A request that is not resumable still matches its
    output: a preempted one resumes with the answer it had.)"""
    ns = _namespaces()[:1]
    first = tokens(128, seed=9)
    later = first + tokens(128, seed=10)  # the next turn's tokens, appended to the session
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64, host_bytes=0))
    kv = torch.zeros(2, 2, 64, 1, 32, dtype=torch.bfloat16)
    for ref in chunk_keys(as_token_array(later), chain_seed(ns[0]), 64, None):  # what was saved of it
        store.put(ref.key, kv.clone(), namespace_id=ns[0].id, token_start=ref.start, num_tokens=64)
    assert store.flush(30)
    view = StoreView(store.config)
    side = SchedulerSide(view, ns, 32, LoraFingerprints(None), can_load=True, can_save=True, save_partial=False,
                         save_decode=True)
    req = SimpleNamespace(request_id="r", prompt_token_ids=first, cache_salt=None, lora_request=None,
                          mm_features=[], prompt_embeds=None, resumable=resumable, all_token_ids=list(first))
    assert side.get_num_new_matched_tokens(req, 0)[0] == 96  # the first prompt, less its last block
    req.all_token_ids = list(later)  # the session's next turn (or, not resumable, an answer so far)
    assert side.get_num_new_matched_tokens(req, 0)[0] == (96 if resumable else 224)
    view.close()
    store.close()
