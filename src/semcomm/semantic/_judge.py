"""An instruct model as the judge of borderline candidates (optional, off by default).

A yes/no judgement is one forward pass over a short prompt: far cheaper than generating the
answer, dearer than the embedding lookup. :class:`JudgeVerifier` asks a small instruct model
from the catalog (``semcomm.models``: SmolLM2-135M-Instruct by default, or
Qwen2.5-Coder-0.5B-Instruct) whether one answer serves both questions, and reads
``P(yes) = softmax(logit_yes, logit_no)`` from the first answer token. The model is loaded on
first use, never at import.

Use it where the embedding is unsure::

    judge = JudgeVerifier()
    cache = SemanticCache(policy=ClusterVotePolicy(judge=judge, judge_floor=0.85))

Lone candidates with ``judge_floor <= cos < threshold`` are then served when the judge says
yes. The measured precision, recall and cost per verified hit are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import ConfigError

__all__ = ["JudgeVerifier"]

log = logging.getLogger(__name__)

_SYSTEM = ("You check a support cache. Reply with one word: yes if one answer fully and "
           "correctly answers both questions, no otherwise.")
_USER = "Question 1: {a}\nQuestion 2: {b}\nDoes one answer serve both questions?"


class JudgeVerifier:
    """``verify(query, cached_query) -> bool`` and ``score(...) -> P(yes)`` from an instruct
    model. ``threshold``: the P(yes) at or above which :meth:`verify` says yes. ``calls`` and
    ``seconds`` count the forward passes made and the time they took."""

    def __init__(self, model: str = "smollm2-135m-instruct", *, threshold: float = 0.5,
                 threads: int | None = None, max_chars: int = 400) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"judge threshold must be a probability in [0, 1], got {threshold!r}")
        self.model_name = model
        self.threshold = float(threshold)
        self.threads = threads
        self.max_chars = max_chars
        self.calls = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._model: Any = None
        self._tok: Any = None
        self._yes: list[int] = []
        self._no: list[int] = []

    def _load(self) -> None:
        if self._model is not None:
            return
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:  # pragma: no cover - torch/transformers are core deps here
            raise ConfigError(f"the judge needs torch and transformers: {exc}") from None
        from ..models import is_catalog_name, model_path

        path = model_path(self.model_name) if is_catalog_name(self.model_name) else self.model_name
        if self.threads:
            torch.set_num_threads(self.threads)
        self._tok = AutoTokenizer.from_pretrained(path)
        self._model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        def ids(words: tuple[str, ...]) -> list[int]:
            out = set()
            for w in words:
                t = self._tok.encode(w, add_special_tokens=False)
                if t:
                    out.add(t[0])
            return sorted(out)

        self._yes = ids(("yes", "Yes", " yes", " Yes", "YES"))
        self._no = ids(("no", "No", " no", " No", "NO"))
        if not self._yes or not self._no or set(self._yes) & set(self._no):
            raise ConfigError(f"judge model {self.model_name!r}: cannot find distinct yes/no "
                              "tokens")

    def score(self, query: str, best: Any, runner_up: Any = None) -> float:
        """P(yes): one answer serves both ``query`` and ``best`` (a text or a candidate)."""
        import torch

        cached = best if isinstance(best, str) else best.query
        with self._lock:
            self._load()
            t0 = time.perf_counter()
            msgs = [{"role": "system", "content": _SYSTEM},
                    {"role": "user", "content": _USER.format(a=query[: self.max_chars],
                                                             b=cached[: self.max_chars])}]
            text = self._tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            enc = self._tok(text, return_tensors="pt")
            with torch.inference_mode():
                logits = self._model(**enc).logits[0, -1]
            yes = torch.logsumexp(logits[self._yes], 0)
            no = torch.logsumexp(logits[self._no], 0)
            p = float(torch.sigmoid(yes - no))
            self.calls += 1
            self.seconds += time.perf_counter() - t0
        return p

    def __call__(self, query: str, best: Any, runner_up: Any = None) -> float:
        return self.score(query, best, runner_up)

    def verify(self, query: str, cached_query: str) -> bool:
        return self.score(query, cached_query) >= self.threshold

    @property
    def ms_per_call(self) -> float:
        return 1e3 * self.seconds / self.calls if self.calls else 0.0

    def __repr__(self) -> str:
        return f"JudgeVerifier(model={self.model_name!r}, threshold={self.threshold})"
