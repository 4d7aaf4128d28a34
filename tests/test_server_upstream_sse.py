"""The upstream's event stream is read as server-sent events, not line by line.

A real HTTP upstream on loopback (the ``Recorder`` of the tenant tests, answering scripted
bytes) sends what the SSE format allows and OpenAI-compatible servers do send: an event split
over several ``data:`` lines, comments (``: ping``), ``event:``, ``id:`` and ``retry:`` fields,
CRLF line ends. The gateway in front of it must answer with the whole text and the usage of the
last chunk; broken streams are a 502 naming the problem, and a 503 before the first chunk is
retried as often as ``max_retries`` says.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from httpx_sse import connect_sse

from .test_server_support import TENANTS, LiveServer, live_server, server_config
from .test_server_upstream_tenant import Recorder

SSE = {"content-type": "text/event-stream"}
USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def _data(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


WHOLE = (
    b": ping\n\n"
    b"event: ping\ndata: {}\n\n"  # another event type: no output
    # one event over two data lines (joined by a newline, which JSON allows)
    b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"},\n'
    b'data:  "finish_reason": null}]}\n\n'
    b"id: 7\r\nretry: 500\r\n: keep-alive\r\n"
    + _data(_chunk("lo", "stop")).replace(b"\n", b"\r\n")
    + b"event: message\n" + _data({"choices": [], "usage": USAGE})
    + b"data: [DONE]\n\n"
)


@pytest.fixture(scope="module")
def upstream() -> Iterator[Recorder]:
    rec = Recorder()
    rec.thread.start()
    yield rec
    rec.server.shutdown()
    rec.server.server_close()


@pytest.fixture(scope="module")
def gateway(upstream: Recorder, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LiveServer]:
    up = {"kind": "upstream", "base_url": upstream.url, "upstream_model": "m"}
    cfg = server_config(tmp_path_factory.mktemp("gw"), semantic=False, pipelines={}, models={
        "up": {**up, "max_retries": 1},
        "up-once": {**up, "max_retries": 0},
    })
    with live_server(cfg) as srv:
        yield srv


def _stream(srv: LiveServer, model: str) -> tuple[int, str, dict[str, Any] | None, str]:
    """``(status, text, usage, error message)`` of one streamed chat request to the gateway."""
    text, usage, error = [], None, ""
    with srv.client(TENANTS["acme"]) as c, connect_sse(c, "POST", "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}) as source:
        status = source.response.status_code
        if status != 200:
            source.response.read()
            return status, "", None, source.response.json()["error"]["message"]
        for sse in source.iter_sse():
            if sse.data == "[DONE]":
                break
            chunk = sse.json()
            if "error" in chunk:
                error = chunk["error"]["message"]
                break
            usage = chunk.get("usage") or usage
            text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return status, "".join(text), usage, error


def test_whole_events_comments_and_fields(gateway: LiveServer, upstream: Recorder) -> None:
    upstream.take()
    upstream.script = [(200, SSE, WHOLE)]
    status, text, usage, error = _stream(gateway, "up")
    assert (status, error) == (200, "")
    assert text == "Hello"
    assert usage is not None and usage["prompt_tokens"] == 5
    assert usage["completion_tokens"] == 2  # the last chunk's usage
    (body,) = upstream.take()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("headers", "raw", "needle"), [
    (SSE, _data(_chunk("par")) + b'event: error\ndata: {"error": {"message": "engine died"}}\n\n',
     "failed mid-stream: engine died"),
    (SSE, _data(_chunk("par")) + b"event: error\ndata: out of memory\n\n",
     "failed mid-stream: out of memory"),
    (SSE, _data(_chunk("par")) + _data({"error": {"message": "engine died"}}),
     "failed mid-stream: engine died"),
    (SSE, _data(_chunk("par", "stop")), "without [DONE]"),
    (SSE, b'data: {"choices": [\n\n', "malformed event"),
    ({"content-type": "application/json"}, b"{}", "did not answer with an event stream"),
])
def test_broken_streams_are_named(gateway: LiveServer, upstream: Recorder,
                                  headers: dict[str, str], raw: bytes, needle: str) -> None:
    upstream.take()
    upstream.script = [(200, headers, raw)]
    status, _, _, error = _stream(gateway, "up")
    assert status in (200, 502), error  # before the first chunk: 502; after it: an error event
    assert needle in error and "'up'" in error
    assert len(upstream.take()) == 1  # a stream that started is never retried


def test_a_503_before_the_first_chunk_is_retried_max_retries_times(
        gateway: LiveServer, upstream: Recorder) -> None:
    busy = (503, {"content-type": "application/json", "Retry-After": "0.1"},
            b'{"error": {"message": "busy"}}')
    upstream.take()
    upstream.script = [busy, (200, SSE, _data(_chunk("ok", "stop")) + b"data: [DONE]\n\n")]
    status, text, _, error = _stream(gateway, "up")
    assert (status, text, error) == (200, "ok", "")
    assert len(upstream.take()) == 2  # one 503, one answer
    upstream.script = [busy, busy]
    status, _, _, error = _stream(gateway, "up")
    assert status == 502 and "HTTP 503: busy" in error
    assert len(upstream.take()) == 2  # max_retries = 1: one retry after the first attempt
    upstream.script = [busy]
    status, _, _, error = _stream(gateway, "up-once")
    assert status == 502 and "HTTP 503: busy" in error
    assert len(upstream.take()) == 1
