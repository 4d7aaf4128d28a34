"""Upstream OpenAI-compatible models: a second semcomm server on loopback is the upstream.

Failures are real: the upstream server's models are configured with the test-only
``fail_mode`` option (HTTP 500, a 503 then success, a slow reply, a dropped stream), and one
model points at a closed port.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .test_server_support import (
    ADMIN_KEY,
    LiveServer,
    free_port,
    live_server,
    server_config,
)

UP_KEY = "k-upstream"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    cfg = server_config(
        tmp_path_factory.mktemp("up"), semantic=False, tenants=False,
        models={
            "tiny": {"path": "tiny"},
            "broken": {"path": "tiny", "fail_mode": "http_500"},
            "flaky": {"path": "tiny", "fail_mode": "http_503", "fail_count": 1},
            "slow": {"path": "tiny", "fail_mode": "slow", "fail_delay_s": 3.0},
            "drop": {"path": "tiny", "fail_mode": "drop"},
        },
        pipelines={},
    )
    with live_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway(upstream: LiveServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LiveServer]:
    base = f"{upstream.url}/v1"
    up = {"kind": "upstream", "base_url": base, "api_key": UP_KEY}
    cfg = server_config(
        tmp_path_factory.mktemp("gw"),
        models={
            "up": {**up, "upstream_model": "tiny"},
            "up-broken": {**up, "upstream_model": "broken", "max_retries": 1},
            "up-flaky": {**up, "upstream_model": "flaky", "max_retries": 2},
            "up-slow": {**up, "upstream_model": "slow", "timeout_s": 0.5, "max_retries": 2},
            "up-drop": {**up, "upstream_model": "drop"},
            "up-dead": {"kind": "upstream", "base_url": f"http://127.0.0.1:{free_port()}/v1",
                        "max_retries": 1, "connect_timeout_s": 0.5},
        },
        pipelines={"up-chain": {"stages": [{"model": "up", "system": "Plan.", "max_tokens": 3},
                                           {"model": "up", "system": "Answer."}]}},
    )
    with live_server(cfg) as srv:
        yield srv


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k-acme", max_retries=0)


def _entries(srv: LiveServer) -> int:
    return int(srv.gateway.semantic.stats()["entries"])


def test_upstream_serves_and_gets_semantic_hits(gateway: LiveServer, upstream: LiveServer
                                                ) -> None:
    client = _client(gateway)
    msgs = [{"role": "user", "content": "Which plan includes priority support?"}]
    direct = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x", max_retries=0)
    want = direct.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    first = client.chat.completions.with_raw_response.create(model="up", messages=msgs,
                                                             max_tokens=6)
    out = first.parse()
    assert out.choices[0].message.content == want.choices[0].message.content
    assert out.usage.prompt_tokens == want.usage.prompt_tokens
    assert first.headers["x-semcomm-hits"] == "none"
    para = [{"role": "user", "content": "Which plan comes with priority support?"}]
    again = client.chat.completions.with_raw_response.create(model="up", messages=para,
                                                             max_tokens=6)
    assert again.headers["x-semcomm-hits"] == "semantic"
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="up", messages=msgs, max_tokens=6, stream=True,
        extra_headers={"Cache-Control": "no-cache"}) if c.choices]
    assert "".join(parts) == want.choices[0].message.content


def test_upstream_5xx_is_a_clear_502_and_not_cached(gateway: LiveServer) -> None:
    before = _entries(gateway)
    msgs = [{"role": "user", "content": "Is the broken model there?"}]
    with gateway.client("k-acme") as c:
        for _ in range(2):  # the second call must not be served from any cache
            r = c.post("/v1/chat/completions", json={"model": "up-broken", "messages": msgs})
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["type"] == "upstream_error" and "HTTP 500" in err["message"]
            assert "up-broken" in err["message"]
    assert _entries(gateway) == before
    with pytest.raises(openai.APIStatusError) as info:
        _client(gateway).chat.completions.create(model="up-broken", messages=msgs)
    assert info.value.status_code == 502


def test_upstream_503_is_retried(gateway: LiveServer, upstream: LiveServer) -> None:
    flaky = upstream.gateway.backends["flaky"]
    calls = flaky.calls
    out = _client(gateway).chat.completions.create(
        model="up-flaky", messages=[{"role": "user", "content": "retry me"}], max_tokens=3)
    assert out.choices[0].message.content is not None
    assert flaky.calls == calls + 2  # one 503, one success


def test_upstream_timeout_is_504_without_retry(gateway: LiveServer, upstream: LiveServer
                                               ) -> None:
    slow = upstream.gateway.backends["slow"]
    calls = slow.calls
    before = _entries(gateway)
    with gateway.client("k-acme") as c:
        r = c.post("/v1/chat/completions", json={
            "model": "up-slow", "messages": [{"role": "user", "content": "too slow"}]})
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert slow.calls == calls + 1  # a read timeout is never retried
    assert _entries(gateway) == before


def test_upstream_dropped_stream(gateway: LiveServer) -> None:
    before = _entries(gateway)
    msgs = [{"role": "user", "content": "drop this one"}]
    with gateway.client("k-acme") as c:
        r = c.post("/v1/chat/completions",
                   json={"model": "up-drop", "messages": msgs, "max_tokens": 8})
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    with pytest.raises(openai.APIError):
        for _ in _client(gateway).chat.completions.create(model="up-drop", messages=msgs,
                                                          max_tokens=8, stream=True):
            pass
    assert _entries(gateway) == before


def test_unreachable_upstream_is_reported(gateway: LiveServer) -> None:
    with gateway.client("k-acme") as c:
        r = c.post("/v1/chat/completions", json={
            "model": "up-dead", "messages": [{"role": "user", "content": "anyone?"}]})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}  # details are the admin's
        assert c.get("/health").json() == {"status": "degraded"}
        health = c.get("/health", headers=admin).json()
        metrics = c.get("/metrics", headers=admin).text
    assert health["models"]["up-dead"]["up"] is False and health["status"] == "degraded"
    assert 'semcomm_backend_up{model="up-dead"} 0.0' in metrics


def test_pipeline_over_upstream_uses_text_handoff(gateway: LiveServer) -> None:
    out = _client(gateway).chat.completions.create(
        model="up-chain", messages=[{"role": "user", "content": "Plan my migration."}],
        max_tokens=4, extra_headers={"Cache-Control": "no-store"})
    meta = out.model_extra["semcomm"]
    assert meta["handoffs"] == {"text": 1}
    assert len(meta["stages"]) == 2 and meta["stages"][1]["prompt_tokens"] > 0

