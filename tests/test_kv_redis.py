"""RedisStore against a real redis-server: corruption, sharing, outages, TTL, budgets."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from semcomm.errors import BackendDownWarning, ConfigError
from semcomm.kv import RedisStore, StoreEvent

from ._kvchunks import chain, singles
from ._redis import RedisServer

ROOT = Path(__file__).resolve().parents[1]


def run_worker(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "tests._kv_worker", *args], cwd=ROOT,
                         capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode()


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A TCP port that accepts connections but never answers (a hung server)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
    srv.close()


@pytest.mark.parametrize("damage", ["garbage", "bitflip", "truncate", "swap"])
def test_corrupt_values_are_rejected_counted_and_deleted(
    redis_url: str, raw: redis.Redis, damage: str
) -> None:
    (k0, v0), (k1, v1) = chain(2)
    store = RedisStore(redis_url)
    store.put(k0, v0)
    store.put(k1, v1)
    evicts: list[StoreEvent] = []
    store.subscribe(lambda e: evicts.append(e) if e.kind == "evict" else None)
    name = "semcomm:kv:" + k0.hex()
    bad = {"garbage": b"not a chunk at all", "truncate": v0[:-9], "swap": v1,
           "bitflip": v0[:-30] + bytes([v0[-30] ^ 1]) + v0[-29:]}[damage]
    raw.set(name, bad)
    assert store.get(k0) is None
    assert raw.exists(name) == 0
    st = store.stats()
    assert st.corrupt == 1 and st.misses == 1 and st.entries == 1
    assert [(e.key, e.reason) for e in evicts] == [(k0, "corrupt")]
    assert store.get(k1) == v1


def test_two_processes_share_entries(redis_url: str) -> None:
    store = RedisStore(redis_url)
    run_worker("redis", redis_url, "5", "6")  # another process writes ...
    mine = chain(6, seed=5)
    assert store.lookup([k for k, _ in mine]).num_chunks == 6
    assert all(store.get(k) == v for k, v in mine)  # ... this one reads, validated
    for k, v in chain(4, seed=6):
        store.put(k, v)
    assert run_worker("redis-read", redis_url, "6", "4").strip() == "4"  # and the reverse


def test_prefixes_are_isolated(redis_url: str) -> None:
    a = RedisStore(redis_url, prefix="a:")
    b = RedisStore(redis_url, prefix="b:")
    (k, v), = chain(1)
    a.put(k, v)
    assert a.get(k) == v and b.get(k) is None and list(b.scan()) == []


def test_outage_gives_misses_one_warning_and_recovers(own_redis: RedisServer) -> None:
    c = chain(3)
    keys = [k for k, _ in c]
    store = RedisStore(own_redis.url, retry_interval_s=0.05)
    for k, v in c[:2]:
        store.put(k, v)
    assert store.lookup(keys).num_chunks == 2
    own_redis.stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert store.get(keys[0]) is None
            assert store.fetch(keys[0]) is None
            assert store.lookup(keys).num_chunks == 0
            assert store.contains(keys[0]) is False
            assert store.put(*c[2]) is None
            assert store.delete(keys[1]) is False
            assert list(store.scan()) == []
            time.sleep(0.06)  # past the fail-fast window: real retries, still one warning
    down = [w for w in caught if issubclass(w.category, BackendDownWarning)]
    assert len(down) == 1, [str(w.message) for w in down]
    st = store.stats()
    assert st.outages == 1 and st.errors >= 9 and st.hits == 0 and not store.available
    own_redis.start()  # same port, empty (no persistence): the store must find it again
    time.sleep(0.06)
    store.put(*c[0])
    assert store.get(keys[0]) == c[0][1] and store.available
    assert store.stats().outages == 1
    own_redis.stop()  # a second outage warns once more
    with pytest.warns(BackendDownWarning):
        assert store.get(keys[0]) is None
    assert store.stats().outages == 2


def test_hung_server_times_out_quickly(blackhole: str) -> None:
    store = RedisStore(blackhole, timeout_s=0.2)
    (k, v), = chain(1)
    t0 = time.monotonic()
    with pytest.warns(BackendDownWarning):
        assert store.get(k) is None
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    for _ in range(20):  # fail fast inside the retry window
        store.put(k, v)
    assert time.monotonic() - t0 < 0.5
    assert store.stats().outages == 1


def test_ttl_expires_entries(redis_url: str) -> None:
    (k, v), = chain(1)
    store = RedisStore(redis_url, ttl_s=0.15)
    store.put(k, v)
    assert store.get(k) == v
    time.sleep(0.3)
    assert store.get(k) is None and not store.contains(k)


def test_budget_lru_and_chain_order(redis_url: str) -> None:
    c = chain(3)
    o = singles(3, seed=4)
    size = max(len(v) for _, v in c + o)
    store = RedisStore(redis_url, capacity_bytes=4 * size)
    other_client = RedisStore(redis_url, capacity_bytes=4 * size)  # another worker
    evicted: list[bytes] = []
    store.subscribe(lambda e: evicted.append(e.key) if e.kind == "evict" else None)
    for k, v in c:
        store.put(k, v)
    other_client.put(*o[0])  # full: 4 entries
    assert store.get(c[0][0]) is not None  # reading the prefix refreshes its chain
    store.put(*o[1])  # evicts the chain's tail (2), not chunk 0
    store.put(*o[2])  # then chunk 1: the chain's tail now, last used before o[0]
    st = store.stats()
    assert st.bytes <= 4 * size and st.entries == 4
    assert evicted == [c[2][0], c[1][0]]
    assert store.lookup([k for k, _ in c]).num_chunks == 1
    assert other_client.contains(o[0][0])
    big = chain(1, seed=77, payload=4 * size)[0]
    store.put(*big)
    assert not store.contains(big[0]) and store.stats().rejected == 1


def test_bad_configuration_is_refused(redis_url: str) -> None:
    with pytest.raises(ConfigError, match="url"):
        RedisStore("http://localhost:6379")
    with pytest.raises(ConfigError, match="ttl_s"):
        RedisStore(redis_url, ttl_s=0)
    with pytest.raises(ValueError, match="capacity_bytes"):
        RedisStore(redis_url, capacity_bytes=-1)


def test_fetch_many_with_budget_is_one_batch_and_validates(redis_url: str, raw: redis.Redis) -> None:
    c = chain(3)
    store = RedisStore(redis_url, capacity_bytes=1 << 20)
    for k, v in c:
        store.put(k, v)
    raw.set("semcomm:kv:" + c[1][0].hex(), b"garbage")
    got = store.fetch_many([k for k, _ in c])
    assert [f is not None for f in got] == [True, False, True]
    assert got[0] is not None and got[0].value == c[0][1]
    assert store.stats().corrupt == 1 and not store.contains(c[1][0])
