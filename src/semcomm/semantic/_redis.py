"""Redis entry store: entries shared by every process, each keeping its own vector index.

Layout under ``prefix`` (default ``semcomm:sem``):

- ``{prefix}:e:{id}``: a hash ``{header, vector, answer, checksum}`` (the row of
  :mod:`._entry`), with a Redis expiry when the entry has a TTL;
- ``{prefix}:log``: a stream of changes ``{n, op, id, origin}``, trimmed to about
  ``keep_log`` items; ``n`` comes from ``{prefix}:ver``, an INCR counter written in the same
  MULTI as the change, so a reader that sees a gap in ``n`` knows it missed changes (trimmed)
  and rebuilds from a SCAN;
- ``{prefix}:meta``: the cache's embedder name and dimension.

Redis 7.0 from Debian has no search module, so vectors are searched in-process.

Outage semantics: every operation catches connection errors. While Redis is down, lookups
miss, stores are dropped (counted in ``errors``), and a :class:`BackendDownWarning` is emitted
once per outage. The first successful call after an outage makes ``poll()`` return
``reset=True`` so the index is rebuilt (deletes may have been missed).
"""

from __future__ import annotations

import logging
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import BackendDownWarning, CorruptEntryError, require
from ._entry import Entry, Row, decode_entry, encode_entry
from ._stores import Sync, keep_valid

__all__ = ["RedisEntryStore"]

log = logging.getLogger(__name__)


class RedisEntryStore:
    """See the module docstring."""

    name = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, prefix: str = "semcomm:sem",
                 keep_log: int = 100_000, timeout_s: float = 0.5, retry_s: float = 1.0,
                 client: Any = None, sealer: Any = None) -> None:
        self.sealer = sealer  # semcomm.security.EntrySealer: rows sealed at rest (None: plain)
        redis = require("redis", "redis")
        self._errors_t = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                          OSError)
        self._r = client or redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                 socket_connect_timeout=timeout_s)
        self.url = url
        self.prefix = prefix
        self.keep_log = keep_log
        self.retry_s = retry_s
        self._origin = uuid.uuid4().hex
        self._last_id = b"0-0"
        self._last_n = 0
        self._down_since: float | None = None
        self._need_reset = False
        self.corrupt = 0
        self.errors = 0
        try:
            self._last_n = int(self._r.get(self._k("ver")) or 0)
            last = self._r.xrevrange(self._k("log"), count=1)
            if last:
                self._last_id = last[0][0]
        except self._errors_t as exc:
            self._mark_down(exc)

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # -- availability ----------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._down_since is None

    def _mark_down(self, exc: BaseException) -> None:
        self.errors += 1
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("redis %s unavailable: %s; semantic cache lookups will miss", self.url, exc)
            warnings.warn(f"semantic cache: Redis at {self.url} is down ({exc}); serving misses",
                          BackendDownWarning, stacklevel=4)

    def ping(self) -> bool:
        """One round trip, whatever the retry back-off says: True when Redis answered (which
        ends an outage and resynchronises the index on the next poll), False while it is down."""
        try:
            self._r.ping()
        except self._errors_t as exc:
            if self._down_since is None:
                self._mark_down(exc)
            return False
        self._mark_up()
        return True

    def _may_try(self) -> bool:
        if self._down_since is None:
            return True
        return time.monotonic() - self._down_since >= self.retry_s

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.info("redis %s is back; resynchronising the semantic index", self.url)
            self._down_since = None
            self._need_reset = True

    def _call(self, fn: Any, default: Any) -> Any:
        if not self._may_try():
            return default
        try:
            out = fn()
        except self._errors_t as exc:
            if self._down_since is not None:
                self._down_since = time.monotonic()  # still down: wait retry_s again
                self.errors += 1
            else:
                self._mark_down(exc)
            return default
        self._mark_up()
        return out

    # -- meta ------------------------------------------------------------------------------
    def read_meta(self) -> dict[str, str]:
        raw = self._call(lambda: self._r.hgetall(self._k("meta")), {})
        return {k.decode(): v.decode() for k, v in raw.items()}

    def write_meta(self, meta: dict[str, str]) -> None:
        self._call(lambda: self._r.hset(self._k("meta"), mapping=meta), None)

    # -- rows ------------------------------------------------------------------------------
    def _write(self, op: str, ids: Sequence[str], rows: Sequence[Row] = (),
               expires: Sequence[float | None] = (), delete: bool = False,
               clear_keys: Sequence[bytes] = ()) -> bool:
        def run() -> bool:
            # Read n first then write in one MULTI guarded by WATCH on the counter, so n in
            # the stream is gap-free exactly when no change was trimmed.
            with self._r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(self._k("ver"))
                        n0 = int(pipe.get(self._k("ver")) or 0)
                        pipe.multi()
                        for r, exp in zip(rows, expires, strict=False):
                            key = self._k("e", r.id)
                            pipe.delete(key)
                            pipe.hset(key, mapping={"header": r.header, "vector": r.vector,
                                                    "answer": r.answer, "checksum": r.checksum})
                            if exp is not None:
                                pipe.pexpireat(key, int(exp * 1000))
                        if delete:
                            for i in ids:
                                pipe.delete(self._k("e", i))
                        for ckey in clear_keys:
                            pipe.delete(ckey)
                        for j, i in enumerate(ids):
                            pipe.xadd(self._k("log"),
                                      {"n": n0 + j + 1, "op": op, "id": i, "origin": self._origin},
                                      maxlen=self.keep_log, approximate=True)
                        pipe.set(self._k("ver"), n0 + len(ids))
                        pipe.execute()
                        return True
                    except Exception as exc:  # WatchError: another writer won; retry
                        if type(exc).__name__ != "WatchError":
                            raise
        return bool(self._call(run, False))

    def put(self, entry: Entry) -> None:
        self.put_many([entry])

    def put_many(self, entries: Sequence[Entry]) -> None:
        rows = [encode_entry(e if self.sealer is None else self.sealer.seal_entry(e))
                for e in entries]
        self._write("put", [r.id for r in rows], rows, [e.expires_at for e in entries])

    def _decode(self, entry_id: str, h: dict[bytes, bytes]) -> Entry | None:
        try:
            row = Row(entry_id, h[b"header"].decode(), h[b"vector"], h[b"answer"].decode(),
                      h[b"checksum"].decode())
            e = decode_entry(row)
            return e if self.sealer is None else self.sealer.open_entry(e)
        except (CorruptEntryError, KeyError, UnicodeError, ValueError, TypeError) as exc:
            self.corrupt += 1
            log.warning("semantic cache redis: rejecting corrupt entry %s: %s", entry_id, exc)
            return None

    def get(self, entry_id: str) -> Entry | None:
        h = self._call(lambda: self._r.hgetall(self._k("e", entry_id)), None)
        if not h:
            return None
        e = self._decode(entry_id, h)
        if e is None:
            self.delete([entry_id])
        return e

    def _get_many(self, ids: Sequence[str]) -> list[Entry]:
        def run() -> list[Any]:
            with self._r.pipeline(transaction=False) as pipe:
                for i in ids:
                    pipe.hgetall(self._k("e", i))
                return list(pipe.execute())
        res = self._call(run, None)
        if res is None:
            return []
        return keep_valid(
            self, ((i, self._decode(i, h)) for i, h in zip(ids, res, strict=True) if h))

    def delete(self, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        return len(ids) if self._write("del", list(ids), delete=True) else 0

    def _entry_keys(self) -> list[bytes]:
        return list(self._r.scan_iter(match=self._k("e", "*"), count=1000))

    def load_all(self) -> Iterator[Entry]:
        keys = self._call(self._entry_keys, None)
        if keys is None:
            return iter(())
        plen = len(self._k("e", ""))
        ids = [k.decode()[plen:] for k in keys]
        return iter(self._get_many(ids))

    def poll(self) -> Sync:
        if self._need_reset:
            self._need_reset = False
            self._resync_cursor()
            return Sync(reset=True)
        res = self._call(lambda: self._r.xread({self._k("log"): self._last_id}, count=10_000),
                         None)
        if self._need_reset:  # came back during this call
            self._need_reset = False
            self._resync_cursor()
            return Sync(reset=True)
        if not res:
            return Sync()
        items = res[0][1]
        reset = False
        last: dict[str, str] = {}
        for sid, fields in items:
            n = int(fields[b"n"])
            if n != self._last_n + 1:  # a gap: changes were trimmed before we read them
                reset = True
            self._last_n = n
            self._last_id = sid
            op = fields[b"op"].decode()
            if op == "clear" and fields[b"origin"].decode() != self._origin:
                reset = True
            if fields[b"origin"].decode() == self._origin:
                last.pop(fields[b"id"].decode(), None)
                continue
            last[fields[b"id"].decode()] = op
        if reset:
            return Sync(reset=True)
        puts = [i for i, op in last.items() if op == "put"]
        dels = [i for i, op in last.items() if op == "del"]
        ups = self._get_many(puts) if puts else []
        found = {e.id for e in ups}
        dels.extend(i for i in puts if i not in found)
        return Sync(upserts=ups, deletes=dels)

    def _resync_cursor(self) -> None:
        def run() -> None:
            self._last_n = int(self._r.get(self._k("ver")) or 0)
            last = self._r.xrevrange(self._k("log"), count=1)
            self._last_id = last[0][0] if last else b"0-0"
        self._call(run, None)

    def clear(self) -> None:
        keys = self._call(self._entry_keys, None)
        if keys is None:
            return
        self._write("clear", [""], clear_keys=keys)

    def close(self) -> None:
        try:
            self._r.close()
        except self._errors_t:  # pragma: no cover
            pass
