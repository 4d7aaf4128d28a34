"""The gateway tells a vLLM upstream each request's tenant, and the connector's reading agrees.

The upstream is a real HTTP server on loopback (stdlib ``http.server``) that answers like an
OpenAI-compatible server and records every request body it receives; vLLM itself does not run
here (``make vllm-test`` runs it). The connector side is semcomm's own code
(``integrations._vllm_core``: ``tenant_of`` and the namespaces), applied to the recorded bodies.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from semcomm.security import NO_TENANT_DIGEST, TenantContext, TenantSalter
from semcomm.server._backends import GenRequest
from semcomm.server._upstream import VLLM_TENANT_PARAM, UpstreamBackend, upstream_tenant_fields

from .test_server_support import TENANTS, LiveServer, live_server, server_config

SECRET = "ab" * 32


class Recorder:
    """An OpenAI-compatible stub upstream that keeps the JSON bodies it was sent.

    ``script`` holds raw replies ``(status, headers, body)``, one per request, answered before
    the built-in ones (for streams and failures written byte by byte).
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.script: list[tuple[int, dict[str, str], bytes]] = []
        self._lock = threading.Lock()
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet test output
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", "0"))
                body = json.loads(self.rfile.read(n))
                with rec._lock:
                    rec.bodies.append(body)
                    scripted = rec.script.pop(0) if rec.script else None
                if scripted is not None:
                    status, headers, raw = scripted
                    self.send_response(status)
                    for name, value in {**headers, "content-length": str(len(raw))}.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    for ev in ({"choices": [{"index": 0, "delta": {"content": "ok"},
                                             "finish_reason": None}]},
                               {"choices": [{"index": 0, "delta": {},
                                             "finish_reason": "stop"}]},
                               {"choices": [], "usage": usage}):
                        self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                out = {"id": "x", "object": "chat.completion", "model": body["model"],
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "ok"}}],
                       "usage": usage}
                raw = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self.bodies = self.bodies, []
        return out


@pytest.fixture(scope="module")
def recorders() -> Iterator[list[Recorder]]:
    recs = [Recorder() for _ in range(3)]
    for r in recs:
        r.thread.start()
    yield recs
    for r in recs:
        r.server.shutdown()
        r.server.server_close()


@pytest.fixture(scope="module")
def gateway(recorders: list[Recorder], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LiveServer]:
    a, b, plain = recorders
    cfg = server_config(
        tmp_path_factory.mktemp("gw"), semantic=False, secret=SECRET,
        models={
            "vllm": {"kind": "upstream", "base_urls": [a.url, b.url], "upstream_model": "m",
                     "forward_tenant": "vllm", "max_retries": 0},
            "plain": {"kind": "upstream", "base_url": plain.url, "upstream_model": "m",
                      "max_retries": 0},
        },
        pipelines={},
    )
    with live_server(cfg) as srv:
        yield srv


def _ask(srv: LiveServer, key: str, model: str, text: str, *, stream: bool = False,
         **extra: Any) -> httpx.Response:
    with srv.client(key) as c:
        return c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
            "stream": stream, **extra})


def _sent(recorders: list[Recorder]) -> list[dict[str, Any]]:
    return [b for r in recorders for b in r.take()]


def _connector_namespace(body: dict[str, Any]) -> bytes:
    """The namespace semcomm's vLLM connector would key this request's chunks under."""
    from semcomm.integrations._vllm_core import NamespaceFactory, tenant_of

    tenant = tenant_of(body.get("kv_transfer_params"), body.get("cache_salt"))
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16", codec="lossless",
                          secret=SECRET)
    return bytes(ns.digest(tenant))


def test_each_tenant_reaches_vllm_with_its_own_namespace(gateway: LiveServer,
                                                         recorders: list[Recorder]) -> None:
    _sent(recorders)
    salter = TenantSalter(bytes.fromhex(SECRET))
    seen: dict[str, list[dict[str, Any]]] = {}
    for tenant, key in TENANTS.items():
        for stream in (False, True):
            r = _ask(gateway, key, "vllm", "the same long shared prompt", stream=stream)
            assert r.status_code == 200, r.text
            (body,) = _sent(recorders)
            seen.setdefault(tenant, []).append(body)
    namespaces = {}
    for tenant, bodies in seen.items():
        want = salter.digest(tenant)  # the gateway's salt digest of this tenant
        for body in bodies:
            assert body["kv_transfer_params"] == {VLLM_TENANT_PARAM: want}
            assert body["cache_salt"] == want
        # the connector maps every request of one tenant to one namespace (streams too)
        (namespaces[tenant],) = {_connector_namespace(b) for b in bodies}
    assert namespaces["acme"] != namespaces["beta"]
    public = _connector_namespace({})
    assert public not in namespaces.values()


def test_the_connector_reads_the_field_the_gateway_writes() -> None:
    from semcomm.integrations._vllm_core import TENANT_PARAM

    assert VLLM_TENANT_PARAM == TENANT_PARAM


def test_plain_upstreams_get_openai_fields_only(gateway: LiveServer,
                                               recorders: list[Recorder]) -> None:
    _sent(recorders)
    r = _ask(gateway, TENANTS["acme"], "plain", "hello")
    assert r.status_code == 200, r.text
    (body,) = _sent(recorders)
    assert "kv_transfer_params" not in body and "cache_salt" not in body


def test_clients_cannot_choose_the_forwarded_tenant(gateway: LiveServer,
                                                    recorders: list[Recorder]) -> None:
    _sent(recorders)
    beta = TenantSalter(bytes.fromhex(SECRET)).digest("beta")
    r = _ask(gateway, TENANTS["acme"], "vllm", "hi", cache_salt=beta)
    assert r.status_code == 400  # a client-chosen salt is refused before any upstream call
    assert _sent(recorders) == []
    r = _ask(gateway, TENANTS["acme"], "vllm", "hi",
             kv_transfer_params={VLLM_TENANT_PARAM: beta})
    assert r.status_code == 200, r.text  # accepted: the field is not passed through
    (body,) = _sent(recorders)
    acme = TenantSalter(bytes.fromhex(SECRET)).digest("acme")
    assert body["kv_transfer_params"] == {VLLM_TENANT_PARAM: acme}
    assert body["cache_salt"] == acme


def test_tenant_fields_by_context() -> None:
    digest = TenantSalter(bytes.fromhex(SECRET)).digest("acme")
    assert upstream_tenant_fields(TenantContext.public()) == {}
    assert upstream_tenant_fields(TenantContext("acme", digest)) == {
        "kv_transfer_params": {VLLM_TENANT_PARAM: digest}, "cache_salt": digest}
    one = upstream_tenant_fields(TenantContext("acme", digest, isolate=True))
    two = upstream_tenant_fields(TenantContext("acme", digest, isolate=True))
    assert one["cache_salt"] != two["cache_salt"] != digest  # never reused, never the tenant's
    assert one["kv_transfer_params"][VLLM_TENANT_PARAM] == one["cache_salt"]
    with pytest.raises(RuntimeError, match="no salt digest"):
        upstream_tenant_fields(TenantContext("acme", ""))
    assert NO_TENANT_DIGEST not in str(upstream_tenant_fields(TenantContext("acme", digest)))


def test_forward_tenant_is_checked() -> None:
    with pytest.raises(ValueError, match="forward_tenant"):
        UpstreamBackend("x", base_url="http://127.0.0.1:9/v1", forward_tenant="sglang")
    up = UpstreamBackend("x", base_url="http://127.0.0.1:9/v1", forward_tenant="vllm")
    _, body = up._body(GenRequest(model="x", prompt="p", messages=None, max_tokens=1), stream=False)
    assert "cache_salt" not in body  # a public request (built outside the gateway)
