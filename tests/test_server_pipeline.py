"""Pipelines across two different models: C2C handoff with a fuser, text without one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from semcomm.server import create_app, load_config


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Qwen2 sharer and a Qwen3 receiver (toy sizes) on disk, and a fuser for the pair."""
    from semcomm.fusion import Fuser, FuserConfig, model_spec, save_fuser

    from ._fusion_toy import toy_pair

    root = tmp_path_factory.mktemp("pair")
    p = toy_pair("qwen")
    for name, model, tok in (("sharer", p.sharer, p.sharer_tokenizer),
                             ("receiver", p.receiver, p.receiver_tokenizer)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    cfg = FuserConfig(sharer=model_spec(p.sharer, p.sharer_tokenizer),
                      receiver=model_spec(p.receiver, p.receiver_tokenizer), hidden_dim=16,
                      num_blocks=1, zero_init=False)
    save_fuser(Fuser(cfg), root / "fuser")
    return {"sharer": root / "sharer", "receiver": root / "receiver", "fuser": root / "fuser"}


def _serve(tmp: Path, pair: dict[str, Path], fuser: str | None) -> dict[str, Any]:
    chain: dict[str, Any] = {"stages": [{"model": "sharer", "role": "sharer"},
                                        {"model": "receiver", "role": "receiver",
                                         "system": "Answer briefly."}]}
    if fuser is not None:
        chain["fuser"] = fuser
    cfg = load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp), "max_tokens_limit": 8},
        "models": {"sharer": {"path": str(pair["sharer"])},
                   "receiver": {"path": str(pair["receiver"])}},
        "kv": {"tiers": ["memory"], "chunk_size": 16}, "semantic": {"enabled": False},
        "pipelines": {"chain": chain},
    })
    app = create_app(cfg)

    async def main() -> dict[str, Any]:
        gw = app.state.gateway
        await gw.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as c:
                body = {"model": "chain", "max_tokens": 4, "messages": [
                    {"role": "user", "content": "Zorbia's capital is Velmora. What is it?"}]}
                r1 = await c.post("/v1/chat/completions", json=body)
                r2 = await c.post("/v1/chat/completions", json=body)
                metrics = (await c.get("/metrics")).text
                health = (await c.get("/health")).json()
                streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
            assert r1.status_code == 200 and r2.status_code == 200, r1.text
            deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in streamed.text.splitlines()
                      if line.startswith("data: {") and json.loads(line[6:])["choices"]]
            return {"r1": r1, "r2": r2, "metrics": metrics, "health": health,
                    "streamed": "".join(deltas), "pieces": [d for d in deltas if d],
                    "stream_hits": streamed.headers["x-semcomm-hits"]}
        finally:
            await gw.shutdown()

    return asyncio.run(main())


def test_c2c_handoff_between_different_models(tmp_path: Path, pair: dict[str, Path]) -> None:
    out = _serve(tmp_path, pair, str(pair["fuser"]))
    meta = out["r1"].json()["semcomm"]
    assert meta["handoffs"] == {"c2c": 1}
    assert meta["stages"][0]["sharer"] is True and meta["stages"][0]["completion_tokens"] == 0
    assert meta["stages"][1]["c2c"]["fused_tokens"] > 0
    assert "c2c" in out["r1"].headers["x-semcomm-hits"]
    assert 'semcomm_pipeline_handoffs_total{mode="c2c",pipeline="chain"} 2.0' in out["metrics"]
    # a streaming client gets the fused answer too, the same text as the JSON answer
    answer = out["r1"].json()["choices"][0]["message"]["content"]
    assert answer and out["streamed"] == answer
    assert "c2c" in out["stream_hits"]
    # ... piece by piece as the receiver decodes it, not as one block at the end
    tokens = out["r1"].json()["usage"]["completion_tokens"]
    assert tokens >= 2 and len(out["pieces"]) >= 2, (tokens, out["pieces"])
    # the second request reads the sharer's context KV from the KV store
    assert out["r2"].json()["semcomm"]["stages"][1]["c2c"]["sharer_source"] == "engine"


def test_text_handoff_without_a_fuser(tmp_path: Path, pair: dict[str, Path]) -> None:
    out = _serve(tmp_path, pair, str(tmp_path / "no-such-fuser"))
    assert out["streamed"] == out["r1"].json()["choices"][0]["message"]["content"]
    meta = out["r1"].json()["semcomm"]
    assert meta["handoffs"] == {"text": 1}
    assert meta["stages"][0]["completion_tokens"] > 0  # the first model wrote text
    assert "no fuser" in out["health"]["wiring"]["c2c:sharer->receiver"]
