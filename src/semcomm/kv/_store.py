"""The chunk store interface shared by every KV tier, and what all stores have in common.

A store maps a :data:`ChunkKey` (32-byte hash-chain key) to the bytes of one encoded chunk
(:func:`semcomm.kv.encode_chunk`). Every store:

* validates a value on ``put`` (a malformed chunk, or one whose header names another key, is
  refused with :class:`~semcomm.errors.InvalidInputError` and nothing is stored);
* never serves bytes it cannot vouch for (persistent tiers verify the checksum on every ``get``;
  a bad entry is counted in ``stats().corrupt``, deleted and reported as a miss);
* reports ``store``/``evict`` events with a per-store, strictly increasing sequence number
  (the routing package's precise prefix index follows them).

``StoreBase`` holds the shared machinery (events, default ``lookup``/``fetch``);
concrete stores implement ``get``, ``put``, ``contains``, ``delete``, ``scan`` and ``stats``.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, overload, runtime_checkable

from ..errors import CorruptEntryError, InvalidInputError
from ._format import ChunkHeader, verify_chunk, verify_put
from ._keys import ChunkKey

__all__ = [
    "KEY_SIZE",
    "ChunkSealer",
    "ChunkStore",
    "EventKind",
    "Fetched",
    "PrefixMatch",
    "StoreBase",
    "StoreEvent",
    "StoreStats",
    "check_key",
    "check_stored",
    "open_stored",
    "parent_of",
    "validate_chunk",
]

logger = logging.getLogger("semcomm.kv")

KEY_SIZE = 32
"""Bytes in a chunk key (BLAKE2b-256 digest, see ``_keys``)."""

EventKind = Literal["store", "evict"]


@dataclass(slots=True)
class StoreStats:
    """A snapshot of one store's counters (a fresh object per ``stats()`` call)."""

    name: str  # tier name: "memory", "disk", "redis", "tiered"
    entries: int  # chunks held (this process's view for disk; server view for redis)
    bytes: int  # encoded bytes held
    capacity_bytes: int | None  # byte budget; None = unbounded (redis without a budget)
    hits: int = 0  # get/fetch calls that returned bytes
    misses: int = 0  # get/fetch calls that returned None (absent, corrupt or backend down)
    puts: int = 0  # values accepted by put
    rejected: int = 0  # valid values not stored (larger than the budget, or all else pinned)
    evictions: int = 0  # entries removed to respect the budget
    corrupt: int = 0  # entries that failed validation on read; deleted, never served
    errors: int = 0  # backend failures turned into misses / no-op puts
    outages: int = 0  # distinct backend outages seen (redis)
    pinned: int = 0  # entries pinned against eviction
    tiers: tuple[StoreStats, ...] = ()  # per-tier stats (TieredStore only), fastest first


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of ``lookup``: the longest run of consecutive cached chunks from ``keys[0]``."""

    num_chunks: int  # chunks cached from keys[0] on, without a gap
    tiers: tuple[str, ...]  # tier name holding each of those chunks (len == num_chunks)


@dataclass(frozen=True, slots=True)
class Fetched:
    """Result of ``fetch``: validated chunk bytes and the tier that served them."""

    value: bytes
    tier: str


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """A change in a store, delivered to subscribers in ``seq`` order."""

    kind: EventKind  # "store": a chunk became available; "evict": it is gone
    key: ChunkKey
    tier: str  # name of the tier where it happened
    seq: int  # per-store sequence number, strictly increasing from 1
    reason: str = ""  # "put", "found" (disk: another process's file), "evict", "delete", "corrupt"


@runtime_checkable
class ChunkStore(Protocol):
    """What the engine, fusion, routing and security packages rely on from any store."""

    name: str

    def get(self, key: ChunkKey) -> bytes | None: ...

    def put(self, key: ChunkKey, value: bytes) -> None: ...

    def contains(self, key: ChunkKey) -> bool: ...

    def delete(self, key: ChunkKey) -> bool: ...

    def scan(self) -> Iterator[ChunkKey]: ...

    def stats(self) -> StoreStats: ...

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixMatch: ...

    def fetch(self, key: ChunkKey) -> Fetched | None: ...

    def subscribe(self, callback: Callable[[StoreEvent], None]) -> None: ...

    # batch calls: one round trip where the backend allows (defaults in BaseChunkStore)
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def fetch_many(self, keys: Sequence[ChunkKey]) -> list[Fetched | None]: ...

    def put_many(self, items: Sequence[tuple[ChunkKey, bytes]]) -> None: ...

    def close(self) -> None: ...


def check_key(key: object) -> ChunkKey:
    """Return ``key`` as bytes, or raise ``TypeError``/``ValueError`` naming what is wrong."""
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise TypeError(f"chunk key must be {KEY_SIZE} bytes, got {type(key).__name__}")
    if len(key) != KEY_SIZE:
        raise ValueError(f"chunk key must be {KEY_SIZE} bytes, got {len(key)} bytes")
    return ChunkKey(key)


def validate_chunk(key: ChunkKey, value: object) -> tuple[bytes, ChunkKey | None]:
    """Check that ``value`` is a complete, intact chunk whose header names ``key``.

    Returns the value as ``bytes`` and its parent key; raises :class:`InvalidInputError`
    (a ``ValueError``) naming the key and the defect otherwise. The very object
    ``encode_chunk`` returned is checked without hashing it again (its checksum was computed
    over these immutable bytes, :func:`~semcomm.kv._format.verify_put`); anything else is
    checked completely.
    """
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise TypeError(f"chunk value must be bytes from encode_chunk, got {type(value).__name__}")
    try:
        info = verify_put(value, expect_key=key)
    except CorruptEntryError as exc:
        raise InvalidInputError(
            f"value for chunk key {key.hex()[:16]} is not a valid semcomm chunk: {exc}"
        ) from None
    return value, _parent(info.parent)


def check_stored(key: ChunkKey, data: bytes | memoryview) -> ChunkKey | None:
    """Verify bytes read back from a store; returns the parent key or raises CorruptEntryError."""
    return _parent(verify_chunk(data, expect_key=key).parent)


class ChunkSealer(Protocol):
    """Seals chunks at rest (``semcomm.security.ChunkSealer`` is the implementation).

    ``seal`` turns ``encode_chunk`` bytes into a sealed chunk (still an SCKV container with a
    readable header, so indexes can be rebuilt without the key); ``open`` authenticates and
    returns the original bytes, raising ``CorruptEntryError`` for anything forged or swapped.
    """

    def seal(self, chunk: bytes) -> bytes: ...

    def open(self, stored: bytes) -> bytes: ...


@overload
def open_stored(
    key: ChunkKey, stored: bytes, sealer: ChunkSealer | None
) -> tuple[bytes, ChunkKey | None]: ...


@overload
def open_stored(
    key: ChunkKey, stored: bytes | memoryview, sealer: ChunkSealer | None
) -> tuple[bytes | memoryview, ChunkKey | None]: ...


def open_stored(
    key: ChunkKey, stored: bytes | memoryview, sealer: ChunkSealer | None
) -> tuple[bytes | memoryview, ChunkKey | None]:
    """Verify stored bytes (and unseal them); returns (chunk bytes, parent key).

    Unsealed bytes come back as they were passed (a memoryview stays a view); a sealer's
    plaintext is new ``bytes``. Raises ``CorruptEntryError`` for anything that must not be served.
    """
    parent = check_stored(key, stored)
    if sealer is None:
        return stored, parent
    try:
        return sealer.open(stored if isinstance(stored, bytes) else bytes(stored)), parent
    except CorruptEntryError:
        raise
    except ValueError as exc:  # a sealer that reports failures as ValueError
        raise CorruptEntryError(f"chunk {key.hex()[:16]} failed to unseal: {exc}") from None


def _parent(raw: bytes | None) -> ChunkKey | None:
    return ChunkKey(raw) if raw is not None and len(raw) == KEY_SIZE else None


def parent_of(header: ChunkHeader) -> ChunkKey | None:
    """The parent chunk key named in a header (None for a chain's first chunk)."""
    if header.parent is None:
        return None
    try:
        raw = bytes.fromhex(header.parent)
    except ValueError:
        return None
    return _parent(raw)


class StoreBase(ABC):
    """Shared machinery: event fan-out, default ``lookup``/``fetch``.

    Subclasses call :meth:`_emit` *after* releasing their own locks, so a subscriber may call
    back into the store. Subscribers run synchronously in the thread that changed the store;
    an exception in one is logged and does not disturb the store or the other subscribers.
    """

    name: str = "store"

    def __init__(self) -> None:
        self._subscribers: list[Callable[[StoreEvent], None]] = []
        self._event_lock = threading.RLock()  # orders delivery by seq
        self._seq = 0  # last sequence number handed out; only _emit changes it

    # ---- the primitives every store implements ----------------------------------------------
    @abstractmethod
    def get(self, key: ChunkKey) -> bytes | None:
        """Validated bytes of ``key``, or None (absent, corrupt, or backend down)."""

    @abstractmethod
    def put(self, key: ChunkKey, value: bytes) -> None:
        """Store an encoded chunk; raises InvalidInputError for a malformed value."""

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is present (does not verify the bytes or change recency)."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove ``key``; True if it was present."""

    @abstractmethod
    def scan(self) -> Iterator[ChunkKey]:
        """Every key held (a snapshot)."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A fresh snapshot of the counters."""

    # ---- events -------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[StoreEvent], None]) -> None:
        """Call ``callback(StoreEvent)`` on every later store/evict in this store."""
        if not callable(callback):
            raise TypeError("subscribe() needs a callable")
        with self._event_lock:
            self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[StoreEvent], None]) -> None:
        """Stop delivering events to ``callback`` (no error if it was not subscribed)."""
        with self._event_lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def _emit(self, kind: EventKind, key: ChunkKey, reason: str, tier: str | None = None) -> None:
        with self._event_lock:
            self._seq += 1
            if not self._subscribers:
                return
            event = StoreEvent(kind=kind, key=key, tier=tier or self.name, seq=self._seq,
                               reason=reason)
            for cb in list(self._subscribers):
                try:
                    cb(event)
                except Exception:  # a broken subscriber must not break the store
                    logger.exception("store event subscriber %r failed", cb)

    # ---- defaults built on the five primitives -------------------------------------------
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key (one round trip where the backend allows)."""
        return [self.contains(k) for k in keys]

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixMatch:
        """Longest run of consecutive present chunks from ``keys[0]`` (does not touch LRU)."""
        n = 0
        for present in self.contains_many(keys):
            if not present:
                break
            n += 1
        return PrefixMatch(n, (self.name,) * n)

    def fetch(self, key: ChunkKey) -> Fetched | None:
        value = self.get(key)
        return None if value is None else Fetched(value, self.name)

    def fetch_many(self, keys: Sequence[ChunkKey]) -> list[Fetched | None]:
        """``fetch`` of each key, in order (one round trip for Redis; per tier for tiered)."""
        return [self.fetch(k) for k in keys]

    def put_many(self, items: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """``put`` of each (key, value) in order (DiskStore: one sync per batch with fsync)."""
        for key, value in items:
            self.put(key, value)

    def __contains__(self, key: object) -> bool:
        return self.contains(check_key(key))

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Release resources (nothing to do for most stores)."""

