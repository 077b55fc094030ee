"""Scheduler side: prefix lookups, load plans and save plans. Never touches KV bytes.

Keys come from kvtier's own chained hash over the prompt's token ids (never vLLM's
``block_hashes``, whose values depend on vLLM settings). A request's keys are computed once
and kept until it finishes; with ``save_decode``, the keys of the full chunks its output
completes are added as the output's tokens become known. A hit requires every
tensor-parallel rank's chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.backends.index import Lease
from kvtier.keys import (
    Namespace,
    RankedChunk,
    RequestExtras,
    as_token_array,
    chain_seed,
    child_key,
    match_prefix,
    ranked_chunk_keys,
    tail_candidates,
)
from kvtier.store_view import StoreView
from kvtier.vllm.identity import LoraFingerprints
from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec
from kvtier.vllm.namespace import request_extras

log = logging.getLogger("kvtier")
# How long chunks promised to a load stay safe from eviction (by any process). A load
# normally starts within a step or two; a request queued longer than this may find a chunk
# gone, which costs a recompute, never wrong KV.
LOAD_LEASE_S = 120.0


@dataclass
class _Request:
    tokens: np.ndarray  # the prompt's
    extras: RequestExtras
    seeds: tuple[bytes, ...]
    # in the order they are saved (by end): the prompt's full chunks, its partial tail (if
    # saved), then the full chunks its output completes (with save_decode)
    to_save: list[RankedChunk]
    n_full: int  # the prompt's full chunks
    request: Any = None  # vLLM's request, whose token ids grow with its output (save_decode)
    next_save: int = 0
    block_ids: list[int] = field(default_factory=list)
    # a load of this request failed (vLLM reported its blocks invalid): it is not promised
    # again, since a chunk that failed to load may fail again (an I/O error leaves it stored)
    load_failed: bool = False
    # the keys of the chunks the last lookup found stored on every rank: their saves are
    # skipped (the worker then reads no index on the model's thread)
    stored: set[tuple[bytes, ...]] = field(default_factory=set)
    # a longer stored tail that holds the prompt's own tail (saved at a smaller block size)
    tail_held_by: tuple[bytes, ...] = ()
    # the tail lengths the last lookup tried, where they start and the length of the tokens
    # they come from (vLLM asks again each step while a request waits; with 2048-token chunks
    # hashing them costs ~0.5 ms per rank)
    tail_candidates: tuple[tuple[int, int], list[RankedChunk]] | None = None
    # the prompt and output tokens a resumed request's lookups match (with save_decode; kept
    # while it waits: converting a 128k-token list costs ~1.4 ms)
    sequence: np.ndarray | None = None

    @property
    def full(self) -> list[RankedChunk]:
        return self.to_save[: self.n_full]

    def before(self, i: int) -> tuple[bytes, ...] | None:
        """The keys of the full chunk that chunk ``i`` of ``to_save`` extends (None for one
        that starts the sequence): the chunk before it, or, for the first chunk the output
        completes, the one before the prompt's partial tail (which starts where it does)."""
        start = self.to_save[i].start
        if start == 0:
            return None
        prev = self.to_save[i - 1]
        return prev.keys if prev.end == start else self.to_save[i - 2].keys


def _head(st: _Request, chunk: RankedChunk) -> tuple[bytes, ...]:
    """The keys (per rank) of the first chunk of ``chunk``'s chain: the sequence's first full
    chunk, or the chunk itself if it starts the sequence (a partial first chunk)."""
    if chunk.start == 0:
        return chunk.keys
    # (in save order, a prompt's partial first chunk comes before the full one its output completes)
    return [c for c in st.to_save[:2] if c.start == 0][-1].keys


def _rewind(st: _Request, computed: int) -> None:
    """vLLM rolled the request back to ``computed`` tokens (it recomputes what a failed load
    left out, or a preempted request from where its cache ends): plan the saves of the
    chunks it recomputes again (the worker skips those stored or queued)."""
    while st.next_save and st.to_save[st.next_save - 1].end > computed:
        st.next_save -= 1


class SchedulerSide:
    def __init__(self, store: StoreView, namespaces: list[Namespace], block_size: int,
                 loras: LoraFingerprints, *, can_load: bool, can_save: bool, save_partial: bool,
                 load_async: bool = True, save_decode: bool = False) -> None:
        self.store = store
        self.namespaces = namespaces  # one per tensor-parallel rank
        self.namespace_ids = tuple(ns.id for ns in namespaces)
        for ns in namespaces:
            store.register_namespace(ns.id, ns.describe())
        self.block_size = block_size
        self.loras = loras
        self.chunk_tokens = namespaces[0].chunk_tokens
        self.can_load = can_load
        self.can_save = can_save
        self.save_partial = save_partial
        self.save_decode = save_decode and can_save
        self.load_async = load_async
        self._reqs: dict[str, _Request] = {}
        # req -> (local hit in tokens, [(chunk, tokens of it to load)])
        self._plans: dict[str, tuple[int, list[tuple[RankedChunk, int]]]] = {}
        self._loads: list[LoadSpec] = []
        self._uses: list[tuple[bytes, ...]] = []
        # req -> the lease on the last chunk promised to its load: (keys, when, lease)
        self._leases: dict[str, tuple[tuple[bytes, ...], float, Future[Lease]]] = {}
        # req -> steps it must still be scheduled before its synchronous load is surely done
        self._sync_loading: dict[str, int] = {}
        # req -> the blocks its load in flight fills (until vLLM reports it done, or, for a
        # synchronous one, until its errors would have been reported): whose load failed
        self._loading: dict[str, set[int]] = {}
        self.lookups = 0
        self.hit_tokens = 0  # tokens vLLM allocated for loads (a load that failed included)

    # -- per-request keys ------------------------------------------------------------
    def _state(self, request: Any) -> _Request | None:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        extras = request_extras(request, self.loras)
        if extras is None or request.prompt_token_ids is None:
            return None  # inputs kvtier cannot key: never cached
        tokens = as_token_array(request.prompt_token_ids)
        seeds = tuple(chain_seed(ns, extras) for ns in self.namespaces)
        chunks = ranked_chunk_keys(tokens, seeds, self.chunk_tokens,
                                   self.block_size if self.save_partial else None)
        # A resumable request (vLLM's streaming input: one request id for a whole realtime
        # session) gets later turns appended, with audio or images its keys, made now, do not
        # cover: its tokens past this first prompt are neither output nor keyable. Cached by
        # this prompt only.
        decode = self.save_decode and not getattr(request, "resumable", False)
        st = _Request(tokens, extras, seeds, chunks, len(tokens) // self.chunk_tokens,
                      request if decode else None)
        self._reqs[request.request_id] = st
        return st

    def _present(self, st: _Request, chunks: list[RankedChunk], *, remote: bool = True) -> int:
        """How many leading ``chunks`` every rank has stored (here or, with ``remote``, in the
        remote tier)."""
        n = len(chunks)
        if n == 0:
            return 0
        for rank in range(len(self.namespaces)):
            if n == 0:
                break
            head = _head(st, chunks[0])[rank]
            n = self.store.count_present_chain(head, [(c.start, c.keys[rank]) for c in chunks[:n]],
                                               remote=remote)
        return n

    def _present_each(self, chunks: list[RankedChunk], *, remote: bool = True) -> list[bool]:
        """Whether every rank has stored each of ``chunks`` (here or, with ``remote``, in the
        remote tier): one index read per rank."""
        there = [True] * len(chunks)
        for rank in range(len(self.namespaces)):
            ask = [i for i, t in enumerate(there) if t]
            if not ask:
                break
            for i, t in zip(ask, self.store.present_each([chunks[i].keys[rank] for i in ask], remote=remote),
                            strict=True):
                there[i] = t
        return there

    def _note_stored(self, st: _Request, hits: list[RankedChunk]) -> None:
        """Note the ``hits`` this store holds itself: their saves are skipped. (A chunk only
        the remote tier holds is saved here too, as before a lookup decided it.) So is the
        request's own tail when a longer stored tail at its start holds its KV (one saved at a
        smaller block size, before a restart), unless that one fails to load."""
        if self.store.remote is not None:
            hits = hits[: self._present(st, hits, remote=False)]
        st.stored = {c.keys for c in hits}
        tail = st.to_save[st.n_full] if len(st.to_save) > st.n_full else None
        longer = (hits and tail is not None and tail.end - tail.start < self.chunk_tokens
                  and hits[-1].start == tail.start and hits[-1].end > tail.end)
        st.tail_held_by = hits[-1].keys if longer else ()

    def _sequence(self, st: _Request) -> tuple[np.ndarray, list[RankedChunk]]:
        """The tokens a lookup matches and their full chunks: the prompt's, or, with
        ``save_decode``, also the output's so far (a preempted request resumes with the
        answer it had: the chunks of it that were saved are loaded too)."""
        if st.request is None or len(st.request.all_token_ids) <= len(st.tokens):
            return st.tokens, st.full
        self._add_output_chunks(st)
        full = st.full + [c for c in st.to_save[st.n_full:] if c.end - c.start == self.chunk_tokens]
        if st.sequence is None or len(st.sequence) != len(st.request.all_token_ids):
            st.sequence = as_token_array(st.request.all_token_ids)
        return st.sequence, full

    def _match(self, st: _Request, tokens: np.ndarray, full: list[RankedChunk]) -> list[RankedChunk]:
        def candidates(tokens: np.ndarray, parents: tuple[bytes, ...], start: int, chunk_tokens: int,
                       granularity: int) -> list[RankedChunk]:  # (the same for the same start and tokens)
            if st.tail_candidates is None or st.tail_candidates[0] != (start, len(tokens)):
                st.tail_candidates = ((start, len(tokens)),
                                      tail_candidates(tokens, parents, start, chunk_tokens, granularity))
            return st.tail_candidates[1]

        return match_prefix(tokens, st.seeds, full, self.chunk_tokens,
                            self.block_size if self.save_partial else None,
                            lambda chunks: self._present(st, chunks), self._present_each, candidates)

    # -- vLLM calls --------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """Hash the prompt as the request arrives, off the scheduling path."""
        self._state(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        tokens, full = self._sequence(st)
        # A request asks again after a preemption (or a load that failed): it may load again,
        # unless a load of it failed; asking again could promise the same bad chunk forever
        # (an I/O error leaves it stored), so it recomputes instead. Still look up which of
        # its chunks are stored, so that their saves are skipped.
        if not self.can_load or st.load_failed:
            if self.can_save:
                self._note_stored(st, self._match(st, tokens, full))
            return 0, False
        self.lookups += 1
        hits = self._match(st, tokens, full)
        self._note_stored(st, hits)
        bs = self.block_size
        if not self.can_save:  # what vLLM's own cache served is a use (see KVTierMetadata.uses):
            # every whole block of it (a tail saved at a smaller block size may end inside one)
            self._uses.extend(c.keys for c in hits if c.start < c.end // bs * bs <= num_computed_tokens)
        # Leave at least one prompt token to compute; stay block aligned (a tail saved at a
        # smaller block size may end inside a block: its whole blocks are loaded).
        end = min(hits[-1].end // bs * bs if hits else 0, (len(tokens) - 1) // bs * bs)
        if end <= num_computed_tokens:
            return 0, False
        plan = [(c, min(c.end, end) - c.start) for c in hits if c.end > num_computed_tokens and c.start < end]
        # Lease the last chunk promised, on every rank: eviction keeps it and everything it
        # extends (its chain's head) until the load is done.
        if plan:
            self._lease(request.request_id, plan[-1][0].keys)
        self._plans[request.request_id] = (num_computed_tokens, plan)
        return end - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        planned = self._plans.pop(request.request_id, None)
        if num_external_tokens <= 0 or planned is None:
            self._release(request.request_id)  # vLLM loads nothing after all
            return
        load_start, plan = planned
        self.hit_tokens += num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        bs = self.block_size
        chunks = []
        for c, n_tokens in plan:
            begin = max(c.start, load_start)
            end = c.start + n_tokens
            if end <= begin:
                continue
            chunks.append(ChunkLoad(c.keys, c.start, c.end - c.start, (begin - c.start) // bs,
                                    block_ids[begin // bs : end // bs]))
        self._loads.append(LoadSpec(request.request_id, chunks, sync=not self.load_async))
        self._loading[request.request_id] = {b for c in chunks for b in c.block_ids}
        if not self.load_async:
            # read during the step that first runs the request; with asynchronous scheduling
            # the step after it is planned while that one runs
            self._sync_loading[request.request_id] = 2

    def build_connector_meta(self, so: Any) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._loads, namespace_ids=self.namespace_ids, uses=self._uses,
                              idle=getattr(so, "total_num_scheduled_tokens", None) == 0)
        self._loads, self._uses = [], []
        for req_id in so.preempted_req_ids or ():
            # its blocks are freed, and may go to another request's load in this very step: a
            # failure reported for them is not its own (its own load's, if it failed in the
            # step before, is missed: it may be promised again when it resumes, once)
            self._loading.pop(req_id, None)
        shipped = {spec.req_id for spec in meta.loads}  # (a synchronous one's count starts after this step)
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            _rewind(st, new.num_computed_tokens)  # (model runner V2 resumes a preempted request as new)
            self._plan_saves(new.req_id, st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            if req_id in self._sync_loading and req_id not in shipped:  # (a resumed request comes this way)
                self._sync_loading[req_id] -= 1
                if not self._sync_loading[req_id]:
                    self._release(req_id)
            before = cached.num_computed_tokens[i]
            _rewind(st, before)
            self._plan_saves(req_id, st, before + so.num_scheduled_tokens.get(req_id, 0), meta)
        return meta

    def _plan_saves(self, req_id: str, st: _Request, computed: int, meta: KVTierMetadata) -> None:
        if not self.can_save:
            return
        if st.request is not None:
            self._add_output_chunks(st)
        else:
            computed = min(computed, len(st.tokens))
        bs = self.block_size
        while st.next_save < len(st.to_save) and st.to_save[st.next_save].end <= computed:
            c = st.to_save[st.next_save]
            st.next_save += 1
            if c.end // bs > len(st.block_ids):
                continue  # blocks not known (should not happen): skip rather than save garbage
            held_by = st.tail_held_by if st.next_save - 1 == st.n_full else ()
            meta.saves.append(SaveSpec(req_id, c.keys, c.start, c.end - c.start,
                                       st.block_ids[c.start // bs : c.end // bs],
                                       st.before(st.next_save - 1) or (), _head(st, c),
                                       stored=c.keys in st.stored or bool(held_by), held_by=held_by))

    def _add_output_chunks(self, st: _Request) -> None:
        """Add the full chunks the request's output has completed to its saves. Only tokens
        vLLM has appended count (sampled and accepted: not speculative drafts, nor the
        placeholders of asynchronous scheduling), so a chunk's keys name its final tokens;
        its KV is saved once the step that computes its last token runs."""
        tokens = st.request.all_token_ids
        step = self.chunk_tokens
        end = st.to_save[-1].end // step * step if st.to_save else 0  # (at a partial tail: its start)
        added = []
        while end + step <= len(tokens):
            last = len(st.to_save) - 1
            # the full chunk that ends at ``end`` (before the prompt's partial tail, if that is last)
            parents = (st.to_save[last].keys if st.to_save[last].end == end else st.before(last)) if end else None
            piece = as_token_array(tokens[end : end + step])
            st.to_save.append(RankedChunk(end, end + step, tuple(child_key(p, piece) for p in parents or st.seeds)))
            added.append(st.to_save[-1])
            end += step
        if added:  # (a repeated answer: stored already; one index read, on the scheduler's thread)
            st.stored.update(c.keys for c, there in zip(added, self._present_each(added, remote=False), strict=True)
                             if there)

    def request_finished(self, request: Any) -> bool:
        """Forget the request. Never holds its blocks: the worker's copies of a step's saves
        into host memory are complete when the step ends (``wait_for_save`` synchronizes),
        and the write to disk continues from those host buffers."""
        self._plans.pop(request.request_id, None)
        self._reqs.pop(request.request_id, None)
        self._release(request.request_id)
        return False

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        """vLLM reports these requests' asynchronous loads done: their leases can go."""
        for req_id in req_ids:
            self._release(req_id)

    def loads_failed(self, invalid_block_ids: set[int]) -> None:
        """vLLM reports these blocks' loads failed (it recomputes them): the requests whose
        loads in flight fill them are not promised a load again. (Reported no later than an
        asynchronous load is reported done, on every rank, and than a synchronous one's
        request has been scheduled twice after its load's step: before ``_release`` forgets
        the blocks.)"""
        if not invalid_block_ids:
            return
        for req_id, blocks in self._loading.items():
            st = self._reqs.get(req_id)
            if st is not None and not blocks.isdisjoint(invalid_block_ids):
                st.load_failed = True

    def _lease(self, req_id: str, keys: tuple[bytes, ...]) -> None:
        old = self._leases.get(req_id)
        if old is not None and old[0] == keys and time.monotonic() - old[1] < LOAD_LEASE_S / 2:
            return  # asked again while it waits for blocks: its lease still holds
        self._leases[req_id] = (keys, time.monotonic(), self.store.lease(keys, LOAD_LEASE_S))
        if old is not None:  # (after the new one is in place: no moment without a lease)
            self.store.release(old[2])

    def _release(self, req_id: str) -> None:
        """The request's load is over (done, failed, or never to happen): end its lease, so
        that the chunks it promised are evicted in LRU order again, not kept for minutes."""
        self._sync_loading.pop(req_id, None)
        self._loading.pop(req_id, None)
        held = self._leases.pop(req_id, None)
        if held is not None:
            self.store.release(held[2])
