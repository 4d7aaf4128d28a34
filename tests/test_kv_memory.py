"""MemoryStore: exact LRU order, budgets under random workloads, pinning, chain-tail eviction."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from semcomm.errors import InvalidInputError
from semcomm.kv import MemoryStore

from ._kvchunks import chain, singles


def test_exact_lru_order_independent_chunks() -> None:
    items = singles(6)
    size = max(len(v) for _, v in items)
    store = MemoryStore(capacity_bytes=3 * size)
    evicted: list[bytes] = []
    store.subscribe(lambda e: evicted.append(e.key) if e.kind == "evict" else None)
    k = [key for key, _ in items]
    v = dict(items)
    for i in (0, 1, 2):
        store.put(k[i], v[k[i]])
    assert store.get(k[0]) is not None  # 0 becomes most recent: order 1, 2, 0
    store.put(k[3], v[k[3]])  # evicts 1
    store.contains(k[2])  # contains/lookup do not touch recency
    store.lookup([k[2]])
    store.put(k[4], v[k[4]])  # evicts 2
    assert store.get(k[3]) is not None  # order 0, 4, 3
    store.put(k[5], v[k[5]])  # evicts 0
    assert evicted == [k[1], k[2], k[0]]
    assert sorted(store.scan()) == sorted([k[3], k[4], k[5]])
    assert store.stats().evictions == 3


def test_budget_never_exceeded_random_workload() -> None:
    """Seeded random puts/gets/deletes of varied sizes against a model LRU (independent chunks)."""
    rnd = random.Random(7)
    items = [(k, v) for n, p in ((8, 16), (8, 256), (8, 1024), (2, 2000)) for k, v in singles(n, seed=p, payload=p)]
    cap = 6000
    store = MemoryStore(capacity_bytes=cap)
    model: OrderedDict[bytes, int] = OrderedDict()
    for _ in range(600):
        key, value = rnd.choice(items)
        op = rnd.random()
        if op < 0.5:
            store.put(key, value)
            if len(value) > cap:  # never fits: rejected, nothing changes
                continue
            model.pop(key, None)
            while model and sum(model.values()) + len(value) > cap:
                model.popitem(last=False)
            model[key] = len(value)
        elif op < 0.9:
            got = store.get(key)
            assert (got == value) if key in model else got is None
            if key in model:
                model.move_to_end(key)
        else:
            assert store.delete(key) == (key in model)
            model.pop(key, None)
        st = store.stats()
        assert st.bytes <= cap
        assert set(store.scan()) == set(model)
        assert store.eviction_order() == list(model)


def test_prefix_chunks_outlive_their_extensions() -> None:
    c = chain(4)  # 0 <- 1 <- 2 <- 3
    other = singles(3, seed=9)
    size = max(len(v) for _, v in c + other)
    store = MemoryStore(capacity_bytes=5 * size)
    order: list[bytes] = []
    store.subscribe(lambda e: order.append(e.key) if e.kind == "evict" else None)
    for key, value in c:
        store.put(key, value)
    for key, value in c:  # the engine reads a chain front to back: 3 is most recent
        assert store.get(key) == value
    store.put(*other[0])  # full: 5 entries
    for key, value in other[1:]:
        store.put(key, value)
    # pure LRU would evict chunk 0 then 1; the chain loses its tail instead
    assert order == [c[3][0], c[2][0]]
    assert store.lookup([k for k, _ in c]).num_chunks == 2


def test_pinned_entries_are_never_evicted() -> None:
    items = singles(5, seed=3)
    size = max(len(v) for _, v in items)
    store = MemoryStore(capacity_bytes=2 * size)
    store.put(*items[0])
    assert store.pin(items[0][0]) and store.pin(items[0][0])  # pinned twice
    for key, value in items[1:]:
        store.put(key, value)
    assert store.contains(items[0][0])
    assert store.stats().pinned == 1
    assert store.unpin(items[0][0])
    store.put(*items[1])
    assert store.contains(items[0][0])  # still pinned once
    assert store.unpin(items[0][0]) and not store.unpin(items[0][0])
    store.put(*items[2])
    store.put(*items[3])
    assert not store.contains(items[0][0])


def test_full_of_pinned_rejects_instead_of_exceeding() -> None:
    items = singles(3, seed=4)
    size = max(len(v) for _, v in items)
    store = MemoryStore(capacity_bytes=2 * size)
    for key, value in items[:2]:
        store.put(key, value)
        store.pin(key)
    store.put(*items[2])
    st = store.stats()
    assert not store.contains(items[2][0]) and st.rejected == 1 and st.bytes <= 2 * size


def test_value_larger_than_budget_is_rejected() -> None:
    (key, value), = singles(1)
    store = MemoryStore(capacity_bytes=len(value) - 1)
    store.put(key, value)
    assert store.get(key) is None and store.stats().rejected == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_capacity(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        MemoryStore(capacity_bytes=bad)  # type: ignore[arg-type]


def test_put_validates_and_keeps_old_data() -> None:
    (k0, v0), (k1, v1) = chain(2)
    store = MemoryStore()
    store.put(k0, v0)
    with pytest.raises(InvalidInputError, match="not a valid semcomm chunk"):
        store.put(k0, v1)  # header names another key
    flipped = bytearray(v0)
    flipped[len(flipped) // 2] ^= 1
    with pytest.raises(InvalidInputError, match="checksum"):
        store.put(k0, bytes(flipped))
    with pytest.raises(InvalidInputError):
        store.put(k1, v1[:-3])
    with pytest.raises(TypeError):
        store.put(k0.hex(), v0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.put(k0[:8], v0)
    assert store.get(k0) == v0 and not store.contains(k1) and len(store) == 1


def reference_victim(model: OrderedDict[bytes, bytes | None], pins: dict[bytes, int],
                     protect: bytes | None) -> bytes | None:
    """The documented policy, written plainly: LRU among unpinned entries without cached children."""
    parents = {p for p in model.values() if p is not None}
    for key in model:  # least recently used first
        if key not in parents and not pins.get(key) and key != protect:
            return key
    return None


def test_chain_aware_lru_matches_the_reference_policy() -> None:
    """Random puts/gets/pins over several chains; eviction order equals the reference exactly."""
    rnd = random.Random(3)
    chains = [chain(5, seed=s) for s in range(4)]
    parent_of = {k: (c[i - 1][0] if i else None) for c in chains for i, (k, _) in enumerate(c)}
    value_of = {k: v for c in chains for k, v in c}
    size = max(len(v) for v in value_of.values())
    cap = 7 * size
    store = MemoryStore(capacity_bytes=cap)
    evicted: list[bytes] = []
    store.subscribe(lambda e: evicted.append(e.key) if e.reason == "evict" else None)
    model: OrderedDict[bytes, bytes | None] = OrderedDict()  # key -> parent, LRU first
    pins: dict[bytes, int] = {}
    for step in range(800):
        key = rnd.choice(list(value_of))
        op = rnd.random()
        if op < 0.5:
            evicted.clear()
            store.put(key, value_of[key])
            expect: list[bytes] = []
            old = model.pop(key, "absent")
            used = sum(len(value_of[k]) for k in model)
            ok = True
            while used + len(value_of[key]) > cap:
                victim = reference_victim(model, pins, parent_of[key])
                if victim is None:
                    ok = False
                    break
                del model[victim]
                expect.append(victim)
                used -= len(value_of[victim])
            if ok:
                model[key] = parent_of[key]
            elif old != "absent":
                model[key] = parent_of[key]  # the old copy stays
            assert evicted == expect, step
        elif op < 0.85:
            got = store.get(key)
            assert (got is not None) == (key in model), step
            if key in model:
                model.move_to_end(key)
        elif op < 0.95:
            if store.pin(key):
                pins[key] = pins.get(key, 0) + 1
        elif store.unpin(key):
            pins[key] -= 1
        pins = {k: n for k, n in pins.items() if n and k in model}
        assert set(store.scan()) == set(model), step
        assert store.stats().bytes <= cap
