"""The gateway's view of the semantic answer cache (``semcomm.semantic.SemanticCache``).

What a key means here: the query is the last user message; the context (every system message
and the earlier turns) and the model must match exactly, which the cache enforces through its
partition; the scope carries the tenant, whose salt digest the cache derives server-side; the
model key also carries the settings that change an answer (``max_tokens``, ``stop``, and for
sampled requests ``temperature``, ``top_p`` and ``seed``), so that a short answer is never
served for a request that asked for a long one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from .._query import split_query
from ..errors import TenantError
from ..runtime import Completion
from ..security import TenantContext
from ..semantic import Scope, SemanticCache
from ._backends import GenRequest

__all__ = ["SCOPE_NAME", "SemanticHit", "SemanticLayer"]

SCOPE_NAME = "default"
"""Scope name of every entry the gateway writes; the tenant rides in the Scope's tenant field."""

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
    """(query, context) by the one rule the integrations share (``semcomm._query``)."""
    if req.messages is None:
        return req.prompt or "", None
    query, context = split_query(req.messages)
    return query or "", context


class SemanticLayer:
    """Adapts a ``SemanticCache`` to the gateway: async calls, health, tags for invalidation."""

    RETRY_DOWN_S = 5.0

    def __init__(self, cache: SemanticCache, *, threshold: float | None = None,
                 ttl_s: float | None = None, backend: str = "memory", salter: Any = None) -> None:
        self.cache = cache
        try:  # a remote store (Redis) answers a health probe; a local one says None
            self._pingable = cache.backend.ping() is not None
        except Exception:  # a remote store that is down right now
            self._pingable = True
        self.salter = salter  # the TenantSalter the cache derives scope digests with
        self.threshold = threshold
        self.ttl_s = ttl_s
        self.backend = backend
        self.up = True
        self.detail = f"{backend} semantic cache"
        self._down_at = 0.0
        self._errors = 0
        self._guarded = 0
        self.rejections_delta = 0  # candidates vetoed since the gateway last read this
        self._shadow_view: tuple[float, int, dict[str, Any] | None] = (0.0, -1, None)

    def _scope(self, ctx: TenantContext) -> Scope:
        """The tenant's scope. The cache derives the scope's digest from the tenant id with the
        same salter as admission: a context whose digest differs is refused, never served."""
        if self.salter is not None and self.salter.digest(ctx.tenant) != ctx.digest:
            raise TenantError("the admitted tenant digest does not match the semantic scope")
        return Scope(name=SCOPE_NAME, tenant=ctx.tenant)

    @staticmethod
    def _model(req: GenRequest) -> str:
        """Model identity plus the settings that change an answer.

        Sampling settings join the key only for sampled requests, so greedy entries keep the
        key they always had (the system prompt and earlier turns are the cache's context).
        """
        key = f"{req.model}#max_tokens={req.max_tokens}#stop={'|'.join(req.stop)}"
        if req.temperature > 0:
            key += f"#temperature={req.temperature:g}#top_p={req.top_p:g}#seed={req.seed}"
        return key

    @staticmethod
    def _tags(req: GenRequest) -> list[str]:
        return [f"model:{req.model}"]

    def warm(self) -> None:
        """Load the embedder, the index and the policy's verifier now, so the first request does
        not pay for them."""
        try:
            if self.cache.mode == "shadow":
                # a shadowed warm-up lookup would wait for an answer forever and count as traffic
                self.cache.embedder.embed(["warm up"])
                self.cache.stats()
            else:
                self.cache.lookup("warm up", scope=Scope(name="__warmup__", tenant=None))
            self.load_models()
        except Exception as exc:
            self._down(exc)

    def load_models(self) -> None:
        """Load the embedder and the policy's cross-encoder verifier (MiniLM each, about 90 MB
        apiece) now, without a lookup (nothing counted as traffic).

        The server calls it before it measures the memory plan's baseline, so the plan counts
        them instead of warm-up adding them after the plan was made."""
        self.cache.embedder.embed(["warm up"])
        scorer = self.cache.policy.scorer
        if scorer is not None and hasattr(scorer, "scores"):  # a cross-encoder (not a function)
            scorer.scores("warm up", ["warm up"])

    def usable(self) -> bool:
        """Up, or (for a store without a health probe) down long enough ago that one request
        may probe it again. A store with ``ping`` is back only when :meth:`probe` says so."""
        if self.up:
            return True
        return not self.pingable and time.monotonic() - self._down_at > self.RETRY_DOWN_S

    @property
    def pingable(self) -> bool:
        """The entry store answers a health probe (Redis)."""
        return self._pingable

    def probe(self) -> bool:
        """One health probe of the entry store (Redis: a PING, at most its socket timeout);
        the gateway calls it every ``server.health_probe_s`` from a thread. Only a probe brings
        a pinged store back up, so the state follows the store and does not flap with the
        requests that happen to touch it. Returns whether the layer is up."""
        if not self._pingable:
            return self.up
        try:
            ok = bool(self.cache.backend.ping())
            why: Exception = ConnectionError("no answer to PING")
        except Exception as exc:  # a probe must never raise into the gateway
            ok, why = False, exc
        if not ok:
            self._down(ConnectionError(f"{self.backend} entry store unreachable ({why})"))
        elif not self.up:
            log.warning("semantic cache backend (%s) is back", self.backend)
            self.up = True
            self.detail = f"{self.backend} semantic cache (recovered)"
            self._errors = self._error_count()  # errors from the outage are not a new one
        return self.up

    def _error_count(self) -> int:
        try:
            return self.cache.stats().errors
        except Exception:
            return self._errors

    def _check_counters(self) -> None:
        """The cache turns backend errors into misses; surface them (health, metric, log)."""
        try:
            st = self.cache.stats()
        except Exception as exc:
            self._down(exc)
            return
        errors, guarded = st.errors, st.guarded
        self.rejections_delta += max(0, guarded - self._guarded)
        self._guarded = guarded
        if errors > self._errors:
            self._errors = errors
            self._down(RuntimeError(f"{errors} backend errors (lookups degraded to misses)"))
        elif not self.up and not self.pingable:  # a pinged store comes back by probe() only
            log.warning("semantic cache backend recovered")
            self.up = True
            self.detail = f"{self.backend} semantic cache (recovered)"

    def _down(self, exc: Exception) -> None:
        if self.up:
            log.error("semantic cache backend is down (%s); serving without it", exc)
        self._down_at = time.monotonic()
        self.up = False
        self.detail = f"down: {exc.__class__.__name__}: {exc}"

    async def lookup(self, req: GenRequest, ctx: TenantContext) -> SemanticHit | None:
        query, context = _split(req)
        if not query.strip():
            return None
        kw: dict[str, Any] = {"scope": self._scope(ctx), "context": context,
                              "model": self._model(req), "tags": self._tags(req)}
        if self.threshold is not None:
            kw["threshold"] = self.threshold
        try:
            hit = await asyncio.to_thread(self.cache.lookup, query, **kw)
        except Exception as exc:
            self._down(exc)
            return None
        self._check_counters()
        if hit is None:
            return None
        meta = hit.metadata or {}
        return SemanticHit(
            answer=hit.answer, similarity=float(hit.similarity), entry_id=hit.entry_id,
            age_s=float(hit.age_s), prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", 0)))

    async def store(self, req: GenRequest, ctx: TenantContext, comp: Completion) -> None:
        query, context = _split(req)
        if not query.strip():
            return
        kw: dict[str, Any] = {"scope": self._scope(ctx), "context": context,
                              "model": self._model(req), "tags": self._tags(req),
                              "metadata": {"prompt_tokens": comp.prompt_tokens,
                                           "completion_tokens": comp.completion_tokens}}
        if self.ttl_s is not None:
            kw["ttl"] = self.ttl_s
        await asyncio.to_thread(self.cache.store, query, comp.text, **kw)
        self._check_counters()

    def invalidate(self, *, tag: str | None = None, scope: str | None = None,
                   tenant: str | None = None) -> int:
        kw: dict[str, Any] = {}
        if tag:
            kw["tag"] = tag
        if scope:
            kw["scope"] = scope
        if tenant:
            kw["tenant"] = tenant
        return int(self.cache.invalidate(**kw) or 0)

    def stats(self) -> dict[str, Any]:
        return dict(self.cache.stats().as_dict())

    SHADOW_REFRESH_S = 1.0
    SHADOW_LARGE = 10_000

    def shadow_summary(self, target_precision: float = 0.95) -> dict[str, Any] | None:
        """Shadow mode, live: would-be hit rate, estimated precision by similarity band and the
        lowest cosine cut whose estimated precision meets ``target_precision``, over the
        cache's finished shadow records (None when the cache serves). Recomputed when records
        were added; past :attr:`SHADOW_LARGE` records at most once per :attr:`SHADOW_REFRESH_S`
        (the dashboard polls every 2 s; a report over 100k records takes ~0.2 s)."""
        if self.cache.mode != "shadow":
            return None
        records = self.cache.shadow.records
        at, count, view = self._shadow_view
        now = time.monotonic()
        if view is not None and (len(records) == count or (
                len(records) > self.SHADOW_LARGE and now - at < self.SHADOW_REFRESH_S)):
            return view
        rep = self.cache.shadow_report(target_precision=target_precision)
        pending = self.cache.shadow_pending
        view = {
            "mode": "shadow", "lookups": rep.lookups, "would_hit": rep.would_hit,
            "would_hit_rate": round(rep.would_hit_rate, 4), "compared": rep.compared,
            "awaiting_answer": pending,
            "estimated_precision": None if rep.estimated_precision is None
            else round(rep.estimated_precision, 4),
            "bands": [{"lo": b.lo, "hi": min(b.hi, 1.0), "lookups": b.lookups,
                       "would_hit": b.would_hit, "compared": b.compared,
                       "precision": None if b.precision is None else round(b.precision, 4)}
                      for b in rep.bands],
            "target_precision": rep.target_precision,
            "threshold": None if rep.threshold is None else round(rep.threshold, 4),
            "threshold_precision": None if rep.threshold_precision is None
            else round(rep.threshold_precision, 4),
            "threshold_hit_rate": None if rep.threshold_hit_rate is None
            else round(rep.threshold_hit_rate, 4),
        }
        self._shadow_view = (now, len(records), view)
        return view

    def close(self) -> None:
        self.cache.close()

