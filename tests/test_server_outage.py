"""A Redis outage under a live server is visible: ``/health`` says ``degraded`` and names the
Redis KV tier and the Redis semantic store, the ``*_backend_up`` gauges read 0 for as long as
it lasts (no flapping while requests keep being served), and both come back once Redis does."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from semcomm.errors import BackendDownWarning

from ._redis import RedisServer, running_redis
from .test_server_support import ADMIN_KEY, TENANTS, LiveServer, live_server, server_config

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[LiveServer]:
    cfg = server_config(Path(tmp_path_factory.mktemp("outage")), health_probe_s=0.2)
    cfg.kv.tiers = ["memory", "redis"]
    cfg.kv.redis_url = redis.url
    cfg.semantic.backend = "redis"
    cfg.semantic.redis_url = redis.url
    with live_server(cfg) as srv:
        yield srv


def _health(srv: LiveServer) -> dict[str, Any]:
    return dict(httpx.get(f"{srv.url}/health", headers=ADMIN, timeout=30).json())


def _gauges(srv: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{srv.url}/metrics", headers=ADMIN, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("semcomm_kv_backend_up", "semcomm_semantic_backend_up")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _until(cond: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_a_redis_outage_shows_as_degraded_until_it_ends(server: LiveServer,
                                                         redis: RedisServer) -> None:
    kv_gauge = 'semcomm_kv_backend_up{tier="redis"}'
    sem_gauge = "semcomm_semantic_backend_up"
    h = _health(server)
    assert h["status"] == "ok" and h["down"] == [], h["down"]
    assert h["kv"]["tiers"]["redis"]["up"] and h["semantic"]["up"]
    assert _gauges(server) == {kv_gauge: 1.0, sem_gauge: 1.0}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendDownWarning)  # loud in the log; asserted below
        redis.stop()
        try:
            assert _until(lambda: _health(server)["status"] == "degraded", 30)
            # for as long as Redis is down: degraded every time, with requests served meanwhile
            with server.client(TENANTS["acme"]) as c:
                for i in range(8):
                    r = c.post("/v1/chat/completions", json={
                        "model": "tiny", "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"outage question {i % 3}"}]})
                    assert r.status_code == 200, r.text
                    h = _health(server)
                    assert h["status"] == "degraded", h
                    assert {"kv:redis", "semantic:redis"} <= set(h["down"]), h["down"]
                    assert not h["kv"]["tiers"]["redis"]["up"] and not h["semantic"]["up"]
                    time.sleep(0.1)
            assert _gauges(server) == {kv_gauge: 0.0, sem_gauge: 0.0}
            # without the admin key: the state, and nothing about which backend
            assert httpx.get(f"{server.url}/health").json() == {"status": "degraded"}
        finally:
            redis.start()
        assert _until(lambda: _health(server)["status"] == "ok", 30)
    h = _health(server)
    assert h["down"] == [] and h["kv"]["tiers"]["redis"]["up"] and h["semantic"]["up"]
    assert _gauges(server) == {kv_gauge: 1.0, sem_gauge: 1.0}
