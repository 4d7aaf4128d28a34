"""Evaluation: receiver alone, sharer alone, text-to-text (T2T) and C2C on multiple choice.

Every method answers with greedy decoding through the same loop (:func:`greedy_decode`), and
the answer letter is read from the generated text, so accuracies and latencies compare like
for like:

* ``receiver``: the receiver reads the question prompt and answers;
* ``sharer``: the sharer does the same;
* ``t2t``: the sharer first writes background for the question (its greedy continuation of
  ``background_prompt``, up to ``background_tokens``), then the receiver answers with
  ``background_prompt + background`` in front of the question (the paper's three-turn T2T);
* ``c2c``: the receiver answers with the sharer's prompt KV fused into its own cache.

Latency is wall time per query (median reported), including the sharer's work for T2T and
C2C. The cache-enrichment oracle (C2C paper, section 3) asks whether a richer cache of the
*same length* helps: the receiver prefills ``context + question``, the context's KV entries
are dropped, and it answers from the question's (now context-informed) KV alone; compared
with the plain question cache and with the full context kept.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._kvio import cache_kwargs, cache_to_layers, layers_to_cache, output_cache
from ._pipeline import FusionPipeline, ModelSide, greedy_decode

__all__ = [
    "EvalSettings",
    "MCItem",
    "evaluate",
    "oracle_enrichment",
    "parse_letter",
    "plot_results",
]

log = logging.getLogger(__name__)

METHODS = ("receiver", "sharer", "t2t", "c2c")


@dataclass(frozen=True, slots=True)
class MCItem:
    """One multiple-choice question as each method needs it."""

    id: str
    prompt: str  # letter mode: question with lettered options, ending with the answer cue
    qa_prompt: str  # loglik mode: question without options, ending with the answer cue
    options: tuple[str, ...]  # option texts, scored as " " + option + "." in loglik mode
    answer_index: int
    background_prompt: str  # what the sharer continues to write background (T2T)
    split: str = ""  # e.g. "seen"/"unseen" (reported separately when present)
    context: str = ""  # oracle knowledge (a statement of the fact) for the enrichment oracle

    @property
    def letter(self) -> str:
        return "abcdefghij"[self.answer_index]


@dataclass(slots=True)
class EvalSettings:
    answer_mode: str = "loglik"  # "loglik": option log-likelihood; "letter": generate the letter
    max_new_tokens: int = 4  # letter mode: the letter and its period
    background_tokens: int = 24  # T2T: most tokens the sharer may write
    letters: str = "abcd"
    option_format: str = " {option}."  # loglik mode: continuation scored per option
    t2t_joiner: str = "\n"  # between the background and the question
    methods: tuple[str, ...] = METHODS


_LETTER_RE_CACHE: dict[str, re.Pattern[str]] = {}


def parse_letter(text: str, letters: str = "abcd") -> str | None:
    """The first option letter standing alone at the start of ``text`` ("c.", " (B)", "c")."""
    pat = _LETTER_RE_CACHE.get(letters)
    if pat is None:
        pat = re.compile(rf"^[\s(\[]*([{letters}{letters.upper()}])(?![a-zA-Z])")
        _LETTER_RE_CACHE[letters] = pat
    m = pat.match(text)
    return m.group(1).lower() if m else None


def _stop_after_answer(text: str) -> bool:
    return "." in text or "\n" in text


def _decode_text(side: ModelSide) -> Callable[[list[int]], str]:
    return lambda ids: side.tokenizer.decode(ids, skip_special_tokens=True)


def _prefill(side: ModelSide, ids: list[int]) -> Any:
    if len(ids) < 2:
        return None
    with torch.no_grad():
        out = side.model(
            input_ids=torch.tensor([ids[:-1]], device=side.device), use_cache=True, logits_to_keep=1
        )
    return cache_to_layers(output_cache(out))


def score_options(
    model: torch.nn.Module,
    layers: Any,
    feed_ids: list[int],
    start_pos: int,
    options: list[list[int]],
) -> list[float]:
    """Sum of log-probabilities of each option's tokens after ``feed_ids`` (one batch).

    ``layers`` holds KV for positions ``[0, start_pos)`` (or None) and is not mutated.
    """
    device = next(model.parameters()).device
    n = len(options)
    seqs = [feed_ids + opt for opt in options]
    t = max(len(x) for x in seqs)
    ids = torch.zeros(n, t, dtype=torch.long, device=device)
    mask = torch.zeros(n, t, dtype=torch.long, device=device)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x, device=device)
        mask[i, : len(x)] = 1
    past = 0
    cache = None
    if layers:
        past = layers[0][0].shape[2]
        cache = layers_to_cache(
            # expanded views are only read: the cache concatenates new KV into new tensors
            [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in layers]
        )
    full_mask = torch.cat([torch.ones(n, past, dtype=torch.long, device=device), mask], dim=1)
    position_ids = torch.arange(start_pos, start_pos + t, device=device)[None].expand(n, -1)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=position_ids,
            use_cache=True,
            **cache_kwargs(model, cache),
        )
    logp = torch.log_softmax(out.logits.float(), dim=-1)
    scores = []
    f = len(feed_ids)
    for i, opt in enumerate(options):
        # token feed_ids[-1] (index f-1) predicts opt[0], and so on
        idx = torch.arange(f - 1, f - 1 + len(opt), device=device)
        tgt = torch.tensor(opt, device=device)
        scores.append(float(logp[i, idx, tgt].sum()))
    return scores


def _option_ids(side: ModelSide, item: MCItem, fmt: str) -> list[list[int]]:
    return [
        list(side.tokenizer(fmt.format(option=o), add_special_tokens=False)["input_ids"])
        for o in item.options
    ]


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def _answer_alone(
    side: ModelSide, prompt: str, item: MCItem, st: EvalSettings
) -> tuple[int | None, int]:
    """(chosen option index or None, tokens generated) for one model reading ``prompt``."""
    ids = list(side.tokenizer(prompt, add_special_tokens=side.add_special_tokens)["input_ids"])
    layers = _prefill(side, ids)
    if st.answer_mode == "loglik":
        scores = score_options(
            side.model, layers, [ids[-1]], len(ids) - 1, _option_ids(side, item, st.option_format)
        )
        return _argmax(scores), 0
    gen = greedy_decode(
        side.model,
        layers,
        [ids[-1]],
        start_pos=len(ids) - 1,
        max_new_tokens=st.max_new_tokens,
        eos_ids=side.eos_ids(),
        stop=_stop_after_answer,
        decode=_decode_text(side),
    )
    return _letter_index(side.tokenizer.decode(gen, skip_special_tokens=True), st.letters), len(gen)


def _letter_index(text: str, letters: str) -> int | None:
    got = parse_letter(text, letters)
    return None if got is None else letters.index(got)


def _background(side: ModelSide, prompt: str, max_new: int) -> tuple[str, int]:
    ids = list(side.tokenizer(prompt, add_special_tokens=side.add_special_tokens)["input_ids"])
    gen = greedy_decode(
        side.model,
        _prefill(side, ids),
        [ids[-1]],
        start_pos=len(ids) - 1,
        max_new_tokens=max_new,
        eos_ids=side.eos_ids(),
        stop=lambda t: "\n" in t or t.rstrip().endswith("."),
        decode=_decode_text(side),
    )
    return side.tokenizer.decode(gen, skip_special_tokens=True).strip(), len(gen)


def _c2c_answer(pipeline: FusionPipeline, item: MCItem, st: EvalSettings) -> tuple[int | None, int]:
    recv = pipeline.receiver
    if st.answer_mode == "loglik":
        fp = pipeline.encode(item.qa_prompt)
        layers, _ = pipeline.fused_layers(fp)
        r_ids = fp.receiver.input_ids
        scores = score_options(
            recv.model,
            layers,
            [r_ids[-1]],
            len(r_ids) - 1,
            _option_ids(recv, item, st.option_format),
        )
        return _argmax(scores), 0
    gen = pipeline.generate(item.prompt, max_new_tokens=st.max_new_tokens, stop=_stop_after_answer)
    return _letter_index(gen.text, st.letters), len(gen.token_ids)


@dataclass(slots=True)
class _Tally:
    correct: list[bool] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    answered: int = 0

    def summary(self) -> dict[str, Any]:
        n = len(self.correct)
        out: dict[str, Any] = {
            "accuracy": sum(self.correct) / n if n else 0.0,
            "latency_s": statistics.median(self.latency) if self.latency else 0.0,
            "mean_latency_s": statistics.fmean(self.latency) if self.latency else 0.0,
            "tokens_generated": statistics.fmean(self.tokens) if self.tokens else 0.0,
            "answered_fraction": self.answered / n if n else 0.0,
            "n": n,
        }
        for split in sorted({s for s in self.splits if s}):
            picks = [c for c, s in zip(self.correct, self.splits) if s == split]
            out[f"accuracy_{split}"] = sum(picks) / len(picks) if picks else 0.0
        return out


def evaluate(
    pipeline: FusionPipeline,
    items: list[MCItem],
    settings: EvalSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run each method over ``items``; returns ``{method: {accuracy, latency_s, ...}}``.

    The question prompts are given to each model's tokenizer as they are; C2C wraps them in
    the pipeline's prefixes and suffixes (empty for the reference pair).
    """
    st = settings or EvalSettings()
    if st.answer_mode not in ("loglik", "letter"):
        raise ValueError(f"answer_mode must be 'loglik' or 'letter', got {st.answer_mode!r}")
    tallies = {m: _Tally() for m in st.methods}
    sharer, receiver = pipeline.sharer, pipeline.receiver
    for i, item in enumerate(items):
        prompt = item.qa_prompt if st.answer_mode == "loglik" else item.prompt
        for method in st.methods:
            t0 = time.perf_counter()
            if method == "receiver":
                got, ntok = _answer_alone(receiver, prompt, item, st)
            elif method == "sharer":
                got, ntok = _answer_alone(sharer, prompt, item, st)
            elif method == "t2t":
                bg, nbg = _background(sharer, item.background_prompt, st.background_tokens)
                ctx = f"{item.background_prompt} {bg}".strip() + st.t2t_joiner
                got, ntok = _answer_alone(receiver, ctx + prompt, item, st)
                ntok += nbg
            elif method == "c2c":
                got, ntok = _c2c_answer(pipeline, item, st)
            else:
                raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
            elapsed = time.perf_counter() - t0
            tally = tallies[method]
            tally.correct.append(got == item.answer_index)
            tally.answered += got is not None
            tally.latency.append(elapsed)
            tally.tokens.append(ntok)
            tally.splits.append(item.split)
        if progress is not None:
            progress(i + 1, len(items))
    return {m: t.summary() for m, t in tallies.items()}


def oracle_enrichment(
    receiver: ModelSide, items: list[MCItem], settings: EvalSettings | None = None
) -> dict[str, Any]:
    """Cache-enrichment oracle: does a context-informed cache of the same length help?

    For each item with a ``context``: ``question``: the plain question cache; ``enriched``:
    the question's KV computed after the context, with the context's KV dropped (same
    length as ``question``); ``full_context``: the context kept in the cache.
    """
    st = settings or EvalSettings()
    tok = receiver.tokenizer
    res: dict[str, list[bool]] = {"question": [], "enriched": [], "full_context": []}
    used = [it for it in items if it.context]
    for it in used:
        prompt = it.qa_prompt if st.answer_mode == "loglik" else it.prompt
        ctx_ids = list(
            tok(it.context + st.t2t_joiner, add_special_tokens=receiver.add_special_tokens)[
                "input_ids"
            ]
        )
        q_ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
        bos = list(tok("", add_special_tokens=receiver.add_special_tokens)["input_ids"])
        q_alone = bos + q_ids
        full = ctx_ids + q_ids
        full_layers = _prefill(receiver, full)
        q_layers = _prefill(receiver, q_alone)
        c = len(ctx_ids) - len(bos)
        # enriched: drop the context's entries (keep BOS), same cache length as q_layers;
        # keys keep their original rotary positions, so the last token is fed at its own
        enriched = [
            (
                torch.cat([k[:, :, : len(bos)], k[:, :, len(bos) + c :]], dim=2),
                torch.cat([v[:, :, : len(bos)], v[:, :, len(bos) + c :]], dim=2),
            )
            for k, v in full_layers
        ]
        runs = {
            "question": (q_layers, len(q_alone) - 1),
            "enriched": (enriched, len(full) - 1),
            "full_context": (full_layers, len(full) - 1),
        }
        for name, (layers, pos) in runs.items():
            if st.answer_mode == "loglik":
                scores = score_options(
                    receiver.model,
                    layers,
                    [q_ids[-1]],
                    pos,
                    _option_ids(receiver, it, st.option_format),
                )
                got: int | None = _argmax(scores)
            else:
                gen = greedy_decode(
                    receiver.model,
                    layers,
                    [q_ids[-1]],
                    start_pos=pos,
                    max_new_tokens=st.max_new_tokens,
                    eos_ids=receiver.eos_ids(),
                    stop=_stop_after_answer,
                    decode=_decode_text(receiver),
                )
                got = _letter_index(tok.decode(gen, skip_special_tokens=True), st.letters)
            res[name].append(got == it.answer_index)
    n = len(used)
    return {
        "n": n,
        **{f"accuracy_{k}": (sum(v) / n if n else 0.0) for k, v in res.items()},
        "note": "enriched = question KV computed after the context, context KV dropped "
        "(same cache length as question)",
    }


def plot_results(results: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Accuracy and median latency per method as a two-panel PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if m in results]
    acc = [results[m]["accuracy"] * 100 for m in methods]
    lat = [results[m]["latency_s"] * 1e3 for m in methods]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    colors = ["#999999", "#6699cc", "#cc9966", "#339966"][: len(methods)]
    a1.bar(methods, acc, color=colors)
    a1.set_ylabel("accuracy (%)")
    a1.set_ylim(0, 100)
    a1.set_title("held-out multiple choice")
    for x, y in enumerate(acc):
        a1.text(x, y + 1, f"{y:.1f}", ha="center", fontsize=8)
    a2.bar(methods, lat, color=colors)
    a2.set_ylabel("median latency per query (ms)")
    a2.set_title("latency")
    for x, y in enumerate(lat):
        a2.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
