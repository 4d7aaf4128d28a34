"""Fair eviction in the memory tier: per-namespace shares, shared prefixes kept longest."""

from __future__ import annotations

import dataclasses

import pytest

from semcomm.kv import MemoryStore, TieredStore
from semcomm.kv._lru import FairChainLru, Incoming, make_lru

from ._kvchunks import NS, chain

NS_B = dataclasses.replace(NS, model="other-model")


def _size() -> int:
    return len(chain(1)[0][1])


def test_a_long_session_on_one_model_cannot_evict_anothers_shared_prefix() -> None:
    size = _size()
    store = MemoryStore(capacity_bytes=12 * size, eviction="fair")
    system_b = chain(3, seed=1, ns=NS_B)  # model B's system prompt: 3 chunks
    for k, v in system_b:
        store.put(k, v)
    for _ in range(3):  # read by three requests: shared
        for k, _v in system_b:
            assert store.get(k) is not None
    short_b = chain(2, seed=2, ns=NS_B)  # one short request's own tail on B
    for k, v in short_b:
        store.put(k, v)
    long_a = chain(40, seed=3, ns=NS)  # a long session on model A fills far past the budget
    for k, v in long_a:
        store.put(k, v)
    for k, _v in system_b + short_b:  # B holds 5 of 12 chunks: under its half, untouched
        assert store.contains(k), "model B lost a chunk to model A's long session"
    assert store.stats().bytes <= 12 * size
    held_a = sum(len(v) for k, v in long_a if store.contains(k))
    assert 0 < held_a <= 12 * size - sum(len(v) for _k, v in system_b + short_b)
    assert store.stats().evictions > 0  # A paid for its own session


@pytest.mark.parametrize("eviction", ["lru", "fair"])
def test_plain_lru_lets_the_long_session_win_and_fair_does_not(eviction: str) -> None:
    size = _size()
    store = MemoryStore(capacity_bytes=8 * size, eviction=eviction)
    system_b = chain(2, seed=1, ns=NS_B)
    for k, v in system_b:
        store.put(k, v)
        store.get(k)
        store.get(k)
    for k, v in chain(30, seed=3, ns=NS):
        store.put(k, v)
    kept = all(store.contains(k) for k, _v in system_b)
    assert kept is (eviction == "fair")  # the failure the fair policy fixes


def test_within_a_namespace_cold_chunks_go_before_shared_ones() -> None:
    size = _size()
    store = MemoryStore(capacity_bytes=4 * size, eviction="fair")
    shared = chain(1, seed=10)  # a system prompt, read by several requests
    cold = [chain(1, seed=20 + i)[0] for i in range(3)]  # one-off prompts
    store.put(*shared[0])
    store.get(shared[0][0])
    store.get(shared[0][0])
    for k, v in cold:  # newer than the shared chunk: plain LRU would evict the shared one first
        store.put(k, v)
    store.put(*chain(1, seed=99)[0])
    assert store.contains(shared[0][0])
    assert not store.contains(cold[0][0])  # the least recently used cold chunk went
    assert store.stats().evictions == 1


def test_pinned_chunks_stay_and_an_over_share_namespace_pays_first() -> None:
    b = chain(2, seed=1, ns=NS_B)
    a = chain(4, seed=2)
    store = MemoryStore(capacity_bytes=sum(len(v) for _k, v in a + b), eviction="fair")
    for k, v in b:
        store.put(k, v)
    store.pin(b[0][0])
    for k, v in a:
        store.put(k, v)
    # full: A holds 4, B 2; one more B chunk evicts from A (the namespace most over its share)
    extra_b = chain(1, seed=5, ns=NS_B)[0]
    store.put(*extra_b)
    assert all(store.contains(k) for k, _v in b) and store.contains(extra_b[0])
    assert sum(store.contains(k) for k, _v in a) == 3


def test_fair_bookkeeping_tracks_group_bytes_through_replace_and_delete() -> None:
    lru = make_lru("fair")
    assert isinstance(lru, FairChainLru)
    lru.add(b"k1" * 16, 10, None, b"g1")
    lru.add(b"k2" * 16, 5, None, b"g2")
    lru.add(b"k1" * 16, 12, None, b"ignored-on-replace")
    assert lru.group_bytes == {b"g1": 12, b"g2": 5}
    lru.remove(b"k1" * 16)
    assert lru.group_bytes == {b"g2": 5} and lru.bytes == 5
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_lru("mru")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        MemoryStore(1024, eviction="mru")


def test_a_rewrite_or_promotion_keeps_the_hit_count() -> None:
    size = _size()
    mem = MemoryStore(capacity_bytes=3 * size, eviction="fair", name="memory")
    slow = MemoryStore(capacity_bytes=100 * size, name="slow")
    tiered = TieredStore([mem, slow])
    shared = chain(1, seed=10)[0]
    tiered.put(*shared)
    tiered.get(shared[0])
    tiered.get(shared[0])
    mem.put(*shared)  # rewritten (e.g. written through again): still shared
    for i in range(4):
        tiered.put(*chain(1, seed=30 + i)[0])
    assert mem.contains(shared[0])


def test_a_long_session_cannot_evict_its_own_models_system_prompt_while_it_is_read() -> None:
    size = _size()
    store = MemoryStore(capacity_bytes=12 * size, eviction="fair")
    system = chain(3, seed=1)  # the model's system prompt, shared by its short requests
    for k, v in system:
        store.put(k, v)
    for _ in range(2):
        for k, _v in system:
            store.get(k)
    for i, (k, v) in enumerate(chain(40, seed=3)):  # a long session on the same model
        store.put(k, v)
        if i % 4 == 0:  # short requests keep reading the system prompt meanwhile
            for sk, _v in system:
                assert store.get(sk) is not None, f"system prompt evicted at chunk {i}"
    assert store.stats().rejected > 0  # the session's later chunks were refused instead


def test_a_shared_prompt_no_one_reads_any_more_cools_down_and_goes() -> None:
    now = [0.0]
    lru = FairChainLru(fresh_s=60.0, clock=lambda: now[0])
    cap = 15  # the group is over its share whatever it holds
    hot, key = b"h" * 32, lambda i: bytes([i]) * 32
    lru.add(hot, 10, None, b"g")
    lru.touch(hot)
    lru.touch(hot)  # read by several requests: shared
    for i in range(1, 4):
        lru.add(key(i), 10, None, b"g")
    incoming = Incoming(b"g", 10, cap)
    assert lru.victim(incoming=incoming) == key(1)  # one-off chunks go first
    for i in range(1, 4):
        lru.remove(key(i))
    assert lru.victim(incoming=incoming) is None  # only the shared chunk left: kept, refused
    now[0] = 61.0  # nobody read it for a minute: cold again
    assert lru.victim(incoming=incoming) == hot
