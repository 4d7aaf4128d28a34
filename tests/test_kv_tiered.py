"""TieredStore: write-through, promotion on hit, independent budgets, lookup across tiers."""

from __future__ import annotations

from pathlib import Path

import pytest

from semcomm.errors import BackendDownWarning, ConfigError, InvalidInputError
from semcomm.kv import DiskStore, MemoryStore, RedisStore, StoreEvent, TieredStore

from ._kvchunks import chain, singles
from ._redis import RedisServer


def test_write_through_and_promotion(tmp_path: Path, redis_url: str) -> None:
    mem, disk, red = MemoryStore(), DiskStore(tmp_path / "kv"), RedisStore(redis_url)
    store = TieredStore([mem, disk, red])
    (k, v), = chain(1)
    store.put(k, v)
    assert mem.get(k) == disk.get(k) == red.get(k) == v
    mem.delete(k)
    disk.delete(k)
    got = store.fetch(k)
    assert got is not None and (got.value, got.tier) == (v, "redis")
    assert mem.contains(k) and disk.contains(k)  # promoted into both faster tiers
    got = store.fetch(k)
    assert got is not None and got.tier == "memory"
    assert store.promotions == 1


def test_fast_tier_eviction_keeps_slower_copies(tmp_path: Path) -> None:
    items = singles(6, seed=2)
    size = max(len(v) for _, v in items)
    mem = MemoryStore(capacity_bytes=2 * size)
    disk = DiskStore(tmp_path / "kv")
    store = TieredStore([mem, disk])
    for k, v in items:
        store.put(k, v)
    assert mem.stats().entries == 2 and disk.stats().entries == 6
    first = store.fetch(items[0][0])
    assert first is not None and first.tier == "disk" and first.value == items[0][1]
    st = store.stats()
    assert [t.name for t in st.tiers] == ["memory", "disk"]
    assert st.tiers[0].evictions >= 4 and st.tiers[1].evictions == 0
    assert st.entries == 6 and st.hits == 1


def test_lookup_reports_the_tier_of_each_chunk(tmp_path: Path) -> None:
    mem, disk = MemoryStore(), DiskStore(tmp_path / "kv")
    store = TieredStore([mem, disk])
    c = chain(5)
    keys = [k for k, _ in c]
    for k, v in c[:4]:
        disk.put(k, v)
    mem.put(*c[1])
    mem.put(*c[4])  # chunk 4 is only in memory; the gap at 3 is covered by disk
    m = store.lookup(keys)
    assert m.num_chunks == 5
    assert m.tiers == ("disk", "memory", "disk", "disk", "memory")
    disk.delete(keys[2])
    assert store.lookup(keys).num_chunks == 2


def test_events_are_forwarded_in_order(tmp_path: Path) -> None:
    mem = MemoryStore(capacity_bytes=1)  # too small: every chunk is rejected by memory
    store = TieredStore([mem, DiskStore(tmp_path / "kv")])
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    (k, v), = chain(1)
    store.put(k, v)
    store.delete(k)
    assert [(e.kind, e.tier, e.seq) for e in events] == [("store", "disk", 1), ("evict", "disk", 2)]


def test_redis_outage_keeps_local_tiers_serving(tmp_path: Path, own_redis: RedisServer) -> None:
    mem = MemoryStore()
    red = RedisStore(own_redis.url, retry_interval_s=0.05)
    store = TieredStore([mem, red])
    c = chain(2)
    store.put(*c[0])
    own_redis.stop()
    with pytest.warns(BackendDownWarning):
        store.put(*c[1])  # write-through: memory stores it, redis is skipped
    assert store.fetch(c[0][0]) is not None and store.fetch(c[1][0]) is not None
    assert store.lookup([k for k, _ in c]).num_chunks == 2
    assert store.stats().outages == 1


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        TieredStore([])
    with pytest.raises(ConfigError, match="distinct"):
        TieredStore([MemoryStore(), MemoryStore()])
    with pytest.raises(TypeError):
        TieredStore([object()])  # type: ignore[list-item]
    mem, disk = MemoryStore(), DiskStore(tmp_path / "kv")
    store = TieredStore([mem, disk])
    (_, v0), (k1, _) = chain(2)
    with pytest.raises(InvalidInputError):
        store.put(k1, v0)
    assert not mem.contains(k1) and not disk.contains(k1)


def test_fetch_many_promotes_per_tier(tmp_path: Path) -> None:
    mem, disk = MemoryStore(), DiskStore(tmp_path / "kv")
    store = TieredStore([mem, disk])
    c = chain(3)
    for k, v in c:
        disk.put(k, v)
    mem.put(*c[0])
    got = store.fetch_many([k for k, _ in c])
    assert [f.tier if f else None for f in got] == ["memory", "disk", "disk"]
    assert all(mem.contains(k) for k, _ in c)
