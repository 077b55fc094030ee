"""Roles, concurrent batches, chunked prefill and preemption on a real engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from enginehelpers import tokens

from kvtier.testing.engine import Engine, kv_transfer_config, observe

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvtier import ChunkStore
    from kvtier.store_view import StoreView
    from kvtier.vllm.scheduler_side import SchedulerSide


def test_producer_then_consumer_share_a_store(tiny_model: Path, store_dir: Path) -> None:
    p = tokens(600, seed=60)
    with Engine(tiny_model) as e:
        base = e.generate([p], max_tokens=6)[0]
    with Engine(tiny_model, kv_transfer_config(store_dir, role="kv_producer")) as e:
        prod = e.generate([p, p], max_tokens=6)
        assert e.scheduler_connector._sched.hit_tokens == 0  # a producer never loads
    with Engine(tiny_model, kv_transfer_config(store_dir, role="kv_consumer")) as e:
        cons = e.generate([p], max_tokens=6)[0]
        consumer_saves = e.worker_connector._store.counters.snapshot()["saves_queued"]
    assert cons.num_cached_tokens == 576
    assert consumer_saves == 0  # a consumer never saves
    assert prod[0].tokens == cons.tokens == base.tokens


def test_a_producer_skips_stored_chunks_without_reading_the_index_on_the_models_thread(
        tiny_model: Path, store_dir: Path) -> None:
    """A prompt stored already is not written again (a warm-up run twice, say). Its
    scheduler's lookup says so: the worker reads no index, where a cold page would hold up
    the forward pass."""
    p = tokens(600, seed=61)
    ktc = kv_transfer_config(store_dir, role="kv_producer")
    with Engine(tiny_model, ktc) as e:
        e.generate([p], max_tokens=1)
        assert e.worker_connector._store.flush(30)
    with Engine(tiny_model, ktc) as e:
        store = e.worker_connector._store

        def no_index_read(*args: object) -> None:
            raise AssertionError("the model's thread read the index")

        store.backend.present_each = no_index_read
        e.generate([p], max_tokens=1)
        assert store.counters.snapshot()["saves_queued"] == 0


def _assert_no_leaks(e: Engine) -> None:
    sched = e.scheduler
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but vLLM's null block
    side = e.scheduler_connector._sched
    assert not side._reqs and not side._plans and not side._loads
    worker = e.worker_connector._worker
    assert not worker._loads and not worker._staged


def test_concurrent_partial_overlaps_and_early_finishes(tiny_model: Path, store_dir: Path) -> None:
    shared = tokens(512, seed=70)
    prompts = [shared + tokens(40 * i + 10, seed=71 + i) for i in range(6)]
    prompts += [shared[:256] + tokens(300, seed=80), tokens(330, seed=81)]
    # max_tokens=1 finishes requests in the very step their chunks are saved.
    lengths = [1, 5, 1, 9, 1, 3, 1, 7]
    with Engine(tiny_model) as e:
        base = [e.generate([p], max_tokens=n)[0].tokens for p, n in zip(prompts, lengths, strict=True)]
    cfg = kv_transfer_config(store_dir)
    for run in range(2):
        with Engine(tiny_model, cfg) as e:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                      for n in lengths]
            outs = e.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                  use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == base
            if run == 1:
                assert all(o.num_cached_tokens >= 256 for o in outs[:7])
            _assert_no_leaks(e)


def test_long_prompt_chunked_prefill_and_preemption(tiny_model: Path, store_dir: Path) -> None:
    """Prompts prefilled over several steps and requests preempted for lack of KV blocks."""
    prompts = [tokens(1500, seed=90 + i) for i in range(4)]
    # float32: an asynchronous load makes the schedule depend on timing, and bf16 matmuls give
    # (slightly) different results for different batch compositions, which flipped a greedy
    # token after ~40 steps; in float32 the output is schedule-independent, so any difference
    # is a KV error. The memory is sized (same block count as bf16 at 1.5 MiB) to force preemption.
    opts = {"max_num_batched_tokens": 512, "kv_cache_memory_bytes": 3 << 20, "max_model_len": 2048,
            "max_num_seqs": 4, "dtype": "float32"}
    with Engine(tiny_model, **opts) as e:
        base = [r.tokens for r in e.generate(prompts, max_tokens=100)]
    cfg = kv_transfer_config(store_dir)
    with Engine(tiny_model, cfg, **opts) as e:
        preemptions: list[str] = []
        observe(e.scheduler, "_preempt_request", lambda _, request, *a, **k: preemptions.append(request.request_id))
        first = e.generate(prompts, max_tokens=100)
        _assert_no_leaks(e)
    assert preemptions, "the KV memory was meant to be small enough to force preemption"
    assert [r.tokens for r in first] == base
    with Engine(tiny_model, cfg, **opts) as e:
        second = e.generate(prompts, max_tokens=100)
        _assert_no_leaks(e)
    assert [r.tokens for r in second] == base
    assert [r.num_cached_tokens for r in second] == [1472] * 4


def test_a_prefix_served_by_vllms_own_cache_stays_recent_in_the_store(tiny_model: Path, store_dir: Path) -> None:
    """A hot prefix lives in vLLM's own prefix cache while the server runs, so it is never
    loaded from the store. Its uses must still count for the store's LRU: otherwise it is
    the first thing evicted (and saved again from vLLM's cache, over and over), and after a
    restart the hottest prefix misses."""
    hot = tokens(3 * 256 + 40, seed=70)
    ktc = kv_transfer_config(store_dir, disk_bytes="2M")  # about 15 chunks of this model
    with Engine(tiny_model, ktc) as e:
        e.generate([hot], max_tokens=1)
        store = e.worker_connector._store
        assert store.flush(30)
        first = {x.key: x.location for x in store.backend.entries()}  # hot's records
        for i in range(6):
            e.generate([tokens(768, seed=71 + i)], max_tokens=1)  # new chunks: evictions
            assert e.generate([hot], max_tokens=1)[0].num_cached_tokens >= 768  # vLLM's cache
            assert store.flush(30)
        assert store.stats()["evicted_disk"] >= 6
        # never evicted: the very records first written are still there
        assert {k: store.backend.lookup(k).location for k in first if store.backend.lookup(k)} == first
    with Engine(tiny_model, ktc) as e:  # "after a restart"
        assert e.generate([hot], max_tokens=1)[0].num_cached_tokens >= 768


def test_an_engine_that_only_loads_counts_its_own_cache_hits_as_uses(tiny_model: Path, store_dir: Path) -> None:
    """A ``kv_consumer`` (a read-only replica) never saves, so no skipped save says that a
    prefix its vLLM cache served was used: the scheduler passes those uses to the worker,
    and the store's LRU sees them."""
    import time

    from kvtier import CacheConfig, ChunkStore

    hot = tokens(3 * 256 + 40, seed=80)
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        e.generate([hot], max_tokens=1)
        assert e.worker_connector._store.flush(30)
    with Engine(tiny_model, kv_transfer_config(store_dir, role="kv_consumer")) as e:
        assert e.generate([hot], max_tokens=1)[0].num_cached_tokens >= 768  # loaded: a use
        time.sleep(1.2)
        between = time.time_ns()
        assert e.generate([hot], max_tokens=1)[0].num_cached_tokens >= 768  # vLLM's own cache
    with ChunkStore(CacheConfig(path=store_dir)) as store:
        stamps = [x.atime_ns for x in store.backend.entries()]
    assert len(stamps) >= 3 and min(stamps) >= between, (stamps, between)


def test_a_preempted_request_resumed_as_new_plans_the_saves_it_recomputes(store_dir: Path) -> None:
    """vLLM's model runner V2 (its default on GPUs, not run on the CPU) hands a preempted
    request back as a new one. The chunks it recomputes from where its cache ends are
    planned again (the worker skips those stored or queued), so a save dropped before the
    preemption is made up for. vLLM's own request and scheduler-output records; only the
    output's container is a plain object."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.request import Request

    from kvtier import CacheConfig, Namespace
    from kvtier.store_view import StoreView
    from kvtier.vllm.identity import LoraFingerprints
    from kvtier.vllm.scheduler_side import SchedulerSide

    ns = Namespace(model="m", weights_fingerprint="sha256:00", dtype="bfloat16", kv_shape=(2, 2, 2, 32),
                   chunk_tokens=256)
    view = StoreView(CacheConfig(path=store_dir))
    try:
        sched = SchedulerSide(view, [ns], 32, LoraFingerprints(None), can_load=True, can_save=True,
                              save_partial=False)
        req = Request("r", tokens(600, seed=90), SamplingParams(max_tokens=1), None)
        sched.on_new_request(req)

        def step(computed: int, scheduled: int) -> list[int]:
            new = NewRequestData.from_request(req, (list(range(19)),))
            new.num_computed_tokens = computed
            so = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"r": scheduled},
                                 scheduled_cached_reqs=CachedRequestData.make_empty(), preempted_req_ids=None)
            return [s.token_start for s in sched.build_connector_meta(so).saves]

        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert step(0, 600) == [0, 256]
        # preempted; vLLM's own cache kept the first 256 tokens: it resumes as a new request
        assert step(256, 344) == [256]
    finally:
        view.close()


def _observe(e: Engine) -> tuple[list[str], dict[str, list[int]]]:
    """The requests vLLM preempts, and the tokens kvtier loads for each request (in order),
    observed on the real scheduler without changing what it does."""
    preempted: list[str] = []
    loads: dict[str, list[int]] = {}

    def loading(_: None, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            loads.setdefault(request.request_id, []).append(num_external_tokens)

    observe(e.scheduler, "_preempt_request", lambda _, request, *a, **k: preempted.append(request.request_id))
    observe(e.scheduler_connector._sched, "update_state_after_alloc", loading)
    return preempted, loads


# Two 1000-token prompts answered with 520 tokens each do not fit in this KV memory
# together: one is preempted while it decodes. vLLM's own prefix cache is off, as when the
# blocks a preempted request freed were reused before it resumed: only kvtier has its KV.
# float32: the output does not depend on the schedule (see the preemption test above).
PREEMPTING = {"max_num_batched_tokens": 512, "kv_cache_memory_bytes": 3 << 20, "max_model_len": 2048,
              "max_num_seqs": 2, "dtype": "float32", "enable_prefix_caching": False}


@pytest.mark.both_schedulings
@pytest.mark.parametrize("load_async", [True, False])
def test_a_preempted_request_loads_its_prefix_and_answer_again(tiny_model: Path, store_dir: Path,
                                                               load_async: bool) -> None:
    """A request preempted after its prompt (and, with ``save_decode_chunks``, the chunks its
    answer completed) were saved loads them when it resumes, instead of recomputing them
    all: also when it loaded its prompt before. (It used to get one external load in its
    life, and to look up its prompt only.) A synchronous load of a resumed request runs in
    the step that resumes it (vLLM's model runner V1 schedules it with the running ones)."""
    prompts = [tokens(1000, seed=95 + i) for i in range(2)]
    with Engine(tiny_model, **PREEMPTING) as e:
        base = [r.tokens for r in e.generate(prompts, max_tokens=520)]
    cfg = kv_transfer_config(store_dir, save_decode_chunks=True, load_async=load_async)
    for first_load in ([], [992]):  # a fresh store; then, after a restart, the prompt is stored
        with Engine(tiny_model, cfg, **PREEMPTING) as e:
            preempted, loads = _observe(e)
            got = e.generate(prompts, max_tokens=520)
            _assert_no_leaks(e)
        assert [r.tokens for r in got] == base
        assert preempted, "the KV memory was meant to be small enough to preempt a request"
        for req_id in preempted:
            # then past the prompt's 3 chunks (768 tokens): the answer's chunks saved before
            assert loads[req_id][:-1] == first_load and loads[req_id][-1] >= 1024, loads
            assert loads[req_id][-1] % 256 == 0


@pytest.mark.both_schedulings
def test_a_request_whose_load_failed_is_not_promised_a_load_again(tiny_model: Path, store_dir: Path) -> None:
    """Every record read fails with an I/O error (the record stays stored). vLLM recomputes
    the blocks and asks the connector again; promising the same chunks again would fail
    the same way, for ever. Each request is promised one load, and the output is right."""
    import errno

    prompts = [tokens(700, seed=97 + i) for i in range(2)]
    with Engine(tiny_model) as e:
        base = [r.tokens for r in e.generate(prompts, max_tokens=8)]
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        e.generate(prompts, max_tokens=8)
        assert e.worker_connector._store.flush(30)
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        backend = e.worker_connector._store.backend

        def failing_read(entry, fn):
            raise OSError(errno.EIO, "Input/output error (injected)")

        backend.read_record = failing_read
        side = e.scheduler_connector._sched
        asked = side.get_num_new_matched_tokens
        promised: dict[str, int] = {}

        def counting_ask(request, num_computed_tokens):
            if promised.get(request.request_id, 0) >= 3:  # (the bug: a loop; end it, and fail below)
                return 0, False
            n, is_async = asked(request, num_computed_tokens)
            if n:
                promised[request.request_id] = promised.get(request.request_id, 0) + 1
            return n, is_async

        side.get_num_new_matched_tokens = counting_ask
        got = e.generate(prompts, max_tokens=8)
        stats = e.worker_connector._store.counters.snapshot()
        _assert_no_leaks(e)
    assert [r.tokens for r in got] == base
    assert stats["io_errors"] >= 2 and stats["corrupt_records"] == 0
    assert sorted(promised.values()) == [1, 1], promised


def _side_on_a_store(tmp_path: Path, load_async: bool,
                            ) -> tuple[SchedulerSide, StoreView, ChunkStore, dict[str, Any]]:
    """A scheduler side on a real store holding two 200-token prompts' chunks (64 tokens
    each), its view, the store, and the two requests (the fields of vLLM's request that
    kvtier reads)."""
    from types import SimpleNamespace

    import torch

    from kvtier import CacheConfig, ChunkStore, Namespace
    from kvtier.keys import as_token_array, chain_seed, chunk_keys
    from kvtier.store_view import StoreView
    from kvtier.vllm.identity import LoraFingerprints
    from kvtier.vllm.scheduler_side import SchedulerSide

    ns = Namespace(model="m", weights_fingerprint="w", dtype="bfloat16", kv_shape=(2, 2, 1, 32), chunk_tokens=64)
    prompts = {"a": tokens(200, seed=9), "b": tokens(200, seed=10)}
    kv = torch.zeros(2, 2, 64, 1, 32, dtype=torch.bfloat16)
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64, host_bytes=0))
    for prompt in prompts.values():
        for ref in chunk_keys(as_token_array(prompt), chain_seed(ns), 64, None):
            store.put(ref.key, kv.clone(), namespace_id=ns.id, token_start=ref.start, num_tokens=64)
    assert store.flush(10)
    view = StoreView(store.config)
    side = SchedulerSide(view, [ns], 32, LoraFingerprints(None), can_load=True, can_save=True,
                         save_partial=False, load_async=load_async)
    reqs = {k: SimpleNamespace(request_id=k, prompt_token_ids=p, cache_salt=None, lora_request=None,
                               mm_features=[], prompt_embeds=None) for k, p in prompts.items()}
    return side, view, store, reqs


def _step(cached: tuple[str, ...] = (), resumed: tuple[str, ...] = (),
          preempted: tuple[str, ...] = ()) -> SchedulerOutput:
    """vLLM's scheduler output for a step that runs ``cached`` requests (``resumed`` among them,
    with blocks 0-6) and preempts ``preempted``."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    ids = list(cached)
    so.scheduled_cached_reqs = CachedRequestData(
        req_ids=ids, resumed_req_ids=set(resumed), new_token_ids=[[] for _ in ids], all_token_ids={},
        new_block_ids=[(list(range(7)),) if r in resumed else None for r in ids],
        num_computed_tokens=[192] * len(ids), num_output_tokens=[1] * len(ids))
    so.num_scheduled_tokens = {r: 1 for r in ids}
    so.preempted_req_ids = set(preempted)
    return so


BLOCKS_0_TO_6 = type("Blocks", (), {"get_block_ids": lambda self: (list(range(7)),)})()


def test_a_failed_load_marks_only_the_request_whose_blocks_it_filled(tmp_path: Path) -> None:
    """vLLM reports failed loads as block ids, and a block is reused once a load is over: a
    request whose load finished is not blamed for a later load that fails in its old blocks
    (it still loads when it resumes), and the request whose load did fail is not promised
    one again."""
    side, view, store, reqs = _side_on_a_store(tmp_path, load_async=True)
    try:
        assert side.get_num_new_matched_tokens(reqs["a"], 0) == (192, True)
        side.update_state_after_alloc(reqs["a"], BLOCKS_0_TO_6, 192)
        side.loads_finished(["a"])  # a's load is over: its blocks may go to b
        assert side.get_num_new_matched_tokens(reqs["b"], 0) == (192, True)
        side.update_state_after_alloc(reqs["b"], BLOCKS_0_TO_6, 192)
        side.loads_failed({3})
        side.loads_finished(["b"])
        assert side.get_num_new_matched_tokens(reqs["a"], 0) == (192, True)  # a, preempted, loads again
        assert side.get_num_new_matched_tokens(reqs["b"], 0) == (0, False)  # b recomputes
    finally:
        view.close()
        store.close()


def test_a_resumed_requests_failed_synchronous_load_is_told_under_asynchronous_scheduling(tmp_path: Path) -> None:
    """vLLM's model runner V1 schedules a resumed request through its cached requests, in the
    very step that runs its synchronous load; with asynchronous scheduling that step's
    output (the failed blocks) comes after the next step is planned. The failure must still
    find the load's blocks."""
    side, view, store, reqs = _side_on_a_store(tmp_path, load_async=False)
    try:
        assert side.get_num_new_matched_tokens(reqs["a"], 0) == (192, False)
        side.update_state_after_alloc(reqs["a"], BLOCKS_0_TO_6, 192)
        side.build_connector_meta(_step(cached=("a",), resumed=("a",)))  # step N: the load runs
        side.build_connector_meta(_step(cached=("a",)))  # step N+1, planned before N's output
        side.loads_failed({2})  # step N's output
        assert side.get_num_new_matched_tokens(reqs["a"], 0) == (0, False)
    finally:
        view.close()
        store.close()


def test_a_request_preempted_after_its_synchronous_load_is_not_blamed_for_the_next_one(tmp_path: Path) -> None:
    """A request preempted right after its synchronous load frees its blocks, and another
    request's load may fill them in the same step: that load's failure is not the
    preempted request's, which loads again when it resumes."""
    side, view, store, reqs = _side_on_a_store(tmp_path, load_async=False)
    try:
        side.get_num_new_matched_tokens(reqs["a"], 0)
        side.update_state_after_alloc(reqs["a"], BLOCKS_0_TO_6, 192)
        side.build_connector_meta(_step(cached=("a",), resumed=("a",)))  # step N: a's load
        side.loads_failed(set())
        assert side.get_num_new_matched_tokens(reqs["b"], 0) == (192, False)
        side.update_state_after_alloc(reqs["b"], BLOCKS_0_TO_6, 192)  # a's freed blocks
        side.build_connector_meta(_step(cached=("b",), resumed=("b",), preempted=("a",)))
        side.loads_failed({3})  # b's load failed
        assert side.get_num_new_matched_tokens(reqs["a"], 0) == (192, False)
        assert side.get_num_new_matched_tokens(reqs["b"], 0) == (0, False)
    finally:
        view.close()
        store.close()
