"""An OpenAI-compatible model server reached over HTTP, served as one of the gateway's models.

:class:`UpstreamBackend` speaks the same stream contract as every backend (``Started``,
``Delta`` pieces, one ``Completion``), with timeouts and retries only where a retry cannot
duplicate output (one tenacity policy, :meth:`UpstreamBackend._retrying`); streamed replies are
read as server-sent events by httpx-sse. :func:`upstream_tenant_fields` keeps tenants apart on a
vLLM upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError
from tenacity import (
    AsyncRetrying,
    RetryAction,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from ..errors import UpstreamError
from ..runtime import Completion, Delta, Started, StreamItem
from ..security import TenantContext
from ._backends import BackendStatus, GenRequest
from ._upstream_fast import parse_completion

__all__ = ["FORWARD_TENANT", "VLLM_TENANT_PARAM", "UpstreamBackend", "upstream_tenant_fields"]

log = logging.getLogger(__name__)

_RETRY_STATUSES = {429, 502, 503, 504}
_MAX_WAIT_S = 2.0  # the longest pause between two attempts, Retry-After included
# exponential backoff with full jitter: uniform in [0, min(2 s, 0.1 s * 2**retry)), so the mean
# pause doubles from 50 ms
_BACKOFF = wait_random_exponential(multiplier=0.1, max=_MAX_WAIT_S)
# what a streamed request asks for (as httpx_sse.aconnect_sse does)
_SSE_HEADERS = {"Accept": "text/event-stream", "Cache-Control": "no-store"}


def _error_message(resp: Any) -> str:
    try:
        body = resp.json()
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    except Exception:
        return (resp.text or "").strip()[:300] or resp.reason_phrase


class _Refused(Exception):
    """An HTTP error answer (status >= 400): no output yet, retried when its status allows."""

    def __init__(self, resp: httpx.Response) -> None:
        super().__init__(f"HTTP {resp.status_code}")
        self.status = resp.status_code
        self.message = _error_message(resp)
        try:
            self.retry_after: float | None = float(resp.headers.get("retry-after", ""))
        except ValueError:
            self.retry_after = None


def _retryable(exc: BaseException) -> bool:
    """Retried: a connection that failed, or a 429/502/503/504 answer (nothing produced yet).
    Not a read timeout: the upstream may still be working, a retry would double its load."""
    if isinstance(exc, _Refused):
        return exc.status in _RETRY_STATUSES
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def _wait(state: RetryCallState) -> float:
    """The backoff, or the answer's Retry-After when it asks for longer (at most 2 s)."""
    delay = _BACKOFF(state)
    exc = state.outcome.exception() if state.outcome is not None else None
    if isinstance(exc, _Refused) and exc.retry_after is not None:
        delay = min(_MAX_WAIT_S, max(delay, exc.retry_after))
    return delay


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
    kv_reuse = False  # whatever the upstream does, it is not semcomm's KV
    max_positions = None  # unknown here

    def __init__(self, name: str, *, base_url: str, api_key: str | None = None,
                 upstream_model: str | None = None, timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0, max_retries: int = 2,
                 forward_tenant: str = "off") -> None:
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

    def prepare(self, req: GenRequest) -> None:
        return None  # the upstream renders and tokenizes

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

    def _retrying(self, attempts: int) -> AsyncRetrying:
        """The retry policy after a first failed attempt: at most ``attempts`` more."""
        return AsyncRetrying(stop=stop_after_attempt(attempts), wait=_wait,
                             retry=retry_if_exception(_retryable), before_sleep=self._log_retry,
                             reraise=True)

    async def _backoff(self, first: BaseException) -> None:
        """The pause after the first attempt failed, by the policy's own wait and log line."""
        policy = self._retrying(self.max_retries)
        state = RetryCallState(policy, None, (), {})
        state.set_exception((type(first), first, first.__traceback__))
        delay = _wait(state)
        state.next_action = RetryAction(delay)
        self._log_retry(state)
        await asyncio.sleep(delay)

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        log.info("upstream %s: %s, retrying in %.2f s", self.name,
                 exc if isinstance(exc, _Refused) else exc.__class__.__name__,
                 state.next_action.sleep if state.next_action is not None else 0.0)

    def _transport_error(self, exc: Exception, attempts: int = 1) -> UpstreamError:
        """Mark the upstream and name a transport failure that is not retried (any more)."""
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            self._mark(False, f"unreachable: {exc.__class__.__name__}")
            return UpstreamError(
                f"upstream model {self.name!r} at {self.base_url} is unreachable "
                f"({exc.__class__.__name__}) after {attempts} attempts",
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

    async def _send(self, path: str, body: dict[str, Any], *, stream: bool) -> httpx.Response:
        """POST ``body`` under the retry policy: an answer below 400 (``stream``: its headers
        only, the caller reads and closes it) or an :class:`UpstreamError`.

        The first attempt runs without the retry machinery (about 0.1 ms a request on the
        gateway's hot path); only a retryable failure enters the tenacity policy, which then
        makes the remaining attempts."""
        attempts = 1
        try:
            try:
                return await self._attempt(path, body, stream)
            except Exception as exc:
                if not _retryable(exc) or self.max_retries < 1:
                    raise
                first = exc
            await self._backoff(first)
            async for attempt in self._retrying(self.max_retries):
                with attempt:
                    attempts = 1 + attempt.retry_state.attempt_number
                    return await self._attempt(path, body, stream)
        except _Refused as exc:
            raise self._status_error(exc.status, exc.message) from None
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, attempts) from exc
        raise AssertionError("unreachable: the retry policy returns or raises")

    async def _attempt(self, path: str, body: dict[str, Any], stream: bool) -> httpx.Response:
        if not stream:  # the whole answer at once (httpx reads it)
            resp = await self._client.post(path, json=body)
        else:  # the answer's headers; the caller reads the events and closes it
            request = self._client.build_request("POST", path, json=body, headers=_SSE_HEADERS)
            resp = await self._client.send(request, stream=True)
        if resp.status_code >= 400:
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            raise _Refused(resp)
        return resp

    async def _complete(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        """One JSON call (the client is not streaming): same retry rules as streams."""
        path, body = self._body(req, stream=False)
        t0 = time.perf_counter()
        self._in_flight += 1
        try:
            resp = await self._send(path, body, stream=False)
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
        if not req.stream:
            async for item in self._complete(req):
                yield item
            return
        path, body = self._body(req, stream=True)
        t0 = time.perf_counter()
        self._in_flight += 1
        try:
            # retried only here, before the first chunk: once events flow, a failure is final
            resp = await self._send(path, body, stream=True)
            try:
                async for item in self._read_events(resp, t0):
                    yield item
            except SSEError as exc:
                raise UpstreamError(f"upstream model {self.name!r} did not answer with an "
                                    f"event stream ({exc})", status=502) from exc
            except httpx.HTTPError as exc:
                raise self._transport_error(exc) from exc
            finally:
                await resp.aclose()
            if not self._up:
                self._mark(True, f"upstream {self.base_url}")
        finally:
            self._in_flight -= 1

    async def _read_events(self, resp: httpx.Response, t0: float) -> AsyncIterator[StreamItem]:
        """The server-sent events of an OpenAI stream: ``Started``, ``Delta``s, one ``Completion``.

        Events are whole (several ``data:`` lines join with newlines; comments and ``id:`` /
        ``retry:`` fields are no output). An ``error`` event, or an event whose JSON has an
        ``error``, fails the stream; events of other types (pings) are skipped.
        """
        parts: list[str] = []
        finish = "stop"
        usage: dict[str, Any] = {}
        ttft = 0.0
        started = False
        saw_done = False
        async with aclosing(EventSource(resp).aiter_sse()) as events:
            async for sse in events:
                if sse.event not in ("message", "error") or not sse.data:
                    continue
                if sse.data.strip() == "[DONE]":
                    saw_done = True
                    break
                try:
                    chunk = json.loads(sse.data)
                except json.JSONDecodeError:
                    chunk = None
                if sse.event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                    err = chunk.get("error", chunk) if isinstance(chunk, dict) else sse.data[:300]
                    raise UpstreamError(f"upstream model {self.name!r} failed mid-stream: "
                                        f"{err.get('message') if isinstance(err, dict) else err}",
                                        status=502)
                if not isinstance(chunk, dict):
                    raise UpstreamError(f"upstream model {self.name!r} sent a malformed event",
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
        yield Completion(
            text="".join(parts), finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens", 0) or 0),
            completion_tokens=int(usage.get("completion_tokens", 0) or 0),
            ttft_s=ttft, meta={"model": self.name, "upstream": self.base_url},
        )

    async def aclose(self) -> None:
        await self._client.aclose()
