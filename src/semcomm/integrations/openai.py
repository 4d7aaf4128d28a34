"""OpenAI-client adapter: a semantic cache in front of ``client.chat.completions.create``.

``CachedOpenAI(openai.OpenAI(...))`` (or ``CachedAsyncOpenAI(openai.AsyncOpenAI(...))``)
behaves like the client it wraps; only ``chat.completions.create`` looks in the cache first.
The client and the ``openai`` module are not modified.

- Query: the last user message; context: the system prompt and earlier turns (the cache's
  ``context_turns`` window); model identity: ``model`` plus every sampling and tool parameter
  (hashed), so two temperatures or tool sets never share entries.
- Not cached: streaming requests, ``n > 1``, and requests with ``temperature > max_temperature``
  (default 1.0: sampling answers are not meant to be reused when hot).
- A hit returns a ``ChatCompletion`` rebuilt from the stored JSON, with ``id`` prefixed
  ``semcomm-hit-`` and ``system_fingerprint`` left as stored, so callers can tell.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .._query import split_query
from ..errors import require
from ..semantic import Scope, SemanticCache

__all__ = ["CachedAsyncOpenAI", "CachedOpenAI", "request_key"]

_NOT_IDENTITY = {"messages", "stream", "stream_options", "user", "metadata", "store",
                 "extra_headers", "extra_query", "extra_body", "timeout"}


def request_key(kwargs: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], str]:
    """(query, context messages, model identity) for a chat-completions request.

    ``query`` is None when the request has no user message to key on.
    """
    msgs = list(kwargs.get("messages") or [])
    ident = {k: v for k, v in kwargs.items() if k not in _NOT_IDENTITY}
    model = "openai:" + hashlib.sha256(
        json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]
    query, context = split_query(msgs)
    return query, context, model


class _Base:
    def __init__(self, client: Any, cache: SemanticCache | None, scope: str,
                 tenant: str | None, ttl: float | None, max_temperature: float) -> None:
        require("openai", "dev")
        self.client = client
        self.cache = cache if cache is not None else SemanticCache()
        self.scope = Scope(scope, tenant)
        self.ttl = ttl
        self.max_temperature = max_temperature
        self.hits = 0
        self.misses = 0

    def _cacheable(self, kwargs: dict[str, Any]) -> bool:
        if kwargs.get("stream"):
            return False
        if (kwargs.get("n") or 1) > 1:
            return False
        t = kwargs.get("temperature")
        return t is None or float(t) <= self.max_temperature

    @staticmethod
    def _rebuild(answer: str) -> Any:
        from openai.types.chat import ChatCompletion

        data = json.loads(answer)
        data["id"] = "semcomm-hit-" + str(data.get("id", ""))
        return ChatCompletion.model_validate(data)


class _Completions:
    def __init__(self, owner: CachedOpenAI) -> None:
        self._o = owner

    def create(self, **kwargs: Any) -> Any:
        o = self._o
        inner = o.client.chat.completions
        if not o._cacheable(kwargs):
            return inner.create(**kwargs)
        query, ctx, model = request_key(kwargs)
        if query is None:
            return inner.create(**kwargs)
        hit = o.cache.lookup(query, scope=o.scope, context=ctx, model=model)
        if hit is not None:
            o.hits += 1
            return o._rebuild(hit.answer)
        o.misses += 1
        resp = inner.create(**kwargs)
        o.cache.store(query, resp.model_dump_json(), scope=o.scope, context=ctx, model=model,
                      ttl=o.ttl)
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._o.client.chat.completions, name)


class _Chat:
    def __init__(self, completions: Any, client: Any) -> None:
        self.completions = completions
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client.chat, name)


class CachedOpenAI(_Base):
    """Wrap an ``openai.OpenAI`` client; every attribute but ``chat.completions.create`` is the
    client's own."""

    def __init__(self, client: Any, cache: SemanticCache | None = None, *,
                 scope: str = "openai", tenant: str | None = None, ttl: float | None = None,
                 max_temperature: float = 1.0) -> None:
        super().__init__(client, cache, scope, tenant, ttl, max_temperature)
        self.chat = _Chat(_Completions(self), client)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class _AsyncCompletions:
    def __init__(self, owner: CachedAsyncOpenAI) -> None:
        self._o = owner

    async def create(self, **kwargs: Any) -> Any:
        o = self._o
        inner = o.client.chat.completions
        if not o._cacheable(kwargs):
            return await inner.create(**kwargs)
        query, ctx, model = request_key(kwargs)
        if query is None:
            return await inner.create(**kwargs)
        hit = await o.cache.alookup(query, scope=o.scope, context=ctx, model=model)
        if hit is not None:
            o.hits += 1
            return o._rebuild(hit.answer)
        o.misses += 1
        resp = await inner.create(**kwargs)
        await o.cache.astore(query, resp.model_dump_json(), scope=o.scope, context=ctx,
                             model=model, ttl=o.ttl)
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._o.client.chat.completions, name)


class CachedAsyncOpenAI(_Base):
    """Wrap an ``openai.AsyncOpenAI`` client (see :class:`CachedOpenAI`)."""

    def __init__(self, client: Any, cache: SemanticCache | None = None, *,
                 scope: str = "openai", tenant: str | None = None, ttl: float | None = None,
                 max_temperature: float = 1.0) -> None:
        super().__init__(client, cache, scope, tenant, ttl, max_temperature)
        self.chat = _Chat(_AsyncCompletions(self), client)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
