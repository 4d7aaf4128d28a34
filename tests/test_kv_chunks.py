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
    """Rewrite a chunk's header (with a fresh, valid checksum) to forge a malformed chunk."""
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
def test_verify_rejects_what_decode_rejects(edit: dict[str, object]) -> None:
    (_, v), = chain(1)
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
