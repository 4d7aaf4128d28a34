"""The gateway under bad input and from outside: bounded bodies, 4xx (never 5xx) for every
malformed request, answer-changing fields refused, usage of this request on semantic hits, and
who may see which ops endpoint (docs/SECURITY.md, "Endpoints")."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_server_support import ADMIN_KEY, TENANTS, LiveServer, live_server, server_config

ACME, BETA = TENANTS["acme"], TENANTS["beta"]
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY_LIMIT = 64 * 1024
USER = [{"role": "user", "content": "Where is my parcel?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    cfg = server_config(tmp_path_factory.mktemp("hard"), max_tokens_limit=16,
                        max_body_bytes=BODY_LIMIT)
    with live_server(cfg) as srv:
        yield srv


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return dict(err)


# --- bounded input ------------------------------------------------------------------------------

def test_oversized_body_is_refused_with_413_and_the_limit(server: LiveServer) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 * BODY_LIMIT)}]}
    with server.client(ACME) as c:
        err = _error(c.post("/v1/chat/completions", json=big), 413)
        assert err["code"] == "request_too_large" and f"{BODY_LIMIT:,}" in err["message"]
        # a body without Content-Length (chunked) is cut off as it arrives
        chunks = (b"x" * 8192 for _ in range(2 * BODY_LIMIT // 8192))
        r = c.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
        _error(r, 413)
        # just under the limit is read and judged on its content
        ok = {"model": "tiny", "max_tokens": 2,
              "messages": [{"role": "user", "content": "y" * (BODY_LIMIT - 200)}]}
        assert c.post("/v1/chat/completions", json=ok).status_code == 400  # too many tokens


def test_default_body_limit_follows_the_largest_context(tmp_path: Path) -> None:
    from semcomm.server import create_app

    app = create_app(server_config(tmp_path, semantic=False, tenants=False))
    positions = app.state.gateway.backends["tiny"].max_positions
    assert app.state.max_body_bytes == max(1 << 20, positions * 64 + 64 * 1024)


def test_a_prompt_longer_than_any_context_is_refused_untokenized(server: LiveServer) -> None:
    backend = server.gateway.backends["tiny"]
    assert backend.max_prompt_chars is not None
    calls = []
    real = backend.tokenizer.__class__.__call__

    def counting(self: Any, *a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(self, *a, **kw)

    text = "z" * (backend.max_prompt_chars + 1)
    assert len(json.dumps(text)) < BODY_LIMIT
    backend.tokenizer.__class__.__call__ = counting
    try:
        with server.client(ACME) as c:
            err = _error(c.post("/v1/completions", json={"model": "tiny", "prompt": text}), 400)
    finally:
        backend.tokenizer.__class__.__call__ = real
    assert err["param"] == "prompt" and "characters" in err["message"]
    assert calls == []  # refused before the tokenizer ran


# --- no 5xx on bad input ------------------------------------------------------------------------

BAD_BODIES: list[tuple[str, bytes, str | None, str]] = [
    ("lone surrogate", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages.0.content", "surrogate"),
    ("surrogate in a key", b'{"model": "tiny", "messages": [], "\\udc00": 1}', None, "surrogate"),
    ("invalid UTF-8", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     None, "UTF-8"),
    ("deep nesting", b'{"model": "tiny", "messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
     None, "nests deeper"),
    ("nesting past MAX_DEPTH", b'{"model": "tiny", "user": ' + b"[" * 80 + b"]" * 80 + b"}",
     None, "nests deeper"),
    ("not JSON", b'{"model": "tiny", "messages": [', None, "not valid JSON"),
    ("stream as text", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
     b'"stream": "yes"}', "stream", "boolean"),
    ("seed past 64 bits", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
     b'"seed": 123456789012345678901234567890}', "seed", "less than"),
    ("content of the wrong type", b'{"model": "tiny", "messages": [{"role": "user", '
     b'"content": 5}]}', "messages.0.content", ""),
]


@pytest.mark.parametrize(("raw", "param", "says"), [b[1:] for b in BAD_BODIES],
                         ids=[b[0] for b in BAD_BODIES])
def test_malformed_bodies_get_400_naming_the_problem(server: LiveServer, raw: bytes,
                                                     param: str | None, says: str) -> None:
    with server.client(ACME) as c:
        r = c.post("/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"})
        err = _error(r, 400)
        assert err["param"] == param and says in err["message"], err
        # the connection stays usable: the next request on it is answered
        ok = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER,
                                                  "max_tokens": 2})
        assert ok.status_code == 200


REFUSED_FIELDS = [
    ("logprobs", True), ("top_logprobs", 3), ("logit_bias", {"42": 5}),
    ("response_format", {"type": "json_object"}), ("presence_penalty", 0.5),
    ("frequency_penalty", -1), ("tool_choice", "required"),
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("modalities", ["audio"]),
    ("audio", {"voice": "x"}), ("prediction", {"type": "content", "content": "x"}),
]
ACCEPTED_NEUTRAL = [
    ("logprobs", False), ("top_logprobs", 0), ("logit_bias", {}), ("logit_bias", None),
    ("response_format", {"type": "text"}), ("presence_penalty", 0), ("tool_choice", "none"),
    ("modalities", ["text"]),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_FIELDS)
def test_fields_that_change_the_answer_are_refused(server: LiveServer, field: str,
                                                   value: Any) -> None:
    with server.client(ACME) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER,
                                                 field: value})
    err = _error(r, 400)
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize(("field", "value"), ACCEPTED_NEUTRAL)
def test_neutral_values_of_unsupported_fields_are_accepted(server: LiveServer, field: str,
                                                           value: Any) -> None:
    with server.client(ACME) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER,
                                                 "max_tokens": 2, field: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [("best_of", 2), ("logprobs", 2), ("echo", "no")])
def test_completions_refuse_answer_changing_fields(server: LiveServer, field: str,
                                                   value: Any) -> None:
    with server.client(ACME) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", field: value})
    assert _error(r, 400)["param"] == field


# JSON values, including strings with lone surrogates and other odd code points
_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
                     lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(_TEXT, kids, max_size=3), max_leaves=8)
_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "n", "stream", "stream_options", "stop", "seed", "user", "logprobs",
           "top_logprobs", "logit_bias", "response_format", "tools", "tool_choice", "echo",
           "suffix", "best_of", "presence_penalty", "cache_salt", "extra_body"]
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "wizard", ""])
                                  | _JSON, "content": _TEXT | _JSON})
_BODY = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "chain", "nope"]) | _JSON},
    optional={"messages": st.lists(_MESSAGE, max_size=3) | _JSON,
              "prompt": _TEXT | _JSON, "max_tokens": st.integers(-2, 20) | _JSON,
              **{f: _JSON for f in _FIELDS if f not in ("model", "messages", "prompt",
                                                        "max_tokens")}})


def _encode(body: Any) -> bytes:
    # json.dumps writes lone surrogates as \\udXXX escapes (valid JSON, invalid Unicode)
    return json.dumps(body, allow_nan=True).encode()


@given(body=_BODY, endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       raw=st.none() | st.binary(max_size=64))
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_bodies_never_get_a_5xx_or_a_traceback(server: LiveServer, body: Any,
                                                      endpoint: str, raw: bytes | None) -> None:
    """Generated bodies (wrong types, odd values, lone surrogates, raw bytes): 2xx or 4xx in
    OpenAI's error shape, never a 5xx, never a traceback in the body."""
    content = raw if raw is not None else _encode(body)
    with server.client(ACME) as c:
        r = c.post(endpoint, content=content, headers={"content-type": "application/json",
                                                       "Cache-Control": "no-store"})
    assert r.status_code < 500, (content[:300], r.text[:500])
    assert "Traceback" not in r.text and 'File "' not in r.text
    if r.status_code >= 400:
        assert {"message", "type", "param", "code"} <= set(r.json()["error"])


# --- usage on a semantic hit --------------------------------------------------------------------

def test_usage_counts_this_requests_prompt_on_a_semantic_hit(server: LiveServer) -> None:
    first = [{"role": "user", "content": "How do I reset my account password?"}]
    para = [{"role": "user", "content": "How can I reset the password of my account, please?"}]
    with server.client(BETA) as c:
        stored = c.post("/v1/chat/completions", json={"model": "tiny", "messages": first,
                                                      "max_tokens": 6})
        hit = c.post("/v1/chat/completions", json={"model": "tiny", "messages": para,
                                                   "max_tokens": 6})
        assert hit.headers["x-semcomm-hits"] == "semantic"
        miss = c.post("/v1/chat/completions", json={"model": "tiny", "messages": para,
                                                    "max_tokens": 6},
                      headers={"Cache-Control": "no-cache, no-store"})
        assert miss.headers["x-semcomm-hits"] != "semantic"
    counted = miss.json()["usage"]["prompt_tokens"]
    assert stored.json()["usage"]["prompt_tokens"] != counted  # the stored count would differ
    assert hit.json()["usage"]["prompt_tokens"] == counted
    assert hit.json()["usage"]["total_tokens"] == counted + hit.json()["usage"][
        "completion_tokens"]
    assert hit.json()["semcomm"]["semantic"]["prompt_tokens"] == "this request"


# --- who sees what ------------------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w:/.~-])/(?:home|root|tmp|usr|var|opt|etc|srv|mnt|work)/")


def _no_paths(text: str) -> None:
    assert not _PATH.search(text), _PATH.search(text)


def test_unauthenticated_health_says_only_ok_or_degraded(server: LiveServer) -> None:
    for headers in ({}, {"Authorization": f"Bearer {ACME}"}, {"Authorization": "Bearer bad"}):
        r = httpx.get(f"{server.url}/health", headers=headers)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, headers
    full = httpx.get(f"{server.url}/health", headers=ADMIN)
    assert {"models", "semantic", "kv", "memory", "wiring", "down"} <= set(full.json())
    _no_paths(full.text)
    _no_paths(httpx.get(f"{server.url}/admin/stats", headers=ADMIN).text)


@pytest.mark.parametrize("path", ["/metrics", "/dashboard", "/dashboard/data", "/docs", "/redoc",
                                  "/openapi.json"])
def test_ops_endpoints_need_the_admin_key(server: LiveServer, path: str) -> None:
    assert httpx.get(f"{server.url}{path}").status_code == 401
    if path != "/dashboard/data":  # a tenant key opens the tenant's own counters there
        assert httpx.get(f"{server.url}{path}",
                         headers={"Authorization": f"Bearer {ACME}"}).status_code == 401
    r = httpx.get(f"{server.url}{path}", headers=ADMIN)
    assert r.status_code == 200
    _no_paths(r.text)


def test_a_tenant_sees_only_its_own_counters(server: LiveServer) -> None:
    msgs = [{"role": "system", "content": "Dashboard isolation check."}, *USER]
    with server.client(ACME) as a, server.client(BETA) as b, server.client(ADMIN_KEY) as adm:
        before = {k: c.get("/dashboard/data").json() for k, c in (("a", a), ("b", b),
                                                                  ("adm", adm))}
        for _ in range(3):
            assert b.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs,
                                                        "max_tokens": 2}).status_code == 200
        after = {k: c.get("/dashboard/data").json() for k, c in (("a", a), ("b", b),
                                                                 ("adm", adm))}
    assert after["a"]["requests"] == before["a"]["requests"]  # beta's traffic is not acme's
    assert after["b"]["requests"] == before["b"]["requests"] + 3
    assert after["adm"]["requests"] == before["adm"]["requests"] + 3
    a_ids = {p["id"] for p in after["a"]["top_prefixes"]}
    b_ids = {p["id"] for p in after["b"]["top_prefixes"]}
    assert b_ids and not a_ids & b_ids
    assert after["a"]["tiers"] == {} and after["a"]["memory"] is None
    assert after["adm"]["tiers"] and after["adm"]["memory"] is not None


def test_open_endpoints_and_the_metrics_key(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, semantic=False, open_endpoints=["health", "docs", "dashboard"],
                        metrics_key="scrape-key")
    with live_server(cfg) as srv:
        assert "models" in httpx.get(f"{srv.url}/health").json()
        assert httpx.get(f"{srv.url}/openapi.json").status_code == 200
        assert httpx.get(f"{srv.url}/dashboard/data").status_code == 200
        assert httpx.get(f"{srv.url}/metrics").status_code == 401
        for key in ("scrape-key", ADMIN_KEY):
            assert httpx.get(f"{srv.url}/metrics",
                             headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_without_an_admin_key_ops_endpoints_say_how_to_open_them(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, semantic=False, admin_key=None)
    with live_server(cfg) as srv:
        r = httpx.get(f"{srv.url}/metrics")
        err = _error(r, 403)
        assert "server.admin_key" in err["message"] and "open_endpoints" in err["message"]
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}


def test_single_user_server_stays_open(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, semantic=False, tenants=False, admin_key=None)
    with live_server(cfg) as srv:
        for path in ("/metrics", "/docs", "/openapi.json", "/dashboard/data"):
            assert httpx.get(f"{srv.url}{path}").status_code == 200, path
        assert "models" in httpx.get(f"{srv.url}/health").json()


def test_redact_paths() -> None:
    from semcomm.server._app import redact_paths

    out = redact_paths({"a": "fuser /root/.cache/semcomm/fusers/qwen-smol ready",
                        "b": ["http://127.0.0.1:8001/v1", "redis://h:6379/0", "x/y"],
                        "c": "file ~/secret/dir/f.json"})
    assert out == {"a": "fuser .../qwen-smol ready",
                   "b": ["http://127.0.0.1:8001/v1", "redis://h:6379/0", "x/y"],
                   "c": "file .../f.json"}


def test_raw_socket_surrogate_keeps_the_connection(server: LiveServer) -> None:
    """The probe's finding: a lone surrogate used to reset the keep-alive connection."""
    body = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    good = json.dumps({"model": "tiny", "max_tokens": 2, "messages": USER}).encode()

    def request(b: bytes) -> bytes:
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nAuthorization: Bearer " + ACME.encode() + b"\r\nContent-Length: "
                + str(len(b)).encode() + b"\r\n\r\n" + b)

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(request(body))
        first = _read_response(s)
        s.sendall(request(good))
        second = _read_response(s)
    assert first.startswith(b"HTTP/1.1 400") and b"Traceback" not in first
    assert second.startswith(b"HTTP/1.1 200")


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(rest) < length:
        rest += s.recv(65536)
    return head + b"\r\n\r\n" + rest
