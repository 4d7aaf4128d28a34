"""The put fast paths keep every guarantee: the hand-over, preallocated files, waiting writers.

* A value ``encode_chunk`` just returned is checked without a second hash (the hand-over), but
  anything else (a copy, altered bytes, the same object under another key) is checked as before
  and a bad value is refused and stored nowhere.
* Large chunk files get their blocks preallocated; the file is exactly the chunk, a refusing
  filesystem only turns the preallocation off, and every read still verifies.
* Write-behind: a caller that waits (``flush``) writes queued chunks itself, and a key's writes
  still land in the order they were put.
"""

from __future__ import annotations

import ctypes
import errno
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash

from semcomm.errors import InvalidInputError
from semcomm.kv import DiskStore, MemoryStore, TieredStore, _disk, _disk_io, _format, encode_chunk
from semcomm.kv._format import _Handover
from semcomm.kv._writeback import WriteQueue

from ._kvchunks import NS, chain


def _altered(value: bytes, at: int) -> bytes:
    raw = bytearray(value)
    raw[at] ^= 0x01
    return bytes(raw)


# ---- the hand-over --------------------------------------------------------------------------
def test_encode_chunk_hands_over_exactly_the_object_it_returns() -> None:
    (key, value), = chain(1)
    assert _format._HANDOVER.take(value)  # the very object: held
    assert not _format._HANDOVER.take(value)  # one hand-over per encoding
    assert not _format._HANDOVER.take(bytes(bytearray(value)))  # equal bytes, another object


@pytest.mark.parametrize("at", [-1, -20, 60, 12])  # checksum, payload, header, header length
def test_altered_bytes_of_an_encoded_chunk_are_refused_by_every_store(
        tmp_path: Path, at: int) -> None:
    (key, value), = chain(1, payload=4096)
    bad = _altered(value, at)
    stores = [MemoryStore(), DiskStore(tmp_path / "kv"),
              DiskStore(tmp_path / "wb", durability="write-behind"),
              TieredStore([MemoryStore(), DiskStore(tmp_path / "t")])]
    for store in stores:
        with pytest.raises(InvalidInputError):
            store.put(key, bad)
        assert not store.contains(key) and store.stats().entries == 0
        store.put(key, value)  # the original is still good
        assert store.get(key) == value
        store.close()


def test_a_handed_over_chunk_under_another_key_is_refused(tmp_path: Path) -> None:
    (k0, v0), (k1, _) = chain(2)
    store = DiskStore(tmp_path / "kv")
    with pytest.raises(InvalidInputError, match="says it is"):
        store.put(k1, v0)
    assert not store.contains(k1)


def test_a_handed_over_chunk_is_stored_without_a_second_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = xxhash.xxh3_128_digest

    def counting(data: Any) -> bytes:
        hashed.append(len(memoryview(data)))
        return bytes(real(data))

    items = chain(3, payload=4096)
    copies = [(k, bytes(bytearray(v))) for k, v in items]
    monkeypatch.setattr(_format.xxhash, "xxh3_128_digest", counting)
    store = TieredStore([MemoryStore(), DiskStore(tmp_path / "kv")])
    for k, v in items:
        store.put(k, v)  # validated once, no tier hashes it again
    assert hashed == []
    for k, v in copies:  # bytes from anywhere else: verified (once, by the tiered store)
        store.put(k, v)
    assert len(hashed) == 3
    hashed.clear()
    disk = DiskStore(tmp_path / "kv")
    assert all(disk.get(k) == v for k, v in items)  # reads always verify
    assert len(hashed) == 3


def test_reads_verify_even_what_was_handed_over(tmp_path: Path) -> None:
    items = chain(2, payload=4096)
    store = DiskStore(tmp_path / "kv")
    store.put_many(items)
    path = Path(store._path(items[1][0]))
    path.write_bytes(_altered(path.read_bytes(), 100))
    assert store.get(items[1][0]) is None and store.stats().corrupt == 1
    assert store.get(items[0][0]) == items[0][1]


def test_the_hand_over_is_bounded_and_holds_the_objects_it_vouches_for() -> None:
    h = _Handover(max_items=2, max_bytes=100, ttl_s=60)
    a, b, c = (bytes([i]) * 40 for i in range(3))
    for v in (a, b, c):
        h.give(v)
    assert len(h) == 2 and not h.take(a) and h.take(b) and h.take(c)  # oldest dropped first
    h.give(bytes(101))  # larger than the whole budget: never held
    assert len(h) == 0
    d, e = bytes(60), b"\x01" * 60
    h.give(d)
    h.give(e)  # 120 bytes > 100: the oldest goes
    assert not h.take(d) and h.take(e)
    h.give(bytearray(b"x"))  # type: ignore[arg-type]  # mutable: never vouched for
    assert len(h) == 0
    old = _Handover(ttl_s=0.0)
    old.give(a)
    old.give(b)  # a expired at once
    assert not old.take(a)


def test_encode_chunk_still_returns_plain_bytes() -> None:
    (key, value), = chain(1)
    again = encode_chunk(namespace=NS.digest, key=key, parent=None, num_tokens=4, start=0,
                         dtype="float32", codec="none", codec_params={}, arrays={})
    assert type(value) is bytes and type(again) is bytes and value != again


# ---- preallocated files ---------------------------------------------------------------------
def test_large_chunks_are_written_preallocated_and_exactly(tmp_path: Path) -> None:
    items = chain(2, payload=_disk._PREALLOCATE_MIN)  # above the preallocation threshold
    store = DiskStore(tmp_path / "kv")
    assert store._preallocate == (_disk_io._FALLOCATE is not None)
    store.put_many(items)
    for k, v in items:
        assert Path(store._path(k)).read_bytes() == v  # no preallocated tail
    buf = bytearray(max(len(v) for _, v in items))
    again = DiskStore(tmp_path / "kv")
    assert all(again.get(k) == v and bytes(again.get_into(k, buf) or b"") == v
               for k, v in items)


def test_a_filesystem_that_cannot_preallocate_turns_it_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def refuse(fd: int, mode: int, offset: int, length: int) -> int:
        calls.append(length)
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(_disk_io, "_FALLOCATE", refuse)
    store = DiskStore(tmp_path / "kv")
    items = chain(3, payload=_disk._PREALLOCATE_MIN)
    store.put_many(items)
    assert len(calls) == 1 and not store._preallocate  # asked once, then not again
    assert all(store.get(k) == v for k, v in items) and store.stats().errors == 0


def test_a_full_disk_at_preallocation_is_a_failed_write_not_a_torn_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, mode: int, offset: int, length: int) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(_disk_io, "_FALLOCATE", full)
    store = DiskStore(tmp_path / "kv")
    (k, v), = chain(1, payload=_disk._PREALLOCATE_MIN)
    store.put(k, v)
    assert store.stats().errors == 1 and not store.contains(k)
    shards = [p for p in (tmp_path / "kv").iterdir() if p.is_dir()]
    assert not [f for d in shards for f in d.iterdir()]  # no temporary file left behind
    assert store._preallocate  # still on: the disk may have room later


# ---- waiting callers write ------------------------------------------------------------------
class _Job:
    __slots__ = ("key", "value")

    def __init__(self, key: bytes, value: bytes) -> None:
        self.key = key
        self.value = value


def test_flush_writes_the_queue_itself_when_no_writer_runs() -> None:
    written: list[tuple[str, bytes]] = []
    q: WriteQueue[_Job] = WriteQueue(
        lambda job: written.append((threading.current_thread().name, job.value)),
        max_bytes=1 << 20, threads=2)
    q._threads[1] = threading.Thread()  # lane 1's writer never gets to run (a busy machine)
    jobs = [_Job(bytes([1]) + bytes(31), f"v{i}".encode()) for i in range(4)]  # all lane 1
    for job in jobs:
        q.submit(job)
    q.flush()  # returns: the caller wrote them, in order
    assert written == [(threading.current_thread().name, j.value) for j in jobs]
    assert q.queued == (0, 0)
    q._threads[1] = None
    q.close()


def test_a_keys_writes_land_in_put_order_with_writers_and_helpers() -> None:
    seen: dict[bytes, list[int]] = {}
    lock = threading.Lock()

    def write(job: _Job) -> None:
        with lock:
            seen.setdefault(job.key, []).append(int(job.value))

    q: WriteQueue[_Job] = WriteQueue(write, max_bytes=64, threads=3)  # tight: submit helps too
    keys = [bytes([i]) + bytes(31) for i in range(6)]

    def produce(k: bytes) -> None:
        for n in range(200):
            q.submit(_Job(k, str(n).encode()))
            if n % 17 == 0:
                q.flush()

    producers = [threading.Thread(target=produce, args=(k,)) for k in keys]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    q.close()
    assert seen == {k: list(range(200)) for k in keys}


# ---- the budget under any interleaving -----------------------------------------------------
def test_the_budget_holds_when_only_the_newly_indexed_chunk_can_go(tmp_path: Path) -> None:
    items = chain(3)  # 0 <- 1 <- 2: only a chain's tail may be evicted
    size = max(len(v) for _, v in items)
    store = DiskStore(tmp_path / "kv", capacity_bytes=2 * size + size // 2)  # two chunks fit
    store.put_many(items[:2])
    other = DiskStore(tmp_path / "kv", capacity_bytes=10 * size)  # another process's view
    other.put(*items[2])
    events: list[tuple[str, bytes]] = []
    store.subscribe(lambda e: events.append((e.kind, e.key)))
    assert store.get(items[2][0]) == items[2][1]  # verified and served, then over budget:
    assert store.stats().bytes <= store.capacity_bytes  # the tail itself goes
    assert events == [("store", items[2][0]), ("evict", items[2][0])]
    assert [store.get(k) for k, _ in items[:2]] == [v for _, v in items[:2]]


def test_a_read_that_failed_before_a_write_landed_keeps_the_landed_chunk(tmp_path: Path) -> None:
    """Threads interleave a get that finds no file (the chunk was just evicted) with a put of
    the same key that renames its file into place and indexes it. The get's miss must not
    forget the key then: the file would stay on disk uncounted, and a later read indexing it
    would push the store over its budget."""
    import os

    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 20)
    (key, value), = chain(1)
    path = store._path(key)
    store.put(key, value)  # the write that landed
    # the read that failed earlier, reported now: the file is back
    store._read_failed(key, path, FileNotFoundError(path))
    assert key in store._lru.entries and store.stats().bytes == len(value)
    assert store.get(key) == value
    # with the file really gone the key is forgotten
    os.unlink(path)
    store._read_failed(key, path, FileNotFoundError(path))
    assert key not in store._lru.entries and store.stats().bytes == 0


def test_a_write_evicted_before_it_is_indexed_is_not_indexed(tmp_path: Path) -> None:
    """A put renames its file into place; before it indexes the key, another write of the key
    is indexed and evicted, and the eviction unlinks this file. Indexing it then would list
    a chunk with no file."""
    import os

    store = DiskStore(tmp_path / "kv", capacity_bytes=1 << 20)
    (key, value), = chain(1)
    job = store._admit(key, value, None)
    assert job is not None and store._write(job, sync=False)
    os.unlink(store._path(key))  # what the eviction did
    store._finish(job, True)
    assert key not in store._lru.entries
    st = store.stats()
    assert st.bytes == 0 and st.entries == 0 and store._reserved == 0
    assert list(store.scan()) == []
