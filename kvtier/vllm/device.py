"""Device-copy plumbing shared by the CPU and CUDA paths.

On CUDA, staging copies run on a side stream into pinned host memory and are awaited once
per step; on the CPU the same calls are plain synchronous copies. Keeping both behind these
few functions means the code the CPU tests exercise is the code that runs on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch


class CopyStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self.is_cuda else None

    @property
    def non_blocking(self) -> bool:
        return self.is_cuda

    @contextlib.contextmanager
    def after_compute(self) -> Iterator[None]:
        """Run the enclosed copies after the work already queued on the compute stream."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class StepIndex:
    """The block ids of one step's copies, on the device, uploaded once per step.

    Building an index tensor from a Python list on CUDA is a synchronous copy: done per layer
    and chunk inside the side stream, it blocked the model's thread until the compute stream
    caught up. Here the ids of the whole step go into one reused pinned buffer and reach the
    device in one asynchronous copy, enqueued on the side stream before the copies that use
    them; callers take slices. On the CPU the buffer itself is the index (no copy). Buffers
    grow rarely (doubling) and are reused: no allocation per step in steady state. The
    buffer may be refilled only after the step's copies are done (``CopyStream.synchronize``,
    which every step ends with).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.long)
        self._dev = self._host
        self.allocations = 0  # times the buffers grew (steady state: stops growing)

    def upload(self, id_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One device tensor per list (slices of one buffer). Call inside
        ``CopyStream.after_compute()`` so the copy is ordered before the gathers."""
        total = sum(len(ids) for ids in id_lists)
        if total > self._host.numel():
            size = max(total, 2 * self._host.numel(), 256)
            self._host = torch.empty(size, dtype=torch.long, pin_memory=self.is_cuda)
            self._dev = torch.empty(size, dtype=torch.long, device=self.device) if self.is_cuda else self._host
            self.allocations += 1
        host = self._host.numpy()
        at, bounds = 0, []
        for ids in id_lists:
            host[at : at + len(ids)] = np.asarray(ids, dtype=np.int64)
            bounds.append((at, len(ids)))
            at += len(ids)
        if self.is_cuda and total:
            self._dev[:total].copy_(self._host[:total], non_blocking=True)
        return [self._dev.narrow(0, a, n) for a, n in bounds]
