"""The model router on the two real catalog models: labels, training, held-out evaluation.

Labels come from scoring both models on multiple-choice questions with the option
log-likelihood rule (``semcomm fusion eval --methods receiver,sharer``: the receiver is
SmolLM2-135M-Instruct, the sharer Qwen2.5-Coder-0.5B-Instruct), so a label says whether that
model picks the right option for that question. Training rows are items ``300..499`` of each
development set (ARC-Easy, CommonsenseQA, PIQA); the held-out rows are items ``0..59`` (never
used by the fuser's training data either). The router (MiniLM features, one logistic regression
per model, calibrated to a cost share) is evaluated on the held-out rows against each model
alone, a random router at the same cost share and the oracle (RouteLLM's PGR / APGR).

    python -m tools.train.router_real                 # label (resumable), train, evaluate
    python -m tools.train.router_real --ship          # also write the shipped router asset

Labelling runs ``semcomm fusion eval`` once per set and split and keeps each JSON, so a rerun
resumes where it stopped. Writes ``benchmarks/results/router_real.json`` and ``router_real.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data" / "mcqa"
SETS = ("arc_easy", "commonsense_qa", "piqa")
SMALL, LARGE = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
COSTS = {SMALL: 1.0, LARGE: 4.0}  # the embedded default's relative costs
SPLITS = {"train": (300, 200), "test": (0, 60)}  # (skip, limit) per set
ASSET = ROOT / "src" / "semcomm" / "routing" / "assets" / "smollm2-qwen2.5-coder.json"

console = Console(stderr=True)


def label_file(work: Path, name: str, split: str) -> Path:
    return work / f"{name}_{split}.json"


def run_labels(work: Path, data: Path, threads: int) -> None:
    """Score both models on each set and split (skips splits already written)."""
    work.mkdir(parents=True, exist_ok=True)
    for split, (skip, limit) in SPLITS.items():
        for name in SETS:
            out = label_file(work, name, split)
            if out.is_file():
                continue
            cmd = [sys.executable, "-m", "semcomm.cli", "fusion", "eval", "--data",
                   str(data / f"{name}.jsonl"), "--skip", str(skip), "--limit", str(limit),
                   "--methods", "receiver,sharer", "--threads", str(threads), "--json", str(out)]
            console.print(f"[bold]labelling[/] {name} {split}: {' '.join(cmd[2:])}")
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def read_rows(work: Path, data: Path, split: str) -> list[dict[str, Any]]:
    """Question text + per-model correctness for one split, from the eval JSONs."""
    from semcomm.fusion import read_mcqa

    rows: list[dict[str, Any]] = []
    skip, limit = SPLITS[split]
    for name in SETS:
        doc = json.loads(label_file(work, name, split).read_text(encoding="utf-8"))
        qs = read_mcqa(data / f"{name}.jsonl", skip=skip, limit=limit)
        small, large = doc["receiver"]["correct"], doc["sharer"]["correct"]
        if not len(qs) == len(small) == len(large):
            raise SystemExit(f"{name} {split}: {len(qs)} questions but {len(small)}/{len(large)} labels")
        for q, a, b in zip(qs, small, large, strict=True):
            rows.append({"question": q.question, "set": name, f"{SMALL}_correct": bool(a),
                         f"{LARGE}_correct": bool(b)})
    return rows


def random_quality(y: np.ndarray, share: float, rng: np.random.Generator, reps: int = 200) -> float:
    """Mean quality of routing a random ``share`` of prompts to the large model."""
    n = len(y)
    vals = []
    for _ in range(reps):
        pick = rng.random(n) < share
        vals.append(float(np.where(pick, y[:, 1], y[:, 0]).mean()))
    return float(np.mean(vals))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=RESULTS / "train_router_real_labels",
                   help="folder for the per-set label JSONs (resumable)")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=float, default=0.5, help="cost share the shipped router targets")
    p.add_argument("--json", type=Path, default=RESULTS / "train_router_real.json")
    p.add_argument("--png", type=Path, default=RESULTS / "train_router_real.png")
    p.add_argument("--ship", action="store_true", help=f"write the trained router to {ASSET.relative_to(ROOT)}")
    args = p.parse_args(argv)

    from semcomm.routing import ModelRouter, ModelSpec

    run_labels(args.work, args.data, args.threads)
    train, test = read_rows(args.work, args.data, "train"), read_rows(args.work, args.data, "test")
    models = [ModelSpec(SMALL, COSTS[SMALL]), ModelSpec(LARGE, COSTS[LARGE])]

    def labels(rows: list[dict[str, Any]]) -> np.ndarray:
        return np.asarray([[r[f"{m.name}_correct"] for m in models] for r in rows], dtype=np.float64)

    t0 = time.perf_counter()
    router = ModelRouter(models).fit([r["question"] for r in train], labels(train), budget=args.budget)
    fit_s = time.perf_counter() - t0
    prompts, y = [r["question"] for r in test], labels(test)
    ev = router.evaluate(prompts, y)
    fresh = [f"Question: {q}" for q in prompts[:50]]  # texts the embedder has not seen
    t0 = time.perf_counter()
    for q in fresh:
        router.route(q)
    route_ms = (time.perf_counter() - t0) / len(fresh) * 1e3

    # at the shipped budget: the router's own choice on held-out prompts
    picks = np.asarray([router.route(q).index for q in prompts])
    share = float(picks.mean())
    routed_q = float(y[np.arange(len(y)), picks].mean())
    rng = np.random.default_rng(0)
    rand_q = random_quality(y, share, rng)
    per_set = {}
    for name in SETS:
        idx = [i for i, r in enumerate(test) if r["set"] == name]
        per_set[name] = {"n": len(idx), SMALL: float(y[idx, 0].mean()), LARGE: float(y[idx, 1].mean()),
                         "routed": float(y[idx, picks[idx]].mean()), "large_share": float(picks[idx].mean()),
                         "oracle": float(y[idx].max(axis=1).mean())}
    train_y = labels(train)
    result = {
        "models": {m.name: m.cost for m in models},
        "train": {"n": len(train), SMALL: float(train_y[:, 0].mean()), LARGE: float(train_y[:, 1].mean()),
                  "only_small": int(((train_y[:, 0] == 1) & (train_y[:, 1] == 0)).sum()),
                  "only_large": int(((train_y[:, 0] == 0) & (train_y[:, 1] == 1)).sum())},
        "test": {"n": len(test), "per_set": per_set},
        "budget": args.budget,
        "at_budget": {"large_share": share, "quality": routed_q, "random_same_share": rand_q,
                      "router_over_random": routed_q - rand_q, "small_alone": float(y[:, 0].mean()),
                      "large_alone": float(y[:, 1].mean()), "oracle": float(y.max(axis=1).mean())},
        "sweep": ev.to_json(),
        "fit_s": fit_s,
        "route_ms": route_ms,
        "command": "python -m tools.train.router_real" + (" --ship" if args.ship else ""),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    tab = Table(title=f"model router on the real pair (held-out, n={len(test)}, cost {SMALL}=1, {LARGE}=4)")
    for col in ("condition", "accuracy", "share to the large model"):
        tab.add_column(col, justify="right" if col != "condition" else "left")
    tab.add_row(f"{SMALL} alone", f"{y[:, 0].mean():.3f}", "0.00")
    tab.add_row(f"{LARGE} alone", f"{y[:, 1].mean():.3f}", "1.00")
    tab.add_row(f"router (budget {args.budget})", f"{routed_q:.3f}", f"{share:.2f}")
    tab.add_row("random at the same share", f"{rand_q:.3f}", f"{share:.2f}")
    tab.add_row("oracle (either right)", f"{y.max(axis=1).mean():.3f}", "")
    Console().print(tab)
    console.print(f"APGR {ev.apgr:.3f} (random 0.5); route {route_ms:.1f} ms per prompt; fit {fit_s:.1f} s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ev.cost_share, ev.quality, "o-", label=f"router (APGR {ev.apgr:.2f})")
    q0, q1 = float(y[:, 0].mean()), float(y[:, 1].mean())
    ax.plot([0, 1], [q0, q1], "--", color="grey", label="random")
    ax.axhline(float(y.max(axis=1).mean()), color="green", lw=0.8, label="oracle")
    ax.set_xlabel(f"share of requests sent to {LARGE}")
    ax.set_ylabel("held-out accuracy (option log-likelihood)")
    ax.set_title("model router, real pair (ARC-Easy, CSQA, PIQA held-out)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    console.print(f"wrote {args.json} and {args.png}")

    if args.ship:
        ASSET.parent.mkdir(parents=True, exist_ok=True)
        router.save(ASSET)
        console.print(f"shipped the router to {ASSET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
