"""TieredStore: several stores, fastest first, used as one."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from ..errors import ConfigError
from ._format import hand_over, withdraw
from ._keys import ChunkKey
from ._store import (
    ChunkStore,
    ChunkStoreBase,
    Fetched,
    PrefixMatch,
    StoreEvent,
    StoreStats,
    check_key,
    validate_chunk,
)

__all__ = ["TieredStore"]


class TieredStore(ChunkStoreBase):
    """Tiers ordered fastest first, e.g. ``[MemoryStore(), DiskStore(path), RedisStore(url)]``.

    * **Write-through:** ``put`` validates once and writes the chunk to every tier.
    * **Read in order, promote on hit:** ``fetch``/``get`` return the first tier holding the
      key (``Fetched.tier`` names it) and copy the chunk into every faster tier.
    * **Independent budgets:** each tier evicts on its own; eviction in a fast tier never
      deletes from a slower one, so a chunk falls back to the next tier instead of vanishing.
    * ``lookup`` counts a chunk as cached if any tier holds it and reports the tier per chunk
      (the first that holds it); ``delete`` removes the key from every tier.
    * ``stats()`` has hits/misses of the whole store, entries/bytes/capacity of its largest
      tier, and every tier's own stats in ``tiers``.
    * Events of every tier are forwarded with this store's own sequence numbers and
      ``StoreEvent.tier`` naming the tier where the change happened.
    * ``tiers`` are the tier stores; ``prefetch``, ``flush`` and ``close`` go to every tier,
      ``ping`` probes every tier (None when none has a backend to probe), ``namespace_bytes``
      is the first tier's that accounts them.

    Reads go through each tier's ``fetch``/``fetch_many``, which serve verified bytes only
    (:class:`ChunkStore`), so this store's reads are verified too (``verified_reads``).
    """

    name = "tiered"
    verified_reads = True  # every tier's fetch serves verified bytes only

    def __init__(self, tiers: Sequence[ChunkStore], *, name: str = "tiered"):
        super().__init__()
        tiers = list(tiers)
        if not tiers:
            raise ConfigError("TieredStore needs at least one tier")
        for t in tiers:
            if not isinstance(t, ChunkStore):
                raise TypeError(f"TieredStore tiers must be ChunkStores (a store of your own: "
                                f"inherit semcomm.kv.ChunkStoreBase), got {type(t).__name__}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"TieredStore tier names must be distinct, got {names} "
                              "(pass name=... to the stores)")
        if any(t is self for t in tiers):
            raise ConfigError("a TieredStore cannot contain itself")
        self.name = name
        self._tiers: tuple[ChunkStore, ...] = tuple(tiers)
        self._lock = threading.Lock()
        self._hits = self._misses = self._promotions = 0
        for t in self.tiers:
            t.subscribe(self._forward)

    @property
    def tiers(self) -> tuple[ChunkStore, ...]:
        """The tier stores, fastest first."""
        return self._tiers

    def _forward(self, ev: StoreEvent) -> None:
        self._emit(ev.kind, ev.key, ev.reason, tier=ev.tier)

    # ---- reads ---------------------------------------------------------------------------
    def fetch(self, key: ChunkKey) -> Fetched | None:
        key = check_key(key)
        for i, tier in enumerate(self.tiers):
            got = tier.fetch(key)
            if got is not None:
                self._promote(key, got.value, i)
                with self._lock:
                    self._hits += 1
                return Fetched(got.value, tier.name)
        with self._lock:
            self._misses += 1
        return None

    def _promote(self, key: ChunkKey, value: bytes, found_at: int) -> None:
        if found_at == 0:
            return
        # a tier whose get serves only bytes it verified (the checksum of what it read, or a
        # value validated by its put; semcomm's own stores): the faster tiers need not hash it
        # again. Any other tier's bytes are checked again by each faster tier's put.
        verified = self.tiers[found_at].verified_reads
        for faster in self.tiers[:found_at]:
            if verified:
                hand_over(value)
            faster.put(key, value)
        withdraw(value)
        with self._lock:
            self._promotions += 1

    def fetch_many(self, keys: Sequence[ChunkKey]) -> list[Fetched | None]:
        """Each key from the first tier holding it (one batch per tier), promoted on hit."""
        ks = [check_key(k) for k in keys]
        out: list[Fetched | None] = [None] * len(ks)
        for i, tier in enumerate(self.tiers):
            todo = [j for j in range(len(ks)) if out[j] is None]
            if not todo:
                break
            got = tier.fetch_many([ks[j] for j in todo])
            for j, f in zip(todo, got):
                if f is not None:
                    out[j] = Fetched(f.value, tier.name)
                    self._promote(ks[j], f.value, i)
        with self._lock:
            hits = sum(f is not None for f in out)
            self._hits += hits
            self._misses += len(out) - hits
        return out

    def get(self, key: ChunkKey) -> bytes | None:
        got = self.fetch(key)
        return None if got is None else got.value

    def contains(self, key: ChunkKey) -> bool:
        key = check_key(key)
        return any(t.contains(key) for t in self.tiers)

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixMatch:
        """Longest gap-free run from ``keys[0]`` across tiers (one batched query per tier)."""
        keys = [check_key(k) for k in keys]
        where: list[str | None] = [None] * len(keys)
        limit = len(keys)  # chunks past the first gap cannot count
        for tier in self.tiers:
            todo = [i for i in range(limit) if where[i] is None]
            if not todo:
                break
            flags = tier.contains_many([keys[i] for i in todo])
            for i, present in zip(todo, flags):
                if present:
                    where[i] = tier.name
        n = 0
        while n < limit and where[n] is not None:
            n += 1
        return PrefixMatch(n, tuple(w for w in where[:n] if w is not None))

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        found = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            for i, present in zip(todo, tier.contains_many([keys[i] for i in todo])):
                found[i] = found[i] or present
        return found

    # ---- writes --------------------------------------------------------------------------
    def put(self, key: ChunkKey, value: bytes) -> None:
        key = check_key(key)
        value, _ = validate_chunk(key, value)  # once: a bad value raises before any write
        for tier in self.tiers:
            hand_over(value)  # verified above: each tier checks it without a second hash
            tier.put(key, value)
        withdraw(value)

    def put_many(self, items: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """Write a batch through to every tier (with each tier's ``put_many``).

        Every value is validated first: a bad one raises before any tier is written."""
        batch = []
        for k, v in items:
            k = check_key(k)
            batch.append((k, validate_chunk(k, v)[0]))
        for tier in self.tiers:
            for _, v in batch:
                hand_over(v)
            tier.put_many(batch)
        for _, v in batch:
            withdraw(v)

    def prefetch(self, keys: Sequence[ChunkKey]) -> None:
        """``prefetch`` of every tier (a disk tier: ``DiskStore.prefetch``; others: nothing)."""
        for tier in self.tiers:
            tier.prefetch(keys)

    def delete(self, key: ChunkKey) -> bool:
        key = check_key(key)
        results = [t.delete(key) for t in self.tiers]
        return any(results)

    def scan(self) -> Iterator[ChunkKey]:
        seen: set[ChunkKey] = set()
        for tier in self.tiers:
            for k in tier.scan():
                if k not in seen:
                    seen.add(k)
                    yield k

    def stats(self) -> StoreStats:
        per = tuple(t.stats() for t in self.tiers)
        largest = max(per, key=lambda s: (s.entries, s.bytes))
        with self._lock:
            return StoreStats(
                name=self.name, entries=largest.entries, bytes=largest.bytes,
                capacity_bytes=largest.capacity_bytes, hits=self._hits, misses=self._misses,
                puts=max(s.puts for s in per), rejected=sum(s.rejected for s in per),
                evictions=sum(s.evictions for s in per), corrupt=sum(s.corrupt for s in per),
                errors=sum(s.errors for s in per), outages=sum(s.outages for s in per),
                pinned=sum(s.pinned for s in per), tiers=per,
            )

    @property
    def promotions(self) -> int:
        """Chunks copied into faster tiers after a hit in a slower one."""
        return self._promotions

    def flush(self) -> None:
        """Wait until every tier has written what it accepted (a write-behind DiskStore)."""
        for t in self.tiers:
            t.flush()

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def ping(self) -> bool | None:
        """Every tier's health probe: None when no tier has a backend to probe, else whether
        all of those answered (the server probes ``tiers`` one by one to name the one down)."""
        answers = [a for a in (t.ping() for t in self.tiers) if a is not None]
        return all(answers) if answers else None

    def namespace_bytes(self) -> dict[bytes, int] | None:
        """The first tier's bytes per namespace that accounts them (the memory tier's)."""
        for t in self.tiers:
            held = t.namespace_bytes()
            if held is not None:
                return held
        return None
