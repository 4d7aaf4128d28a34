"""CLI: ``semcomm agents eval``: agents sharing text, reuse against full prefill.

``semcomm agents eval --data FILE --limit N --json OUT [--pipeline NAME] [--agents K]``: FILE is
JSONL of ``{"question", "answer"}`` (GSM8K: the number after ``####``) or ``{"question",
"choices", "answer": int}``; the first N items in file order. The default pipeline (``judge``)
is K solver agents (default 4, different role prompts, each reading the question and every
earlier agent's answer) and a judge that picks one answer by its number; ``chain`` has no judge
(the last agent's answer is final). Each question runs by full prefill and with shared
segments reused (engine/_agents.py). OUT gets ``{"full", "reuse"}``, each with ``accuracy``,
``latency_s`` (median end to end), ``last_agent_ttft_s`` (median) and ``n``; ``reuse`` also
``agreement``, ``judge_agreement`` and ``reused_share``; plus ``meta`` and the per-question
``rows``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import InvalidInputError

__all__ = ["agents_app", "register"]

agents_app = typer.Typer(help="Agents sharing text: cross-context KV reuse, evaluated.",
                         no_args_is_help=True)
_out = Console()


def summary_table(summary: dict) -> Table:
    t = Table(title="Agent pipeline: full prefill vs shared segments reused")
    for col in ("pipeline", "accuracy", "agree", "judge agree", "reused", "fallbacks",
                "latency med (s)", "last TTFT med (s)", "n"):
        t.add_column(col, justify="left" if col == "pipeline" else "right")
    full = summary.get("full", {})
    for name, s in summary.items():
        lat = f"{s['latency_s']:.2f}"
        ttft = f"{s['last_agent_ttft_s']:.3f}"
        if name != "full" and full:
            if s["latency_s"]:
                lat += f" ({full['latency_s'] / s['latency_s']:.2f}x)"
            if s["last_agent_ttft_s"]:
                ttft += f" ({full['last_agent_ttft_s'] / s['last_agent_ttft_s']:.2f}x)"
        t.add_row(name, f"{s['accuracy']:.2f}",
                  "-" if s.get("agreement") is None else f"{s['agreement']:.2f}",
                  "-" if s.get("judge_agreement") is None else f"{s['judge_agreement']:.2f}",
                  f"{s['reused_share']:.2f}",
                  "-" if s.get("fallbacks") is None else f"{s['fallbacks']}/{s['turns']}",
                  lat, ttft, str(s["n"]))
    return t


@agents_app.command("eval")
def eval_cmd(
    data: Path = typer.Option(..., "--data", help="JSONL of {question, answer} (GSM8K) or "
                              "{question, choices, answer: int}."),
    limit: int = typer.Option(..., "--limit", min=1, help="The first N items in file order."),
    json_out: Path = typer.Option(..., "--json", help="Where to write the results."),
    pipeline: str = typer.Option("judge", "--pipeline", help="judge (K solvers and a judge) "
                                 "or chain (K agents, the last one's answer final)."),
    agents: int = typer.Option(4, "--agents", min=1, max=12, help="Solver agents."),
    model: str = typer.Option("", "--model", help="Catalog name or path (default: the "
                              "default catalog model)."),
    selector: str = typer.Option("epic", "--selector", help="How shared segments are "
                                 "blended: cacheblend, epic, prophet, concat or full."),
    recompute: float = typer.Option(0.15, "--recompute", min=0.0, max=1.0,
                                    help="Share of shared-segment tokens recomputed."),
    gate: str = typer.Option("margin", "--gate", help="Solvers' confidence test: off, margin, "
                             "dual, dual+margin, always."),
    judge_gate: str = typer.Option("always", "--judge-gate", help="The judge's (always: "
                                   "full prefill)."),
    margin: float = typer.Option(0.02, "--margin", min=0.0, max=1.0,
                                 help="Top-1 minus top-2 probability below which the reused "
                                 "prefill falls back to full prefill."),
    judge_margin: float = typer.Option(-1.0, "--judge-margin", max=1.0,
                                       help="The judge's margin (negative: --margin)."),
    watch: float = typer.Option(0.1, "--watch", min=0.0, max=1.0,
                                help="While a solver decodes after reused KV, rebuild the KV "
                                "in full at the first step whose top-1 minus top-2 "
                                "probability is below this (0: off)."),
    offsets: int = typer.Option(0, "--offsets", min=0,
                                help="KVCOMM's offsets: samples each agent's slot learns by "
                                "full prefill before its learned offset is added (0: off)."),
    max_new_tokens: int = typer.Option(0, "--max-new-tokens", min=0,
                                       help="Per solver (0: 160 math, 48 choice)."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch threads (0: its default)."),
) -> None:
    """K solvers and a judge by full prefill vs shared segments reused: accuracy, agreement,
    reused share, latency, last agent's TTFT."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..engine import GATES, SELECTORS
    from ..models import DEFAULT_MODEL
    from ._tools.agents_eval import PIPELINES, Runner, load_items, run_eval

    if pipeline not in PIPELINES:
        raise InvalidInputError(f"unknown pipeline {pipeline!r}; one of {', '.join(PIPELINES)}")
    if selector not in SELECTORS:
        raise InvalidInputError(f"unknown selector {selector!r}; one of {', '.join(SELECTORS)}")
    for g in (gate, judge_gate):
        if g not in GATES:
            raise InvalidInputError(f"unknown gate {g!r}; one of {', '.join(GATES)}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    items = load_items(data, limit)
    name = model or DEFAULT_MODEL
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=_out, transient=False) as progress:
        load = progress.add_task(f"loading {name}", total=None)
        runner = Runner(name)
        progress.update(load, total=1, completed=1)
        task = progress.add_task(f"questions ({pipeline}, {agents} agents)", total=len(items))
        res = run_eval(runner, items, agents=agents, pipeline=pipeline, selector=selector,
                       recompute=recompute, gate=gate, judge_gate=judge_gate, margin=margin,
                       watch=watch, judge_margin=judge_margin if judge_margin >= 0 else None,
                       offsets=offsets, max_new_tokens=max_new_tokens or None,
                       progress=lambda done, total: progress.update(task, completed=done))
    out = dict(res["summary"])
    out["meta"] = {"model": name, "data": str(data), "limit": limit, "pipeline": pipeline,
                   "agents": agents, "selector": selector, "recompute": recompute,
                   "gate": gate, "judge_gate": judge_gate, "margin": margin,
                   "judge_margin": judge_margin if judge_margin >= 0 else margin, "watch": watch,
                   "offsets": offsets, "max_new_tokens": max_new_tokens or None, "threads": threads or None}
    out["rows"] = res["rows"]
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(out, indent=2, default=str))
    _out.print(summary_table(res["summary"]))
    _out.print(f"wrote {json_out}")


def register(app: typer.Typer) -> None:
    app.add_typer(agents_app, name="agents")
