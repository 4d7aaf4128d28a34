"""RAG evaluation behind ``semcomm rag eval`` and ``benchmarks/rag``: documents reused at any
position against full prefill, prefix-only caching and plain concatenation.

Items are ``{"question", "answers": [...], "ctxs": [{"title", "text"}, ...]}`` (JSON list or
JSONL). Each question is asked with its first K passages in the file's order; every mode gets
the same token ids (the passages tokenized alone, spliced into the chat template), so TTFT is
measured from the same ids to the first chosen token in every mode:

* ``full``: the engine's own prefill of the whole prompt, no store.
* ``prefix``: the engine's exact prefix cache, after each passage was stored alone as the first
  passage of a prompt (prefix caching's best case for passages seen before in another order).
* ``concat``: the stored passages re-rotated into place, nothing of them recomputed (r = 0).
* ``reuse`` (and any other selector/budget): the stored passages with a share ``r`` of their
  tokens recomputed by the selector.

Scores: answer token F1 and exact match against ``answers`` (SQuAD normalisation: lower case,
no punctuation, articles or extra spaces), agreement (greedy tokens identical to ``full``'s),
next-token KL(full || mode) at the first generated position, TTFT median and p90.
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import string
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...engine import (
    DecodeState,
    Document,
    DocumentReuse,
    HFEngine,
    SamplingParams,
    SegmentedPrompt,
    Text,
    User,
    build_prompt,
    decode_steps,
)
from ...errors import InvalidInputError
from ...kv import MemoryStore

__all__ = [
    "INSTRUCTION",
    "Mode",
    "exact_match",
    "f1_score",
    "load_items",
    "normalize_answer",
    "rag_segments",
    "run_eval",
    "summarize",
]

INSTRUCTION = ("Answer the question with a short phrase, using only the search results below "
               "(some of which might be irrelevant).\n\n")
STOP = ["\n"]
ANCHORS = ("template", "head")  # what each passage is computed after (DocumentReuse's anchor)


# ---------------------------------------------------------------------------- data
def load_items(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Items of a JSON list or JSONL file, the first ``limit`` in file order, validated."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"no data file at {p}")
    text = p.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    items = []
    for i, row in enumerate(rows[:limit] if limit is not None else rows):
        if (not isinstance(row, dict) or not isinstance(row.get("question"), str)
                or not isinstance(row.get("answers"), list) or not isinstance(row.get("ctxs"), list)
                or not row["ctxs"]
                or not all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in row["ctxs"])):
            raise InvalidInputError(
                f"{p} item {i}: expected {{'question': str, 'answers': [str], 'ctxs': "
                "[{'title': str, 'text': str}, ...]}")
        items.append(row)
    if not items:
        raise InvalidInputError(f"{p} holds no items")
    return items


def passage(ctx: dict[str, Any]) -> str:
    title = ctx.get("title") or ""
    return f"(Title: {title}) {ctx['text']}" if title else str(ctx["text"])


def rag_segments(item: dict[str, Any], k: int | None = None,
                 order: Sequence[int] | None = None) -> list[Any]:
    """The prompt of one item: instruction, labelled passages (Documents), the question."""
    ctxs = item["ctxs"][:k] if k else item["ctxs"]
    if order is not None:
        ctxs = [ctxs[i] for i in order]
    segs: list[Any] = [User(INSTRUCTION)]
    for i, c in enumerate(ctxs):
        segs += [Text(f"Document [{i + 1}] "), Document(passage(c)), Text("\n")]
    segs.append(User(f"\nQuestion: {item['question']}\nAnswer:"))
    return segs


# -------------------------------------------------------------------------- scores
def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, answers: Iterable[str]) -> float:
    best = 0.0
    pred = normalize_answer(prediction).split()
    for ans in answers:
        gold = normalize_answer(str(ans)).split()
        common = collections.Counter(pred) & collections.Counter(gold)
        same = sum(common.values())
        if same == 0:
            continue
        p, r = same / len(pred), same / len(gold)
        best = max(best, 2 * p * r / (p + r))
    return best


def exact_match(prediction: str, answers: Iterable[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(str(a)) for a in answers))


def kl_div(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of the softmax distributions of two logit vectors (nats)."""
    lp = torch.log_softmax(p_logits.float(), -1)
    lq = torch.log_softmax(q_logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum())


# ---------------------------------------------------------------------------- modes
@dataclass(frozen=True)
class Mode:
    """One way to answer: ``kind`` full / prefix / blend (with a selector and budget)."""

    name: str
    kind: str
    selector: str = ""
    recompute: float = 0.0
    margin: float | None = None  # blend: the confidence test (full prefill below it)
    watch: float | None = None  # blend: KV rebuilt in full at a later unsure decode step


@dataclass
class Answer:
    text: str
    tokens: list[int]
    ttft_s: float
    first_logits: torch.Tensor | None
    recompute: float = 0.0
    prompt_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _greedy(engine: HFEngine, cache: Any, logits: torch.Tensor, max_new: int) -> tuple[list[int], str]:
    seq = DecodeState(engine.tokenizer, SamplingParams(), engine.device, max_new_tokens=max_new,
                      stop=STOP, eos_ids=engine.eos_token_ids)
    step = torch.zeros((1, 1), dtype=torch.long, device=engine.device)

    def forward(nxt: list[int]) -> torch.Tensor:
        step.fill_(nxt[0])
        with torch.inference_mode():
            return engine._runner.forward(step, cache)[None]

    for _ in decode_steps([seq], logits[None], forward):
        pass
    seq.finish()
    return list(seq.token_ids), seq.text or ""


def prompt_head(tokenizer: Any) -> list[int]:
    """The token ids every evaluation prompt starts with, up to its first passage (chat
    header, instruction, the first passage's label)."""
    p = build_prompt(tokenizer, rag_segments({"question": "", "ctxs": [{"text": "x"}]}))
    return list(p.ids[: p.spans[0][0]])


class Runner:
    """The engines of one model (one per mode family, sharing the loaded weights).

    ``anchor``: what each passage is computed after when stored: ``template`` (the engine's
    default, the chat header) or ``head`` (the evaluation prompt's own head,
    :func:`prompt_head`: documents stored for this prompt layout only)."""

    def __init__(self, model: str, chunk_size: int = 256, store_bytes: int = 3 << 30,
                 anchor: str = "template"):
        if anchor not in ANCHORS:
            raise InvalidInputError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
        self.full = HFEngine(model, store=None)
        m, tok = self.full.model, self.full.tokenizer
        self.prefix = HFEngine(m, tok, store=MemoryStore(store_bytes // 4), chunk_size=chunk_size)
        self.reuse_engine = HFEngine(m, tok, store=MemoryStore(store_bytes), chunk_size=chunk_size)
        self.docs = DocumentReuse(self.reuse_engine, keep_blended=False,
                                  anchor=prompt_head(tok) if anchor == "head" else None)
        self.model_name = model

    def prepare(self, item: dict[str, Any], k: int | None) -> SegmentedPrompt:
        return self.docs.prepare(rag_segments(item, k))

    def store_passages(self, item: dict[str, Any], k: int | None) -> None:
        """What a RAG system does when it indexes its corpus: each passage's KV alone; and,
        for the prefix cache, the question's first passage as the first passage of an earlier
        prompt (its best case: passages seen before in another order hit only there; the
        others, stored the same way, could never be a prefix of this prompt)."""
        first_done = False
        for seg in rag_segments(item, k):
            if isinstance(seg, Document):
                self.docs.precompute(seg)
                if not first_done:
                    first = [User(INSTRUCTION), Text("Document [1] "), seg]
                    self.prefix.prefill(list(build_prompt(self.full.tokenizer, first).ids))
                    first_done = True

    def answer(self, mode: Mode, prompt: SegmentedPrompt, max_new: int) -> Answer:
        ids = list(prompt.ids)
        if mode.kind == "full":
            t0 = time.perf_counter()
            pre = self.full.prefill(ids, store=False)
            int(pre.last_logits.argmax())
            ttft = time.perf_counter() - t0
            toks, text = _greedy(self.full, pre.cache, pre.last_logits, max_new)
            return Answer(text, toks, ttft, pre.last_logits, 1.0, len(ids))
        if mode.kind == "prefix":
            r = self.prefix.generate(ids, max_new, stop=STOP)
            return Answer(r.text or "", list(r.token_ids), r.stats.ttft_s, None, 1.0, len(ids),
                          {"hit_tokens": r.stats.hit_tokens})
        gen = self.docs.generate_iter(prompt, max_new, selector=mode.selector,
                                      recompute=mode.recompute, stop=STOP, margin=mode.margin,
                                      watch=mode.watch)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                res = done.value
                break
        st = res.stats
        # a rebuilt answer recomputed its whole prompt after all: counted as a fallback is
        return Answer(res.text or "", res.token_ids, st.ttft_s, res.last_logits,
                      1.0 if st.repaired_at is not None else st.recompute_share, len(ids),
                      {"select_ms": st.select_ms, "load_ms": st.load_ms,
                       "prefill_ms": st.prefill_ms, "documents_hit": st.documents_hit,
                       "fallback": st.fallback, "first_margin": st.first_margin,
                       "repaired_at": st.repaired_at})


def contract_modes(selector: str, recompute: float, margin: float | None = None,
                   watch: float | None = None) -> list[Mode]:
    """The contract's four modes, and ``gated`` (reuse with the confidence test at
    ``margin`` and/or the decode watch at ``watch``) when either is given."""
    modes = [Mode("full", "full"), Mode("prefix", "prefix"),
             Mode("concat", "blend", "concat", 0.0), Mode("reuse", "blend", selector, recompute)]
    if margin or watch:
        modes.append(Mode("gated", "blend", selector, recompute, margin or None, watch or None))
    return modes


def run_eval(model: str, items: Sequence[dict[str, Any]], modes: Sequence[Mode], *,
             docs: int | None = None, max_new_tokens: int = 32,
             progress: Callable[[str, int, int], None] | None = None,
             runner: Runner | None = None) -> dict[str, Any]:
    """Answer every item in every mode; per-mode summaries plus the per-question rows."""
    run = runner or Runner(model)
    for i, item in enumerate(items):
        run.store_passages(item, docs)
        if progress:
            progress("storing passages", i + 1, len(items))
    rows: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        prompt = run.prepare(item, docs)
        got: dict[str, Answer] = {}
        for mode in modes:
            got[mode.name] = run.answer(mode, prompt, max_new_tokens)
        full = got.get("full")
        row: dict[str, Any] = {"question": item["question"], "answers": item["answers"],
                               "prompt_tokens": len(prompt.ids),
                               "document_tokens": prompt.document_tokens}
        for name, a in got.items():
            row[name] = {
                "text": a.text, "f1": f1_score(a.text, item["answers"]),
                "em": exact_match(a.text, item["answers"]), "ttft_s": a.ttft_s,
                "agree": (a.tokens == full.tokens) if full is not None else None,
                "kl": (kl_div(full.first_logits, a.first_logits)
                       if full is not None and full.first_logits is not None
                       and a.first_logits is not None else None),
                "recompute": a.recompute, **a.extra,
            }
        rows.append(row)
        if progress:
            progress("answering", i + 1, len(items))
    return {"model": model, "docs": docs, "n": len(rows), "summary": summarize(rows, modes),
            "rows": rows}


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def summarize(rows: Sequence[dict[str, Any]], modes: Sequence[Mode]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        rs = [r[mode.name] for r in rows]
        if not rs:
            continue
        kls = [r["kl"] for r in rs if r["kl"] is not None]
        agree = [r["agree"] for r in rs if r["agree"] is not None]
        out[mode.name] = {
            "f1": statistics.fmean(r["f1"] for r in rs),
            "em": statistics.fmean(r["em"] for r in rs),
            "ttft_s": statistics.median(r["ttft_s"] for r in rs),
            "ttft_p90_s": _p90([r["ttft_s"] for r in rs]),
            "n": len(rs),
            "agreement": statistics.fmean(agree) if agree else None,
            "kl": statistics.fmean(kls) if kls else None,
            "recompute": statistics.fmean(r["recompute"] for r in rs),
            "selector": mode.selector or mode.kind,
            **({"margin": mode.margin, "watch": mode.watch,
                "fallback": statistics.fmean(bool(r.get("fallback")) for r in rs),
                "repaired": statistics.fmean(r.get("repaired_at") is not None for r in rs)}
               if mode.margin or mode.watch else {}),
        }
    return out
