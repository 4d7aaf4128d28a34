"""Cache-to-cache fusion on the reference pair: accuracy and latency against the baselines.

Evaluates, on the held-out multiple-choice questions of the reference world (facts the fuser
never trained on; half "seen" by the receiver, half "unseen"), with the shipped fuser:

* receiver alone, sharer alone, text-to-text (the sharer writes one sentence of background,
  the receiver answers with it in context) and C2C (the sharer's prompt KV fused into the
  receiver's cache): accuracy, median latency per query, tokens generated;
* the goals as ratios: C2C - receiver and C2C - T2T (accuracy points), T2T / C2C latency;
* where C2C's time goes (sharer prefill, receiver prefill, fusion, answer scoring), and C2C
  with the sharer's prompt KV restored from a KV store (``HFEngine`` over a ``MemoryStore``,
  warm) instead of recomputed;
* the cache-enrichment oracle (same cache length, context-informed vs plain);
* fuser size against the two models.

Usage: ``python -m benchmarks.fusion.reference [--limit N] [--json FILE] [--png FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from semcomm.cli._tools.fusion_reference import _assets_paths, reference_items, run_eval
from semcomm.engine import HFEngine
from semcomm.fusion import FusionPipeline, load_fuser, load_side, shipped_fuser_path
from semcomm.fusion._eval import EvalSettings, plot_results, score_options
from semcomm.kv import MemoryStore
from semcomm.reference import build_world

console = Console()


def breakdown(limit: int, fuser_path: Path) -> dict[str, Any]:
    """Per-stage C2C time, cold (sharer forward) and with the sharer KV from a warm store."""
    s_path, r_path = _assets_paths()
    s, r = load_side(s_path), load_side(r_path)
    fz = load_fuser(fuser_path, sharer=s.spec, receiver=r.spec)
    items = reference_items(build_world(seed=0), heldout=True, limit=limit)
    st = EvalSettings()
    engine = HFEngine(
        s.model, s.tokenizer, store=MemoryStore(capacity_bytes=256 << 20), chunk_size=16
    )
    runs: dict[str, dict[str, list[float]]] = {}
    for name, pipe in (
        ("forward", FusionPipeline(s, r, fz)),
        ("store_warm", FusionPipeline(s, r, fz, sharer_engine=engine)),
    ):
        if name == "store_warm":  # warm the store: every item's sharer prompt once
            for it in items:
                engine.prefill(pipe.encode(it.qa_prompt).sharer.input_ids)
        acc: dict[str, list[float]] = {}
        for it in items:
            t0 = time.perf_counter()
            fp = pipe.encode(it.qa_prompt)
            layers, stats = pipe.fused_layers(fp)
            t1 = time.perf_counter()
            opts = [
                list(
                    r.tokenizer(st.option_format.format(option=o), add_special_tokens=False)[
                        "input_ids"
                    ]
                )
                for o in it.options
            ]
            ids = fp.receiver.input_ids
            score_options(r.model, layers, [ids[-1]], len(ids) - 1, opts)
            t2 = time.perf_counter()
            for k in ("sharer_ms", "receiver_prefill_ms", "fuse_ms"):
                acc.setdefault(k, []).append(float(stats.get(k, 0.0)))
            acc.setdefault("score_ms", []).append((t2 - t1) * 1e3)
            acc.setdefault("total_ms", []).append((t2 - t0) * 1e3)
            if name == "store_warm":
                es = stats.get("sharer_engine_stats") or {}
                acc.setdefault("sharer_hit_fraction", []).append(
                    es.get("hit_tokens", 0) / max(es.get("prompt_tokens", 1), 1)
                )
        runs[name] = acc
    return {name: {k: statistics.median(v) for k, v in acc.items()} for name, acc in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=0, help="held-out questions (0: all)")
    p.add_argument("--fuser", type=Path, default=None, help="fuser folder (default: shipped)")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/fusion_reference.json"))
    p.add_argument("--png", type=Path, default=Path("benchmarks/results/fusion_reference.png"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke run: 8 held-out questions")
    args = p.parse_args()
    if args.quick:
        args.limit = 8
    torch.set_num_threads(args.threads)
    fuser_path = args.fuser or shipped_fuser_path()
    n_items = len(reference_items(build_world(seed=0), heldout=True, limit=args.limit or None))
    with Progress(console=console) as prog:
        task = prog.add_task("evaluate", total=n_items)
        doc = run_eval(
            fuser=fuser_path,
            limit=args.limit or None,
            progress=lambda i, n: prog.update(task, completed=i),
        )
    doc["breakdown_ms"] = breakdown(min(n_items, 8 if args.quick else 60), fuser_path)
    setup = doc["setup"]
    t = Table(
        title=f"C2C on {setup['items']} held-out reference questions ({setup['answer_mode']})"
    )
    for c in ("method", "accuracy", "seen", "unseen", "median latency (ms)", "tokens generated"):
        t.add_column(c, justify="left" if c == "method" else "right")
    for m in ("receiver", "sharer", "t2t", "c2c"):
        r = doc[m]
        t.add_row(
            m,
            f"{r['accuracy']:.3f}",
            f"{r['accuracy_seen']:.3f}",
            f"{r['accuracy_unseen']:.3f}",
            f"{r['latency_s'] * 1e3:.1f}",
            f"{r['tokens_generated']:.1f}",
        )
    console.print(t)
    s = doc["summary"]
    g = Table(title="goals (ratios from this run)")
    for c in ("measure", "value", "goal", "met"):
        g.add_column(c)
    rows = [
        (
            "C2C - receiver (points)",
            s["c2c_minus_receiver_points"],
            ">= +10",
            s["c2c_minus_receiver_points"] >= 10,
        ),
        ("C2C - T2T (points)", s["c2c_minus_t2t_points"], ">= +3", s["c2c_minus_t2t_points"] >= 3),
        (
            "T2T / C2C latency",
            s["t2t_over_c2c_latency"],
            ">= 2.5x",
            s["t2t_over_c2c_latency"] >= 2.5,
        ),
    ]
    for name, v, goal, ok in rows:
        g.add_row(
            name, f"{v:+.1f}" if "points" in name else f"{v:.2f}x", goal, "yes" if ok else "NO"
        )
    console.print(g)
    b = Table(title="C2C per-query time, median ms (sharer KV: forward vs warm KV store)")
    for c in ("sharer KV", "sharer", "receiver prefill", "fuse", "score", "total"):
        b.add_column(c, justify="right")
    for name, v in doc["breakdown_ms"].items():
        b.add_row(
            name,
            f"{v['sharer_ms']:.2f}",
            f"{v['receiver_prefill_ms']:.2f}",
            f"{v['fuse_ms']:.2f}",
            f"{v['score_ms']:.2f}",
            f"{v['total_ms']:.2f}",
        )
    console.print(b)
    o = doc["oracle"]
    console.print(
        f"oracle: question {o['accuracy_question']:.3f}, enriched (same length) "
        f"{o['accuracy_enriched']:.3f}, full context {o['accuracy_full_context']:.3f}"
    )
    console.print(
        f"fuser {setup['fuser_params']:,} params = {setup['fuser_params'] / setup['receiver_params']:.2f}x "
        f"the receiver ({setup['receiver_params']:,}); sharer {setup['sharer_params']:,}; training "
        f"{setup['fuser_meta'].get('train_seconds', 'n/a')} s"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    plot_results({m: doc[m] for m in ("receiver", "sharer", "t2t", "c2c")}, args.png)
    console.print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
