"""Evaluation of a reference model on a world.

* ``perplexity``: on held-out-template statements of the "seen" facts (language, not memorised
  strings; the receiver was trained on those facts too), ``perplexity_unseen`` on the others,
  ``perplexity_train`` on the first train template of the seen facts (memorised wording). Per
  token of the model's own tokenizer, so not comparable across tokenizers. A tiny model that saw
  six wordings per relation finds a seventh improbable: held-out perplexity is far above the
  train-template one.
* ``accuracy_seen`` / ``accuracy_unseen``: multiple choice by option log-likelihood: the option
  whose ``" option."`` continuation of ``format_qa(question)`` has the highest summed
  log-probability wins (chance is 0.25).
* ``letter_accuracy_seen`` / ``letter_accuracy_unseen``: greedy answer letter: the model's argmax
  next token after the multiple-choice prompt must be the correct letter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .world import MCQuestion, World

__all__ = ["ModelEval", "evaluate_model", "option_scores"]

T = TypeVar("T")


@dataclass(slots=True)
class ModelEval:
    """Evaluation figures of one model (see module docstring) and per-question correctness."""

    perplexity: float
    perplexity_unseen: float
    perplexity_train: float
    accuracy_seen: float
    accuracy_unseen: float
    letter_accuracy_seen: float
    letter_accuracy_unseen: float
    n_seen: int
    n_unseen: int
    n_sentences: int
    correct: dict[str, bool]  # mc question id -> option log-likelihood correct

    def summary(self) -> dict[str, Any]:
        """The JSON-able figures (without per-question correctness)."""
        return {
            "perplexity": round(self.perplexity, 4),
            "perplexity_unseen": round(self.perplexity_unseen, 4),
            "perplexity_train": round(self.perplexity_train, 4),
            "accuracy_seen": round(self.accuracy_seen, 4),
            "accuracy_unseen": round(self.accuracy_unseen, 4),
            "letter_accuracy_seen": round(self.letter_accuracy_seen, 4),
            "letter_accuracy_unseen": round(self.letter_accuracy_unseen, 4),
            "n_seen": self.n_seen,
            "n_unseen": self.n_unseen,
            "n_sentences": self.n_sentences,
        }


def _batched(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


@torch.no_grad()
def _sequence_logprobs(model: Any, tok: Any, texts: Sequence[str], starts: Sequence[int],
                       batch_size: int = 64) -> list[tuple[float, int]]:
    """For each text: (sum of log p of tokens from index ``start`` on, number of such tokens).

    ``start`` counts tokens including BOS; ``texts`` are tokenized with BOS, no EOS.
    """
    out: list[tuple[float, int]] = []
    pad = tok.pad_token_id
    for chunk_idx, chunk in enumerate(_batched(list(texts), batch_size)):
        enc = [tok(t)["input_ids"] for t in chunk]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, : len(e)] = torch.tensor(e)
            mask[i, : len(e)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        tgt = ids[:, 1:]
        tok_lp = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [B, T-1]: log p(token t+1)
        for i, e in enumerate(enc):
            s = starts[chunk_idx * batch_size + i]
            s = max(s, 1)
            out.append((float(tok_lp[i, s - 1 : len(e) - 1].sum()), len(e) - s))
    return out


def option_scores(model: Any, tok: Any, questions: Sequence[MCQuestion],
                  batch_size: int = 64) -> list[list[float]]:
    """Summed log-likelihood of each option's ``" option."`` after ``q.qa_prompt``."""
    texts: list[str] = []
    starts: list[int] = []
    for q in questions:
        n_prompt = len(tok(q.qa_prompt)["input_ids"])
        for opt in q.options:
            full = f"{q.qa_prompt} {opt}."
            assert tok(full)["input_ids"][:n_prompt] == tok(q.qa_prompt)["input_ids"], (
                "prompt tokens must be a prefix of prompt + option"
            )
            texts.append(full)
            starts.append(n_prompt)
    lps = _sequence_logprobs(model, tok, texts, starts, batch_size)
    return [[lps[4 * i + j][0] for j in range(4)] for i in range(len(questions))]


@torch.no_grad()
def _letter_correct(model: Any, tok: Any, questions: Sequence[MCQuestion],
                    batch_size: int = 64) -> list[bool]:
    out: list[bool] = []
    pad = tok.pad_token_id
    for chunk in _batched(list(questions), batch_size):
        enc = [tok(q.prompt)["input_ids"] for q in chunk]
        targets = []
        for q, e in zip(chunk, enc):
            full = tok(f"{q.prompt} {q.letter}.")["input_ids"]
            targets.append(full[len(e)])
        width = max(len(e) for e in enc)
        # left-pad so that the last position is the prompt's last token
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, width - len(e):] = torch.tensor(e)
            mask[i, width - len(e):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        pred = logits[:, -1].argmax(-1).tolist()
        out += [p == t for p, t in zip(pred, targets)]
    return out


def _spread(items: Sequence[T], n: int) -> list[T]:
    """``n`` items evenly spaced over ``items`` (all of them if fewer): a subset that covers
    every relation, since items are ordered by relation."""
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def evaluate_model(model: Any, tok: Any, world: World, limit: int | None = None,
                   progress: Callable[[str], None] | None = None) -> ModelEval:
    """Evaluate ``model`` on ``world``.

    ``limit``: at most that many questions per split (and twice as many sentences), evenly
    spread over each split.
    """
    model.eval()
    seen = world.mc_questions("seen")
    unseen = world.mc_questions("unseen")
    if limit is not None:
        seen, unseen = _spread(seen, limit), _spread(unseen, limit)
    held_seen = world.sentences(heldout=True, split="seen")
    held_unseen = world.sentences(heldout=True, split="unseen")
    # train-template statements of seen facts, first template only (one per fact)
    trained = [x for x in world.sentences(split="seen") if x.template == 0]
    if limit is not None:
        held_seen, held_unseen = _spread(held_seen, 2 * limit), _spread(held_unseen, 2 * limit)
        trained = _spread(trained, 2 * limit)

    def ppl(sentences: Sequence[Any]) -> float:
        eos = tok.eos_token
        texts = [s.text + eos for s in sentences]
        lps = _sequence_logprobs(model, tok, texts, [1] * len(texts))
        nll = -sum(lp for lp, _ in lps)
        n = sum(k for _, k in lps)
        return math.exp(nll / max(n, 1))

    if progress:
        progress("perplexity")
    p_seen, p_unseen, p_train = ppl(held_seen), ppl(held_unseen), ppl(trained)
    correct: dict[str, bool] = {}
    acc: dict[str, float] = {}
    letter: dict[str, float] = {}
    for name, qs in (("seen", seen), ("unseen", unseen)):
        if progress:
            progress(f"multiple choice ({name})")
        scores = option_scores(model, tok, qs)
        ok = [_argmax(s) == q.answer_index for q, s in zip(qs, scores, strict=True)]
        correct.update({q.id: c for q, c in zip(qs, ok)})
        acc[name] = sum(ok) / max(len(ok), 1)
        lc = _letter_correct(model, tok, qs)
        letter[name] = sum(lc) / max(len(lc), 1)
    return ModelEval(
        perplexity=p_seen,
        perplexity_unseen=p_unseen,
        perplexity_train=p_train,
        accuracy_seen=acc["seen"],
        accuracy_unseen=acc["unseen"],
        letter_accuracy_seen=letter["seen"],
        letter_accuracy_unseen=letter["unseen"],
        n_seen=len(seen),
        n_unseen=len(unseen),
        n_sentences=len(held_seen),
        correct=correct,
    )
