"""Crash consistency: a writer process saving continuously is killed with SIGKILL at many
different moments (while opening, encoding, committing, evicting, fsyncing). After each kill
the store reopens and every record that can be found verifies, bit for bit, against KV
regenerated from the chunk's tokens; nothing partial is ever visible."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from kvhelpers import Expected, Zygote, make_kv, open_cache, same_bits, seq_tokens, verify_store

# the disk budget is small so that kills also land in the middle of evictions
CFG = {"disk_bytes": "3M", "commit_bytes": "128K", "host_bytes": "8M"}
# (backend, durability) -> kill moments: ("fork", s) counts from the writer's start (kills
# while it creates or opens the store and makes its first save), ("open", s) from the
# moment it is open and saving steadily
_MOMENTS = [("fork", 0.0), ("fork", 0.03), ("fork", 0.07), ("fork", 0.12), ("open", 0.0),
            ("open", 0.005), ("open", 0.012), ("open", 0.02), ("open", 0.03), ("open", 0.045),
            ("open", 0.065), ("open", 0.09), ("open", 0.12), ("open", 0.16), ("open", 0.2)]
PLANS = {
    ("lmdb", "process"): _MOMENTS,
    ("lmdb", "power"): _MOMENTS[1::2],
    ("files", "process"): _MOMENTS,
    ("files", "power"): _MOMENTS[1::2],
}


@pytest.mark.parametrize(("backend", "durability"), list(PLANS))
def test_sigkilled_writer_never_leaves_partial_records(zygote: Zygote, tmp_path: Path,
                                                       backend: str, durability: str) -> None:
    store, log = tmp_path / "store", tmp_path / "writer.log"
    exp = Expected(log=log)
    seed = time.time_ns() % 10_000
    rng = random.Random(seed)
    reports = []
    for n, (after, base) in enumerate(PLANS[(backend, durability)]):
        delay = base + rng.uniform(0, 0.005)
        rep = zygote.request("crash", timeout=60, delay=delay, after=after, kwargs={
            "path": str(store), "backend": backend, "durability": durability,
            "first": n * 100_000, "log": str(log), "cfg": CFG})
        context = (f"{backend}/{durability} kill #{n}, {delay * 1000:.0f} ms after {after} "
                   f"(seed {seed}): {rep}")
        assert rep["killed"], context
        exp.learn()
        found = verify_store(store, backend, exp, context, CFG)
        reports.append((after, rep, found))

    # the kills hit a writer with work in flight, at many different points, and records
    # survived them
    killed_saving = [r for after, r, _ in reports if after == "open" and r["saved"] > 0]
    assert len(killed_saving) >= len(reports) // 3, reports  # (under heavy load, fewer)
    assert len({r["saved"] for r in killed_saving}) >= len(killed_saving) // 2, reports
    assert reports[-1][2] > 0, reports

    # and through the library: every sequence loads a correct prefix (often nothing: the
    # small budget evicts the oldest chunks, which are the shared prefixes)
    with open_cache(store, backend, **CFG) as cache:
        for i in sorted(exp.seen):
            toks = seq_tokens(i)
            got = cache.load(toks)
            if got.shape[2]:
                assert same_bits(got, make_kv(toks[: got.shape[2]])), f"sequence {i} (seed {seed})"
        assert cache.stats()["corrupt_records"] == 0
