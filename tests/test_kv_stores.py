"""One conformance suite run against every store: memory, disk, Redis and tiered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from semcomm.errors import InvalidInputError
from semcomm.kv import (
    ChunkStore,
    ChunkStoreBase,
    DiskStore,
    Fetched,
    MemoryStore,
    PrefixMatch,
    RedisStore,
    StoreEvent,
    StoreStats,
    TieredStore,
)

from ._kvchunks import NS, DictStore, chain, tampered

KINDS = ["memory", "disk", "disk-write-behind", "redis", "tiered"]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChunkStore]:
    kind = request.param
    if kind == "memory":
        s: ChunkStore = MemoryStore()
    elif kind == "disk":
        s = DiskStore(tmp_path / "kv")
    elif kind == "disk-write-behind":  # the same contract while writes are still queued
        s = DiskStore(tmp_path / "kv", durability="write-behind")
    elif kind == "redis":
        s = RedisStore(request.getfixturevalue("redis_url"))
    else:
        s = TieredStore([MemoryStore(), DiskStore(tmp_path / "kv"),
                         RedisStore(request.getfixturevalue("redis_url"))])
    yield s
    s.close()


def expected_tier(store: ChunkStore) -> str:
    return "memory" if isinstance(store, TieredStore) else store.name


def test_is_a_chunk_store(store: ChunkStore) -> None:
    assert isinstance(store, ChunkStore)
    assert store.name in {"memory", "disk", "redis", "tiered"}


def test_put_get_contains_delete_scan(store: ChunkStore) -> None:
    c = chain(3)
    (k0, v0), (k1, v1), (k2, _) = c
    assert store.get(k0) is None and not store.contains(k0)
    store.put(k0, v0)
    store.put(k1, v1)
    assert store.get(k0) == v0 and store.get(k1) == v1
    assert isinstance(store.get(k0), bytes)
    assert store.contains(k0) and not store.contains(k2)
    assert sorted(store.scan()) == sorted([k0, k1])
    assert store.delete(k0) is True
    assert store.delete(k0) is False
    assert store.get(k0) is None and not store.contains(k0)
    assert list(store.scan()) == [k1]


def test_stats_count_hits_misses_and_bytes(store: ChunkStore) -> None:
    (k0, v0), (k1, v1) = chain(2)
    store.put(k0, v0)
    store.put(k1, v1)
    store.get(k0)
    store.get(k0)
    store.get(chain(1, seed=99)[0][0])
    st = store.stats()
    assert isinstance(st, StoreStats)
    assert (st.hits, st.misses, st.corrupt) == (2, 1, 0)
    assert st.entries == 2 and st.bytes == len(v0) + len(v1)
    if isinstance(store, TieredStore):
        assert [t.name for t in st.tiers] == ["memory", "disk", "redis"]
        assert all(t.entries == 2 for t in st.tiers)


def test_lookup_longest_consecutive_prefix(store: ChunkStore) -> None:
    c = chain(6)
    keys = [k for k, _ in c]
    for i in (0, 1, 2, 4, 5):  # a gap at 3
        store.put(*c[i])
    m = store.lookup(keys)
    assert isinstance(m, PrefixMatch)
    assert m.num_chunks == 3 and m.tiers == (expected_tier(store),) * 3
    assert store.lookup(keys[1:]).num_chunks == 2
    assert store.lookup(keys[3:]).num_chunks == 0
    assert store.lookup([]) == PrefixMatch(0, ())


def test_fetch_names_the_tier(store: ChunkStore) -> None:
    (k0, v0), (k1, _) = chain(2)
    store.put(k0, v0)
    got = store.fetch(k0)
    assert got == Fetched(v0, expected_tier(store))
    assert store.fetch(k1) is None


def test_invalid_values_are_refused_and_nothing_is_lost(store: ChunkStore) -> None:
    (k0, v0), (k1, v1) = chain(2)
    store.put(k0, v0)
    bad = [v1, v0[:-1], v0 + b"\0", b"", b"SCKV" + bytes(40)]
    flipped = bytearray(v0)
    flipped[-20] ^= 0x10
    bad.append(bytes(flipped))
    for value in bad:
        with pytest.raises(InvalidInputError, match=k0.hex()[:16]):
            store.put(k0, value)
    with pytest.raises(InvalidInputError):
        store.put(k1, v0)  # the header says it is chunk 0
    with pytest.raises(TypeError):
        store.put(k1, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.get(k0.hex())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.contains(k0[:31])
    assert store.get(k0) == v0 and not store.contains(k1)
    assert sorted(store.scan()) == [k0]


def test_events_store_and_evict_with_increasing_seq(store: ChunkStore) -> None:
    (k0, v0), (k1, v1) = chain(2)
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    store.put(k0, v0)
    store.put(k1, v1)
    store.delete(k0)
    stores = [e for e in events if e.kind == "store"]
    evicts = [e for e in events if e.kind == "evict"]
    assert {e.key for e in stores} == {k0, k1}
    assert [e.key for e in evicts if e.tier == expected_tier(store)] == [k0]
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] >= 1
    first = next(e for e in stores if e.key == k0)
    assert first.tier == expected_tier(store)


def test_defaults_work(tmp_path: Path) -> None:
    assert MemoryStore().stats().capacity_bytes == 1 << 30
    d = DiskStore(tmp_path / "default")
    assert d.stats().capacity_bytes == 10 << 30 and d.stats().entries == 0
    d.close()


@pytest.mark.parametrize("kind", ["memory", "disk", "disk-write-behind"])
def test_threads_share_a_store_within_budget(kind: str, tmp_path: Path) -> None:
    import threading

    items = [kv for s in range(4) for kv in chain(6, seed=s)]
    size = max(len(v) for _, v in items)
    cap = 8 * size
    store: MemoryStore | DiskStore = (
        MemoryStore(capacity_bytes=cap) if kind == "memory"
        else DiskStore(tmp_path / "kv", capacity_bytes=cap,
                       durability="write-behind" if kind == "disk-write-behind" else "flush"))
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        import random

        rnd = random.Random(seed)
        try:
            for _ in range(150):
                k, v = rnd.choice(items)
                if rnd.random() < 0.5:
                    store.put(k, v)
                else:
                    got = store.get(k)
                    assert got is None or got == v
                assert store.stats().bytes <= cap
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store.flush()  # write-behind: the writes still queued land (and evict) first
    values = dict(items)
    assert all(store.get(k) == values[k] for k in list(store.scan()))
    assert store.stats().corrupt == 0 and store.stats().bytes <= cap


def test_fetch_many_in_order(store: ChunkStore) -> None:
    c = chain(4)
    for i in (0, 2, 3):
        store.put(*c[i])
    got = store.fetch_many([k for k, _ in c])
    assert [None if f is None else f.value for f in got] == [c[0][1], None, c[2][1], c[3][1]]
    assert {f.tier for f in got if f is not None} == {expected_tier(store)}
    assert store.fetch_many([]) == []
    st = store.stats()
    assert (st.hits, st.misses) == (3, 1)


def test_every_protocol_member_without_probing(store: ChunkStore) -> None:
    """What callers use on any store without getattr: present, with the documented answer."""
    c = chain(2)
    keys = [k for k, _ in c]
    store.put_many(c)
    store.flush()
    store.prefetch(keys)  # a hint: disk reads the files ahead, the others do nothing
    assert store.contains_many(keys) == [True, True]
    tiered = isinstance(store, TieredStore)
    assert store.ping() is (True if tiered or store.name == "redis" else None)  # Redis is up
    if tiered:
        assert [t.name for t in store.tiers] == ["memory", "disk", "redis"]
    else:
        assert store.tiers == (store,)  # a single store's tiers: itself
    held = store.namespace_bytes()
    if tiered or store.name == "memory":  # the memory tier accounts bytes per namespace
        assert held == {NS.digest: sum(len(v) for _, v in c)}
    else:
        assert held is None
    assert store.verified_reads
    assert store.reads_into is isinstance(store, DiskStore)
    buf = bytearray(len(c[0][1]) + 10)
    view = store.get_into(keys[0], buf)
    assert view is not None and bytes(view) == c[0][1]
    small = bytearray(4)  # too small: a view of new memory, the same bytes
    view = store.get_into(keys[1], small)
    assert view is not None and bytes(view) == c[1][1]
    assert store.get_into(chain(1, seed=9)[0][0], buf) is None
    with pytest.raises(TypeError):
        store.get_into(keys[0], bytes(10))  # type: ignore[arg-type]


def test_a_store_of_ones_own_needs_only_the_six_primitives() -> None:
    s = DictStore()
    assert isinstance(s, ChunkStore) and isinstance(s, ChunkStoreBase)
    c = chain(3)
    keys = [k for k, _ in c]
    s.put_many(c)
    assert s.lookup(keys) == PrefixMatch(3, ("dict",) * 3)
    assert s.contains_many(keys) == [True] * 3
    assert [f.value if f else None for f in s.fetch_many(keys)] == [v for _, v in c]
    assert s.fetch(keys[0]) == Fetched(c[0][1], "dict")
    buf = bytearray(len(c[0][1]))
    assert bytes(s.get_into(keys[0], buf) or b"") == c[0][1]
    s.prefetch(keys)
    s.flush()
    assert s.ping() is None and s.tiers == (s,) and s.namespace_bytes() is None
    assert not s.verified_reads and not s.reads_into
    with s:
        pass  # close: nothing to release


def test_a_store_whose_get_does_not_verify_never_serves_a_tampered_chunk() -> None:
    """ChunkStoreBase.fetch checks what an unverified get returned: a tampered or swapped
    value is a miss (and deleted), through fetch, fetch_many and get_into."""
    s = DictStore()
    c = chain(3)
    keys = [k for k, _ in c]
    s.put_many(c)
    s.data[keys[1]] = tampered(c[1][1])
    s.data[keys[2]] = c[0][1]  # another key's chunk
    got = s.fetch_many(keys)
    assert got[0] == Fetched(c[0][1], "dict") and got[1:] == [None, None]
    assert keys[1] not in s.data and keys[2] not in s.data  # dropped, never served
    s.data[keys[1]] = tampered(c[1][1])
    assert s.get_into(keys[1], bytearray(len(c[1][1]))) is None
    assert s.fetch(keys[1]) is None


def test_a_store_of_ones_own_as_a_tier() -> None:
    """A user store behind a MemoryStore: hits promoted, a tampered chunk a miss (not
    promoted), and every protocol call of the tiered store reaches it."""
    mine = DictStore()
    mem = MemoryStore()
    st = TieredStore([mem, mine])
    c = chain(3)
    keys = [k for k, _ in c]
    for k, v in c:
        mine.put(k, v)
    mine.data[keys[2]] = tampered(c[2][1])
    assert st.lookup(keys).num_chunks == 3  # presence only: nothing verified yet
    got = st.fetch_many(keys)
    assert [f.tier if f else None for f in got] == ["dict", "dict", None]
    assert mem.contains_many(keys) == [True, True, False]  # promoted: the good ones only
    assert st.fetch(keys[0]) == Fetched(c[0][1], "memory")
    assert st.ping() is None and st.namespace_bytes() == {NS.digest: len(c[0][1]) +
                                                           len(c[1][1])}
    st.prefetch(keys)
    st.flush()
    st.close()


def test_a_tier_that_is_not_a_chunk_store_names_the_base_class() -> None:
    class Partial:
        name = "partial"

        def get(self, key: bytes) -> bytes | None:
            return None

    with pytest.raises(TypeError, match="ChunkStoreBase"):
        TieredStore([MemoryStore(), Partial()])  # type: ignore[list-item]
