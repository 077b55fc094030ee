"""A store as vLLM's scheduler sees it: lookups and leases on the shared index, nothing more.

The scheduler only answers "how much of this prompt is stored?" and promises what it
answered to a load. It needs no writer thread, host tier or I/O pools, and it must not keep
a view of its own: every answer comes from the store's index, which every worker and every
other server updates, so it never promises a chunk another process has evicted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.backends import open_shared
from kvtier.backends.index import Lease
from kvtier.config import CacheConfig
from kvtier.metrics import Counters
from kvtier.remote import open_remote

log = logging.getLogger("kvtier")


class StoreView:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.counters = Counters()  # the remote tier's (lookups only: no uploads from here)
        self.remote = open_remote(config, self.counters, writer=False)  # lazy: connects on use
        try:
            self._lock, self.backend = open_shared(config)
        except BaseException:
            if self.remote is not None:
                self.remote.close(0)
            raise
        self.lookup_errors = 0
        self._closed = False
        self._releaser: ThreadPoolExecutor | None = None
        self._releaser_pid = 0

    def count_present_chain(self, head: bytes, spans: Sequence[tuple[int, bytes]], *,
                            remote: bool = True) -> int:
        """How many leading chunks ``(token_start, key)`` of the chain whose first chunk is
        ``head`` the store holds (0 if the index cannot be read), counting on in the remote
        tier unless ``remote`` is False. Reads the chain's chunks where the index keeps them
        side by side: a few pages per prompt, also when cold."""
        try:
            n = self.backend.count_present_chain(head, spans)
        except Exception as exc:
            self.lookup_errors += 1
            log.warning("kvtier: lookup failed (%s); treating as a miss", exc)
            return 0
        if n < len(spans) and remote and self.remote is not None:  # the shared tier may hold the rest
            n += self.remote.count_present_prefix([k for _, k in spans[n:]])
        return n

    def present_each(self, keys: Sequence[bytes], *, remote: bool = True) -> list[bool]:
        """Whether each of ``keys`` is stored, here or (with ``remote``) in the remote tier, in
        one index read (and one remote lookup for those not here); all False if the index
        cannot be read."""
        try:
            there = self.backend.present_each(keys)
        except Exception as exc:
            self.lookup_errors += 1
            log.warning("kvtier: lookup failed (%s); treating as a miss", exc)
            return [False] * len(keys)
        return there if self.remote is None or not remote else self.remote.or_present(keys, there)

    def lease(self, keys: Sequence[bytes], seconds: float) -> Future[Lease]:
        """Keep ``keys``, and the chunks they extend, from eviction for ``seconds`` (the
        loads promised to vLLM), or until :meth:`release`, which takes what this returns.
        Written on the index's writer thread, as releases are: an index write waits for any
        other process's commit (a server's eviction, at its budget), and vLLM's scheduling
        loop must not. A lease written late, or not at all (its result is then empty), may let
        a chunk be evicted before it is read: a recompute, not an error."""
        if self._closed:  # (shutting down: no load will need it)
            none: Future[Lease] = Future()
            none.set_result({})
            return none
        return self._writer().submit(self._lease_now, keys, seconds)

    def _lease_now(self, keys: Sequence[bytes], seconds: float) -> Lease:
        try:
            return self.backend.lease(keys, seconds)
        except Exception as exc:
            log.warning("kvtier: could not lease chunks for a load (%s)", exc)
            return {}

    def release(self, held: Future[Lease]) -> None:
        """End a lease whose load is done (else it holds until it expires: eviction would
        take fresher chunks instead); on the same thread, after the lease was written."""
        if not self._closed:
            self._writer().submit(self._release_now, held)

    def _writer(self) -> ThreadPoolExecutor:
        """The one thread that writes leases and releases, in the order they were asked."""
        if self._releaser is None or self._releaser_pid != os.getpid():  # (none is inherited by fork)
            self._releaser = ThreadPoolExecutor(1, thread_name_prefix="kvtier-release")
            self._releaser_pid = os.getpid()
        return self._releaser

    def _release_now(self, held: Future[Lease]) -> None:
        # (a lease asked before a fork, on the parent's thread, is not this process's: none)
        lease = held.result() if held.done() else {}
        if not lease:
            return
        try:
            self.backend.release(lease)
        except Exception as exc:
            log.warning("kvtier: could not release a load's lease (%s); it expires by itself", exc)

    def register_namespace(self, namespace_id: bytes, description: dict[str, object]) -> None:
        self.backend.register_namespace(namespace_id, description)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._releaser is not None and self._releaser_pid == os.getpid():
                # the releases queued go first (bounded: a hung index must not hang shutdown)
                self._releaser.shutdown(wait=False)
                for t in getattr(self._releaser, "_threads", ()):
                    t.join(float(self.config.close_timeout_s))
            if self.remote is not None:
                self.remote.close()
            self.backend.close()
            self._lock.release()
