"""The host-memory tier: decoded chunks in RAM under a byte budget, least recently used out.

Chunks are kept as tensors in the canonical layout, so a host hit is one copy into the
destination. The tensors are usually slots of the store's ``BufferPool`` (pinned when CUDA is
present, for fast device copies; ordinary memory on the CPU backend, same code).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            t = self._items.get(key)
            if t is not None:
                self._items.move_to_end(key)
            return t

    def put(self, key: bytes, tensor: torch.Tensor) -> int:
        """Insert (the tier keeps a reference; the caller must not modify the tensor).

        Returns how many chunks were evicted to make room; a chunk bigger than the whole
        budget is not kept.
        """
        size = tensor.numel() * tensor.element_size()
        if size > self.budget:
            return 0
        evicted = 0
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            while self._bytes + size > self.budget and self._items:
                _, victim = self._items.popitem(last=False)
                self._bytes -= victim.numel() * victim.element_size()
                evicted += 1
            self._items[key] = tensor
            self._bytes += size
        return evicted

    def evict_oldest(self) -> bool:
        """Drop the least recently used chunk (its pooled buffer returns to the pool once no
        one else holds it); False if the tier is empty."""
        with self._lock:
            if not self._items:
                return False
            _, victim = self._items.popitem(last=False)
            self._bytes -= victim.numel() * victim.element_size()
        return True

    def discard(self, key: bytes, tensor: torch.Tensor | None = None) -> None:
        """Drop ``key``'s chunk (only if it is ``tensor``, where given)."""
        with self._lock:
            old = self._items.get(key)
            if old is None or (tensor is not None and old is not tensor):
                return
            del self._items[key]
            self._bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
