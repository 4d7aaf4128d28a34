"""Agents sharing text: K solver agents and a judge of one model, full prefill against shared
segments reused (engine/_agents.py), and today's text hand-off with the exact prefix cache.

For each model and data set (``gsm8k``: GSM8K train, ``arc_easy`` / ``commonsense_qa`` /
``piqa``: the multiple-choice sets, all under ../shared/data), the first N questions go through
the same pipeline by ``full`` prefill, ``prefix`` (every agent through the exact prefix cache:
role prompts hit, the shared text after them never does) and ``reuse`` (shared segments from
anchors or stored documents, a share recomputed by the selector, the confidence gate), what
``semcomm agents eval`` runs. Reported per pipeline: accuracy, agreement with full's final
answer, judge agreement (the same candidate picked), the reused share of all agents' prefill
tokens, fallbacks, end-to-end latency (median) and its ratio to full and to prefix, the last
agent's TTFT (median) and its ratio, TTFT by agent position. A table, JSON and a PNG (TTFT by
agent position, one panel per model and set).

Usage: ``python -m benchmarks.agents.bench [--quick] [--models a,b] [--sets gsm8k,arc_easy]
[--n 5] [--agents 4] [--selector epic] [--recompute 0.15] [--gate margin]
[--judge-gate always] [--judge-margin M] [--watch 0.1] [--offsets 0] [--max-new-tokens 0] [--threads 1] [--no-prefix] [--json FILE]
[--png FILE]``. ``--quick``: the reference receiver (a tiny Qwen2-shaped model shipped in the
package), 2 GSM8K questions, 3 agents, 8 new tokens: a smoke run of seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.common import DATA, RESULTS, write_json
from semcomm.cli._tools.agents_eval import Runner, load_items, run_eval

console = Console(width=None if sys.stdout.isatty() else 160)
SETS = {"gsm8k": DATA / "sft" / "gsm8k_train.jsonl",
        "arc_easy": DATA / "mcqa" / "arc_easy.jsonl",
        "commonsense_qa": DATA / "mcqa" / "commonsense_qa.jsonl",
        "piqa": DATA / "mcqa" / "piqa.jsonl"}


def table(title: str, summary: dict[str, Any]) -> Table:
    t = Table(title=title)
    for col in ("pipeline", "acc", "agree", "judge agree", "reused", "fallbacks", "latency s",
                "full/x", "prefix/x", "last TTFT s", "full/x", "n"):
        t.add_column(col, justify="left" if col == "pipeline" else "right")
    full, prefix = summary.get("full", {}), summary.get("prefix", {})

    def ratio(base: dict[str, Any], s: dict[str, Any], key: str) -> str:
        return f"{base[key] / s[key]:.2f}" if base and s.get(key) else "-"

    for name, s in summary.items():
        t.add_row(name, f"{s['accuracy']:.2f}",
                  "-" if s.get("agreement") is None else f"{s['agreement']:.2f}",
                  "-" if s.get("judge_agreement") is None else f"{s['judge_agreement']:.2f}",
                  f"{s['reused_share']:.2f}",
                  "-" if s.get("fallbacks") is None else f"{s['fallbacks']}/{s['turns']}",
                  f"{s['latency_s']:.2f}", ratio(full, s, "latency_s"),
                  ratio(prefix, s, "latency_s"), f"{s['last_agent_ttft_s']:.3f}",
                  ratio(full, s, "last_agent_ttft_s"), str(s["n"]))
    return t


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, s, r) for m, sets in results.items() for s, r in sets.items()]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (model, name, res) in zip(axes[0], panels):
        summary = res["summary"]
        for pipe, s in summary.items():
            ys = s["ttft_by_agent_s"]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=pipe)
        agents = next(iter(summary.values()))["agents"]
        ax.set_xticks(range(1, len(agents) + 1), [f"{i + 1}\n{a}" for i, a in enumerate(agents)])
        ax.set_xlabel("agent position")
        ax.set_ylabel("TTFT median (s)")
        ax.set_title(f"{Path(str(model)).name} / {name} (n={res['n']})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description="Agents sharing text: cross-context KV reuse")
    ap.add_argument("--quick", action="store_true", help="the reference receiver, 2 GSM8K "
                    "questions, 3 agents, 8 new tokens")
    ap.add_argument("--models", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--sets", default="arc_easy,gsm8k")
    ap.add_argument("--n", type=int, default=5, help="questions per set (file order)")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--pipeline", default="judge")
    ap.add_argument("--selector", default="epic")
    ap.add_argument("--recompute", type=float, default=0.15)
    ap.add_argument("--gate", default="margin")
    ap.add_argument("--judge-gate", default="always")
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--judge-margin", type=float, default=None)
    ap.add_argument("--watch", type=float, default=0.1)
    ap.add_argument("--offsets", type=int, default=0, help="KVCOMM's offsets (0: off)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: 160 math, 48 choice")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-prefix", action="store_true", help="skip the prefix-cache pipeline")
    ap.add_argument("--json", type=Path, default=RESULTS / "agents.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "agents.png")
    a = ap.parse_args()
    if a.quick:
        from semcomm.reference import receiver_path

        a.models, a.sets, a.n, a.agents, a.max_new_tokens = (str(receiver_path()), "gsm8k", 2,
                                                             3, 8)
    torch.set_num_threads(a.threads)
    args = vars(a) | {"json": str(a.json), "png": str(a.png)}
    results: dict[str, dict[str, Any]] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        for model in [m for m in a.models.split(",") if m]:
            runner = Runner(model, prefix=not a.no_prefix)
            results[model] = {}
            for name in [s for s in a.sets.split(",") if s]:
                if name not in SETS:
                    raise SystemExit(f"unknown set {name!r}; one of {', '.join(SETS)}")
                if not SETS[name].exists():
                    raise SystemExit(f"needs {SETS[name]} (the shared data sets)")
                items = load_items(SETS[name], a.n)
                task = progress.add_task(f"{Path(model).name} {name}", total=len(items))
                res = run_eval(runner, items, agents=a.agents, pipeline=a.pipeline,
                               selector=a.selector, recompute=a.recompute, gate=a.gate,
                               judge_gate=a.judge_gate, margin=a.margin, watch=a.watch,
                               judge_margin=a.judge_margin, offsets=a.offsets,
                               max_new_tokens=a.max_new_tokens or None,
                               progress=lambda d, t, task=task: progress.update(task,
                                                                                completed=d))
                res["n"] = len(items)
                results[model][name] = res
                console.print(table(f"{Path(model).name} / {name}: {len(items)} questions, "
                                    f"{a.agents} solvers + judge, {a.selector}@{a.recompute:g},"
                                    f" gate {a.gate}/{a.judge_gate}, {a.threads} thread(s)",
                                    res["summary"]))
                write_json(a.json, {"args": args, "results": results}, console)
    write_json(a.json, {"args": args, "results": results}, console)
    plot(results, a.png)


if __name__ == "__main__":
    main()
