"""One side of a KV pipe, in its own process: ``_pipe_peer.py send|recv WHERE NAME``.

Both sides build the same message list (shapes, dtypes, Nones) from a fixed seed; the
receiver checks each message it gets against it and prints ``received N``.
"""

from __future__ import annotations

import sys

import torch

from kvtier.pipe import KVPipe


def messages() -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(2, 2, 64, 4, 32, generator=g).to(torch.bfloat16),  # a KV-like block
        None,
        torch.randint(0, 50_000, (300,), generator=g),  # int64 token ids
        torch.randn(3, 5, generator=g, dtype=torch.float64),
        torch.zeros(0, 8, dtype=torch.float16),  # empty
        torch.tensor(3.5),  # 0-dim
        torch.rand(17, generator=g) > 0.5,  # bool
        torch.randn(1024, 1024, generator=g),  # 4 MiB float32: several parts in Redis
        None,
    ]


def main() -> None:
    role, where, name = sys.argv[1:4]
    with KVPipe(where, name, timeout_s=5.0) as pipe:
        if role == "send":
            for m in messages():
                pipe.send_tensor(m)
            return
        n = 0
        for want in messages():
            got = pipe.recv_tensor(timeout=60)
            if want is None:
                assert got is None, f"message {n}: expected None, got {got!r}"
            else:
                assert got is not None and got.dtype == want.dtype and got.shape == want.shape, (n, got)
                assert torch.equal(got, want), f"message {n} differs"
            n += 1
        print(f"received {n}")


if __name__ == "__main__":
    main()
