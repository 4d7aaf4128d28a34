"""Figures behind ``/dashboard``: hit rates, tokens and ms saved, memory per tier, routing
spread and the most reused cached prefixes (opaque fingerprints, never their text).

The admin sees every tenant's traffic, the stores, the memory plan and shadow mode; a tenant
(``dashboard_data(gw, tenant=...)``) sees only the counters of its own requests and the models
it may use: no store, memory or other tenant's figure (docs/SECURITY.md, "Endpoints").
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._gateway import Gateway

__all__ = ["ALL_TENANTS", "dashboard_data", "memory_data", "semantic_shadow_data"]


class _All(enum.Enum):
    ALL = "all"


ALL_TENANTS = _All.ALL
"""``dashboard_data``'s default: every tenant (``tenant=None`` is the public namespace)."""


def semantic_shadow_data(gw: Gateway) -> dict[str, Any] | None:
    """The semantic cache in shadow mode, live (None when it serves or is off): what it would
    have served, the estimated precision by similarity band and the cut for 95 % precision."""
    sem = gw.semantic
    if sem is None:
        return None
    try:
        return sem.shadow_summary(target_precision=0.95)
    except Exception as exc:  # a broken cache must not take the dashboard down
        return {"mode": "shadow", "error": f"{type(exc).__name__}: {exc}"}


def memory_data(gw: Gateway) -> dict[str, Any] | None:
    """The memory plan, live (None when the process has none): per model its state
    (loaded or unloaded by keep-alive), weights held, KV live / cached / budget, reloads."""
    if gw.memory is None:
        return None
    snap = gw.memory.snapshot()
    keep = ("state", "pinned", "weight_bytes", "weight_resident_bytes", "kv_live_bytes",
            "kv_cached_bytes", "kv_budget_bytes", "kv_headroom_bytes", "reloads", "unloads",
            "reload_s_total", "last_reload_s", "refused", "keep_alive_s")
    return {**{k: snap.get(k) for k in ("limit_bytes", "planned_bytes", "planned_now_bytes",
                                         "rss_bytes", "peak_rss_bytes")},
            "models": {n: {k: m.get(k) for k in keep} for n, m in snap["models"].items()}}


def dashboard_data(gw: Gateway, *, tenant: str | None | _All = ALL_TENANTS) -> dict[str, Any]:
    everyone = tenant is ALL_TENANTS
    s = gw.stats if tenant is ALL_TENANTS else gw.tenant_stats(tenant)
    layers = sorted(set(s.layer_hits) | set(s.lookups) | {"semantic", "kv"})
    total = max(1, s.requests)
    per_layer = {
        layer: {
            "hits": s.layer_hits.get(layer, 0),
            "hit_rate": round(s.layer_hits.get(layer, 0) / total, 4),
            "tokens_saved": s.layer_tokens.get(layer, 0),
            "ms_saved": round(s.layer_ms.get(layer, 0.0), 2),
        }
        for layer in layers
    }
    tiers = {}
    for tier, st in (gw.store_stats() if everyone else {}).items():
        tiers[tier] = {"bytes": int(st.get("bytes", 0) or 0),
                       "entries": int(st.get("entries", 0) or 0),
                       "capacity_bytes": int(st.get("capacity_bytes", 0) or 0),
                       "evictions": int(st.get("evictions", 0) or 0)}
    top = sorted(s.prefixes.items(), key=lambda kv: (kv[1].reuses, kv[1].saved_tokens),
                 reverse=True)[:10]
    models = {}
    for name in gw.model_names(None if tenant is ALL_TENANTS else tenant):
        b = gw.backends[name]
        bst = b.status()
        models[name] = {"kind": b.kind, "up": bst.up, "queue_depth": bst.queue_depth,
                        "in_flight": bst.in_flight}
    point = {"t": round(time.time() - s.started, 1), "requests": s.requests,
             "tokens_saved": sum(s.layer_tokens.values()),
             "ms_saved": round(sum(s.layer_ms.values()), 1)}
    if not s.history or s.history[-1]["t"] + 1 <= point["t"]:
        s.history.append(point)
        del s.history[:-120]
    return {
        "uptime_s": round(time.time() - s.started, 1),
        "requests": s.requests,
        "errors": s.errors,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "tokens_saved": sum(s.layer_tokens.values()),
        "ms_saved": round(sum(s.layer_ms.values()), 2),
        "layers": per_layer,
        "tiers": tiers,
        "routing": dict(s.routing),
        "handoffs": dict(s.handoffs),
        "models": models,
        "top_prefixes": [{"id": fp, "tokens": p.tokens, "reuses": p.reuses,
                          "saved_tokens": p.saved_tokens} for fp, p in top],
        "history": list(s.history),
        "memory": memory_data(gw) if everyone else None,
        "semantic_shadow": semantic_shadow_data(gw) if everyone else None,
    }
