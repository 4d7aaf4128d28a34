"""The gateway's view of the semantic answer cache (``semcomm.semantic.SemanticCache``).

What a key means here: the query is the last user message; the context (every system message
and the earlier turns) and the model must match exactly, which the cache enforces through its
partition; the scope carries the tenant, whose salt digest the cache derives server-side; the
scope name also carries the sampling settings that change an answer (``max_tokens``), so that a
short answer is never served for a request that asked for a long one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from ._backends import Completion, GenRequest

__all__ = ["SemanticLayer", "SemanticHit"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SemanticHit:
    answer: str
    similarity: float
    entry_id: str
    age_s: float
    prompt_tokens: int
    completion_tokens: int


def _split(req: GenRequest) -> tuple[str, list[dict[str, str]] | None]:
    """(query, context): the last user message and everything before it."""
    if req.messages is None:
        return req.prompt or "", None
    msgs = req.messages
    last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=len(msgs) - 1)
    return msgs[last]["content"], msgs[:last] + msgs[last + 1:]


class SemanticLayer:
    """Adapts a ``SemanticCache`` to the gateway: async calls, health, tags for invalidation."""

    def __init__(self, cache: Any, *, threshold: float | None = None,
                 ttl_s: float | None = None, backend: str = "memory") -> None:
        self.cache = cache
        self.threshold = threshold
        self.ttl_s = ttl_s
        self.backend = backend
        self.up = True
        self.detail = f"{backend} semantic cache"
        self._scope_cls = None
        try:
            from ..semantic import Scope

            self._scope_cls = Scope
        except ImportError:  # pragma: no cover - depends on the semantic package version
            pass

    def _scope(self, req: GenRequest, tenant_digest: str) -> Any:
        name = f"model={req.model};max_tokens={req.max_tokens};stop={'|'.join(req.stop)}"
        if self._scope_cls is not None:
            return self._scope_cls(name=name, tenant=req.tenant)
        return f"{tenant_digest}/{name}"

    def _down(self, exc: Exception) -> None:
        if self.up:
            log.error("semantic cache backend is down (%s); serving without it", exc)
        self.up = False
        self.detail = f"down: {exc.__class__.__name__}: {exc}"

    async def lookup(self, req: GenRequest, tenant_digest: str) -> SemanticHit | None:
        query, context = _split(req)
        if not query.strip():
            return None
        kw: dict[str, Any] = {"scope": self._scope(req, tenant_digest), "context": context}
        if self.threshold is not None:
            kw["threshold"] = self.threshold
        try:
            hit = await asyncio.to_thread(self.cache.lookup, query, **kw)
        except Exception as exc:
            self._down(exc)
            return None
        if hit is None:
            return None
        meta = getattr(hit, "metadata", None) or {}
        return SemanticHit(
            answer=hit.answer, similarity=float(hit.similarity),
            entry_id=str(getattr(hit, "entry_id", "")), age_s=float(getattr(hit, "age_s", 0.0)),
            prompt_tokens=int(meta.get("prompt_tokens", 0)) if isinstance(meta, dict) else 0,
            completion_tokens=int(meta.get("completion_tokens", 0)) if isinstance(meta, dict)
            else 0,
        )

    async def store(self, req: GenRequest, tenant_digest: str, comp: Completion) -> None:
        query, context = _split(req)
        if not query.strip():
            return
        kw: dict[str, Any] = {"scope": self._scope(req, tenant_digest), "context": context,
                              "tags": [f"model:{req.model}"]}
        if self.ttl_s is not None:
            kw["ttl"] = self.ttl_s
        try:
            await asyncio.to_thread(self.cache.store, query, comp.text, **kw)
        except TypeError:
            kw.pop("tags", None)
            await asyncio.to_thread(self.cache.store, query, comp.text, **kw)

    def invalidate(self, *, tag: str | None = None, scope: str | None = None,
                   tenant: str | None = None) -> int:
        kw: dict[str, Any] = {}
        if tag:
            kw["tag"] = tag
        if scope:
            kw["scope"] = self._scope_cls(name=scope, tenant=tenant) if self._scope_cls else scope
        return int(self.cache.invalidate(**kw) or 0)

    def stats(self) -> dict[str, Any]:
        st = self.cache.stats()
        if isinstance(st, dict):
            return st
        return {k: getattr(st, k) for k in dir(st)
                if not k.startswith("_") and isinstance(getattr(st, k), int | float | str)}

    def close(self) -> None:
        close = getattr(self.cache, "close", None)
        if close is not None:
            close()


_ = time
