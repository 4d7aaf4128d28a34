"""MemoryStore: the in-process tier (a dict of immutable ``bytes`` under a byte budget)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

from ._keys import ChunkKey
from ._lru import EVICTION_POLICIES, Incoming, LruPinning, make_lru
from ._store import ChunkStoreBase, PrefixMatch, StoreStats, check_key, validate_chunk

__all__ = ["DEFAULT_MEMORY_CAPACITY", "MemoryStore"]

logger = logging.getLogger("semcomm.kv")

DEFAULT_MEMORY_CAPACITY = 1 << 30  # 1 GiB


class MemoryStore(ChunkStoreBase, LruPinning):
    """Chunks in process memory, bounded by ``capacity_bytes`` of encoded chunk bytes.

    * ``put`` validates the whole chunk (header, key, checksum) and raises
      :class:`~semcomm.errors.InvalidInputError` for a malformed value, storing nothing.
    * ``get`` returns the very ``bytes`` object stored (no copy, no re-verification: process
      memory is trusted) and marks it most recently used.
    * Eviction (see :class:`ChainLru`): least recently used chain tail first; a chunk whose
      children are cached outlives them; pinned chunks (``pin``/``unpin``, counted) are never
      evicted. ``eviction="fair"`` (:class:`FairChainLru`, what the server uses) also keeps
      fair shares per KV namespace (one per model and tenant): the victim comes from the
      namespace holding the most bytes, and within it chunks read fewer than twice go before
      shared ones (system prompts), so one model's long session cannot push another model's
      hot prefixes out. A value that cannot fit without evicting pinned data is not stored
      (``stats().rejected``); the budget is never exceeded.
    * ``lookup`` and ``contains`` do not change recency. Thread-safe.
    """

    name = "memory"
    verified_reads = True  # put validated every value; process memory is trusted

    def __init__(self, capacity_bytes: int = DEFAULT_MEMORY_CAPACITY, *, name: str = "memory",
                 eviction: str = "lru"):
        super().__init__()
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}; use one of "
                             f"{sorted(EVICTION_POLICIES)}")
        self.eviction = eviction
        self._fair = eviction == "fair"
        self._data: dict[ChunkKey, bytes] = {}
        self._lru = make_lru(eviction)
        self._lock = threading.Lock()
        self._hits = self._misses = self._puts = self._rejected = self._evictions = 0

    # ---- primitives ---------------------------------------------------------------------
    def get(self, key: ChunkKey) -> bytes | None:
        key = check_key(key)
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self._misses += 1
                return None
            self._lru.touch(key)
            self._hits += 1
            return value

    def put(self, key: ChunkKey, value: bytes) -> None:
        key = check_key(key)
        value, parent = validate_chunk(key, value)
        self._insert(key, value, parent, reason="put")

    def _insert(self, key: ChunkKey, value: bytes, parent: ChunkKey | None, reason: str) -> bool:
        """Store an already validated value; returns False if it could not fit."""
        size = len(value)
        evicted: list[ChunkKey] = []
        group = self._group(value) if self._fair else None
        with self._lock:
            if size > self.capacity_bytes:
                self._rejected += 1
                logger.debug("chunk %s (%d B) exceeds the %s budget", key.hex()[:16], size,
                             self.name)
                return False
            old_value = self._data.pop(key, None)
            old = self._lru.remove(key) if old_value is not None else None
            ok = True
            incoming = Incoming(group, size, self.capacity_bytes) if self._fair else None
            while self._lru.bytes + size > self.capacity_bytes:
                victim = self._lru.victim(protect=parent, incoming=incoming)
                if victim is None:
                    ok = False
                    break
                e = self._lru.remove(victim)
                assert e is not None
                del self._data[victim]
                self._evictions += 1
                evicted.append(victim)
            if ok:
                self._data[key] = value
                self._lru.add(key, size, parent, group)
                self._puts += 1
            else:
                self._rejected += 1
                if old_value is not None and old is not None:  # keep what was there
                    self._data[key] = old_value
                    self._lru.add(key, old.size, old.parent, old.group)
                    for _ in range(old.pins):
                        self._lru.pin(key)
            if old is not None:  # a rewrite keeps the chunk's hit count (fair eviction)
                self._lru.entries[key].hits = old.hits
            if ok and old is not None:
                for _ in range(old.pins):
                    self._lru.pin(key)
        self._finish(evicted)
        if ok and old_value is None:
            self._emit("store", key, reason)
        return ok

    @staticmethod
    def _group(value: bytes) -> bytes:
        """The chunk's namespace digest (its fair-eviction group), from its header."""
        from ._format import read_header

        return bytes.fromhex(read_header(value).namespace)

    def _finish(self, evicted: list[ChunkKey]) -> None:
        # must not hold self._lock (subscribers may call back in)
        for k in evicted:
            self._emit("evict", k, "evict")

    def contains(self, key: ChunkKey) -> bool:
        return check_key(key) in self._data

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        data = self._data
        return [check_key(k) in data for k in keys]

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixMatch:
        n = 0
        data = self._data
        for k in keys:
            if check_key(k) not in data:
                break
            n += 1
        return PrefixMatch(n, (self.name,) * n)

    def delete(self, key: ChunkKey) -> bool:
        key = check_key(key)
        with self._lock:
            if self._data.pop(key, None) is None:
                return False
            self._lru.remove(key)
        self._emit("evict", key, "delete")
        return True

    def scan(self) -> Iterator[ChunkKey]:
        with self._lock:
            keys = list(self._data)
        return iter(keys)

    def clear(self) -> None:
        """Drop every entry (pinned ones included); emits an evict event per entry."""
        with self._lock:
            keys = list(self._data)
            self._data.clear()
            self._lru = make_lru(self.eviction)
        for k in keys:
            self._emit("evict", k, "delete")

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                name=self.name, entries=len(self._data), bytes=self._lru.bytes,
                capacity_bytes=self.capacity_bytes, hits=self._hits, misses=self._misses,
                puts=self._puts, rejected=self._rejected, evictions=self._evictions,
                pinned=self._lru.pinned,
            )

    def namespace_bytes(self) -> dict[bytes, int]:
        """Bytes held per namespace digest (read from each chunk's header; no LRU touch), so a
        server can say how much of this tier each model and tenant holds."""
        from ._format import read_header

        with self._lock:
            values = list(self._data.values())
        out: dict[bytes, int] = {}
        for v in values:
            ns = bytes.fromhex(read_header(v).namespace)
            out[ns] = out.get(ns, 0) + len(v)
        return out

    # pinning: pin / unpin / eviction_order come from LruPinning

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return (f"MemoryStore(entries={len(self._data)}, bytes={self._lru.bytes}, "
                f"capacity_bytes={self.capacity_bytes})")
