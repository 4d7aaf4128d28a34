"""`serve --ray`: two local Ray Serve replicas behind semcomm's replica router, KV shared in Redis."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from semcomm.server import create_app, load_config

pytestmark = [pytest.mark.ray, pytest.mark.redis]

LONG = "Order log: " + " ".join(f"item-{i} shipped;" for i in range(30))


@pytest.fixture(scope="module")
def ray_gateway(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from ray import serve

    from semcomm.server._ray import deploy_models
    from semcomm.server._wiring import build_gateway

    tmp = tmp_path_factory.mktemp("ray")
    cfg = load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp), "max_tokens_limit": 8},
        "models": {"tiny": {"path": "tiny"}},
        "kv": {"tiers": ["memory"], "chunk_size": 32}, "semantic": {"enabled": False},
        "ray": {"replicas": 2, "redis_url": redis_server.url, "num_cpus_per_replica": 0.1},
    })
    redis_server.flush()
    mp = pytest.MonkeyPatch()
    # the gateway, the replicas and this process share one server secret (salts, chunk MACs)
    mp.setenv("SEMCOMM_SECRET", "5e" * 32)
    mp.setenv("SEMCOMM_HOME", str(tmp / "home"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    try:
        gw = build_gateway(cfg, backends=deploy_models(cfg))
        app = create_app(gateway=gw)
        asyncio.run(gw.startup())
        yield cfg, app
    finally:
        serve.shutdown()
        ray.shutdown()
        mp.undo()


async def _chat(app: Any, messages: list[dict[str, str]]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 timeout=120) as c:
        r = await c.post("/v1/chat/completions",
                         json={"model": "tiny", "max_tokens": 3, "messages": messages})
        assert r.status_code == 200, r.text
        return r


def test_replicas_spread_load_and_keep_conversations_home(ray_gateway: Any) -> None:
    _, app = ray_gateway

    async def main() -> tuple[list[str], list[str]]:
        spread = await asyncio.gather(*[
            _chat(app, [{"role": "user", "content": f"distinct question {i} " * 8}])
            for i in range(8)])
        convo = [{"role": "system", "content": LONG}, {"role": "user", "content": "first"}]
        homes = []
        for turn in range(3):
            r = await _chat(app, convo)
            homes.append(r.json()["semcomm"]["replica"])
            convo = [*convo, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": f"follow-up {turn}"}]
        return [r.json()["semcomm"]["replica"] for r in spread], homes

    spread, homes = asyncio.run(main())
    assert len(set(spread)) == 2  # both replicas served
    assert len(set(homes)) == 1  # the conversation stayed where its prefix is


def test_kv_prefix_is_shared_through_redis(ray_gateway: Any) -> None:
    """A prefix computed by a Serve replica is a hit for another engine process via Redis."""
    cfg, app = ray_gateway
    from semcomm.server._ray import EngineReplica, _shared_kv

    msgs = [{"role": "system", "content": LONG.replace("Order", "Warehouse").replace("shipped", "stored")},
            {"role": "user", "content": "q"}]
    first = asyncio.run(_chat(app, msgs))
    assert first.headers["x-semcomm-hits"] == "none"
    other = EngineReplica("tiny", _shared_kv(cfg).model_dump_json())  # another engine process
    out = asyncio.run(other.generate({"messages": msgs, "max_tokens": 3}))
    assert out["hit_tokens"] >= 64
    assert out["text"] == first.json()["choices"][0]["message"]["content"]


def test_ray_needs_a_shared_redis(tmp_path: Path) -> None:
    from semcomm.errors import ConfigError
    from semcomm.server._ray import _shared_kv

    cfg = load_config(None, environ={}, overrides={"server": {"state_dir": str(tmp_path)}})
    with pytest.raises(ConfigError, match="redis_url"):
        _shared_kv(cfg)


def test_a_replica_error_reaches_the_client_as_one_clean_line(ray_gateway: Any) -> None:
    """The same typed error and message as the single-process path, never a traceback."""
    _, app = ray_gateway

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as c:
            return await c.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 3,
                "messages": [{"role": "user", "content": "x" * 5000}]})

    r = asyncio.run(main())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert re.fullmatch(r"the prompt has \d+ tokens; model 'tiny' accepts at most 4095 prompt "
                        r"tokens", err["message"]), err["message"]


def test_the_router_hashes_under_the_replicas_namespace(ray_gateway: Any) -> None:
    """The gateway sends the tenant's KV namespace: the same digest the replicas store under."""
    from semcomm.security import TenantContext

    _, app = ray_gateway
    backend = app.state.gateway.backends["tiny"]
    stats = backend.handle.stats.remote().result()
    assert backend.namespace_hex(TenantContext.public()) == stats["namespace"]
    other = TenantContext("acme", "ab" * 32, False)
    assert backend.namespace_hex(other) not in ("", stats["namespace"])


def test_a_ray_stream_joins_to_the_answer(ray_gateway: Any) -> None:
    """The stream contract holds for Ray replicas too, stop strings included."""
    _, app = ray_gateway
    body = {"model": "tiny", "max_tokens": 8, "stop": ["\n\n\n"],
            "messages": [{"role": "user", "content": "stream contract over Ray"}]}

    async def main() -> tuple[str, str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as c:
            plain = await c.post("/v1/chat/completions", json=body)
            streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
        parts = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                 for line in streamed.text.splitlines()
                 if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        assert streamed.headers["x-semcomm-replica"]
        return plain.json()["choices"][0]["message"]["content"], "".join(parts)

    plain, streamed = asyncio.run(main())
    assert streamed == plain
