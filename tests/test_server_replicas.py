"""Replica routing without Ray: several in-process workers or upstream URLs of one model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from semcomm.errors import ConfigError
from semcomm.security import TenantContext
from semcomm.server import create_app, load_config
from semcomm.server._backends import GenRequest

from .test_server_support import LiveServer, live_server, server_config

LONG = "Order log: " + " ".join(f"item-{i} shipped;" for i in range(30))


def _cfg(tmp: Path, models: dict[str, Any]) -> Any:
    return load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp), "max_tokens_limit": 8},
        "models": models, "kv": {"tiers": ["memory"], "chunk_size": 32},
        "semantic": {"enabled": False}})


async def _spread_and_home(app: Any, model: str) -> tuple[list[str], list[str], list[int]]:
    """Replicas of 8 concurrent distinct prompts; replicas and hits of a 3-turn conversation."""
    gw = app.state.gateway
    await gw.startup()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:
            async def chat(messages: list[dict[str, str]]) -> httpx.Response:
                r = await c.post("/v1/chat/completions",
                                 json={"model": model, "max_tokens": 2, "messages": messages})
                assert r.status_code == 200, r.text
                assert r.headers["x-semcomm-replica"] == r.json()["semcomm"]["replica"]
                return r

            spread = await asyncio.gather(*[
                chat([{"role": "user", "content": f"distinct question {i} " * 8}])
                for i in range(8)])
            convo = [{"role": "system", "content": LONG}, {"role": "user", "content": "first"}]
            homes, hits = [], []
            for turn in range(3):
                r = await chat(convo)
                homes.append(r.headers["x-semcomm-replica"])
                hits.append(r.json()["usage"].get("prompt_tokens_details", {})
                            .get("cached_tokens", 0))
                convo = [*convo, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": f"follow-up {turn}"}]
            backend = gw.backends[model]
            if backend.kind == "hf":  # the router's keys are the KV store's keys
                req = GenRequest(model=model, messages=convo[:2], prompt=None, max_tokens=2,
                                 ctx=TenantContext.public())
                keys, n = backend.keys(req)
                assert n > 64 and all(gw.kv_store.contains(k) for k in keys[:n // 32])
            return [r.headers["x-semcomm-replica"] for r in spread], homes, hits
    finally:
        await gw.shutdown()


def test_local_workers_are_routed_by_prefix_and_load(tmp_path: Path) -> None:
    app = create_app(_cfg(tmp_path, {"tiny": {"path": "tiny", "workers": 2, "max_batch": 1}}))
    spread, homes, hits = asyncio.run(_spread_and_home(app, "tiny"))
    assert set(spread) == {"worker-0", "worker-1"}  # load spreads over both workers
    assert len(set(homes)) == 1  # the conversation stays with the worker holding its prefix
    assert hits[1] >= 256 and hits[2] >= 256
    health = app.state.gateway.health()["models"]["tiny"]
    assert "2/2 replicas up" in health["detail"]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    cfg = server_config(tmp_path_factory.mktemp("up"), tenants=False, semantic=False,
                        pipelines={}, models={"tiny": {"path": "tiny"}})
    with live_server(cfg) as srv:
        yield srv


def test_upstream_base_urls_are_routed_by_prefix_and_load(tmp_path: Path,
                                                          upstream: LiveServer) -> None:
    # one upstream server reached under two addresses: two replicas to the router
    urls = [f"http://127.0.0.1:{upstream.port}/v1", f"http://localhost:{upstream.port}/v1"]
    app = create_app(_cfg(tmp_path, {"up": {"kind": "upstream", "base_urls": urls,
                                            "upstream_model": "tiny"}}))
    spread, homes, _ = asyncio.run(_spread_and_home(app, "up"))
    assert set(spread) == {"upstream-0", "upstream-1"}
    assert len(set(homes)) == 1


@pytest.mark.parametrize(("model", "needle"), [
    ({"kind": "upstream", "base_url": "http://a/v1", "base_urls": ["http://b/v1"]}, "not both"),
    ({"kind": "upstream", "base_urls": ["http://a/v1", "http://a/v1/"]}, "distinct"),
    ({"kind": "upstream", "base_urls": ["http://a/v1"], "workers": 2}, "workers"),
    ({"path": "tiny", "base_urls": ["http://a/v1"]}, "only for kind = 'upstream'"),
    ({"path": "tiny", "workers": 0}, "models.m.workers"),
])
def test_replica_options_are_validated(tmp_path: Path, model: dict[str, Any],
                                       needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        _cfg(tmp_path, {"m": model})
