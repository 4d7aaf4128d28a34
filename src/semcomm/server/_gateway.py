"""The request path, independent of HTTP: admission -> route and prepare -> semantic cache ->
model -> store.

A :class:`Gateway` owns the backends, the semantic cache layer, the shared KV store, the
metrics and the dashboard statistics of one server; ``build_gateway(config)`` (``_wiring``)
builds one from the config in one step. The FastAPI app (``_app``) only parses requests and
formats responses; ``run_demo`` and the Ray deployment reuse the same object. The path is
drawn in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import uuid
from collections import Counter, OrderedDict, defaultdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidInputError, OverloadedError, SemcommError, TenantError, UpstreamError
from ..kv import ChunkStore
from ..runtime import Completion, Delta, MemoryMonitor, PrefillScheduler, Started, StreamItem
from ..security import TenantContext, TenantSalter
from ._backends import GenRequest, ModelBackend, collect
from ._config import ServerConfig
from ._metrics import Metrics
from ._semantic_layer import SemanticLayer

__all__ = ["Admitter", "DashboardStats", "Gateway", "ModelChooser", "ModelNotFound", "Served"]

log = logging.getLogger(__name__)


class Admitter(Protocol):
    """Admission: what ``semcomm.security.RequestGuard`` provides (see docs/server.md)."""

    def admit(self, tenant: str | None, tokens: Sequence[int], *, max_tokens: int | None = None,
              body: Mapping[str, Any] | None = None,
              headers: Mapping[str, str] | None = None) -> Any: ...


ModelChooser = Callable[[GenRequest, list[str]], "str | None"]
"""Model "auto": ``(request, the models it may use) -> a model name or None``."""


class ModelNotFound(InvalidInputError):
    """The requested model is not configured (or not allowed for this tenant)."""

    def __init__(self, model: str, available: list[str]) -> None:
        super().__init__(f"model {model!r} does not exist; available: {', '.join(available)}")
        self.model = model


@dataclass(slots=True)
class Served:
    """What the app needs to answer one request: the resolved model and the item stream."""

    model: str
    hits_header: str  # known before the first byte: "semantic", "kv:512", "none", ...
    items: AsyncIterator[StreamItem]  # Started (already taken: it set the header), Delta*,
    # one Completion
    replica: str = ""  # the replica serving it ("" when the model has one)


@dataclass(slots=True)
class _PrefixUse:
    tokens: int = 0  # prompt tokens of the prefix
    reuses: int = 0  # requests that reused it
    saved_tokens: int = 0


class DashboardStats:
    """The traffic counters of a gateway (every tenant) or of one tenant: the one record of
    what happened, read by the dashboard and, for every tenant, by ``/metrics`` (the
    ``semcomm_requests``, ``_errors``, ``_cache_hits``, ``_cache_misses``, ``_tokens_saved``,
    ``_seconds_saved``, ``_prompt_tokens``, ``_completion_tokens``, ``_routing_decisions`` and
    ``_pipeline_handoffs`` families). No texts, no tenant ids; bounded."""

    MAX_PREFIXES = 512

    def __init__(self) -> None:
        self.started = time.time()
        self.requests = 0  # requests admitted to the path
        self.failed = 0  # of those, ended by an error
        self.finished: Counter[tuple[str, str, str]] = Counter()  # (endpoint, model, status)
        self.error_types: Counter[str] = Counter()
        self.layer_hits: Counter[str] = Counter()
        self.layer_tokens: Counter[str] = Counter()
        self.layer_ms: defaultdict[str, float] = defaultdict(float)  # milliseconds saved
        self.lookups: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.routing: Counter[str] = Counter()
        self.handoffs_by: Counter[tuple[str, str]] = Counter()  # (pipeline, mode)
        self.prompt_by_model: Counter[str] = Counter()
        self.completion_by_model: Counter[str] = Counter()
        self.prefixes: OrderedDict[str, _PrefixUse] = OrderedDict()
        self.history: list[dict[str, float]] = []  # one point per second-ish, bounded
        self._ms_per_prompt_token = 0.0  # EWMA of prefill cost, to price KV hits
        self._ms_per_request = 0.0  # EWMA of a full generation, to price semantic hits

    @property
    def errors(self) -> int:
        return self.failed

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_by_model.values())

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion_by_model.values())

    @property
    def handoffs(self) -> dict[str, int]:
        """Pipeline handoffs by mode, every pipeline together."""
        out: Counter[str] = Counter()
        for (_pipeline, mode), n in self.handoffs_by.items():
            out[mode] += n
        return dict(out)

    def record(self, layer: str, tokens: int, ms: float) -> None:
        """A request served (partly) from ``layer``: ``tokens`` not computed, ``ms`` saved."""
        self.layer_hits[layer] += 1
        self.layer_tokens[layer] += tokens
        self.layer_ms[layer] += ms

    def lookup(self, layer: str) -> None:
        self.lookups[layer] += 1

    def miss(self, layer: str) -> None:
        self.misses[layer] += 1

    def fail(self, error_type: str) -> None:
        """A request ended by an error of this type."""
        self.failed += 1
        self.error_types[error_type] += 1

    def finish(self, endpoint: str, model: str, status: str) -> None:
        self.finished[(endpoint, model, status)] += 1

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        self.prompt_by_model[model] += prompt
        self.completion_by_model[model] += completion

    def prefix(self, fingerprint: str, tokens: int, saved: int) -> None:
        p = self.prefixes.get(fingerprint)
        if p is None:
            p = self.prefixes[fingerprint] = _PrefixUse(tokens=tokens)
            if len(self.prefixes) > self.MAX_PREFIXES:
                # keep the most reused half (the newest first among equals), drop the rest:
                # one sort every MAX_PREFIXES / 2 new prefixes, not a scan per request
                order = list(self.prefixes.items())
                keep = sorted(range(len(order)), key=lambda i: (order[i][1].reuses, i),
                              reverse=True)[: self.MAX_PREFIXES // 2]
                self.prefixes = OrderedDict(order[i] for i in sorted(keep))
        if saved:
            p.reuses += 1
            p.saved_tokens += saved

    def learn_cost(self, prompt_tokens: int, hit_tokens: int, ttft_s: float, total_s: float) -> None:
        computed = max(1, prompt_tokens - hit_tokens)
        per_tok = ttft_s * 1000 / computed
        a = 0.2
        if per_tok > 0:
            self._ms_per_prompt_token = (per_tok if not self._ms_per_prompt_token
                                         else (1 - a) * self._ms_per_prompt_token + a * per_tok)
        if total_s > 0:
            ms = total_s * 1000
            self._ms_per_request = (ms if not self._ms_per_request
                                    else (1 - a) * self._ms_per_request + a * ms)


def _fingerprint(tenant_digest: str, messages: list[dict[str, str]] | None,
                 prompt: str | None) -> tuple[str, int]:
    """An opaque id of a request's shared prefix (system prompt or first 256 chars), no text."""
    if messages:
        head = next((m["content"] for m in messages if m["role"] in ("system", "developer")),
                    messages[0]["content"][:256])
    else:
        head = (prompt or "")[:256]
    h = hashlib.blake2b(f"{tenant_digest}\x00{head}".encode(), digest_size=6).hexdigest()
    return h, len(head)


class Gateway:
    """The request path of one server (see the module docstring)."""

    def __init__(self, config: ServerConfig, *, backends: Mapping[str, ModelBackend] | None = None,
                 semantic: SemanticLayer | None = None, kv_store: ChunkStore | None = None,
                 guard: Admitter | None = None, model_router: ModelChooser | None = None,
                 salter: TenantSalter | None = None, notes: dict[str, str] | None = None,
                 memory: MemoryMonitor | None = None,
                 prefill: PrefillScheduler | None = None) -> None:
        """A gateway over parts that are already built (``build_gateway(config)`` builds them
        from the config in one step); nothing is filled in later."""
        self.config = config
        self.salter = salter if salter is not None else TenantSalter(config.server.secret)
        self._keys: dict[str, str] = {}
        for name, t in config.tenants.items():
            for key in [t.api_key, *t.api_keys]:
                self._keys[key] = name
        self.backends: dict[str, ModelBackend] = dict(backends or {})
        self.semantic = semantic
        self.kv_store = kv_store  # the ChunkStore shared by in-process engines
        self.guard = guard  # admission (semcomm.security.RequestGuard); None admits everyone
        self.model_router = model_router  # model "auto"; None: routing.default_model
        # what is wired and what is not (/health); shared with the parts that add to it
        self.notes: dict[str, str] = notes if notes is not None else {}
        self.stats = DashboardStats()  # every tenant's traffic (the admin's dashboard)
        # each tenant's own traffic (a tenant's dashboard); bounded by the configured tenants
        self._tenant_stats: dict[str | None, DashboardStats] = {}
        self.metrics = Metrics(self.store_stats, traffic=lambda: self.stats)
        self.memory = memory  # the process's memory plan and live KV (None: not planned)
        if memory is not None:
            self.metrics.register_memory(memory.snapshot)
        self.prefill = prefill  # the process's prefill scheduler (None: none, or turned off)
        if self.prefill is not None:
            self.metrics.register_prefill(self.prefill.stats)
        self._started = False
        # KV tiers with a health probe (Redis), filled by the first probe: tier name -> (up,
        # detail); read by /health
        self.kv_health: dict[str, tuple[bool, str]] = {}
        self._prober: asyncio.Task[None] | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    async def startup(self) -> None:
        """Warm the semantic cache (embedder, index) and publish the backends' state."""
        if self._started:
            return
        if self.semantic is not None:
            await asyncio.to_thread(self.semantic.warm)
        self._started = True
        for name, b in self.backends.items():
            self.metrics.backend_up.labels(name).set(1 if b.status().up else 0)
        if self.semantic is not None:
            self.metrics.semantic_up.set(1 if self.semantic.up else 0)
        await asyncio.to_thread(self.probe_backends)  # a tier without a remote answers None
        if self.kv_health or (self.semantic is not None and self.semantic.pingable):
            self._prober = asyncio.create_task(self._probe_loop())

    # --- backend health ----------------------------------------------------------------------
    def _kv_tiers(self) -> tuple[ChunkStore, ...]:
        return () if self.kv_store is None else self.kv_store.tiers

    def probe_backends(self) -> None:
        """One health probe of every backend that has one (Redis KV tiers, a Redis semantic
        store): their state in /health and the ``*_backend_up`` gauges follows the probe, so
        an outage shows for as long as it lasts and recovery within one probe interval
        (``server.health_probe_s``). Blocking (socket timeouts): run it in a thread."""
        for tier in self._kv_tiers():
            try:
                answer = tier.ping()
                why = "no answer to PING"
            except Exception as exc:  # a probe never raises
                answer, why = False, f"{type(exc).__name__}: {exc}"
            if answer is None:  # nothing remote to probe (memory, disk)
                continue
            ok, name = bool(answer), tier.name
            was = self.kv_health.get(name, (True, ""))[0]
            if ok != was:
                if ok:
                    log.warning("KV tier %s is back", name)
                else:
                    log.error("KV tier %s is down (%s); serving without it", name, why)
            self.kv_health[name] = (True, "up") if ok else (False, f"down: {why}")
            self.metrics.kv_up.labels(name).set(1 if ok else 0)
        if self.semantic is not None:
            self.metrics.semantic_up.set(1 if self.semantic.probe() else 0)

    async def _probe_loop(self) -> None:
        interval = self.config.server.health_probe_s
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(self.probe_backends)
            except Exception:  # pragma: no cover - probe_backends catches per backend
                log.exception("health probe failed")

    async def shutdown(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            self._prober = None
        for b in list(self.backends.values()):
            try:
                await b.aclose()
            except Exception:  # pragma: no cover - best effort on shutdown
                log.exception("closing backend %s failed", b.name)
        if self.semantic is not None:
            await asyncio.to_thread(self.semantic.close)
        if self.kv_store is not None:
            await asyncio.to_thread(self.kv_store.close)
        self._started = False

    # --- auth ------------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str | None:
        """Map an ``Authorization: Bearer <key>`` header to a configured tenant id.

        Returns None (the anonymous, single-user namespace) when no tenant is configured and
        the key is unknown or absent. Raises :class:`TenantError` otherwise.
        """
        key = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                key = value.strip()
        if key is not None:
            for k, tenant in self._keys.items():
                if hmac.compare_digest(k.encode(), key.encode()):
                    return tenant
        if self.config.anonymous_allowed:
            return None
        if key is None:
            raise TenantError("missing API key: send 'Authorization: Bearer <api_key>'")
        raise TenantError("incorrect API key provided")

    def is_admin(self, authorization: str | None) -> bool:
        return self.has_key(authorization, self.config.server.admin_key)

    @staticmethod
    def has_key(authorization: str | None, key: str | None) -> bool:
        """``authorization`` is ``Bearer <key>`` (constant-time; False when ``key`` is unset)."""
        if not key or not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(),
                                                                  key.encode())

    def tenant_stats(self, tenant: str | None) -> DashboardStats:
        """The dashboard figures of one tenant's traffic alone."""
        st = self._tenant_stats.get(tenant)
        if st is None:
            st = self._tenant_stats[tenant] = DashboardStats()
        return st

    def _both(self, tenant: str | None) -> tuple[DashboardStats, DashboardStats]:
        return self.stats, self.tenant_stats(tenant)

    def tenant_digest(self, tenant: str | None) -> str:
        return self.salter.digest(tenant)

    def admit(self, req: GenRequest, *, body: dict[str, Any] | None = None,
              headers: dict[str, str] | None = None) -> TenantContext:
        """Admission: the request's :class:`TenantContext`, or a refusal (400 / 429).

        Runs the request guard (client salts refused, rate limit, probe detection) when one is
        wired; without one every authenticated request is admitted, not isolated.
        """
        if self.guard is None:
            return TenantContext(req.tenant, self.tenant_digest(req.tenant), False)
        probe_tokens = list((req.prompt or "".join(m["content"] for m in req.messages or []))
                            .encode("utf-8"))
        admission = self.guard.admit(req.tenant, probe_tokens, max_tokens=req.max_tokens,
                                     body=body, headers=headers)
        # any guard returning ``salt_digest`` and ``isolate`` fits (docs/server.md)
        return TenantContext(req.tenant, admission.salt_digest, bool(admission.isolate))

    # --- models ----------------------------------------------------------------------------------
    def model_names(self, tenant: str | None = None) -> list[str]:
        names = list(self.backends)
        if tenant is not None:
            allowed = self.config.tenants[tenant].models
            if allowed is not None:
                names = [n for n in names if n in allowed]
        return names

    def resolve(self, model: str, tenant: str | None, req: GenRequest,
                routed: str | None = None) -> tuple[str, ModelBackend]:
        """The model serving ``req`` and its backend: ``model``, or for "auto"/"default" the
        router's choice (``routed``), else ``routing.default_model``, moved to another model
        when the chosen one has no KV headroom for it (preparing the candidates' prompts)."""
        names = self.model_names(tenant)
        if model in ("auto", "default"):
            chosen = routed if routed in names else None
            if chosen is None:
                dm = self.config.routing.default_model
                chosen = dm if dm in names else (names[0] if names else None)
            if chosen is None:
                raise ModelNotFound(model, names)
            chosen = self._with_headroom(chosen, names, req)
            for st in self._both(tenant):
                st.routing[chosen] += 1
            model = chosen
        if model not in names:
            raise ModelNotFound(model, names)
        return model, self.backends[model]

    def _kv_tokens(self, model: str, req: GenRequest) -> int | None:
        """Tokens of KV ``req`` reserves on in-process ``model`` (None: not one, or the prompt
        does not fit it)."""
        try:
            prep = self.backends[model].prepare(req)
        except SemcommError:
            return None
        return None if prep is None else prep.kv_tokens

    def _with_headroom(self, chosen: str, names: list[str], req: GenRequest) -> str:
        """Model "auto" and memory: when ``chosen`` has no KV headroom for the request now, the
        smallest other candidate (by planned weights) that has it; else ``chosen`` (which then
        waits or answers 429 as usual). Only in-process models the plan covers are weighed."""
        mem = self.memory
        if mem is None or chosen not in mem.plan.models:
            return chosen
        tokens = self._kv_tokens(chosen, req)
        if tokens is None or mem.fits(chosen, tokens):
            return chosen
        auto = set(self.config.routing.auto_models or names)
        plans = mem.plan.models
        for other in sorted((n for n in names if n != chosen and n in auto and n in plans),
                            key=lambda n: plans[n].weight_bytes):
            need = self._kv_tokens(other, req)
            if need is not None and mem.fits(other, need):
                log.info("model %s is out of KV headroom for %d tokens: %s serves 'auto'",
                         chosen, tokens, other)
                self.metrics.memory_reroutes.labels(chosen, other).inc()
                return other
        return chosen

    def prepare(self, req: GenRequest) -> tuple[str, ModelBackend]:
        """Route and prepare ``req`` once (blocking: the model router embeds, preparing renders
        and tokenizes): the model, its backend, and ``req.prepared`` filled for it. Raises 400
        for a prompt that cannot fit the model, 404 for a model the tenant may not use."""
        routed = None
        if req.model in ("auto", "default") and self.model_router is not None:
            routed = self.model_router(req, self.model_names(req.tenant))
        model, backend = self.resolve(req.model, req.tenant, req, routed)
        backend.prepare(req)
        return model, backend

    def _prepares_off_loop(self, req: GenRequest) -> bool:
        """Whether preparing ``req`` does work worth a thread (routing, tokenizing)."""
        b = self.backends.get(req.model)
        return b is None or b.kind == "hf" or req.model in ("auto", "default")

    # --- the request path -----------------------------------------------------------------------
    async def serve(self, req: GenRequest, *, endpoint: str, body: dict[str, Any] | None = None,
                    headers: dict[str, str] | None = None, no_cache: bool = False,
                    no_store: bool = False) -> Served:
        """Run the request path up to the first item; the rest streams from ``Served.items``.

        Admission, then routing and preparing (one thread hop when there is work), the
        semantic answer cache, then the model. Raises before anything is sent (bad input,
        unknown model, overload, upstream down), so the app can answer with a proper status.
        """
        t0 = time.perf_counter()
        if not req.request_id:
            req.request_id = uuid.uuid4().hex
        # 0. admission (auth happened in the app): salts, rate limit, probe detection, before
        # any embedding, routing or tokenizing is spent on the request
        ctx = req.ctx = self.admit(req, body=body, headers=headers)
        # 1. the model (the semantic key names it) and the prompt prepared for it, once
        if self._prepares_off_loop(req):
            model, backend = await asyncio.to_thread(self.prepare, req)
        else:
            model, backend = self.prepare(req)
        req.model = model
        for st in self._both(req.tenant):
            st.requests += 1
        fp, fp_len = _fingerprint(ctx.digest, req.messages, req.prompt)

        # 2. semantic answer cache (tenant-scoped; only deterministic requests by default)
        sem = self.semantic
        sem_ok = (sem is not None and sem.usable() and not ctx.isolate
                  and (req.temperature == 0 or not self.config.semantic.only_greedy))
        if sem is not None and sem_ok and not no_cache:
            for st in self._both(req.tenant):
                st.lookup("semantic")
            hit = await sem.lookup(req, ctx)
            self._semantic_health()
            if hit is not None:
                prep = req.prepared.get(model)  # usage counts this request's prompt
                return self._semantic_hit(req, hit, endpoint, t0, fp, fp_len,
                                          None if prep is None else len(prep.ids))
            for st in self._both(req.tenant):
                st.miss("semantic")

        # 3. the model (in-process engine, upstream, or pipeline)
        self.metrics.overhead.observe(time.perf_counter() - t0)
        items = backend.stream(req)
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            raise UpstreamError(f"model {model!r} produced nothing", status=502) from None
        except OverloadedError:
            self.metrics.rejected.labels(model).inc()
            raise
        except UpstreamError:
            self.metrics.upstream_retries.labels(model).inc()
            self.metrics.backend_up.labels(model).set(1 if backend.status().up else 0)
            raise
        if not isinstance(first, Started):
            raise UpstreamError(f"model {model!r} broke the stream contract: "
                                f"{type(first).__name__} before Started", status=502)
        hits = [f"kv:{first.hit_tokens}"] if first.hit_tokens else []
        hits.extend(first.layers)
        store = sem_ok and not no_store
        return Served(model=model, hits_header=",".join(hits) or "none", replica=first.replica,
                      items=self._finish(req, backend, first, items, endpoint, t0, store, ctx,
                                         fp, fp_len))

    def _semantic_health(self) -> None:
        sem = self.semantic
        if sem is None:
            return
        self.metrics.semantic_up.set(1 if sem.up else 0)
        if sem.rejections_delta:
            self.metrics.verifier_rejections.inc(sem.rejections_delta)
            sem.rejections_delta = 0

    def _semantic_hit(self, req: GenRequest, hit: Any, endpoint: str, t0: float, fp: str,
                      fp_len: int, prompt_tokens: int | None = None) -> Served:
        """Serve a semantic hit. ``prompt_tokens``: this request's prompt (None: unknown, the
        stored request's count is reported, and ``semcomm.semantic.prompt_tokens`` says so)."""
        answer = hit.answer
        counted = prompt_tokens is not None
        prompt_tokens = int(prompt_tokens if prompt_tokens is not None else hit.prompt_tokens)
        tokens = prompt_tokens + hit.completion_tokens
        saved_ms = self.stats._ms_per_request
        self.metrics.similarity.observe(hit.similarity)
        for st in self._both(req.tenant):
            st.record("semantic", tokens, saved_ms)
            st.prefix(fp, fp_len, tokens)
        comp = Completion(
            text=answer, finish_reason="stop", prompt_tokens=prompt_tokens,
            completion_tokens=hit.completion_tokens, hits=["semantic"], hit_tokens=0,
            ttft_s=time.perf_counter() - t0,
            meta={"model": req.model, "semantic": {"similarity": round(hit.similarity, 4),
                                                    "entry_id": hit.entry_id,
                                                    "age_s": round(hit.age_s, 3),
                                                    "prompt_tokens": "this request" if counted
                                                    else "stored request"}},
        )
        self._account(req.model, endpoint, comp, t0, status="200", tenant=req.tenant)

        started = Started(prompt_tokens=prompt_tokens, hit_tokens=0)

        async def one() -> AsyncIterator[StreamItem]:  # the stream contract, as every backend
            yield started
            if answer:
                yield Delta(answer)
            yield comp

        return Served(model=req.model, hits_header="semantic", items=one())

    async def _finish(self, req: GenRequest, backend: ModelBackend, first: StreamItem,
                      items: AsyncIterator[StreamItem], endpoint: str, t0: float, store: bool,
                      ctx: TenantContext, fp: str, fp_len: int) -> AsyncIterator[StreamItem]:
        final: Completion | None = None
        status = "200"
        sent: list[str] = []  # the deltas so far: joined, they must equal the final text
        try:
            yield first
            async for item in items:
                if isinstance(item, Delta):
                    sent.append(item.text)
                elif isinstance(item, Completion):
                    final = item
                    if "".join(sent) != final.text:  # the one stream contract, never patched
                        raise UpstreamError(
                            f"model {req.model!r} broke the stream contract: its text pieces "
                            "do not join to its answer", status=502)
                yield item
            if final is None:
                raise UpstreamError(f"model {req.model!r} ended its stream without a result",
                                    status=502)
        except BaseException as exc:
            status = "error"
            for st in self._both(req.tenant):
                st.fail(type(exc).__name__)
            raise
        finally:
            if final is None and status == "200":
                status = "cancelled"
            for st in self._both(req.tenant):
                st.finish(endpoint, req.model, status)
            self.metrics.backend_up.labels(req.model).set(1 if backend.status().up else 0)
        assert final is not None
        self._account(req.model, endpoint, final, t0, status="200", count=False,
                      tenant=req.tenant)
        # KV prefix, snapshot and C2C savings, as the backend reported them
        if final.hit_tokens:
            ms = final.hit_tokens * self.stats._ms_per_prompt_token
            layer_tokens = final.meta.get("saved_tokens_by_layer") or {"kv": final.hit_tokens}
            for layer, tok in layer_tokens.items():
                share = tok / final.hit_tokens if final.hit_tokens else 0
                for st in self._both(req.tenant):
                    st.record(layer, tok, ms * share)
        elif backend.kind == "hf":
            for st in self._both(req.tenant):
                st.miss("kv")
        for mode, n in (final.meta.get("handoffs") or {}).items():
            for st in self._both(req.tenant):
                st.handoffs_by[(req.model, mode)] += n
        for st in self._both(req.tenant):
            st.prefix(fp, fp_len, final.hit_tokens)
            st.learn_cost(final.prompt_tokens, final.hit_tokens, final.ttft_s,
                          time.perf_counter() - t0)
        if (store and self.semantic is not None and final.finish_reason in ("stop", "length")
                and final.text):
            try:
                await self.semantic.store(req, ctx, final)
            except Exception as exc:  # a cache write must never fail the request
                log.warning("semantic store failed: %s", exc)
                for st in self._both(req.tenant):
                    st.error_types["SemanticStoreError"] += 1

    def _account(self, model: str, endpoint: str, comp: Completion, t0: float, *, status: str,
                 count: bool = True, tenant: str | None = None) -> None:
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        if comp.ttft_s:
            self.metrics.ttft.labels(model).observe(comp.ttft_s)
        for st in self._both(tenant):
            if count:
                st.finish(endpoint, model, status)
            st.tokens(model, comp.prompt_tokens, comp.completion_tokens)

    async def complete(self, req: GenRequest, **kw: Any) -> tuple[Served, Completion]:
        served = await self.serve(req, endpoint=kw.pop("endpoint", "internal"), **kw)
        return served, await collect(served.items)

    # --- introspection ---------------------------------------------------------------------------
    def store_stats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        store = self.kv_store
        if store is not None:
            for t in store.tiers:
                try:
                    st = t.stats()
                except Exception:
                    continue
                out[f"kv-{t.name}"] = {"entries": st.entries, "bytes": st.bytes,
                                       "capacity_bytes": st.capacity_bytes, "hits": st.hits,
                                       "misses": st.misses, "evictions": st.evictions,
                                       "corrupt": st.corrupt}
        if self.semantic is not None:
            try:
                out["semantic"] = self.semantic.stats()
            except Exception:
                pass
        return out

    def health_status(self) -> str:
        """``ok`` or ``degraded``: what an unauthenticated ``/health`` says, nothing more."""
        if any(not b.status().up for b in self.backends.values()):
            return "degraded"
        if self.config.semantic.enabled and (self.semantic is None or not self.semantic.up):
            return "degraded"
        if any(not up for up, _ in self.kv_health.values()):
            return "degraded"
        return "ok"

    def health(self) -> dict[str, Any]:
        models = {}
        for name, b in self.backends.items():
            st = b.status()
            models[name] = {"kind": b.kind, "up": st.up, "detail": st.detail,
                            "queue_depth": st.queue_depth, "in_flight": st.in_flight}
            self.metrics.backend_up.labels(name).set(1 if st.up else 0)
            self.metrics.queue_depth.labels(name).set(st.queue_depth)
        sem: dict[str, Any] = {"enabled": self.semantic is not None}
        if self.semantic is not None:
            sem.update(up=self.semantic.up, detail=self.semantic.detail)
            self.metrics.semantic_up.set(1 if self.semantic.up else 0)
        elif self.config.semantic.enabled:
            sem.update(up=False, detail=self.notes.get("semantic", "not available"))
            self.metrics.semantic_up.set(0)
        if self.semantic is not None:
            sem["backend"] = self.semantic.backend
        tiers = {}
        for t in self._kv_tiers():
            name = t.name
            up, detail = self.kv_health.get(name, (True, "up"))
            tiers[name] = {"up": up, "detail": detail}
        # what is down, by name: "model:<name>", "semantic:<backend>", "kv:<tier>"
        down = [f"model:{n}" for n, m in models.items() if not m["up"]]
        if self.config.semantic.enabled and not sem.get("up", False):
            down.append(f"semantic:{sem.get('backend', self.config.semantic.backend)}")
        down += [f"kv:{n}" for n, t in tiers.items() if not t["up"]]
        return {
            "status": "degraded" if down else "ok",
            "down": down,
            "models": models,
            "semantic": sem,
            "kv": {"enabled": self.kv_store is not None,
                   "detail": self.notes.get("kv", ""), "tiers": tiers},
            "memory": self.memory.snapshot() if self.memory is not None else None,
            "prefill": self.prefill.stats() if self.prefill is not None else None,
            "wiring": dict(self.notes),
        }

