"""The chunk store interface shared by every KV tier, and what all stores have in common.

A store maps a :data:`ChunkKey` (32-byte hash-chain key) to the bytes of one encoded chunk
(:func:`semcomm.kv.encode_chunk`). Every store:

* validates a value on ``put`` (a malformed chunk, or one whose header names another key, is
  refused with :class:`~semcomm.errors.InvalidInputError` and nothing is stored);
* never serves bytes it cannot vouch for (persistent tiers verify the checksum on every ``get``;
  a bad entry is counted in ``stats().corrupt``, deleted and reported as a miss);
* reports ``store``/``evict`` events with a per-store, strictly increasing sequence number
  (the routing package's precise prefix index follows them).

:class:`ChunkStore` is the interface callers use (every member, no probing);
:class:`ChunkStoreBase` implements all of it on top of six primitives a concrete store writes
(``get``, ``put``, ``contains``, ``delete``, ``scan``, ``stats``).
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
    "ChunkStoreBase",
    "EventKind",
    "Fetched",
    "PrefixMatch",
    "StoreBase",
    "StoreEvent",
    "StoreStats",
    "byte_view",
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
    """The store interface: what the engine, the vLLM connector, fusion, routing and the server
    call, every member on every store (callers never probe with ``getattr``/``hasattr``).

    **Required** of an implementation (abstract in :class:`ChunkStoreBase`): ``get``, ``put``,
    ``contains``, ``delete``, ``scan`` and ``stats``. **Provided** by :class:`ChunkStoreBase`
    on top of those (override where the backend does better, as semcomm's stores do): ``name``
    (a class attribute, ``"store"``), ``lookup``, ``fetch``, ``fetch_many``, ``contains_many``,
    ``put_many``, ``get_into``, ``prefetch``, ``flush``, ``close``, ``ping``, ``tiers``,
    ``namespace_bytes``, ``subscribe``/``unsubscribe``, ``verified_reads`` and ``reads_into``.

    A store of your own inherits :class:`ChunkStoreBase` and implements the six required
    methods; it is then a ``ChunkStore`` (``isinstance`` checks that every member is present)
    and works wherever semcomm's stores do, a ``TieredStore`` tier included.

    Reads serve verified bytes only: ``fetch``, ``fetch_many`` and ``get_into`` return bytes
    whose checksum and key were checked (the engine and the vLLM connector decode them without
    hashing again). semcomm's stores verify in ``get`` itself (``verified_reads = True``); for a
    store whose ``get`` does not (``verified_reads = False``, the default), the base class's
    ``fetch`` checks what ``get`` returned and treats a bad value as a miss (and deletes it).
    """

    name: str
    verified_reads: bool  # True: get itself returns only verified bytes (semcomm's stores)
    reads_into: bool  # True: get_into reads into the caller's buffer (DiskStore), no copy

    # ---- required ---------------------------------------------------------------------------
    def get(self, key: ChunkKey) -> bytes | None: ...

    def put(self, key: ChunkKey, value: bytes) -> None: ...

    def contains(self, key: ChunkKey) -> bool: ...

    def delete(self, key: ChunkKey) -> bool: ...

    def scan(self) -> Iterator[ChunkKey]: ...

    def stats(self) -> StoreStats: ...

    # ---- provided by ChunkStoreBase -------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixMatch: ...

    def fetch(self, key: ChunkKey) -> Fetched | None: ...

    def subscribe(self, callback: Callable[[StoreEvent], None]) -> None: ...

    def unsubscribe(self, callback: Callable[[StoreEvent], None]) -> None: ...

    # batch calls: one round trip where the backend allows
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def fetch_many(self, keys: Sequence[ChunkKey]) -> list[Fetched | None]: ...

    def put_many(self, items: Sequence[tuple[ChunkKey, bytes]]) -> None: ...

    def get_into(self, key: ChunkKey, buffer: bytearray | memoryview) -> memoryview | None: ...

    def prefetch(self, keys: Sequence[ChunkKey]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def ping(self) -> bool | None: ...

    @property
    def tiers(self) -> tuple[ChunkStore, ...]: ...

    def namespace_bytes(self) -> dict[bytes, int] | None: ...


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


def byte_view(buffer: bytearray | memoryview, caller: str) -> memoryview:
    """A flat byte view of a caller's read buffer; ``TypeError`` unless writable and contiguous."""
    out = memoryview(buffer)
    if out.readonly or not out.contiguous:
        raise TypeError(f"{caller} needs a writable, contiguous buffer (a bytearray)")
    if out.format != "B" or out.ndim != 1:
        out = out.cast("B")
    return out


class ChunkStoreBase(ABC):
    """Everything of :class:`ChunkStore` on top of six primitives (what a store implements).

    Subclasses implement ``get``, ``put``, ``contains``, ``delete``, ``scan`` and ``stats``
    (and set ``name``); every other member has a default here, built on those: batch calls
    are loops of the single ones, ``get_into`` copies a fetched chunk into the buffer,
    ``prefetch``/``flush``/``close`` do nothing, ``ping`` says None (no backend to probe),
    ``tiers`` is the store itself and ``namespace_bytes`` None (not accounted).

    Events: subclasses call :meth:`_emit` *after* releasing their own locks, so a subscriber
    may call back into the store. Subscribers run synchronously in the thread that changed the
    store; an exception in one is logged and does not disturb the store or the other
    subscribers.
    """

    name: str = "store"
    verified_reads: bool = False
    """True when ``get`` returns only bytes it verified (checksum and key, or a value validated
    by ``put`` and held in trusted memory); False: ``fetch`` verifies what ``get`` returned."""
    reads_into: bool = False
    """True when ``get_into`` reads the chunk into the caller's buffer itself (``DiskStore``);
    False: it copies a fetched chunk into it (an extra copy: callers then prefer ``fetch``)."""

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

    # ---- defaults built on the primitives ------------------------------------------------
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
        """``get`` plus the tier that served it; verified bytes only (see ``verified_reads``)."""
        value = self.get(key)
        if value is None:
            return None
        if not self.verified_reads and not self._verified(key, value):
            return None
        return Fetched(value, self.name)

    def _verified(self, key: ChunkKey, value: bytes) -> bool:
        """Whether ``value`` (from a ``get`` that does not verify) is an intact chunk of ``key``;
        a bad one is deleted (best effort) and logged: it must never be served."""
        try:
            check_stored(check_key(key), value)
            return True
        except CorruptEntryError as exc:
            logger.warning("%s: dropping corrupt chunk %s: %s", self.name,
                           bytes(key).hex()[:16], exc)
        try:
            self.delete(key)
        except Exception:  # the read is a miss either way
            logger.exception("%s: deleting corrupt chunk %s failed", self.name,
                             bytes(key).hex()[:16])
        return False

    def fetch_many(self, keys: Sequence[ChunkKey]) -> list[Fetched | None]:
        """``fetch`` of each key, in order (one round trip for Redis; per tier for tiered)."""
        return [self.fetch(k) for k in keys]

    def put_many(self, items: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """``put`` of each (key, value) in order (DiskStore: one sync per batch with fsync)."""
        for key, value in items:
            self.put(key, value)

    def get_into(self, key: ChunkKey, buffer: bytearray | memoryview) -> memoryview | None:
        """The verified chunk as a view: of ``buffer`` when it fits (copied in), else of the
        fetched bytes; None for a miss. Valid until ``buffer`` is reused. ``DiskStore`` reads
        the file straight into ``buffer`` instead (``reads_into``)."""
        out = byte_view(buffer, "get_into")
        got = self.fetch(key)
        if got is None:
            return None
        value = got.value
        if len(value) > len(out):
            return memoryview(value)
        out[: len(value)] = value
        return out[: len(value)]

    def prefetch(self, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - a hint, optional
        """Start bringing these chunks closer before they are read (``DiskStore``: the files
        into the page cache); a hint, nothing to do by default."""

    def flush(self) -> None:  # noqa: B027 - optional, not abstract
        """Wait until every accepted chunk is stored (``DiskStore`` write-behind); by default
        ``put`` has stored it already."""

    def close(self) -> None:  # noqa: B027 - optional, not abstract
        """Release resources (nothing to do for most stores)."""

    def ping(self) -> bool | None:
        """Health probe of a remote backend: True if it answered, False if not; None for a
        store without one (nothing to probe)."""
        return None

    @property
    def tiers(self) -> tuple[ChunkStore, ...]:
        """The tier stores, fastest first (a ``TieredStore``'s); a single store's is itself."""
        return (self,)

    def namespace_bytes(self) -> dict[bytes, int] | None:
        """Bytes held per namespace digest (one per model and tenant), or None where the store
        does not account them (``MemoryStore`` does; a ``TieredStore`` gives its first tier's
        that does)."""
        return None

    def __contains__(self, key: object) -> bool:
        return self.contains(check_key(key))

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


StoreBase = ChunkStoreBase
"""The former name of :class:`ChunkStoreBase` (kept for code written against it)."""
