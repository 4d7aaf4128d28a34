"""DiskStore: reopen, corruption, crash safety, several writing processes, budgets."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from semcomm.errors import ConfigError
from semcomm.kv import DiskStore, StoreEvent

from ._kvchunks import chain, singles

ROOT = Path(__file__).resolve().parents[1]


def chunk_files(path: Path) -> list[Path]:
    return sorted(path.glob("??/*.sckv"))


def tmp_files(path: Path) -> list[Path]:
    return sorted(path.glob("??/.*.tmp"))


def disk_bytes(path: Path) -> int:
    total = 0
    for p in chunk_files(path):
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # evicted meanwhile (a store's refresher thread)
            pass
    return total


def start_together(procs: list[subprocess.Popen[bytes]], go: Path) -> None:
    """Wait until every worker is ready, then release them at once."""
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == b"ready", (line, p.stderr.read() if p.stderr else b"")
    go.touch()


def worker(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests._kv_worker", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture
def kvdir(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Child processes of a test; any still running at the end are killed."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        DiskStore(f)
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskStore(tmp_path / "a", capacity_bytes=-5)


def test_files_are_sharded_and_named_by_key(kvdir: Path) -> None:
    store = DiskStore(kvdir)
    c = chain(3)
    for k, v in c:
        store.put(k, v)
    for k, v in c:
        p = kvdir / k.hex()[:2] / f"{k.hex()}.sckv"
        assert p.read_bytes() == v
    assert not tmp_files(kvdir)


def test_reopen_rebuilds_the_index_and_serves_hits(kvdir: Path) -> None:
    c = chain(4)
    store = DiskStore(kvdir)
    for k, v in c:
        store.put(k, v)
    store.close()
    again = DiskStore(kvdir)
    st = again.stats()
    assert st.entries == 4 and st.bytes == sum(len(v) for _, v in c)
    assert again.lookup([k for k, _ in c]).num_chunks == 4
    assert all(again.get(k) == v for k, v in c)
    assert again.stats().hits == 4


def test_reopen_orders_lru_by_mtime(kvdir: Path) -> None:
    items = singles(4, seed=5)
    size = max(len(v) for _, v in items)
    store = DiskStore(kvdir)
    for k, v in items[:3]:
        store.put(k, v)
    now = time.time()
    for age, (k, _) in zip((10, 30, 20), items[:3]):  # oldest: item 1, then 2, then 0
        p = kvdir / k.hex()[:2] / f"{k.hex()}.sckv"
        os.utime(p, (now - age, now - age))
    again = DiskStore(kvdir, capacity_bytes=3 * size)
    assert again.eviction_order() == [items[1][0], items[2][0], items[0][0]]
    again.put(*items[3])
    assert not again.contains(items[1][0]) and again.contains(items[2][0])


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "swap", "garbage", "empty"])
def test_corrupt_files_are_rejected_counted_and_removed(kvdir: Path, damage: str) -> None:
    (k0, v0), (k1, v1) = chain(2)
    store = DiskStore(kvdir)
    store.put(k0, v0)
    store.put(k1, v1)
    evicts: list[StoreEvent] = []
    store.subscribe(lambda e: evicts.append(e) if e.kind == "evict" else None)
    p0 = kvdir / k0.hex()[:2] / f"{k0.hex()}.sckv"
    p1 = kvdir / k1.hex()[:2] / f"{k1.hex()}.sckv"
    if damage == "truncate":
        p0.write_bytes(v0[: len(v0) // 2])
    elif damage == "bitflip":
        b = bytearray(v0)
        b[len(b) - 40] ^= 0x04  # inside the tensor payload
        p0.write_bytes(bytes(b))
    elif damage == "swap":
        p0.write_bytes(v1)  # a valid chunk, but of another key
    elif damage == "garbage":
        p0.write_bytes(os.urandom(len(v0)))
    else:
        p0.write_bytes(b"")
    assert store.contains(k0)  # presence is cheap; the bytes are checked on read
    assert store.get(k0) is None
    assert not p0.exists() and p1.exists()
    st = store.stats()
    assert st.corrupt == 1 and st.misses == 1 and st.entries == 1
    assert [(e.key, e.reason) for e in evicts] == [(k0, "corrupt")]
    assert store.get(k1) == v1


def test_open_drops_files_with_bad_headers(kvdir: Path) -> None:
    (k0, v0), (k1, v1), (k2, v2) = chain(3)
    store = DiskStore(kvdir)
    for k, v in ((k0, v0), (k1, v1), (k2, v2)):
        store.put(k, v)
    store.close()
    (kvdir / k0.hex()[:2] / f"{k0.hex()}.sckv").write_bytes(v0[:-7])  # size mismatch
    (kvdir / k1.hex()[:2] / f"{k1.hex()}.sckv").write_bytes(v2)  # names another key
    again = DiskStore(kvdir)
    st = again.stats()
    assert st.entries == 1 and st.corrupt == 2
    assert [p.name for p in chunk_files(kvdir)] == [f"{k2.hex()}.sckv"]
    assert again.get(k2) == v2


def test_budget_exact_lru_under_random_workload(kvdir: Path) -> None:
    rnd = random.Random(11)
    items = singles(6, seed=1, payload=32) + singles(6, seed=2, payload=400)
    cap = 4000
    store = DiskStore(kvdir, capacity_bytes=cap, fsync=False)
    model: OrderedDict[bytes, int] = OrderedDict()
    for _ in range(250):
        key, value = rnd.choice(items)
        if rnd.random() < 0.55:
            store.put(key, value)
            model.pop(key, None)
            while model and sum(model.values()) + len(value) > cap:
                model.popitem(last=False)
            model[key] = len(value)
        else:
            got = store.get(key)
            assert (got == value) if key in model else got is None
            if key in model:
                model.move_to_end(key)
        assert disk_bytes(kvdir) <= cap
        assert store.eviction_order() == list(model)
    assert store.stats().evictions > 10


def test_prefix_outlives_extension_on_disk(kvdir: Path) -> None:
    c = chain(3)
    o = singles(2, seed=8)
    size = max(len(v) for _, v in c + o)
    store = DiskStore(kvdir, capacity_bytes=4 * size)
    for k, v in c:
        store.put(k, v)
    store.put(*o[0])
    store.put(*o[1])  # must evict: the tail of the chain (2), not its oldest chunk (0)
    assert store.lookup([k for k, _ in c]).num_chunks == 2
    assert store.contains(o[0][0])


def test_stale_tmp_files_are_removed_on_open(kvdir: Path) -> None:
    (k0, v0), = chain(1)
    store = DiskStore(kvdir)
    store.put(k0, v0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, check=True)
    dead_pid = int(dead.stdout)
    shard = kvdir / k0.hex()[:2]
    stale = shard / f".{k0.hex()}.{dead_pid}.abcd1234.tmp"
    stale.write_bytes(v0[:10])
    live = shard / f".{k0.hex()}.{os.getpid()}.beef0000.tmp"  # a write of ours in progress
    live.write_bytes(v0[:10])
    DiskStore(kvdir)
    assert not stale.exists() and live.exists()


def test_two_processes_write_concurrently(kvdir: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    DiskStore(kvdir).close()
    n = 40
    go = kvdir.parent / "go"
    procs.extend(worker("disk", str(kvdir), str(seed), str(n), str(10 << 30), str(go))
                 for seed in (1, 2))
    start_together(procs, go)
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    store = DiskStore(kvdir)
    expected = chain(n, seed=1, payload=256) + chain(n, seed=2, payload=256)
    assert store.stats().entries == 2 * n and store.stats().corrupt == 0
    assert all(store.get(k) == v for k, v in expected)
    assert store.stats().corrupt == 0 and not tmp_files(kvdir)


def test_two_processes_share_one_budget(kvdir: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    size = len(chain(1, payload=256)[0][1]) + 2
    cap = 25 * size
    DiskStore(kvdir, capacity_bytes=cap).close()
    go = kvdir.parent / "go"
    procs.extend(worker("disk", str(kvdir), str(seed), "60", str(cap), str(go)) for seed in (3, 4))
    start_together(procs, go)
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    store = DiskStore(kvdir, capacity_bytes=cap)  # opening sweeps under the lock
    assert disk_bytes(kvdir) <= cap
    assert store.stats().bytes == disk_bytes(kvdir)
    valid = {k: v for k, v in chain(60, seed=3, payload=256) + chain(60, seed=4, payload=256)}
    keys = list(store.scan())
    assert keys and all(store.get(k) == valid[k] for k in keys)
    assert store.stats().corrupt == 0


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_refresher_indexes_another_writers_files_and_deletions(kvdir: Path) -> None:
    """Nothing is called on the store: its refresher thread alone sees the other writer."""
    store = DiskStore(kvdir, refresh_s=0.05)
    other = DiskStore(kvdir, refresh_s=None)  # its own index, as another process has
    items = singles(5, seed=21)
    for k, v in items:
        other.put(k, v)
    assert wait_for(lambda: store.stats().entries == 5), store.stats()
    assert store.stats().bytes == disk_bytes(kvdir)
    for k, _ in items[:2]:
        other.delete(k)
    assert wait_for(lambda: store.stats().entries == 3), store.stats()
    assert set(store.eviction_order()) == {k for k, _ in items[2:]}
    from semcomm.kv import _refresher

    assert id(store) in _refresher.REFRESHER._due
    store.close()
    assert id(store) not in _refresher.REFRESHER._due  # the refresher no longer re-lists it


def test_refresher_keeps_the_budget_shared_with_another_writer(kvdir: Path) -> None:
    size = len(singles(1, seed=30)[0][1])
    cap = 10 * size
    store = DiskStore(kvdir, capacity_bytes=cap, refresh_s=0.05)
    other = DiskStore(kvdir, capacity_bytes=cap, refresh_s=None)
    for k, v in singles(6, seed=31):
        store.put(k, v)
    for k, v in singles(6, seed=32):  # 12 chunks on disk: each index sees only its own 6
        other.put(k, v)
    assert wait_for(lambda: disk_bytes(kvdir) <= cap), disk_bytes(kvdir)
    assert store.stats().bytes == disk_bytes(kvdir) and store.stats().evictions == 2


def test_put_never_lists_the_directory(kvdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from semcomm.kv import _disk, _refresher

    store = DiskStore(kvdir, refresh_s=0.05)
    other = DiskStore(kvdir, refresh_s=None)
    other.put(*singles(1, seed=40)[0])  # a file the refresher has to find
    me = threading.get_ident()
    listings = []
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(path: Any) -> Any:
        listings.append(threading.get_ident())
        return real_scandir(path)

    def listdir(path: Any) -> Any:
        listings.append(threading.get_ident())
        return real_listdir(path)

    monkeypatch.setattr(_disk.os, "scandir", scandir)
    monkeypatch.setattr(_disk.os, "listdir", listdir)
    monkeypatch.setattr(_refresher, "REFRESH_S", 0.0)  # the old put re-listed when this had passed
    for k, v in singles(20, seed=41):
        store.put(k, v)
        time.sleep(0.005)
    assert me not in listings
    assert wait_for(lambda: store.stats().entries == 21)
    assert me not in listings and listings  # the refresher thread listed


def test_relisting_reads_only_shards_that_changed(kvdir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from semcomm.kv import _disk

    store = DiskStore(kvdir, refresh_s=None)
    other = DiskStore(kvdir, refresh_s=None)
    time.sleep(0.05)  # past the racy window of the open's listing
    listed: list[str] = []
    real_listdir = os.listdir

    def listdir(path: Any) -> Any:
        listed.append(os.path.basename(path))
        return real_listdir(path)

    monkeypatch.setattr(_disk.os, "listdir", listdir)
    store._refresh()  # shards made within the racy window of the open's listing: read again
    listed.clear()
    assert store._refresh() == [] and listed == []  # nothing changed since: no shard read
    key, value = singles(1, seed=50)[0]
    other.put(key, value)
    store._refresh()
    assert listed == [key.hex()[:2]] and store.stats().entries == 1
    time.sleep(0.05)
    listed.clear()
    store._refresh()  # listed once more (its mtime was within the racy window), then not
    store._refresh()
    assert listed == [key.hex()[:2]]
    store.sweep()  # a sweep lists every shard
    assert len(listed) == 1 + 256


def test_refresh_s_is_checked(kvdir: Path) -> None:
    with pytest.raises(ValueError, match="refresh_s"):
        DiskStore(kvdir, refresh_s=0)
    with pytest.raises(TypeError, match="refresh_s"):
        DiskStore(kvdir, refresh_s="1")  # type: ignore[arg-type]


def test_kill_9_mid_write_never_serves_a_partial_chunk(
    kvdir: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    DiskStore(kvdir).close()
    p = worker("big", str(kvdir))
    procs.append(p)
    deadline = time.monotonic() + 60
    while not tmp_files(kvdir) or not chunk_files(kvdir):  # killed while writing chunk >= 1
        assert p.poll() is None, p.stderr.read().decode() if p.stderr else ""
        assert time.monotonic() < deadline, "writer never got going"
        time.sleep(0.002)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    store = DiskStore(kvdir)
    assert not tmp_files(kvdir)  # the dead writer's partial file is gone
    keys = list(store.scan())
    assert keys and store.stats().entries == len(keys)
    assert all(store.get(k) is not None for k in keys)
    assert store.stats().corrupt == 0


# ---- durability and batched writes ------------------------------------------------------

@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count file fsyncs and whole-filesystem syncs made by DiskStore."""
    from semcomm.kv import _disk_io

    counts = {"fsync": 0, "syncfs": 0}
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        counts["fsync"] += 1
        real_fsync(fd)

    def syncfs(fd: int) -> None:
        counts["syncfs"] += 1

    monkeypatch.setattr(_disk_io.os, "fsync", fsync)
    monkeypatch.setattr(_disk_io, "syncfs", syncfs)
    return counts


@pytest.mark.parametrize(("kwargs", "expect"), [
    ({}, "flush"), ({"durability": "fsync"}, "fsync"), ({"fsync": True}, "fsync"),
    ({"fsync": False}, "flush"), ({"durability": "flush"}, "flush"),
    ({"durability": "write-behind"}, "write-behind"),
])
def test_durability_setting(tmp_path: Path, kwargs: dict[str, object], expect: str) -> None:
    assert DiskStore(tmp_path, **kwargs).durability == expect  # type: ignore[arg-type]


def test_bad_durability_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="durability"):
        DiskStore(tmp_path, durability="sometimes")


def test_flush_never_syncs_and_fsync_syncs_each_put(tmp_path: Path, syncs: dict[str, int]) -> None:
    items = chain(4)
    flush = DiskStore(tmp_path / "f")
    for k, v in items:
        flush.put(k, v)
    assert syncs == {"fsync": 0, "syncfs": 0}
    durable = DiskStore(tmp_path / "d", durability="fsync")
    for k, v in items:
        durable.put(k, v)
    assert syncs["fsync"] == 2 * len(items)  # the file before its rename, its directory after
    assert all(durable.get(k) == v for k, v in items)


def test_put_many_syncs_once_per_batch(tmp_path: Path, syncs: dict[str, int]) -> None:
    items = chain(12)
    store = DiskStore(tmp_path, durability="fsync")
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    store.put_many(items)
    assert syncs["syncfs"] == 1
    shards = {k.hex()[:2] for k, _ in items}
    assert syncs["fsync"] == len(shards)  # one per directory renamed into, no file fsyncs
    assert [e.key for e in events] == [k for k, _ in items]
    assert all(store.get(k) == v for k, v in items)
    assert len(DiskStore(tmp_path)) == 12


def test_put_many_validates_the_whole_batch_first(tmp_path: Path) -> None:
    from semcomm.errors import InvalidInputError

    items = chain(3)
    store = DiskStore(tmp_path, durability="fsync")
    bad = [items[0], (items[1][0], items[2][1]), items[2]]  # value names another key
    with pytest.raises(InvalidInputError):
        store.put_many(bad)
    assert len(store) == 0 and chunk_files(tmp_path) == []


def test_a_reopened_store_knows_its_shard_directories(kvdir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from semcomm.kv import _disk

    DiskStore(kvdir).close()
    store = DiskStore(kvdir, refresh_s=None)
    made: list[str] = []
    real = os.makedirs
    monkeypatch.setattr(_disk.os, "makedirs", lambda p, **kw: (made.append(p), real(p, **kw)))
    items = singles(8, seed=60)
    for k, v in items:
        store.put(k, v)
    assert made == [] and all(store.get(k) == v for k, v in items)
    shutil.rmtree(kvdir / items[0][0].hex()[:2])  # a shard removed under the store: made again
    store.put(*items[0])
    assert len(made) == 1 and store.get(items[0][0]) == items[0][1]
