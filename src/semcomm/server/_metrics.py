"""Prometheus metrics of one gateway (own registry, so several apps can live in one process).

Every name starts with ``semcomm_``. Labels never carry a tenant id, a prompt or a cache key:
what a tenant's request hit is told to that tenant alone (the ``x-semcomm-hits`` header).
Store sizes and evictions are read from the stores at scrape time by a custom collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["LAYERS", "Metrics"]

LAYERS = ("semantic", "kv", "snapshot", "c2c")
"""Reuse layers, cheapest first: semantic answers, KV prefixes, KV snapshots handed between
pipeline stages on one model, and cache-to-cache fusion between different models."""

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SIM_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0)


class _StoreCollector(Collector):
    """Reads store statistics at scrape time: bytes, entries, evictions per tier."""

    def __init__(self, source: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        try:
            tiers = self.source()
        except Exception:  # a scrape must not fail because a backend is down
            tiers = {}
        b = GaugeMetricFamily("semcomm_store_bytes", "Bytes held per store tier", labels=["tier"])
        e = GaugeMetricFamily("semcomm_store_entries", "Entries per store tier", labels=["tier"])
        cap = GaugeMetricFamily("semcomm_store_capacity_bytes", "Byte budget per store tier",
                                labels=["tier"])
        ev = CounterMetricFamily("semcomm_store_evictions", "Evictions per store tier",
                                 labels=["tier"])
        cor = CounterMetricFamily("semcomm_store_corrupt", "Corrupt entries rejected per tier",
                                  labels=["tier"])
        for tier, st in tiers.items():
            b.add_metric([tier], float(st.get("bytes", 0) or 0))
            e.add_metric([tier], float(st.get("entries", 0) or 0))
            if st.get("capacity_bytes"):
                cap.add_metric([tier], float(st["capacity_bytes"]))
            ev.add_metric([tier], float(st.get("evictions", 0) or 0))
            cor.add_metric([tier], float(st.get("corrupt", 0) or 0))
        yield from (b, e, cap, ev, cor)


class _PrefillCollector(Collector):
    """``semcomm_prefill_*``: the process's prefill scheduler (read at scrape)."""

    def __init__(self, source: Callable[[], dict[str, Any]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        try:
            st = self.source()
        except Exception:  # a scrape must not fail
            return
        yield GaugeMetricFamily("semcomm_prefill_slots", "Long prefills that may compute at "
                                "once across every model", value=float(st["slots"]))
        yield GaugeMetricFamily("semcomm_prefill_long_running", "Long prefill pieces "
                                "computing now", value=float(st["running"]))
        yield GaugeMetricFamily("semcomm_prefill_long_waiting", "Long prefill pieces waiting "
                                "for a slot now", value=float(st["waiting"]))
        yield CounterMetricFamily("semcomm_prefill_long", "Long prefills (more uncached "
                                  "tokens than long_prefill_tokens)",
                                  value=float(st["long_prefills"]))
        yield CounterMetricFamily("semcomm_prefill_short", "Short prefills (never wait)",
                                  value=float(st["short_prefills"]))
        yield CounterMetricFamily("semcomm_prefill_pieces", "Pieces long prefills ran in",
                                  value=float(st["pieces"]))
        yield CounterMetricFamily("semcomm_prefill_waits", "Long prefill pieces that waited "
                                  "for a slot or for short requests", value=float(st["waits"]))
        yield CounterMetricFamily("semcomm_prefill_wait_seconds", "Seconds long prefill "
                                  "pieces waited (for a slot or for short requests)",
                                  value=float(st["wait_s"]))
        yield GaugeMetricFamily("semcomm_prefill_short_in_flight", "Short requests and "
                                "prefills in flight now (long prefills yield to them)",
                                value=float(st["short_in_flight"]))
        yield CounterMetricFamily("semcomm_prefill_yields", "Long prefill pieces that waited "
                                  "for short requests", value=float(st["yields"]))
        yield CounterMetricFamily("semcomm_long_prefill_yield_seconds", "Seconds long "
                                  "prefill pieces waited for short requests (before starting "
                                  "or paused between layers)", value=float(st["yield_s"]))
        yield CounterMetricFamily("semcomm_prefill_yield_forced", "Long prefill pieces that "
                                  "ran out of long_prefill_yield_max_ms with short requests in "
                                  "flight (the starvation bound)", value=float(st["forced"]))


class _MemoryCollector(Collector):
    """``semcomm_memory_*``: the memory plan and what each model holds now (read at scrape)."""

    def __init__(self, source: Callable[[], dict[str, Any]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        try:
            snap = self.source()
        except Exception:  # a scrape must not fail
            return
        w = GaugeMetricFamily("semcomm_memory_weight_bytes", "Weight bytes each in-process "
                              "model holds in memory now (0 while keep-alive has it unloaded)",
                              labels=["model"])
        loaded = GaugeMetricFamily("semcomm_memory_loaded", "1 when the model's weights are "
                                   "loaded, 0 while keep-alive has them unloaded",
                                   labels=["model"])
        reloads = CounterMetricFamily("semcomm_memory_reloads", "Reloads of weights that "
                                      "keep-alive unloaded", labels=["model"])
        unloads = CounterMetricFamily("semcomm_memory_unloads", "Unloads of idle weights "
                                      "(keep_alive_s)", labels=["model"])
        reload_s = CounterMetricFamily("semcomm_memory_reload_seconds", "Wall seconds spent "
                                       "reloading weights (requests waited this long)",
                                       labels=["model"])
        headroom = GaugeMetricFamily("semcomm_memory_kv_headroom_bytes", "Live KV budget not "
                                     "reserved by running requests", labels=["model"])
        kv = GaugeMetricFamily("semcomm_memory_kv_bytes", "KV bytes held per model: live "
                               "(running requests) plus its prefix cache in memory",
                               labels=["model"])
        live = GaugeMetricFamily("semcomm_memory_kv_live_bytes",
                                 "KV reserved by running requests per model", labels=["model"])
        budget = GaugeMetricFamily("semcomm_memory_kv_budget_bytes",
                                   "Live KV budget per model (the plan)", labels=["model"])
        for name, m in snap["models"].items():
            w.add_metric([name], m.get("weight_resident_bytes", m["weight_bytes"]))
            kv.add_metric([name], m["kv_bytes"])
            live.add_metric([name], m["kv_live_bytes"])
            budget.add_metric([name], m["kv_budget_bytes"])
            headroom.add_metric([name], m.get("kv_headroom_bytes", 0))
            loaded.add_metric([name], 1 if m.get("loaded", True) else 0)
            reloads.add_metric([name], m.get("reloads", 0))
            unloads.add_metric([name], m.get("unloads", 0))
            reload_s.add_metric([name], m.get("reload_s_total", 0.0))
        yield from (w, kv, live, budget, headroom, loaded, reloads, unloads, reload_s)
        yield GaugeMetricFamily("semcomm_memory_planned_bytes", "The whole process as the memory "
                                "plan predicts it (baseline, weights, KV budgets, memory tier)",
                                value=snap["planned_bytes"])
        if "planned_now_bytes" in snap:
            yield GaugeMetricFamily("semcomm_memory_planned_now_bytes", "The plan with the "
                                    "models keep-alive unloaded taken out",
                                    value=snap["planned_now_bytes"])
        yield GaugeMetricFamily("semcomm_memory_rss_bytes", "Resident bytes of this process now",
                                value=snap["rss_bytes"])
        yield GaugeMetricFamily("semcomm_memory_peak_rss_bytes", "Peak resident bytes so far",
                                value=snap["peak_rss_bytes"])
        if snap.get("limit_bytes") is not None:
            yield GaugeMetricFamily("semcomm_memory_limit_bytes", "server.memory_bytes",
                                    value=snap["limit_bytes"])


class Traffic(Protocol):
    """The traffic counters ``/metrics`` reads (``_gateway.DashboardStats``)."""

    @property
    def finished(self) -> Mapping[tuple[str, str, str], int]: ...

    @property
    def error_types(self) -> Mapping[str, int]: ...

    @property
    def layer_hits(self) -> Mapping[str, int]: ...

    @property
    def misses(self) -> Mapping[str, int]: ...

    @property
    def layer_tokens(self) -> Mapping[str, int]: ...

    @property
    def layer_ms(self) -> Mapping[str, float]: ...

    @property
    def prompt_by_model(self) -> Mapping[str, int]: ...

    @property
    def completion_by_model(self) -> Mapping[str, int]: ...

    @property
    def routing(self) -> Mapping[str, int]: ...

    @property
    def handoffs_by(self) -> Mapping[tuple[str, str], int]: ...

class _TrafficCollector:
    """``semcomm_requests``, ``_errors``, ``_cache_hits``, ... from the gateway's traffic
    counters at each scrape: the dashboard and ``/metrics`` read the same record."""

    _FAMILIES: tuple[tuple[Callable[[Traffic], Mapping[Any, float]], str, str, tuple[str, ...],
                           float], ...] = (
        (lambda t: t.finished, "semcomm_requests", "Requests by endpoint, model and status",
         ("endpoint", "model", "status"), 1.0),
        (lambda t: t.error_types, "semcomm_errors", "Errors by type", ("type",), 1.0),
        (lambda t: t.layer_hits, "semcomm_cache_hits", "Requests served (partly) from cache, per layer",
         ("layer",), 1.0),
        (lambda t: t.misses, "semcomm_cache_misses", "Lookups that missed, per layer", ("layer",), 1.0),
        (lambda t: t.layer_tokens, "semcomm_tokens_saved", "Tokens not computed thanks to a layer (prompt "
         "tokens not recomputed; prompt and completion tokens for semantic hits)", ("layer",),
         1.0),
        (lambda t: t.layer_ms, "semcomm_seconds_saved", "Estimated wall time saved per layer", ("layer",),
         1e-3),
        (lambda t: t.prompt_by_model, "semcomm_prompt_tokens", "Prompt tokens received", ("model",), 1.0),
        (lambda t: t.completion_by_model, "semcomm_completion_tokens", "Completion tokens returned",
         ("model",), 1.0),
        (lambda t: t.routing, "semcomm_routing_decisions", "Model router decisions", ("model",), 1.0),
        (lambda t: t.handoffs_by, "semcomm_pipeline_handoffs", "Pipeline handoffs by mode",
         ("pipeline", "mode"), 1.0),
    )

    def __init__(self, source: Callable[[], Traffic]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        traffic = self.source()
        for read, name, doc, labels, scale in self._FAMILIES:
            fam = CounterMetricFamily(name, doc, labels=list(labels))
            for key, value in dict(read(traffic)).items():
                fam.add_metric(list(key) if isinstance(key, tuple) else [key], value * scale)
            yield fam


class Metrics:
    """All metric families of one gateway."""

    def __init__(self, store_source: Callable[[], dict[str, dict[str, Any]]] | None = None, *,
                 traffic: Callable[[], Traffic] | None = None):
        r = self.registry = CollectorRegistry(auto_describe=True)
        if traffic is not None:  # the gateway's traffic counters, read at scrape
            r.register(_TrafficCollector(traffic))
        self.similarity = Histogram("semcomm_semantic_similarity",
                                    "Cosine similarity of served semantic hits",
                                    buckets=_SIM_BUCKETS, registry=r)
        self.verifier_rejections = Counter("semcomm_verifier_rejections",
                                           "Semantic candidates rejected by the verifier or policy",
                                           registry=r)
        self.semantic_up = Gauge("semcomm_semantic_backend_up",
                                 "1 when the semantic cache backend works, 0 when it is down",
                                 registry=r)
        self.kv_up = Gauge("semcomm_kv_backend_up", "1 when a KV store tier answers its health "
                           "probe, 0 while it is down", ["tier"], registry=r)
        self.ttft = Histogram("semcomm_ttft_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("semcomm_request_latency_seconds", "End-to-end request latency",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("semcomm_gateway_overhead_seconds",
                                  "Time spent in the gateway outside the model backend",
                                  buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                           0.025, 0.05, 0.1), registry=r)
        self.backend_up = Gauge("semcomm_backend_up", "1 when a model backend is up", ["model"],
                                registry=r)
        self.queue_depth = Gauge("semcomm_queue_depth", "Requests queued per model", ["model"],
                                 registry=r)
        self.rejected = Counter("semcomm_overload_rejections",
                                "Requests refused with 429/503 because a queue was full",
                                ["model"], registry=r)
        self.upstream_retries = Counter("semcomm_upstream_failures",
                                        "Upstream calls that failed, by model", ["model"],
                                        registry=r)
        self.memory_reroutes = Counter("semcomm_memory_reroutes", "Model 'auto' requests sent "
                                       "to another model because the chosen one had no KV "
                                       "headroom", ["from_model", "to_model"], registry=r)
        if store_source is not None:
            r.register(_StoreCollector(store_source))

    def register_prefill(self, source: Callable[[], dict[str, Any]]) -> None:
        """Export the prefill scheduler (``semcomm_prefill_*``) from ``source()`` at scrape."""
        self.registry.register(_PrefillCollector(source))

    def register_memory(self, source: Callable[[], dict[str, Any]]) -> None:
        """Export the memory plan (``semcomm_memory_*``) from ``source()`` at each scrape."""
        self.registry.register(_MemoryCollector(source))
