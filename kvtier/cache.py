"""The library API: save, find and load the KV of token sequences, without vLLM.

    from kvtier import KVCache, Namespace

    ns = Namespace(model="my-model", weights_fingerprint="sha256:...", dtype="bfloat16",
                   kv_shape=(layers, 2, kv_heads, head_dim))
    with KVCache.open("/data/kvcache", ns) as cache:
        cache.save(tokens, kv)                  # kv: [layers, 2, len(tokens), kv_heads, head_dim]
        n = cache.lookup(tokens)                # longest cached prefix, in tokens
        kv_prefix = cache.load(tokens)          # [layers, 2, n, kv_heads, head_dim]

Chunks are ``namespace.chunk_tokens`` tokens; the trailing part of a sequence is saved too,
rounded down to ``tail_granularity`` tokens, so an exact re-sent sequence hits in full.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvtier.codec import DTYPE_CODES, LAYOUT_CODES, dtype_name
from kvtier.config import CacheConfig, seconds
from kvtier.errors import ConfigError, StoreError
from kvtier.keys import (
    FORMAT_VERSION,
    NO_EXTRAS,
    ChunkRef,
    Namespace,
    RankedChunk,
    RequestExtras,
    as_token_array,
    chain_seed,
    chunk_keys,
    is_integer,
    match_prefix,
    ranked_chunk_keys,
)
from kvtier.store import ChunkStore

TOKEN_AXIS = 2  # canonical layout [layers, k/v, tokens, kv_heads, head_dim]


class KVCache:
    """A cache of one namespace's KV over a :class:`ChunkStore`."""

    def __init__(self, store: ChunkStore, namespace: Namespace, *, tail_granularity: int = 16,
                 owns_store: bool = True) -> None:
        """A cache over an open ``store``. ``owns_store``: :meth:`close` closes the store too;
        pass False for caches that share one store (several namespaces), and close the store
        yourself."""
        if not isinstance(store, ChunkStore):
            raise TypeError(f"KVCache(store, namespace): store must be an open kvtier.ChunkStore, got "
                            f"{type(store).__name__}; to open a store by its path, use "
                            "KVCache.open(path, namespace, config)")
        _check_namespace(namespace, "KVCache(store, namespace)")
        if store.closed:  # (its index is closed too: registering would read as a damaged store)
            raise StoreError(f"{store.config.path}: KVCache(store, namespace): the store was closed; open it "
                             "again (or use KVCache.open(path, namespace, config))")
        self._dtype = _check_fits(namespace, store.config, tail_granularity, writes=not store.readonly)
        self.store = store
        self.namespace = namespace
        self.tail_granularity = tail_granularity
        self._owns_store = owns_store
        if not store.readonly:
            store.backend.register_namespace(namespace.id, namespace.describe())

    @classmethod
    def open(cls, path: str | Path, namespace: Namespace, config: CacheConfig | None = None,
             *, tail_granularity: int = 16, readonly: bool = False) -> KVCache:
        """Open (creating if needed) the store at ``path`` for ``namespace``."""
        _check_namespace(namespace, "KVCache.open(path, namespace, config)")
        if config is not None and not isinstance(config, CacheConfig):
            raise TypeError(f"KVCache.open(path, namespace, config): config must be a kvtier.CacheConfig, got "
                            f"{type(config).__name__} (CacheConfig.from_dict({{...}}) for a dict of settings)")
        cfg = config.replaced(path=Path(path)) if config else CacheConfig(
            path=Path(path), chunk_tokens=namespace.chunk_tokens)
        _check_fits(namespace, cfg, tail_granularity, writes=not readonly)  # before the store is created or changed
        store = ChunkStore(cfg, readonly=readonly)
        try:
            return cls(store, namespace, tail_granularity=tail_granularity)
        except BaseException:
            store.close(flush=False)  # don't leak threads and the store lock on a bad argument
            raise

    def _open_for(self, what: str, *, writes: bool = False) -> None:
        """Refuse a call that could only be lost: on a closed cache (it would save nothing
        and find nothing, silently) or, for a save, on one opened read-only."""
        if self.store.closed:
            raise StoreError(f"{self.store.config.path}: cannot {what}: this cache's store was closed (by its "
                             "close(), or another KVCache's that owned the same ChunkStore: give caches "
                             "that share one owns_store=False); open it again")
        if writes and self.store.readonly:
            raise StoreError(f"{self.store.config.path}: cannot {what}: this cache was opened read-only; "
                             "open it without readonly=True to save")

    # -- keys ----------------------------------------------------------------------
    def _seed(self, extras: RequestExtras) -> bytes:
        return chain_seed(self.namespace, extras)

    def chunks(self, tokens: Sequence[int] | np.ndarray, extras: RequestExtras = NO_EXTRAS) -> list[ChunkRef]:
        """The chunks a save of ``tokens`` writes (full chunks, then the rounded-down tail)."""
        return chunk_keys(as_token_array(tokens), self._seed(extras), self.namespace.chunk_tokens,
                          self.tail_granularity)

    def match(self, tokens: Sequence[int] | np.ndarray, extras: RequestExtras = NO_EXTRAS) -> list[ChunkRef]:
        """The stored chunks covering the longest cached prefix of ``tokens``, in order."""
        self._open_for("look up")
        arr = as_token_array(tokens)
        seeds = (self._seed(extras),)
        full = ranked_chunk_keys(arr, seeds, self.namespace.chunk_tokens, None)

        def present(cs: list[RankedChunk]) -> int:  # a prompt's chunks, read in chain order
            if not cs:
                return 0
            head = cs[0].keys[0] if cs[0].start == 0 else full[0].keys[0]
            return self.store.count_present_chain(head, [(c.start, c.keys[0]) for c in cs])

        def present_each(cs: list[RankedChunk]) -> list[bool]:
            return self.store.present_each([c.keys[0] for c in cs], remote=True)

        hits = match_prefix(arr, seeds, full, self.namespace.chunk_tokens, self.tail_granularity,
                            present, present_each)
        return [ChunkRef(h.keys[0], h.start, h.end) for h in hits]

    # -- operations ----------------------------------------------------------------
    def save(self, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor,
             extras: RequestExtras = NO_EXTRAS, *, wait: float = 0.0) -> int:
        """Queue the KV of ``tokens`` for storage; return the number of tokens queued.

        ``kv`` is ``[layers, 2, len(tokens), kv_heads, head_dim]`` in the namespace's dtype.
        Chunks already stored are skipped. Saving is write-behind: call :meth:`flush` to wait.
        A chunk the write queue has no room for is dropped (and counted), as a server must;
        with ``wait`` (seconds, for this whole call) it waits for the writer to make room
        instead, so an offline caller can save a prompt larger than the queue.
        """
        self._open_for("save", writes=True)
        seconds("save(wait=...)", wait)
        arr = as_token_array(tokens)
        self._check_kv(kv, len(arr))
        kv = kv.detach().cpu()
        until = time.monotonic() + wait if wait > 0 else None  # (this whole call's deadline)
        queued = 0
        parent: bytes | None = None
        refs = self.chunks(arr, extras)
        head = refs[0].key if refs else None
        for ref in refs:
            ref_parent, parent = parent, ref.key
            if self.store.count_present_prefix([ref.key]):
                continue
            part = kv.narrow(TOKEN_AXIS, ref.start, ref.num_tokens)
            chunk = self.store.buffer(tuple(part.shape), part.dtype, wait_until=until)  # pooled: no allocation per chunk
            if chunk is None:
                continue  # every buffer is queued for writing: dropped (and counted), like a full queue
            chunk.copy_(part)  # the store owns what it is given; never the caller's tensor
            if self.store.put(ref.key, chunk, namespace_id=self.namespace.id, token_start=ref.start,
                              num_tokens=ref.num_tokens, parent=ref_parent, head=head, wait_until=until):
                queued += ref.num_tokens
            chunk = None  # the store's now: this name must not keep it from the pool while we wait
        return queued

    def lookup(self, tokens: Sequence[int] | np.ndarray, extras: RequestExtras = NO_EXTRAS) -> int:
        """Length in tokens of the longest cached prefix of ``tokens``."""
        hits = self.match(tokens, extras)
        return hits[-1].end if hits else 0

    def load(self, tokens: Sequence[int] | np.ndarray, extras: RequestExtras = NO_EXTRAS,
             max_tokens: int | None = None) -> torch.Tensor:
        """The KV of the longest loadable cached prefix: ``[layers, 2, n, kv_heads, head_dim]``.

        Every chunk is verified; loading stops at the first chunk that is missing or fails
        verification, so the result is always a correct (possibly shorter, possibly empty) prefix.
        ``max_tokens``: load at most that many tokens, whole chunks (and the tail) only: the
        longest cached prefix that ends at or before it (so fewer than one chunk's worth
        loads nothing).
        The result's memory is its own, given back to the system when the result is dropped;
        it cannot grow in place (``resize_`` to a larger size raises and leaves that tensor's
        sizes changed: copy it instead).
        """
        self._open_for("load")
        if max_tokens is not None and (not is_integer(max_tokens) or max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer, 0 or more, got {max_tokens!r}")
        hits = self.match(tokens, extras)
        if max_tokens is not None:
            hits = [h for h in hits if h.end <= max_tokens]
        n = hits[-1].end if hits else 0
        layers, two, heads, dim = self.namespace.kv_shape
        # memory of its own: dropping it gives the memory back (a loop over requests stays flat)
        out = self.store.results.empty((layers, two, n, heads, dim), self._dtype)
        dsts = [out.narrow(TOKEN_AXIS, ref.start, ref.num_tokens) for ref in hits]
        if out.numel() * out.element_size() * 4 > self.store.host.budget:
            # A bulk load (over a quarter of the host tier): decode each chunk straight into its slice of ``out``, in parallel,
            # and keep it out of the host tier (it would evict most of it, and the per-chunk
            # tensors it needs cost an allocation each, slower than the disk here).
            got = self.store.load_into([ref.key for ref in hits], dsts)
            return out if got == len(hits) else self._prefix(out, hits[got].start)
        # small: through the host tier, for reuse; in parallel, each read bounded by read_timeout_s
        with contextlib.closing(self.store.load_many([ref.key for ref in hits])) as reads:
            for ref, dst in zip(hits, dsts, strict=True):
                chunk = next(reads).tensor
                if chunk is None or tuple(chunk.shape) != tuple(dst.shape) or chunk.dtype != dst.dtype:
                    return self._prefix(out, ref.start)
                dst.copy_(chunk)
        return out

    def _prefix(self, kv: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` tokens of ``kv``, contiguous, in memory of their own."""
        part = kv.narrow(TOKEN_AXIS, 0, n)
        return self.store.results.empty(tuple(part.shape), part.dtype).copy_(part)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued saves are on the persistent tier."""
        self._open_for("flush")
        if timeout is not None:
            seconds("flush(timeout)", timeout)
        return self.store.flush(timeout)

    def stats(self) -> dict[str, object]:
        return self.store.stats()

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_kv(self, kv: torch.Tensor, n_tokens: int) -> None:
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}"
                            + (" (torch.from_numpy(kv) makes one)" if isinstance(kv, np.ndarray) else ""))
        layers, two, heads, dim = self.namespace.kv_shape
        want = (layers, two, n_tokens, heads, dim)
        if tuple(kv.shape) != want:
            raise ValueError(f"kv must have shape {list(want)} ([layers, 2, tokens, kv_heads, head_dim]), got {list(kv.shape)}")
        if kv.dtype != self._dtype:
            raise ValueError(f"kv dtype {kv.dtype} differs from the namespace's {self.namespace.dtype}")
        if kv.device.type == "meta":
            raise ValueError("kv is on the meta device: it has no values to save")


def _check_namespace(namespace: object, call: str) -> None:
    if not isinstance(namespace, Namespace):
        raise TypeError(f"{call}: namespace must be a kvtier.Namespace(model=..., weights_fingerprint=..., "
                        f"dtype=..., kv_shape=..., chunk_tokens=...), got {type(namespace).__name__}")


def _check_fits(namespace: Namespace, config: CacheConfig, tail_granularity: int, *,
                writes: bool) -> torch.dtype:
    """Refuse a namespace that ``config`` cannot store (ConfigError); its torch dtype."""
    if namespace.chunk_tokens != config.chunk_tokens:
        raise ConfigError(
            f"chunk_tokens: namespace says {namespace.chunk_tokens}, store config says "
            f"{config.chunk_tokens}; they must agree")
    if not 0 < tail_granularity <= namespace.chunk_tokens or namespace.chunk_tokens % tail_granularity:
        raise ConfigError(
            f"tail_granularity: must divide chunk_tokens ({namespace.chunk_tokens}), got {tail_granularity}")
    # Both are part of the keys; records are written in this format's one layout whatever
    # the namespace says, so another value would label KV as what it is not.
    if namespace.layout not in LAYOUT_CODES:
        raise ConfigError(f"layout: records are stored as {', '.join(map(repr, LAYOUT_CODES))} "
                          f"([layers, k/v, tokens, kv_heads, head_dim]), got {namespace.layout!r}; "
                          "leave Namespace.layout at its default")
    if namespace.format_version != FORMAT_VERSION:
        raise ConfigError(f"format_version: this kvtier writes and reads format {FORMAT_VERSION}, the "
                          f"namespace says {namespace.format_version}; leave Namespace.format_version at its default")
    dtype = _torch_dtype(namespace.dtype)
    chunk_bytes = math.prod(namespace.kv_shape) * namespace.chunk_tokens * dtype.itemsize
    if chunk_bytes > config.max_record_bytes:
        raise ConfigError(
            f"max_record_bytes: {config.max_record_bytes} bytes is smaller than one chunk of this "
            f"namespace ({chunk_bytes} bytes); raise it or lower chunk_tokens")
    if writes and chunk_bytes > config.write_queue_bytes:  # (every save would be dropped)
        raise ConfigError(
            f"write_queue_bytes: {config.write_queue_bytes} bytes is smaller than one chunk of this "
            f"namespace ({chunk_bytes} bytes); raise it or lower chunk_tokens")
    return dtype


def _torch_dtype(name: str) -> torch.dtype:
    """The namespace's dtype, refused at open unless the record format stores it (else every
    save would be dropped later, in the background)."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ConfigError(f"dtype: unknown torch dtype {name!r}")
    canonical = dtype_name(dt)
    if canonical != name.removeprefix("torch."):  # an alias: "float", "half"
        raise ConfigError(f"dtype: {name!r} is an alias; give its name, {canonical!r} (it is part of the namespace)")
    if canonical not in DTYPE_CODES:
        raise ConfigError(f"dtype: kvtier's record format does not store {canonical!r}; it stores "
                          f"{', '.join(DTYPE_CODES)}")
    return dt
