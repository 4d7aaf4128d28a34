"""Eviction order for the local tiers: LRU among chain tails, never a pinned entry.

``ChainLru`` is the bookkeeping of :class:`MemoryStore` and :class:`DiskStore` (not thread-safe:
the owning store holds its lock around every call).

Invariants:

* An entry is *evictable* when it is not pinned and none of its cached children is present
  (a child is an entry whose header names it as ``parent``). So a prefix chunk always outlives
  its extensions: a chain is evicted from its tail inward, the way SGLang's radix cache evicts
  leaves first. Pinning a chunk therefore also keeps its whole prefix.
* Among evictable entries the victim is the least recently used one (exact LRU: a strictly
  increasing tick per touch). A lazy min-heap of ``(tick, key)`` finds it; stale heap items
  (touched again, gained a child, pinned, removed) are skipped when popped and the heap is
  rebuilt when it grows past a few times the entry count.
* ``bytes`` is the sum of the entry sizes, updated on every add/remove.

:class:`FairChainLru` (the memory tier's ``eviction = "fair"``) keeps the chain rule and pins
but chooses the victim differently: entries carry a *group* (their KV namespace: one per model
and tenant) and a hit count; the victim comes from the group holding the most bytes (the one
most over an equal share of the budget), and within it a chunk hit fewer than ``shared_hits``
times goes before one hit repeatedly and lately (a shared system prompt), LRU within each
class; a chunk never evicts a chunk of its own group that is still read repeatedly.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._keys import ChunkKey
from ._store import check_key

__all__ = [
    "EVICTION_POLICIES",
    "ChainLru",
    "FairChainLru",
    "Incoming",
    "LruEntry",
    "LruPinning",
    "make_lru",
]


@dataclass(frozen=True, slots=True)
class Incoming:
    """The chunk an insert is making room for (what fair eviction weighs shares with)."""

    group: bytes | None  # its namespace digest
    size: int  # its encoded bytes
    capacity: int  # the store's byte budget


@dataclass(slots=True)
class LruEntry:
    """Per-entry eviction metadata (changed only by ChainLru)."""

    size: int  # encoded bytes
    parent: ChunkKey | None  # parent chunk key from the header (None: first chunk)
    tick: int  # recency: larger = used more recently
    pins: int = 0  # pin count; > 0 means never evicted
    group: bytes | None = None  # fair eviction: the chunk's KV namespace digest (set on add)
    hits: int = 0  # fair eviction: reads since it was stored (``touch``)
    read_at: float = 0.0  # fair eviction: clock time of its last read (or its store)


class ChainLru:
    """LRU over evictable chain tails; see the module docstring for the invariants."""

    def __init__(self) -> None:
        self.entries: dict[ChunkKey, LruEntry] = {}
        self.bytes = 0
        self._tick = 0
        self._children: dict[ChunkKey, int] = {}  # parent key -> cached children naming it
        self._heap: list[tuple[int, ChunkKey]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _evictable(self, key: ChunkKey, e: LruEntry) -> bool:
        return e.pins == 0 and self._children.get(key, 0) == 0

    def _push(self, key: ChunkKey, e: LruEntry) -> None:
        if self._evictable(key, e):
            heapq.heappush(self._heap, (e.tick, key))
            if len(self._heap) > 4 * len(self.entries) + 64:
                self._heap = [(x.tick, k) for k, x in self.entries.items() if self._evictable(k, x)]
                heapq.heapify(self._heap)

    def add(self, key: ChunkKey, size: int, parent: ChunkKey | None,
            group: bytes | None = None) -> int | None:
        """Insert or replace ``key`` as most recently used; return the old size if replaced.

        ``group``: the chunk's namespace (used by :class:`FairChainLru`; ignored here)."""
        if parent == key:  # a self-parent would make the entry unevictable forever
            parent = None
        old = self.entries.get(key)
        if old is not None:
            old_size = old.size
            self.bytes += size - old.size
            old.size = size
            old.tick = self._next_tick()
            self._push(key, old)
            return old_size
        e = LruEntry(size=size, parent=parent, tick=self._next_tick(), group=group)
        self.entries[key] = e
        self.bytes += size
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._push(key, e)
        return None

    def touch(self, key: ChunkKey) -> None:
        e = self.entries.get(key)
        if e is not None:
            e.tick = self._next_tick()
            self._push(key, e)

    def remove(self, key: ChunkKey) -> LruEntry | None:
        e = self.entries.pop(key, None)
        if e is None:
            return None
        self.bytes -= e.size
        p = e.parent
        if p is not None:
            n = self._children.get(p, 0) - 1
            if n > 0:
                self._children[p] = n
            else:
                self._children.pop(p, None)
                pe = self.entries.get(p)
                if pe is not None:
                    self._push(p, pe)  # the parent just became a chain tail
        return e

    def pin(self, key: ChunkKey) -> bool:
        e = self.entries.get(key)
        if e is None:
            return False
        e.pins += 1
        return True

    def unpin(self, key: ChunkKey) -> bool:
        e = self.entries.get(key)
        if e is None or e.pins == 0:
            return False
        e.pins -= 1
        self._push(key, e)
        return True

    @property
    def pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins)

    def victim(self, protect: ChunkKey | None = None, *, incoming: Incoming | None = None
               ) -> ChunkKey | None:
        """The entry to evict next (not removed), or None if nothing is evictable.

        ``protect`` names one entry that must survive this round (the parent of a chunk being
        inserted, so the new chunk does not orphan itself). ``incoming`` describes the chunk
        being inserted (used by :class:`FairChainLru`; ignored here).
        """
        held: list[tuple[int, ChunkKey]] = []
        found: ChunkKey | None = None
        while self._heap:
            tick, key = self._heap[0]
            e = self.entries.get(key)
            if e is None or e.tick != tick or not self._evictable(key, e):
                heapq.heappop(self._heap)  # stale
                continue
            if key == protect:
                held.append(heapq.heappop(self._heap))
                continue
            found = key
            break
        for item in held:
            heapq.heappush(self._heap, item)
        return found

    def order(self) -> list[ChunkKey]:
        """Entries least recently used first (diagnostics and tests; O(n log n))."""
        return [k for k, _ in sorted(self.entries.items(), key=lambda kv: kv[1].tick)]


class FairChainLru(ChainLru):
    """Fair shares per namespace, shared prefixes kept longest (see the module docstring).

    Invariants (on top of :class:`ChainLru`'s): ``group_bytes[g]`` is the sum of the sizes of
    the entries of group ``g`` (groups with no entry are absent). An entry is *hot* when its
    ``hits >= shared_hits`` and it was read within the last ``fresh_s`` seconds (``clock``); a
    hot entry that nobody reads for ``fresh_s`` *cools down* and counts as cold again (time,
    not bytes written: a long session writes its whole prompt in one burst, between two reads
    of the system prompt it must not outlive). The victim comes from the group
    holding the most bytes that has an evictable entry: its least recently used cold entry,
    else its least recently used hot one. So a group at or under an equal share of a full
    budget loses nothing while another is over its share, and its hot chunks go only after its
    cold ones. A chunk being inserted never evicts a hot chunk of its own group (the insert is
    refused instead): a long session cannot push out the system prompt its own model's other
    requests keep reading.
    """

    def __init__(self, shared_hits: int = 2, *, fresh_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if shared_hits < 1:
            raise ValueError(f"shared_hits must be >= 1, got {shared_hits}")
        if fresh_s <= 0:
            raise ValueError(f"fresh_s must be > 0, got {fresh_s}")
        self.shared_hits = shared_hits
        self.fresh_s = fresh_s
        self._clock = clock
        self.group_bytes: dict[bytes | None, int] = {}
        # per (group, read repeatedly): lazy min-heap of (tick, key); stale items are skipped
        # as in ChainLru (an entry moves heaps when its hits reach shared_hits)
        self._gheaps: dict[tuple[bytes | None, bool], list[tuple[int, ChunkKey]]] = {}
        self._gcount: dict[bytes | None, int] = {}  # entries per group (heap rebuild bound)

    def _shared(self, e: LruEntry) -> bool:
        return e.hits >= self.shared_hits

    def _push(self, key: ChunkKey, e: LruEntry) -> None:
        if not self._evictable(key, e):
            return
        hkey = (e.group, self._shared(e))
        heap = self._gheaps.setdefault(hkey, [])
        heapq.heappush(heap, (e.tick, key))
        if len(heap) > 4 * self._gcount.get(e.group, 0) + 64:
            g, shared = hkey
            heap[:] = [(x.tick, k) for k, x in self.entries.items()
                       if x.group == g and self._shared(x) == shared and self._evictable(k, x)]
            heapq.heapify(heap)

    def add(self, key: ChunkKey, size: int, parent: ChunkKey | None,
            group: bytes | None = None) -> int | None:
        old = self.entries.get(key)
        if old is not None:  # replaced in place: same group, hits kept
            old_size = super().add(key, size, parent, old.group)
            assert old_size is not None
            self.group_bytes[old.group] += size - old_size
            return old_size
        self.group_bytes[group] = self.group_bytes.get(group, 0) + size
        self._gcount[group] = self._gcount.get(group, 0) + 1
        out = super().add(key, size, parent, group)
        self.entries[key].read_at = self._clock()
        return out

    def touch(self, key: ChunkKey) -> None:
        e = self.entries.get(key)
        if e is not None:
            e.hits += 1
            e.read_at = self._clock()
        super().touch(key)

    def remove(self, key: ChunkKey) -> LruEntry | None:
        e = super().remove(key)
        if e is None:
            return None
        g = e.group
        left = self.group_bytes[g] - e.size
        count = self._gcount[g] - 1
        if count:
            self.group_bytes[g], self._gcount[g] = left, count
        else:
            assert left == 0, "group bytes out of step with its entries"
            del self.group_bytes[g], self._gcount[g]
            self._gheaps.pop((g, False), None)
            self._gheaps.pop((g, True), None)
        return e

    def _top(self, g: bytes | None, shared: bool, protect: ChunkKey | None
             ) -> tuple[ChunkKey, LruEntry] | None:
        """The least recently used evictable entry of one heap (left in it), or None."""
        heap = self._gheaps.get((g, shared))
        if not heap:
            return None
        held: list[tuple[int, ChunkKey]] = []
        found: tuple[ChunkKey, LruEntry] | None = None
        while heap:
            tick, key = heap[0]
            e = self.entries.get(key)
            if (e is None or e.tick != tick or e.group != g or self._shared(e) != shared
                    or not self._evictable(key, e)):
                heapq.heappop(heap)  # stale
                continue
            if key == protect:
                held.append(heapq.heappop(heap))
                continue
            found = (key, e)
            break
        for item in held:
            heapq.heappush(heap, item)
        return found

    def _group_victim(self, g: bytes | None, protect: ChunkKey | None, own: bool
                      ) -> ChunkKey | None:
        cold = self._top(g, False, protect)
        hot = self._top(g, True, protect)  # the least recently read of the group's hot ones
        if hot is not None:
            if self._clock() - hot[1].read_at >= self.fresh_s:  # cooled down: cold again
                if cold is None or hot[1].tick < cold[1].tick:
                    return hot[0]
            elif own and cold is None:
                return None  # still read: the incoming chunk of its own group is refused
        if cold is not None:
            return cold[0]
        return hot[0] if hot is not None else None

    def victim(self, protect: ChunkKey | None = None, *, incoming: Incoming | None = None
               ) -> ChunkKey | None:
        """As :meth:`ChainLru.victim`, from the group holding the most bytes first. With
        ``incoming``, only groups over an equal share of ``incoming.capacity`` (the incoming
        chunk counted in its group) may lose an entry: when none of them has an evictable one,
        None (the insert is refused rather than taken out of a group within its share)."""
        held = dict(self.group_bytes)
        share = None
        if incoming is not None:
            held[incoming.group] = held.get(incoming.group, 0) + incoming.size
            share = incoming.capacity / len(held)
        for g in sorted(held, key=lambda x: held[x], reverse=True):
            if share is not None and held[g] <= share:
                break
            own = incoming is not None and g == incoming.group
            found = self._group_victim(g, protect, own)
            if found is not None:
                return found
        return None

    def order(self) -> list[ChunkKey]:
        """Entries by group (most bytes first), then read fewer than ``shared_hits`` times
        first, then least recently used first (chains, pins and cooling ignored)."""
        rank = sorted(self.group_bytes, key=lambda x: self.group_bytes[x], reverse=True)
        pos = {g: i for i, g in enumerate(rank)}
        return [k for k, _ in sorted(self.entries.items(), key=lambda kv: (
            pos[kv[1].group], self._shared(kv[1]), kv[1].tick))]


EVICTION_POLICIES: dict[str, type[ChainLru]] = {"lru": ChainLru, "fair": FairChainLru}
"""Eviction bookkeeping by name: ``lru`` (exact LRU over chain tails) or ``fair`` (fair shares
per namespace, shared prefixes kept longest)."""


def make_lru(policy: str) -> ChainLru:
    """A fresh bookkeeping object for the eviction policy named ``policy``."""
    try:
        return EVICTION_POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {policy!r}; use one of "
                         f"{sorted(EVICTION_POLICIES)}") from None


class LruPinning:
    """Pinning and eviction order for a store whose bookkeeping is a :class:`ChainLru`.

    Mixed into :class:`MemoryStore` and :class:`DiskStore`, which set ``_lru`` and ``_lock``.
    For a ``DiskStore`` pins and order are this process's view of the folder.
    """

    _lru: ChainLru
    _lock: threading.Lock | threading.RLock

    def pin(self, key: ChunkKey) -> bool:
        """Protect ``key`` from eviction (counted: pin twice, unpin twice). False if absent."""
        key = check_key(key)
        with self._lock:
            return self._lru.pin(key)

    def unpin(self, key: ChunkKey) -> bool:
        """Undo one ``pin``; False if ``key`` is absent or not pinned."""
        key = check_key(key)
        with self._lock:
            return self._lru.unpin(key)

    def eviction_order(self) -> list[ChunkKey]:
        """Entries least recently used first (ignores pins and chains; for diagnostics)."""
        with self._lock:
            return self._lru.order()
