"""Device-copy plumbing shared by the CPU and CUDA paths.

On CUDA, staging copies run on a side stream, to and from pinned host memory, and are
tracked with events: the host never waits for them on the model's thread; the compute
stream waits for them on the device where vLLM needs the data (``compute_waits_for``), and
other threads or later steps ask whether they are done (``done``). On the CPU the same calls
are plain synchronous copies and every event is ``None`` (done). Keeping both behind these
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

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream the copies run on (None on the CPU): for timing them."""
        return self._stream

    @contextlib.contextmanager
    def after_compute(self) -> Iterator[None]:
        """Run the enclosed copies after the work already queued on the compute stream."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event that completes when the copies enqueued so far on the side stream have
        (None on the CPU, where they already have)."""
        if self._stream is None:
            return None
        # blocking: a thread that waits on it (the writer, for a save's copies) sleeps
        # instead of spinning a core for up to a forward pass
        event = torch.cuda.Event(blocking=True)
        event.record(self._stream)
        return event

    @staticmethod
    def done(event: torch.cuda.Event | None) -> bool:
        """Whether the copies ``event`` marks have completed (never waits)."""
        return event is None or bool(event.query())

    def compute_waits_for(self, event: torch.cuda.Event | None) -> None:
        """Work enqueued from now on on the compute stream waits, on the device, for the copies
        ``event`` marks; the host does not wait."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """The host waits for every copy enqueued (shutdown and tests only: never in a step)."""
        if self._stream is not None:
            self._stream.synchronize()


class StepIndex:
    """The block ids of one step's copies, on the device, uploaded once per step.

    Building an index tensor from a Python list on CUDA is a synchronous copy: done per layer
    and chunk inside the side stream, it blocked the model's thread until the compute stream
    caught up. Here the ids of the whole step go into one reused pinned buffer and reach the
    device in one asynchronous copy, enqueued on the side stream before the copies that use
    them; callers take slices. On the CPU the buffer itself is the index (no copy). Buffers
    grow rarely (doubling) and are reused: no allocation per step in steady state. A buffer
    may be refilled only after the copies that use it are done: :class:`IndexRing` hands out
    one per batch of copies and takes it back then.
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


class IndexRing:
    """:class:`StepIndex` buffers for batches of copies still in flight.

    Copies are never awaited on the model's thread, so a step's index buffer may still be
    read by the device when the next step needs one: each batch takes a buffer (``take``)
    and gives it back with the event that marks its copies (``hold``); a buffer is reused
    only once its event is done. In steady state as many exist as batches overlap (two or
    three); none is made per step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[StepIndex] = []
        self._held: list[tuple[StepIndex, torch.cuda.Event | None]] = []
        self._all: list[StepIndex] = []

    @property
    def allocations(self) -> int:
        """Index buffers made or grown, all told (steady state: stops growing)."""
        return sum(ix.allocations for ix in self._all)

    def take(self) -> StepIndex:
        still = []
        for ix, event in self._held:
            if CopyStream.done(event):
                self._free.append(ix)
            else:
                still.append((ix, event))
        self._held = still
        if self._free:
            return self._free.pop()
        ix = StepIndex(self.device)
        self._all.append(ix)
        return ix

    def hold(self, ix: StepIndex, event: torch.cuda.Event | None) -> None:
        self._held.append((ix, event))
