"""A sliding-window model in the server: concurrent requests with KV hits stay exact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import torch
import transformers as T

from semcomm.reference import build_byte_tokenizer
from semcomm.server import create_app, load_config


def _mistral_dir(tmp: Path) -> Path:
    tok = build_byte_tokenizer()
    cfg = T.MistralConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                          max_position_embeddings=512, sliding_window=8,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp / "m")
    tok.save_pretrained(tmp / "m")
    return tmp / "m"


async def _ask(client: httpx.AsyncClient, text: str) -> str:
    r = await client.post("/v1/chat/completions", json={
        "model": "sw", "max_tokens": 6, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_concurrent_requests_on_a_sliding_window_model_match_one_at_a_time(tmp_path: Path
                                                                           ) -> None:
    path = _mistral_dir(tmp_path)
    cfg = load_config(None, overrides={
        "server": {"state_dir": str(tmp_path / "state"), "batch_wait_ms": 50},
        "models": {"sw": {"path": str(path), "max_batch": 4}},
        "kv": {"tiers": ["memory"], "chunk_size": 16},
        "semantic": {"enabled": False}}, defaults=False, environ={})
    texts = [f"shared context about trains and tickets, question {i}?" for i in range(4)]

    async def run() -> tuple[list[str], list[str]]:
        app = create_app(cfg)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            alone = [await _ask(c, t) for t in texts]  # one at a time (and stores the KV)
            together = await asyncio.gather(*[_ask(c, t) for t in texts])  # batched, with hits
        await app.state.gateway.shutdown()
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone
