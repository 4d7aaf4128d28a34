"""The memory plan on the two real models in one server: RSS, TTFT, shared-prefix hits, reloads.

One in-process server (``create_app`` under uvicorn on a loopback port, in a child process so
each run's peak RSS is its own) serves SmolLM2-135M-Instruct ("small") and
Qwen2.5-Coder-0.5B-Instruct ("coder"), ``--workers`` in-process workers each (default two; a
long session holds one of them while it runs), KV in a memory tier that is too small for
everything. The workload: short requests (one of two system prompts per model plus a short
question, 8 tokens out, two at a time) and, in the middle phase, one long session per model
(``--quick``: one turn over a 1.5k-token context; else two turns, 16 tokens out per turn).
Four runs:

* ``plan``: ``[server] memory_bytes`` with per-model ``kv_bytes`` sized for one long session
  plus four short requests, KV admission, fair eviction in the memory tier, KV headroom in the
  replica router, and the prefill scheduler at its defaults (docs/server.md, "Prefill
  scheduling": one long prefill at a time on two cores, in pieces of 256 tokens, pausing
  while a short request is in flight on another worker, each pause at most 500 ms, then
  100 ms of compute before the next);
* ``plan-noyield``: ``plan`` with ``long_prefill_yield = false``: the scheduler's slots,
  pieces and niceness, but long prefills do not step aside for short requests in flight;
* ``plan-nosched``: ``plan`` with the prefill scheduler off (``long_prefill_slots = 0``):
  every long prefill one forward, both at once;
* ``fixed``: no plan, the same fixed memory-tier budget under plain LRU, no KV term in routing,
  no prefill scheduler.

Measured in each run: short requests' TTFT alone (8 rounds of four with ``--quick``, 12
without), during the long sessions (until they end) and after them (p50 and p99), the shared
system prompts' prefix hit rate in the same three phases (cached prompt tokens / prompt
tokens), every status (a refusal must be a 429 with Retry-After), the long sessions' TTFT and
answers, the scheduler's counters, and the process's peak RSS against the plan's
``planned_bytes``. A last run measures keep-alive: the small model unloaded when idle (RSS
before and after), then a request that waits for the reload (its TTFT against a warm one, the
reload seconds, and that the answer is the same).

    OMP_NUM_THREADS=1 python -m benchmarks.server.memory [--quick] [--workers 3]
        [--replica-policy least-loaded] [--out benchmarks/results/memory.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {"small": "smollm2-135m-instruct", "coder": "qwen2.5-coder-0.5b-instruct"}
CHUNK = 64  # KV chunk tokens (the system prompts span several chunks)
TIER_BYTES = 96 * 2**20  # the memory tier: holds the system prompts, not the long sessions too
SHORT_OUT = 8
MODES = ("plan", "plan-noyield", "plan-nosched", "fixed")
LONG_OUT = 16


def _passages() -> list[str]:
    path = DATA / "workloads" / "boolq_dev.jsonl"
    out = []
    with open(path) as fh:
        for line in fh:
            out.append(json.loads(line)["passage"])
            if len(out) >= 400:
                break
    return out


def _text(passages: list[str], start: int, words: int) -> str:
    """About ``words`` words of real text from passage ``start`` on."""
    got: list[str] = []
    i = start
    while len(got) < words:
        got.extend(passages[i % len(passages)].split())
        i += 1
    return " ".join(got[:words])


def _config(mode: str, state: Path, kv_bytes: dict[str, int] | None, *,
            keep_alive: bool = False, workers: int = 2, policy: str = "default") -> Any:
    from semcomm.server import load_config

    sched = mode in ("plan", "plan-noyield")  # the prefill scheduler (server defaults)
    noyield = mode == "plan-noyield"
    mode = "plan" if mode in ("plan-nosched", "plan-noyield") else mode

    models: dict[str, Any] = {}
    for name, path in MODELS.items():
        m: dict[str, Any] = {"path": path, "workers": workers, "max_batch": 4,
                             "max_context": 2048}
        if mode == "plan" and kv_bytes is not None:
            m["kv_bytes"] = kv_bytes[name]
        if keep_alive:
            m = {"path": path, "workers": 1, "max_batch": 4, "max_context": 2048,
                 "keep_alive_s": 3600}
        models[name] = m
        if keep_alive:
            break
    server: dict[str, Any] = {"state_dir": str(state), "torch_threads": 1, "batch_wait_ms": 5,
                              "max_tokens_limit": 2000, "kv_wait_s": 2.0}
    if not sched:
        server["long_prefill_slots"] = 0
    if noyield:
        server["long_prefill_yield"] = False
    if mode == "plan":
        server["memory_bytes"] = 8 * 2**30
    return load_config(None, overrides={
        "server": server, "models": models,
        "kv": {"tiers": ["memory"], "memory_bytes": TIER_BYTES, "chunk_size": CHUNK,
               "memory_eviction": "fair" if mode == "plan" else "lru"},
        "routing": {"replica_policy": policy},
        "semantic": {"enabled": False}}, defaults=False, environ={})


class Server:
    """uvicorn serving ``create_app(config)`` in a thread of this process."""

    def __init__(self, config: Any) -> None:
        import socket

        import uvicorn

        from semcomm.server import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.app = create_app(config)
        self.gateway = self.app.state.gateway
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread died")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


async def chat(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int
               ) -> dict[str, Any]:
    """One streamed chat request: TTFT (first content), status, cached/prompt tokens, text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out: dict[str, Any] = {"model": model, "ttft_s": None, "text": "", "t0": t0}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        out["status"] = r.status_code
        out["retry_after"] = r.headers.get("retry-after")
        out["replica"] = r.headers.get("x-semcomm-replica")
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode()[:200]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                out["status"] = 500
                out["error"] = str(ev["error"])[:200]
                continue
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    out["text"] += piece
            if ev.get("usage"):
                u = ev["usage"]
                out["prompt_tokens"] = u["prompt_tokens"]
                out["cached_tokens"] = u["prompt_tokens_details"]["cached_tokens"]
    out["t1"] = time.perf_counter()
    out["total_s"] = out["t1"] - t0
    if out["ttft_s"] is None:
        out["ttft_s"] = out["total_s"]
    return out


def _shorts(passages: list[str]) -> list[tuple[str, list[dict[str, str]]]]:
    """The short requests of one round: each (model, system prompt) with its own question."""
    out = []
    for mi, model in enumerate(MODELS):
        for si in range(2):
            system = ("You answer questions about the reference text below in one short "
                      "sentence.\n" + _text(passages, 10 + 7 * (2 * mi + si), 150))
            out.append((model, [{"role": "system", "content": system}]))
    return out


def _question(passages: list[str], k: int) -> str:
    """A question no other request asks (its number makes it unique)."""
    return f"Question {k}: " + " ".join(passages[(k * 13) % len(passages)].split()[:12]) + "?"


async def run_shorts(client: Any, shorts: list[tuple[str, list[dict[str, str]]]],
                     passages: list[str], rounds: int, k0: int, *, until: Any = None,
                     concurrency: int = 2) -> list[dict[str, Any]]:
    """``rounds`` rounds of the short requests (``concurrency`` at a time); with ``until``, go
    on past ``rounds`` until it is done."""
    results: list[dict[str, Any]] = []
    k = k0
    sem = asyncio.Semaphore(concurrency)

    async def one(model: str, msgs: list[dict[str, str]], kk: int) -> None:
        async with sem:
            results.append(await chat(client, model, [*msgs, {"role": "user", "content":
                                                              _question(passages, kk)}],
                                      SHORT_OUT))

    r = 0
    while r < rounds or (until is not None and not until.done()):
        await asyncio.gather(*(one(m, msgs, k + i) for i, (m, msgs) in enumerate(shorts)))
        k += len(shorts)
        r += 1
    return results


async def long_session(client: Any, model: str, passages: list[str], start: int,
                       words: int, turns: int) -> list[dict[str, Any]]:
    """``turns`` turns over a context growing by about ``words`` words a turn."""
    msgs = [{"role": "system", "content": "You summarize documents."},
            {"role": "user", "content": _text(passages, start, words) + "\nSummarize."}]
    out = []
    for turn in range(turns):
        res = await chat(client, model, msgs, LONG_OUT)
        out.append(res)
        msgs = [*msgs, {"role": "assistant", "content": res["text"]},
                {"role": "user", "content": _text(passages, start + 40 + turn, words)
                 + "\nAnd this one?"}]
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rs if r["status"] == 200]
    ttft = [r["ttft_s"] for r in ok]
    hit = [r.get("cached_tokens", 0) / max(1, r.get("prompt_tokens", 1)) for r in ok]
    return {"n": len(rs), "ok": len(ok), "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p99_s": _pct(ttft, 0.99), "hit_rate": statistics.mean(hit) if hit else 0.0,
            "per_model_hit_rate": {m: statistics.mean([h for r, h in zip(ok, hit)
                                                       if r["model"] == m] or [0.0])
                                   for m in MODELS}}


def _statuses(rs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rs:
        key = str(r["status"]) + ("+retry-after" if r["status"] == 429 and r["retry_after"]
                                  else "")
        out[key] = out.get(key, 0) + 1
    return out


def _kv_budgets(quick: bool) -> dict[str, int]:
    """One long session (prompt + output at its longest) plus four short requests per model."""
    from transformers import AutoConfig

    from semcomm.models import model_path
    from semcomm.runtime._memplan import kv_shape_from_config

    out = {}
    for name, cat in MODELS.items():
        shape = kv_shape_from_config(AutoConfig.from_pretrained(model_path(cat)))
        out[name] = shape.bytes_for(2048) + 4 * shape.bytes_for(320)
    return out


async def _probe(client: Any, gw: Any, longs: Any) -> dict[str, Any]:
    """While the small model's long session holds its KV, a request whose prompt plus
    ``max_tokens`` needs more than the headroom left: it waits ``kv_wait_s`` and gets 429 +
    Retry-After (or runs, if the session ends first: it stops at once, the answer is one word)."""
    acct = gw.memory.accountant
    plan = gw.memory.plan.models["small"]
    need = plan.kv.bytes_for(2040)
    while not longs.done() and acct.headroom("small") >= need:
        await asyncio.sleep(0.05)
    msgs = [{"role": "user", "content": "Reply with one word: yes."}]
    out = await chat(client, "small", msgs, 2000)
    out["headroom_at_send"] = acct.headroom("small")
    out["need"] = need
    return out


def _thread_cpu() -> dict[str, float]:
    """CPU seconds each live thread of this process has used (by thread name)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            clk = time.pthread_getcpuclockid(t.ident)  # type: ignore[arg-type]
            out[t.name] = out.get(t.name, 0.0) + time.clock_gettime(clk)
        except (OSError, TypeError, AttributeError):
            continue
    return out


def _on_long_worker(during: list[dict[str, Any]], longs: list[dict[str, Any]]) -> dict[str, Any]:
    """Shorts served by the worker that ran their model's long session (token-aware balancing
    sends them to the other worker while the session holds its KV)."""
    def overlaps(r: dict[str, Any], long: dict[str, Any]) -> bool:
        return r["model"] == long["model"] and r["t0"] < long.get("t1", 0) and \
            r["t0"] >= long["t0"]

    live = [(r, lg) for r in during if r["status"] == 200 for lg in longs if overlaps(r, lg)]
    return {"shorts_while_own_long_ran": len(live),
            "on_long_worker": sum(r.get("replica") == lg.get("replica") for r, lg in live)}


async def child_main(mode: str, quick: bool, workers: int = 2, policy: str = "default"
                     ) -> dict[str, Any]:
    import httpx

    from semcomm.runtime._memplan import current_rss_bytes, peak_rss_bytes

    passages = _passages()
    rounds = 2 if quick else 4
    # the baseline's p99 needs samples too: the "during" phase runs until the long sessions
    # end (dozens of requests), and a p99 over 8 would be their max
    alone_rounds = 8 if quick else 12
    # quick: one turn of ~1.5k tokens; full: two turns of ~800 tokens each (1.6k at the second)
    words, turns = (1100, 1) if quick else (600, 2)
    state = Path(tempfile.mkdtemp(prefix=f"bench-memory-{mode}-"))
    planned = mode in ("plan", "plan-noyield", "plan-nosched")
    kv = _kv_budgets(quick) if planned else None
    t_load = time.perf_counter()
    srv = Server(_config(mode, state, kv, workers=workers, policy=policy))
    load_s = time.perf_counter() - t_load
    gw = srv.gateway
    res: dict[str, Any] = {"mode": mode, "load_s": load_s, "workers": workers,
                           "replica_policy": policy}
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
            shorts = _shorts(passages)
            # warm-up: every system prompt cached and read by a few requests (shared)
            await run_shorts(client, shorts, passages, 3, 10_000)
            alone = await run_shorts(client, shorts, passages, alone_rounds, 0)
            longs_task = asyncio.ensure_future(asyncio.gather(*(
                long_session(client, m, passages, 200 + 60 * i, words, turns)
                for i, m in enumerate(MODELS))))
            probe_task = None
            if planned:
                probe_task = asyncio.ensure_future(_probe(client, gw, longs_task))
            cpu0, w0 = _thread_cpu(), time.perf_counter()
            during = await run_shorts(client, shorts, passages, rounds, 1000, until=longs_task)
            cpu1, w1 = _thread_cpu(), time.perf_counter()
            res["during_cpu_s"] = {"wall_s": round(w1 - w0, 2), **{
                k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items()
                if v - cpu0.get(k, 0.0) >= 0.05}}
            longs = [r for session in await longs_task for r in session]
            probes = [await probe_task] if probe_task is not None else []
            after = await run_shorts(client, shorts, passages, rounds, 2000)
            snap = gw.memory.snapshot() if gw.memory is not None else None
            res["prefill"] = gw.prefill.stats() if gw.prefill is not None else None
    finally:
        srv.stop()
    every = alone + during + after + longs + probes
    res.update({
        "alone": _summary(alone), "during": _summary(during), "after": _summary(after),
        "long": {"n": len(longs), "ok": sum(r["status"] == 200 for r in longs),
                 "prompt_tokens": [r.get("prompt_tokens") for r in longs],
                 "total_s": [round(r.get("total_s", 0.0), 2) for r in longs],
                 "ttft_s": [round(r.get("ttft_s", 0.0), 2) for r in longs],
                 "texts": [r.get("text", "") for r in longs]},
        "statuses": _statuses(every),
        "failed_for_memory": sum(1 for r in every if r["status"] not in (200, 429)
                                 or (r["status"] == 429 and not r["retry_after"])),
        "probe": [{k: p.get(k) for k in ("status", "retry_after", "headroom_at_send", "need")}
                  for p in probes],
        "balancing": _on_long_worker(during, longs),
        "requests": [{"phase": phase, **{k: r.get(k) for k in (
            "model", "status", "replica", "prompt_tokens", "cached_tokens")},
            "ttft_s": round(r["ttft_s"], 3) if r.get("ttft_s") is not None else None}
            for phase, rs in (("alone", alone), ("during", during), ("after", after),
                              ("long", longs), ("probe", probes)) for r in rs],
        "peak_rss_bytes": peak_rss_bytes(), "rss_end_bytes": current_rss_bytes(),
    })
    if snap is not None:
        res["plan"] = {"planned_bytes": snap["planned_bytes"],
                       "baseline_bytes": snap["baseline_bytes"],
                       "prefix_cache_bytes": snap["prefix_cache_bytes"],
                       "models": {n: {k: m[k] for k in ("weight_bytes", "kv_budget_bytes",
                                                        "kv_bytes_per_token", "refused")}
                                  for n, m in snap["models"].items()}}
        res["peak_rss_over_plan"] = res["peak_rss_bytes"] / snap["planned_bytes"]
    return res


async def keepalive_main(quick: bool) -> dict[str, Any]:
    """Keep-alive on the small model: unload when idle, reload on the next request."""
    import gc

    import httpx

    from semcomm.runtime._memplan import current_rss_bytes

    passages = _passages()
    state = Path(tempfile.mkdtemp(prefix="bench-memory-keepalive-"))
    srv = Server(_config("plan", state, None, keep_alive=True))
    backend = srv.gateway.backends["small"]
    msgs = [{"role": "system", "content": _text(passages, 5, 150)},
            {"role": "user", "content": "Say what the text is about."}]
    reps = 2 if quick else 3
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
            ref = await chat(client, "small", msgs, SHORT_OUT)
            warm, cold, same = [], [], True
            rss_loaded, rss_unloaded = [], []
            for _ in range(reps):
                w = await chat(client, "small", msgs, SHORT_OUT)
                warm.append(w["ttft_s"])
                gc.collect()
                rss_loaded.append(current_rss_bytes())
                assert backend.unload_if_idle(), "the idle model did not unload"
                rss_unloaded.append(current_rss_bytes())
                c = await chat(client, "small", msgs, SHORT_OUT)  # waits for the reload
                cold.append(c["ttft_s"])
                same = same and c["text"] == ref["text"] and w["text"] == ref["text"]
            r = backend.residency
    finally:
        srv.stop()
    return {"warm_ttft_s": warm, "reload_ttft_s": cold, "reloads": r.reloads,
            "reload_s_total": r.reload_s_total, "mean_reload_s": r.reload_s_total / r.reloads,
            "outputs_identical": same,
            "rss_freed_bytes": statistics.median(a - b for a, b in zip(rss_loaded, rss_unloaded)),
            "weight_bytes": srv.gateway.memory.plan.models["small"].weight_bytes}


def _child(mode: str, quick: bool, out: Path, workers: int, policy: str) -> None:
    res = asyncio.run(keepalive_main(quick) if mode == "keepalive"
                      else child_main(mode, quick, workers, policy))
    out.write_text(json.dumps(res, indent=2, default=float))


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def show(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title="memory plan: short requests (TTFT seconds, shared-prefix hit rate)")
    for col in ("run", "phase", "n", "ok", "TTFT p50", "TTFT p99", "p99 / alone", "hit rate",
                "hit / alone"):
        t.add_column(col, justify="right")
    for mode in MODES:
        r = res[mode]
        for phase in ("alone", "during", "after"):
            p = r[phase]
            a = r["alone"]
            t.add_row(mode, phase, str(p["n"]), str(p["ok"]), f"{p['ttft_p50_s']:.3f}",
                      f"{p['ttft_p99_s']:.3f}", f"{p['ttft_p99_s'] / a['ttft_p99_s']:.2f}x",
                      f"{p['hit_rate']:.3f}", f"{p['hit_rate'] / max(a['hit_rate'], 1e-9):.2f}")
    console.print(t)
    m = Table(title="memory and refusals")
    for col in ("run", "peak RSS", "planned", "peak / plan", "statuses", "failed for memory"):
        m.add_column(col, justify="right")
    for mode in MODES:
        r = res[mode]
        plan = r.get("plan")
        m.add_row(mode, _mib(r["peak_rss_bytes"]), _mib(plan["planned_bytes"]) if plan else "-",
                  f"{r['peak_rss_over_plan']:.3f}" if plan else "-", json.dumps(r["statuses"]),
                  str(r["failed_for_memory"]))
    console.print(m)
    for mode in MODES:
        r = res[mode]
        pre = r.get("prefill")
        console.print(f"{mode}: long sessions' TTFT {r['long']['ttft_s']} s; prefill scheduler "
                      + (f"{pre['slots']} slot(s), {pre['pieces']} pieces, {pre['waits']} waits "
                         f"({pre['wait_s']:.1f} s), nice {pre['nice']}, yield {pre['yield']}: "
                         f"{pre['yields']} pieces yielded ({pre['yield_s']:.1f} s), "
                         f"{pre['forced']} forced by the {pre['yield_max_ms']:.0f} ms bound"
                         if pre else "off")
                      + f"; CPU seconds by thread during the long sessions: "
                      f"{r.get('during_cpu_s')}")
    k = res["keepalive"]
    console.print(f"keep-alive (small): reload {k['mean_reload_s']:.2f} s; TTFT warm "
                  f"{statistics.median(k['warm_ttft_s']):.3f} s vs after unload "
                  f"{statistics.median(k['reload_ttft_s']):.3f} s; RSS freed "
                  f"{_mib(k['rss_freed_bytes'])} of {_mib(k['weight_bytes'])} weights; outputs "
                  f"identical: {k['outputs_identical']}")


def chart(res: dict[str, Any], path: Path) -> None:
    from benchmarks.common import agg_figure

    with agg_figure(path, (10, 3.6)) as ax:
        import numpy as np

        fig = ax.figure
        fig.clear()
        a1, a2, a3 = fig.subplots(1, 3)
        phases = ["alone", "during", "after"]
        x = np.arange(3)
        w = 0.8 / len(MODES)
        for i, mode in enumerate(MODES):
            r = res[mode]
            off = (i - (len(MODES) - 1) / 2) * w
            a1.bar(x + off, [r[p]["ttft_p99_s"] / r["alone"]["ttft_p99_s"] for p in phases], w,
                   label=mode)
            a2.bar(x + off, [r[p]["hit_rate"] for p in phases], w, label=mode)
        a1.axhline(1.5, color="#c33", lw=0.8, ls="--")
        for ax_, title in ((a1, "short requests: p99 TTFT / alone"),
                           (a2, "system-prompt prefix hit rate")):
            ax_.set_xticks(x, ["alone", "during long", "after long"])
            ax_.set_title(title, fontsize=9)
            ax_.legend(fontsize=8)
        r = res["plan"]
        a3.bar(["planned", "peak RSS"], [r["plan"]["planned_bytes"] / 2**30,
                                         r["peak_rss_bytes"] / 2**30], color=["#888", "#4a7"])
        a3.set_title(f"plan run: GiB (peak/plan {r['peak_rss_over_plan']:.2f})", fontsize=9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and shorter sessions")
    p.add_argument("--out", type=Path, default=RESULTS / "server_memory.json")
    p.add_argument("--workers", type=int, default=2,
                   help="in-process workers per model (a long session holds one of them)")
    p.add_argument("--replica-policy", default="default",
                   help="[routing] replica_policy (least-loaded: in-process workers share one "
                   "KV store, so only load tells them apart)")
    p.add_argument("--child", choices=[*MODES, "keepalive"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, args.quick, args.child_out, args.workers, args.replica_policy)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    res: dict[str, Any] = {"quick": args.quick, "machine": f"{os.cpu_count()} CPUs, loaded "
                           "(shared with other jobs)", "models": MODELS,
                           "tier_bytes": TIER_BYTES, "chunk_tokens": CHUNK,
                           "workers": args.workers, "replica_policy": args.replica_policy}
    res["loadavg_before"] = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for mode in (*MODES, "keepalive"):
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, "-m", "benchmarks.server.memory", "--child", mode, "--child-out", str(out),
                   "--workers", str(args.workers), "--replica-policy", args.replica_policy]
            if args.quick:
                cmd.append("--quick")
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            res[mode] = json.loads(out.read_text())
            print(f"{mode}: done at {time.perf_counter() - t0:.0f} s", flush=True)
    res["wall_s"] = time.perf_counter() - t0
    res["loadavg_after"] = os.getloadavg()
    plan, fixed = res["plan"], res["fixed"]
    res["goals"] = {
        "peak_rss_within_10pct_of_plan": abs(plan["peak_rss_over_plan"] - 1) <= 0.10,
        "plan_p99_during_over_alone": plan["during"]["ttft_p99_s"] / plan["alone"]["ttft_p99_s"],
        "fixed_p99_during_over_alone": fixed["during"]["ttft_p99_s"]
        / fixed["alone"]["ttft_p99_s"],
        "plan_noyield_p99_during_over_alone": res["plan-noyield"]["during"]["ttft_p99_s"]
        / res["plan-noyield"]["alone"]["ttft_p99_s"],
        "plan_nosched_p99_during_over_alone": res["plan-nosched"]["during"]["ttft_p99_s"]
        / res["plan-nosched"]["alone"]["ttft_p99_s"],
        "plan_p99_during_at_most_1_5x_alone": plan["during"]["ttft_p99_s"]
        <= 1.5 * plan["alone"]["ttft_p99_s"],
        "long_texts_identical_with_and_without_scheduler":
            plan["long"]["texts"] == res["plan-nosched"]["long"]["texts"]
            == res["plan-noyield"]["long"]["texts"],
        "plan_hit_during_over_alone": plan["during"]["hit_rate"] / plan["alone"]["hit_rate"],
        "plan_hit_after_over_alone": plan["after"]["hit_rate"] / plan["alone"]["hit_rate"],
        "fixed_hit_after_over_alone": fixed["after"]["hit_rate"] / fixed["alone"]["hit_rate"],
        "no_request_failed_for_memory": plan["failed_for_memory"] == 0
        and fixed["failed_for_memory"] == 0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=float))
    print(f"wrote {args.out}")
    show(res)
    chart(res, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
