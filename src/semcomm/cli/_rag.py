"""CLI: ``semcomm rag eval``: documents reused at any position, measured on a RAG data set.

``semcomm rag eval --data FILE --limit N --json OUT [--model NAME] [--recompute R]
[--selector NAME] [--docs K]``: FILE is JSON or JSONL of ``{"question", "answers": [...],
"ctxs": [{"title", "text"}, ...]}``; the first N items in file order. Each item's passages are
stored alone first (``DocumentReuse.precompute``), then each question is asked with its first K
passages in the file's order by full prefill, prefix-only caching, plain concatenation (r = 0)
and reuse (the selector at budget R). OUT gets ``{"full", "prefix", "concat", "reuse"}``, each
with ``f1``, ``em``, ``ttft_s`` (median per question) and ``n``; ``reuse`` also ``agreement``
(answers identical to full's) and ``recompute`` (share of document tokens recomputed); plus
``meta`` and the per-question ``rows``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from ..errors import InvalidInputError

__all__ = ["rag_app", "register"]

rag_app = typer.Typer(help="RAG: documents reused at any position, evaluated.",
                      no_args_is_help=True)
_out = Console()


def _table(summary: dict) -> Table:
    t = Table(title="RAG answers by mode")
    for col in ("mode", "F1", "EM", "agree", "KL", "recompute", "TTFT med (s)", "TTFT p90 (s)",
                "n"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    full = summary.get("full", {}).get("ttft_s")
    for name, s in summary.items():
        ratio = f" ({full / s['ttft_s']:.1f}x)" if full and s["ttft_s"] and name != "full" else ""
        t.add_row(name, f"{s['f1']:.3f}", f"{s['em']:.3f}",
                  "-" if s.get("agreement") is None else f"{s['agreement']:.2f}",
                  "-" if s.get("kl") is None else f"{s['kl']:.3f}",
                  f"{s['recompute']:.2f}", f"{s['ttft_s']:.3f}{ratio}",
                  f"{s['ttft_p90_s']:.3f}", str(s["n"]))
    return t


@rag_app.command("eval")
def eval_cmd(
    data: Path = typer.Option(..., "--data", help="JSON or JSONL of {question, answers, ctxs}."),
    limit: int = typer.Option(..., "--limit", min=1, help="The first N items in file order."),
    json_out: Path = typer.Option(..., "--json", help="Where to write the results."),
    model: str = typer.Option("", "--model", help="Catalog name or path (default: the "
                              "default catalog model)."),
    recompute: float = typer.Option(0.15, "--recompute", min=0.0, max=1.0,
                                    help="Share of document tokens recomputed by the selector."),
    selector: str = typer.Option("", "--selector", help="cacheblend, epic or prophet "
                                 "(default: the engine's default selector)."),
    docs: int = typer.Option(0, "--docs", min=0, help="Passages per question (0: all)."),
    margin: float = typer.Option(0.0, "--margin", min=0.0, max=1.0,
                                 help="Also run 'gated': reuse with the confidence test (full "
                                      "prefill when the first token's top-1 minus top-2 "
                                      "probability is below this); 0: not run."),
    watch: float = typer.Option(0.0, "--watch", min=0.0, max=1.0,
                                help="In 'gated' (run when given): rebuild the KV in full at "
                                     "the first later decode step whose top-1 minus top-2 "
                                     "probability is below this; 0: off."),
    anchor: str = typer.Option("template", "--anchor",
                               help="What each passage is computed after when stored: "
                                    "'template' (the chat header) or 'head' (the prompt's own "
                                    "head: instruction and first label)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    threads: int = typer.Option(0, "--threads", min=0, help="torch threads (0: its default)."),
) -> None:
    """Full prefill vs prefix caching vs concatenation vs reuse: F1, EM, agreement, TTFT."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..engine import DEFAULT_SELECTOR, SELECTORS
    from ..models import DEFAULT_MODEL
    from ._tools.rag_eval import contract_modes, load_items, run_eval

    if threads:
        import torch

        torch.set_num_threads(threads)
    sel = selector or DEFAULT_SELECTOR
    if sel not in SELECTORS:
        raise InvalidInputError(f"unknown selector {sel!r}; one of {', '.join(SELECTORS)}")
    items = load_items(data, limit)
    name = model or DEFAULT_MODEL
    modes = contract_modes(sel, recompute, margin or None, watch or None)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=_out, transient=False) as progress:
        tasks: dict[str, TaskID] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done)

        load = progress.add_task(f"loading {name}", total=None)
        from ._tools.rag_eval import Runner

        runner = Runner(name, anchor=anchor)
        progress.update(load, total=1, completed=1)
        res = run_eval(name, items, modes, docs=docs or None, max_new_tokens=max_new_tokens,
                       progress=report, runner=runner)
    out = dict(res["summary"])
    out["meta"] = {"model": name, "data": str(data), "limit": limit, "docs": docs or None,
                   "selector": sel, "recompute": recompute, "max_new_tokens": max_new_tokens,
                   "margin": margin or None, "watch": watch or None, "anchor": anchor,
                   "threads": threads or None}
    out["rows"] = res["rows"]
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(out, indent=2))
    _out.print(_table(res["summary"]))
    _out.print(f"wrote {json_out}")


def register(app: typer.Typer) -> None:
    app.add_typer(rag_app, name="rag")
