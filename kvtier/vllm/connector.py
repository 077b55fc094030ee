"""``KVTierConnector``: vLLM's KV-connector interface over kvtier's tiered store.

One class serves both roles vLLM creates: the scheduler role (prefix lookups, load and save
plans; :mod:`kvtier.vllm.scheduler_side`) and the worker role (copies between paged blocks
and chunks; :mod:`kvtier.vllm.worker_side`). When the model's KV is something kvtier does
not handle (hybrid/mamba, MLA, sliding window, quantized KV, an unknown attention backend)
the connector logs one line and turns itself off; the engine serves normally. The same
happens for a vLLM version or an engine setting kvtier does not know (:mod:`kvtier.vllm.compat`),
for weights it cannot fingerprint (:mod:`kvtier.vllm.identity`), and for any unexpected error
while starting: a cache must never take the server down. Only a mistake in kvtier's own
settings stops start-up, with a message naming the setting.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvtier.errors import ConfigError, KVTierError, StoreDamaged, StoreFull
from kvtier.store import ChunkStore
from kvtier.store_view import StoreView
from kvtier.vllm.compat import release_from_vllm, startup_problem
from kvtier.vllm.identity import IdentityUnavailable, LoraFingerprints, model_fingerprint
from kvtier.vllm.layout import BACKEND_CONTENT, UnsupportedLayout, probe_cpu_layout
from kvtier.vllm.metadata import KVTierMetadata
from kvtier.vllm.namespace import build_namespace, kv_geometry, model_identity
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.settings import ConnectorSettings
from kvtier.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.vllm.worker_side import UNSAFE_SAVE_STEPS, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier")


def _route_logs_through_vllm() -> None:
    """Send kvtier's log lines through vLLM's handlers (same format, same destination)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


_route_logs_through_vllm()


def _cache_hit_source() -> Any:
    """How vLLM's metrics label our hits (vLLM >= 0.32 has the enum; 0.30 and 0.31 don't)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return getattr(CacheHitSource, "DISK", None) or getattr(CacheHitSource, "HOST", None)


def _any_tp_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank of this worker's tensor-parallel group (a small
    all-reduce on its CPU group; every rank calls it in the same steps: those with
    synchronous loads, which the scheduler sends to every rank alike)."""
    from vllm.distributed.parallel_state import get_tp_group

    t = torch.tensor([int(flag)], dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return bool(t.item())


def _sync_loads_unsafe(vllm_config: Any) -> str | None:
    """Why vLLM would mishandle a failed synchronous load here, or None. vLLM rolls such a
    request back to recompute the blocks, but with asynchronous scheduling it leaves the
    output placeholders it reserved for the step in flight, and recomputes with them:
    garbage token ids (on the CPU the engine fails with an embedding IndexError; vLLM issue
    49250, part 2). Model runner V2 keeps the old computed-token count on the device and
    recomputes from the wrong offset, in either scheduling mode (part 1, as reported there;
    V2 needs Triton, so it never runs here)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler, "async_scheduling", None):
        return "vLLM schedules asynchronously (async_scheduling)"
    try:
        v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # (a property that judges the config: not this connector's business)
        v2 = False
    return "vLLM runs its model runner V2" if v2 else None


def _micro_batched(vllm_config: Any) -> bool:
    """Whether vLLM may split a forward pass into micro-batches (dual-batch overlap,
    ``enable_dbo``; or ``ubatch_size`` above 1). Each micro-batch then runs every layer on a
    thread of its own and calls ``save_kv_layer`` for it, so a layer's first call comes
    before the other micro-batch has written its KV."""
    pc = vllm_config.parallel_config
    return bool(getattr(pc, "enable_dbo", False)) or int(getattr(pc, "ubatch_size", 1) or 1) > 1


def _layer_waits_run(forward_context: Any) -> bool:
    """Whether this forward pass runs the attention layers' hooks (``wait_for_layer_load``):
    not where it replays a full CUDA graph. (kvtier asks vLLM for piecewise graphs where loads
    are synchronous, but vLLM can turn that back into full graphs, e.g. with
    ``pass_config.fuse_attn_quant``, and then replays them for uniform decode batches.)"""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) != "FULL"


def _unsafe_save_steps(vllm_config: Any) -> int:
    """How many steps' saves a failed synchronous load spoils (see ``UNSAFE_SAVE_STEPS``):
    one where vLLM is known to schedule synchronously, else two. (Where it is known to
    schedule asynchronously no load is synchronous: ``_sync_loads_unsafe``.)"""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return 1 if getattr(scheduler, "async_scheduling", None) is False else UNSAFE_SAVE_STEPS


def _cpu_content_layout(layer: Any, g: Any, vllm_config: Any) -> str | torch.Tensor | None:
    """The CPU backend's KV layout for this engine's kernel ISA, found by writing known values
    through vLLM's own cache-write op (see :func:`kvtier.vllm.layout.probe_cpu_layout`)."""
    from vllm import _custom_ops as ops

    isa = getattr(layer, "isa", None)
    if isa is None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(g.dtype, g.block_size, g.head_size,
                            str(getattr(vllm_config.cache_config, "cache_dtype", "auto")))

    def write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    layout = probe_cpu_layout(write, g.block_size, g.head_size, g.dtype)
    log.info("kvtier: CPU attention kernel %s stores KV %s", isa,
             "in a layout kvtier cannot invert" if layout is None
             else f"as {layout}" if isinstance(layout, str) else "in a packed layout (permuted copies)")
    return layout


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM turns its hybrid KV manager off for connectors without it, and
    hybrid mamba models then fail to start. Declaring it keeps such models starting; kvtier
    caches single-group KV only and turns itself off on several groups."""

    _cache_hit_source = _cache_hit_source()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Synchronous loads (``load_async: false``) are waited for layer by layer, in the
        attention layers' hooks, which a full CUDA graph replays without running: vLLM then
        uses piecewise graphs. Saves need no such thing (``wait_for_save`` copies whatever
        the hooks did not), so asynchronous loads keep full graphs."""
        return (extra_config or {}).get("load_async", True) is False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.settings = ConnectorSettings.from_extra_config(ktc.kv_connector_extra_config)
        if self.settings.save_wait_s and ktc.kv_role != "kv_producer":
            raise ConfigError("save_wait_s: only for an offline producer (kv_role \"kv_producer\", as "
                              "kvtier warmup runs); an engine that serves must never wait for storage")
        # A cache miss must never fail a request: vLLM reads this right after creating us.
        ktc.kv_load_failure_policy = self.settings.load_failure_policy
        self._can_save = ktc.kv_role in ("kv_both", "kv_producer")
        self._can_load = ktc.kv_role in ("kv_both", "kv_consumer")
        self._store: ChunkStore | None = None  # the worker side's tiered store
        self._view: StoreView | None = None  # the scheduler side's lookups
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self.disabled_reason: str | None = None
        self.prefetch: Future[int] | None = None  # the start-up prefetch into the host tier
        # When the worker side is off but the scheduler side planned loads/saves, the worker
        # still answers: loads fail (vLLM recomputes).
        self._orphan_loads: set[str] = set()
        self._orphan_blocks: set[int] = set()

        try:
            self._start(vllm_config, role, kv_cache_config)
        except (StoreDamaged, StoreFull) as exc:  # a cache, not the server's business: serve without it
            self._close_store()
            if self.role == KVConnectorRole.SCHEDULER:
                self._disable(str(exc))
            else:  # (a worker may fail where its scheduler did not: say so there too)
                self._disable_worker(str(exc))
        except (KVTierError, OSError):
            self._close_store()
            raise  # the user's settings or store path: they must see it and fix it
        except IdentityUnavailable as exc:
            self._close_store()
            self._disable(str(exc))
        except Exception as exc:  # never take the server down over a cache
            self._close_store()
            log.debug("kvtier: start-up failure", exc_info=True)
            self._disable(f"unexpected error while starting ({type(exc).__name__}: {exc})")

    def _start(self, vllm_config: VllmConfig, role: KVConnectorRole,
               kv_cache_config: KVCacheConfig | None) -> None:
        ktc = self._kv_transfer_config
        problem = startup_problem(vllm_config)
        if problem:
            self._disable(problem)
            return
        geometry, reason = kv_geometry(kv_cache_config)
        if geometry is None:
            self._disable(reason)
            return
        if self.settings.cache.chunk_tokens % geometry.block_size:
            raise ConfigError(
                f"chunk_tokens: {self.settings.cache.chunk_tokens} must be a multiple of vLLM's "
                f"block_size ({geometry.block_size}); e.g. set chunk_tokens to "
                f"{max(1, 256 // geometry.block_size) * geometry.block_size}")
        chunk_bytes = (len(geometry.layer_names) * 2 * self.settings.cache.chunk_tokens
                       * geometry.num_kv_heads * geometry.head_size * geometry.dtype.itemsize)
        for name in ("max_record_bytes", "write_queue_bytes"):
            if getattr(self.settings.cache, name) < chunk_bytes:
                raise ConfigError(
                    f"{name}: {getattr(self.settings.cache, name)} bytes is smaller than one chunk of "
                    f"this model ({chunk_bytes} bytes); raise it or lower chunk_tokens")
        self._geometry = geometry
        # Once per process. vLLM creates connectors after loading the model, which may touch a
        # worker's copy of the config, so records take the scheduler's namespace ids from the
        # step metadata rather than this process's own.
        self._identity = model_identity(vllm_config)
        # Open the store first: the weights-fingerprint cache lives inside it. The scheduler
        # only looks up (the shared index); workers save and load.
        if role == KVConnectorRole.SCHEDULER:
            self._view = StoreView(self.settings.cache)
        else:
            self._store = ChunkStore(self.settings.cache)
        fingerprints = self.settings.cache.path / "fingerprints.json"
        self._fingerprint = model_fingerprint(vllm_config, self.settings.weights_fingerprint, fingerprints)
        if role == KVConnectorRole.SCHEDULER:
            namespaces = [build_namespace(str(vllm_config.model_config.model), geometry,
                                          self.settings.cache.chunk_tokens, self._fingerprint,
                                          self._identity, r, self._tp_size) for r in range(self._tp_size)]
            loras = LoraFingerprints(fingerprints, getattr(vllm_config.load_config, "download_dir", None))
            load_async = self.settings.load_async
            unsafe = None if load_async else _sync_loads_unsafe(vllm_config)
            if unsafe:
                log.warning("kvtier: load_async: false is not used, loads are asynchronous: %s, and "
                            "then recomputes a failed synchronous load wrongly (vLLM issue 49250); remove "
                            "the setting (it also keeps vLLM on piecewise CUDA graphs)", unsafe)
                load_async = True
            self._sched = SchedulerSide(self._view, namespaces, geometry.block_size, loras,
                                        can_load=self._can_load, can_save=self._can_save,
                                        save_partial=self.settings.save_partial_chunks,
                                        load_async=load_async,
                                        save_decode=self.settings.save_decode_chunks)
            remote = self._view.remote
            log.info("kvtier: connector on (%s, store %s, backend %s, namespace %s%s)",
                     ktc.kv_role, self.settings.cache.path, self.settings.cache.backend,
                     namespaces[0].id.hex(), f", remote {remote.address.describe()}" if remote else "")

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._view is not None:
            self._view.close()
            self._view = None

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        if self.role == KVConnectorRole.SCHEDULER:
            log.warning("kvtier: connector disabled for this model: %s; serving without a KV cache tier", reason)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future miss

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.disabled_reason:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        g = self._geometry
        names = [n for n in g.layer_names if n in kv_caches]
        if len(names) != len(g.layer_names):
            self._disable_worker("KV caches of some layers were not registered")
            return
        ctx = self._vllm_config.compilation_config.static_forward_context
        backends = {ctx[n].attn_backend.get_name() for n in names if n in ctx and hasattr(ctx[n], "attn_backend")}
        contents = {BACKEND_CONTENT.get(b) for b in backends}
        if len(contents) != 1 or None in contents:
            self._disable_worker(f"attention backend {sorted(backends)} has a KV layout kvtier does not handle")
            return
        content = contents.pop()
        if content == "cpu":
            content = _cpu_content_layout(ctx[names[0]], g, self._vllm_config)
            if content is None:
                self._disable_worker("the CPU attention kernel stores KV in a form kvtier cannot invert")
                return
        rank = get_tensor_model_parallel_rank()
        ns = build_namespace(str(self._vllm_config.model_config.model), g, self.settings.cache.chunk_tokens,
                             self._fingerprint, self._identity, rank,
                             self._tp_size)
        try:
            self._worker = WorkerSide(self._store, ns, names, kv_caches, content, g.block_size,
                                      any_rank=_any_tp_rank if self._tp_size > 1 else None,
                                      save_wait_s=self.settings.save_wait_s,
                                      unsafe_save_steps=_unsafe_save_steps(self._vllm_config),
                                      stage_bytes=self.settings.device_stage_bytes,
                                      copy_bytes=self.settings.device_copy_bytes,
                                      layer_hooks=not _micro_batched(self._vllm_config))
        except UnsupportedLayout as exc:
            self._disable_worker(f"unexpected KV tensor layout ({exc})")
            return
        except KVTierError:  # e.g. chunk buffers the host cannot hold: start-up stops
            if not release_from_vllm(self):
                self.shutdown()
            raise
        if not self._worker.layer_hooks:
            log.info("kvtier: vLLM splits forward passes into micro-batches: each step's saves are "
                     "copied after its forward pass")
        if self.settings.prefetch_bytes and self._can_load:
            self.prefetch = self._store.prefetch_recent(ns.id, self.settings.prefetch_bytes,
                                                        self.settings.prefetch_reader)

    def _disable_worker(self, reason: str) -> None:
        self.disabled_reason = reason
        log.warning("kvtier: connector disabled on this worker: %s; serving without it", reason)

    def _meta(self) -> KVTierMetadata | None:
        if self._worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVTierMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.uses:
            self._worker.record_uses(meta.uses)  # type: ignore[union-attr]
        if meta is not None and meta.loads:
            self._worker.start_loads(meta, layer_waits=_layer_waits_run(forward_context))  # type: ignore[union-attr]
        elif self._worker is None and self.has_connector_metadata():
            orphan = self._get_connector_metadata()
            if isinstance(orphan, KVTierMetadata):
                if self._tp_size > 1 and any(spec.sync for spec in orphan.loads):
                    with contextlib.suppress(Exception):  # the other ranks' workers ask: answer
                        _any_tp_rank(True)
                for spec in orphan.loads:
                    # every block fails; only an asynchronous load's request is waiting to
                    # be reported finished (vLLM asserts that of any it is told about)
                    if not spec.sync:
                        self._orphan_loads.add(spec.req_id)
                    for chunk in spec.chunks:
                        self._orphan_blocks.update(chunk.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # asynchronous loads: nothing to wait for (a request runs only after its load
        # finished); synchronous ones: the compute stream waits for this layer's copies
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or not meta.saves:
            return
        try:
            self._worker.save_layer(meta, layer_name)  # type: ignore[union-attr]
        except Exception as exc:  # a failed copy costs a future miss, never the step
            log.warning("kvtier: staging a save failed: %s", exc)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            try:
                self._worker.finish_saves(self._meta())
            except Exception as exc:
                log.warning("kvtier: handing saves to the store failed: %s", exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            recving, self._orphan_loads = self._orphan_loads, set()
            return None, recving or None
        meta = self._meta()
        return self._worker.get_finished(finished_req_ids, idle=meta is None or meta.idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            blocks, self._orphan_blocks = self._orphan_blocks, set()
            return blocks
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return KVTierStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._close_store()

    # ============================== scheduler side ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None:
            return 0, False
        try:
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:  # a lookup fault is a miss
            log.warning("kvtier: lookup failed: %s", exc)
            return 0, False

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            try:
                self._sched.on_new_request(request)
            except Exception as exc:
                log.warning("kvtier: hashing a new request failed: %s", exc)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._sched is None:
            return KVTierMetadata()
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            try:  # (failures first: a load reported failed is also reported done)
                self._sched.loads_failed(connector_output.invalid_block_ids or set())
                self._sched.loads_finished(connector_output.finished_recving or ())
            except Exception as exc:  # (a lease not released expires by itself)
                log.warning("kvtier: releasing finished loads failed: %s", exc)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        return self._sched.request_finished(request), None

    def reset_cache(self) -> bool:
        """vLLM asks connectors to drop cached KV, e.g. after the weights were updated in place.

        kvtier's store is keyed by the weights fingerprint taken at start-up, which cannot see
        weights changed in memory: this process stops looking up and saving (vLLM recomputes),
        and the store is left intact for servers that still run the fingerprinted weights.
        """
        if self._sched is not None:
            self._sched = None
            log.warning("kvtier: vLLM reset the connector's cache (weights may have changed in "
                        "place); kvtier stops caching in this process. Restart the server to "
                        "cache again.")
        return True

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats | None:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
