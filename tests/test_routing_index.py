"""Prefix indexes: bounds, LRU order, and convergence under out-of-order and replayed events."""

from __future__ import annotations

import random

import pytest

from semcomm.routing import ApproximateIndex, IndexEvent, PreciseIndex


def test_approximate_match_is_consecutive_and_per_replica() -> None:
    idx = ApproximateIndex(3, capacity_chunks=100)
    idx.on_routed(0, ["a", "b", "c"])
    idx.on_routed(1, ["a", "x"])
    assert idx.match(["a", "b", "c", "d"]) == {0: 3, 1: 1}
    assert idx.match(["a", "x"]) == {0: 1, 1: 2}
    assert idx.match(["z", "b", "c"]) == {}  # no match without the first chunk
    assert idx.match([]) == {}


def test_approximate_bounded_lru_prefix_outlives_extensions() -> None:
    idx = ApproximateIndex(1, capacity_chunks=4)
    idx.on_routed(0, ["p", "a1", "a2"])
    idx.on_routed(0, ["p", "b1", "b2"])  # 5 distinct keys > 4: the oldest extension goes
    assert idx.size(0) == 4
    assert idx.match(["p", "b1", "b2"]) == {0: 3}
    assert idx.match(["p", "a1", "a2"]) == {0: 2}  # a2 (oldest tail) evicted, prefix kept
    assert idx.evictions == 1
    for i in range(50):
        idx.on_routed(0, [f"k{i}", f"k{i}x"])
        assert idx.size(0) <= 4
    assert len(idx) <= 4


def test_approximate_resize_keeps_surviving_replicas() -> None:
    idx = ApproximateIndex(3, capacity_chunks=10)
    idx.on_routed(0, ["a"])
    idx.on_routed(2, ["b"])
    idx.resize(2, keep=[2, -1])  # replica 2 becomes slot 0, a new replica at slot 1
    assert idx.match(["b"]) == {0: 1}
    assert idx.match(["a"]) == {}


def _ev(kind: str, key: str, seq: int, tier: str = "memory") -> IndexEvent:
    return IndexEvent(kind, key, tier, seq)


def test_precise_store_evict_and_replay() -> None:
    idx = PreciseIndex(2, capacity_chunks=100, speculative=False)
    assert idx.apply(0, _ev("store", "a", 1))
    assert idx.apply(0, _ev("store", "b", 2))
    assert idx.match(["a", "b"]) == {0: 2}
    assert not idx.apply(0, _ev("store", "b", 2))  # replayed
    assert idx.stats.replayed == 1
    assert idx.apply(0, _ev("evict", "b", 3))
    assert idx.match(["a", "b"]) == {0: 1}
    assert not idx.apply(0, _ev("evict", "b", 3))  # replayed evict
    assert not idx.apply(0, _ev("store", "b", 2))  # late store older than the evict: stale
    assert idx.match(["a", "b"]) == {0: 1}
    assert idx.stats.stale == 1


def test_precise_out_of_order_evict_before_store() -> None:
    idx = PreciseIndex(1, capacity_chunks=100, speculative=False)
    assert not idx.apply(0, _ev("evict", "k", 5))  # evict arrives first
    assert not idx.apply(0, _ev("store", "k", 4))  # then its older store: must not resurrect
    assert idx.match(["k"]) == {}
    assert idx.apply(0, _ev("store", "k", 6))  # a genuinely newer store counts
    assert idx.match(["k"]) == {0: 1}


def test_precise_gaps_are_reported_until_filled() -> None:
    idx = PreciseIndex(1, capacity_chunks=100, speculative=False)
    idx.apply(0, _ev("store", "a", 1))
    idx.apply(0, _ev("store", "d", 4))
    assert idx.missing(0, "memory") == [2, 3]
    idx.apply(0, _ev("store", "b", 2))
    assert idx.missing(0, "memory") == [3]
    assert idx.stats.gaps == 1


def test_precise_tiers_are_separate_streams() -> None:
    idx = PreciseIndex(1, capacity_chunks=100, speculative=False)
    idx.apply(0, _ev("store", "a", 1, "memory"))
    idx.apply(0, _ev("store", "a", 1, "disk"))  # same seq, other store: not a replay
    assert idx.tiers_of("a") == {0: ("disk", "memory")}
    idx.apply(0, _ev("evict", "a", 2, "memory"))
    assert idx.match(["a"]) == {0: 1}  # still on disk
    assert idx.tiers_of("a") == {0: ("disk",)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_precise_converges_under_shuffled_and_duplicated_delivery(seed: int) -> None:
    """Any delivery order with replays gives the same state as in-order delivery."""
    rng = random.Random(seed)
    events: list[tuple[int, IndexEvent]] = []
    truth: list[set[str]] = [set(), set()]
    seqs = [0, 0]
    for _ in range(400):
        r = rng.randrange(2)
        key = f"k{rng.randrange(30)}"
        kind = "evict" if key in truth[r] and rng.random() < 0.5 else "store"
        seqs[r] += 1
        events.append((r, IndexEvent(kind, key, "memory", seqs[r])))
        if kind == "store":
            truth[r].add(key)
        else:
            truth[r].discard(key)
    delivered = events + rng.sample(events, 100)  # replays
    rng.shuffle(delivered)
    idx = PreciseIndex(2, capacity_chunks=1000, speculative=False)
    for r, e in delivered:
        idx.apply(r, e)
    for r in range(2):
        held = {f"k{i}" for i in range(30) if idx.holds(r, f"k{i}")}
        assert held == truth[r]
        assert idx.size(r) == len(truth[r])
        assert idx.missing(r, "memory") == []


def test_precise_bounded_when_evicts_are_lost() -> None:
    idx = PreciseIndex(1, capacity_chunks=8, speculative=False)
    for i in range(100):
        idx.apply(0, _ev("store", f"k{i}", i + 1))
        assert idx.size(0) <= 8
    assert len(idx) == 8
    assert idx.stats.overflow_evictions == 92
    assert idx.holds(0, "k99") and not idx.holds(0, "k0")


def test_precise_speculative_entries_until_settled() -> None:
    idx = PreciseIndex(2, capacity_chunks=100)
    idx.on_routed(1, ["a", "b"])
    assert idx.match(["a", "b", "c"]) == {1: 2}
    idx.on_routed(1, ["a", "b"])
    idx.on_settled(1, ["a", "b"])
    assert idx.match(["a", "b"]) == {1: 2}  # still one pending prompt
    idx.on_settled(1, ["a", "b"])
    assert idx.match(["a", "b"]) == {}  # no events arrived: nothing is held


def test_precise_rejects_bad_input() -> None:
    idx = PreciseIndex(1, capacity_chunks=4)
    with pytest.raises(ValueError, match="kind"):
        idx.apply(0, _ev("erase", "a", 1))
    with pytest.raises(ValueError, match="out of range"):
        idx.apply(3, _ev("store", "a", 1))
