"""Routing by memory headroom: the replica router's KV term and the model router's fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from semcomm.routing import ReplicaRouter

from .test_server_support import live_server


def _warm(router: ReplicaRouter, tokens: list[int], replica: int) -> None:
    d = router.record(router.plan(tokens), replica)
    router.complete(d)


@pytest.mark.parametrize("policy", ["default", "affinity", "least-loaded", "weighted"])
def test_a_long_context_goes_to_a_replica_with_kv_room(policy: str) -> None:
    router = ReplicaRouter(["a", "b", "c"], policy=policy, chunk_size=16)
    prompt = list(range(512))
    _warm(router, prompt, 0)  # "a" holds the prefix: affinity would pick it
    router.set_kv_free([1_000, 2_000_000, 500_000])
    d = router.route(prompt, kv_bytes=1_500_000)
    assert (d.replica, d.kv_fit) == ("b", True)  # the only one with room
    router.complete(d)
    d = router.route(prompt, kv_bytes=400_000)
    assert d.replica in ("b", "c") and d.kv_fit
    router.complete(d)
    d = router.route(prompt, kv_bytes=5_000_000)  # fits nowhere: the most room waits least
    assert (d.replica, d.kv_fit) == ("b", False)
    router.complete(d)
    router.set_kv_free([None, None, None])  # unknown headroom never filters
    if policy in ("default", "affinity"):
        assert router.route(prompt, kv_bytes=5_000_000).replica == "a"
    with pytest.raises(ValueError, match="needs 3 values"):
        router.set_kv_free([1.0])


def _config(tmp: Path, models: dict[str, Any], **routing: Any):  # type: ignore[no-untyped-def]
    from semcomm.server import load_config

    return load_config(None, overrides={
        "server": {"state_dir": str(tmp), "kv_wait_s": 0.0, "batch_wait_ms": 0},
        "models": models, "routing": routing,
        "kv": {"tiers": ["memory"], "memory_bytes": 8 * 2**20},
        "semantic": {"enabled": False}}, defaults=False, environ={})


LONG = {"model": "tiny", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "a long shared context " * 12}]}


def test_workers_route_a_long_request_to_the_one_with_kv_headroom(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"tiny": {"path": "tiny", "workers": 2, "kv_bytes": 400_000}})
    with live_server(cfg) as srv, srv.client() as c:
        first = c.post("/v1/chat/completions", json=LONG)
        assert first.status_code == 200, first.text
        home = first.headers["x-semcomm-replica"]
        again = c.post("/v1/chat/completions", json=LONG)
        assert again.headers["x-semcomm-replica"] == home  # prefix affinity
        acct = srv.gateway.memory.accountant
        # a long session holds most of the home worker's share of the budget
        held = acct.reserve("tiny", 300, worker=f"tiny/{home}")
        try:
            moved = c.post("/v1/chat/completions", json=LONG)
            assert moved.status_code == 200, moved.text
            assert moved.headers["x-semcomm-replica"] != home
        finally:
            acct.release(held)


def test_auto_prefers_a_smaller_model_when_the_chosen_one_is_out_of_headroom(
    tmp_path: Path,
) -> None:
    from semcomm.reference import build_tiny_model  # noqa: F401 - both models are "tiny"

    cfg = _config(tmp_path, {"big": {"path": "tiny", "kv_bytes": 400_000},
                             "small": {"path": "tiny", "kv_bytes": 400_000}},
                  default_model="big")
    with live_server(cfg) as srv, srv.client() as c:
        gw = srv.gateway
        # make "small" the smaller one in the plan (both are the same tiny model here)
        gw.memory.plan.models["small"].weight_bytes //= 2
        body = {**LONG, "model": "auto"}
        r = c.post("/v1/chat/completions", json=body)
        assert r.json()["model"] == "big"
        acct = gw.memory.accountant
        held = acct.reserve("big", 700)  # a long session fills most of big's KV budget
        try:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "small"
            assert 'semcomm_memory_reroutes_total{from_model="big",to_model="small"} 1.0' in \
                c.get("/metrics").text
            named = c.post("/v1/chat/completions", json={**LONG, "model": "big"})
            assert named.status_code == 429  # a request that names its model is not moved
        finally:
            acct.release(held)
