"""A three-stage agent chain with a shared context: semcomm against plain serving.

The chain (router, then researcher, then writer) runs as one semcomm pipeline over one model.
Each stage's prompt extends the previous stage's prompt and output (see
``semcomm.server._pipeline``), and every request carries the same long shared context (a
knowledge-base article), with a different question each time.

* **plain**: the same pipeline and model with no caches (plain decoding, every prompt token
  prefilled at every stage);
* **semcomm**: KV prefix cache on (memory tier), handoff between stages by KV (same model).

Greedy outputs must be identical token for token (checked). Reported: end-to-end latency
ratio, share of prompt tokens not recomputed, per-stage hit tokens; table, JSON and PNG.

    python -m benchmarks.server.agent_chain --json chain.json --png chain.png [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

console = Console()

ARTICLE = (
    "Nimbus Cloud knowledge base, article 118: moving a server between regions. "
    "A server can move between the Lyon, Oslo and Lisbon regions. Moves keep the server's "
    "disks, its private network address and its backups; the public address changes unless "
    "a floating address is attached. A move starts from the dashboard (Server, then Region, "
    "then Move) or from the API (POST /servers/{id}/move with the target region). During the "
    "move the server is stopped; a move of a 40 GB disk takes about twelve minutes, and larger "
    "disks take proportionally longer. Billing follows the target region from the hour after "
    "the move. Moves are refused while a snapshot is being taken, while the server is locked "
    "by a support case, and for servers with local NVMe scratch disks, which must be detached "
    "first. The Pro plan includes two free moves a month; each further move costs 2 euros. "
    "If a move fails, the server is restarted in its original region and the attempt is not "
    "billed. Support can pre-approve moves of servers larger than 2 TB, which otherwise need a "
    "maintenance window booked a week ahead. "
)
QUESTIONS = [
    "How long will moving my 80 GB server take?",
    "Will my public IP address change if I move to Oslo?",
    "Can I move a server that has an NVMe scratch disk?",
    "What does a third move in the same month cost on the Pro plan?",
    "What happens to billing after the move?",
    "Is there anything I must do before moving a 3 TB server?",
]
STAGES = [
    {"role": "router", "system": "You are the router. Name the desk for this request."},
    {"role": "researcher", "system": "You are the researcher. Quote the relevant facts."},
    {"role": "writer", "system": "You are the writer. Answer the customer in one sentence."},
]


def build(kind: str, model: Any, tok: Any, tmp: Path) -> Any:
    from semcomm.kv import MemoryStore
    from semcomm.runtime import DirectRunner, engine_runner
    from semcomm.security import TenantSalter
    from semcomm.server import BatchingWorker, LocalBackend, load_config
    from semcomm.server._wiring import build_gateway

    cfg = load_config(None, environ={}, defaults=False, overrides={
        "server": {"state_dir": str(tmp / kind), "max_tokens_limit": 4096},
        "models": {"m": {"path": "tiny"}},
        "kv": {"enabled": kind == "semcomm", "tiers": ["memory"], "chunk_size": 64},
        "semantic": {"enabled": False},
        "pipelines": {"chain": {"stages": [{"model": "m", "system": s["system"], "role": s["role"],
                                            "max_tokens": 8} for s in STAGES]}},
    })
    store = None
    if kind == "semcomm":
        store = MemoryStore(capacity_bytes=2**30)
        runner, note = engine_runner(model, tok, model_id="bench", store=store,
                                     salter=TenantSalter(cfg.server.secret), chunk_size=64,
                                     codec=None)
        assert runner is not None, note
    else:
        runner = DirectRunner(model, tok, model_id="bench")
    backend = LocalBackend("m", BatchingWorker(runner, max_batch=1, name="m"),
                           kv_reuse=kind == "semcomm")
    gw = build_gateway(cfg, backends={"m": backend})
    if store is not None:
        gw.kv_store = store  # the store the bench's engine writes (for the store figures)
    return gw


async def run_chain(gw: Any, question: str, article: str = ARTICLE) -> dict[str, Any]:
    from semcomm.server import GenRequest

    await gw.startup()
    req = GenRequest(model="chain", messages=[
        {"role": "system", "content": article},
        {"role": "user", "content": question}], prompt=None, max_tokens=8, stream=False)
    t0 = time.perf_counter()
    served, final = await gw.complete(req, endpoint="bench")
    return {"latency_s": time.perf_counter() - t0, "text": final.text,
            "stages": final.meta["stages"], "intermediate": final.meta["intermediate"],
            "prompt_tokens": final.prompt_tokens, "hit_tokens": final.hit_tokens,
            "handoffs": final.meta["handoffs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/server_agent_chain.json"))
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--hidden", type=int, default=512, help="model width (config-built Qwen2)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer requests")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from semcomm.reference import build_tiny_model

    torch.set_num_threads(1 if args.quick else max(1, (os.cpu_count() or 2)))
    hidden, layers = (128, 2) if args.quick else (args.hidden, args.layers)
    questions = QUESTIONS[:2] if args.quick else QUESTIONS
    model, tok = build_tiny_model(hidden_size=hidden, layers=layers, heads=max(2, hidden // 64),
                                  kv_heads=max(1, hidden // 128))
    tmp = Path(tempfile.mkdtemp(prefix="semcomm-bench-chain-"))
    results: dict[str, list[dict[str, Any]]] = {}
    with Progress(console=console) as prog:
        for kind in ("plain", "semcomm"):
            gw = build(kind, model, tok, tmp)
            task = prog.add_task(kind, total=len(questions) + 1)
            # warm torch up on an unrelated context, so that request 0 is really cold
            asyncio.run(run_chain(gw, "warm-up", article="An unrelated warm-up context."))
            prog.advance(task)
            rows = []
            for q in questions:
                rows.append(asyncio.run(run_chain(gw, q)))
                prog.advance(task)
            results[kind] = rows
            asyncio.run(gw.shutdown())
    plain, sem = results["plain"], results["semcomm"]
    identical = all(p["text"] == s["text"] and p["intermediate"] == s["intermediate"]
                    for p, s in zip(plain, sem))
    lat_p = sum(r["latency_s"] for r in plain)
    lat_s = sum(r["latency_s"] for r in sem)
    prompt = sum(r["prompt_tokens"] for r in sem)
    hit = sum(r["hit_tokens"] for r in sem)
    cold_share = sem[0]["hit_tokens"] / sem[0]["prompt_tokens"]
    out = {
        "model": {"family": "qwen2 (config-built)", "hidden": hidden, "layers": layers},
        "chain_stages": len(STAGES), "requests": len(questions),
        "identical_greedy_outputs": identical,
        "latency_plain_s": lat_p, "latency_semcomm_s": lat_s,
        "latency_ratio": lat_p / lat_s,
        "median_latency_plain_s": statistics.median(r["latency_s"] for r in plain),
        "median_latency_semcomm_s": statistics.median(r["latency_s"] for r in sem),
        "prompt_tokens": prompt, "prompt_tokens_not_recomputed": hit,
        "share_not_recomputed": hit / prompt,
        "share_not_recomputed_first_request": cold_share,
        "handoffs": sem[0]["handoffs"],
        "per_request": [{"question": q, "plain_s": p["latency_s"], "semcomm_s": s["latency_s"],
                         "prompt_tokens": s["prompt_tokens"], "hit_tokens": s["hit_tokens"],
                         "stage_hits": [st["hit_tokens"] for st in s["stages"]]}
                        for q, p, s in zip(questions, plain, sem)],
    }
    table = Table(title=f"three-stage agent chain, shared context (Qwen2 h{hidden} x{layers})")
    for col in ("request", "plain s", "semcomm s", "ratio", "prompt tok", "not recomputed"):
        table.add_column(col, justify="right")
    for i, r in enumerate(out["per_request"]):
        table.add_row(str(i), f"{r['plain_s']:.3f}", f"{r['semcomm_s']:.3f}",
                      f"{r['plain_s'] / r['semcomm_s']:.2f}x", str(r["prompt_tokens"]),
                      f"{sum(r['stage_hits'])} ({sum(r['stage_hits']) / r['prompt_tokens']:.0%})")
    console.print(table)
    console.print(f"identical greedy outputs: {identical}; end-to-end latency ratio "
                  f"{out['latency_ratio']:.2f}x; prompt tokens not recomputed "
                  f"{out['share_not_recomputed']:.1%} (first request {cold_share:.1%})")
    args.json.write_text(json.dumps(out, indent=2))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = range(len(out["per_request"]))
        ax.bar([x - 0.2 for x in xs], [r["plain_s"] for r in out["per_request"]], 0.4,
               label="plain", color="#9aa5b1")
        ax.bar([x + 0.2 for x in xs], [r["semcomm_s"] for r in out["per_request"]], 0.4,
               label="semcomm", color="#2f7ed8")
        ax.set_xlabel("request (same shared context, new question)")
        ax.set_ylabel("end-to-end latency (s)")
        ax.set_title(f"3-stage agent chain: {out['latency_ratio']:.1f}x lower latency, "
                     f"{out['share_not_recomputed']:.0%} prompt tokens reused")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
