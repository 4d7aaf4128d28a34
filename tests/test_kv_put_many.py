"""DiskStore.put_many with "flush" and "fsync": chunks written concurrently, the batch's promise.

A batch is written by its caller and the process's helper threads; when ``put_many`` returns
every chunk is in its final file and in the index (a restart finds them all, a tampered one is
refused), events come in the batch's order, a repeated key keeps its last value and a failed
write leaves only that chunk out.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from semcomm.kv import DiskStore, StoreEvent

from ._kvchunks import chain

DURABILITIES = ["flush", "fsync"]


def chunk_files(path: Path) -> list[Path]:
    return sorted(path.glob("??/*.sckv"))


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_batch_is_written_by_several_threads_at_once(tmp_path: Path, durability: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path, durability=durability, writer_threads=2, refresh_s=None)
    # the first two writes wait for each other: with one writing thread this times out
    meet = threading.Barrier(2, timeout=10)
    writers: set[str] = set()
    real: Callable[..., str | None] = store._stage

    arrivals = itertools.count()  # next() is atomic: exactly the first two writes wait

    def stage(job: object, **kw: object) -> str | None:
        writers.add(threading.current_thread().name)
        if next(arrivals) < 2:
            try:
                meet.wait()
            except threading.BrokenBarrierError:
                pass
        return real(job, **kw)

    monkeypatch.setattr(store, "_stage", stage)
    items = chain(8, payload=4096)
    store.put_many(items)
    assert not meet.broken, "no two chunks of the batch were written at the same time"
    assert len(writers) >= 2
    assert threading.current_thread().name in writers  # the caller writes too
    assert all(store.get(k) == v for k, v in items)


@pytest.mark.parametrize("durability", DURABILITIES)
def test_on_return_every_chunk_is_a_file_and_indexed(tmp_path: Path, durability: str) -> None:
    store = DiskStore(tmp_path, durability=durability, refresh_s=None)
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    items = chain(24, payload=2048)
    store.put_many(items)
    assert len(chunk_files(tmp_path)) == 24 and not list(tmp_path.glob("??/.*.tmp"))
    assert len(store) == 24 and store.stats().puts == 24
    assert store.stats().bytes == sum(len(v) for _, v in items)
    assert [(e.kind, e.key) for e in events] == [("store", k) for k, _ in items]  # batch order
    assert store.lookup([k for k, _ in items]).num_chunks == 24


@pytest.mark.parametrize("durability", DURABILITIES)
def test_a_restart_finds_the_batch_and_refuses_a_tampered_chunk(tmp_path: Path,
                                                                durability: str) -> None:
    items = chain(12, payload=2048)
    store = DiskStore(tmp_path, durability=durability, refresh_s=None)
    store.put_many(items)
    store.close()
    key = items[5][0]
    path = tmp_path / key.hex()[:2] / f"{key.hex()}.sckv"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    reopened = DiskStore(tmp_path, refresh_s=None)
    assert len(reopened) == 12  # the index is rebuilt from the headers
    assert reopened.get(key) is None and reopened.stats().corrupt == 1
    assert all(reopened.get(k) == v for k, v in items if k != key)


def test_a_repeated_key_keeps_its_last_value(tmp_path: Path) -> None:
    # the same tokens (the same key) with another payload: a second version of the chunk
    first, second = chain(1, seed=1)[0], chain(1, seed=1, payload=128)[0]
    assert first[0] == second[0] and first[1] != second[1]
    other = chain(1, seed=2)[0]
    store = DiskStore(tmp_path, refresh_s=None)
    store.put_many([first, other, second])
    assert store.get(first[0]) == second[1]
    assert len(store) == 2 and store.stats().bytes == len(second[1]) + len(other[1])
    assert DiskStore(tmp_path, refresh_s=None).get(first[0]) == second[1]


def test_a_failed_write_leaves_only_that_chunk_out(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, refresh_s=None)
    items = chain(16, payload=1024)
    broken = items[3][0].hex()[:2]
    shard = tmp_path / broken
    for f in shard.iterdir():
        f.unlink()
    shard.rmdir()
    shard.write_text("not a directory")  # every write into this shard fails
    store.put_many(items)
    lost = [k for k, _ in items if k.hex()[:2] == broken]
    assert store.stats().errors == len(lost)
    assert all((store.get(k) is None) == (k in lost) for k, _ in items)
    assert len(store) == len(items) - len(lost)
    assert store.stats().bytes == sum(len(v) for k, v in items if k not in lost)


def test_writer_threads_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writer threads"):
        DiskStore(tmp_path, writer_threads=0)
