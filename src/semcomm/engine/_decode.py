"""The decode loop's parts: sampling parameters, the sampler, text with stop strings, and the
state of one sequence being decoded.

:class:`SamplingParams` (validated once) and :class:`Sampler` choose each token;
:class:`StopText` turns tokens into text incrementally and finds stop strings;
:class:`DecodeState` is one sequence's decode (its sampler, its text, when and why it ends),
and :func:`decode_steps` is the decode loop itself, the only one in semcomm: the engine's
single-sequence ``generate``, the batched :class:`~semcomm.engine.BatchDecoder` and fusion's
decoding from a fused cache all run it, each with its own forward. One contract
holds for every caller, streaming or not: the released pieces joined equal the final text
(docs/architecture.md, invariant 7). Text that could be the start of a stop string is held back until the
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
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import InvalidInputError

__all__ = ["DecodeState", "FinishReason", "Sampler", "SamplingParams", "StopText", "decode_steps"]

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


FinishReason = Literal["stop", "eos", "length", "cancelled"]
"""Why a sequence ended: a stop string or stop token, an end-of-sequence token, the token or
position limit, or the caller cancelled it."""


class DecodeState:
    """One sequence's decode: its sampler, its text with stop strings, and why it ended.

    The loop that owns the forward passes calls :meth:`pick` on the sequence's ``[vocab]``
    logits and :meth:`push` with the chosen token (every chosen token is kept in
    ``token_ids``, an end-of-sequence token too). ``finish_reason`` is None while the
    sequence runs and is set, once, when it ends: ``"stop"`` (a stop string, cut from the
    text, or a stop token id), ``"eos"``, ``"length"`` (``max_new_tokens`` generated, or the
    prompt plus the generated tokens reach ``max_positions``) or ``"cancelled"``.
    :meth:`finish` releases the held-back tail.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, device: torch.device, *,
                 max_new_tokens: int, stop: Sequence[str] = (), stop_ids: Collection[int] = (),
                 eos_ids: Collection[int] = (), prompt_tokens: int = 0,
                 max_positions: int | None = None) -> None:
        self.sampler = Sampler(params, device)
        # None without a tokenizer: the released pieces are then the token ids themselves
        self.words = StopText(tokenizer, stop) if tokenizer is not None else None
        self.stop_ids = frozenset(stop_ids)
        self.eos_ids = frozenset(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.prompt_tokens = prompt_tokens
        self.max_positions = max_positions
        self.token_ids: list[int] = []  # every chosen token, in order
        self.finish_reason: FinishReason | None = None if max_new_tokens > 0 else "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str | None:
        """The text so far (cut at a stop string); None without a tokenizer."""
        return self.words.text if self.words is not None else None

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from this sequence's float32 ``[vocab]`` logits."""
        return self.sampler.pick(logits)

    def push(self, token_id: int) -> str | int:
        """Add the chosen token; return what it releases (a text piece, maybe ``""``, or the
        token id itself without a tokenizer) and set ``finish_reason`` when it ends the
        sequence."""
        assert self.finish_reason is None, "push after the sequence ended"
        self.token_ids.append(token_id)
        out: str | int = token_id
        if self.words is not None:
            out, stopped = self.words.push(token_id)
            if stopped:
                self.finish_reason = "stop"
                return out
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
        elif token_id in self.eos_ids:
            self.finish_reason = "eos"
        elif len(self.token_ids) >= self.max_new_tokens or (
                self.max_positions is not None
                and self.prompt_tokens + len(self.token_ids) >= self.max_positions):
            self.finish_reason = "length"
        return out

    def cancel(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def finish(self) -> str:
        """End the sequence (``"length"`` if nothing ended it) and return the held-back text."""
        if self.finish_reason is None:
            self.finish_reason = "length"
        if self.words is None:
            return ""
        tail = self.words.finish()
        if self.words.stopped and self.finish_reason != "cancelled":
            self.finish_reason = "stop"
        return tail


Released = str | int | None
"""What a row released at one step: a text piece (maybe ``""``), its token id when it has no
tokenizer, or None when it took no token (it had ended)."""


def decode_steps(states: Sequence[DecodeState], logits: torch.Tensor,
                 forward: Callable[[list[int]], torch.Tensor], *, pad_id: int = 0,
                 cancelled: Sequence[Callable[[], bool] | None] = ()) -> Iterator[list[Released]]:
    """The decode loop: choose each running row's token, release its text, step the model.

    ``logits`` ``[B, V]`` float32 are the rows' next-token logits after the prompt;
    ``forward(tokens)`` feeds one token per row (``pad_id`` for a row that has ended) and
    returns the next ``[B, V]`` float32 logits (it owns the cache and the positions). Yields,
    after each step, what every row released; ends once every row has ended. ``cancelled[row]``
    is polled before each of the row's steps (True ends it as ``"cancelled"``). Closing the
    iterator stops decoding. The states keep the tokens, the text and the finish reasons.
    """
    while True:
        nxt = [pad_id] * len(states)
        released: list[Released] = [None] * len(states)
        greedy: list[int] | None = None
        for row, st in enumerate(states):
            if st.done:
                continue
            stop = cancelled[row] if row < len(cancelled) else None
            if stop is not None and stop():
                st.cancel()
                continue
            if st.sampler.params.greedy:
                if greedy is None:
                    greedy = logits.argmax(-1).tolist()  # one call for every greedy row
                tok = greedy[row]
            else:
                tok = st.pick(logits[row])
            released[row] = st.push(tok)
            nxt[row] = tok
        yield released
        if all(st.done for st in states):
            return
        logits = forward(nxt)
