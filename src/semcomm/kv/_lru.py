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
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

from ._keys import ChunkKey
from ._store import check_key

__all__ = ["ChainLru", "LruEntry", "LruPinning"]


@dataclass(slots=True)
class LruEntry:
    """Per-entry eviction metadata (changed only by ChainLru)."""

    size: int  # encoded bytes
    parent: ChunkKey | None  # parent chunk key from the header (None: first chunk)
    tick: int  # recency: larger = used more recently
    pins: int = 0  # pin count; > 0 means never evicted


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

    def add(self, key: ChunkKey, size: int, parent: ChunkKey | None) -> int | None:
        """Insert or replace ``key`` as most recently used; return the old size if replaced."""
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
        e = LruEntry(size=size, parent=parent, tick=self._next_tick())
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

    def victim(self, protect: ChunkKey | None = None) -> ChunkKey | None:
        """The entry to evict next (not removed), or None if nothing is evictable.

        ``protect`` names one entry that must survive this round (the parent of a chunk being
        inserted, so the new chunk does not orphan itself).
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
