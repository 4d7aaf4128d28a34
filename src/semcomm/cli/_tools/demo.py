"""The quickstart workload: the embedded default served in-process, cold then warm.

:func:`run_demo` builds the embedded default configuration (fresh caches in a temporary
directory unless told otherwise), serves it through the full HTTP request path in-process
(httpx over ASGI: auth, admission, semantic cache, model router, engine with KV prefix reuse,
pipeline handoffs), and plays a scripted workload twice: multi-turn customer-support
conversations under a shared system prompt, and router-then-specialist agent chains served by
the ``semcomm-chain`` pipeline. It returns per-stage savings as a dict (JSON-ready);
:func:`write_demo_report` turns that dict into a self-contained HTML page and
:func:`write_demo_chart` into a PNG.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...server import ServerConfig, create_app, load_config

__all__ = ["demo_workload", "run_demo", "write_demo_chart", "write_demo_report"]

log = logging.getLogger(__name__)

_FALLBACK_SYSTEM = ("You are the support desk of Nimbus Cloud, a hosting company. Answer each "
                    "question in one short sentence.")
_FALLBACK_CONVERSATIONS = [
    [("How do I reset my password?", "Open Settings, then Security, then Reset password."),
     ("And if I lost access to my email?", "Contact support with your account id."),
     ("How long does that take?", "Usually less than one business day.")],
    [("Which plan includes backups?", "The Pro plan includes daily backups."),
     ("Can I restore a single file?", "Yes, from the Backups tab."),
     ("How long are backups kept?", "Thirty days on the Pro plan.")],
    [("Where is your data center?", "In Lyon and in Oslo."),
     ("Can I choose Oslo?", "Yes, pick the region when you create a server."),
     ("Is moving later possible?", "Yes, with a migration from the dashboard.")],
]
_FALLBACK_CHAINS = ["My invoice for March is wrong, who can fix it?",
                    "The server in Oslo does not boot after the update.",
                    "I want to upgrade to the Pro plan."]
_NEW_FOLLOW_UP = "thanks. one more question: who should i contact if this changes?"
_ROUTER_SYSTEM = "You are the router. Name the desk that should answer: billing, tech or sales."
_SPECIALIST_SYSTEM = "You are the specialist desk named above. Answer the customer in one sentence."


def demo_workload(n_conversations: int = 3, n_chains: int = 3, *,
                  source: str = "built-in") -> dict[str, Any]:
    """The scripted workload: the built-in support workload (real English, for the real default
    models), or ``source="reference"``: the reference world's (for the reference tiny models)."""
    if source != "reference":
        return {"source": "built-in", "system": _FALLBACK_SYSTEM,
                "conversations": _FALLBACK_CONVERSATIONS[:n_conversations],
                "chains": _FALLBACK_CHAINS[:n_chains], "router_system": _ROUTER_SYSTEM,
                "specialist_system": _SPECIALIST_SYSTEM}
    try:
        from ...reference import ROUTER_PROMPT, build_world

        world = build_world()
        convs = [c for c in world.conversations(turns=3) if len(c.turns) >= 7][:n_conversations]
        chains = world.agent_chains()[:n_chains]
        if not convs or not chains:
            raise ValueError("empty reference world")
        system = convs[0].turns[0].content
        conversations = []
        for c in convs:
            turns = [t for t in c.turns if t.role != "system"]
            conversations.append([(turns[i].content, turns[i + 1].content)
                                  for i in range(0, len(turns) - 1, 2)])
        return {"source": "reference world", "system": system, "conversations": conversations,
                "chains": [c.request for c in chains], "router_system": ROUTER_PROMPT,
                "specialist_system": "you are the specialist desk named above. answer the "
                                     "request in one short sentence."}
    except Exception as exc:  # the reference package is optional for the demo
        log.info("reference world unavailable (%s); using the built-in workload", exc)
        return {"source": "built-in", "system": _FALLBACK_SYSTEM,
                "conversations": _FALLBACK_CONVERSATIONS[:n_conversations],
                "chains": _FALLBACK_CHAINS[:n_chains], "router_system": _ROUTER_SYSTEM,
                "specialist_system": _SPECIALIST_SYSTEM}


_ADMIN_KEY = "demo-admin-key"


def _demo_config(state_dir: Path, work: dict[str, Any], max_tokens: int) -> ServerConfig:
    base = load_config(None, environ={})
    router, specialist = (list(base.models) * 2)[:2][::-1]  # the larger model routes
    return load_config(None, environ={}, overrides={
        "server": {"state_dir": str(state_dir), "default_max_tokens": max_tokens,
                   "admin_key": _ADMIN_KEY},  # the whole dashboard is the admin's
        "kv": {"chunk_size": 32},
        "tenants": {"demo": {"api_key": "demo-key"}},
        "pipelines": {"semcomm-chain": {
            "description": "router step, then the specialist's answer",
            "stages": [{"model": router, "system": work["router_system"],
                        "role": "router", "max_tokens": 6},
                       {"model": specialist, "system": work["specialist_system"],
                        "role": "specialist"}]}},
    })


async def _one(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int
               ) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    parts: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"demo request failed: HTTP {resp.status_code}: {resp.text}")
        hits = resp.headers.get("x-semcomm-hits", "none")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"demo request failed mid-stream: {chunk['error']}")
            for ch in chunk.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
            usage = chunk.get("usage") or usage
            meta = chunk.get("semcomm") or meta
    total = time.perf_counter() - t0
    return {"model": model, "hits": hits, "latency_ms": total * 1000,
            "ttft_ms": (ttft if ttft is not None else total) * 1000,
            "prompt_tokens": int(usage.get("prompt_tokens", 0)),
            "completion_tokens": int(usage.get("completion_tokens", 0)),
            "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
            "handoffs": meta.get("handoffs", {}), "text": "".join(parts)}


async def _run(config: ServerConfig, work: dict[str, Any], max_tokens: int,
               progress: Callable[[str], None] | None) -> dict[str, Any]:
    import httpx

    app = create_app(config)
    gw = app.state.gateway
    chat_model = config.routing.default_model or next(iter(config.models))
    await gw.startup()
    rounds: dict[str, list[dict[str, Any]]] = {}
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://semcomm.local",
                                     headers={"Authorization": "Bearer demo-key"},
                                     timeout=600) as client:
            for rnd in ("cold", "warm"):
                if progress:
                    progress(rnd)
                rows = []
                for ci, conv in enumerate(work["conversations"]):
                    history: list[dict[str, str]] = [{"role": "system", "content": work["system"]}]
                    for ti, (question, scripted_answer) in enumerate(conv):
                        msgs = [*history, {"role": "user", "content": question}]
                        r = await _one(client, chat_model, msgs, max_tokens)
                        r.update(round=rnd, kind="support", item=f"conv{ci}.turn{ti}")
                        rows.append(r)
                        # follow-ups carry the scripted answer, so both rounds send the same text
                        history = [*msgs, {"role": "assistant", "content": scripted_answer}]
                    if rnd == "warm":
                        # a follow-up never asked before: no semantic hit, but the whole
                        # conversation before it is a KV prefix hit
                        msgs = [*history, {"role": "user", "content": _NEW_FOLLOW_UP}]
                        r = await _one(client, chat_model, msgs, max_tokens)
                        r.update(round=rnd, kind="support", item=f"conv{ci}.new")
                        rows.append(r)
                for ci, request in enumerate(work["chains"]):
                    r = await _one(client, "semcomm-chain",
                                   [{"role": "user", "content": request}], max_tokens)
                    r.update(round=rnd, kind="agent-chain", item=f"chain{ci}")
                    rows.append(r)
                rounds[rnd] = rows
            dash = (await client.get("/dashboard/data", headers={
                "Authorization": f"Bearer {_ADMIN_KEY}"})).json()  # what the dashboard shows
        notes = dict(gw.notes)
    finally:
        await gw.shutdown()
    return {"rounds": rounds, "dashboard": dash, "wiring": notes}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    sem = [r for r in rows if r["hits"] == "semantic"]
    kv_tok = sum(r["cached_tokens"] for r in rows if r["hits"] != "semantic")
    sem_tok = sum(r["prompt_tokens"] + r["completion_tokens"] for r in sem)
    handoffs: dict[str, int] = {}
    for r in rows:
        for k, v in (r.get("handoffs") or {}).items():
            handoffs[k] = handoffs.get(k, 0) + v
    lat = sorted(r["latency_ms"] for r in rows)
    ttft = sorted(r["ttft_ms"] for r in rows)
    return {
        "requests": n,
        "prompt_tokens": prompt,
        "semantic_hits": len(sem),
        "semantic_tokens_saved": sem_tok,
        "kv_hit_requests": sum(1 for r in rows if r["hits"].startswith("kv:")),
        "kv_tokens_saved": kv_tok,
        "prompt_tokens_not_recomputed": kv_tok + sum(r["prompt_tokens"] for r in sem),
        "share_not_recomputed": round((kv_tok + sum(r["prompt_tokens"] for r in sem))
                                      / prompt, 4) if prompt else 0.0,
        "handoffs": handoffs,
        "latency_ms_total": round(sum(lat), 2),
        "latency_ms_median": round(lat[n // 2], 3) if n else 0.0,
        "ttft_ms_median": round(ttft[n // 2], 3) if n else 0.0,
    }


def run_demo(*, config: ServerConfig | None = None, state_dir: str | Path | None = None,
             n_conversations: int = 3, n_chains: int = 3, max_tokens: int = 16,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the quickstart workload cold then warm; return per-stage savings (JSON-ready).

    ``config``: serve this configuration instead of the embedded default (its state directory
    is used as is). ``state_dir``: where the default configuration keeps its caches (default: a
    fresh temporary directory, so that the cold round is really cold). ``progress`` is called
    with the round name as each round starts.
    """
    work = demo_workload(n_conversations, n_chains)
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if config is None:
        if state_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="semcomm-demo-")
            state_dir = tmp.name
        config = _demo_config(Path(state_dir), work, max_tokens)
    try:
        raw = asyncio.run(_run(config, work, max_tokens, progress))
    finally:
        if tmp is not None:
            tmp.cleanup()
    cold, warm = raw["rounds"]["cold"], raw["rounds"]["warm"]
    sc, sw = _summary(cold), _summary(warm)
    # speedups compare the same requests in both rounds (warm also has new follow-ups)
    same = {r["item"] for r in cold}
    sw_same = _summary([r for r in warm if r["item"] in same])
    by_kind = {}
    for kind in ("support", "agent-chain"):
        c = _summary([r for r in cold if r["kind"] == kind])
        w = _summary([r for r in warm if r["kind"] == kind and r["item"] in same])
        by_kind[kind] = {"cold": c, "warm": w,
                         "latency_speedup": round(c["latency_ms_total"] / w["latency_ms_total"], 3)
                         if w["latency_ms_total"] else None}
    for rows in (cold, warm):
        for r in rows:
            r["latency_ms"] = round(r["latency_ms"], 3)
            r["ttft_ms"] = round(r["ttft_ms"], 3)
            r.pop("text", None)
    dash = raw["dashboard"]
    return {
        "workload": {"source": work["source"], "conversations": len(work["conversations"]),
                     "chains": len(work["chains"]), "max_tokens": max_tokens},
        "models": list(config.models),
        "pipelines": list(config.pipelines),
        "cold": sc,
        "warm": sw,
        "by_kind": by_kind,
        "speedup": {
            "latency_total": round(sc["latency_ms_total"] / sw_same["latency_ms_total"], 3)
            if sw_same["latency_ms_total"] else None,
            "ttft_median": round(sc["ttft_ms_median"] / sw_same["ttft_ms_median"], 3)
            if sw_same["ttft_ms_median"] else None,
        },
        "stages": {
            layer: {"hits": v["hits"], "tokens_saved": v["tokens_saved"],
                    "ms_saved_estimated": v["ms_saved"]}
            for layer, v in dash["layers"].items()
        },
        "tiers": dash["tiers"],
        "wiring": raw["wiring"],
        "requests": cold + warm,
    }


# --- report -------------------------------------------------------------------------------------


def _bar_svg(pairs: list[tuple[str, float, float]], unit: str) -> str:
    """Horizontal cold/warm bars as inline SVG (no external resources)."""
    width, row = 560, 34
    top = max([max(c, w) for _, c, w in pairs] + [1e-9])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{row * len(pairs) + 24}" role="img">']
    for i, (label, c, w) in enumerate(pairs):
        y = 8 + i * row
        for j, (val, color) in enumerate(((c, "#9aa5b1"), (w, "#2f7ed8"))):
            bw = max(1.0, 360 * val / top)
            out.append(f'<rect x="150" y="{y + j * 12}" width="{bw:.1f}" height="10" '
                       f'fill="{color}"/>')
            out.append(f'<text x="{155 + bw:.1f}" y="{y + 9 + j * 12}" font-size="10">'
                       f'{val:,.1f} {unit}</text>')
        out.append(f'<text x="0" y="{y + 15}" font-size="12">{html.escape(label)}</text>')
    out.append(f'<text x="150" y="{row * len(pairs) + 20}" font-size="10" fill="#555">grey: '
               f'cold, blue: warm</text></svg>')
    return "".join(out)


def write_demo_report(result: dict[str, Any], path: str | Path) -> Path:
    """Write a self-contained HTML report (inline CSS and SVG, no scripts) of a demo result."""
    path = Path(path)
    c, w = result["cold"], result["warm"]
    rows = []
    for key, label in (("requests", "requests"), ("prompt_tokens", "prompt tokens"),
                       ("semantic_hits", "semantic hits"),
                       ("semantic_tokens_saved", "tokens saved by semantic hits"),
                       ("kv_hit_requests", "requests with KV prefix hits"),
                       ("kv_tokens_saved", "prompt tokens restored from KV cache"),
                       ("share_not_recomputed", "share of prompt tokens not recomputed"),
                       ("latency_ms_total", "total latency (ms)"),
                       ("ttft_ms_median", "median time to first token (ms)")):
        rows.append(f"<tr><td>{label}</td><td>{c[key]}</td><td>{w[key]}</td></tr>")
    stage_rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v['hits']}</td><td>{v['tokens_saved']}</td>"
        f"<td>{v['ms_saved_estimated']}</td></tr>" for k, v in result["stages"].items())
    tier_rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v['entries']}</td><td>{v['bytes']:,}</td></tr>"
        for k, v in result["tiers"].items())
    kinds = [(k, v["cold"]["latency_ms_total"], v["warm"]["latency_ms_total"])
             for k, v in result["by_kind"].items()]
    wiring = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>"
                     for k, v in result["wiring"].items())
    sp = result["speedup"]
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>semcomm quickstart report</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 860px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 20px; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 12px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
.big {{ font-size: 28px; font-weight: 600; color: #2f7ed8; }}
</style></head><body>
<h1>semcomm quickstart</h1>
<p>Workload: {result['workload']['conversations']} support conversations and
{result['workload']['chains']} agent chains ({html.escape(result['workload']['source'])}),
played cold then warm through the full request path.</p>
<p><span class="big">{sp['latency_total']}&times;</span> lower total latency warm than cold;
median time to first token {sp['ttft_median']}&times; lower.</p>
<h2>Cold vs warm</h2>
<table><tr><th></th><th>cold</th><th>warm</th></tr>{''.join(rows)}</table>
{_bar_svg(kinds, 'ms')}
<h2>What each stage saved</h2>
<table><tr><th>layer</th><th>hits</th><th>tokens saved</th><th>ms saved (est.)</th></tr>
{stage_rows}</table>
<h2>Memory per tier</h2>
<table><tr><th>tier</th><th>entries</th><th>bytes</th></tr>{tier_rows}</table>
<h2>What was wired</h2><ul>{wiring}</ul>
</body></html>
"""
    path.write_text(doc, encoding="utf-8")
    return path


def write_demo_chart(result: dict[str, Any], path: str | Path) -> Path:
    """A PNG: latency and prompt tokens recomputed, cold vs warm, per workload kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    kinds = list(result["by_kind"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(kinds))
    for ax, key, title in ((axes[0], "latency_ms_total", "total latency (ms)"),
                           (axes[1], "prompt_tokens", "prompt tokens recomputed")):
        cold, warm = [], []
        for k in kinds:
            cs, ws = result["by_kind"][k]["cold"], result["by_kind"][k]["warm"]
            if key == "prompt_tokens":
                cold.append(cs["prompt_tokens"] - cs["prompt_tokens_not_recomputed"])
                warm.append(ws["prompt_tokens"] - ws["prompt_tokens_not_recomputed"])
            else:
                cold.append(cs[key])
                warm.append(ws[key])
        ax.bar([i - 0.2 for i in x], cold, 0.4, label="cold", color="#9aa5b1")
        ax.bar([i + 0.2 for i in x], warm, 0.4, label="warm", color="#2f7ed8")
        ax.set_xticks(list(x), kinds)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("semcomm quickstart: cold vs warm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
