"""One self-describing record per chunk: a checked header followed by the payload.

Layout (little-endian)::

    magic "KVTIER\\0\\1" | format_version u16 | header_len u16 | codec u8 | dtype u8
    | layout u8 | ndim u8 | num_tokens u32 | token_start u64 | created_ns u64
    | raw_len u64 | payload_len u64 | key 32B | namespace_id 16B | payload_xxh3_128 16B
    | dims u64 * ndim | header_xxh3_64 u64 | payload

Every format version keeps the first three fields where they are and ends its header with
the header's own checksum, so a record of another version whose header is intact is told
apart from a damaged one (incompatible, kept) before anything else of it is read; one whose
header is longer than the first ``MAX_HEADER_BYTES`` a reader hands over is kept too (one
flipped bit in the version of a record of this version still fails the header checksum). A new
codec, dtype or layout code needs a new format version: an unknown code in a header of this
version is damage (or a crafted header), and is treated as such.

Decoding trusts nothing it has not checked: the header has its own checksum, lengths and
the shape are cross-checked before anything is allocated, and the payload checksum is
verified before a byte reaches the caller. No pickle, no torch.load: data cannot run code.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import xxhash
import zstandard

from kvtier.errors import DestinationMismatch, IncompatibleRecord, RecordError, RecordTooLarge
from kvtier.keys import FORMAT_VERSION, KEY_BYTES, NAMESPACE_ID_BYTES

if TYPE_CHECKING:  # torch is imported only where tensors are made: the CLI reads headers without it
    import torch

MAGIC = b"KVTIER\x00\x01"
_FIXED = struct.Struct("<8sHHBBBBIQQQQ32s16s16s")
_U64 = struct.Struct("<Q")
MAX_NDIM = 8


def header_bytes(ndim: int) -> int:
    """The length of a record's header for a tensor of ``ndim`` dimensions."""
    return _FIXED.size + 8 * ndim + 8


MAX_HEADER_BYTES = header_bytes(MAX_NDIM)
_MAX_DIM = 1 << 48  # no tensor dimension is larger (256 Ti elements)

CODEC_RAW = 0
CODEC_ZSTD = 1  # zstandard over byte planes (shuffled) for multi-byte dtypes
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd+shuffle"}

LAYOUTS = {1: "LKTHD"}  # [layers, k/v, tokens, kv_heads, head_dim]
LAYOUT_CODES = {v: k for k, v in LAYOUTS.items()}

# dtype code -> (torch dtype name, bytes per element)
DTYPE_INFO: dict[int, tuple[str, int]] = {
    1: ("float32", 4),
    2: ("float16", 2),
    3: ("bfloat16", 2),
    4: ("float8_e4m3fn", 1),
    5: ("float8_e5m2", 1),
    6: ("int8", 1),
    7: ("uint8", 1),
    # not KV dtypes: for tensors passed through a KV pipe (kvtier.pipe)
    8: ("int16", 2),
    9: ("int32", 4),
    10: ("int64", 8),
    11: ("float64", 8),
    12: ("bool", 1),
}
DTYPE_CODES = {name: code for code, (name, _) in DTYPE_INFO.items()}


def torch_dtypes() -> dict[int, torch.dtype]:
    """The record format's dtypes as torch dtypes, by code."""
    import torch

    return {code: getattr(torch, name) for code, (name, _) in DTYPE_INFO.items()}


@dataclass(frozen=True)
class RecordHeader:
    format_version: int
    header_len: int
    codec: int
    dtype_name: str  # torch's name, e.g. "bfloat16"
    layout: str
    shape: tuple[int, ...]
    num_tokens: int
    token_start: int
    created_ns: int
    raw_len: int
    payload_len: int
    key: bytes
    namespace_id: bytes
    checksum: bytes

    @property
    def record_len(self) -> int:
        return self.header_len + self.payload_len

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes, flat. One PyTorch operation for a contiguous tensor (the writer's): each
    lets go of the GIL and takes it again, a wait for a serving process's model thread; the
    flattening is numpy's, which keeps the GIL."""
    import torch

    whole = t.contiguous() if t.dim() else t.reshape(1)  # (a 0-dim tensor has no last dim to view)
    return whole.view(torch.uint8).numpy().reshape(-1)


def _shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def _unshuffle(planes: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return planes
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).reshape(-1)


def encode(
    tensor: torch.Tensor,
    *,
    key: bytes,
    namespace_id: bytes,
    token_start: int,
    num_tokens: int,
    compression: str = "none",
    level: int = 3,
    layout: str = "LKTHD",
) -> tuple[bytes, memoryview]:
    """Encode a CPU tensor as ``(header, payload)``; the raw payload is a view, not a copy."""
    if tensor.device.type != "cpu":
        raise ValueError("encode() takes a CPU tensor; stage device tensors into host memory first")
    code = DTYPE_CODES.get(dtype_name(tensor.dtype))
    if code is None:
        raise ValueError(f"dtype {tensor.dtype} is not supported by the record format")
    if len(key) != KEY_BYTES or len(namespace_id) != NAMESPACE_ID_BYTES:
        raise ValueError("key must be 32 bytes and namespace_id 16 bytes")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got {tensor.dim()}")
    raw = _byte_view(tensor)
    if compression == "zstd":
        codec = CODEC_ZSTD
        planes = _shuffle(raw, tensor.element_size())
        payload = memoryview(zstandard.ZstdCompressor(level=level).compress(planes))
    else:
        codec = CODEC_RAW
        payload = memoryview(raw).cast("B")
    checksum = xxhash.xxh3_128_digest(payload)
    header_len = header_bytes(tensor.dim())
    head = _FIXED.pack(
        MAGIC, FORMAT_VERSION, header_len, codec, code, LAYOUT_CODES[layout],
        tensor.dim(), num_tokens, token_start, time.time_ns(), raw.nbytes, payload.nbytes,
        key, namespace_id, checksum,
    ) + b"".join(_U64.pack(d) for d in tensor.shape)
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head)), payload


def decode_header(buf: bytes | memoryview, *, max_record_bytes: int = 1 << 30,
                  record_len: int | None = None) -> RecordHeader:
    """Parse and validate a header against the buffer it came from.

    ``buf`` may be just the header (then its payload length is checked against
    ``record_len`` if given) or the whole record. Raises :class:`RecordError` for anything
    malformed or inconsistent (proven corrupt), :class:`IncompatibleRecord` for an intact
    header of another format version, and :class:`RecordTooLarge` for an intact,
    consistent record over ``max_record_bytes`` (another process may have a higher limit).
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < _FIXED.size + 8:
        raise RecordError(f"record too short for a header ({len(mv)} bytes)")
    (magic, version, header_len, codec, dtype_code, layout_code, ndim, num_tokens, token_start,
     created_ns, raw_len, payload_len, key, ns_id, checksum) = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise RecordError("bad magic: not a kvtier record")
    if header_len > len(mv) and version != FORMAT_VERSION and header_len >= _FIXED.size + 8:
        # a later version's longer header (what a reader hands over is the first
        # MAX_HEADER_BYTES): its checksum cannot be read here, so nothing proves it damaged
        raise IncompatibleRecord(f"record format version {version} (a {header_len}-byte header), "
                                 f"this kvtier reads {FORMAT_VERSION}")
    if not _FIXED.size + 8 <= header_len <= len(mv):
        raise RecordError(f"bad header length {header_len}")
    (stored_hsum,) = _U64.unpack_from(mv, header_len - 8)
    if xxhash.xxh3_64_intdigest(mv[: header_len - 8]) != stored_hsum:
        raise RecordError("header checksum mismatch")
    if version != FORMAT_VERSION:  # intact (its checksum holds), in a layout of its own
        raise IncompatibleRecord(f"record format version {version}, this kvtier reads {FORMAT_VERSION}")
    if header_len != header_bytes(ndim) or ndim > MAX_NDIM:
        raise RecordError(f"bad header length {header_len} for {ndim} dimensions")
    if codec not in CODEC_NAMES or dtype_code not in DTYPE_INFO or layout_code not in LAYOUTS:
        raise RecordError("unknown codec, dtype or layout code")
    shape = tuple(_U64.unpack_from(mv, _FIXED.size + 8 * i)[0] for i in range(ndim))
    dtype, itemsize = DTYPE_INFO[dtype_code]
    # Consistency first (exact integers, no overflow): a record whose parts disagree is corrupt.
    if any(d > _MAX_DIM for d in shape):  # no tensor has it, even beside a zero dimension
        raise RecordError(f"shape {shape} has an impossible dimension")
    n_items = 1
    for d in shape:
        n_items *= d
    if n_items * itemsize != raw_len:
        raise RecordError(f"shape {shape} of {dtype} does not match raw length {raw_len}")
    if codec == CODEC_RAW and payload_len != raw_len:
        raise RecordError(f"implausible payload length {payload_len}")
    if record_len is None and len(mv) > header_len:
        record_len = len(mv)
    if record_len is not None and record_len != header_len + payload_len:
        raise RecordError(f"record is {record_len} bytes, header says {header_len + payload_len}")
    # Only then the limit: an intact record over it is another process's, not damage.
    if raw_len > max_record_bytes or payload_len > max_record_bytes:
        raise RecordTooLarge(f"record holds {max(raw_len, payload_len)} bytes, over max_record_bytes "
                             f"({max_record_bytes}); skipped, not deleted (raise max_record_bytes to read it)")
    return RecordHeader(version, header_len, codec, dtype, LAYOUTS[layout_code], shape, num_tokens,
                        token_start, created_ns, raw_len, payload_len, key, ns_id, checksum)


def verify_payload(header: RecordHeader, record: bytes | memoryview) -> memoryview:
    """Return the payload view after checking its length and checksum."""
    mv = memoryview(record).cast("B")
    payload = mv[header.header_len :]
    if len(payload) != header.payload_len:
        raise RecordError(f"payload is {len(payload)} bytes, header says {header.payload_len} (truncated?)")
    if xxhash.xxh3_128_digest(payload) != header.checksum:
        raise RecordError("payload checksum mismatch")
    return payload


def verify_pieces(header: RecordHeader, pieces: Sequence[bytes | memoryview]) -> list[memoryview]:
    """:func:`verify_payload` for a payload stored in pieces (e.g. the parts of a remote value)."""
    views = [memoryview(p).cast("B") for p in pieces]
    got = sum(len(v) for v in views)
    if got != header.payload_len:
        raise RecordError(f"payload is {got} bytes, header says {header.payload_len} (truncated?)")
    h = xxhash.xxh3_128()
    for v in views:
        h.update(v)
    if h.digest() != header.checksum:
        raise RecordError("payload checksum mismatch")
    return views


def decode(
    record: bytes | memoryview,
    *,
    expect_key: bytes | None = None,
    out: torch.Tensor | None = None,
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    max_record_bytes: int = 1 << 30,
) -> tuple[RecordHeader, torch.Tensor]:
    """Validate a whole record and return its tensor (written into ``out`` when given, else
    into ``alloc(shape, dtype)``, else into a new tensor).

    ``expect_key`` guards against a record filed under the wrong key (a misplaced file).
    """
    header = decode_header(record, max_record_bytes=max_record_bytes)
    _check_key(header, expect_key)
    return header, _materialize(header, [verify_payload(header, record)], out, alloc)


def decode_pieces(
    head: bytes | memoryview,
    pieces: Sequence[bytes | memoryview],
    *,
    expect_key: bytes | None = None,
    out: torch.Tensor | None = None,
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    max_record_bytes: int = 1 << 30,
) -> tuple[RecordHeader, torch.Tensor]:
    """:func:`decode` for a record kept as its header and its payload in pieces, copied
    straight into the destination (no joined copy of the payload)."""
    header = decode_header(head, max_record_bytes=max_record_bytes,
                           record_len=len(memoryview(head).cast("B")) + sum(len(memoryview(p).cast("B")) for p in pieces))
    _check_key(header, expect_key)
    return header, _materialize(header, verify_pieces(header, pieces), out, alloc)


class RecordReader(Protocol):
    """A stored record as a payload store offers it: its first bytes and size, and reads of
    the rest straight into a caller's buffer (so a load need not stage the whole record)."""

    size: int
    head: memoryview  # the first min(size, MAX_HEADER_BYTES) bytes

    def fill(self, dst: memoryview, offset: int) -> None:
        """Fill ``dst`` from the record at ``offset``; RecordError if the record ends first."""

    def fill_runs(self, runs: Sequence[memoryview], offset: int) -> None:
        """Fill ``runs`` back to back from the record at ``offset`` (a scattered read: one
        request for all of them where the store can); RecordError if the record ends first."""

    def whole(self) -> memoryview:
        """The whole record (a view valid until the read ends)."""

    def fill_record(self, region: memoryview, offset: int) -> None:
        """Fill ``region[offset:size]`` with the record's bytes at the same offsets. ``region``
        stands for the whole record from its first byte, starts on a page and runs at least
        to ``size`` rounded up to a page; the reader may write all of it (the record's own
        bytes before ``offset``, anything past ``size``), e.g. to read whole pages with
        ``O_DIRECT``. RecordError if the record ends first."""


PAGE = 4096


def record_region(dest: torch.Tensor, header_len: int, size: int) -> memoryview | None:
    """The memory of ``dest``'s storage as :meth:`RecordReader.fill_record` wants it, if
    ``dest`` sits ``header_len`` bytes into a page-aligned storage with room for the whole
    record in whole pages (a pooled buffer asked for with ``lead``); else None."""
    import torch

    st = dest.untyped_storage()
    if (dest.device.type != "cpu" or not dest.is_contiguous()
            or dest.storage_offset() * dest.element_size() != header_len
            or st.nbytes() < -(-size // PAGE) * PAGE or st.data_ptr() % PAGE):
        return None
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(st).numpy()).cast("B")


def record_lead(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Where in a pooled buffer (``lead`` of :meth:`BufferPool.acquire`) to put a chunk of
    ``shape`` so that its record's header fits in front of it: the header's length, or 0 if
    the dtype's alignment does not allow it (no record then sits in place)."""
    n = header_bytes(len(shape))
    return n if n % dtype.itemsize == 0 else 0


def record_in_place(tensor: torch.Tensor, header: bytes) -> memoryview | None:
    """The whole record of ``tensor`` (encoded raw as ``header`` + its bytes) as one view of
    its own buffer, if ``tensor`` sits ``len(header)`` bytes into a page-aligned buffer with
    room to the record's last page (a pooled buffer asked for with :func:`record_lead`).
    The header is written in front of the payload, which is already there: a backend then
    writes the record from this memory as it is, with no staging copy (``O_DIRECT`` from the
    pool). The view runs to the end of the record's last page; the record is its first
    ``len(header) + tensor.nbytes`` bytes. None where the tensor does not sit so."""
    size = len(header) + tensor.numel() * tensor.element_size()
    region = record_region(tensor, len(header), size)
    if region is None:
        return None
    region[: len(header)] = header
    return region[: -(-size // PAGE) * PAGE]


def decode_from(
    reader: RecordReader,
    *,
    expect_key: bytes | None = None,
    out: torch.Tensor | None = None,
    alloc: Callable[..., torch.Tensor] | None = None,
    max_record_bytes: int = 1 << 30,
    out_is_scratch: bool = False,
) -> tuple[RecordHeader, torch.Tensor]:
    """:func:`decode` for a record read through ``reader``. An uncompressed payload headed for
    a new tensor (no ``out``), or for an ``out`` the caller marks as scratch (its contents
    are unspecified unless this returns), is read straight into it and verified there: one
    copy from the storage instead of two. Any other ``out`` is written only once verified.

    ``alloc(shape, dtype, lead=n)`` makes the new tensor; asked with ``lead`` the header's
    length, it may place the tensor that far into a page-aligned buffer (see
    :func:`record_region`), and the reader then reads the whole record into that buffer,
    which lets a file be read with ``O_DIRECT``."""
    header = decode_header(reader.head, max_record_bytes=max_record_bytes, record_len=reader.size)
    _check_key(header, expect_key)
    scratch = out is not None and out_is_scratch and out.device.type == "cpu"
    direct = out is None or (scratch and out.is_contiguous())
    # a strided scratch ``out`` (a slice of a bigger tensor) of the record's shape: its contiguous runs
    runs = (_contiguous_runs(out) if scratch and not direct and tuple(out.shape) == header.shape
            and out.dtype == header.dtype else None)
    if header.codec != CODEC_RAW or not (direct or runs):
        return decode(reader.whole(), expect_key=expect_key, out=out, alloc=alloc,
                      max_record_bytes=max_record_bytes)
    if runs:  # read the runs straight from the record, in payload order, and verify them all
        reader.fill_runs(runs, header.header_len)
        h = xxhash.xxh3_128()
        for run in runs:
            h.update(run)
        if h.digest() != header.checksum:
            raise RecordError("payload checksum mismatch")
        return header, out
    import torch

    region = None
    if out is None:
        lead = record_lead(header.shape, header.dtype)
        dest = alloc(header.shape, header.dtype, lead=lead) if alloc else torch.empty(header.shape, dtype=header.dtype)
        region = record_region(dest, header.header_len, reader.size) if lead else None
    else:
        check_destination(out, header.shape, header.dtype)
        dest = out
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy()).cast("B")
    if region is not None:
        reader.fill_record(region, header.header_len)
    else:
        reader.fill(view, header.header_len)
    if xxhash.xxh3_128_digest(view) != header.checksum:
        raise RecordError("payload checksum mismatch")
    return header, dest


_MIN_RUN_BYTES = 64 * 1024  # shorter runs are cheaper staged whole and copied once
_MAX_RUNS = 1024  # one scattered read (IOV_MAX on Linux)


def _contiguous_runs(t: torch.Tensor) -> list[memoryview] | None:
    """The memory of a strided CPU tensor as contiguous runs in row-major (payload) order,
    e.g. one run per layer and K/V for a chunk's slice of a ``[layers, 2, tokens, ...]``
    tensor; None if its last dimension is strided or its runs are short."""
    import torch

    if not t.dim() or t.stride(-1) != 1 or t.numel() == 0:
        return None
    arr = t.view(torch.uint8).numpy()
    k = arr.ndim  # the run is arr[i_0..i_{k-1}], contiguous: find the smallest such k
    expect = arr.itemsize
    while k > 0 and arr.strides[k - 1] == expect:
        expect *= arr.shape[k - 1]
        k -= 1
    if expect < _MIN_RUN_BYTES or t.numel() * t.element_size() // expect > _MAX_RUNS:
        return None
    # Runs that share memory (an expand()ed tensor) would fail the checksum computed over
    # them, and a good record would be taken for corrupt: those are staged instead. Their
    # offsets follow from the strides (no per-run work on the load path).
    starts = np.zeros(1, dtype=np.int64)
    for n, stride in zip(arr.shape[:k], arr.strides[:k], strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    if not bool(np.all(np.diff(np.sort(starts)) >= expect)):
        return None
    return [memoryview(arr[idx]).cast("B") for idx in np.ndindex(*arr.shape[:k])]


def check_destination(out: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> None:
    """Raise :class:`DestinationMismatch` unless ``out`` can take a chunk of ``shape`` and
    ``dtype`` as it is (a copy would broadcast or cast it: never the chunk's KV)."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise DestinationMismatch(f"record is {dtype}{list(shape)}, destination is {out.dtype}{list(out.shape)}")


def _check_key(header: RecordHeader, expect_key: bytes | None) -> None:
    if expect_key is not None and header.key != expect_key:
        raise RecordError("record key does not match the key it was looked up by")


def _materialize(header: RecordHeader, pieces: list[memoryview], out: torch.Tensor | None,
                 alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None) -> torch.Tensor:
    """Write a verified payload (in pieces) into ``out`` or a new tensor."""
    if header.codec == CODEC_ZSTD:
        compressed = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        try:
            planes = zstandard.ZstdDecompressor().decompress(compressed, max_output_size=header.raw_len)
        except zstandard.ZstdError as exc:
            raise RecordError(f"zstd payload does not decompress: {exc}") from exc
        if len(planes) != header.raw_len:
            raise RecordError("decompressed length does not match the header")
        itemsize = DTYPE_INFO[DTYPE_CODES[header.dtype_name]][1]
        pieces = [memoryview(_unshuffle(np.frombuffer(planes, dtype=np.uint8), itemsize))]
    import torch

    if out is None:
        out = alloc(header.shape, header.dtype) if alloc else torch.empty(header.shape, dtype=header.dtype)
    else:
        check_destination(out, header.shape, header.dtype)
    # numpy copies: a source may be a read-only view (an LMDB map), which torch cannot wrap.
    if out.device.type == "cpu" and out.is_contiguous():
        dst = out.reshape(-1).view(torch.uint8).numpy()
        at = 0
        for piece in pieces:
            n = len(piece)
            np.copyto(dst[at : at + n], np.frombuffer(piece, dtype=np.uint8))
            at += n
        return out
    raw = np.frombuffer(pieces[0] if len(pieces) == 1 else b"".join(pieces), dtype=np.uint8)
    if out.device.type == "cpu" and out.dim() and out.stride(-1) == 1:
        # A strided CPU slice (e.g. one chunk of a bigger KV tensor along the token axis):
        # copy straight into it, with no temporary tensor. Viewing the last dimension as bytes
        # needs it contiguous, which a slice along an outer axis keeps.
        dst = out.view(torch.uint8).numpy()
        np.copyto(dst, raw.reshape(dst.shape))
        return out
    tmp = torch.from_numpy(raw.copy()).view(header.dtype).reshape(header.shape)
    out.copy_(tmp)
    return out
