"""A live semcomm gateway for the framework integration tests (no tests here).

The tiny config-built model with documents on, as tests/test_server_documents.py sets it up
(memory KV, no semantic cache, so a second request is answered by the model), behind a
recorder: each chat request's JSON body as the gateway received it, the ``x-semcomm-hits`` it
answered and its JSON answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ._semantic_helpers import bow_embed

__all__ = ["PASSAGES", "Exchange", "bow", "gateway"]

#: Three retrieved passages; a question names one of them, so retrieval orders them differently.
PASSAGES = [f"(Title: Place {i}) Place {i} lies on river {i} and trades in item-{i}; " * 3
            for i in range(3)]


def bow(texts: list[str]) -> list[list[float]]:
    """Unit bag-of-words vectors: the test retrievers' embedding."""
    v = bow_embed(texts)
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).tolist()  # type: ignore[no-any-return]


@dataclass
class Exchange:
    """One chat request the gateway received, the hits it answered and its answer (None when
    streamed)."""

    body: dict[str, Any]
    hits: str
    answer: dict[str, Any] | None

    def parts(self) -> list[dict[str, Any]]:
        """Every content part of every message, in order (a string content is no part)."""
        return [p for m in self.body["messages"] if isinstance(m.get("content"), list)
                for p in m["content"]]

    def documents(self) -> list[str]:
        """The texts sent as documents, in order."""
        return [p["text"] for p in self.parts() if p.get("document") is True]

    def reused(self) -> int | None:
        """``docs:<tokens>`` of ``x-semcomm-hits``: document tokens reused (None: no documents)."""
        m = re.search(r"\bdocs:(\d+)", self.hits)
        return int(m.group(1)) if m else None

    def documents_hit(self) -> int | None:
        """How many documents the gateway found stored (None: it served no documents)."""
        doc = (self.answer or {}).get("semcomm", {}).get("documents")
        return None if doc is None else int(doc["documents_hit"])


class _Record:
    """ASGI middleware: appends an :class:`Exchange` for each POST to the chat endpoint."""

    def __init__(self, app: Any, sink: list[Exchange]) -> None:
        self.app, self.sink = app, sink

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        hits: list[str] = []
        out: list[bytes] = []
        is_json: list[bool] = []

        async def rec() -> Any:
            msg = await receive()
            if msg["type"] == "http.request":
                chunks.append(msg.get("body", b""))
            return msg

        async def snd(msg: Any) -> None:
            if msg["type"] == "http.response.start":
                headers = {k.lower(): v.decode() for k, v in msg.get("headers", [])}
                hits.append(headers.get(b"x-semcomm-hits", ""))
                is_json.append(headers.get(b"content-type", "").startswith("application/json"))
            elif msg["type"] == "http.response.body":
                out.append(msg.get("body", b""))
            await send(msg)

        await self.app(scope, rec, snd)
        answer = json.loads(b"".join(out)) if is_json and is_json[0] else None
        self.sink.append(Exchange(json.loads(b"".join(chunks)), ",".join(hits), answer))


@contextmanager
def gateway(tmp: Path) -> Iterator[tuple[str, list[Exchange]]]:
    """``(base_url ending in /v1, exchanges)`` of a live gateway serving model ``tiny``."""
    pytest.importorskip("uvicorn")
    from semcomm.server import load_config

    from .test_server_support import LiveServer

    config = load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp), "max_tokens_limit": 16},
        "models": {"tiny": {"path": "tiny", "max_batch": 4}},
        "kv": {"tiers": ["memory"], "chunk_size": 32}, "semantic": {"enabled": False}})
    log: list[Exchange] = []
    srv = LiveServer(config)
    srv.app.add_middleware(_Record, sink=log)
    srv.start()
    try:
        yield f"{srv.url}/v1", log
    finally:
        srv.stop()
