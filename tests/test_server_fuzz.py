"""Schema-based fuzzing of the OpenAPI spec (no 5xx), and a short bounded load test."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from .test_server_support import TENANTS, LiveServer, live_server, server_config

KEY = TENANTS["acme"]
MEMORY_BUDGET = 4 * 2**20  # bytes of the memory KV tier in this test's config


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    cfg = server_config(tmp_path_factory.mktemp("fuzz"), max_queue=32, max_tokens_limit=16)
    cfg.kv.memory_bytes = MEMORY_BUDGET
    with live_server(cfg) as srv:
        yield srv


def test_openapi_fuzz_has_no_server_errors(server: LiveServer) -> None:
    """Every operation of /openapi.json, a dozen generated cases each: never a 5xx."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    seen: Counter[int] = Counter()
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
            response = case.call(base_url=server.url, timeout=60)
            seen[response.status_code] += 1
            assert response.status_code < 500, (case.path, case.body, response.text[:500])
            if response.status_code >= 400 and case.path.startswith("/v1/"):
                assert {"message", "type", "param", "code"} <= set(response.json()["error"])

        check()
    assert seen[200] and any(400 <= s < 500 for s in seen)  # both paths were exercised


def test_bounded_load_has_no_5xx(server: LiveServer) -> None:
    """16 concurrent clients for a few seconds: only 200 or 429, memory inside its budget."""
    clients, seconds = 16, 6.0
    statuses: Counter[int] = Counter()
    prompts = [f"Customer {i % 5} asks about order {i % 7}" for i in range(32)]

    async def client(i: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            end = time.monotonic() + seconds
            n = i
            while time.monotonic() < end:
                stream = n % 3 == 0
                body = {"model": "tiny", "max_tokens": 8, "stream": stream,
                        "messages": [{"role": "system", "content": "Support desk."},
                                     {"role": "user", "content": prompts[n % len(prompts)]}]}
                r = await c.post("/v1/chat/completions", json=body)
                statuses[r.status_code] += 1
                if r.status_code == 429:
                    await asyncio.sleep(min(1.0, float(r.headers["Retry-After"])))
                n += clients

    async def main() -> None:
        await asyncio.gather(*[client(i) for i in range(clients)])

    asyncio.run(main())
    assert statuses[200] > clients, statuses
    assert set(statuses) <= {200, 429}, statuses
    stats = httpx.get(f"{server.url}/admin/stats",
                      headers={"Authorization": "Bearer admin-secret-key"}).json()
    mem = stats["stores"]["kv-memory"]
    assert 0 < mem["bytes"] <= MEMORY_BUDGET
    health = httpx.get(f"{server.url}/health").json()
    assert health["models"]["tiny"]["queue_depth"] == 0
