"""The decode loop's parts: sampling parameters, the sampler, and text with stop strings.

:class:`SamplingParams` (validated once) and :class:`Sampler` choose each token;
:class:`StopText` turns tokens into text incrementally and finds stop strings. One contract
holds for every caller, streaming or not: the released pieces joined equal the final text
(DESIGN invariant 7). Text that could be the start of a stop string is held back until the
next tokens decide it (a stream never shows part of a stop string), and a token that does not
complete a UTF-8 character yet releases nothing.

Incremental detokenization (as vLLM and TGI do): each step decodes only the tokens since a
moving ``prefix`` offset, ``decode(ids[prefix:])`` against ``decode(ids[prefix:read])``, and
releases the difference; the window starts at the first generated token, so its leading-space
treatment is the one ``decode(all generated tokens)`` gives. At the end the full text is
decoded once and checked against what was released.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = ["Sampler", "SamplingParams", "StopText"]

logger = logging.getLogger("semcomm.engine")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen: greedy when ``temperature == 0`` (top-p/top-k then ignored)."""

    temperature: float = 0.0  # >= 0; 0 = greedy (argmax)
    top_p: float = 1.0  # 0 < p <= 1: keep the smallest set of tokens whose mass reaches p
    top_k: int = 0  # >= 0; 0 = no limit
    seed: int | None = None  # seeds the sampler's generator (None: torch's global RNG)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise InvalidInputError(
                f"bad sampling parameters: temperature={self.temperature} (>= 0), "
                f"top_p={self.top_p} (0 < p <= 1), top_k={self.top_k} (>= 0)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Chooses the next token from float32 ``[vocab]`` logits under :class:`SamplingParams`."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.rng: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.rng = torch.Generator(device=device)
            self.rng.manual_seed(int(params.seed))

    def pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cum = torch.cumsum(sp, dim=-1)
            drop = cum - sp > p.top_p  # keep the smallest prefix whose mass reaches top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, si, sp)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.rng))


class StopText:
    """Generated text, built token by token, cut at the first stop string.

    ``push(token)`` returns ``(piece, stopped)``: the text that is now safe to release and
    whether a stop string was found (the text is cut before it). ``finish()`` releases what
    was held back and returns the last piece. ``text`` is the final text once finished; the
    pieces joined always equal it.
    """

    _WINDOW = 6  # tokens kept before ``read`` as context for the next decode

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()):
        self._tok = tokenizer
        self.stops = [s for s in stops if s]
        self._hold_max = max((len(s) for s in self.stops), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # decode window start (token index)
        self._read = 0  # tokens whose text is in ``_text``
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._text = ""  # stable text so far (released + held), cut at a stop string
        self._released = 0  # chars of ``_text`` released
        self.stopped = False
        self.finished = False

    @property
    def text(self) -> str:
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def _held(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        t = self._text
        for k in range(min(self._hold_max, len(t) - self._released), 0, -1):
            tail = t[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def push(self, token_id: int) -> tuple[str, bool]:
        assert not self.stopped and not self.finished
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith("\ufffd") or len(new_text) <= len(self._prefix_text):
            return "", False  # incomplete UTF-8, or no visible text yet
        piece = new_text[len(self._prefix_text) :]
        self._read = len(self._ids)
        self._prefix = max(self._prefix, self._read - self._WINDOW)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._add(piece)

    def _add(self, piece: str) -> tuple[str, bool]:
        from_ = max(self._released, len(self._text) - self._hold_max)  # a match may start here
        self._text += piece
        cuts = [i for i in (self._text.find(s, from_) for s in self.stops) if i >= 0]
        if cuts:
            self._text = self._text[: min(cuts)]
            self.stopped = True
            return self._release(len(self._text)), True
        return self._release(len(self._text) - self._held()), False

    def _release(self, upto: int) -> str:
        out = self._text[self._released : upto]
        self._released = max(self._released, upto)
        return out

    def finish(self) -> str:
        """Release everything left (held-back text, an incomplete UTF-8 tail)."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        out = ""
        full = self._decode(self._ids)
        if full.startswith(self._text):
            tail = full[len(self._text) :]  # what the last tokens added (incomplete UTF-8)
            if tail:
                out, self.stopped = self._add(tail)
        else:  # incremental decoding disagreed with the whole decode: keep what was released
            logger.warning("incremental detokenization differs from the full decode; the "
                           "streamed text is kept")
        return out + self._release(len(self._text))
