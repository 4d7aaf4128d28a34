"""The model router in the request path: model "auto" goes where the trained router says."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np

from semcomm.routing import ModelRouter, ModelSpec
from semcomm.server import create_app, load_config

BILLING = ["my invoice is wrong", "refund my last payment", "why was my card charged twice",
           "change the billing address on my invoices", "I need a receipt for March"]
TECH = ["my server does not boot", "the disk is full and the database crashed",
        "ssh connection refused on port 22", "kernel panic after the update",
        "the load balancer returns 502"]


def test_auto_model_follows_the_trained_router(tmp_path: Path) -> None:
    router = ModelRouter([ModelSpec("billing-model", 1.0), ModelSpec("tech-model", 1.0)])
    labels = np.array([[1, 0]] * len(BILLING) + [[0, 1]] * len(TECH))
    router.fit(BILLING + TECH, labels, budget=None)
    path = router.save(tmp_path / "router.json")
    cfg = load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp_path / "state"), "max_tokens_limit": 8},
        "models": {"billing-model": {"path": "tiny"}, "tech-model": {"path": "tiny"}},
        "kv": {"tiers": ["memory"]}, "semantic": {"enabled": False},
        "routing": {"model_router": str(path), "default_model": "billing-model"},
    })
    app = create_app(cfg)

    async def main() -> list[str]:
        gw = app.state.gateway
        await gw.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as c:
                out = []
                for text in ("there is a wrong charge on my invoice",
                             "my server crashed and does not boot"):
                    r = await c.post("/v1/chat/completions", json={
                        "model": "auto", "max_tokens": 2,
                        "messages": [{"role": "user", "content": text}]})
                    assert r.status_code == 200, r.text
                    out.append(r.headers["x-semcomm-model"])
                metrics = (await c.get("/metrics")).text
                assert 'semcomm_routing_decisions_total{model="tech-model"} 1.0' in metrics
                return out
        finally:
            await gw.shutdown()

    assert asyncio.run(main()) == ["billing-model", "tech-model"]
