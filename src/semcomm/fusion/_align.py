"""Token alignment between two tokenizers by character spans.

Both models see the same *shared text* (the context), each wrapped in its own prompt
(``prefix + shared + suffix``; prefixes and suffixes may differ: chat templates, answer
cues). Each tokenizer reports character offsets into its own prompt string (fast
tokenizers' ``offset_mapping``; offsets refer to the original text even when the tokenizer
normalizes it, e.g. WordPiece lowercasing and accent stripping). Offsets are made relative
to the shared text, and each receiver token lying wholly inside the shared text takes the
sharer tokens whose spans overlap its own:

* split tokens (receiver "Bor" "deaux", sharer "bordeaux") both take the one sharer token;
* merged tokens (receiver "Bordeaux", sharer "bord" "##eaux") take both (weights average them
  with ``reduce="mean"``, or take the rightmost with ``reduce="last"``);
* a sharer token with exactly the receiver token's span is taken alone (identical tokenizers
  align one to one);
* receiver tokens with no overlapping sharer token (whitespace runs, which WordPiece drops;
  template or special tokens) and tokens straddling the shared text's edges are not fused.

Unlike the reference C2C aligner, the sharer keeps its natural tokenization (its prompt is
never re-tokenized into receiver-sized pieces), and nothing is dropped from a one-to-many
mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import InvalidInputError

__all__ = ["Alignment", "EncodedPrompt", "PromptParts", "align_offsets", "encode_prompt"]

Reduce = Literal["mean", "last"]


@dataclass(frozen=True, slots=True)
class PromptParts:
    """A prompt as ``prefix + shared + suffix``; only ``shared`` is seen by both models."""

    prefix: str
    shared: str
    suffix: str

    @property
    def text(self) -> str:
        return self.prefix + self.shared + self.suffix

    @property
    def shared_span(self) -> tuple[int, int]:
        start = len(self.prefix)
        return start, start + len(self.shared)


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """Token ids of one prompt with each token's character span relative to the shared text.

    ``spans[i]`` is ``None`` for tokens not wholly inside the shared text (special tokens,
    template tokens, tokens straddling its edges) and for zero-width tokens.
    """

    input_ids: list[int]
    spans: list[tuple[int, int] | None]


def encode_prompt(tokenizer: Any, parts: PromptParts, *, add_special_tokens: bool) -> EncodedPrompt:
    """Tokenize ``parts.text`` and compute each token's span relative to ``parts.shared``."""
    if not getattr(tokenizer, "is_fast", False):
        raise InvalidInputError(
            f"{type(tokenizer).__name__} is not a fast tokenizer: cross-tokenizer alignment "
            "needs character offsets (return_offsets_mapping)"
        )
    enc = tokenizer(
        parts.text,
        add_special_tokens=add_special_tokens,
        return_offsets_mapping=True,
        return_token_type_ids=False,
        return_attention_mask=False,
    )
    ids = list(enc["input_ids"])
    start, end = parts.shared_span
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    spans: list[tuple[int, int] | None] = []
    for tok, (a, b) in zip(ids, enc["offset_mapping"], strict=True):
        if b <= a or tok in special or a < start or b > end:
            spans.append(None)
        else:
            spans.append((a - start, b - start))
    return EncodedPrompt(input_ids=ids, spans=spans)


@dataclass(frozen=True, slots=True)
class Alignment:
    """Receiver-token x sharer-token weights.

    ``weights`` is [N_r, N_s] float32 with rows summing to 1 where ``mask`` is 1 and all zero
    elsewhere; aligned sharer KV for the receiver is ``weights @ sharer_kv`` along tokens.
    """

    weights: torch.Tensor  # [N_r, N_s]
    mask: torch.Tensor  # [N_r] float32, 1.0 = fused

    @property
    def num_fused(self) -> int:
        return int(self.mask.sum().item())

    def sources(self, i: int) -> list[int]:
        """Sharer token indices feeding receiver token ``i``."""
        return torch.nonzero(self.weights[i] > 0).flatten().tolist()


def align_offsets(
    receiver_spans: list[tuple[int, int] | None],
    sharer_spans: list[tuple[int, int] | None],
    *,
    reduce: Reduce = "mean",
) -> Alignment:
    """Align by span overlap; see the module docstring for the rules."""
    if reduce not in ("mean", "last"):
        raise ValueError(f"reduce must be 'mean' or 'last', got {reduce!r}")
    n_r, n_s = len(receiver_spans), len(sharer_spans)
    weights = torch.zeros(n_r, n_s, dtype=torch.float32)
    # sharer spans sorted by start; both lists are in text order, so one sweep suffices
    indexed = [(j, s) for j, s in enumerate(sharer_spans) if s is not None]
    # exact span matches first: the k-th receiver token with span X takes the k-th sharer
    # token with span X (identical tokenizers align 1:1, byte pieces of one character too)
    exact: dict[tuple[int, int], list[int]] = {}
    for j, s in indexed:
        exact.setdefault(s, []).append(j)
    seen: dict[tuple[int, int], int] = {}
    lo = 0
    for i, span in enumerate(receiver_spans):
        if span is None:
            continue
        a, b = span
        k_seen = seen.get(span, 0)
        seen[span] = k_seen + 1
        same = exact.get(span)
        if same is not None and k_seen < len(same):
            weights[i, same[k_seen]] = 1.0
            continue
        while lo < len(indexed) and indexed[lo][1][1] <= a:
            lo += 1
        hits: list[int] = []
        k = lo
        while k < len(indexed) and indexed[k][1][0] < b:
            c, d = indexed[k][1]
            if c < b and d > a:
                hits.append(indexed[k][0])
            k += 1
        if not hits:
            continue
        if reduce == "last":
            weights[i, hits[-1]] = 1.0
        else:
            weights[i, hits] = 1.0 / len(hits)
    mask = (weights.sum(dim=1) > 0).to(torch.float32)
    return Alignment(weights=weights, mask=mask)
