"""OpenAI-client wrapper against a local OpenAI-compatible HTTP server (stands in for the API)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

openai = pytest.importorskip("openai")

from semcomm import SemanticCache
from semcomm.integrations.openai import CachedAsyncOpenAI, CachedOpenAI
from semcomm.semantic import CallableEmbedder

from ._semantic_helpers import bow_embed


class FakeAPI:
    """A tiny chat-completions server: answers "answer #N to: <last user message>"."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.calls.append(body)
                last = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
                out = json.dumps({
                    "id": f"cmpl-{len(api.calls)}", "object": "chat.completion", "created": 1,
                    "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": f"answer #{len(api.calls)} to: {last}"}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def api() -> Iterator[FakeAPI]:
    a = FakeAPI()
    a.thread.start()
    try:
        yield a
    finally:
        a.server.shutdown()
        a.server.server_close()


@pytest.fixture
def cache() -> SemanticCache:
    return SemanticCache(embedder=CallableEmbedder(bow_embed))


def _msgs(q: str, system: str = "be brief") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": q}]


def test_second_identical_request_is_served_from_cache(api, cache) -> None:
    client = CachedOpenAI(openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0),
                          cache)
    r1 = client.chat.completions.create(model="m", messages=_msgs("what is semcomm"))
    r2 = client.chat.completions.create(model="m", messages=_msgs("what is semcomm"))
    assert len(api.calls) == 1
    assert r1.choices[0].message.content == r2.choices[0].message.content == \
        "answer #1 to: what is semcomm"
    assert r2.id.startswith("semcomm-hit-") and not r1.id.startswith("semcomm-hit-")
    assert (client.hits, client.misses) == (1, 1)


def test_model_params_context_and_streaming_are_not_shared(api, cache) -> None:
    client = CachedOpenAI(openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0),
                          cache)
    client.chat.completions.create(model="m", messages=_msgs("what is semcomm"))
    client.chat.completions.create(model="m2", messages=_msgs("what is semcomm"))
    client.chat.completions.create(model="m", messages=_msgs("what is semcomm"), temperature=0.2)
    client.chat.completions.create(model="m", messages=_msgs("what is semcomm", "be verbose"))
    client.chat.completions.create(model="m", messages=_msgs("what is semcomm"), n=2)
    assert len(api.calls) == 5 and client.hits == 0
    # passthrough attributes still work
    assert client.base_url == client.client.base_url


async def test_async_client(api, cache) -> None:
    client = CachedAsyncOpenAI(openai.AsyncOpenAI(base_url=api.base_url, api_key="x",
                                                  max_retries=0), cache)
    r1 = await client.chat.completions.create(model="m", messages=_msgs("hello async world"))
    r2 = await client.chat.completions.create(model="m", messages=_msgs("hello async world"))
    assert len(api.calls) == 1 and r2.choices[0].message.content == r1.choices[0].message.content
    await client.client.close()
