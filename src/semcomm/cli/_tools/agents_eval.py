"""Agent-pipeline evaluation behind ``semcomm agents eval`` and ``benchmarks/agents``.

Items are JSONL of ``{"question", "answer"}`` (GSM8K: the number after ``####`` is the answer)
or ``{"question", "choices": [...], "answer": int}`` (multiple choice). Every question goes
through the same pipeline twice on one model, from the same token ids:

* ``full``: every agent prefills its whole prompt (no cache);
* ``reuse``: shared segments (the question, earlier answers) reused across agents
  (engine/_agents.py: anchors, then stored documents; a share recomputed by a selector; the
  confidence gate falls back to full prefill);
* optionally ``prefix`` (the benchmark): every agent through the engine's exact prefix cache
  (today's text hand-off with prefix caching: role prompts hit, shared text never does).

Per pipeline: accuracy of the final answer, end-to-end latency (median), the last agent's TTFT
(median) and TTFT by agent position; for ``reuse`` also agreement (final answers identical to
``full``'s), judge agreement (the judge picked the same candidate) and the reused share of all
agents' prefill tokens.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...engine import (
    DEFAULT_JUDGE_GATE,
    DEFAULT_WATCH,
    AgentPipeline,
    AnchorPool,
    HFEngine,
    PipelineRun,
    default_agents,
    extract_choice,
    extract_number,
)
from ...errors import InvalidInputError
from ...kv import MemoryStore

__all__ = ["PIPELINES", "Runner", "load_items", "run_eval", "summarize"]

PIPELINES = ("judge", "chain")


def load_items(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` items of a JSONL file, each ``{"question", "answer", "kind",
    ["choices"]}`` with ``answer`` normalised (GSM8K: the number after ``####``)."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"no data file at {p}")
    items: list[dict[str, Any]] = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        if limit is not None and len(items) >= limit:
            break
        row = json.loads(line)
        q, a = row.get("question") if isinstance(row, dict) else None, (
            row.get("answer") if isinstance(row, dict) else None)
        ch = row.get("choices") if isinstance(row, dict) else None
        if isinstance(q, str) and isinstance(ch, list) and ch and isinstance(a, int) \
                and not isinstance(a, bool) and 0 <= a < len(ch):
            items.append({"question": q, "choices": [str(c) for c in ch], "answer": a,
                          "kind": "choice"})
        elif isinstance(q, str) and isinstance(a, str):
            gold = a.split("####")[-1].strip() if "####" in a else a.strip()
            num = extract_number(gold)
            items.append({"question": q, "answer": num if num is not None else gold,
                          "kind": "math"})
        else:
            raise InvalidInputError(
                f"{p} line {i + 1}: expected {{'question': str, 'answer': str}} or "
                "{'question': str, 'choices': [str, ...], 'answer': int}")
    if not items:
        raise InvalidInputError(f"{p} holds no items")
    if len({it["kind"] for it in items}) > 1:
        raise InvalidInputError(f"{p} mixes math and multiple-choice items")
    return items


def final_answer(run: PipelineRun, item: dict[str, Any]) -> Any:
    if item["kind"] == "choice":
        return extract_choice(run.final_text, len(item["choices"]))
    return extract_number(run.final_text)


def correct(pred: Any, item: dict[str, Any]) -> bool:
    if pred is None:
        return False
    if item["kind"] == "choice":
        return int(pred) == int(item["answer"])
    try:
        return abs(float(pred) - float(item["answer"])) < 1e-6
    except ValueError:
        return str(pred) == str(item["answer"])


class Runner:
    """The engines of one model (weights shared): full (no store), reuse and prefix."""

    def __init__(self, model: str | Any, tokenizer: Any = None, chunk_size: int = 256,
                 store_bytes: int = 1 << 30, prefix: bool = False):
        # the full engine's chunk size (its default): a fallback's prefill then runs the same
        # forwards as full prefill (the engine prefills one chunk a forward; at 16 a 335-token
        # fallback took 21 forwards and 14-16 s against full's 6 s)
        self.full = HFEngine(model, tokenizer, store=None) if not isinstance(model, HFEngine) \
            else model
        m, tok = self.full.model, self.full.tokenizer
        self.reuse = HFEngine(m, tok, store=MemoryStore(store_bytes), chunk_size=chunk_size)
        self.prefix = (HFEngine(m, tok, store=MemoryStore(store_bytes // 4),
                                chunk_size=chunk_size) if prefix else None)


def _pipelines(runner: Runner, kind: str, agents: int, pipeline: str, *, selector: str,
               recompute: float, gate: str, judge_gate: str, margin: float,
               max_new_tokens: int | None, anchor_budget: int, watch: float = DEFAULT_WATCH,
               judge_margin: float | None = None, offsets: int = 0) -> dict[str, AgentPipeline]:
    if pipeline not in PIPELINES:
        raise InvalidInputError(f"unknown pipeline {pipeline!r}; one of {', '.join(PIPELINES)}")
    solvers, judge = default_agents(agents, kind, max_new_tokens)
    j = judge if pipeline == "judge" else None
    out = {"full": AgentPipeline(runner.full, solvers, j, reuse=False, kind=kind),
           "reuse": AgentPipeline(runner.reuse, solvers, j, reuse=True, selector=selector,
                                  recompute=recompute, gate=gate, judge_gate=judge_gate,
                                  margin=margin, pool=AnchorPool(anchor_budget), kind=kind,
                                  watch=watch, judge_margin=judge_margin, offsets=offsets)}
    if runner.prefix is not None:
        out["prefix"] = AgentPipeline(runner.prefix, solvers, j, reuse=False, kind=kind)
    return out


def run_eval(runner: Runner, items: Sequence[dict[str, Any]], *, agents: int = 4,
             pipeline: str = "judge", selector: str = "epic", recompute: float = 0.15,
             gate: str = "margin", judge_gate: str = DEFAULT_JUDGE_GATE, margin: float = 0.02,
             max_new_tokens: int | None = None, anchor_budget: int = 256 << 20,
             watch: float = DEFAULT_WATCH, judge_margin: float | None = None,
             offsets: int = 0,
             progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Every item through each pipeline; per-pipeline summaries, per-question rows, meta."""
    kind = items[0]["kind"]
    pipes = _pipelines(runner, kind, agents, pipeline, selector=selector, recompute=recompute,
                       gate=gate, judge_gate=judge_gate, margin=margin,
                       max_new_tokens=max_new_tokens, anchor_budget=anchor_budget,
                       watch=watch, judge_margin=judge_margin, offsets=offsets)
    rows: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        row: dict[str, Any] = {"question": item["question"], "gold": item["answer"]}
        for name, pipe in pipes.items():
            run = pipe.run(item["question"], item.get("choices"))
            pred = final_answer(run, item)
            row[name] = {"final": pred, "correct": correct(pred, item), "pick": run.pick,
                         "latency_s": run.latency_s, "prompt_tokens": run.prompt_tokens,
                         "saved_tokens": sum(t.saved_tokens for t in run.turns),
                         "reused_share": run.reused_share,
                         "turns": [t.to_dict() for t in run.turns]}
        for name in pipes:
            if name != "full":
                row[name]["agree"] = row[name]["final"] == row["full"]["final"]
                row[name]["judge_agree"] = row[name]["pick"] == row["full"]["pick"]
        rows.append(row)
        if progress:
            progress(i + 1, len(items))
    summary = summarize(rows, list(pipes))
    if pipes["reuse"].pool is not None:
        summary["reuse"]["anchors"] = pipes["reuse"].pool.stats()
    return {"summary": summary, "rows": rows}


def summarize(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        rs = [r[name] for r in rows]
        if not rs:
            continue
        positions = max(len(r["turns"]) for r in rs)
        by_pos = [statistics.median(r["turns"][p]["ttft_s"] for r in rs if len(r["turns"]) > p)
                  for p in range(positions)]
        turns = [t for r in rs for t in r["turns"]]
        s: dict[str, Any] = {
            "accuracy": statistics.fmean(float(r["correct"]) for r in rs),
            "latency_s": statistics.median(r["latency_s"] for r in rs),
            "last_agent_ttft_s": statistics.median(r["turns"][-1]["ttft_s"] for r in rs),
            "n": len(rs),
            "ttft_by_agent_s": by_pos,
            "agents": [t["name"] for t in rs[0]["turns"]],
            "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
            "saved_tokens": sum(r["saved_tokens"] for r in rs),
            "reused_share": (sum(r["saved_tokens"] for r in rs)
                             / max(1, sum(r["prompt_tokens"] for r in rs))),
        }
        if name != "full":
            s["agreement"] = statistics.fmean(float(r["agree"]) for r in rs)
            s["judge_agreement"] = statistics.fmean(float(r["judge_agree"]) for r in rs)
            s["fallbacks"] = sum(t["mode"] == "fallback" for t in turns)
            s["repairs"] = sum(t.get("repaired_at") is not None for t in turns)
            s["reused_turns"] = sum(t["mode"] == "reuse" for t in turns)
            s["warmups"] = sum(t["mode"] == "warmup" for t in turns)
            s["offsets_applied"] = sum(t.get("offsets_applied", 0) for t in turns)
            s["turns"] = len(turns)
            s["segment_reused_share"] = (sum(t["reused_tokens"] for t in turns)
                                         / max(1, sum(t["prompt_tokens"] for t in turns)))
        out[name] = s
    return out


def ttft_plot(summary: dict[str, Any], path: str | Path, title: str = "") -> None:
    """A PNG of TTFT by agent position, one line per pipeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in summary.items():
        ys = s.get("ttft_by_agent_s")
        if not ys:
            continue
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    names: list[str] = next((s["agents"] for s in summary.values() if s.get("agents")), [])
    ax.set_xticks(range(1, len(names) + 1), [f"{i + 1}\n{n}" for i, n in enumerate(names)])
    ax.set_xlabel("agent position")
    ax.set_ylabel("TTFT median (s)")
    ax.set_title(title or "TTFT by agent position")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
