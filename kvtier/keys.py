"""Content keys: a namespace plus a chained SHA-256 over token ids, one key per chunk.

Chunk i's key covers every token before it (it hashes its parent's key), so a key names a
whole prefix, not just its own tokens. Keys are stable across processes and restarts: they
depend only on token ids, the namespace and the request extras, never on Python's ``hash``.
SHA-256 (not a fast non-cryptographic hash) because a crafted prompt must not be able to
collide with another tenant's prefix.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

# Bump when the meaning of stored bytes changes; it is part of every namespace.
FORMAT_VERSION = 1

KEY_BYTES = 32
# A lookup tries trailing partial chunks at multiples of this many tokens (or of the block
# size, where it is smaller), not only of its own block size: a tail saved by a server with
# a smaller block size is then found after a restart with a larger one (see tail_lookup_step).
TAIL_LOOKUP_STEP = 16
NAMESPACE_ID_BYTES = 16
_UINT_IS_32 = array.array("I").itemsize == 4


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the KV bytes of a token prefix.

    Two processes share cached KV only if every field is equal. ``kv_shape`` is the
    canonical per-token shape ``(layers, 2, kv_heads, head_dim)`` of this rank's heads.
    """

    model: str
    weights_fingerprint: str
    dtype: str
    kv_shape: tuple[int, int, int, int]
    chunk_tokens: int = 256
    layout: str = "LKTHD"
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # Checked here, not where the namespace is used: a wrong type would otherwise key the
        # KV under a namespace nobody else can name ("16" is not 16) or fail deep inside.
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))  # torch.bfloat16
        for name in ("model", "weights_fingerprint", "dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"Namespace: {name} must be a non-empty string, got {value!r}"
                                + (" (a digest of the model's weights, e.g. 'sha256:...': KV is never keyed "
                                   "by a model's name alone)" if name == "weights_fingerprint" else ""))
        for name in ("chunk_tokens", "tp_rank", "tp_size", "format_version"):
            value = getattr(self, name)
            if not is_integer(value):
                raise TypeError(f"Namespace: {name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        try:
            shape = tuple(self.kv_shape)
        except TypeError:  # (not iterable)
            shape = ()
        if len(shape) != 4 or not all(is_integer(d) for d in shape) or shape[1] != 2 or min(shape) <= 0:
            raise ValueError(f"kv_shape must be (layers, 2, kv_heads, head_dim), integers, got {self.kv_shape!r}")
        object.__setattr__(self, "kv_shape", tuple(int(d) for d in shape))
        if self.chunk_tokens <= 0:
            raise ValueError(f"Namespace: chunk_tokens must be 1 or more, got {self.chunk_tokens}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be in [0, tp_size={self.tp_size})")
        extra = self.extra.items() if isinstance(self.extra, dict) else self.extra
        try:
            pairs = tuple((k, v) for k, v in extra)
        except (TypeError, ValueError):
            pairs = None
        if pairs is None or not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
            raise TypeError(f"Namespace: extra must be (name, value) pairs of strings (or a dict of them), "
                            f"got {self.extra!r}")
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError(f"Namespace: extra names a setting twice: {self.extra!r}")
        object.__setattr__(self, "extra", tuple(sorted(pairs)))  # (the id does not depend on the order)

    def describe(self) -> dict[str, object]:
        """A JSON-ready description (what ``kvtier ls`` shows)."""
        d = asdict(self)
        d["kv_shape"] = list(self.kv_shape)
        d["extra"] = dict(self.extra)
        return d

    @functools.cached_property
    def id(self) -> bytes:
        """16-byte identifier: SHA-256 of the canonical JSON description (computed once: the
        namespace is frozen, and a worker asks for it every step)."""
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).digest()[:NAMESPACE_ID_BYTES]


@dataclass(frozen=True)
class RequestExtras:
    """Per-request inputs that change KV beyond the token ids.

    ``cache_salt`` isolates tenants; ``lora`` names the adapter (name and path or id);
    ``mm_hashes`` are the content hashes of multimodal inputs with their token offsets.
    """

    cache_salt: str | None = None
    lora: str | None = None
    mm_hashes: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("cache_salt", "lora"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"RequestExtras: {name} must be a string or None, got {value!r}")
        try:
            mm = tuple((h, o) for h, o in self.mm_hashes)
        except (TypeError, ValueError):
            mm = None
        if mm is None or not all(isinstance(h, str) and h and is_integer(o) and o >= 0 for h, o in mm):
            raise TypeError("RequestExtras: mm_hashes must be (content hash, token offset) pairs: a non-empty "
                            f"string and an integer of 0 or more, got {self.mm_hashes!r}")
        object.__setattr__(self, "mm_hashes", tuple((h, int(o)) for h, o in mm))

    def canonical(self) -> bytes:
        return json.dumps(
            {"salt": self.cache_salt, "lora": self.lora, "mm": [list(m) for m in self.mm_hashes]},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()


NO_EXTRAS = RequestExtras()


def is_integer(value: object) -> bool:
    """An integer, Python's or numpy's, and not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


class ChunkRef(NamedTuple):
    """A chunk of a token sequence: tokens ``[start, end)`` and the key naming that prefix.

    A NamedTuple (immutable, like the frozen dataclass it was) because a lookup builds 512
    of them for a 128k-token prompt, and a tuple is built ~3x faster than a dataclass.
    """

    key: bytes
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def chain_seed(namespace: Namespace, extras: RequestExtras = NO_EXTRAS) -> bytes:
    """The parent 'key' of chunk 0: binds the namespace and the request extras."""
    if not isinstance(extras, RequestExtras):  # (a dict would fail deep inside, unexplained)
        raise TypeError(f"extras: expected kvtier.RequestExtras(cache_salt=..., lora=..., mm_hashes=...), "
                        f"got {type(extras).__name__}")
    h = hashlib.sha256(b"kvtier-chain\x00")
    h.update(namespace.id)
    h.update(extras.canonical())
    return h.digest()


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian uint32 array (hashing views of it costs no copies)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4") and tokens.ndim == 1:
        return np.ascontiguousarray(tokens)  # (hashing views its bytes: a strided array is copied once)
    if isinstance(tokens, list) and sys.byteorder == "little" and _UINT_IS_32:
        # array('I') converts a list of ints 3x faster than numpy and range-checks each one.
        try:
            return np.frombuffer(array.array("I", tokens), dtype="<u4")
        except (OverflowError, TypeError):
            pass  # fall through for the precise error below
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError):  # ragged nesting, say
        raise ValueError("token ids must be a one-dimensional sequence of integers") from None
    if arr.ndim == 0:  # (a generator, a scalar)
        raise ValueError(f"token ids must be a one-dimensional sequence of integers (a list or an "
                         f"array), got {type(tokens).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size:
        if arr.dtype.kind not in "iufO":
            raise ValueError(f"token ids must be integers, got {arr.dtype} values")
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.floor(arr))):
            raise ValueError("token ids must be integers, got fractional values")  # (0.5 would key as 0)
        if arr.dtype.kind == "O":  # (Decimal("0.5") would key as 0)
            odd = next((t for t in arr if not is_integer(t)), None)
            if odd is not None:
                raise ValueError(f"token ids must be integers, got {type(odd).__name__} values")
        try:  # in range before the cast, which would wrap what is not (ints beyond int64: object)
            if arr.min() < 0 or arr.max() >= 2**32:
                raise ValueError("token ids must be in [0, 2**32)")
        except TypeError:  # not numbers at all
            raise ValueError(f"token ids must be integers, got {arr.dtype} values") from None
    return arr.astype("<u4")


def child_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """Key of the chunk ``tokens`` that follows the prefix named ``parent``."""
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(memoryview(tokens).cast("B"))
    return h.digest()


def chunk_keys(
    tokens: np.ndarray,
    seed: bytes,
    chunk_tokens: int,
    tail_granularity: int | None = None,
) -> list[ChunkRef]:
    """Keys of the full chunks of ``tokens`` and, optionally, of its trailing partial chunk.

    The trailing partial chunk is rounded down to a multiple of ``tail_granularity``
    (e.g. vLLM's block size); ``None`` means no partial chunk.
    """
    # One byte view of the whole array and the length prefix computed once: slicing a
    # memoryview per chunk is far cheaper than a numpy slice + memoryview + cast each time.
    # The bytes hashed are exactly child_key's (tests pin a key value).
    mv = memoryview(np.ascontiguousarray(tokens, dtype="<u4")).cast("B")
    sha256 = hashlib.sha256
    refs: list[ChunkRef] = []
    parent = seed
    n = len(tokens)
    full = n // chunk_tokens
    step = chunk_tokens * 4
    length = chunk_tokens.to_bytes(4, "little")
    for i in range(full):
        h = sha256(parent)
        h.update(length)
        h.update(mv[i * step : (i + 1) * step])
        parent = h.digest()
        s = i * chunk_tokens
        refs.append(ChunkRef(parent, s, s + chunk_tokens))
    if tail_granularity:
        s = full * chunk_tokens
        tail = (n - s) // tail_granularity * tail_granularity
        if tail:
            refs.append(ChunkRef(child_key(parent, tokens[s : s + tail]), s, s + tail))
    return refs


def tail_lookup_step(granularity: int) -> int:
    """The step between the tail lengths a lookup tries, for tails saved rounded down to
    ``granularity`` tokens (vLLM's block size). Finer than the block size where that is over
    :data:`TAIL_LOOKUP_STEP`: a tail saved at block size 32 (224 tokens) is found by a server
    restarted at 64, which loads the part of it its blocks hold (192)."""
    return math.gcd(granularity, TAIL_LOOKUP_STEP)


def partial_candidates(
    tokens: np.ndarray, parent: bytes, start: int, chunk_tokens: int, step: int
) -> list[ChunkRef]:
    """Partial chunks at ``start``, longest first, ``step`` tokens apart, that a lookup may
    find after the last full hit."""
    avail = min(len(tokens) - start, chunk_tokens - 1)
    longest = avail // step * step
    return [
        ChunkRef(child_key(parent, tokens[start : start + n]), start, start + n)
        for n in range(longest, 0, -step)
    ]


class RankedChunk(NamedTuple):
    """A chunk with one key per namespace (e.g. per tensor-parallel rank) over the same tokens."""

    start: int
    end: int
    keys: tuple[bytes, ...]


def ranked_chunk_keys(tokens: np.ndarray, seeds: Sequence[bytes], chunk_tokens: int,
                      tail_granularity: int | None = None) -> list[RankedChunk]:
    """:func:`chunk_keys` for several seeds at once, zipped chunk by chunk."""
    per_seed = [chunk_keys(tokens, s, chunk_tokens, tail_granularity) for s in seeds]
    return [RankedChunk(refs[0].start, refs[0].end, tuple(r.key for r in refs))
            for refs in zip(*per_seed, strict=True)]


def tail_candidates(tokens: np.ndarray, parents: Sequence[bytes], start: int, chunk_tokens: int,
                    granularity: int) -> list[RankedChunk]:
    """The partial chunks at ``start`` that a lookup tries, longest first, every
    :func:`tail_lookup_step`, with one key per parent (per tensor-parallel rank)."""
    step = tail_lookup_step(granularity)
    per_seed = [partial_candidates(tokens, p, start, chunk_tokens, step) for p in parents]
    return [RankedChunk(cs[0].start, cs[0].end, tuple(c.key for c in cs)) for cs in zip(*per_seed, strict=True)]


def match_prefix(tokens: np.ndarray, seeds: Sequence[bytes], full: list[RankedChunk],
                 chunk_tokens: int, granularity: int | None,
                 present: Callable[[list[RankedChunk]], int],
                 present_each: Callable[[list[RankedChunk]], list[bool]],
                 candidates: Callable[..., list[RankedChunk]] = tail_candidates) -> list[RankedChunk]:
    """The stored chunks covering the longest cached prefix of ``tokens``.

    ``full`` are the sequence's full chunks; ``present`` says how many leading chunks of a
    list are stored (for every key of each), ``present_each`` whether each chunk of a list is
    (one read for all). After the longest run of full chunks, the partial chunks that may
    follow it (when tails are saved rounded to ``granularity``) are looked up together, at
    every :func:`tail_lookup_step`, and the longest stored one is the last hit. It may end
    past what a caller with a larger block size can use: that caller loads a part of it.
    ``candidates`` (:func:`tail_candidates`' arguments) lets a caller that asks again keep them.
    """
    hits = full[: present(full)]
    if granularity:
        start = hits[-1].end if hits else 0
        parents = hits[-1].keys if hits else tuple(seeds)
        cands = candidates(tokens, parents, start, chunk_tokens, granularity)
        if cands:
            for cand, there in zip(cands, present_each(cands), strict=True):
                if there:
                    return [*hits, cand]
    return hits
