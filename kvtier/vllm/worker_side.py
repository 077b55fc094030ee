"""Worker side: copies KV between vLLM's paged blocks and kvtier chunks.

Saves: once ``save_kv_layer`` has run for a layer (for every layer of a group where
``save_copy_bytes`` groups them; by default one layer at a time, on every device), that
layer's blocks of every chunk being saved are gathered into a device stage with one or two
indexing ops, then each chunk's piece goes into its pooled host buffer in one copy
(canonical layout; see ``kvtier.vllm.block_rows``), on the side stream, behind the layer's
compute (the step's first hooks do nothing but note their layers, which the third copies
with its own; see ``WorkerSide.save_layer``);
``wait_for_save`` gathers the layers whose hooks did not run (a CUDA graph replays the
forward without them), has the compute stream wait for the gathers on the device (the blocks
may be reused next step) and hands the chunks to the write-behind store with the event the
writer thread waits on. The model's thread never waits for a copy or for storage.

Loads: ``start_load_kv`` starts one background job per request that reads and verifies its
chunks, several at once; each ``get_finished`` enqueues the scatter of the chunks that have
arrived so far into the request's blocks (so the copies overlap the reads of later chunks),
and reports the request once its job is done and all its copies are (an event, polled). Synchronous loads
(``load_async: false``) read before the forward pass and scatter layer by layer (the first
group is the first layer alone):
``wait_for_layer_load`` makes the compute stream wait for its layer only. Blocks whose chunk
was missing or corrupt are reported through ``get_block_ids_with_load_errors`` so vLLM
recomputes them; a failed synchronous load also discards the saves of its step and the next
(``UNSAFE_SAVE_STEPS``): they were computed over the blocks it did not fill.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from queue import Empty, Queue

import torch

from kvtier.keys import Namespace
from kvtier.store import ChunkStore, Loaded, Outcome
from kvtier.vllm.block_rows import BATCH_BYTES, COPY_BYTES, BlockRows, RowPlan, layer_groups
from kvtier.vllm.device import CopyStream, IndexRing, StepIndex
from kvtier.vllm.layout import Content, blocks_view
from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

log = logging.getLogger("kvtier")
LOG_INTERVAL_S = 60.0
LOAD_POLL_S = 0.002
# Steps whose saves are discarded once a synchronous load failed: its own, whose forward pass
# ran over blocks the load did not fill (vLLM rolls the request back only after the step),
# and, with vLLM's async scheduling, the next, planned before vLLM learned of the failure.
# Their KV would pass every checksum and be loaded by every later request. (Without async
# scheduling the next step recomputes the rolled-back blocks: its saves are the good KV.)
UNSAFE_SAVE_STEPS = 2
# At most this many failed loads' keys are remembered until their chunks are saved again.
REFUTED_MAX = 4096
# The layer hook of a step that plans its saves (a model with fewer layers: its last). The
# hooks before it only note their layers: the first runs with only the first layer's
# attention queued on the device (traced on an H200: 0.67 ms of a 45 ms prefill idle while
# it planned), the second with about a layer more. The queue grows by about a layer per
# hook from there (the host enqueued a whole 45 ms step in 15-34% of its time), and the
# plan, the dearest hook's work, costs the same wherever it runs; each hook waited for adds
# only a layer's copies to the planning hook's work (0.1-0.2 ms of host time on this
# project's VMs, 16 chunks).
PLAN_HOOK = 3
# Load outcomes that say a chunk is not stored: its recomputed KV is saved. (Not an I/O
# error or a record over this process's size limit, which leave an intact record, nor one of
# another format version, kept for the kvtier that reads it.)
_NOT_STORED = frozenset({Outcome.MISS, Outcome.CORRUPT})


@dataclass
class _Staged:
    spec: SaveSpec
    buf: torch.Tensor | None  # None: nothing to copy, for the reason ``skipped`` counts
    # with no buffer: "save_skipped_chunks" (stored already), "save_dropped_chunks" (no buffer
    # was free; the store counts it too), "save_unsafe_chunks" (see UNSAFE_SAVE_STEPS)
    skipped: str = "save_skipped_chunks"
    replace: bool = False  # this rank could not load the stored record: replace it


@dataclass
class _Batch:
    """A batch of chunks to copy: its plan, each chunk's host tensor (layers first), where
    each group of layers starts in it and how many it holds (``spans``), and (made once per
    batch and group size) each chunk's region of the stage."""
    plan: RowPlan
    chunks: list[torch.Tensor | None]
    spans: list[tuple[int, int]]
    owners: list[_Staged] = field(default_factory=list)  # a save's: whose buffer each chunk is
    _regions: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def piece(self, i: int, k: int) -> torch.Tensor:
        """Chunk ``i``'s group ``k`` of layers. Made when its copy is enqueued, not all when
        the step is planned: a save plans in a layer hook (``PLAN_HOOK``), while the device
        has about two layers of work queued, so what the plan costs the host can idle it."""
        start, size = self.spans[k]
        chunk = self.chunks[i]
        assert chunk is not None  # (a save's chunk with no buffer is not copied)
        return chunk.narrow(0, start, size)

    def regions(self, rows: BlockRows, stage: torch.Tensor, count: int) -> list[torch.Tensor]:
        if count not in self._regions:
            self._regions[count] = rows.regions(stage, self.plan, count)
        return self._regions[count]


@dataclass
class _LoadResult:
    failed_blocks: list[int] = field(default_factory=list)
    loaded: list[tuple[ChunkLoad, torch.Tensor]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    broken: bool = False  # a copy failed: the later chunks are not copied (they are failed)
    copied_early: bool = False  # a long synchronous load: chunks copied before its last ones


@dataclass
class _LoadJob:
    """An asynchronous load in progress. Its reader thread hands each verified chunk over
    through ``arrived``, in order, as it comes; the model's thread takes what has arrived at
    each look (``taken`` so far) and enqueues its copies. The job keeps no reference to a
    chunk it handed over: its buffer goes back to the pool once its copy is done, so a long
    load cycles through a few buffers instead of holding one per chunk. What all the jobs'
    ``arrived`` queues hold together is bounded (``WorkerSide._arrived_slots``): a reader
    ahead of the steps waits rather than fill the pool (a chunk that finds no pooled buffer
    lands in new, pageable memory, whose copy to a GPU stalls the model)."""
    spec: LoadSpec
    res: _LoadResult
    arrived: Queue[tuple[ChunkLoad, torch.Tensor]]
    future: Future[_LoadResult]
    stop: threading.Event  # its request finished (aborted) before the load did: read no more
    taken: int = 0


class WorkerSide:
    def __init__(self, store: ChunkStore, namespace: Namespace, layer_names: list[str],
                 kv_caches: dict[str, torch.Tensor], content: Content, block_size: int,
                 any_rank: Callable[[bool], bool] | None = None, save_wait_s: float = 0.0,
                 unsafe_save_steps: int = UNSAFE_SAVE_STEPS, stage_bytes: int | None = None,
                 copy_bytes: int | None = None, layer_hooks: bool = True, save_copy_bytes: int = 0) -> None:
        self.store = store
        self.unsafe_save_steps = unsafe_save_steps  # 1 where vLLM schedules synchronously
        # offline producers (warm-up) only: how long a step may wait for the writer to make
        # room rather than drop saves; a server's is 0 (its model thread never waits)
        self.save_wait_s = save_wait_s
        self._save_deadline: float | None = None
        # whether a flag is set on any tensor-parallel rank (every rank calls it in the same
        # steps); None: this rank alone (tensor_parallel_size 1)
        self._any_rank = any_rank
        self.namespace = namespace
        self.rank = namespace.tp_rank
        self.block_size = block_size
        _, _, self.heads, self.head_dim = namespace.kv_shape
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.views = [blocks_view(kv_caches[n], content, self.head_dim) for n in layer_names]
        self.dtype = kv_caches[layer_names[0]].dtype
        self.copies = CopyStream(kv_caches[layer_names[0]].device)
        # chunks are copied in batches through one staging tensor on the device, gathered
        # layer by layer and moved to and from host memory a group of layers at a time (see
        # kvtier.vllm.block_rows): its size is fixed now, whatever the steps ask
        self.rows = BlockRows(self.views[0])
        self.tables = [self.rows.tables(v) for v in self.views]
        row_shape = self.rows.row_shape
        row_bytes = math.prod(row_shape) * self.dtype.itemsize
        chunk_rows = self.rows.rows_per_chunk(-(-namespace.chunk_tokens // block_size))
        layers = len(self.views)
        # Loads: on a GPU every copy between device and host memory has a fixed cost, so a
        # chunk's layers go several at a time (COPY_BYTES: host-tier loads ran at 0.84x of
        # the link on an H200 against 0.77x one layer at a time). On the CPU that copy is a
        # memcpy with no such cost, and the pass through the stage's scratch that grouping
        # needs (an index_copy_, about 4x slower there than a gather) would: one layer per copy.
        if copy_bytes is None:
            copy_bytes = COPY_BYTES if self.copies.is_cuda else 0
        self.per_copy = self.rows.layers_per_copy(chunk_rows * row_bytes, layers, copy_bytes)
        self._groups = layer_groups(layers, self.per_copy)
        # a forward pass that waits for a load layer by layer gets its first layer soonest
        self._sync_groups = layer_groups(layers, self.per_copy, first=1)
        self._spans = [(g.start, len(g)) for g in self._groups]  # (where each starts in a chunk)
        self._sync_spans = [(g.start, len(g)) for g in self._sync_groups]
        # Saves: one layer per copy by default, also on a GPU. A layer's copies then follow
        # its compute, and the step's last gathers (what the next step waits for) queue
        # behind one layer's copies, not a group's: on an H200, for a 16-chunk prefill step,
        # the last gathers ended 0.04 ms after the forward pass against 1.9 ms with 8 layers
        # per copy, at the same rate on the device (0.82x of the link against 0.81x).
        self.save_per_copy = self.rows.layers_per_copy(chunk_rows * row_bytes, layers, save_copy_bytes)
        self._save_groups = layer_groups(layers, self.save_per_copy)
        self._save_spans = [(g.start, len(g)) for g in self._save_groups]
        # the stage: BATCH_BYTES of a batch's rows in each layer slot and in the scratch, and at
        # least every group of a whole chunk at once (see _gather_late), for loads and saves
        def slots(per_copy: int) -> int:  # stage rows per chunk row: its layer slots and the scratch
            return per_copy + self.rows.scratch(per_copy)

        if stage_bytes is None:
            stage_bytes = BATCH_BYTES * max(slots(self.per_copy), slots(self.save_per_copy))
        need = chunk_rows * max(len(self._groups) * slots(self.per_copy),
                                len(self._save_groups) * slots(self.save_per_copy))
        # allocated on the side stream, the only one that uses it: should the worker be dropped
        # without close(), PyTorch's allocator gives the memory out again only behind the
        # copies still in flight there (IndexRing's device buffers are made there too)
        with self.copies.after_compute():
            self._stage = torch.empty((max(need, stage_bytes // row_bytes), *row_shape), dtype=self.dtype,
                                      device=self.copies.device)
        # every staging and host-tier buffer now, pinned and touched, in one allocation: no
        # step allocates (the first saves would pay for new pinned memory on this thread)
        store.reserve_buffers((len(self.views), 2, namespace.chunk_tokens, self.heads, self.head_dim), self.dtype)
        # chunks a load may have read but not yet copied: half of what the host tier's share
        # of the pool holds once what the store reads ahead (ChunkStore.load_many) and two in
        # hand are set aside (the queue refills while the last batch is copied); at least one
        # per I/O thread, or a small host tier would starve the reads
        host_chunks = int(store.config.host_bytes) // max(1, store.pool.chunk_bytes)
        io = store.config.io_threads
        self._arrived_max = max(io, (host_chunks - 2 * io - 2) // 2)
        # Several asynchronous loads at once share those budgets (up to io_threads run at
        # once): chunks read but not yet taken by this thread, and reads ahead of the reader.
        self._arrived_slots = threading.Semaphore(self._arrived_max)
        self._read_ahead = 2 * io
        self._readers = 0  # asynchronous loads reading now
        self._readers_lock = threading.Lock()
        self._closing = False
        self._load_signal = threading.Event()  # set by a reader when a chunk or a job is ready
        # whether get_finished also waits for pending loads' readers in a step that ran a
        # forward pass: on the CPU, where they share the cores and the GIL with the forward
        # pass, it speeds the loads (engine_bench's KV-pressure workload: 1.02-1.09x of no
        # connector with it, 0.95-0.97x without); on a GPU it would hold the model's thread
        # up to LOAD_POLL_S per step, and the next step with it
        self.busy_step_load_wait = not self.copies.is_cuda
        # block ids go to the device once per step, not per layer and chunk; a step's buffer
        # is reused only once its copies are done (they are never awaited on this thread)
        self._save_index = IndexRing(self.copies.device)
        self._load_index = IndexRing(self.copies.device)
        self._staged: list[_Staged] | None = None  # this step's saves, from its planning hook on
        # the metadata of the step whose saves the hooks note and plan (see save_layer), and
        # that step's hooked layers not yet acted on (until its planning hook, PLAN_HOOK)
        self._step_meta: KVTierMetadata | None = None
        self._noted: list[int] = []
        self._plan_hook = min(PLAN_HOOK, layers)
        # this step's chunks to copy, in batches (views made once per step, not per layer)
        self._save_batches: list[_Batch] = []
        self._staged_index: StepIndex | None = None
        self._blocks_read: torch.cuda.Event | None = None  # after this step's last gathers so far
        self._hooked = [False] * layers  # which layers' hooks ran this step
        self._copied = [False] * len(self._save_groups)  # which groups of layers are copied
        self._save_namespace = namespace.id
        # host buffers that copies in flight may still write (save gathers) or read (load
        # scatters): kept until their event is done, so the pool does not reuse them under
        # a copy (a buffer the store let go of, a loaded chunk already copied)
        self._in_flight: list[tuple[torch.cuda.Event | None, list[torch.Tensor]]] = []
        self._loads: dict[str, _LoadJob] = {}
        # finished asynchronous loads, reported once the event after their last copy is done
        self._reporting: list[tuple[torch.cuda.Event | None, str, _LoadResult]] = []
        self._layer_ready: dict[int, torch.cuda.Event | None] = {}  # this step's synchronous loads
        self._warned_layer_waits = False
        # whether save_kv_layer's calls say a layer's KV is written: not where vLLM splits the
        # forward pass into micro-batches (dual-batch overlap), each calling it for each layer;
        # every layer is then copied in wait_for_save, after the whole forward pass
        self.layer_hooks = layer_hooks
        self._load_errors: set[int] = set()
        # Keys this rank failed to load (missing, corrupt, the wrong shape): the scheduler's
        # lookup called them stored, but their recomputed KV must be saved; True: replacing
        # the stored record, which this rank read and could not use. (Insertion-ordered,
        # bounded; reader threads add, the model's thread takes.)
        self._refuted: dict[bytes, bool] = {}
        self._unsafe_save_steps = 0  # see UNSAFE_SAVE_STEPS
        self._pool = ThreadPoolExecutor(max(1, store.config.io_threads), thread_name_prefix="kvtier-kvload")
        self.stats: dict[str, float] = {}  # only touched on the model's thread
        self._last_log = time.monotonic()
        self._last_counters = store.counters.snapshot()
        self._load_copy_kernels()

    def _load_copy_kernels(self) -> None:
        """Run each copy kernel once now, on block 0 (read and written back unchanged):
        CUDA loads a kernel's code on its first launch and may synchronize the device to do
        it, which in the first saving step would stall the model's thread behind the forward
        pass (seen on an H100: 115 ms). Twice: PyTorch's CUDA ``index_select`` runs one
        kernel for up to 16 indices and another above, and a step may use either (a short
        tail, a batch of chunks); the second pass repeats block 0 as many times as the stage
        holds, up to 17 rows per table (every repeat reads and writes the same values). With
        the layer slots of saves and of loads both (they differ on a GPU), and with each
        set of element types the layers' tables are indexed as (one, unless some layer's
        memory is aligned otherwise: see ``widened``)."""
        kinds = {tuple(t.dtype for t in tables): tables for tables in self.tables}
        for per_copy in sorted({self.save_per_copy, self.per_copy}):
            per_block = self.rows.rows_per_chunk(1) * (per_copy + self.rows.scratch(per_copy))
            repeats = max(1, min(17, self._stage.shape[0] // per_block))
            for blocks in ([0], [0] * repeats):
                index = StepIndex(self.copies.device)
                ((plan, _),) = self._plan_rows(index, [blocks], per_copy)
                with self.copies.after_compute():
                    for tables in kinds.values():
                        BlockRows.gather(tables, plan, self._stage)
                        BlockRows.scatter(tables, plan, self._stage)
                self.copies.synchronize()

    def _plan_rows(self, index: StepIndex, block_lists: list[list[int]],
                   per_copy: int) -> list[tuple[RowPlan, list[int]]]:
        """Batches of chunks that fit the stage with ``per_copy`` layer slots each, with their
        rows uploaded in one copy (call inside ``after_compute``): each batch's plan, and its
        chunks' positions in ``block_lists``."""
        lists: list[Sequence[int]] = []
        parts = []
        for batch in self.rows.batches(block_lists, self._stage.shape[0], per_copy):
            chunks = [block_lists[i] for i in batch]
            ids, sizes = self.rows.id_lists(chunks, per_copy)
            parts.append((batch, chunks, len(ids), sizes))
            lists.extend(ids)
        uploaded = index.upload(lists)
        out, at = [], 0
        for batch, chunks, n, sizes in parts:
            out.append((self.rows.plan(chunks, uploaded[at : at + n], sizes, per_copy), batch))
            at += n
        return out

    def _bump(self, **deltas: float) -> None:
        for k, v in deltas.items():
            self.stats[k] = self.stats.get(k, 0) + v

    # -- saves ---------------------------------------------------------------------
    def save_layer(self, meta: KVTierMetadata, layer_name: str) -> None:
        """A layer's hook (``save_kv_layer``): its layer is computed once the compute stream
        gets this far. The step's first hooks only note their layers: they run while the
        device has little queued (the first: only that layer's attention), so any host time
        spent in them can idle the device (traced on an H200: 0.67 ms of a 45 ms prefill
        while the first hook planned). The step's ``PLAN_HOOK``-th hook plans its saves and
        copies the noted layers with its own, with more than a layer of compute queued ahead
        of it; the side stream waits for its layer, and so for the earlier ones (the blocks
        a layer wrote stay as they are until the step ends)."""
        li = self.layer_index.get(layer_name)
        if li is None or not meta.saves or not self.layer_hooks:
            return
        if meta is not self._step_meta:  # the step's first hook
            if self._staged is not None:  # a step that never reached wait_for_save: its plan
                # is not this step's (other blocks, other chunks); its chunks stay uncached
                log.warning("kvtier: a step's saves were never handed over (wait_for_save did not run "
                            "after its forward pass); %d chunks of it not saved",
                            sum(st.buf is not None for st in self._staged))
                self._end_saves(store=False)
            self._step_meta, self._noted = meta, []
        self._noted.append(li)
        if self._staged is None and len(self._noted) < self._plan_hook:
            return
        with self.copies.after_compute():
            if self._staged is None:  # the planning hook: plan the step's saves once (a plan
                self._plan_saves(meta)  # that fails is made again by the next hook)
            # (the noted layers stay noted until a hook gets past the plan: where it failed,
            # the next hook copies them, also where only taking the pool buffers failed,
            # which leaves the chunks that got none unsaved)
            hooked, self._noted = self._noted, []
            # a group of layers is copied once every layer of it has been computed (its hook
            # ran: hooks need not come in the layers' order)
            for i in hooked:
                self._hooked[i] = True
                k = i // self.save_per_copy
                if all(self._hooked[j] for j in self._save_groups[k]):
                    self._copy_group(k)

    def record_uses(self, uses: list[tuple[bytes, ...]]) -> None:
        """Stored chunks requests used from vLLM's own prefix cache (per rank keys): uses for
        the store's LRU (a dict insert; never waits)."""
        self.store.touch(keys[self.rank] for keys in uses)

    def _plan_saves(self, meta: KVTierMetadata) -> None:
        """Which of the step's chunks to copy (those neither stored nor queued), their block
        ids uploaded to the device in one copy, and a pooled buffer for each (call inside
        ``after_compute``)."""
        unsafe = self._unsafe_save_steps > 0  # nothing of this step is saved (UNSAFE_SAVE_STEPS)
        if self.save_wait_s:  # an offline producer may wait: for the last steps' copies, so
            # that their buffers can go back to the pool (no name here may hold a buffer)
            for event in [e for e, _ in self._in_flight if e is not None]:
                event.synchronize()
        self._release_landed()  # the last steps' buffers whose copies are done (never waits)
        self._save_deadline = time.monotonic() + self.save_wait_s if self.save_wait_s else None
        # Stored: as the scheduler's lookup found it, or queued here since. No index read: it
        # could wait for the disk on this thread (a chunk stored since the lookup is written
        # again, and the index keeps the first copy).
        queued = self.store.queued_each([spec.keys[self.rank] for spec in meta.saves])
        staged: list[_Staged] = []
        copying: list[_Staged] = []  # (those of them to copy)
        used = []
        for spec, in_queue in zip(meta.saves, queued, strict=True):
            key = spec.keys[self.rank]
            holder = spec.held_by[self.rank] if spec.held_by else key  # what holds its KV
            refuted = key in self._refuted or holder in self._refuted  # a load failed here: not stored after all
            there = not unsafe and ((spec.stored and not refuted) or in_queue)
            if there:  # stored already, and used all the same (see record_uses)
                used.append(key if in_queue else holder)
            if unsafe or there:
                staged.append(_Staged(spec, None, "save_unsafe_chunks" if unsafe else "save_skipped_chunks"))
                continue
            copying.append(_Staged(spec, None, "save_dropped_chunks"))  # (its buffer: _take_buffers)
            staged.append(copying[-1])
        # A use from vLLM's own prefix cache (or a load): else the store's LRU would evict the
        # hottest prefixes first, those that never need a load while the server runs.
        self.store.touch(used)
        if self._staged_index is not None:  # (a plan that failed part way: given back)
            self._save_index.hold(self._staged_index, self.copies.record())
        self._staged_index = self._save_index.take()
        self._save_batches = [
            _Batch(plan, [None] * len(batch), self._save_spans, [copying[i] for i in batch])
            for plan, batch in self._plan_rows(self._staged_index, [list(st.spec.block_ids) for st in copying],
                                               self.save_per_copy)]
        ids = meta.namespace_ids
        self._save_namespace = ids[self.rank] if len(ids) > self.rank else self.namespace.id
        self._hooked = [False] * len(self.views)
        self._copied = [False] * len(self._save_groups)
        self._staged = staged
        self._take_buffers()

    def _take_buffers(self) -> None:
        """A pooled buffer for each chunk of the step to copy (none free: the save is dropped
        and counted; it is gathered all the same, and not copied)."""
        for batch in self._save_batches:
            for i, st in enumerate(batch.owners):
                spec = st.spec
                shape = (len(self.views), 2, spec.num_tokens, self.heads, self.head_dim)
                st.buf = self.store.buffer(shape, self.dtype, wait_until=self._save_deadline)
                if st.buf is not None:  # (saved now)
                    st.replace = self._refuted.pop(spec.keys[self.rank], False)
                batch.chunks[i] = st.buf

    def _copy_group(self, k: int) -> None:
        """Copy group ``k`` of layers of this step's saves into their buffers (inside
        ``after_compute``): per batch, its layers gathered into their slots of the stage, then
        one copy per chunk."""
        if self._copied[k]:
            return
        for batch in self._save_batches:
            self._gather_group(k, batch.plan, self._stage)
            if batch is self._save_batches[-1]:  # the blocks are read (see _end_saves)
                self._blocks_read = self.copies.record()
            self._to_buffers(k, batch, batch.regions(self.rows, self._stage, len(self._save_groups[k])))
        self._copied[k] = True

    def _gather_group(self, k: int, plan: RowPlan, stage: torch.Tensor) -> None:
        """Group ``k``'s layers of a batch into their slots of ``stage`` (the batch's part)."""
        for slot, li in enumerate(self._save_groups[k]):
            BlockRows.gather(self.tables[li], plan, stage, slot)

    def _to_buffers(self, k: int, batch: _Batch, regions: list[torch.Tensor]) -> None:
        """A batch's gathered group ``k`` of layers from the stage (``regions``, per chunk)
        into each chunk's buffer (a chunk that got none: not copied)."""
        for i, (region, blocks) in enumerate(zip(regions, batch.plan.blocks, strict=True)):
            if batch.chunks[i] is not None:
                self.rows.to_chunk(region, blocks, batch.piece(i, k), self.copies.non_blocking)

    def finish_saves(self, meta: KVTierMetadata | None = None) -> None:
        """The step's forward pass is enqueued: copy what its layer hooks did not, and hand
        the chunks to the store (``wait_for_save``; never waits for a copy)."""
        if self._layer_ready and not self._warned_layer_waits:  # the forward pass has been
            # enqueued: its waits are in, or it ran without them (start_loads was told wrong)
            self._warned_layer_waits = True
            log.warning("kvtier: the forward pass did not wait for %d layers of a synchronous load "
                        "(wait_for_layer_load was not called); set load_async: true", len(self._layer_ready))
        self._layer_ready.clear()
        self._release_landed()
        try:
            self._finish_saves(meta if meta is not None else self._step_meta)
        finally:  # the step is over (wait_for_save runs once per forward pass)
            self._unsafe_save_steps = max(0, self._unsafe_save_steps - 1)
            self._step_meta, self._noted = None, []

    def _finish_saves(self, meta: KVTierMetadata | None) -> None:
        if self._staged is None and (meta is None or not meta.saves):
            return
        late: list[int] = []
        try:
            with self.copies.after_compute():
                if self._staged is None:  # no layer hook planned: a CUDA graph replayed the
                    self._plan_saves(meta)  # type: ignore[arg-type]  # forward (or hooks ran for
                    # fewer layers than PLAN_HOOK)
                late = [k for k, done in enumerate(self._copied) if not done]
                self._gather_late(late)
        except Exception as exc:
            log.warning("kvtier: copying KV to save failed: %s; the step's chunks stay uncached", str(exc))
            self._end_saves(store=False)
            return
        if late:
            self._bump(save_layers_after_forward=sum(len(self._save_groups[k]) for k in late))
        self._end_saves(store=True)

    def _gather_late(self, late: list[int]) -> None:
        """Copy the groups of layers no hook copied (inside ``after_compute``). Where all of
        them fit the stage (one chunk's always do), every gather goes first, each group into
        its own part of the stage, then the host copies: the next step's compute need wait
        only for the gathers (the event after them), not for the copies to host memory, which
        under a replayed CUDA graph all come after the forward pass."""
        rows = sum(batch.plan.stage_rows for batch in self._save_batches) * len(late)
        if not late or rows > self._stage.shape[0]:
            for k in late:
                self._copy_group(k)
            return
        parts, at = [], 0
        for k in late:
            for batch in self._save_batches:
                region = self._stage.narrow(0, at, batch.plan.stage_rows)
                self._gather_group(k, batch.plan, region)
                parts.append((k, region, batch))
                at += batch.plan.stage_rows
        self._blocks_read = self.copies.record()
        for k, region, batch in parts:
            self._to_buffers(k, batch, self.rows.regions(region, batch.plan, len(self._save_groups[k])))
            self._copied[k] = True

    def _end_saves(self, *, store: bool) -> None:
        staged, self._staged = self._staged or [], None
        self._save_batches = []
        event = self.copies.record()
        blocks_read, self._blocks_read = self._blocks_read if store else None, None
        # the gathers read blocks vLLM may hand out again from the next step on: later work on
        # the compute stream waits for them (on the device; this thread does not), from right
        # after this forward pass. Not later: vLLM's model runner V2 zeroes and copies blocks
        # for the next step before it calls the connector's first hook (handle_preemptions).
        # One event stands for all earlier ones: they are on the same stream. Only for the
        # gathers (``blocks_read``: the event after the step's last ones), not for the copies
        # to host memory after them (a group of layers of every chunk: milliseconds); for
        # everything where a copy failed.
        self.copies.compute_waits_for(blocks_read if blocks_read is not None else event)
        if self._staged_index is not None:
            self._save_index.hold(self._staged_index, event)
            self._staged_index = None
        buffers = [s.buf for s in staged if s.buf is not None]
        if buffers:
            self._in_flight.append((event, buffers))
        ready = event.synchronize if event is not None else None  # the writer thread waits on it
        with self.store.put_batch():  # (the writer is woken once, for the whole step)
            for s in staged:
                if s.buf is None:
                    self._bump(**{s.skipped: 1})
                    continue
                if not store:
                    self._bump(save_dropped_chunks=1)
                    continue
                parents = s.spec.parent_keys
                ok = self.store.put(s.spec.keys[self.rank], s.buf, namespace_id=self._save_namespace,
                                    token_start=s.spec.token_start, num_tokens=s.spec.num_tokens,
                                    group=s.spec.keys[0], parent=parents[self.rank] if parents else None,
                                    head=s.spec.head_keys[self.rank] if s.spec.head_keys else None, ready=ready,
                                    wait_until=self._save_deadline, replace=s.replace)
                self._bump(save_chunks=1 if ok else 0, save_tokens=s.spec.num_tokens if ok else 0,
                           save_dropped_chunks=0 if ok else 1)

    def _release_landed(self) -> None:
        """Let go of the host buffers whose copies are done (never waits)."""
        self._in_flight = [(e, b) for e, b in self._in_flight if not self.copies.done(e)]

    # -- loads ---------------------------------------------------------------------
    def start_loads(self, meta: KVTierMetadata, layer_waits: bool = True) -> None:
        """``layer_waits``: the forward pass calls ``wait_for_layer_load`` in each attention
        layer (not where a full CUDA graph replays it: a synchronous load is then waited for
        whole, before the forward pass)."""
        self._layer_ready.clear()
        sync = [spec for spec in meta.loads if spec.sync]
        if sync:
            failed = True  # unless the loads below are seen through
            try:
                failed = self._load_sync(sync, layer_waits)
            except Exception as exc:  # a fault kvtier did not foresee: recompute, never fail the step
                log.warning("kvtier: a synchronous load failed: %s; its blocks are recomputed", str(exc))
                self._layer_ready.clear()
                # copies a long load enqueued before the fault land before vLLM recomputes
                self.copies.compute_waits_for(self.copies.record())
                self._load_errors.update(b for spec in sync for chunk in spec.chunks for b in chunk.block_ids)
            finally:  # every rank agrees in the same steps, whatever happened here
                if self.any_rank_failed(failed):
                    self._unsafe_save_steps = self.unsafe_save_steps
        for spec in meta.loads:
            if not spec.sync and spec.req_id not in self._loads:
                res, arrived, stop = _LoadResult(), Queue(), threading.Event()  # (bounded by _arrived_slots)
                future = self._pool.submit(self._read_shared, spec, res,
                                           functools.partial(self._hand_over, arrived, stop), stop.is_set)
                future.add_done_callback(lambda _: self._load_signal.set())
                self._loads[spec.req_id] = _LoadJob(spec, res, arrived, future, stop)

    def _load_sync(self, specs: list[LoadSpec], layer_waits: bool = True) -> bool:
        """Read synchronous loads (vLLM calls us before the forward pass that uses their
        blocks) and enqueue their copies layer by layer; whether any of it failed."""
        sync = [self._read_sync(spec) for spec in specs]
        # layer by layer: the first layers compute while later ones are still copied
        event = self._scatter([(res, res.loaded) for res in sync], layer_events=layer_waits)
        if not layer_waits or (any(res.copied_early for res in sync) and len(self._layer_ready) < len(self.views)):
            # no layer waits for its own copies (a full CUDA graph; or nothing was left to
            # copy layer by layer, the chunk after a long load's early copies having failed):
            # the forward pass waits for all of them
            self.copies.compute_waits_for(event)
        for res in sync:  # a synchronous load's failures are reported in its own step
            res.loaded = []  # (held until copied: _in_flight)
            self._report(res)
        return any(res.failed_blocks for res in sync)

    def any_rank_failed(self, failed: bool) -> bool:
        """Whether a step's synchronous loads failed on this or any other tensor-parallel
        rank: one rank's failure spoils every rank's KV of that step (the layers' outputs are
        summed across ranks). Every rank calls this in the same steps."""
        if self._any_rank is None:
            return failed
        try:
            return self._any_rank(failed)
        except Exception as exc:  # cannot tell: assume it failed somewhere
            log.warning("kvtier: checking the other ranks' loads failed: %s", exc)
            return True

    def _read_sync(self, spec: LoadSpec) -> _LoadResult:
        """A synchronous load's read, on this thread: whenever as many chunks as an
        asynchronous load may hold have arrived and more are to come, they are copied into
        the cache and let go once copied, so a long load stays within the pool; the last
        ones (all of a load that fits one batch) are left in ``res.loaded`` for the
        layer-by-layer copy that the forward pass waits on."""
        res = _LoadResult()
        to_come = len(spec.chunks)

        def deliver(item: tuple[ChunkLoad, torch.Tensor]) -> None:
            nonlocal to_come
            res.loaded.append(item)
            to_come -= 1
            # a load that fits one batch (or its last chunks) is copied layer by layer
            if len(res.loaded) >= self._arrived_max and to_come:
                items, res.loaded = res.loaded, []
                self._scatter([(res, items)])
                res.copied_early = True
                self._release_landed()

        self._read(spec, res, deliver)
        return res

    def wait_for_layer(self, layer_name: str) -> None:
        """The compute stream waits (on the device) for this layer's synchronous loads."""
        li = self.layer_index.get(layer_name)
        if li is not None and li in self._layer_ready:
            self.copies.compute_waits_for(self._layer_ready.pop(li))

    def _read_shared(self, spec: LoadSpec, res: _LoadResult,
                     deliver: Callable[[tuple[ChunkLoad, torch.Tensor]], None],
                     stop: Callable[[], bool]) -> _LoadResult:
        """:meth:`_read` for an asynchronous load: the loads reading at once split the reads
        ahead between them, so that together they hold about as many pooled buffers as one
        (each keeps the read it waits for; beyond the pool a chunk lands in new memory: an
        allocation, and on a GPU a pageable copy that stalls the model's thread)."""
        with self._readers_lock:
            self._readers += 1
        try:
            return self._read(spec, res, deliver,
                              ahead=lambda: self._read_ahead // max(1, self._readers), stop=stop)
        finally:
            with self._readers_lock:
                self._readers -= 1

    def _read(self, spec: LoadSpec, res: _LoadResult,
              deliver: Callable[[tuple[ChunkLoad, torch.Tensor]], None],
              ahead: Callable[[], int] | None = None, stop: Callable[[], bool] | None = None) -> _LoadResult:
        """Read and verify a request's chunks (a background thread in async mode), handing
        each verified chunk to ``deliver`` as it arrives, in order; failures go to ``res``.

        Only storage work happens here: reads, checksums and decoding into host tensors
        release the GIL and use no thread pool of torch's. The copies into vLLM's KV cache
        are enqueued from the thread that drives the model (see ``_scatter``): from a second
        thread they would fight the worker's OpenMP threads for the same cores.
        """
        t0 = time.perf_counter()
        # every chunk is read and verified, in parallel on the store's I/O pool, even past a
        # bad one (unused then: the prefix is broken), so corrupt records are found and
        # removed now and the recomputed KV replaces them
        # (closed on the way out, also by an exception: the reads not begun are cancelled)
        with contextlib.closing(self.store.load_many([chunk.keys[self.rank] for chunk in spec.chunks],
                                                     ahead)) as results:
            for i, chunk in enumerate(spec.chunks):  # (no zip: its reused tuple would keep a chunk)
                if self._closing:  # (shutting down: nobody takes the rest)
                    raise RuntimeError("the worker closed during a load")
                if stop is not None and stop():  # (its request is gone: nobody takes the rest)
                    break
                loaded = next(results)
                if not self._usable(chunk, loaded):
                    for rest in spec.chunks[i:]:
                        res.failed_blocks.extend(rest.block_ids)
                    if loaded.outcome is Outcome.TIMED_OUT:  # the rest would wait on the same storage
                        break
                    for rest, later in zip(spec.chunks[i + 1:], results, strict=True):  # the rest, as said above
                        self._usable(rest, later)
                        del later
                        if self._closing or (stop is not None and stop()):
                            break
                    break
                deliver((chunk, loaded.tensor))  # type: ignore[arg-type]
                del loaded  # handed over: not kept while the next chunk is read
        res.seconds = time.perf_counter() - t0
        return res

    def _usable(self, chunk: ChunkLoad, loaded: Loaded) -> bool:
        """(Any thread.) Whether ``loaded`` is ``chunk``'s KV in this rank's shape and dtype.
        If not, and the chunk is not stored in a form this rank can load (missing, corrupt,
        the wrong shape), it is saved when recomputed (``_refuted``); a record this rank read
        and cannot use is then replaced (else what is stored by then is another writer's
        copy, which a reader may be loading: kept)."""
        data = loaded.tensor
        if data is not None and data.dtype == self.dtype \
                and tuple(data.shape) == (len(self.views), 2, chunk.num_tokens, self.heads, self.head_dim):
            return True
        if data is not None or loaded.outcome in _NOT_STORED:  # (not an I/O error: kept)
            self._refute(chunk, replace=data is not None)
        return False

    def _refute(self, chunk: ChunkLoad, *, replace: bool) -> None:
        self._refuted[chunk.keys[self.rank]] = replace
        while len(self._refuted) > REFUTED_MAX:  # (one whose save never came)
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del self._refuted[next(iter(self._refuted))]

    def _scatter(self, parts: list[tuple[_LoadResult, list[tuple[ChunkLoad, torch.Tensor]]]], *,
                 layer_events: bool = False) -> torch.cuda.Event | None:
        """Enqueue the copies of loaded chunks (each with the load it belongs to) into their
        blocks, layer by layer (with an event per layer if ``layer_events``); returns the
        event that marks them all, and holds the chunks' host buffers until it is done.
        Never waits for them. The chunks of a load whose earlier copy failed (``broken``) are
        failed, not copied; a copy that fails fails its chunks and breaks their loads."""
        loaded = []
        for res, items in parts:
            if res.broken:
                for chunk, _ in items:
                    res.failed_blocks.extend(chunk.block_ids)
            else:
                loaded.extend((res, item) for item in items)
        index = None
        failed = False
        try:
            index = self._load_index.take()
            with self.copies.after_compute():
                groups = self._sync_groups if layer_events else self._groups
                spans = self._sync_spans if layer_events else self._spans
                # per batch: its plan, and each chunk's tokens its blocks take, past the
                # skipped ones
                batches = []
                for plan, batch in self._plan_rows(index, [list(chunk.block_ids) for _, (chunk, _) in loaded],
                                                   self.per_copy):
                    tokens = []
                    for i, blocks in zip(batch, plan.blocks, strict=True):
                        chunk, data = loaded[i][1]
                        tokens.append(data.narrow(2, chunk.skip_blocks * self.block_size, blocks * self.block_size))
                    batches.append(_Batch(plan, tokens, spans))
                non_blocking, stage = self.copies.non_blocking, self._stage
                # a group of layers at a time: one copy per chunk into the stage, then one
                # scatter per layer; a layer's event follows its last batch's scatter
                for k, group in enumerate(groups):
                    for b, batch in enumerate(batches):
                        regions = batch.regions(self.rows, stage, len(group))
                        for i, (region, blocks) in enumerate(zip(regions, batch.plan.blocks, strict=True)):
                            self.rows.from_chunk(batch.piece(i, k), blocks, region, non_blocking)
                        for slot, li in enumerate(group):
                            BlockRows.scatter(self.tables[li], batch.plan, stage, slot)
                            if layer_events and b == len(batches) - 1:
                                self._layer_ready[li] = self.copies.record()
            for res, (chunk, _) in loaded:
                res.tokens += len(chunk.block_ids) * self.block_size
        except Exception as exc:
            # (the message only, here and above: a handler that keeps records, such as a
            # MemoryHandler, would keep the exception, whose frames hold the chunks' buffers)
            log.warning("kvtier: copying loaded KV into the cache failed: %s", str(exc))
            for res, (chunk, _) in loaded:
                res.failed_blocks.extend(chunk.block_ids)
                res.broken = True
            if layer_events:  # (a failed asynchronous scatter leaves this step's layer waits be)
                self._layer_ready.clear()
            failed = True
        event = self.copies.record()
        if index is not None:
            self._load_index.hold(index, event)
        if loaded:
            self._in_flight.append((event, [data for _, (_, data) in loaded]))
        if failed:  # copies enqueued before the failure must land before vLLM recomputes the blocks
            self.copies.compute_waits_for(event)
        return event

    def _report(self, res: _LoadResult) -> None:
        failed = set(res.failed_blocks)  # (a block failed twice over is one block)
        self._load_errors.update(failed)
        self._bump(load_tokens=res.tokens, load_seconds=res.seconds,
                   load_failed_blocks=len(failed), load_requests=1)

    def _report_finished(self) -> set[str]:
        """The finished asynchronous loads whose copies are done: reported, and returned."""
        done, still = set(), []
        for event, req_id, res in self._reporting:
            if self.copies.done(event):
                self._report(res)
                done.add(req_id)
            else:
                still.append((event, req_id, res))
        self._reporting = still
        return done

    def _hand_over(self, arrived: Queue[tuple[ChunkLoad, torch.Tensor]], stop: threading.Event,
                   item: tuple[ChunkLoad, torch.Tensor]) -> None:
        """(A reader thread.) Hand a verified chunk to the model's thread, waiting while as
        many as allowed (by all the loads together) are waiting for their copies; give up if
        the worker closes, or drop it if the request is gone (``stop``)."""
        while True:
            if self._closing:
                raise RuntimeError("the worker closed during a load")
            if stop.is_set():
                return
            if self._arrived_slots.acquire(timeout=0.05):
                break
        arrived.put(item)
        self._load_signal.set()

    def _scatter_arrived(self) -> None:
        """Enqueue the copies of every chunk that arrived since the last call, for all the
        asynchronous loads in one batch (one index upload), so the copies of a load's first
        chunks overlap the reads of its later ones. A load whose job is done waits in
        ``_reporting`` for the event after its last copy (all copies are on one stream)."""
        parts: list[tuple[_LoadResult, list[tuple[ChunkLoad, torch.Tensor]]]] = []
        finished: list[tuple[str, _LoadJob]] = []
        for req_id, job in list(self._loads.items()):
            done = job.future.done()  # before draining: nothing arrives after a done job's last
            new = []
            while True:
                try:
                    new.append(job.arrived.get_nowait())
                except Empty:
                    break
                self._arrived_slots.release()  # taken: its buffer is held until copied (_in_flight)
            job.taken += len(new)
            if job.stop.is_set():  # its request is gone: nothing more is copied for it
                new = []
            if done:
                del self._loads[req_id]
                finished.append((req_id, job))
                try:
                    job.future.result()
                except Exception as exc:  # defensive: _read catches storage faults
                    log.warning("kvtier: load job failed: %s", str(exc))
                    # what it verified may still be copied; every later chunk is failed
                    for chunk in job.spec.chunks[job.taken:]:
                        job.res.failed_blocks.extend(chunk.block_ids)
                if job.stop.is_set():  # nothing reported failed: its blocks are freed once it is reported
                    job.res.failed_blocks.clear()
            if new:
                parts.append((job.res, new))
        try:
            event = self._scatter(parts) if parts else None
            if finished and not parts:
                event = self.copies.record()
        except Exception:
            # No event marks the copies (recording it failed: a CUDA error, which vLLM does
            # not survive). The finished loads have left _loads: report them all the same,
            # every block failed, so that none waits for good, then let the error through.
            for req_id, job in finished:
                if not job.stop.is_set():  # (an aborted request's blocks are freed, not failed)
                    job.res.failed_blocks = [b for chunk in job.spec.chunks for b in chunk.block_ids]
                self._reporting.append((None, req_id, job.res))
            raise
        self._reporting.extend((event, req_id, job.res) for req_id, job in finished)

    # -- completion ------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str], idle: bool = True) -> tuple[set[str] | None, set[str] | None]:
        """``idle``: the step ran no forward pass (the engine only waits for loads).
        ``finished_req_ids``: requests that ended; one whose load is still in flight was
        aborted (vLLM holds its blocks until the load is reported): the load stops reading."""
        for req_id in finished_req_ids & self._loads.keys():
            self._loads[req_id].stop.set()
        if self._loads and (idle or self.busy_step_load_wait):
            # vLLM's engine loop spins on this thread while requests wait for their KV and
            # nothing else runs; a short wait here hands the GIL to the reader threads
            # (otherwise each of their GIL-releasing I/O calls waits a whole switch interval
            # to get it back). It ends as soon as a reader hands a chunk over or finishes.
            # On a GPU, never in a step with a forward pass (busy_step_load_wait).
            self._load_signal.clear()
            if not any(job.future.done() or not job.arrived.empty() for job in self._loads.values()):
                self._load_signal.wait(LOAD_POLL_S)
        self._scatter_arrived()
        # reported once their copies are done: on the CPU at once, on a GPU a step or so later
        done_recv = self._report_finished()
        self._release_landed()
        # Saves never hold blocks (see SchedulerSide.request_finished): nothing to report.
        self._maybe_log()
        return None, (done_recv or None)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call: the connector's own plus the store's deltas."""
        now = self.store.counters.snapshot()
        out, self.stats = self.stats, {}
        for k, v in now.items():
            d = v - self._last_counters.get(k, 0)
            if d:
                out["store_" + k] = d
        self._last_counters = now
        return {k: v for k, v in out.items() if v}

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        self._last_log = now
        c = self.store.counters.snapshot()
        log.info("kvtier: hits host=%d disk=%d misses=%d saved=%d dropped=%d corrupt=%d evicted=%d",
                 c["hits_host"], c["hits_disk"], c["misses"], c["saves_committed"],
                 c["dropped_saves"], c["corrupt_records"], c["evicted_disk"])
        if self.store.remote is not None:
            log.info("kvtier: remote hits=%d uploaded=%d dropped=%d unavailable=%d corrupt=%d",
                     c["remote_hits"], c["remote_saves"], c["remote_dropped"], c["remote_errors"],
                     c["remote_corrupt"])

    def close(self) -> None:
        """Stop. Asynchronous loads in flight stop at their next chunk (the engine is shutting
        down: none is reported), and their readers are waited for at most the store's
        ``close_timeout_s`` (a read that hangs, on a network file system, is left behind, as
        the store leaves a hung write); what they handed over is let go."""
        self._closing = True  # a reader stops at its next chunk, or its next hand-over
        for job in self._loads.values():
            job.future.cancel()
        futures_wait([job.future for job in self._loads.values()], timeout=self.store.config.close_timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.copies.synchronize()  # shutting down: let the copies in flight land
        for job in self._loads.values():
            with contextlib.suppress(Empty):
                while True:
                    job.arrived.get_nowait()
        self._loads.clear()
        self._report_finished()
        self._release_landed()
