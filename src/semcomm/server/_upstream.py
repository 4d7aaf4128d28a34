"""An OpenAI-compatible model server reached over HTTP, served as one of the gateway's models.

:class:`UpstreamBackend` speaks the same stream contract as every backend (``Started``,
``Delta`` pieces, one ``Completion``), with timeouts and retries only where a retry cannot
duplicate output; :func:`upstream_tenant_fields` keeps tenants apart on a vLLM upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from ..errors import UpstreamError
from ..security import TenantContext
from ._backends import BackendStatus, Completion, GenRequest, StreamItem
from ._batching import Delta, Started

__all__ = ["FORWARD_TENANT", "VLLM_TENANT_PARAM", "UpstreamBackend", "upstream_tenant_fields"]

log = logging.getLogger(__name__)

_RETRY_STATUSES = {429, 502, 503, 504}


def _error_message(resp: Any) -> str:
    try:
        body = resp.json()
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    except Exception:
        return (resp.text or "").strip()[:300] or resp.reason_phrase


VLLM_TENANT_PARAM = "semcomm_tenant"
"""The ``kv_transfer_params`` field semcomm's vLLM connector reads the tenant from (its default
``tenant_param``, ``semcomm.integrations.vllm``)."""

FORWARD_TENANT = frozenset({"off", "vllm"})
"""How an upstream is told a request's tenant: ``"off"`` (nothing; any OpenAI-compatible
server) or ``"vllm"`` (see :func:`upstream_tenant_fields`)."""


def upstream_tenant_fields(ctx: TenantContext) -> dict[str, Any]:
    """Request-body fields that keep a tenant's KV apart on a vLLM upstream.

    A tenant's value is its salt digest (``TenantContext.digest``: SHA-256 of the salt the server
    secret derives; opaque, stable, never the salt or the secret), sent twice:
    ``kv_transfer_params = {"semcomm_tenant": digest}`` selects the namespace of semcomm's vLLM
    connector (which salts it again with its own ``SEMCOMM_SECRET``), and ``cache_salt = digest``
    separates vLLM's in-process prefix cache, which ignores ``kv_transfer_params``. The public
    context (no tenant) sends nothing: vLLM's and the connector's shared namespace. An isolated
    context (a flagged prober) gets a fresh random value per request, so nothing it sends is
    served from, or to, anyone's cache.
    """
    if ctx.isolate:
        value = f"isolate:{secrets.token_hex(16)}"
    elif ctx.tenant is None:
        return {}
    elif not ctx.digest:
        raise RuntimeError(f"tenant {ctx.tenant!r} has no salt digest (not admitted by the "
                           "gateway): refusing to send it to the upstream's shared namespace")
    else:
        value = ctx.digest
    return {"kv_transfer_params": {VLLM_TENANT_PARAM: value}, "cache_salt": value}


class UpstreamBackend:
    """An OpenAI-compatible model server reached over HTTP.

    Retries (at most ``max_retries``, exponential backoff with jitter, honouring Retry-After up
    to 2 s) happen only when no output can have been produced yet: connection failures and 429,
    502, 503, 504 answers, and for streams only before the first chunk. A read timeout is not
    retried (the upstream may still be working; retrying would double its load); it becomes an
    :class:`UpstreamError` with status 504.

    ``forward_tenant="vllm"`` adds the request's tenant to every upstream call
    (:func:`upstream_tenant_fields`), for a vLLM running semcomm's KV connector: two tenants
    then never share KV in vLLM. ``"off"`` (default) sends only OpenAI fields; other servers
    may refuse the extra ones (a semcomm upstream refuses ``cache_salt``).
    """

    kind = "upstream"

    def __init__(self, name: str, *, base_url: str, api_key: str | None = None,
                 upstream_model: str | None = None, timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0, max_retries: int = 2,
                 forward_tenant: str = "off") -> None:
        import httpx

        if forward_tenant not in FORWARD_TENANT:
            raise ValueError(f"forward_tenant must be one of {sorted(FORWARD_TENANT)}, "
                             f"got {forward_tenant!r}")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.upstream_model = upstream_model or name
        self.max_retries = max_retries
        self.forward_tenant = forward_tenant
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        self._up = True
        self._detail = f"upstream {self.base_url}"
        self._in_flight = 0

    def status(self) -> BackendStatus:
        return BackendStatus(up=self._up, detail=self._detail, in_flight=self._in_flight)

    def _body(self, req: GenRequest, stream: bool) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.upstream_model,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": stream,
        }
        if req.stop:
            body["stop"] = req.stop
        if req.seed is not None:
            body["seed"] = req.seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.forward_tenant == "vllm":
            body.update(upstream_tenant_fields(req.tenant_ctx))
        if req.messages is not None:
            body["messages"] = req.messages
            return "/chat/completions", body
        body["prompt"] = req.prompt
        return "/completions", body

    def _mark(self, up: bool, detail: str) -> None:
        if up != self._up:
            log.warning("upstream model %s is now %s: %s", self.name, "up" if up else "down", detail)
        self._up, self._detail = up, detail

    async def _backoff(self, attempt: int, retry_after: str | None) -> None:
        delay = min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())
        if retry_after:
            try:
                delay = min(2.0, max(delay, float(retry_after)))
            except ValueError:
                pass
        await asyncio.sleep(delay)

    def _transport_error(self, exc: Exception, attempt: int) -> UpstreamError:
        """Mark the upstream and name a transport failure that is not retried (any more)."""
        import httpx

        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            self._mark(False, f"unreachable: {exc.__class__.__name__}")
            return UpstreamError(
                f"upstream model {self.name!r} at {self.base_url} is unreachable "
                f"({exc.__class__.__name__}) after {attempt + 1} attempts",
                status=502, retryable=True)
        if isinstance(exc, httpx.TimeoutException):
            self._mark(False, "timed out")
            return UpstreamError(
                f"upstream model {self.name!r} timed out ({exc.__class__.__name__})",
                status=504)
        self._mark(False, f"broken reply: {exc.__class__.__name__}")
        return UpstreamError(
            f"upstream model {self.name!r} broke off its reply "
            f"({exc.__class__.__name__}: {exc})", status=502)

    def _status_error(self, status: int, message: str) -> UpstreamError:
        """Mark the upstream and name an HTTP error answer that is not retried (any more)."""
        self._mark(status < 500, f"HTTP {status}")
        return UpstreamError(
            f"upstream model {self.name!r} answered HTTP {status}: {message}", status=status,
            retryable=status in _RETRY_STATUSES)

    async def _complete(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        """One JSON call (the client is not streaming): same retry rules as streams."""
        import httpx

        from ._upstream_fast import parse_completion

        path, body = self._body(req, stream=False)
        t0 = time.perf_counter()
        self._in_flight += 1
        try:
            attempt = 0
            while True:
                try:
                    resp = await self._client.post(path, json=body)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    if attempt < self.max_retries:
                        await self._backoff(attempt, None)
                        attempt += 1
                        continue
                    raise self._transport_error(exc, attempt) from exc
                except httpx.HTTPError as exc:
                    raise self._transport_error(exc, attempt) from exc
                if resp.status_code >= 400:
                    if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                        await self._backoff(attempt, resp.headers.get("retry-after"))
                        attempt += 1
                        continue
                    raise self._status_error(resp.status_code, _error_message(resp))
                break
            text, finish, usage = parse_completion(self.name, resp.content)
            if not self._up:
                self._mark(True, f"upstream {self.base_url}")
            elapsed = time.perf_counter() - t0
        finally:
            self._in_flight -= 1
        yield Started(prompt_tokens=int(usage.get("prompt_tokens", 0) or 0), hit_tokens=0)
        if text:
            yield Delta(text)
        yield Completion(
            text=text, finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens", 0) or 0),
            completion_tokens=int(usage.get("completion_tokens", 0) or 0),
            ttft_s=elapsed, meta={"model": self.name, "upstream": self.base_url},
        )

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        import httpx

        if not req.stream:
            async for item in self._complete(req):
                yield item
            return
        path, body = self._body(req, stream=True)
        t0 = time.perf_counter()
        self._in_flight += 1
        try:
            attempt = 0
            while True:
                try:
                    async with self._client.stream("POST", path, json=body) as resp:
                        if resp.status_code >= 400:
                            await resp.aread()
                            msg = _error_message(resp)
                            if resp.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                                log.info("upstream %s answered %d, retrying", self.name,
                                         resp.status_code)
                                await self._backoff(attempt, resp.headers.get("retry-after"))
                                attempt += 1
                                continue
                            raise self._status_error(resp.status_code, msg)
                        async for item in self._parse_sse(resp, req, t0):
                            yield item
                        if not self._up:
                            self._mark(True, f"upstream {self.base_url}")
                        return
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    if attempt < self.max_retries:
                        await self._backoff(attempt, None)
                        attempt += 1
                        continue
                    raise self._transport_error(exc, attempt) from exc
                except httpx.HTTPError as exc:
                    raise self._transport_error(exc, attempt) from exc
        finally:
            self._in_flight -= 1

    async def _parse_sse(self, resp: Any, req: GenRequest, t0: float) -> AsyncIterator[StreamItem]:
        parts: list[str] = []
        finish = "stop"
        usage: dict[str, Any] = {}
        ttft = 0.0
        started = False
        saw_done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                saw_done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError as exc:
                raise UpstreamError(f"upstream model {self.name!r} sent a malformed event",
                                    status=502) from exc
            if "error" in chunk:
                err = chunk["error"]
                raise UpstreamError(f"upstream model {self.name!r} failed mid-stream: "
                                    f"{err.get('message') if isinstance(err, dict) else err}",
                                    status=502)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("content") if "delta" in choice else choice.get("text")
                if not started:
                    started = True
                    yield Started(prompt_tokens=0, hit_tokens=0)
                if text:
                    if not parts:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
                    yield Delta(text)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        if not saw_done:
            raise UpstreamError(f"upstream model {self.name!r} ended its stream without [DONE]",
                                status=502)
        if not started:
            yield Started(prompt_tokens=0, hit_tokens=0)
        text = "".join(parts)
        yield Completion(
            text=text, finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens", 0) or 0),
            completion_tokens=int(usage.get("completion_tokens", 0) or 0),
            ttft_s=ttft, meta={"model": self.name, "upstream": self.base_url},
        )

    async def aclose(self) -> None:
        await self._client.aclose()
