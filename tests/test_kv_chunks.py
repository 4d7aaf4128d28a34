"""Chunk format details the stores rely on: verify_chunk, empty and 0-d tensors."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from semcomm.errors import CorruptEntryError
from semcomm.kv import decode_chunk, encode_chunk
from semcomm.kv._format import verify_chunk

from ._kvchunks import chain


def encode(arrays: dict[str, np.ndarray]) -> bytes:
    return encode_chunk(namespace=b"n" * 32, key=b"k" * 32, parent=b"p" * 32, num_tokens=0,
                        start=0, dtype="float32", codec="none", codec_params={}, arrays=arrays)


@pytest.mark.parametrize("arr", [
    np.zeros(0, np.float32), np.zeros((2, 0, 3), np.float16), np.array(3.5, np.float32),
    np.arange(6, dtype=">f4").reshape(2, 3), np.arange(12, dtype=np.int8).reshape(3, 4)[:, ::2],
])
def test_round_trip_of_unusual_tensors(arr: np.ndarray) -> None:
    data = encode({"x": arr})
    out = decode_chunk(data).arrays["x"]
    assert out.shape == arr.shape and np.array_equal(out, arr)
    info = verify_chunk(data, expect_key=b"k" * 32)
    assert (info.key, info.parent, info.namespace, info.nbytes) == (
        b"k" * 32, b"p" * 32, b"n" * 32, len(data))


def reframe(data: bytes, edit: dict[str, object]) -> bytes:
    """Rewrite a format 1 chunk's JSON header (with a fresh, valid checksum) to forge a bad one."""
    import xxhash

    (hlen,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + hlen])
    header.update(edit)
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = data[:4] + struct.pack("<I", len(h)) + h + data[8 + hlen : -16]
    return body + xxhash.xxh3_128_digest(body)


@pytest.mark.parametrize("edit", [
    {"format_version": 99}, {"payload_len": 1}, {"tensors": "none"},
    {"tensors": [["k.0", "<f4", [100], 0, 400]]}, {"tensors": [["k.0", "object", [1], 0, 4]]},
    {"key": "zz"}, {"namespace": None},
])
def test_verify_rejects_what_decode_rejects_format1(edit: dict[str, object]) -> None:
    (_, v), = chain(1, format_version=1)
    bad = reframe(v, edit)
    with pytest.raises(CorruptEntryError):
        verify_chunk(bad)
    if "key" not in edit and "namespace" not in edit:  # decode does not parse the hex fields
        with pytest.raises(CorruptEntryError):
            decode_chunk(bad)


def test_verify_checks_checksum_and_key() -> None:
    (k0, v0), (k1, _) = chain(2)
    assert verify_chunk(v0, expect_key=k0).key == k0
    with pytest.raises(CorruptEntryError, match="says it is"):
        verify_chunk(v0, expect_key=k1)
    with pytest.raises(CorruptEntryError, match="checksum"):
        verify_chunk(v0[:-1] + bytes([v0[-1] ^ 1]))
    with pytest.raises(CorruptEntryError):
        verify_chunk(v0[:5])


# ---- format 2 (binary header) and compatibility with format 1 ------------------------------

def _v2_forge(data: bytes, header: bytes) -> bytes:
    """A chunk with ``header`` in place of its own (fresh, valid checksum)."""
    import xxhash

    (hlen,) = struct.unpack_from("<I", data, 4)
    body = data[:4] + struct.pack("<I", len(header)) + header + data[8 + hlen : -16]
    return body + xxhash.xxh3_128_digest(body)


def _v2_header(data: bytes) -> bytes:
    (hlen,) = struct.unpack_from("<I", data, 4)
    return data[8 : 8 + hlen]


def test_format2_is_written_by_default_and_round_trips() -> None:
    from semcomm.kv import FORMAT_VERSION, read_header

    (k, v), = chain(1)
    assert FORMAT_VERSION == 2 and v[8] != ord("{")  # binary header, not JSON
    h = read_header(v)
    assert h.format_version == 2 and h.key == k.hex() and h.parent is None
    assert decode_chunk(v, expect_key=k).arrays["k.0"].shape == (32,)
    assert h.to_bytes() == _v2_header(v)  # parse -> encode is the identity


@pytest.mark.parametrize("field_edit", ["version3", "payload_len", "dtype_code", "shape",
                                        "trailing", "flags", "lengths"])
def test_format2_rejects_forged_headers(field_edit: str) -> None:
    (_, v), = chain(1)
    h = bytearray(_v2_header(v))
    if field_edit == "version3":
        struct.pack_into("<H", h, 0, 3)
    elif field_edit == "payload_len":
        struct.pack_into("<Q", h, 16, struct.unpack_from("<Q", h, 16)[0] - 4)
    elif field_edit == "flags":
        struct.pack_into("<H", h, 2, 0x80)
    elif field_edit == "lengths":
        h = h[:-1]
    elif field_edit == "trailing":  # table longer than its entries: a stray byte
        struct.pack_into("<I", h, 38, struct.unpack_from("<I", h, 38)[0] + 1)
        h += b"\0"
    else:
        table = h.rfind(b"k.0") - 4  # the first entry: u16 name length, u8 code, u8 ndim
        if field_edit == "dtype_code":
            h[table + 2] = 200
        else:  # shape no longer matches nbytes
            struct.pack_into("<Q", h, table + 4 + 3, 31)
    bad = _v2_forge(v, bytes(h))
    with pytest.raises(CorruptEntryError) as err:
        verify_chunk(bad)
    if field_edit == "version3":
        assert "version 3" in str(err.value)
    with pytest.raises(CorruptEntryError):
        decode_chunk(bad)


def test_format1_chunks_still_read_everywhere(tmp_path) -> None:
    """A directory written by a format 1 semcomm serves its chunks after an upgrade."""
    from semcomm.kv import DiskStore, MemoryStore, read_header

    old = chain(3, format_version=1)
    assert all(v[8] == ord("{") and read_header(v).format_version == 1 for _, v in old)
    disk = DiskStore(tmp_path / "kv")
    for k, v in old:
        disk.put(k, v)
    disk.close()
    reopened = DiskStore(tmp_path / "kv")
    assert len(reopened) == 3
    for k, v in old:
        assert reopened.get(k) == v
        assert decode_chunk(v, expect_key=k).header.format_version == 1
    mem = MemoryStore()
    mem.put(*old[0])
    assert mem.get(old[0][0]) == old[0][1]


def test_table_cache_never_vouches_for_different_bytes() -> None:
    """A valid table seen first does not make a forged one (other bytes) pass."""
    (_, v), = chain(1)
    verify_chunk(v)  # caches this table
    h = bytearray(_v2_header(v))
    table = h.rfind(b"k.0") - 4
    struct.pack_into("<Q", h, table + 4 + 3, 31)
    with pytest.raises(CorruptEntryError, match="shape/size"):
        verify_chunk(_v2_forge(v, bytes(h)))


def test_unsupported_write_version_is_refused() -> None:
    with pytest.raises(ValueError, match="format version 7"):
        encode_chunk(namespace=b"n" * 32, key=b"k" * 32, parent=None, num_tokens=0, start=0,
                     dtype="float32", codec="none", codec_params={}, arrays={}, format_version=7)
