"""RedisStore: chunks in a real redis-server, shared by every worker that can reach it.

Server-side layout (``P`` = the key prefix, default ``semcomm:kv:``)::

    P<64 hex>   the encoded chunk (binary string; optional TTL)
    P~lru       sorted set: member = key hex, score = recency tick   } kept only with a
    P~size      hash: key hex -> encoded size                        } byte budget
    P~parent    hash: key hex -> parent key hex                      } (capacity_bytes)
    P~bytes     counter: bytes held                                  }
    P~tick      counter: recency clock shared by all clients         }

Every mutation is one Lua script, so several processes keep the bookkeeping consistent.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import (
    BackendDownWarning,
    ConfigError,
    CorruptEntryError,
    require,
)
from ._keys import ChunkKey
from ._store import (
    KEY_SIZE,
    ChunkSealer,
    ChunkStoreBase,
    Fetched,
    PrefixMatch,
    StoreStats,
    check_key,
    open_stored,
    validate_chunk,
)

__all__ = ["RedisStore"]

logger = logging.getLogger("semcomm.kv")

# chunks are megabytes: large socket reads cut the pure-Python reply parser's work ~4x
# (hiredis, in the redis extra, parses in C either way)
_READ_SIZE = 1 << 20
_MAX_CHAIN_BUMP = 64  # ancestors re-ranked per touch (a 16k-token prompt at chunk size 256)

# Shared Lua helpers. ARGV layout is fixed per script; P is the prefix.
_LUA_TOUCH = """
local function touch(P, member)
  local lru = P .. '~lru'
  local parents = P .. '~parent'
  local t = redis.call('INCR', P .. '~tick')
  redis.call('ZADD', lru, t, member)
  -- ancestors rank above their extensions: a chain is evicted from its tail inward
  local p = redis.call('HGET', parents, member)
  local n = 0
  while p and n < MAX_BUMP do
    if not redis.call('ZSCORE', lru, p) then break end
    t = redis.call('INCR', P .. '~tick')
    redis.call('ZADD', lru, t, p)
    p = redis.call('HGET', parents, p)
    n = n + 1
  end
end
local function forget(P, member)
  local size = redis.call('HGET', P .. '~size', member)
  if size then
    redis.call('DECRBY', P .. '~bytes', size)
    redis.call('HDEL', P .. '~size', member)
  end
  redis.call('ZREM', P .. '~lru', member)
  redis.call('HDEL', P .. '~parent', member)
end
""".replace("MAX_BUMP", str(_MAX_CHAIN_BUMP))

# KEYS[1] = data key. ARGV: value, ttl_ms, member, parent, capacity (-1 = untracked), P
# returns {existed (0/1), stored (0/1), evicted members...}
_LUA_PUT = _LUA_TOUCH + """
local P = ARGV[6]
local member = ARGV[3]
local cap = tonumber(ARGV[5])
local size = string.len(ARGV[1])
local existed = redis.call('EXISTS', KEYS[1])
local out = {existed, 1}
if cap >= 0 then
  if size > cap then
    out[2] = 0
    return out
  end
  local old = redis.call('HGET', P .. '~size', member)
  local cur = tonumber(redis.call('GET', P .. '~bytes') or '0')
  if old then cur = cur - tonumber(old) end
  while cur + size > cap do
    local v = redis.call('ZRANGE', P .. '~lru', 0, 1)
    local victim = v[1]
    if victim == member then victim = v[2] end
    if not victim then break end
    local s = redis.call('HGET', P .. '~size', victim)
    if s then cur = cur - tonumber(s) end
    redis.call('DEL', P .. victim)
    forget(P, victim)
    table.insert(out, victim)
  end
  forget(P, member)
  redis.call('HSET', P .. '~size', member, size)
  redis.call('INCRBY', P .. '~bytes', size)
  if ARGV[4] ~= '' and ARGV[4] ~= member then redis.call('HSET', P .. '~parent', member, ARGV[4]) end
  touch(P, member)
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return out
"""

# KEYS[1] = data key. ARGV: member, P.  Returns the value (or nil) and refreshes recency.
_LUA_GET = _LUA_TOUCH + """
local v = redis.call('GET', KEYS[1])
if v and redis.call('ZSCORE', ARGV[2] .. '~lru', ARGV[1]) then touch(ARGV[2], ARGV[1]) end
return v
"""

# KEYS[1] = data key. ARGV: member, P.  Returns 1 if the key existed.
_LUA_DELETE = _LUA_TOUCH + """
local n = redis.call('DEL', KEYS[1])
forget(ARGV[2], ARGV[1])
return n
"""


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisStore(ChunkStoreBase):
    """Chunks in redis-server (binary values), shared by all processes that use the same prefix.

    * ``get`` verifies header, key and checksum; a bad value is counted in ``stats().corrupt``,
      deleted and reported as a miss.
    * ``ttl_s`` gives every chunk an expiry (set on write, not refreshed by reads).
    * ``capacity_bytes`` turns on server-side LRU bookkeeping (Lua scripts, consistent across
      processes): chain tails go before their prefixes. Without it the server's own
      ``maxmemory`` policy bounds memory.
    * **Outages never raise.** A refused connection or a timeout (socket timeouts of
      ``timeout_s``, 0.5 s by default) turns ``get``/``fetch`` into misses, ``put`` into a no-op
      and ``contains``/``lookup`` into "absent". Each outage logs one warning and emits one
      :class:`~semcomm.errors.BackendDownWarning` (not one per call) and counts in
      ``stats().outages``; calls fail fast for ``retry_interval_s`` after a failure, then the
      store retries and recovers by itself when Redis is back.
    """

    name = "redis"
    verified_reads = True  # every value read is checked (checksum, key) before it is served

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: float | None = None,
        prefix: str = "semcomm:kv:",
        capacity_bytes: int | None = None,
        *,
        name: str = "redis",
        timeout_s: float = 0.5,
        retry_interval_s: float = 0.5,
        sealer: ChunkSealer | None = None,
    ):
        super().__init__()
        self._redis = require("redis", "redis")
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"RedisStore url must start with redis://, rediss:// or unix://, "
                              f"got {url!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"RedisStore ttl_s must be positive or None, got {ttl_s!r}")
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
                raise TypeError("capacity_bytes must be an int or None")
            if capacity_bytes < 0:
                raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if not prefix or "~" in prefix:
            raise ConfigError(f"RedisStore prefix must be non-empty and without '~', got {prefix!r}")
        if not timeout_s > 0:
            raise ConfigError(f"RedisStore timeout_s must be positive, got {timeout_s!r}")
        self.name = name
        self.url = url
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.capacity_bytes = capacity_bytes
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.sealer = sealer
        self._ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        self._cap = -1 if capacity_bytes is None else capacity_bytes

        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # one immediate retry: a pooled connection broken by a server restart is replaced
        # without reporting an outage; a dead server still fails within ~2 x timeout_s
        self._client = self._redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1), health_check_interval=0,
            socket_read_size=_READ_SIZE,
        )
        self._put_script = self._client.register_script(_LUA_PUT)
        self._get_script = self._client.register_script(_LUA_GET)
        self._del_script = self._client.register_script(_LUA_DELETE)

        self._state_lock = threading.Lock()
        self._down = False  # inside an outage (warned once)
        self._down_until = 0.0  # monotonic time before which calls fail fast
        self._hits = self._misses = self._puts = self._rejected = 0
        self._evictions = self._corrupt = self._errors = self._outages = 0

    # ---- naming --------------------------------------------------------------------------
    def _rkey(self, key: ChunkKey) -> str:
        return self.prefix + key.hex()

    # ---- outage handling ---------------------------------------------------------------------
    def _skip(self) -> bool:
        """True while the circuit is open (recent failure): fail fast without a round trip."""
        if self._down and time.monotonic() < self._down_until:
            with self._state_lock:
                self._errors += 1
            return True
        return False

    def _failed(self, exc: BaseException) -> None:
        conn_errors = (self._redis.exceptions.ConnectionError, self._redis.exceptions.TimeoutError,
                       OSError)
        with self._state_lock:
            self._errors += 1
            if not isinstance(exc, conn_errors):
                logger.warning("RedisStore %s: command failed: %s", self.url, exc)
                return
            self._down_until = time.monotonic() + self.retry_interval_s
            if self._down:
                return
            self._down = True
            self._outages += 1
        logger.warning("RedisStore %s is unreachable (%s); serving misses until it is back",
                       self.url, exc)
        warnings.warn(f"Redis at {self.url} is unreachable ({exc}); KV lookups degrade to misses",
                      BackendDownWarning, stacklevel=4)

    def _ok(self) -> None:
        if self._down:
            with self._state_lock:
                was, self._down = self._down, False
            if was:
                logger.warning("RedisStore %s is reachable again", self.url)

    def _run(self, fn: Any, default: Any) -> Any:
        if self._skip():
            return default
        try:
            out = fn()
        except (self._redis.exceptions.RedisError, OSError) as exc:
            self._failed(exc)
            return default
        self._ok()
        return out

    # ---- result handling ---------------------------------------------------------------------
    def _after_get(self, key: ChunkKey, raw: Any) -> bytes | None:
        if raw is None:
            with self._state_lock:
                self._misses += 1
            return None
        data = bytes(raw)
        try:
            value, _ = open_stored(key, data, self.sealer)
        except CorruptEntryError as exc:
            logger.warning("RedisStore: dropping corrupt value %s: %s", self._rkey(key), exc)
            self._run(lambda: self._del_script(keys=[self._rkey(key)],
                                               args=[key.hex(), self.prefix]), 0)
            with self._state_lock:
                self._corrupt += 1
                self._misses += 1
            self._emit("evict", key, "corrupt")
            return None
        with self._state_lock:
            self._hits += 1
        return value

    def _put_args(self, key: ChunkKey, value: bytes) -> tuple[list[str], list[Any]]:
        value, parent = validate_chunk(key, value)
        if self.sealer is not None:
            value = self.sealer.seal(value)
        return [self._rkey(key)], [value, self._ttl_ms, key.hex(),
                                   "" if parent is None else parent.hex(), self._cap, self.prefix]

    def _after_put(self, key: ChunkKey, out: Any) -> None:
        if out is None:  # backend down: a no-op
            return
        existed, stored, *evicted = out
        with self._state_lock:
            if int(stored):
                self._puts += 1
            else:
                self._rejected += 1
            self._evictions += len(evicted)
        for m in evicted:
            try:
                victim = ChunkKey(bytes.fromhex(m.decode() if isinstance(m, bytes) else m))
            except ValueError:
                continue
            self._emit("evict", victim, "evict")
        if int(stored) and not int(existed):
            self._emit("store", key, "put")

    @staticmethod
    def _prefix_of(flags: Sequence[Any]) -> int:
        n = 0
        for f in flags:
            if not int(f):
                break
            n += 1
        return n

    # ---- primitives -------------------------------------------------------------------------
    def get(self, key: ChunkKey) -> bytes | None:
        key = check_key(key)
        if self._cap >= 0:
            raw = self._run(lambda: self._get_script(keys=[self._rkey(key)],
                                                     args=[key.hex(), self.prefix]), None)
        else:
            raw = self._run(lambda: self._client.get(self._rkey(key)), None)
        return self._after_get(key, raw)

    def fetch_many(self, keys: Sequence[ChunkKey]) -> list[Fetched | None]:
        """Every key's validated chunk in one pipelined round trip (all None while down)."""
        ks = [check_key(k) for k in keys]
        if not ks:
            return []

        def go() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in ks:
                if self._cap >= 0:
                    self._get_script(keys=[self._rkey(k)], args=[k.hex(), self.prefix],
                                     client=pipe)
                else:
                    pipe.get(self._rkey(k))
            return pipe.execute()  # type: ignore[no-any-return]

        raws = self._run(go, None) or [None] * len(ks)
        out: list[Fetched | None] = []
        for k, raw in zip(ks, raws):
            value = self._after_get(k, raw)
            out.append(None if value is None else Fetched(value, self.name))
        return out

    def put(self, key: ChunkKey, value: bytes) -> None:
        key = check_key(key)
        keys, args = self._put_args(key, value)
        self._after_put(key, self._run(lambda: self._put_script(keys=keys, args=args), None))

    def contains(self, key: ChunkKey) -> bool:
        key = check_key(key)
        return bool(self._run(lambda: self._client.exists(self._rkey(key)), 0))

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key in one pipelined round trip (all False while Redis is down)."""
        ks = [check_key(k) for k in keys]
        if not ks:
            return []

        def go() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in ks:
                pipe.exists(self._rkey(k))
            return pipe.execute()  # type: ignore[no-any-return]

        flags = self._run(go, None)
        return [False] * len(ks) if flags is None else [bool(int(f)) for f in flags]

    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixMatch:
        n = self._prefix_of(self.contains_many(keys))
        return PrefixMatch(n, (self.name,) * n)

    def delete(self, key: ChunkKey) -> bool:
        key = check_key(key)
        n = self._run(lambda: self._del_script(keys=[self._rkey(key)],
                                               args=[key.hex(), self.prefix]), 0)
        if int(n):
            self._emit("evict", key, "delete")
        return bool(int(n))

    def _decode_member(self, raw: bytes) -> ChunkKey | None:
        rest = raw[len(self.prefix.encode()):]
        if len(rest) != 2 * KEY_SIZE:
            return None
        try:
            return ChunkKey(bytes.fromhex(rest.decode("ascii")))
        except (ValueError, UnicodeDecodeError):
            return None

    def scan(self) -> Iterator[ChunkKey]:
        """Keys of every chunk under the prefix (a snapshot; empty while Redis is down)."""
        match = _glob_escape(self.prefix) + "*"

        def go() -> list[ChunkKey]:
            out: list[ChunkKey] = []
            for raw in self._client.scan_iter(match=match, count=1000):
                k = self._decode_member(raw)
                if k is not None:
                    out.append(k)
            return out

        return iter(self._run(go, []))

    def clear(self) -> None:
        """Delete every chunk and the bookkeeping under this prefix."""
        for key in list(self.scan()):
            self.delete(key)
        self._run(lambda: self._client.delete(*[self.prefix + s for s in
                                                ("~lru", "~size", "~parent", "~bytes", "~tick")]), 0)

    def stats(self) -> StoreStats:
        """Counters of this client; entries/bytes as the server holds them now (0 when down)."""

        def tracked() -> tuple[int, int]:
            pipe = self._client.pipeline(transaction=False)
            pipe.zcard(self.prefix + "~lru")
            pipe.get(self.prefix + "~bytes")
            n, b = pipe.execute()
            return int(n), int(b or 0)

        def untracked() -> tuple[int, int]:
            keys = list(self._client.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000))
            keys = [k for k in keys if self._decode_member(k) is not None]
            total = 0
            for i in range(0, len(keys), 1000):
                pipe = self._client.pipeline(transaction=False)
                for k in keys[i : i + 1000]:
                    pipe.strlen(k)
                total += sum(int(x) for x in pipe.execute())
            return len(keys), total

        entries, nbytes = self._run(tracked if self._cap >= 0 else untracked, (0, 0))
        with self._state_lock:
            return StoreStats(
                name=self.name, entries=entries, bytes=nbytes,
                capacity_bytes=self.capacity_bytes, hits=self._hits, misses=self._misses,
                puts=self._puts, rejected=self._rejected, evictions=self._evictions,
                corrupt=self._corrupt, errors=self._errors, outages=self._outages,
            )

    @property
    def available(self) -> bool:
        """Whether the last round trip succeeded (False inside an outage)."""
        return not self._down

    def ping(self) -> bool:
        """One round trip; True if Redis answered (also ends an outage). The server's health
        probe (``ChunkStore.ping``: None from stores without a backend to probe)."""
        return bool(self._run(self._client.ping, False))

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r}, ttl_s={self.ttl_s})"
