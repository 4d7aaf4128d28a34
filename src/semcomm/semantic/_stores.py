"""Entry stores: where entries live, and how each process learns what others changed.

Every store keeps the rows of :mod:`._entry` and a change log, so that each process's
in-process vector index can follow inserts and deletes made by other processes:

- :class:`MemoryEntryStore`: a dict, one process.
- :class:`SQLiteEntryStore`: one SQLite file in WAL mode; a ``changes`` table (autoincrement
  sequence) is the change log. Several processes may open the same file.
- :class:`RedisEntryStore` (in :mod:`._redis`): a Redis hash per entry plus a stream.

``poll()`` returns a :class:`Sync`: the entries upserted and ids deleted by others since the
last poll, or ``reset=True`` when the log no longer reaches back that far (trimmed, cleared, or
after an outage) and the caller must rebuild from ``load_all()``.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import CorruptEntryError, StoreError
from ._entry import ENTRY_FORMAT_VERSION, Entry, Row, decode_entry, encode_entry

__all__ = ["EntryStore", "MemoryEntryStore", "SQLiteEntryStore", "Sync", "keep_valid"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Sync:
    """What changed elsewhere since the last ``poll()``."""

    reset: bool = False  # True: drop the index and rebuild from load_all()
    upserts: list[Entry] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)


class EntryStore(Protocol):
    """The narrow store interface the cache uses."""

    name: str
    corrupt: int  # rows rejected so far

    def read_meta(self) -> dict[str, str]: ...
    def write_meta(self, meta: dict[str, str]) -> None: ...
    def put(self, entry: Entry) -> None: ...
    def get(self, entry_id: str) -> Entry | None: ...
    def delete(self, ids: Sequence[str]) -> int: ...
    def load_all(self) -> Iterator[Entry]: ...
    def poll(self) -> Sync: ...
    def clear(self) -> None: ...
    def close(self) -> None: ...
    def ping(self) -> bool | None:
        """One health probe of a remote backend (Redis: PING); None: nothing to probe."""
        ...


def keep_valid(store: EntryStore, decoded: Iterable[tuple[str, Entry | None]]) -> list[Entry]:
    """The entries of ``decoded`` (``(id, entry or None)`` pairs) that decoded.

    The ids that did not (corrupt, already logged by the decoder) are deleted from ``store``
    in one call once ``decoded`` is exhausted.
    """
    out: list[Entry] = []
    bad: list[str] = []
    for entry_id, e in decoded:
        if e is None:
            bad.append(entry_id)
        else:
            out.append(e)
    if bad:
        store.delete(bad)
    return out


class MemoryEntryStore:
    """In-process dict of entries; nothing to sync."""

    name = "memory"

    def __init__(self) -> None:
        self._rows: dict[str, Entry] = {}
        self._meta: dict[str, str] = {}
        self.corrupt = 0

    def read_meta(self) -> dict[str, str]:
        return dict(self._meta)

    def write_meta(self, meta: dict[str, str]) -> None:
        self._meta.update(meta)

    def put(self, entry: Entry) -> None:
        self._rows[entry.id] = entry

    def get(self, entry_id: str) -> Entry | None:
        return self._rows.get(entry_id)

    def delete(self, ids: Sequence[str]) -> int:
        return sum(self._rows.pop(i, None) is not None for i in ids)

    def load_all(self) -> Iterator[Entry]:
        return iter(list(self._rows.values()))

    def poll(self) -> Sync:
        return Sync()

    def clear(self) -> None:
        self._rows.clear()

    def ping(self) -> None:
        return None  # in-process: nothing to probe

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    id TEXT PRIMARY KEY,
    version INTEGER NOT NULL,   -- entry format version (semcomm.semantic._entry)
    header TEXT NOT NULL,       -- canonical JSON header
    vector BLOB NOT NULL,       -- dim x float32 little-endian
    answer TEXT NOT NULL,
    checksum TEXT NOT NULL      -- XXH3-128 over header, vector, answer
);
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op TEXT NOT NULL,           -- 'put' | 'del' | 'clear'
    id TEXT NOT NULL,
    origin TEXT NOT NULL        -- writer instance id (a process skips its own changes)
);
"""

_KEEP_CHANGES = 50_000  # change-log rows kept; a reader further behind does a full reload


class SQLiteEntryStore:
    """Entries in one SQLite file (WAL; several processes; see the module docstring)."""

    name = "sqlite"

    def __init__(self, path: str | os.PathLike[str], *, timeout_s: float = 10.0,
                 sealer: Any = None) -> None:
        self.sealer = sealer  # semcomm.security.EntrySealer: rows sealed at rest (None: plain)
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "semantic.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._origin = uuid.uuid4().hex
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(str(self.path), timeout=timeout_s,
                                       check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open semantic cache {self.path}: {exc}") from exc
        self.corrupt = 0
        self._puts = 0
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()
        self._seen = int(row[0])

    # -- meta -------------------------------------------------------------------------------
    def read_meta(self) -> dict[str, str]:
        with self._lock:
            return dict(self._db.execute("SELECT key, value FROM meta").fetchall())

    def write_meta(self, meta: dict[str, str]) -> None:
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                                 list(meta.items()))

    # -- rows -------------------------------------------------------------------------------
    def _log(self, op: str, ids: Sequence[str]) -> None:
        self._db.executemany("INSERT INTO changes(op, id, origin) VALUES (?, ?, ?)",
                             [(op, i, self._origin) for i in ids])

    def put(self, entry: Entry) -> None:
        self.put_many([entry])

    def put_many(self, entries: Sequence[Entry]) -> None:
        rows = [encode_entry(e if self.sealer is None else self.sealer.seal_entry(e))
                for e in entries]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT OR REPLACE INTO entries(id, version, header, vector, answer, checksum)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    [(r.id, ENTRY_FORMAT_VERSION, r.header, r.vector, r.answer, r.checksum)
                     for r in rows])
                self._log("put", [r.id for r in rows])
                self._puts += len(rows)
                if self._puts >= 1000:
                    self._puts = 0
                    self._db.execute(
                        "DELETE FROM changes WHERE seq < (SELECT MAX(seq) FROM changes) - ?",
                        (_KEEP_CHANGES,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _decode(self, r: tuple[str, int, str, bytes, str, str]) -> Entry | None:
        try:
            if r[1] != ENTRY_FORMAT_VERSION:
                raise CorruptEntryError(f"entry {r[0]!r}: unknown format version {r[1]!r}")
            e = decode_entry(Row(r[0], r[2], bytes(r[3]), r[4], r[5]))
            return e if self.sealer is None else self.sealer.open_entry(e)
        except (CorruptEntryError, KeyError, TypeError, ValueError) as exc:
            self.corrupt += 1
            log.warning("semantic cache %s: rejecting corrupt entry: %s", self.path, exc)
            return None

    def get(self, entry_id: str) -> Entry | None:
        with self._lock:
            r = self._db.execute(
                "SELECT id, version, header, vector, answer, checksum FROM entries WHERE id = ?",
                (entry_id,)).fetchone()
        if r is None:
            return None
        e = self._decode(r)
        if e is None:
            self.delete([entry_id])
        return e

    def _get_many(self, ids: Sequence[str]) -> list[Entry]:
        def rows() -> Iterator[Any]:
            for s in range(0, len(ids), 500):
                part = list(ids[s : s + 500])
                q = ",".join("?" * len(part))
                with self._lock:
                    fetched = self._db.execute(
                        "SELECT id, version, header, vector, answer, checksum FROM entries "
                        f"WHERE id IN ({q})", part).fetchall()
                yield from fetched
        return keep_valid(self, ((r[0], self._decode(r)) for r in rows()))

    def delete(self, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                n = 0
                for i in ids:
                    n += self._db.execute("DELETE FROM entries WHERE id = ?", (i,)).rowcount
                self._log("del", list(ids))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return n

    def load_all(self) -> Iterator[Entry]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, version, header, vector, answer, checksum FROM entries").fetchall()
        return iter(keep_valid(self, ((r[0], self._decode(r)) for r in rows)))

    def poll(self) -> Sync:
        with self._lock:
            (top,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()
            if top == self._seen:
                return Sync()
            (low,) = self._db.execute("SELECT COALESCE(MIN(seq), 0) FROM changes").fetchone()
            rows = self._db.execute(
                "SELECT seq, op, id, origin FROM changes WHERE seq > ? ORDER BY seq",
                (self._seen,)).fetchall()
            gap = low > self._seen + 1
            self._seen = int(top)
        if gap or any(op == "clear" and origin != self._origin for _, op, _, origin in rows):
            return Sync(reset=True)
        last: dict[str, str] = {}
        for _, op, i, origin in rows:
            if origin != self._origin:
                last[i] = op
            else:
                last.pop(i, None)
        puts = [i for i, op in last.items() if op == "put"]
        dels = [i for i, op in last.items() if op == "del"]
        ups = self._get_many(puts) if puts else []
        found = {e.id for e in ups}
        dels.extend(i for i in puts if i not in found)  # overwritten then deleted meanwhile
        return Sync(upserts=ups, deletes=dels)

    def clear(self) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM entries")
                self._log("clear", [""])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def ping(self) -> None:
        return None  # a local file: nothing to probe

    def close(self) -> None:
        with self._lock:
            self._db.close()
