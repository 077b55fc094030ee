"""Device-copy plumbing shared by the CPU and CUDA paths.

On CUDA, staging copies run on a side stream into pinned host memory and are awaited once
per step; on the CPU the same calls are plain synchronous copies. Keeping both behind these
few functions means the code the CPU tests exercise is the code that runs on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
