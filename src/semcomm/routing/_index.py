"""Prefix indexes: which replica holds which chunk keys.

Two sources behind one :class:`PrefixIndex` interface:

* :class:`ApproximateIndex` learns from the router's own decisions (``on_routed``): the keys of
  every routed prompt are recorded under the chosen replica, in a per-replica LRU bounded by that
  replica's KV capacity in chunks (it mimics the engine's own LRU; it never asks the engine).
* :class:`PreciseIndex` is fed by the engines' store/evict :class:`StoreEvent` s of chunk keys
  (``ChunkStore.subscribe``). Each (replica, tier) store numbers its events; out-of-order and
  replayed events are resolved per key by sequence number, so the index converges to the
  stores' true contents whatever the delivery order.

Both answer :meth:`PrefixIndex.match`: for each replica, how many *consecutive* chunks from the
first one it holds. Keys are opaque hashables: the live router uses the KV store's
:class:`semcomm.kv.ChunkKey` (bytes); the simulator uses the trace's chained block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ApproximateIndex",
    "IndexEvent",
    "PreciseIndex",
    "PreciseIndexStats",
    "PrefixIndex",
]


@runtime_checkable
class PrefixIndex(Protocol):
    """Where prefixes live. Replicas are dense slots ``0..num_replicas-1``."""

    num_replicas: int

    def match(self, keys: Sequence[Hashable]) -> dict[int, int]:
        """``{replica: consecutive chunks held from keys[0]}``; replicas without a match are absent."""
        ...

    def on_routed(self, replica: int, keys: Sequence[Hashable]) -> None:
        """The router sent a prompt with ``keys`` to ``replica`` (approximate sources learn here)."""
        ...

    def on_settled(self, replica: int, keys: Sequence[Hashable]) -> None:
        """The replica finished prefilling a routed prompt (its own events now describe it)."""
        ...

    def size(self, replica: int) -> int:
        """Chunks the index believes ``replica`` holds."""
        ...

    def resize(self, num_replicas: int, keep: Sequence[int] | None = None) -> None:
        """Change the replica set; ``keep[new_slot] = old_slot`` (or -1 for a new replica)."""
        ...


def _consecutive_match(
    holders: dict[Any, Any], keys: Sequence[Hashable], extra: dict[Any, Any] | None = None
) -> dict[int, int]:
    """Longest consecutive run per replica: intersect the holder sets chunk by chunk.

    ``holders`` and ``extra`` map a key to a set or dict of replicas; ``extra`` (speculative
    entries, optional) is united with ``holders``. Work is O(holders of the first key + the
    C-level intersections): a replica's count is written once, when it drops out.
    """
    if not keys:
        return {}

    def get(k: Hashable) -> Any:
        a = holders.get(k)
        if extra is None:
            return a
        b = extra.get(k)
        if a and b:
            return set(a).union(b)
        return a or b

    first = get(keys[0])
    if not first:
        return {}
    alive = set(first)
    out: dict[int, int] = {}
    depth = len(keys)
    for i in range(1, len(keys)):
        h = get(keys[i])
        if not h:
            depth = i
            break
        nxt = alive.intersection(h)
        if len(nxt) != len(alive):
            for r in alive.difference(nxt):
                out[r] = i
            alive = nxt
            if not alive:
                return out
    for r in alive:
        out[r] = depth
    return out


class ApproximateIndex:
    """Routing-history index: per-replica LRU of chunk keys, each bounded by ``capacity_chunks``.

    Invariants: ``holders[k]`` contains ``r`` iff ``k`` is in ``lru[r]``; ``len(lru[r]) <=
    capacity_chunks``. A prompt's keys are touched last-to-first, so the first chunk is the most
    recent and a prefix always outlives its extensions (as in the engine's store).
    """

    def __init__(self, num_replicas: int, capacity_chunks: int) -> None:
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if capacity_chunks <= 0:
            raise ValueError(f"capacity_chunks must be positive, got {capacity_chunks}")
        self.num_replicas = num_replicas
        self.capacity_chunks = capacity_chunks
        self._lru: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._holders: dict[Hashable, set[int]] = {}
        self.evictions = 0  # chunks dropped by the LRU bound (diagnostics only)

    def match(self, keys: Sequence[Hashable]) -> dict[int, int]:
        return _consecutive_match(self._holders, keys)

    def on_routed(self, replica: int, keys: Sequence[Hashable]) -> None:
        lru = self._lru[replica]
        holders = self._holders
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                h = holders.get(k)
                if h is None:
                    holders[k] = {replica}
                else:
                    h.add(replica)
        over = len(lru) - self.capacity_chunks
        for _ in range(max(0, over)):
            old, _ = lru.popitem(last=False)
            h = holders[old]
            h.discard(replica)
            if not h:
                del holders[old]
            self.evictions += 1

    def on_settled(self, replica: int, keys: Sequence[Hashable]) -> None:
        """Nothing to do: the approximate index learned the keys when they were routed."""

    def size(self, replica: int) -> int:
        return len(self._lru[replica])

    def resize(self, num_replicas: int, keep: Sequence[int] | None = None) -> None:
        keep = list(keep) if keep is not None else [
            i if i < self.num_replicas else -1 for i in range(num_replicas)
        ]
        old = self._lru
        self._lru = [old[o] if 0 <= o < len(old) else OrderedDict() for o in keep]
        self.num_replicas = num_replicas
        self._holders = {}
        for r, lru in enumerate(self._lru):
            for k in lru:
                self._holders.setdefault(k, set()).add(r)

    def __len__(self) -> int:
        """Distinct keys indexed."""
        return len(self._holders)


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """A store/evict event as the precise index needs it (shape of ``semcomm.kv.StoreEvent``)."""

    kind: str  # "store" or "evict"
    key: Hashable  # the chunk key
    tier: str = "memory"  # which store of the replica emitted it
    seq: int = 0  # per-(replica, tier) sequence number, strictly increasing at the source


@dataclass(slots=True)
class PreciseIndexStats:
    """Counters of :class:`PreciseIndex` (read-only for callers)."""

    applied: int = 0  # events that changed or confirmed state
    stale: int = 0  # events older than what the index already knows for that key (out of order)
    replayed: int = 0  # exact duplicates of an applied event
    overflow_evictions: int = 0  # entries dropped because a replica exceeded its capacity
    gaps: int = 0  # sequence numbers currently missing across all streams


@dataclass(slots=True)
class _Stream:
    """Delivery state of one (replica, tier) event stream."""

    high: int = -1  # highest seq seen
    missing: set[int] = field(default_factory=set)  # seqs below ``high`` never seen (bounded)


class PreciseIndex:
    """Event-fed index: exactly the chunks the replicas' stores report holding.

    Ordering rule: for each (replica, tier, key), the event with the highest ``seq`` wins. A
    store event older than a known evict (or the reverse) is *stale* and ignored; an event with
    the same seq as the last applied one is a *replay* and ignored. Sequence numbers of evicted
    keys survive as tombstones (bounded by ``tombstones``) so late stores cannot resurrect them.
    Each replica is bounded by ``capacity_chunks`` entries (LRU), in case evicts are lost.

    Speculative entries (llm-d's speculative indexing): between a routing decision and the
    engine's store events, the routed prompt's keys count as held by the chosen replica
    (``speculative=True``), so a burst of requests sharing a new prefix follows the first one.
    They are reference-counted and dropped by :meth:`on_settled` (prefill done).
    """

    def __init__(
        self,
        num_replicas: int,
        capacity_chunks: int,
        *,
        tombstones: int = 65536,
        max_missing: int = 4096,
        speculative: bool = True,
    ) -> None:
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if capacity_chunks <= 0:
            raise ValueError(f"capacity_chunks must be positive, got {capacity_chunks}")
        self.num_replicas = num_replicas
        self.capacity_chunks = capacity_chunks
        self._tombstone_cap = tombstones
        self._max_missing = max_missing
        # key -> {replica: {tier: seq}} for live entries
        self._holders: dict[Hashable, dict[int, dict[str, int]]] = {}
        # per replica LRU of live (key, tier) entries
        self._lru: list[OrderedDict[tuple[Hashable, str], None]] = [
            OrderedDict() for _ in range(num_replicas)
        ]
        # (replica, tier, key) -> seq of the evict that removed it (bounded FIFO)
        self._tomb: OrderedDict[tuple[int, str, Hashable], int] = OrderedDict()
        self._streams: dict[tuple[int, str], _Stream] = {}
        self.speculative = speculative
        # key -> {replica: number of routed, not yet settled prompts containing it}
        self._spec: dict[Hashable, dict[int, int]] = {}
        self.stats = PreciseIndexStats()

    # -- events -------------------------------------------------------------------------------
    def apply(self, replica: int, event: Any) -> bool:
        """Apply one store/evict event from ``replica``; returns whether state changed.

        ``event`` needs ``kind``, ``key``, ``tier`` and ``seq`` attributes (``semcomm.kv.StoreEvent``
        or :class:`IndexEvent`).
        """
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} out of range 0..{self.num_replicas - 1}")
        kind, key, tier, seq = event.kind, event.key, event.tier, int(event.seq)
        if kind not in ("store", "evict"):
            raise ValueError(f"unknown event kind {kind!r} (expected 'store' or 'evict')")
        self._track_seq(replica, tier, seq)
        entry = self._holders.get(key)
        tiers = entry.get(replica) if entry is not None else None
        last = tiers.get(tier) if tiers is not None else None
        tomb_key = (replica, tier, key)
        if last is None:
            last = self._tomb.get(tomb_key)
        if last is not None:
            if seq == last:
                self.stats.replayed += 1
                return False
            if seq < last:
                self.stats.stale += 1
                return False
        self.stats.applied += 1
        if kind == "store":
            self._tomb.pop(tomb_key, None)
            if entry is None:
                entry = self._holders[key] = {}
            if tiers is None:
                tiers = entry[replica] = {}
            tiers[tier] = seq
            lru = self._lru[replica]
            lru[(key, tier)] = None
            lru.move_to_end((key, tier))
            while len(lru) > self.capacity_chunks:
                (okey, otier), _ = lru.popitem(last=False)
                self._drop(replica, okey, otier, None)
                self.stats.overflow_evictions += 1
            return True
        # evict
        if tiers is not None and tier in tiers:
            self._lru[replica].pop((key, tier), None)
            self._drop(replica, key, tier, seq)
            return True
        self._remember(tomb_key, seq)
        return False

    def subscriber(self, replica: int) -> Any:
        """A callback for ``ChunkStore.subscribe`` that feeds this replica's events."""

        def _cb(event: Any) -> None:
            self.apply(replica, event)

        return _cb

    def missing(self, replica: int, tier: str) -> list[int]:
        """Sequence numbers of that stream not yet seen (ask the store to replay them)."""
        st = self._streams.get((replica, tier))
        return sorted(st.missing) if st else []

    def _track_seq(self, replica: int, tier: str, seq: int) -> None:
        st = self._streams.get((replica, tier))
        if st is None:
            st = self._streams[(replica, tier)] = _Stream()
        if seq > st.high:
            if st.high >= 0:
                for s in range(st.high + 1, min(seq, st.high + 1 + self._max_missing)):
                    st.missing.add(s)
                    self.stats.gaps += 1
            st.high = seq
        elif seq in st.missing:
            st.missing.discard(seq)
            self.stats.gaps -= 1
        while len(st.missing) > self._max_missing:
            st.missing.discard(min(st.missing))
            self.stats.gaps -= 1

    def _drop(self, replica: int, key: Hashable, tier: str, seq: int | None) -> None:
        entry = self._holders[key]
        tiers = entry[replica]
        last = tiers.pop(tier)
        if not tiers:
            del entry[replica]
            if not entry:
                del self._holders[key]
        self._remember((replica, tier, key), last if seq is None else seq)

    def _remember(self, tomb_key: tuple[int, str, Hashable], seq: int) -> None:
        self._tomb[tomb_key] = seq
        self._tomb.move_to_end(tomb_key)
        while len(self._tomb) > self._tombstone_cap:
            self._tomb.popitem(last=False)

    # -- PrefixIndex --------------------------------------------------------------------------
    def match(self, keys: Sequence[Hashable]) -> dict[int, int]:
        return _consecutive_match(self._holders, keys, self._spec or None)

    def on_routed(self, replica: int, keys: Sequence[Hashable]) -> None:
        """Record speculative entries until the replica's own events arrive."""
        if not self.speculative:
            return
        spec = self._spec
        for k in keys:
            e = spec.get(k)
            if e is None:
                spec[k] = {replica: 1}
            else:
                e[replica] = e.get(replica, 0) + 1

    def on_settled(self, replica: int, keys: Sequence[Hashable]) -> None:
        if not self.speculative:
            return
        spec = self._spec
        for k in keys:
            e = spec.get(k)
            if e is None or replica not in e:
                continue
            c = e[replica] - 1
            if c > 0:
                e[replica] = c
            else:
                del e[replica]
                if not e:
                    del spec[k]

    def size(self, replica: int) -> int:
        return len(self._lru[replica])

    def holds(self, replica: int, key: Hashable, tier: str | None = None) -> bool:
        tiers = self._holders.get(key, {}).get(replica)
        return bool(tiers) and (tier is None or tier in tiers)  # type: ignore[operator]

    def tiers_of(self, key: Hashable) -> dict[int, tuple[str, ...]]:
        return {r: tuple(sorted(t)) for r, t in self._holders.get(key, {}).items()}

    def resize(self, num_replicas: int, keep: Sequence[int] | None = None) -> None:
        keep = list(keep) if keep is not None else [
            i if i < self.num_replicas else -1 for i in range(num_replicas)
        ]
        old_to_new = {o: n for n, o in enumerate(keep) if o >= 0}
        holders: dict[Hashable, dict[int, dict[str, int]]] = {}
        for key, entry in self._holders.items():
            moved = {old_to_new[r]: t for r, t in entry.items() if r in old_to_new}
            if moved:
                holders[key] = moved
        self._holders = holders
        old = self._lru
        self._lru = [old[o] if 0 <= o < len(old) else OrderedDict() for o in keep]
        self._streams = {
            (old_to_new[r], t): s for (r, t), s in self._streams.items() if r in old_to_new
        }
        self._tomb = OrderedDict(
            ((old_to_new[r], t, k), s) for (r, t, k), s in self._tomb.items() if r in old_to_new
        )
        spec: dict[Hashable, dict[int, int]] = {}
        for key, e in self._spec.items():
            moved_spec = {old_to_new[r]: c for r, c in e.items() if r in old_to_new}
            if moved_spec:
                spec[key] = moved_spec
        self._spec = spec
        self.num_replicas = num_replicas

    def __len__(self) -> int:
        return len(self._holders)
