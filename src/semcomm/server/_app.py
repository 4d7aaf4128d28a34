"""The FastAPI app: OpenAI-compatible endpoints over a :class:`Gateway`, plus ops endpoints.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /dashboard``
and ``GET /dashboard/data``, ``GET /docs``, ``GET /redoc``, ``GET /openapi.json``,
``GET /admin/stats`` and ``POST /admin/invalidate`` (admin key).

Who may call what (docs/SECURITY.md, "Endpoints"): once a key is configured (a tenant or the
admin key), ``/health`` without the admin key says only ``ok`` or ``degraded``; ``/metrics``,
``/dashboard``, the docs and the OpenAPI schema need the admin key (``/metrics`` also takes
``server.metrics_key``) unless listed in ``server.open_endpoints``; ``/dashboard/data`` with a
tenant's key shows that tenant's own counters. No response carries a filesystem path.

Bodies are bounded and checked before any work (``_body``): 413 over ``server.max_body_bytes``,
400 for invalid UTF-8, lone surrogates or too deep a nesting, naming the field.

Every answer to a generation request carries ``x-semcomm-hits``: the layers that served this
request from cache, for this tenant only (``semantic``, ``kv:<tokens>``, ``c2c`` or ``none``);
a model with several replicas adds ``x-semcomm-replica`` (``worker-0``, ``upstream-1``, ...).
Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    InvalidInputError,
    OverloadedError,
    SemcommError,
    TenantError,
    UpstreamError,
)
from ..runtime import Completion, Delta
from ._backends import GenRequest, Piece, collect
from ._body import BadBody, BodyLimit, BodyTooLarge, StrictJSONRoute, default_body_limit
from ._config import ServerConfig, load_config
from ._dashboard import dashboard_data
from ._faults import InjectedFault
from ._gateway import Gateway, ModelNotFound, Served
from ._schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    usage_dict,
)
from ._wiring import build_gateway

__all__ = ["create_app"]

log = logging.getLogger(__name__)

HITS_HEADER = "x-semcomm-hits"
REPLICA_HEADER = "x-semcomm-replica"  # which worker or upstream served it (several replicas)


# an absolute filesystem path in a message ("/root/.cache/semcomm/fusers/x"), not a URL path
# ("http://h:1/v1" has a word character or ':' before its slashes)
_ABS_PATH = re.compile(r"(?<![\w:/.~-])(?:~|/)(?:[^\s'\"(),;:]*/)+([^\s'\"(),;:/]*)")
# parts of a pydantic error location that name a union branch or a validator, not a field
_LOC_NOISE = re.compile(r"^(str|int|float|bool|list|dict|none|StrictBool)$|[\[\]-]")


def redact_paths(obj: Any) -> Any:
    """``obj`` with every absolute filesystem path in its strings cut to its last part
    (``.../name``): responses name what was wired, never where it lives on disk."""
    if isinstance(obj, str):
        return _ABS_PATH.sub(lambda m: f".../{m.group(1)}", obj)
    if isinstance(obj, dict):
        return {k: redact_paths(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_paths(v) for v in obj]
    return obj


class InvalidateRequest(BaseModel):
    tag: str | None = Field(None, min_length=1)
    scope: str | None = Field(None, min_length=1)
    tenant: str | None = Field(None, min_length=1)


def _err(status: int, message: str, type_: str, *, param: str | None = None,
         code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param=param, code=code), status_code=status,
                        headers={HITS_HEADER: "none", **(headers or {})})


def _error_response(exc: BaseException) -> JSONResponse:
    """Map an exception raised before any byte was sent to an OpenAI-style error."""
    if isinstance(exc, ModelNotFound):
        return _err(404, str(exc), "invalid_request_error", param="model",
                    code="model_not_found")
    if isinstance(exc, OverloadedError):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        status = int(getattr(exc, "status_code", 429))
        return _err(status, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": retry})
    if isinstance(exc, TenantError):
        status = int(getattr(exc, "status_code", 401))
        if status == 400:
            return _err(400, str(exc), "invalid_request_error",
                        param=getattr(exc, "field", None), code="client_salt_refused")
        return _err(401, str(exc), "invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
    if isinstance(exc, InvalidInputError):
        return _err(400, str(exc), "invalid_request_error", param=getattr(exc, "param", None))
    if isinstance(exc, UpstreamError):
        st = exc.status or 502
        if st == 429:
            return _err(429, str(exc), "rate_limit_error", code="upstream_rate_limited",
                        headers={"Retry-After": "1"})
        if st in (400, 404, 413, 422):
            return _err(400, str(exc), "invalid_request_error", code="upstream_rejected")
        status = 504 if st == 504 else 502
        return _err(status, str(exc), "upstream_error",
                    code="upstream_timeout" if status == 504 else "upstream_failed")
    if isinstance(exc, InjectedFault):
        headers = {"Retry-After": str(int(exc.retry_after_s))} if exc.retry_after_s else None
        return _err(exc.status, str(exc), "server_error", code="injected_failure",
                    headers=headers)
    if isinstance(exc, asyncio.TimeoutError):
        return _err(504, "the request timed out in the gateway", "timeout_error",
                    code="timeout")
    if isinstance(exc, SemcommError):
        return _err(500, str(exc), "server_error")
    log.exception("unexpected error", exc_info=exc)
    return _err(500, "internal error (see the server log)", "server_error")


def _too_large(exc: BodyTooLarge) -> JSONResponse:
    return _err(413, str(exc.detail), "invalid_request_error", code="request_too_large")


def _cache_flags(request: Request) -> tuple[bool, bool]:
    cc = request.headers.get("cache-control", "").lower()
    return "no-cache" in cc, "no-store" in cc


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _HitsHeader:
    """ASGI middleware: every HTTP response carries ``x-semcomm-hits`` (``none`` unless set)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = message.setdefault("headers", [])
                if not any(k.lower() == b"x-semcomm-hits" for k, _ in headers):
                    headers.append((b"x-semcomm-hits", b"none"))
            await send(message)

        await self.app(scope, receive, send_with_header)


def create_app(config: ServerConfig | str | None = None, *, gateway: Gateway | None = None
               ) -> FastAPI:
    """Build the app. ``config`` is a :class:`ServerConfig`, a TOML path, or None (defaults);
    its gateway is built at once (models loaded), unless ``gateway`` is given."""
    if gateway is None:
        if config is None or isinstance(config, str):
            config = load_config(config)
        gateway = build_gateway(config)
    gw = gateway
    cfg: ServerConfig = gw.config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    body_limit = cfg.server.max_body_bytes or default_body_limit(gw.backends.values())
    # the docs and the schema are routes of our own below, behind the same access rule as the
    # other ops endpoints
    app = FastAPI(title="semcomm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible gateway with semantic, KV-prefix and "
                              "cache-to-cache reuse inside tenant boundaries.",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = StrictJSONRoute  # strict UTF-8, no lone surrogates, bounded depth
    app.state.gateway = gw
    app.state.max_body_bytes = body_limit
    app.add_middleware(_HitsHeader)
    app.add_middleware(BodyLimit, limit=body_limit, respond=_too_large)  # outermost of ours

    # --- errors ----------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            loc = []  # the location is a character offset, not a field
        loc = [p for p in loc if not _LOC_NOISE.search(p)]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            why = (first.get("ctx") or {}).get("error")
            pos = first.get("loc", ("body", None))[-1]
            msg = "the request body is not valid JSON" + (
                f" ({why} at character {pos})" if why and isinstance(pos, int) else "")
        elif first.get("type") == "missing":
            msg = f"missing required parameter {param!r}"
        else:
            msg = f"invalid parameter {param!r}: {first.get('msg', 'invalid value')}"
        return _err(400, msg, "invalid_request_error", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BadBody):
            return _err(400, str(exc.detail), "invalid_request_error", param=exc.param)
        if isinstance(exc, BodyTooLarge):
            return _too_large(exc)
        typ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _err(exc.status_code, str(exc.detail), typ)

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(exc)

    # handled in the exception middleware (a clean response, no traceback in the log)
    for cls in (SemcommError, InjectedFault, asyncio.TimeoutError):
        app.add_exception_handler(cls, _known)
    # anything else: a 500 in OpenAI's shape (the server error middleware logs it)
    app.add_exception_handler(Exception, _known)

    # --- generation ------------------------------------------------------------------------------
    def _auth(request: Request) -> str | None:
        return gw.authenticate(request.headers.get("authorization"))

    def _max_tokens(asked: int | None) -> int:
        n = asked if asked is not None else cfg.server.default_max_tokens
        if n > cfg.server.max_tokens_limit:
            e = InvalidInputError(f"max_tokens is {n}; this server allows at most "
                                  f"{cfg.server.max_tokens_limit}")
            e.param = "max_tokens"  # type: ignore[attr-defined]
            raise e
        return n

    def _headers(served: Served, rid: str) -> dict[str, str]:
        out = {HITS_HEADER: served.hits_header, "x-semcomm-model": served.model,
               "x-request-id": rid}
        if served.replica:
            out[REPLICA_HEADER] = served.replica
        return out

    def _sampling(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        return {"temperature": body.temperature if body.temperature is not None else 0.0,
                "top_p": body.top_p if body.top_p is not None else 1.0,
                "stop": body.stop_list(), "seed": body.seed, "stream": bool(body.stream)}

    async def _generate(request: Request, body: ChatCompletionRequest | CompletionRequest,
                        req: GenRequest, endpoint: str) -> Response:
        """The one handler behind both generation endpoints: the gateway serves ``req`` within
        ``server.request_timeout_s`` (the whole request, streamed or not), the answer is shaped
        for ``endpoint`` ("chat" or "completions")."""
        chat = endpoint == "chat"
        rid = req.request_id
        no_cache, no_store = _cache_flags(request)
        deadline = asyncio.get_running_loop().time() + cfg.server.request_timeout_s

        async def serve() -> tuple[Served, Completion | None]:
            served = await gw.serve(req, endpoint=endpoint,
                                    body=body.model_dump(exclude_none=True),
                                    headers=dict(request.headers), no_cache=no_cache,
                                    no_store=no_store)
            return served, None if body.stream else await collect(served.items)

        # a task of its own: the path's awaits resume its short chain, not the app's as well
        served, final = await asyncio.wait_for(serve(), cfg.server.request_timeout_s)
        headers = _headers(served, rid)
        if final is not None:
            usage = usage_dict(final.prompt_tokens, final.completion_tokens, final.hit_tokens,
                               final.meta.get("documents"))
            meta = {**final.meta, "hits": final.hits or ["none"]}
            shape = chat_response if chat else completion_response
            return JSONResponse(shape(rid, served.model, final.text, final.finish_reason, usage,
                                      meta), headers=headers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        created = int(time.time())

        def chunk(**kw: Any) -> bytes:
            if chat:
                return _sse(chat_chunk(rid, served.model, created, **kw))
            if "content" in kw:
                kw["text"] = kw.pop("content")
            return _sse(completion_chunk(rid, served.model, created, **kw))

        async def events() -> AsyncIterator[bytes]:
            if chat:
                yield chunk(content="", role=True)
            try:
                async with asyncio.timeout_at(deadline):
                    async for item in served.items:
                        if isinstance(item, Delta):
                            yield chunk(content=item.text)
                        elif isinstance(item, Completion):
                            meta = {**item.meta, "hits": item.hits or ["none"]}
                            yield chunk(content="" if not chat else None,
                                        finish=item.finish_reason, meta=meta)
                            if include_usage:
                                yield chunk(empty=True, usage=usage_dict(
                                    item.prompt_tokens, item.completion_tokens, item.hit_tokens,
                                    item.meta.get("documents")))
            except Exception as exc:
                log.warning("stream %s failed: %s", rid, exc)
                yield _sse(json.loads(bytes(_error_response(exc).body)))
                return
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions", summary="Chat completion (OpenAI-compatible)")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        roles = ["system" if m.role == "developer" else m.role for m in body.messages]
        docs = body.semcomm_documents
        req = GenRequest(
            model=body.model, tenant=_auth(request),
            messages=[{"role": r, "content": m.text()} for r, m in zip(roles, body.messages)],
            prompt=None, max_tokens=_max_tokens(body.max_completion_tokens or body.max_tokens),
            request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}", **_sampling(body),
            documents=[Piece(r, text, doc) for r, m in zip(roles, body.messages)
                       for text, doc in m.pieces()]
            if any(m.has_documents() for m in body.messages) else None,
            selector=docs.selector if docs else None,
            recompute=docs.recompute if docs else None,
            margin=docs.margin if docs else None,
            watch=docs.watch if docs else None)
        return await _generate(request, body, req, "chat")

    @app.post("/v1/completions", summary="Text completion (OpenAI-compatible)")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = _auth(request)
        if body.echo or body.suffix:
            e = InvalidInputError("echo and suffix are not supported")
            e.param = "echo" if body.echo else "suffix"  # type: ignore[attr-defined]
            raise e
        req = GenRequest(model=body.model, tenant=tenant, messages=None,
                         prompt=body.prompt_text(), max_tokens=_max_tokens(body.max_tokens),
                         request_id=f"cmpl-{uuid.uuid4().hex[:24]}", **_sampling(body))
        if not req.prompt:
            e = InvalidInputError("prompt must not be empty")
            e.param = "prompt"  # type: ignore[attr-defined]
            raise e
        return await _generate(request, body, req, "completions")

    # --- models, health, metrics -----------------------------------------------------------------
    @app.get("/v1/models", summary="List models")
    async def list_models(request: Request) -> JSONResponse:
        tenant = _auth(request)
        data = []
        for name in gw.model_names(tenant):
            b = gw.backends[name]
            data.append({"id": name, "object": "model", "created": int(gw.stats.started),
                         "owned_by": "semcomm", "semcomm": {"kind": b.kind}})
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id}", summary="Describe one model")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        tenant = _auth(request)
        if model_id not in gw.model_names(tenant):
            raise ModelNotFound(model_id, gw.model_names(tenant))
        return JSONResponse({"id": model_id, "object": "model", "created": int(gw.stats.started),
                             "owned_by": "semcomm"})

    # --- ops endpoints: who may see what (docs/SECURITY.md, "Endpoints") -----------------------
    def _ops_denied(request: Request, name: str) -> JSONResponse | None:
        """None when the caller may see the ops endpoint ``name``, else the refusal."""
        auth = request.headers.get("authorization")
        metrics_key = cfg.server.metrics_key if name == "metrics" else None
        if metrics_key:  # a metrics key protects /metrics in every mode
            if gw.is_admin(auth) or gw.has_key(auth, metrics_key):
                return None
            return _err(401, "metrics need 'Authorization: Bearer <metrics_key>' (or the "
                        "admin key)", "invalid_request_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
        if not cfg.keys_configured or name in cfg.server.open_endpoints or gw.is_admin(auth):
            return None
        path = request.url.path
        if not cfg.server.admin_key:
            return _err(403, f"{path} needs the admin key: set server.admin_key (or list "
                        f"{name!r} in server.open_endpoints)", "permission_error",
                        code="admin_disabled")
        return _err(401, f"{path} needs 'Authorization: Bearer <admin_key>' (or {name!r} in "
                    "server.open_endpoints)", "invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health", summary="Health: ok or degraded; details with the admin key")
    async def health(request: Request) -> JSONResponse:
        if _ops_denied(request, "health") is None:
            return JSONResponse(redact_paths(gw.health()), status_code=200)
        return JSONResponse({"status": gw.health_status()}, status_code=200)

    @app.get("/metrics", summary="Prometheus metrics (all prefixed semcomm_)")
    async def metrics(request: Request) -> Response:
        denied = _ops_denied(request, "metrics")
        if denied is not None:
            return denied
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        gw.health()  # refresh gauges
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema(request: Request) -> JSONResponse:
        denied = _ops_denied(request, "docs")
        return denied if denied is not None else JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> Response:
        denied = _ops_denied(request, "docs")
        return denied if denied is not None else get_swagger_ui_html(
            openapi_url="/openapi.json", title="semcomm - API")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> Response:
        denied = _ops_denied(request, "docs")
        return denied if denied is not None else get_redoc_html(
            openapi_url="/openapi.json", title="semcomm - API")

    # --- dashboard -------------------------------------------------------------------------------
    @app.get("/dashboard", response_class=HTMLResponse, summary="Live dashboard")
    async def dashboard(request: Request) -> Response:
        denied = _ops_denied(request, "dashboard")
        if denied is not None:
            return denied
        html = resources.files("semcomm.server").joinpath("static/dashboard.html").read_text(
            encoding="utf-8")
        return HTMLResponse(html, headers={"Content-Security-Policy":
                                           "default-src 'self'; script-src 'unsafe-inline'; "
                                           "style-src 'unsafe-inline'; img-src data:"})

    @app.get("/dashboard/data", summary="Figures behind the dashboard (JSON): everything for "
             "the admin, a tenant's own counters for its key")
    async def dashboard_json(request: Request) -> JSONResponse:
        auth = request.headers.get("authorization")
        if gw.is_admin(auth) or (not auth and _ops_denied(request, "dashboard") is None):
            return JSONResponse(redact_paths(dashboard_data(gw)))
        tenant = gw.authenticate(auth)  # 401 for a wrong or missing key
        return JSONResponse(dashboard_data(gw, tenant=tenant))

    # --- admin -----------------------------------------------------------------------------------
    def _admin(request: Request) -> JSONResponse | None:
        if not cfg.server.admin_key:
            return _err(403, "admin endpoints are disabled: set server.admin_key",
                        "permission_error", code="admin_disabled")
        if not gw.is_admin(request.headers.get("authorization")):
            return _err(401, "admin endpoints need 'Authorization: Bearer <admin_key>'",
                        "invalid_request_error", code="invalid_api_key")
        return None

    @app.get("/admin/stats", summary="Cache statistics (admin key)")
    async def admin_stats(request: Request) -> JSONResponse:
        denied = _admin(request)
        if denied is not None:
            return denied
        return JSONResponse(redact_paths({"stores": gw.store_stats(), "health": gw.health(),
                                          "dashboard": dashboard_data(gw)}))

    @app.post("/admin/invalidate", summary="Invalidate semantic entries by tag or scope (admin)")
    async def admin_invalidate(body: InvalidateRequest, request: Request) -> JSONResponse:
        denied = _admin(request)
        if denied is not None:
            return denied
        if not body.tag and not body.scope:
            raise InvalidInputError("give a tag or a scope to invalidate")
        if body.tenant is not None and body.tenant not in cfg.tenants:
            raise InvalidInputError(f"unknown tenant {body.tenant!r}")
        if gw.semantic is None:
            return _err(409, "the semantic cache is not enabled", "invalid_request_error")
        n = await asyncio.to_thread(gw.semantic.invalidate, tag=body.tag, scope=body.scope,
                                    tenant=body.tenant)
        return JSONResponse({"invalidated": n})

    return app
