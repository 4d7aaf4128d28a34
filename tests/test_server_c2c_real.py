"""C2C in the gateway on the real catalog pair: Qwen2.5-Coder-0.5B-Instruct reads the
conversation, SmolLM2-135M-Instruct answers from the fused cache with the shipped fuser,
streaming included, and a repeated context's sharer KV comes back from the KV store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from semcomm.server import create_app, load_config

SHARER, RECEIVER = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"


def _pulled() -> bool:
    try:
        from semcomm.fusion import shipped_pair_fuser_path
        from semcomm.models import is_pulled

        return is_pulled(SHARER) and is_pulled(RECEIVER) and (shipped_pair_fuser_path() / "fuser.json").exists()
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _pulled(), reason="the real pair is not pulled (make models)")


def test_the_default_c2c_pipeline_answers_and_streams_on_the_real_pair(tmp_path: Path) -> None:
    from semcomm.fusion import shipped_pair_fuser_path

    default = load_config(None, environ={})
    assert default.pipelines["semcomm-c2c"].handoff == "c2c"  # the embedded default has it
    cfg = load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp_path), "max_tokens_limit": 16},
        "models": {SHARER: {"path": SHARER}, RECEIVER: {"path": RECEIVER}},
        "kv": {"tiers": ["memory"], "chunk_size": 16}, "semantic": {"enabled": False},
        "pipelines": {"semcomm-c2c": default.pipelines["semcomm-c2c"].model_dump()},
    })
    app = create_app(cfg)
    body = {"model": "semcomm-c2c", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Northwind's support desk opens at 9 am. When does it open?"}]}

    async def main() -> dict[str, Any]:
        gw = app.state.gateway
        await gw.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=300) as c:
                r1 = await c.post("/v1/chat/completions", json=body)
                r2 = await c.post("/v1/chat/completions", json=body)
                streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
                health = (await c.get("/health")).json()
            return {"r1": r1, "r2": r2, "streamed": streamed, "health": health}
        finally:
            await gw.shutdown()

    out = asyncio.run(main())
    assert out["r1"].status_code == 200, out["r1"].text
    meta = out["r1"].json()["semcomm"]
    assert meta["handoffs"] == {"c2c": 1}
    c2c = meta["stages"][1]["c2c"]
    assert c2c["fused_tokens"] > 0 and Path(c2c["fuser"]) == shipped_pair_fuser_path()
    answer = out["r1"].json()["choices"][0]["message"]["content"]
    assert answer and any(ch.isalpha() for ch in answer), answer
    assert out["r2"].json()["semcomm"]["stages"][1]["c2c"]["sharer_source"] == "engine"
    assert out["r2"].json()["choices"][0]["message"]["content"] == answer  # greedy, same cache
    pieces = [json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
              for ln in out["streamed"].text.splitlines()
              if ln.startswith("data: {") and json.loads(ln[6:])["choices"]]
    assert "".join(pieces) == answer and len([p for p in pieces if p]) >= 2, pieces
    wiring = json.dumps(out["health"]["wiring"])  # names the fuser, never where it lives
    assert f".../{shipped_pair_fuser_path().name}" in wiring
    assert str(shipped_pair_fuser_path()) not in wiring
