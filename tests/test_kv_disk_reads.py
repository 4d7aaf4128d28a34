"""DiskStore's fast paths keep its guarantees: get_into and the cached header check.

``get_into`` (reads into the caller's buffer) must keep every guarantee of ``get``: the same
verified bytes, the same misses for absent, tampered and swapped files, plaintext from a sealed
store, chunks found after a reopen.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import xxhash

from semcomm.errors import ConfigError, CorruptEntryError
from semcomm.kv import DiskStore, staging_buffer
from semcomm.kv._format import verify_chunk
from semcomm.security import ChunkSealer, TenantKeyring

from ._kvchunks import chain

SECRET = bytes(range(32))


def _file(store: DiskStore, key: bytes) -> Path:
    return Path(store._path(key))  # the chunk's file (its layout: the module docstring)


@pytest.fixture()
def filled(tmp_path: Path) -> tuple[DiskStore, list[tuple[bytes, bytes]]]:
    store = DiskStore(tmp_path / "kv")
    items = chain(4, payload=4096)
    store.put_many(items)
    return store, items


def test_get_into_reads_the_verified_chunk_into_the_buffer(filled) -> None:
    store, items = filled
    buf = bytearray(max(len(v) for _, v in items) + 100)
    for key, value in items:
        got = store.get_into(key, buf)
        assert got is not None and got.tobytes() == value == store.get(key)
        assert got.obj is buf  # a view of the caller's buffer: nothing allocated per read
    assert store.stats().hits == 2 * len(items)


def test_get_into_a_small_buffer_still_serves(filled) -> None:
    store, items = filled
    key, value = items[0]
    got = store.get_into(key, bytearray(16))
    assert got is not None and got.tobytes() == value


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_get_into_rejects_what_get_rejects(filled, damage: str) -> None:
    store, items = filled
    (k0, v0), (k1, v1) = items[0], items[1]
    path = _file(store, k0)
    if damage == "flip":
        raw = bytearray(v0)
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(v0[:-7])
    else:  # another chunk's (valid) bytes under this key
        path.write_bytes(v1)
    buf = bytearray(len(v0) + 64)
    assert store.get_into(k0, buf) is None
    assert store.stats().corrupt == 1 and not path.exists()
    assert store.get_into(k1, buf) is not None  # the others are untouched


@pytest.mark.parametrize("at", [0.1, 0.5, 0.99])  # anywhere in the chunk
def test_reads_into_a_staging_buffer_are_verified_like_any(filled, at: float) -> None:
    store, items = filled
    buf = staging_buffer(max(len(v) for _, v in items))
    assert len(buf) == max(len(v) for _, v in items) and not buf.readonly
    for key, value in items:  # the same bytes as get, in the staging memory
        got = store.get_into(key, buf)
        assert got is not None and got.tobytes() == value == store.get(key)
    k0, v0 = items[0]
    raw = bytearray(v0)
    raw[int(len(raw) * at)] ^= 0x01
    _file(store, k0).write_bytes(bytes(raw))
    assert store.get_into(k0, buf) is None and store.stats().corrupt == 1


@pytest.mark.parametrize(("nbytes", "error"), [(0, ValueError), (-3, ValueError),
                                                (2.5, TypeError), (True, TypeError)])
def test_staging_buffer_refuses_bad_sizes(nbytes: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="nbytes"):
        staging_buffer(nbytes)  # type: ignore[arg-type]


def test_get_into_missing_and_bad_buffers(filled) -> None:
    store, items = filled
    assert store.get_into(b"\x07" * 32, bytearray(64)) is None
    with pytest.raises(TypeError, match="writable"):
        store.get_into(items[0][0], b"read-only bytes")
    with pytest.raises(ValueError, match="32 bytes"):
        store.get_into(b"short", bytearray(64))


def test_get_into_after_reopen_finds_every_chunk(filled) -> None:
    store, items = filled
    store.close()
    again = DiskStore(store.path)
    buf = bytearray(8192)
    assert all(again.get_into(k, buf) is not None for k, _ in items)


def test_get_into_a_sealed_store_gives_plaintext(tmp_path: Path) -> None:
    sealer = ChunkSealer(TenantKeyring(SECRET))
    store = DiskStore(tmp_path / "sealed", sealer=sealer)
    items = chain(2, payload=1024)
    store.put_many(items)
    buf = bytearray(4096)
    for key, value in items:
        assert value not in _file(store, key).read_bytes()  # ciphertext at rest
        got = store.get_into(key, buf)
        assert got is not None and got.tobytes() == value


def _refresh_checksum(raw: bytearray) -> bytes:
    raw[-16:] = xxhash.xxh3_128_digest(bytes(raw[:-16]))
    return bytes(raw)


def test_the_cached_header_check_is_as_strict_as_the_full_parse() -> None:
    items = chain(2, payload=256)
    for key, value in items:  # first sight parses the header, later ones use the cache
        verify_chunk(value, expect_key=key)
        verify_chunk(value, expect_key=key)
    value = items[1][1]
    # a well-checksummed chunk whose header claims fewer payload bytes than its tensors need
    # (payload_len at byte 16 of the format 2 header, after the 8-byte SCKV prefix)
    raw = bytearray(value)
    (plen,) = struct.unpack_from("<Q", raw, 8 + 16)
    struct.pack_into("<Q", raw, 8 + 16, plen - 4)
    with pytest.raises(CorruptEntryError):
        verify_chunk(_refresh_checksum(raw))
    # flags with an unknown bit, with a tail the cache has seen
    raw = bytearray(value)
    struct.pack_into("<H", raw, 8 + 2, 0x8001)
    with pytest.raises(CorruptEntryError, match="flags"):
        verify_chunk(_refresh_checksum(raw))
    # a version the reader does not know
    raw = bytearray(value)
    struct.pack_into("<H", raw, 8, 3)
    with pytest.raises(CorruptEntryError, match="version 3"):
        verify_chunk(_refresh_checksum(raw))


def test_writes_leave_only_chunk_files_and_replace(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "kv")
    items = chain(3, payload=512)
    for k, v in items:
        store.put(k, v)
    store.put(*items[1])  # a replacement of an existing file
    names = sorted(p.name for p in (tmp_path / "kv").glob("??/*"))
    assert names == sorted(f"{k.hex()}.sckv" for k, _ in items)  # no temporary files left
    assert not list((tmp_path / "kv").glob("??/.*"))
    again = DiskStore(tmp_path / "kv")
    assert [again.get(k) for k, _ in items] == [v for _, v in items]
    assert store.stats().errors == 0 and store.stats().puts == 4


# ---- open_into: a chunk read in pieces, verified whole at the end -----------------------------

def _pieces_back_to_front(store: DiskStore, key: bytes, buf: bytearray, step: int = 1000):
    """``open_into`` ``key`` and read its payload in ``step``-byte pieces, last piece first."""
    pieces = store.open_into(key, buf)
    assert pieces is not None
    start = pieces.payload_offset
    for lo in reversed(range(start, pieces.size, step)):
        pieces.read(lo, min(step, pieces.size - lo))
    return pieces


def test_open_into_reads_pieces_in_any_order_into_the_files_places(filled) -> None:
    store, items = filled
    buf = bytearray(max(len(v) for _, v in items) + 100)
    for key, value in items:
        pieces = _pieces_back_to_front(store, key, buf)
        assert pieces.size == len(value) and pieces.header.key == key.hex()
        assert bytes(buf[: len(value)]) == value  # byte i of the file at buf[i]
        got = pieces.finish()
        assert got is not None and got.tobytes() == value and got.obj is buf
        assert pieces.finish() is got  # once: the first answer
    assert store.stats().hits == len(items)


def test_open_into_finish_reads_what_was_not_read(filled) -> None:
    store, items = filled
    key, value = items[1]
    buf = bytearray(len(value))
    pieces = store.open_into(key, buf)
    assert pieces is not None
    mid = pieces.payload_offset + 700
    pieces.read(mid, 300)  # one piece in the middle: the head, gaps and checksum are left
    assert bytes(buf[mid + 300 :]) != value[mid + 300 :]
    got = pieces.finish()
    assert got is not None and got.tobytes() == value


@pytest.mark.parametrize("where", ["payload", "checksum", "read_twice"])
def test_open_into_a_tampered_chunk_fails_at_finish_and_is_dropped(filled, where: str) -> None:
    store, items = filled
    (k0, v0), (k1, _) = items[0], items[1]
    path = _file(store, k0)
    buf = bytearray(len(v0) + 64)
    raw = bytearray(v0)
    if where == "read_twice":  # read whole, then the file changes under the open handle
        pieces = _pieces_back_to_front(store, k0, buf)
        raw[len(raw) // 2] ^= 0x08
        with open(path, "r+b") as f:  # in place: the same inode
            f.seek(len(raw) // 2)
            f.write(bytes(raw[len(raw) // 2 : len(raw) // 2 + 1]))
        pieces.read(len(raw) // 2, 1)  # a piece read again sees the new byte
    else:
        raw[len(raw) // 2 if where == "payload" else -3] ^= 0x08
        path.write_bytes(bytes(raw))
        pieces = _pieces_back_to_front(store, k0, buf)  # the header still parses
    assert pieces.finish() is None  # nothing read may be served
    assert store.stats().corrupt == 1 and not path.exists()
    again = store.open_into(k1, buf)  # the others are untouched
    assert again is not None and again.finish() is not None


def test_open_into_misses(filled, tmp_path: Path) -> None:
    store, items = filled
    (k0, v0), (k1, v1) = items[0], items[1]
    assert store.open_into(b"\x07" * 32, bytearray(64)) is None  # absent
    assert store.open_into(k0, bytearray(len(v0) - 1)) is None  # larger than the buffer
    _file(store, k1).write_bytes(b"SCKV" + b"\xff" * 60)  # a header that does not parse
    assert store.open_into(k1, bytearray(len(v1))) is None
    assert store.stats().corrupt == 1 and not _file(store, k1).exists()
    assert store.stats().misses == 3
    with pytest.raises(TypeError, match="writable"):
        store.open_into(k0, b"read-only bytes")
    pieces = store.open_into(k0, bytearray(len(v0)))
    assert pieces is not None
    with pytest.raises(ValueError, match="outside"):
        pieces.read(len(v0) - 10, 11)
    pieces.close()  # given up: nothing verified, nothing served
    assert pieces.finish() is None
    sealed = DiskStore(tmp_path / "sealed", sealer=ChunkSealer(TenantKeyring(SECRET)))
    sealed.put_many(chain(1, payload=256))
    with pytest.raises(ConfigError, match="sealed"):
        sealed.open_into(chain(1, payload=256)[0][0], bytearray(4096))

