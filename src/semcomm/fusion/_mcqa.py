"""C2C on a real model pair, evaluated on multiple-choice question files.

Data: JSON Lines ``{"question": str, "choices": [str, ...], "answer": int}`` (the format of
``data/mcqa/*.jsonl``). Every method reads the same prompt::

    Question: <question>
    A. <choice 0>
    B. <choice 1>
    ...
    Answer:

The question with its lettered choices is the *shared text* (what C2C fuses); ``Answer:`` is
each model's own suffix and is never fused. One forward per method scores both rules:

* ``loglik`` (the default): the summed log-probability of each choice's text
  (``" " + choice``) after ``Answer:``; the highest wins. ``loglik_mean`` (the mean per
  token) comes from the same forward and is reported too. The shared text is the question
  alone (listing the choices in the prompt makes both models copy them: worse scores).
* ``letter``: the choices are listed with letters in the shared text and the next-token
  logits of ``" A"``, ``" B"``, ... after ``Answer:`` decide.

Methods: ``receiver`` and ``sharer`` alone; ``t2t`` (the sharer writes a short analysis of
the question, at most ``analysis_tokens`` tokens, and the receiver answers with it between
the choices and ``Answer:``); ``c2c`` (the sharer's KV of the shared text fused into the
receiver's). Work common to several methods runs once and is timed once (the receiver's
prompt prefill serves ``receiver`` and ``c2c``, the sharer's serves ``sharer`` and ``c2c``);
each method's latency is the sum of the timed stages it needs, so it is what that method
would cost alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError
from ._align import PromptParts, align_offsets, encode_prompt
from ._fuser import Fuser
from ._kvio import (
    KVLayers,
    align_layers,
    cache_kwargs,
    cache_to_layers,
    layers_to_cache,
    output_cache,
)
from ._pipeline import ModelSide, greedy_decode

__all__ = [
    "DEFAULT_RECEIVER",
    "DEFAULT_SHARER",
    "RULES",
    "MCQuestion",
    "McqaSettings",
    "build_choice_rows",
    "evaluate_mcqa",
    "evaluate_mcqa_receivers",
    "find_pair_fuser",
    "load_pair_side",
    "mcqa_training_examples",
    "oracle_fewshot",
    "read_mcqa",
    "shared_text",
    "shipped_pair_fusers",
]

log = logging.getLogger(__name__)

DEFAULT_SHARER = "qwen2.5-coder-0.5b-instruct"
DEFAULT_RECEIVER = "smollm2-135m-instruct"
LETTERS = "ABCDEFGHIJ"
RULES = ("loglik", "loglik_mean", "letter")
METHODS = ("receiver", "sharer", "t2t", "c2c")
ANSWER_SUFFIX = "Answer:"


@dataclass(frozen=True, slots=True)
class MCQuestion:
    question: str
    choices: tuple[str, ...]
    answer: int


def read_mcqa(path: str | Path, *, limit: int | None = None, skip: int = 0) -> list[MCQuestion]:
    """Items ``skip .. skip+limit`` of a multiple-choice JSONL file, in file order.

    Errors name the file and line.
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"multiple-choice data {p} does not exist")
    out: list[MCQuestion] = []
    seen = 0
    with p.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            seen += 1
            if seen <= skip:
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"{p}:{n}: not valid JSON ({exc.msg})") from exc
            q = row.get("question") if isinstance(row, dict) else None
            ch = row.get("choices") if isinstance(row, dict) else None
            ans = row.get("answer") if isinstance(row, dict) else None
            if (
                not isinstance(q, str)
                or not isinstance(ch, list)
                or len(ch) < 2
                or not all(isinstance(c, str) for c in ch)
                or not isinstance(ans, int)
                or isinstance(ans, bool)
                or not 0 <= ans < len(ch)
            ):
                raise InvalidInputError(
                    f"{p}:{n}: expected {{'question': str, 'choices': [str, str, ...], "
                    "'answer': int index into choices}"
                )
            if len(ch) > len(LETTERS):
                raise InvalidInputError(f"{p}:{n}: at most {len(LETTERS)} choices supported")
            out.append(MCQuestion(q.strip(), tuple(c.strip() for c in ch), ans))
    if not out:
        raise InvalidInputError(f"{p}: no questions (skip={skip}, limit={limit})")
    return out


def shared_text(q: MCQuestion, rule: str = "loglik") -> str:
    """The text both models read: the question, and for the ``letter`` rule its lettered
    choices (option log-likelihood scores the choices as continuations instead)."""
    lines = [f"Question: {q.question}"]
    if rule == "letter":
        lines += [f"{LETTERS[i]}. {c}" for i, c in enumerate(q.choices)]
    return "\n".join(lines) + "\n"


ANALYSIS_INSTRUCTION = "Think briefly about which choice is correct and why."


@dataclass(slots=True)
class McqaSettings:
    rule: str = "loglik"  # "loglik" (choices as continuations) or "letter" (lettered choices)
    analysis_tokens: int = 32  # T2T: most tokens the sharer may write
    bf16: bool = True  # bfloat16 autocast on CPU (fp32 weights)
    methods: tuple[str, ...] = METHODS


@contextmanager
def _autocast(enabled: bool, device: torch.device) -> Iterator[None]:
    if enabled:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


def load_pair_side(spec: str | Path, *, suffix: str = ANSWER_SUFFIX) -> ModelSide:
    """A catalog name, hub id or model folder as a :class:`ModelSide` (fp32 weights) whose
    prompt is ``shared + suffix``."""
    from ._reference import load_side

    return load_side(spec, add_special_tokens=True, template="{shared}" + suffix)


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _prefill_all_but_last(side: ModelSide, ids: list[int], bf16: bool) -> KVLayers:
    with torch.no_grad(), _autocast(bf16, side.device):
        out = side.model(
            input_ids=torch.tensor([ids[:-1]], device=side.device),
            use_cache=True,
            logits_to_keep=1,
        )
    return cache_to_layers(output_cache(out))


def _letter_ids(tokenizer: Any, n: int) -> list[int]:
    ids = []
    for letter in LETTERS[:n]:
        toks = tokenizer(f" {letter}", add_special_tokens=False)["input_ids"]
        ids.append(int(toks[-1]))
    return ids


def score_choices(
    side: ModelSide,
    layers: KVLayers,
    last_id: int,
    start_pos: int,
    choices: tuple[str, ...],
    bf16: bool,
) -> dict[str, list[float]]:
    """Scores of every rule for each choice from one batched forward over the cache.

    ``layers`` holds KV for positions ``[0, start_pos)``; ``last_id`` is the prompt's last
    token (``:`` of ``Answer:``), fed first. Returns ``{"loglik", "loglik_sum", "letter"}``.
    """
    model, tok = side.model, side.tokenizer
    device = side.device
    opts = [list(tok(" " + c, add_special_tokens=False)["input_ids"]) for c in choices]
    n = len(opts)
    t = 1 + max(len(o) for o in opts)
    ids = torch.zeros(n, t, dtype=torch.long, device=device)
    mask = torch.zeros(n, t, dtype=torch.long, device=device)
    for i, o in enumerate(opts):
        ids[i, : 1 + len(o)] = torch.tensor([last_id, *o], device=device)
        mask[i, : 1 + len(o)] = 1
    past = layers[0][0].shape[2]
    cache = layers_to_cache([(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in layers])
    full_mask = torch.cat([torch.ones(n, past, dtype=torch.long, device=device), mask], dim=1)
    pos = torch.arange(start_pos, start_pos + t, device=device)[None].expand(n, -1)
    with torch.no_grad(), _autocast(bf16, device):
        out = model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=pos,
            use_cache=True,
            **cache_kwargs(model, cache),
        )
    logp = torch.log_softmax(out.logits.float(), dim=-1)
    sums, means = [], []
    for i, o in enumerate(opts):
        idx = torch.arange(0, len(o), device=device)
        s = float(logp[i, idx, torch.tensor(o, device=device)].sum()) if o else -math.inf
        sums.append(s)
        means.append(s / max(len(o), 1))
    letters = _letter_ids(tok, n)
    letter = [float(x) for x in logp[0, 0, letters]]
    return {"loglik": sums, "loglik_mean": means, "letter": letter}


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


@dataclass(slots=True)
class _Tally:
    correct: dict[str, list[bool]] = field(default_factory=lambda: {r: [] for r in RULES})
    latency: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)

    def add(self, scores: dict[str, list[float]], answer: int, latency: float, **stages: float):
        for r in RULES:
            self.correct[r].append(_argmax(scores[r]) == answer)
        self.latency.append(latency)
        for k, v in stages.items():
            self.stages.setdefault(k, []).append(v)

    def summary(self, rule: str) -> dict[str, Any]:
        n = len(self.latency)
        acc = {r: (sum(v) / n if n else 0.0) for r, v in self.correct.items()}
        out: dict[str, Any] = {
            "accuracy": acc[rule],
            "latency_s": statistics.median(self.latency) if n else 0.0,
            "n": n,
            "rule": rule,
            "mean_latency_s": statistics.fmean(self.latency) if n else 0.0,
            "tokens_generated": statistics.fmean(self.tokens) if self.tokens else 0.0,
        }
        for r in ("loglik", "loglik_mean") if rule == "loglik" else ("letter",):
            out[f"accuracy_{r}"] = acc[r]
        for k, v in self.stages.items():
            out[f"median_{k}_s"] = statistics.median(v)
        out["correct"] = [int(c) for c in self.correct[rule]]  # per question, file order
        if rule == "loglik":  # the per-token mean rule's, for the complementarity table
            out["correct_loglik_mean"] = [int(c) for c in self.correct["loglik_mean"]]
        return out


def _analysis(sharer: ModelSide, shared: str, max_tokens: int, bf16: bool) -> tuple[str, int]:
    """T2T: the sharer's short analysis of the shared text (its chat template when it has
    one), at most ``max_tokens`` tokens."""
    tok = sharer.tokenizer
    user = shared + ANALYSIS_INSTRUCTION
    if getattr(tok, "chat_template", None):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tok(user + "\nAnalysis:", add_special_tokens=True)["input_ids"])
    layers = _prefill_all_but_last(sharer, ids, bf16)
    with _autocast(bf16, sharer.device):
        gen = greedy_decode(
            sharer.model,
            layers,
            [ids[-1]],
            start_pos=len(ids) - 1,
            max_new_tokens=max_tokens,
            eos_ids=sharer.eos_ids(),
        )
    text = tok.decode(gen, skip_special_tokens=True).strip()
    return " ".join(text.split()), len(gen)


def _encode(side: ModelSide, shared: str) -> Any:
    return encode_prompt(
        side.tokenizer,
        PromptParts(side.prefix, shared, side.suffix),
        add_special_tokens=side.add_special_tokens,
    )


def fused_prompt_layers(
    sharer: ModelSide,
    receiver: ModelSide,
    fuser: Fuser,
    shared: str,
    bf16: bool,
    r_layers: KVLayers | None = None,
    s_layers: KVLayers | None = None,
) -> tuple[KVLayers, list[int], dict[str, float]]:
    """Receiver KV of ``shared + suffix`` (without its last token) fused with the sharer's.

    Returns (fused layers, receiver prompt ids, stage seconds). Precomputed prefills may be
    passed in (they are not mutated).
    """
    r = _encode(receiver, shared)
    s = _encode(sharer, shared)
    stages: dict[str, float] = {}
    if r_layers is None:
        r_layers, stages["receiver_prefill"] = _timed(
            _prefill_all_but_last, receiver, r.input_ids, bf16
        )
    if s_layers is None:
        # all but the sharer's last prompt token, as for the sharer alone: with a suffix
        # (``Answer:``) that token lies outside the shared text and is never fused anyway
        s_layers, stages["sharer_prefill"] = _timed(
            _prefill_all_but_last, sharer, s.input_ids, bf16
        )
    t0 = time.perf_counter()
    s_spans = s.spans[: s_layers[0][0].shape[2]]
    al = align_offsets(r.spans[:-1], s_spans, reduce="mean")  # type: ignore[arg-type]
    device = receiver.device
    with torch.no_grad(), _autocast(bf16, device):
        aligned = align_layers(
            [(k.to(device), v.to(device)) for k, v in s_layers], al.weights[None].to(device)
        )
        fused = fuser.fuse(aligned, r_layers, al.mask[None].to(device))
    dt = r_layers[0][0].dtype  # the receiver's cache dtype (bf16 weights: bf16 KV)
    fused = [(k.to(dt), v.to(dt)) for k, v in fused]
    stages["fuse"] = time.perf_counter() - t0
    return fused, r.input_ids, stages


def evaluate_mcqa(
    sharer: ModelSide,
    receiver: ModelSide,
    fuser: Fuser | None,
    questions: list[MCQuestion],
    settings: McqaSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{method: {accuracy, latency_s, n, accuracy_<rule>...}}`` over ``questions``."""
    st = settings or McqaSettings()
    if "c2c" in st.methods and fuser is None:
        raise InvalidInputError("c2c needs a fuser")
    return evaluate_mcqa_receivers(
        sharer, {"receiver": (receiver, fuser)}, questions, st, progress
    )["receiver"]


def evaluate_mcqa_receivers(
    sharer: ModelSide,
    receivers: dict[str, tuple[ModelSide, Fuser | None]],
    questions: list[MCQuestion],
    settings: McqaSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """:func:`evaluate_mcqa` for one sharer and several receivers at once:
    ``{receiver name: {method: figures}}``.

    The sharer's work is done once per question (its prefill and scoring, the text-to-text
    analysis) and its timings enter every receiver's figures, so each pair's result is what
    :func:`evaluate_mcqa` would give for it alone (the same scores; latencies from one shared
    measurement). A receiver whose fuser is None gets no ``c2c``.
    """
    st = settings or McqaSettings()
    if st.rule not in ("loglik", "letter"):
        raise InvalidInputError(f"rule must be 'loglik' or 'letter', got {st.rule!r}")
    unknown = [m for m in st.methods if m not in METHODS]
    if unknown:
        raise InvalidInputError(f"unknown methods {unknown}; choose from {METHODS}")
    if not receivers:
        raise InvalidInputError("no receiver to evaluate")
    for _, fz in receivers.values():
        if fz is not None:
            fz.eval()
    methods = {
        name: tuple(m for m in st.methods if m != "c2c" or fz is not None)
        for name, (_, fz) in receivers.items()
    }
    tallies = {name: {m: _Tally() for m in ms} for name, ms in methods.items()}
    bf16 = st.bf16
    any_c2c = any("c2c" in ms for ms in methods.values())
    for i, q in enumerate(questions):
        shared = shared_text(q, st.rule)
        s_enc = _encode(sharer, shared)
        s_layers: KVLayers | None = None
        t_sp = 0.0
        if "sharer" in st.methods or any_c2c:
            s_layers, t_sp = _timed(_prefill_all_but_last, sharer, s_enc.input_ids, bf16)
        s_scores: tuple[dict[str, list[float]], float] | None = None
        if "sharer" in st.methods:
            assert s_layers is not None
            s_scores = _timed(score_choices, sharer, s_layers, s_enc.input_ids[-1],
                              len(s_enc.input_ids) - 1, q.choices, bf16)
        analysis: tuple[tuple[str, int], float] | None = None
        if "t2t" in st.methods:
            analysis = _timed(_analysis, sharer, shared, st.analysis_tokens, bf16)
        for name, (receiver, fuser) in receivers.items():
            ms, tally = methods[name], tallies[name]
            r_enc = _encode(receiver, shared)
            r_layers: KVLayers | None = None
            t_rp = 0.0
            if "receiver" in ms or "c2c" in ms:
                r_layers, t_rp = _timed(_prefill_all_but_last, receiver, r_enc.input_ids, bf16)
            if "receiver" in ms:
                assert r_layers is not None
                sc, t_sc = _timed(score_choices, receiver, r_layers, r_enc.input_ids[-1],
                                  len(r_enc.input_ids) - 1, q.choices, bf16)
                tally["receiver"].add(sc, q.answer, t_rp + t_sc, prefill=t_rp, score=t_sc)
            if s_scores is not None:
                sc, t_sc = s_scores
                tally["sharer"].add(sc, q.answer, t_sp + t_sc, prefill=t_sp, score=t_sc)
            if analysis is not None:
                (text, ntok), t_gen = analysis
                ctx = shared + (f"Hint: {text}\n" if text else "")
                t_enc = _encode(receiver, ctx)
                t_layers, t_rp2 = _timed(_prefill_all_but_last, receiver, t_enc.input_ids, bf16)
                sc, t_sc = _timed(
                    score_choices,
                    receiver,
                    t_layers,
                    t_enc.input_ids[-1],
                    len(t_enc.input_ids) - 1,
                    q.choices,
                    bf16,
                )
                tally["t2t"].add(
                    sc,
                    q.answer,
                    t_gen + t_rp2 + t_sc,
                    sharer_generate=t_gen,
                    receiver_prefill=t_rp2,
                    score=t_sc,
                )
                tally["t2t"].tokens.append(ntok)
            if "c2c" in ms:
                assert fuser is not None and r_layers is not None and s_layers is not None
                fused, r_ids, stages = fused_prompt_layers(
                    sharer, receiver, fuser, shared, bf16, r_layers=r_layers, s_layers=s_layers
                )
                sc, t_sc = _timed(
                    score_choices, receiver, fused, r_ids[-1], len(r_ids) - 1, q.choices, bf16
                )
                tally["c2c"].add(
                    sc,
                    q.answer,
                    t_rp + t_sp + stages["fuse"] + t_sc,
                    receiver_prefill=t_rp,
                    sharer_prefill=t_sp,
                    fuse=stages["fuse"],
                    score=t_sc,
                )
        if progress is not None:
            progress(i + 1, len(questions))
    return {
        name: {m: t.summary(st.rule) for m, t in by_method.items()}
        for name, by_method in tallies.items()
    }


def oracle_fewshot(
    receiver: ModelSide,
    questions: list[MCQuestion],
    context: list[MCQuestion],
    *,
    bf16: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The paper's cache-enrichment oracle on a real receiver.

    ``question``: the plain prompt cache; ``enriched``: the prompt's KV computed after solved
    examples (``context``, e.g. 3 items kept out of evaluation), with the examples' KV dropped
    (the same cache length as ``question``); ``full_context``: the examples kept.
    """
    tok = receiver.tokenizer
    demo = "".join(shared_text(c) + f"{ANSWER_SUFFIX} {c.choices[c.answer]}\n\n" for c in context)
    res: dict[str, dict[str, list[bool]]] = {
        k: {r: [] for r in RULES} for k in ("question", "enriched", "full_context")
    }
    bos = list(tok("", add_special_tokens=receiver.add_special_tokens)["input_ids"])
    demo_ids = list(tok(demo, add_special_tokens=False)["input_ids"])
    for i, q in enumerate(questions):
        q_ids = list(tok(shared_text(q) + receiver.suffix, add_special_tokens=False)["input_ids"])
        plain = bos + q_ids
        full = bos + demo_ids + q_ids
        full_layers = _prefill_all_but_last(receiver, full, bf16)
        q_layers = _prefill_all_but_last(receiver, plain, bf16)
        b, c = len(bos), len(demo_ids)
        enriched = [
            (
                torch.cat([k[:, :, :b], k[:, :, b + c :]], 2),
                torch.cat([v[:, :, :b], v[:, :, b + c :]], 2),
            )
            for k, v in full_layers
        ]
        runs = {
            "question": (q_layers, len(plain) - 1),
            "enriched": (enriched, len(full) - 1),  # keys keep their rotary positions
            "full_context": (full_layers, len(full) - 1),
        }
        for name, (layers, pos) in runs.items():
            sc = score_choices(receiver, layers, q_ids[-1], pos, q.choices, bf16)
            for r in RULES:
                res[name][r].append(_argmax(sc[r]) == q.answer)
        if progress is not None:
            progress(i + 1, len(questions))
    n = len(questions)
    out: dict[str, Any] = {"n": n, "context_examples": len(context)}
    for name, by_rule in res.items():
        for r, v in by_rule.items():
            if r == "letter":  # the oracle's prompts do not list the choices
                continue
            key = f"accuracy_{name}" if r == "loglik" else f"accuracy_{name}_{r}"
            out[key] = sum(v) / n if n else 0.0
    out["note"] = (
        "enriched = the question's KV computed after solved examples, the examples' KV dropped "
        "(same cache length as question)"
    )
    return out


def mcqa_training_examples(questions: list[MCQuestion]) -> list[dict[str, str]]:
    """``{"shared", "answer"}`` rows: the shared text and the correct choice's text."""
    return [{"shared": shared_text(q), "answer": " " + q.choices[q.answer]} for q in questions]


def build_training_rows(
    mcqa_files: list[Path],
    *,
    skip: int,
    instruction_file: Path | None = None,
    instruction_limit: int = 0,
    max_answer_chars: int = 120,
    exclude: list[MCQuestion] | None = None,
) -> list[dict[str, str]]:
    """Fuser training rows from the *tail* of multiple-choice files and instruction data.

    Items ``[0, skip)`` of each file are never used (held out for evaluation and rule
    choice); questions whose text equals an ``exclude`` question are dropped as well.
    ``instruction_file`` holds ``{"prompt", "completion"}`` lines (T0-style prompts); the
    first ``instruction_limit`` with a completion of at most ``max_answer_chars`` characters
    are added as ``prompt + "\\n"`` -> ``" " + completion``. Rows are interleaved by source.
    """
    banned = {q.question for q in exclude or []}
    sources: list[list[dict[str, str]]] = []
    for f in mcqa_files:
        held = {q.question for q in read_mcqa(f, limit=skip)}
        qs = [q for q in read_mcqa(f, skip=skip) if q.question not in held | banned]
        sources.append(mcqa_training_examples(qs))
    if instruction_file is not None and instruction_limit > 0:
        rows: list[dict[str, str]] = []
        with Path(instruction_file).open(encoding="utf-8") as fh:
            for line in fh:
                if len(rows) >= instruction_limit:
                    break
                obj = json.loads(line)
                prompt = str(obj.get("prompt", "")).replace("\\n", "\n").strip()
                comp = str(obj.get("completion", "")).replace("<|endoftext|>", "").strip()
                if prompt and comp and len(comp) <= max_answer_chars and len(prompt) <= 600:
                    rows.append({"shared": prompt + "\n", "answer": " " + comp})
        sources.append(rows)
    out: list[dict[str, str]] = []
    longest = max((len(s) for s in sources), default=0)
    for i in range(longest):
        for src in sources:
            if i < len(src):
                out.append(src[i])
    return out


def build_choice_rows(
    mcqa_files: list[Path], *, skip: int, take: int | None = None
) -> list[dict[str, Any]]:
    """Multiple-choice rows (``{"question", "choices", "answer"}``, the evaluated form) for
    the ``choice`` training objective or for validation: items ``[skip, skip + take)`` of
    each file (``take=None``: to the end), minus questions whose text equals one of the first
    ``skip`` items of that file; interleaved by file."""
    sources: list[list[dict[str, Any]]] = []
    for f in mcqa_files:
        held = {q.question for q in read_mcqa(f, limit=skip)} if skip else set()
        qs = [q for q in read_mcqa(f, skip=skip, limit=take) if q.question not in held]
        sources.append(
            [{"question": q.question, "choices": list(q.choices), "answer": q.answer} for q in qs]
        )
    out: list[dict[str, Any]] = []
    for i in range(max((len(x) for x in sources), default=0)):
        out.extend(src[i] for src in sources if i < len(src))
    return out


def c2c_mcqa_metric(
    sharer: ModelSide, receiver: ModelSide, questions: list[MCQuestion], *, bf16: bool = True
) -> Callable[[Fuser], float]:
    """A ``val_metric`` for :class:`~semcomm.fusion.FusionTrainer`: C2C accuracy (the
    ``loglik`` rule) on ``questions``."""

    def metric(fuser: Fuser) -> float:
        res = evaluate_mcqa(
            sharer, receiver, fuser, questions, McqaSettings(bf16=bf16, methods=("c2c",))
        )
        return float(res["c2c"]["accuracy"])

    return metric


PAIR_FUSERS: dict[tuple[str, str], str] = {
    ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"): "qwen2.5-coder-0.5b_to_smollm2-135m",
    ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
        "qwen2.5-coder-1.5b_to_qwen2.5-coder-0.5b",
    ("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"): "qwen2.5-coder-1.5b_to_smollm2-135m",
}
"""Catalog pairs (sharer, receiver) with a fuser folder under ``fusion/assets``."""


def shipped_pair_fuser_path(
    sharer: str | Path | None = None, receiver: str | Path | None = None
) -> Path:
    """Folder of the fuser shipped for a catalog pair (default: :data:`DEFAULT_SHARER` ->
    :data:`DEFAULT_RECEIVER`). The folder holds ``fuser.json`` once a fuser has been trained
    and shipped for the pair (:func:`find_pair_fuser` checks); an error for other pairs."""
    from ._reference import ASSETS_DIR, catalog_name_of

    s = catalog_name_of(sharer or DEFAULT_SHARER)
    r = catalog_name_of(receiver or DEFAULT_RECEIVER)
    folder = PAIR_FUSERS.get((s or "", r or ""))
    if folder is None:
        raise InvalidInputError(
            f"no fuser is shipped for {sharer} -> {receiver}; pairs: "
            + ", ".join(f"{a} -> {b}" for a, b in PAIR_FUSERS)
        )
    return ASSETS_DIR / folder


def find_pair_fuser(sharer: str | Path | None = None, receiver: str | Path | None = None
                    ) -> Path | None:
    """The shipped fuser folder for the pair when there is one (``fuser.json`` present)."""
    try:
        path = shipped_pair_fuser_path(sharer, receiver)
    except InvalidInputError:
        return None
    return path if (path / "fuser.json").is_file() else None


def shipped_pair_fusers() -> list[Path]:
    """Every shipped catalog-pair fuser folder (the default pair's first)."""
    from ._reference import ASSETS_DIR

    found = [ASSETS_DIR / f for f in PAIR_FUSERS.values()]
    return [p for p in found if (p / "fuser.json").is_file()]


def _overlap(results: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """Receiver, sharer, best-of-two oracle (and text hand-off and C2C when present) on the
    same questions, from the per-question lists ``results[method][key]``."""
    r = results.get("receiver", {}).get(key)
    s = results.get("sharer", {}).get(key)
    if not r or not s or len(r) != len(s):
        return {}
    n = len(r)
    either = [bool(a or b) for a, b in zip(r, s)]
    out: dict[str, Any] = {
        "n": n,
        "receiver": sum(r) / n,
        "sharer": sum(s) / n,
        "both_right": sum(a and b for a, b in zip(r, s)) / n,
        "only_receiver": sum(a and not b for a, b in zip(r, s)) / n,
        "only_sharer": sum(b and not a for a, b in zip(r, s)) / n,
        "either_right": sum(either) / n,  # the best-of-two oracle
        "counts": {
            "only_receiver": sum(bool(a and not b) for a, b in zip(r, s)),
            "only_sharer": sum(bool(b and not a) for a, b in zip(r, s)),
            "both_right": sum(bool(a and b) for a, b in zip(r, s)),
            "neither": sum(not e for e in either),
        },
    }
    t = results.get("t2t", {}).get(key)
    if t and len(t) == n:
        out["t2t"] = sum(t) / n
    c = results.get("c2c", {}).get(key)
    if c and len(c) == n:
        gap = out["either_right"] - out["receiver"]
        out["c2c"] = sum(c) / n
        # the share of the receiver -> oracle gap that C2C closes (None when there is no gap)
        out["c2c_gap_closed"] = (out["c2c"] - out["receiver"]) / gap if gap > 0 else None
        only_s = [i for i in range(n) if s[i] and not r[i]]
        out["c2c_right_of_only_sharer"] = (
            sum(bool(c[i]) for i in only_s) / len(only_s) if only_s else None
        )
        out["c2c_lost_of_receiver_right"] = sum(bool(r[i] and not c[i]) for i in range(n)) / n
        out["c2c_right_where_neither"] = sum(bool(c[i] and not either[i]) for i in range(n)) / n
    return out


def complementarity(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How the receiver's and sharer's right answers overlap (per-question ``correct``):
    the flat keys for the run's rule (as before), and ``by_rule`` for both log-likelihood
    rules (summed, per-token mean) with the best-of-two oracle and C2C's share of the
    receiver -> oracle gap."""
    base = _overlap(results, "correct")
    if not base:
        return {}
    out: dict[str, Any] = {k: base[k] for k in
                           ("both_right", "only_receiver", "only_sharer", "either_right")}
    rule = next((v.get("rule") for v in results.values() if isinstance(v, dict)), None)
    by_rule = {str(rule or "loglik"): base}
    mean = _overlap(results, "correct_loglik_mean")
    if mean:
        by_rule["loglik_mean"] = mean
    out["by_rule"] = by_rule
    return out


def goal_summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals as figures: accuracy points and the latency ratio."""
    out: dict[str, Any] = {}
    acc = {m: r["accuracy"] for m, r in results.items()}
    lat = {m: r["latency_s"] for m, r in results.items()}
    if "c2c" in acc:
        for other in ("receiver", "t2t", "sharer"):
            if other in acc:
                out[f"c2c_minus_{other}_points"] = (acc["c2c"] - acc[other]) * 100
        if "t2t" in lat:
            out["t2t_over_c2c_latency"] = lat["t2t"] / max(lat["c2c"], 1e-9)
    return out


def run_mcqa_eval(
    data: str | Path,
    *,
    limit: int | None = None,
    skip: int = 0,
    sharer: str | Path | None = None,
    receiver: str | Path | None = None,
    fuser: str | Path | None = None,
    settings: McqaSettings | None = None,
    oracle: bool = False,
    oracle_shots: int = 3,
    device: str = "cpu",
    weights: str = "bf16",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """``semcomm fusion eval --data``: the four methods on one multiple-choice file.

    ``weights="bf16"`` (with ``settings.bf16``) casts both models' weights to bfloat16;
    ``"fp32"`` keeps float32 weights under bfloat16 autocast (slower decoding).

    Defaults: the real pair (:data:`DEFAULT_SHARER` -> :data:`DEFAULT_RECEIVER`) and the
    fuser shipped for it. Returns ``{"receiver", "sharer", "t2t", "c2c"}`` (each with
    ``accuracy``, ``latency_s``, ``n``, ...) plus ``"summary"``, ``"oracle"``, ``"setup"``.
    The oracle's solved examples are the file's last ``oracle_shots`` items (kept out of
    evaluation; an error if they overlap the evaluated range).
    """
    from ._io import load_fuser, read_fuser_config

    st = settings or McqaSettings()
    questions = read_mcqa(data, limit=limit, skip=skip)
    s_side = load_pair_side(sharer or DEFAULT_SHARER)
    r_side = load_pair_side(receiver or DEFAULT_RECEIVER)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if weights not in ("bf16", "fp32"):
        raise InvalidInputError(f"weights must be 'bf16' or 'fp32', got {weights!r}")
    # bf16 weights halve what every decoded token reads (autocast over fp32 weights re-casts
    # them at each step): T2T's sharer decoding runs about 2x faster
    w_dtype = torch.bfloat16 if (weights == "bf16" and st.bf16) else torch.float32
    for side in (s_side, r_side):
        _ = side.spec  # fingerprint the float32 weights the fuser was trained against
        side.model.to(device=device, dtype=w_dtype)
    fz: Fuser | None = None
    meta: dict[str, Any] = {}
    fpath = Path(fuser) if fuser is not None else find_pair_fuser(
        sharer or DEFAULT_SHARER, receiver or DEFAULT_RECEIVER
    )
    c2c_note = None
    if "c2c" in st.methods and fpath is None:
        # no fuser for this pair yet: the other methods still run (the pair's baselines and
        # its complementarity), C2C is left out and the setup says why
        c2c_note = (
            f"no fuser is shipped for {sharer or DEFAULT_SHARER} -> "
            f"{receiver or DEFAULT_RECEIVER}; c2c not run (pass --fuser DIR)"
        )
        log.info(c2c_note)
        st = dataclasses.replace(st, methods=tuple(m for m in st.methods if m != "c2c"))
        if not st.methods:
            raise InvalidInputError(c2c_note)
    if "c2c" in st.methods:
        assert fpath is not None
        _, meta = read_fuser_config(fpath)
        fz = load_fuser(fpath, sharer=s_side.spec, receiver=r_side.spec, device=device)
    t0 = time.perf_counter()
    results: dict[str, Any] = evaluate_mcqa(s_side, r_side, fz, questions, st, progress)
    oracle_res = None
    if oracle:
        all_q = read_mcqa(data)
        if len(all_q) - oracle_shots < skip + len(questions):
            raise InvalidInputError(
                f"{data}: too few items to keep {oracle_shots} oracle examples out of evaluation"
            )
        oracle_res = oracle_fewshot(r_side, questions, all_q[-oracle_shots:], bf16=st.bf16)
    doc: dict[str, Any] = dict(results)
    doc["summary"] = goal_summary(results)
    doc["complementarity"] = complementarity(results)
    doc["oracle"] = oracle_res
    doc["setup"] = {
        "data": str(data),
        "items": len(questions),
        "skip": skip,
        "rule": st.rule,
        "analysis_tokens": st.analysis_tokens,
        "bf16": st.bf16,
        "weights": "bf16" if w_dtype == torch.bfloat16 else "fp32",
        "device": device,
        "threads": torch.get_num_threads(),
        "sharer": str(sharer or DEFAULT_SHARER),
        "receiver": str(receiver or DEFAULT_RECEIVER),
        "fuser": str(fpath) if fz is not None else None,
        "c2c_note": c2c_note,
        "methods": list(st.methods),
        "fuser_params": fz.num_parameters() if fz is not None else None,
        "fuser_gates": fz.gates() if fz is not None else None,
        "fuser_meta": meta,
        "sharer_params": sum(p.numel() for p in s_side.model.parameters()),
        "receiver_params": sum(p.numel() for p in r_side.model.parameters()),
        "seconds": time.perf_counter() - t0,
    }
    return doc
