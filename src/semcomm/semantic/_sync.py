"""Keeping the cache's in-process table in step with its entry store (:class:`StoreSync`).

Several processes may share one store (a SQLite file, Redis). Each keeps its own
:class:`~semcomm.semantic._table.EntryTable`: built from the store's live rows on first use
(after checking that the store was written with the same embedding dimension), then brought
up to date with the inserts and deletes the others made, which the store reports by
``poll()``: on every lookup and invalidation, at most every ``interval_s`` seconds, and on
:meth:`StoreSync.sync`. An in-memory store has no other writers and is never polled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import ConfigError
from ._stores import EntryStore, MemoryEntryStore, Sync
from ._table import EntryTable

__all__ = ["StoreSync"]

log = logging.getLogger(__name__)


class StoreSync:
    """Loads ``table`` from ``backend`` and applies the store's changes to it (see the
    module docstring). ``embedder_name`` and ``dim`` are checked against the store's meta;
    ``clock`` tells which rows expired. Table changes happen under ``lock``."""

    def __init__(self, backend: EntryStore, table: EntryTable, lock: threading.RLock, *,
                 embedder_name: str, dim: Callable[[], int], clock: Callable[[], float],
                 interval_s: float) -> None:
        self.backend = backend
        self._table = table
        self._lock = lock
        self._embedder_name = embedder_name
        self._dim = dim
        self._clock = clock
        self.interval_s = interval_s
        self.loaded = False
        self._last = 0.0

    def ensure_loaded(self) -> None:
        """Check the store's meta and build the table from it, once."""
        if self.loaded:
            return
        with self._lock:
            if self.loaded:
                return
            meta = self.backend.read_meta()
            dim = self._dim()
            if meta.get("dim") and int(meta["dim"]) != dim:
                raise ConfigError(
                    f"this cache holds {meta['dim']}-dimensional embeddings "
                    f"(embedder {meta.get('embedder', '?')!r}) but embedder "
                    f"{self._embedder_name!r} gives {dim}; open it with the same embedder or "
                    "use a new cache path")
            if meta.get("embedder") and meta["embedder"] != self._embedder_name:
                log.warning("semantic cache was written by embedder %r, now read with %r",
                            meta["embedder"], self._embedder_name)
            if not meta.get("dim"):
                self.backend.write_meta({"dim": str(dim), "embedder": self._embedder_name})
            self._rebuild()
            self.loaded = True

    def _rebuild(self) -> None:
        now = self._clock()
        self._table.reload([e for e in self.backend.load_all() if not e.expired(now)])

    def _apply(self, sync: Sync) -> None:
        if sync.reset:
            self._rebuild()
            return
        if sync.deletes:
            self._table.remove(sync.deletes)
        now = self._clock()
        self._table.add([e for e in sync.upserts if not e.expired(now)])
        if sync.upserts:
            victims = self._table.enforce_budget()
            if victims:
                self.backend.delete(victims)

    def sync(self) -> None:
        """Apply the inserts and deletes other processes made since the last poll."""
        self.ensure_loaded()
        with self._lock:
            self._apply(self.backend.poll())
            self._last = time.monotonic()

    def maybe_sync(self) -> None:
        """:meth:`sync` when ``interval_s`` has passed since the last one (never for an
        in-memory store)."""
        if isinstance(self.backend, MemoryEntryStore):
            return
        if time.monotonic() - self._last >= self.interval_s:
            self.sync()

    def clear(self) -> None:
        """Drop every entry of the store (other processes see the clear) and of the table."""
        self.backend.clear()
        with self._lock:
            self._table.clear()
            if hasattr(self.backend, "poll"):
                self.backend.poll()  # consume our own clear
