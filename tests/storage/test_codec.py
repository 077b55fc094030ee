"""Record codec: round trips, and every kind of damaged or crafted record is rejected
(RecordError) before a byte reaches the caller and before anything is allocated."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from kvhelpers import FIELDS, craft, header_fields, peak_alloc, same_bits

from kvtier import codec
from kvtier.errors import DestinationMismatch, IncompatibleRecord, RecordError
from kvtier.keys import FORMAT_VERSION

KEY = bytes(range(32))
NS = bytes(range(100, 116))
SHAPE = (2, 2, 16, 4, 8)


def rand_tensor(dtype: torch.dtype, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> torch.Tensor:
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1  # a bool byte holds 0 or 1
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def make_record(dtype: torch.dtype = torch.bfloat16, compression: str = "none",
                shape: tuple[int, ...] = SHAPE) -> tuple[torch.Tensor, bytes]:
    t = rand_tensor(dtype, shape)
    header, payload = codec.encode(t, key=KEY, namespace_id=NS, token_start=64,
                                   num_tokens=shape[2], compression=compression)
    return t, header + bytes(payload)


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("dtype", list(codec.torch_dtypes().values()), ids=codec.dtype_name)
def test_round_trip_every_dtype(dtype: torch.dtype, compression: str) -> None:
    t, rec = make_record(dtype, compression)
    header, got = codec.decode(rec, expect_key=KEY)
    assert same_bits(got, t)
    assert (header.shape, header.dtype, header.key, header.namespace_id) == (SHAPE, dtype, KEY, NS)
    assert (header.token_start, header.num_tokens, header.record_len) == (64, 16, len(rec))
    assert header.codec == (codec.CODEC_ZSTD if compression == "zstd" else codec.CODEC_RAW)
    # into a caller's buffer, contiguous or not
    out = torch.empty(SHAPE, dtype=dtype)
    assert codec.decode(rec, out=out)[1] is out and same_bits(out, t)
    big = torch.zeros((2, 2, 16, 4, 16), dtype=dtype)
    view = big[..., :8]
    codec.decode(rec, out=view)
    assert same_bits(view.contiguous(), t)
    assert not big[..., 8:].view(torch.uint8).any()


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("case", ["0-dim", "transposed", "empty"])
def test_tensors_of_any_shape_or_strides_round_trip(case: str, compression: str) -> None:
    """encode takes a tensor's bytes in its logical order, whatever its layout."""
    t = {"0-dim": rand_tensor(torch.bfloat16, (1,)).reshape(()),
         "transposed": rand_tensor(torch.float32, (6, 4)).t(),
         "empty": torch.empty((2, 0, 3), dtype=torch.float16)}[case]
    header, payload = codec.encode(t, key=KEY, namespace_id=NS, token_start=0, num_tokens=1, compression=compression)
    got = codec.decode(header + bytes(payload), expect_key=KEY)[1]
    assert got.shape == t.shape and same_bits(got, t.contiguous())


def test_zstd_shuffles_byte_planes() -> None:
    """16-bit data whose high bytes are constant compresses far better shuffled."""
    t = (torch.arange(4096, dtype=torch.int16) % 256).view(torch.bfloat16).reshape(1, 2, 64, 4, 8)
    h, payload = codec.encode(t, key=KEY, namespace_id=NS, token_start=0, num_tokens=64,
                              compression="zstd")
    assert payload.nbytes < t.numel() * 2 // 4
    assert same_bits(codec.decode(h + bytes(payload))[1], t)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_header_bit_flip_is_rejected(compression: str) -> None:
    _, rec = make_record(compression=compression)
    hlen = header_fields(rec)["header_len"]
    buf = bytearray(rec)
    for bit in range(hlen * 8):
        buf[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(RecordError) as exc:
            codec.decode(bytes(buf), expect_key=KEY)
        assert not isinstance(exc.value, IncompatibleRecord), f"bit {bit}: a damaged header is corrupt"
        buf[bit // 8] ^= 1 << (bit % 8)
    codec.decode(bytes(buf), expect_key=KEY)  # restored: valid again


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_payload_bit_flips_are_rejected(compression: str) -> None:
    _, rec = make_record(compression=compression)
    hlen = header_fields(rec)["header_len"]
    n = len(rec) - hlen
    rng = np.random.default_rng(1)
    positions = [0, 1, n // 2, n - 2, n - 1, *rng.integers(0, n, 20).tolist()]
    for pos in positions:
        for bit in (0, 7):
            buf = bytearray(rec)
            buf[hlen + pos] ^= 1 << bit
            with pytest.raises(RecordError, match="checksum"):
                codec.decode(bytes(buf))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_truncated_or_extended_records_are_rejected(compression: str) -> None:
    _, rec = make_record(compression=compression, shape=(1, 2, 4, 2, 4))
    for cut in range(len(rec)):
        with pytest.raises(RecordError):
            codec.decode(rec[:cut])
    for extra in (b"\0", b"x" * 100):
        with pytest.raises(RecordError):
            codec.decode(rec + extra)


def _zstd_record() -> bytes:
    return make_record(compression="zstd")[1]


GARBAGE = os.urandom(300)
CRAFTED = {
    # shape far beyond max_record_bytes (default 1 GiB), lengths made consistent with it
    "huge shape": lambda r: craft(r, shape=(2**20, 2**20, 2**10), raw_len=2**51, payload_len=2**51),
    "huge shape, small lengths": lambda r: craft(r, shape=(2**20, 2**20, 2**10)),
    "dims overflow u64 product": lambda r: craft(r, shape=(2**64 - 1, 2**64 - 1), raw_len=2**63),
    # zero elements (so raw_len 0 agrees) but a dimension no tensor can have
    "zero dim beside a huge one": lambda r: craft(
        r, shape=(0, 2**63), raw_len=0, payload_len=0, payload=b"",
        checksum=xxhash.xxh3_128_digest(b"")),
    "shape 2x the payload": lambda r: craft(
        r, shape=(2, 2, 32, 4, 8), raw_len=2 * header_fields(r)["raw_len"],
        payload_len=2 * header_fields(r)["raw_len"]),
    "payload_len + 1": lambda r: craft(r, payload_len=header_fields(r)["payload_len"] + 1),
    "payload_len - 1": lambda r: craft(r, payload_len=header_fields(r)["payload_len"] - 1),
    "payload_len huge": lambda r: craft(r, payload_len=2**62),
    "raw_len disagrees with shape": lambda r: craft(r, raw_len=header_fields(r)["raw_len"] - 2),
    "unknown dtype code": lambda r: craft(r, dtype=99),
    "unknown codec code": lambda r: craft(r, codec=7),
    "unknown layout code": lambda r: craft(r, layout=0),
    "too many dims": lambda r: craft(r, shape=(1,) * (codec.MAX_NDIM + 1)),
    "header_len lies": lambda r: craft(r, header_len=header_fields(r)["header_len"] + 8),
    "bad magic": lambda r: craft(r, magic=b"KVTIER\x00\x02"),
    "zstd garbage with valid checksum": lambda r: craft(
        _zstd_record(), payload=GARBAGE, payload_len=len(GARBAGE),
        checksum=xxhash.xxh3_128_digest(GARBAGE)),
    "zstd decompresses short of raw_len": lambda r: craft(
        _zstd_record(), shape=(2, 2, 32, 4, 8), raw_len=2 * header_fields(r)["raw_len"]),
    "zstd bomb beyond raw_len": lambda r: _zstd_bomb(r),
}


def _zstd_bomb(r: bytes) -> bytes:
    """A valid zstd frame of 64 MiB without a declared size, under a header claiming 4 KiB."""
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    blob = b"".join(stream.compress(b"\0" * (1 << 20)) for _ in range(64)) + stream.flush()
    return craft(r, shape=(1, 2, 64, 4, 4), codec=codec.CODEC_ZSTD, raw_len=4096,
                 payload=blob, payload_len=len(blob), checksum=xxhash.xxh3_128_digest(blob))


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_headers_with_valid_checksums_are_rejected(case: str) -> None:
    _, rec = make_record()
    bad = CRAFTED[case](rec)
    # the crafted header really does carry a valid header checksum
    hl = header_fields(bad)["header_len"]
    if case != "header_len lies":
        assert int.from_bytes(bad[hl - 8:hl], "little") == xxhash.xxh3_64_intdigest(bad[:hl - 8])
    with peak_alloc() as grew, pytest.raises(RecordError) as exc:
        codec.decode(bad)
    assert not isinstance(exc.value, IncompatibleRecord)
    assert grew[0] < 16 << 20, f"{case}: decoding allocated {grew[0] >> 20} MiB"


def test_other_format_version_is_incompatible_not_corrupt() -> None:
    _, rec = make_record()
    for version in (FORMAT_VERSION + 1, 0, 0xFFFF):
        with pytest.raises(IncompatibleRecord, match="format version"):
            codec.decode(craft(rec, format_version=version))
    # a later version with a longer header of its own (kept: its checksum, at its end, holds);
    # a damaged one is still corrupt
    f = header_fields(rec)
    hl = f["header_len"]
    f.update(format_version=FORMAT_VERSION + 1, header_len=hl + 16)
    head = codec._FIXED.pack(*(f[n] for n in FIELDS)) + rec[codec._FIXED.size : hl - 8] + b"\7" * 16
    future = head + codec._U64.pack(xxhash.xxh3_64_intdigest(head)) + rec[hl:]
    with pytest.raises(IncompatibleRecord, match="format version"):
        codec.decode(future)
    # longer than the head a store's reader hands over (MAX_HEADER_BYTES): judged from it
    f.update(header_len=codec.MAX_HEADER_BYTES + 64)
    long_head = codec._FIXED.pack(*(f[n] for n in FIELDS)) + rec[codec._FIXED.size : hl - 8]
    long_head += b"\7" * (codec.MAX_HEADER_BYTES + 56 - len(long_head))
    longer = long_head + codec._U64.pack(xxhash.xxh3_64_intdigest(long_head)) + rec[hl:]
    with pytest.raises(IncompatibleRecord, match="format version"):
        codec.decode_header(longer[: codec.MAX_HEADER_BYTES], record_len=len(longer))
    damaged = bytearray(future)
    damaged[hl + 4] ^= 0x10  # in the later version's own header fields
    with pytest.raises(RecordError) as exc:
        codec.decode(bytes(damaged))
    assert not isinstance(exc.value, IncompatibleRecord)


def test_wrong_key_and_wrong_destination_are_rejected() -> None:
    t, rec = make_record()
    with pytest.raises(RecordError, match="key"):
        codec.decode(rec, expect_key=bytes(32))
    # a destination that does not fit is the caller's mistake, not proof of damage
    with pytest.raises(DestinationMismatch, match="destination is"):
        codec.decode(rec, out=torch.empty((2, 2, 15, 4, 8), dtype=torch.bfloat16))
    with pytest.raises(DestinationMismatch):
        codec.decode(rec, out=torch.empty(SHAPE, dtype=torch.float16))
    assert not issubclass(DestinationMismatch, RecordError)
    assert same_bits(codec.decode(rec, expect_key=KEY)[1], t)


def test_encode_refuses_what_it_cannot_describe() -> None:
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(2, dtype=torch.complex64), key=KEY, namespace_id=NS,
                     token_start=0, num_tokens=1)
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(2), key=KEY[:31], namespace_id=NS, token_start=0, num_tokens=1)
    with pytest.raises(ValueError):
        codec.encode(torch.zeros((1,) * 9), key=KEY, namespace_id=NS, token_start=0, num_tokens=1)


def test_decode_from_a_reader_reads_into_the_destination_and_verifies_there() -> None:
    from kvtier.backends.payloads import ViewReader

    t, rec = make_record(torch.bfloat16)
    header, got = codec.decode_from(ViewReader(memoryview(rec)), expect_key=KEY)
    assert same_bits(got, t)
    scratch = torch.empty(SHAPE, dtype=torch.bfloat16)
    assert codec.decode_from(ViewReader(memoryview(rec)), out=scratch, out_is_scratch=True)[1] is scratch
    assert same_bits(scratch, t)
    bad = bytearray(rec)
    bad[-3] ^= 0x40
    with pytest.raises(RecordError, match="checksum"):
        codec.decode_from(ViewReader(memoryview(bytes(bad))))
    kept = torch.zeros(SHAPE, dtype=torch.bfloat16)  # not scratch: untouched when the record is bad
    with pytest.raises(RecordError, match="checksum"):
        codec.decode_from(ViewReader(memoryview(bytes(bad))), out=kept)
    assert not kept.view(torch.uint8).any()
    with pytest.raises(RecordError, match="ends at"):
        ViewReader(memoryview(rec)).fill(memoryview(bytearray(10)), len(rec) - 5)


def test_a_strided_scratch_destination_is_filled_run_by_run_and_verified() -> None:
    """A chunk's slice of a bigger ``[layers, 2, tokens, ...]`` tensor (what ``KVCache.load``
    decodes into) is read straight into its contiguous runs, never staged whole first; a
    flipped byte in any run is still caught."""
    from kvtier.backends.payloads import ViewReader

    class RunsOnly(ViewReader):
        def whole(self) -> memoryview:
            raise AssertionError("staged the whole record")

    t = rand_tensor(torch.bfloat16, (4, 2, 128, 4, 64), seed=5)
    rec = b"".join(codec.encode(t, key=KEY, namespace_id=NS, token_start=0, num_tokens=128))
    big = torch.zeros((4, 2, 3 * 128, 4, 64), dtype=torch.bfloat16)
    dst = big.narrow(2, 128, 128)
    assert not dst.is_contiguous()  # 8 runs (layer, K/V) of 128 tokens x 512 B = 64 KiB
    header, got = codec.decode_from(RunsOnly(memoryview(rec)), expect_key=KEY, out=dst, out_is_scratch=True)
    assert got is dst and same_bits(dst, t)
    assert not big.narrow(2, 0, 128).view(torch.int16).any() and not big.narrow(2, 256, 128).view(torch.int16).any()
    for at in (header.header_len, len(rec) // 2, len(rec) - 1):  # first, a middle and the last run
        bad = bytearray(rec)
        bad[at] ^= 0x01
        with pytest.raises(RecordError, match="checksum"):
            codec.decode_from(RunsOnly(memoryview(bytes(bad))), out=dst, out_is_scratch=True)
    # short runs (under 64 KiB) go through one staged read and one copy instead
    small = torch.zeros((4, 2, 3 * 64, 4, 64), dtype=torch.bfloat16).narrow(2, 64, 64)
    t2 = t.narrow(2, 0, 64).contiguous()
    rec2 = b"".join(codec.encode(t2, key=KEY, namespace_id=NS, token_start=0, num_tokens=64))
    with pytest.raises(AssertionError, match="staged"):
        codec.decode_from(RunsOnly(memoryview(rec2)), out=small, out_is_scratch=True)
    codec.decode_from(ViewReader(memoryview(rec2)), out=small, out_is_scratch=True)
    assert same_bits(small, t2)


def test_an_expanded_destination_is_staged_not_taken_for_corruption() -> None:
    """Regression: runs that share memory (K and V of an expand()ed tensor) failed the
    checksum computed over them, so an intact record looked corrupt (and would be removed)."""
    from kvtier.backends.payloads import ViewReader

    t = rand_tensor(torch.bfloat16, (2, 2, 128, 4, 64), seed=6)
    rec = b"".join(codec.encode(t, key=KEY, namespace_id=NS, token_start=0, num_tokens=128))
    out = torch.zeros((2, 1, 128, 4, 64), dtype=torch.bfloat16).expand(2, 2, 128, 4, 64)
    header, got = codec.decode_from(ViewReader(memoryview(rec)), out=out, out_is_scratch=True)
    assert got is out  # verified against the record itself: no RecordError
