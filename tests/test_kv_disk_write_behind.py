"""DiskStore(durability="write-behind"): queued chunks are served at once, written by flush/close
(and at interpreter exit), bounded with backpressure, never torn by a crash; the server setting."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from semcomm.errors import InvalidInputError
from semcomm.kv import DiskStore

from ._kvchunks import chain
from .test_kv_disk import chunk_files, tmp_files, worker


class Gate:
    """Holds every write of a store until opened: a disk that is slower than its producer."""

    def __init__(self, store: DiskStore) -> None:
        self.open = threading.Event()
        self.waiting = threading.Semaphore(0)  # released once per write that reached the gate
        inner = store._write

        def held(job: Any, *, sync: bool) -> bool:
            self.waiting.release()
            assert self.open.wait(30), "gate never opened"
            return inner(job, sync=sync)

        store._write = held  # type: ignore[method-assign]


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[DiskStore, Gate]]:
    """A write-behind store whose writers wait for ``gate.open`` (opened again at teardown)."""
    store = DiskStore(tmp_path / "kv", durability="write-behind", writer_threads=1)
    gate = Gate(store)
    yield store, gate
    gate.open.set()
    store.close()


def test_queued_chunks_are_served_at_once_and_flush_makes_them_visible(
    slow: tuple[DiskStore, Gate], tmp_path: Path
) -> None:
    store, gate = slow
    items = chain(3)
    for k, v in items:
        store.put(k, v)
    assert gate.waiting.acquire(timeout=10)  # the writer holds the first chunk: nothing on disk
    assert chunk_files(tmp_path / "kv") == []
    buf = bytearray(max(len(v) for _, v in items))
    for k, v in items:  # served from the queue, by every read
        assert store.contains(k) and store.get(k) == v
        view = store.get_into(k, buf)
        assert view is not None and bytes(view) == v
    assert store.lookup([k for k, _ in items]).num_chunks == 3
    assert sorted(store.scan()) == sorted(k for k, _ in items)
    assert len(store) == 3 and store.stats().bytes == sum(len(v) for _, v in items)
    other = DiskStore(tmp_path / "kv")  # another process's view: only files count
    assert not any(other.contains(k) for k, _ in items)
    gate.open.set()
    store.flush()
    assert len(chunk_files(tmp_path / "kv")) == 3 and not tmp_files(tmp_path / "kv")
    assert all(other.get(k) == v for k, v in items)
    assert store.stats().puts == 3 and store.stats().errors == 0



def test_open_into_serves_a_queued_chunk_whole(slow: tuple[DiskStore, Gate],
                                               tmp_path: Path) -> None:
    store, gate = slow
    items = chain(2)
    for k, v in items:
        store.put(k, v)
    assert gate.waiting.acquire(timeout=10) and chunk_files(tmp_path / "kv") == []
    buf = bytearray(max(len(v) for _, v in items))
    for k, v in items:  # from the queue: every byte already in place, nothing to read
        pieces = store.open_into(k, buf)
        assert pieces is not None and bytes(pieces.view) == v
        got = pieces.finish()
        assert got is not None and bytes(got) == v

def test_a_tiered_store_flushes_its_write_behind_tier(tmp_path: Path) -> None:
    from semcomm.kv import MemoryStore, TieredStore

    disk = DiskStore(tmp_path / "kv", durability="write-behind", writer_threads=1)
    gate = Gate(disk)
    store = TieredStore([MemoryStore(), disk])
    items = chain(2)
    try:
        store.put_many(items)
        assert gate.waiting.acquire(timeout=10) and chunk_files(tmp_path / "kv") == []
        gate.open.set()
        store.flush()
        assert all(DiskStore(tmp_path / "kv").get(k) == v for k, v in items)
    finally:
        gate.open.set()
        store.close()


def test_a_full_queue_makes_put_wait(tmp_path: Path) -> None:
    items = chain(3, payload=4096)
    size = len(items[0][1])
    store = DiskStore(tmp_path / "kv", durability="write-behind", writer_threads=1,
                      max_pending_bytes=2 * size + size // 2)  # room for two queued chunks
    gate = Gate(store)
    third_done = threading.Event()
    try:
        store.put(*items[0])
        store.put(*items[1])  # both accepted at once: 2 chunks fit
        t = threading.Thread(target=lambda: (store.put(*items[2]), third_done.set()))
        t.start()
        assert not third_done.wait(0.3)  # the third waits for room (backpressure)
        gate.open.set()
        assert third_done.wait(10)
        t.join()
        store.flush()
        assert len(chunk_files(tmp_path / "kv")) == 3
    finally:
        gate.open.set()
        store.close()


def test_close_writes_the_queue_and_a_reopened_store_finds_everything(
    slow: tuple[DiskStore, Gate], tmp_path: Path
) -> None:
    store, gate = slow
    items = chain(4)
    for k, v in items:
        store.put(k, v)
    gate.open.set()
    store.close()
    again = DiskStore(tmp_path / "kv")
    assert len(again) == 4 and all(again.get(k) == v for k, v in items)
    with pytest.raises(RuntimeError, match="closed"):
        store.put(*chain(1, seed=5)[0])


def test_invalid_values_are_refused_before_queueing(slow: tuple[DiskStore, Gate]) -> None:
    store, _ = slow
    (k0, v0), (k1, _) = chain(2)
    flipped = bytearray(v0)
    flipped[-20] ^= 0x10
    with pytest.raises(InvalidInputError, match=k0.hex()[:16]):
        store.put(k0, bytes(flipped))
    with pytest.raises(InvalidInputError):
        store.put_many([(k1, v0)])  # the header names chunk 0
    assert not store.contains(k0) and store.queue_depth == (0, 0)


def test_tampered_file_of_a_written_chunk_is_rejected(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "kv", durability="write-behind")
    (k0, v0), = chain(1)
    store.put(k0, v0)
    store.flush()
    path = tmp_path / "kv" / k0.hex()[:2] / f"{k0.hex()}.sckv"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    assert store.get(k0) is None and store.stats().corrupt == 1
    store.close()


def test_a_sealed_store_serves_queued_chunks_opened(tmp_path: Path) -> None:
    from semcomm.security import ChunkSealer, TenantKeyring

    sealer = ChunkSealer(TenantKeyring(b"s" * 32))
    store = DiskStore(tmp_path / "kv", durability="write-behind", writer_threads=1,
                      sealer=sealer)
    gate = Gate(store)
    (k0, v0), = chain(1)
    try:
        store.put(k0, v0)
        assert gate.waiting.acquire(timeout=10)
        assert store.get(k0) == v0  # the plaintext, though the queue holds the sealed bytes
        view = store.get_into(k0, bytearray(len(v0)))
        assert view is not None and bytes(view) == v0
    finally:
        gate.open.set()
        store.close()
    assert DiskStore(tmp_path / "kv", sealer=sealer).get(k0) == v0


def test_interpreter_exit_writes_what_is_queued(tmp_path: Path) -> None:
    kvdir = tmp_path / "kv"
    p = worker("behind", str(kvdir), "7", "30")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == b"queued", err.decode()
    store = DiskStore(kvdir)
    items = chain(30, seed=7, payload=4096)
    assert len(store) == 30 and all(store.get(k) == v for k, v in items)


def test_kill_9_mid_write_behind_never_serves_a_partial_chunk(tmp_path: Path) -> None:
    kvdir = tmp_path / "kv"
    DiskStore(kvdir).close()
    p = worker("big", str(kvdir), "write-behind")
    try:
        deadline = time.monotonic() + 60
        while not tmp_files(kvdir) or not chunk_files(kvdir):  # killed while writing one
            assert p.poll() is None, p.stderr.read().decode() if p.stderr else ""
            assert time.monotonic() < deadline, "writer never got going"
            time.sleep(0.002)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    store = DiskStore(kvdir)
    assert not tmp_files(kvdir)  # the dead writer's partial file is gone
    keys = list(store.scan())
    assert keys and all(store.get(k) is not None for k in keys)
    assert store.stats().corrupt == 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"durability": "later"}, "durability must be one of"),
    ({"durability": "write-behind", "max_pending_bytes": 0}, "max_pending_bytes"),
    ({"durability": "write-behind", "writer_threads": 0}, "writer threads"),
    ({"durability": "write-behind", "writer_threads": True}, "writer threads"),
])
def test_bad_settings_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DiskStore(tmp_path / "kv", **kwargs)
    assert not (tmp_path / "kv").exists()  # refused before the directory is touched


def test_server_config_sets_the_disk_durability(tmp_path: Path) -> None:
    from semcomm.errors import ConfigError
    from semcomm.server import load_config
    from semcomm.server._wiring import _kv_memory_bytes, build_kv_store

    def config(**kv: Any) -> Any:
        return load_config(None, overrides={"server": {"state_dir": str(tmp_path)},
                                            "models": {"t": {"path": "tiny"}}, "kv": kv},
                           defaults=False, environ={})

    store, _ = build_kv_store(config(disk_durability="write-behind",
                                     disk_max_pending_bytes=1 << 20))
    disk = next(t for t in store.tiers if t.name == "disk")
    assert disk.durability == "write-behind"
    store.close()
    plain = config()
    assert plain.kv.disk_durability == "flush"
    assert (_kv_memory_bytes(config(disk_durability="write-behind"))
            == plain.kv.memory_bytes + plain.kv.disk_max_pending_bytes)  # the queue is planned
    with pytest.raises((ConfigError, ValueError), match="disk_durability"):
        config(disk_durability="sometimes")
