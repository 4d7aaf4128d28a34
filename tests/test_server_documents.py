"""Documents in a chat (content parts marked ``"document": true``) through the gateway.

An in-process model reuses each passage's KV at whatever position it lands; the response says
what was reused and recomputed (``x-semcomm-hits``: ``docs:<tokens>``, the usage block). The
official ``openai`` client sends the marker unchanged. Tiny config-built model (byte-level
tokenizer: a passage tokenized alone is the same tokens as inside the prompt).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from semcomm.server import create_app, load_config

from .test_server_support import live_server

PASSAGES = [f"(Title: Place {i}) Place {i} lies on river {i} and trades in item-{i}; " * 3
            for i in range(4)]
SYSTEM = {"role": "system", "content": "Answer from the passages."}


def _config(tmp: Path, **models: Any) -> Any:
    return load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp), "max_tokens_limit": 16},
        "models": models or {"tiny": {"path": "tiny", "max_batch": 4}},
        "kv": {"tiers": ["memory"], "chunk_size": 32}, "semantic": {"enabled": False}})


def _messages(order: list[int], question: str, *, marked: bool = True) -> list[dict[str, Any]]:
    parts = [{"type": "text", "text": PASSAGES[i] + "\n", **({"document": True} if marked else {})}
             for i in order]
    return [SYSTEM, {"role": "user", "content": [*parts,
                                                 {"type": "text", "text": question}]}]


async def _chat(c: httpx.AsyncClient, messages: list[dict[str, Any]], **extra: Any
                ) -> httpx.Response:
    r = await c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 8,
                                                   "messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r


def test_documents_are_reused_in_any_order_and_reported(tmp_path: Path) -> None:
    app = create_app(_config(tmp_path))

    async def main() -> None:
        gw = app.state.gateway
        await gw.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=120) as c:
                first = await _chat(c, _messages([0, 1, 2], "Where is item-1 traded?"))
                again = await _chat(c, _messages([2, 0, 1], "Which river has place 2?"))
                plain = await _chat(c, _messages([2, 0, 1], "Which river has place 2?",
                                                 marked=False))
                full = await _chat(c, _messages([2, 0, 1], "Which river has place 2?"),
                                   semcomm_documents={"selector": "full"})
                unsure = await _chat(c, _messages([1, 2, 0], "Which river has place 2?"),
                                     semcomm_documents={"selector": "concat", "margin": 1.0})
                plain2 = await _chat(c, _messages([1, 2, 0], "Which river has place 2?",
                                                  marked=False))
                watched = await _chat(c, _messages([0, 2, 1], "Which river has place 2?"),
                                      semcomm_documents={"selector": "concat", "watch": 1.0})
        finally:
            await gw.shutdown()
        # the first request computed each passage alone and stored it; the second, the same
        # passages in another order, reuses all three
        for r in (first, again):
            assert "docs:" in r.headers["x-semcomm-hits"], r.headers["x-semcomm-hits"]
        doc = again.json()["semcomm"]["documents"]
        assert doc["documents"] == 3 and doc["documents_hit"] == 3
        usage = again.json()["usage"]["prompt_tokens_details"]
        assert usage["document_tokens_reused"] > 0 and usage["selector"] == doc["selector"]
        assert usage["document_tokens_reused"] + usage["document_tokens_recomputed"] == \
            usage["document_tokens"] == doc["document_tokens"]
        assert usage["cached_tokens"] == again.json()["usage"]["prompt_tokens"] - \
            usage["recomputed_tokens"]
        # unmarked text is an ordinary prompt; recomputing every document token gives its answer
        assert "docs:" not in plain.headers["x-semcomm-hits"]
        assert "documents" not in plain.json()["semcomm"]
        assert full.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
        assert full.json()["choices"][0]["message"]["content"] == \
            plain.json()["choices"][0]["message"]["content"]
        assert full.json()["usage"]["prompt_tokens_details"]["selector"] == "full"
        # the confidence test: below the margin the reused KV is not trusted, full prefill
        doc = unsure.json()["semcomm"]["documents"]
        assert doc["fallback"] and doc["margin"] == 1.0 and doc["reused_tokens"] == 0
        assert unsure.json()["choices"][0]["message"]["content"] == \
            plain2.json()["choices"][0]["message"]["content"]
        # watch: the KV rebuilt in full at the first unsure decode step (every step at 1.0)
        doc = watched.json()["semcomm"]["documents"]
        assert doc["watch"] == 1.0 and doc["repaired_at"] == 1 and not doc["fallback"]

    asyncio.run(main())


def test_bad_document_options_are_refused(tmp_path: Path) -> None:
    app = create_app(_config(tmp_path))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            for bad, param in (({"selector": "nope"}, "selector"), ({"recompute": 1.5},
                                                                     "recompute"),
                               ({"watch": -0.1}, "watch")):
                r = await c.post("/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 2, "messages": _messages([0], "q"),
                    "semcomm_documents": bad})
                assert r.status_code == 400 and param in r.json()["error"]["param"], r.text
            r = await c.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "x", "document": "yes"}]}]})
            assert r.status_code == 400, r.text  # a marker that is not a boolean
            assert r.json()["error"]["param"].startswith("messages.0.content")

    asyncio.run(main())


def test_the_openai_client_sends_documents_unchanged(tmp_path: Path) -> None:
    with live_server(_config(tmp_path)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        for order in ([0, 3], [3, 0]):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", max_tokens=4, messages=_messages(order, "Where is item-3?"),
                extra_body={"semcomm_documents": {"selector": "epic", "recompute": 0.2}})
            out = raw.parse()
        assert "docs:" in raw.headers["x-semcomm-hits"]
        details = out.usage.prompt_tokens_details
        assert details is not None and details.model_extra["selector"] == "epic"
        assert details.model_extra["document_tokens_reused"] > 0


# --- pipelines whose stages share text under their own role prompts ---------------------

def _team_config(tmp: Path, pattern: str, layout: str | None = None, *,
                 model: dict[str, Any] | None = None, tenants: bool = False,
                 **over: Any) -> Any:
    roles = [("solver", "You solve it."), ("checker", "You check the answers."),
             ("skeptic", "You look for mistakes."), ("judge", "Pick the best answer.")]
    pipe: dict[str, Any] = {"pattern": pattern, "stages": [
        {"model": "tiny", "role": r, "system": s, "max_tokens": 6} for r, s in roles], **over}
    if layout:
        pipe["layout"] = layout
    return load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp), "max_tokens_limit": 16},
        "models": {"tiny": {"path": "tiny", "max_batch": 4, **(model or {})}},
        "pipelines": {"team": pipe},
        **({"tenants": {"acme": {"api_key": "k-acme"}, "beta": {"api_key": "k-beta"}}}
           if tenants else {}),
        "kv": {"tiers": ["memory"], "chunk_size": 32}, "semantic": {"enabled": False}})


@pytest.mark.parametrize("pattern", ["fanout", "chain"])
def test_agents_reuse_the_text_they_share_under_their_own_role(tmp_path: Path,
                                                              pattern: str) -> None:
    """Each stage puts its own role prompt first, so a prefix cache never hits on the request
    or the earlier answers; as documents their KV is reused under every stage. Streamed and
    not, the final answer is the last stage's; text handoff (no reuse) gives the same stages."""
    question = "Order log: " + " ".join(f"item-{i} shipped;" for i in range(12))

    async def ask(app: Any, stream: bool) -> tuple[httpx.Response, str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:
            r = await c.post("/v1/chat/completions", json={
                "model": "team", "max_tokens": 6, "stream": stream,
                "messages": [{"role": "user", "content": question}]})
            assert r.status_code == 200, r.text
            if not stream:
                return r, r.json()["choices"][0]["message"]["content"]
            text = ""
            for line in r.text.splitlines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:]).get("choices", []):
                        text += ch.get("delta", {}).get("content") or ""
            return r, text

    async def main(app: Any) -> list[tuple[httpx.Response, str]]:
        gw = app.state.gateway
        await gw.startup()
        try:
            return [await ask(app, False), await ask(app, True)]
        finally:
            await gw.shutdown()

    shared = asyncio.run(main(create_app(_team_config(tmp_path / "a", pattern, "shared"))))
    (first, text), (_, streamed) = shared
    meta = first.json()["semcomm"]
    assert meta["pattern"] == pattern and meta["layout"] == "shared"
    assert meta["handoffs"] == {"shared": 3}
    assert len(meta["stages"]) == 4 and len(meta["intermediate"]) == 3
    assert text == streamed  # the last stage's answer, streamed or not
    # the judge reads every earlier answer; all four stages read the request as a document
    judge = meta["stages"][-1]["documents"]
    assert judge["documents"] == 4 and judge["documents_hit"] >= 1
    assert meta["saved_tokens_by_layer"]["docs"] > 0
    assert "docs:" in first.headers["x-semcomm-hits"]
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # a fan-out's specialists read the request only
    if pattern == "fanout":
        assert all(s["documents"]["documents"] == 1 for s in meta["stages"][:-1])
    else:
        assert [s["documents"]["documents"] for s in meta["stages"]] == [1, 2, 3, 4]
    # with text handoff nothing is reused across stages, and the stages still answer
    plain = asyncio.run(main(create_app(_team_config(tmp_path / "b", pattern, "shared",
                                                     handoff="text"))))
    pmeta = plain[0][0].json()["semcomm"]
    assert pmeta["handoffs"] == {"text": 3} and "docs" not in pmeta["saved_tokens_by_layer"]
    assert "docs:" not in plain[0][0].headers["x-semcomm-hits"]


def test_a_fanout_needs_the_shared_layout_and_two_stages(tmp_path: Path) -> None:
    from semcomm.errors import ConfigError

    with pytest.raises(ConfigError, match="layout"):
        _team_config(tmp_path, "fanout", layout="prefix")
    with pytest.raises(ConfigError, match="two or more stages"):
        load_config(None, environ={}, defaults=False, overrides={
            "models": {"tiny": {"path": "tiny"}},
            "pipelines": {"solo": {"pattern": "fanout", "stages": [{"model": "tiny"}]}}})


# --- anchors: the text a stage read or wrote, as it computed it in context ----------------

ORDERS = "Order log: " + " ".join(f"item-{i} shipped;" for i in range(12))


async def _team(app: Any, questions: list[str], keys: list[str] | None = None
                ) -> list[dict[str, Any]]:
    """Each question to pipeline ``team`` in turn, as the tenant of its API key (none)."""
    gw = app.state.gateway
    await gw.startup()
    out = []
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:
            for q, key in zip(questions, keys or [""] * len(questions)):
                r = await c.post("/v1/chat/completions", headers={
                    "Authorization": f"Bearer {key}"} if key else {}, json={
                    "model": "team", "max_tokens": 6,
                    "messages": [{"role": "user", "content": q}]})
                assert r.status_code == 200, r.text
                out.append(r.json())
    finally:
        await gw.shutdown()
    return out


def _anchored(body: dict[str, Any]) -> list[int]:
    return [s["documents"]["documents_anchored"] for s in body["semcomm"]["stages"]]


def test_a_shared_pipeline_reuses_anchors_and_reports_them(tmp_path: Path) -> None:
    """With an anchor pool the first stage, with nothing to reuse, is prefilled in full and
    keeps the request's KV as it computed it in context, and its answer's decode KV; every
    later stage places both (and each earlier answer) from those anchors, never from KV
    computed alone. At r = 1 the answers are full prefill's (the text hand-off's)."""
    app = create_app(_team_config(tmp_path / "a", "chain", "shared",
                                  model={"anchor_bytes": 1 << 22}))
    (body,) = asyncio.run(_team(app, [ORDERS]))
    stages = body["semcomm"]["stages"]
    first = stages[0]["documents"]
    assert first["full_prefill"] and first["documents_anchored"] == 0
    assert first["anchors_captured"] == 2  # the request (in context) and the answer
    assert _anchored(body) == [0, 2, 3, 4]  # the request and every earlier answer
    assert all(s["documents"]["documents_computed"] == 0 for s in stages)
    assert body["semcomm"]["anchors"]["documents"] == 9
    assert body["semcomm"]["anchors"]["tokens"] == sum(
        s["documents"]["anchored_tokens"] for s in stages) > 0
    assert "docs:" in body["semcomm"]["hits"][-1]
    # the memory plan holds the pool's budget
    plan = app.state.gateway.memory.plan.models["tiny"]
    assert plan.anchor_budget_bytes == 1 << 22
    assert plan.planned_bytes == plan.weight_bytes + plan.kv_budget_bytes + (1 << 22)
    # every token recomputed over the anchors: the text hand-off's answers
    exact = asyncio.run(_team(create_app(_team_config(
        tmp_path / "b", "chain", "shared", model={"anchor_bytes": 1 << 22}, selector="full")),
        [ORDERS]))[0]
    plain = asyncio.run(_team(create_app(_team_config(tmp_path / "c", "chain", "shared",
                                                      handoff="text")), [ORDERS]))[0]
    assert _anchored(exact) == [0, 2, 3, 4]
    assert exact["semcomm"]["intermediate"] == plain["semcomm"]["intermediate"]
    assert exact["choices"][0]["message"]["content"] == \
        plain["choices"][0]["message"]["content"]
    # the confidence test at its strictest: every stage falls back, the same answers
    forced = asyncio.run(_team(create_app(_team_config(
        tmp_path / "d", "chain", "shared", model={"anchor_bytes": 1 << 22}, margin=1.0)),
        [ORDERS]))[0]
    assert [s["documents"]["fallback"] for s in forced["semcomm"]["stages"]] == \
        [False, True, True, True]
    assert forced["semcomm"]["intermediate"] == plain["semcomm"]["intermediate"]
    usage = forced["semcomm"]["stages"][1]["documents"]
    assert usage["reused_tokens"] == 0 and usage["documents_anchored"] == 2


def test_the_anchor_pool_stays_in_its_budget_and_tenants_apart(tmp_path: Path) -> None:
    budget = 200_000  # 512 bytes a token: one request's anchors (about 80 kB), not six
    app = create_app(_team_config(tmp_path, "chain", "shared", model={"anchor_bytes": budget},
                                  tenants=True))
    pool = app.state.gateway.backends["tiny"].runner.anchors
    questions = [f"Ticket {i}: " + " ".join(f"part-{i}-{j} late;" for j in range(8))
                 for i in range(6)]
    # acme asks six questions and the last one again; then beta asks that one too
    *acme, beta = asyncio.run(_team(app, [*questions, questions[-1], questions[-1]],
                                    ["k-acme"] * 7 + ["k-beta"]))
    st = pool.stats()
    assert 0 < st["bytes"] <= budget and st["evictions"] > 0
    assert _anchored(acme[-1])[0] == 1  # acme's own request, kept from its last run
    # beta's keys are its own: nothing of acme's is found, its first stage runs in full
    first = beta["semcomm"]["stages"][0]["documents"]
    assert first["full_prefill"] and first["documents_anchored"] == 0
