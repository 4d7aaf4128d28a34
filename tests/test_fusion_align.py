"""Token alignment between tokenizers by character spans, on hard strings."""

from __future__ import annotations

import pytest
import torch

from semcomm.errors import InvalidInputError
from semcomm.fusion import PromptParts, align_offsets, encode_prompt

from ._fusion_helpers import _one_thread  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_bpe_tokenizer, wordpiece_tokenizer


@pytest.fixture(scope="module")
def bpe():
    return toy_bpe_tokenizer()


@pytest.fixture(scope="module")
def wordpiece():
    return wordpiece_tokenizer()


def test_split_and_merged_tokens_mean_and_last() -> None:
    # receiver: "Bor" "deaux" " is"  /  sharer: "bordeaux" "is"  (split on the receiver side)
    # receiver: "Paris" / sharer: "par" "##is"                     (merged on the receiver side)
    recv = [(0, 3), (3, 8), (8, 11), (12, 17)]
    shar = [(0, 8), (9, 11), (12, 15), (15, 17)]
    al = align_offsets(recv, shar, reduce="mean")
    assert [al.sources(i) for i in range(4)] == [[0], [0], [1], [2, 3]]
    assert torch.equal(al.weights[3], torch.tensor([0.0, 0.0, 0.5, 0.5]))
    last = align_offsets(recv, shar, reduce="last")
    assert torch.equal(last.weights[3], torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert al.mask.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_unmatched_and_outside_tokens_are_not_fused() -> None:
    recv = [None, (0, 5), (5, 8), (8, 12)]  # BOS, word, whitespace run, word
    shar = [None, (0, 5), (8, 12)]  # WordPiece drops whitespace
    al = align_offsets(recv, shar)
    assert al.mask.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert torch.equal(al.weights[0], torch.zeros(3)) and torch.equal(al.weights[2], torch.zeros(3))
    with pytest.raises(ValueError):
        align_offsets(recv, shar, reduce="max")  # type: ignore[arg-type]


HARD = [
    "naïve café résumé — 東京 and München",
    "  whitespace   runs\tand\nnew lines  ",
    "Zorbia's capital is Velmora; e-mail@example.com 3.14",
    "emoji 🙂 and combining e\u0301 accents",
]


@pytest.mark.parametrize("shared", HARD)
def test_real_tokenizers_on_hard_strings(bpe, wordpiece, shared: str) -> None:
    r_parts = PromptParts("Q: ", shared, " A:")
    s_parts = PromptParts("question: ", shared, " answer:")
    r = encode_prompt(bpe, r_parts, add_special_tokens=False)
    s = encode_prompt(wordpiece, s_parts, add_special_tokens=True)  # [CLS] ... [SEP]
    al = align_offsets(r.spans, s.spans)
    assert al.weights.shape == (len(r.input_ids), len(s.input_ids))
    assert s.spans[0] is None and s.spans[-1] is None  # specials are never sources
    fused = 0
    for i, span in enumerate(r.spans):
        srcs = al.sources(i)
        if span is None:
            assert not srcs  # template tokens of the receiver are never fused
            continue
        a, b = span
        text = shared[a:b]
        if text.strip() == "":
            assert not srcs, f"whitespace token {text!r} must not be fused"
            continue
        # every source overlaps the receiver token's characters, and sources are complete
        for j in srcs:
            c, d = s.spans[j]
            assert c < b and d > a
        covering = [j for j, sp in enumerate(s.spans) if sp is not None and sp[0] < b and sp[1] > a]
        exact = [j for j in covering if s.spans[j] == span]
        assert srcs == (exact[:1] if exact else covering)
        if srcs:
            fused += 1
            assert abs(float(al.weights[i].sum()) - 1.0) < 1e-6
    assert fused >= len([w for w in shared.split() if w]) // 2


def test_same_tokenizer_gives_identity(bpe) -> None:
    parts = PromptParts("", "The quick brown fox jumps over café 東京", "")
    e = encode_prompt(bpe, parts, add_special_tokens=False)
    al = align_offsets(e.spans, e.spans)
    fused = [i for i, s in enumerate(e.spans) if s is not None]
    assert len(fused) == len(e.spans) > 5
    assert torch.equal(al.weights, torch.eye(len(e.spans)))  # byte pieces of 東京 included


def test_wordpiece_lowercasing_keeps_original_offsets(wordpiece) -> None:
    parts = PromptParts("", "Héllo  WÖRLD", "")
    e = encode_prompt(wordpiece, parts, add_special_tokens=False)
    assert [parts.shared[a:b] for a, b in e.spans] == ["Héllo", "WÖRLD"]


def test_slow_tokenizer_is_refused() -> None:
    class Slow:
        is_fast = False

    with pytest.raises(InvalidInputError, match="fast tokenizer"):
        encode_prompt(Slow(), PromptParts("", "x", ""), add_special_tokens=False)
