"""The greedy head (engine/_greedy_head.py): the exact argmax of a float32 LM head from an int8
copy, a bound and the candidates' float32 logits; the engine's greedy decode with it equals
``generate`` (and the full head) token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from semcomm.engine import HFEngine
from semcomm.engine._greedy_head import GreedyHead
from semcomm.errors import InvalidInputError
from semcomm.kv import MemoryStore

from ._engine_models import prompt_ids, reference_greedy, tiny_model

VOCAB, HIDDEN = 4096, 256


def _at_offset(w: torch.Tensor, offset: int) -> torch.Tensor:
    """``w`` copied to memory at ``offset`` bytes past a 64-byte boundary (a model's weights
    loaded from a file sit wherever the file puts them)."""
    raw = torch.empty(w.numel() * 4 + 128, dtype=torch.uint8)
    start = (offset - raw.data_ptr()) % 64
    out = raw[start : start + w.numel() * 4].view(torch.float32).view(w.shape)
    out.copy_(w)
    assert out.data_ptr() % 64 == offset
    return out


@pytest.fixture(scope="module")
def near_ties() -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose rows come in near-tied pairs along one hidden state ``h``: int8 rounding
    is far larger than the gaps, so the approximate argmax is often the wrong row of a pair."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn((VOCAB, HIDDEN), generator=gen) * 0.05
    h = torch.randn((1, 1, HIDDEN), generator=gen)
    d = h.reshape(-1) / h.norm() ** 2
    top = torch.arange(0, VOCAB, 64)
    for i in top.tolist():  # rows i and i+1: logits 10 and 10 + ~1e-5 (a float32 ulp or so)
        w[i] += (10 - w[i] @ h.reshape(-1)) * d
        w[i + 1] = w[i] + d * torch.randn((), generator=gen).abs() * 1e-5
    return _at_offset(w, 40), h


def test_argmax_equals_the_full_float32_head_where_int8_alone_is_wrong(
        near_ties: tuple[torch.Tensor, torch.Tensor]) -> None:
    w, h = near_ties
    head = GreedyHead(w)
    assert head.verified()
    gen = torch.Generator().manual_seed(1)
    wrong_fast = 0
    for i in range(40):
        x = h + torch.randn(h.shape, generator=gen) * (1e-7 * i)  # moves which row of a pair wins
        exact = F.linear(x, w).reshape(-1)
        fast = head.approx(x)
        wrong_fast += int(fast.argmax()) != int(exact.argmax())
        got = head.logits(x)
        assert int(got.argmax()) == int(exact.argmax())
        rows = torch.nonzero(got > float("-inf")).reshape(-1)
        assert torch.equal(got[rows], exact[rows])  # the candidates' logits are the exact bits
        assert rows.numel() < VOCAB // 8  # and they are few
    assert wrong_fast > 0  # the int8 copy alone would have picked another token


def test_candidate_rows_keep_the_full_products_bits_at_any_alignment() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn((VOCAB, HIDDEN), generator=gen)
    h = torch.randn((1, 1, HIDDEN), generator=gen)
    for offset in (0, 16, 40):
        wo = _at_offset(w, offset)
        exact = F.linear(h, wo).reshape(-1)
        head = GreedyHead(wo)
        for n in (1, 2, 5, 63, 64, 257):
            rows = torch.randperm(VOCAB, generator=gen)[:n].sort().values
            assert torch.equal(head.exact_rows(h, rows), exact[rows]), (offset, n)


def test_bound_covers_the_int8_error() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn((VOCAB, HIDDEN), generator=gen) * torch.rand((VOCAB, 1), generator=gen)
    w[::97, 5] = 3.0  # outliers: large per-row scales
    head = GreedyHead(w)
    for scale in (0.01, 1.0, 50.0):
        h = torch.randn((1, 1, HIDDEN), generator=gen) * scale
        exact = F.linear(h, w).reshape(-1)
        fast = head.approx(h)
        assert bool(((fast - exact).abs() <= head.bounds(h, fast)).all())


def test_refuses_what_it_cannot_copy() -> None:
    with pytest.raises(ValueError, match="float32"):
        GreedyHead(torch.zeros((8, 64), dtype=torch.bfloat16))
    assert not GreedyHead(torch.randn(64, 60)).verified()  # 240-byte rows: alignments differ


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2", "opt"])
def test_engine_greedy_decode_with_the_head_equals_generate(family: str) -> None:
    model = tiny_model(family)
    ids = prompt_ids(40)
    ref = reference_greedy(model, ids, 24)
    store = MemoryStore()
    on = HFEngine(model, store=store, chunk_size=16, device="cpu")
    off = HFEngine(model, store=store, chunk_size=16, device="cpu", greedy_head=False)
    for _ in range(2):  # cold, then warm
        assert on.generate(ids, max_new_tokens=24).token_ids == ref
    assert off.generate(ids, max_new_tokens=24).token_ids == ref
    assert isinstance(on._greedy_head(), GreedyHead)  # the decode steps ran through it
    assert off._greedy_head() is None


def test_engine_keeps_the_full_head_where_it_does_not_apply() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    assert HFEngine(model, device="cpu")._greedy_head() is None  # not a float32 head
    with pytest.raises(InvalidInputError, match="greedy_head"):
        HFEngine(tiny_model("llama"), device="cpu", greedy_head=1)  # type: ignore[arg-type]


def test_sampled_decode_does_not_use_it() -> None:
    model = tiny_model("llama")
    ids = prompt_ids(20)
    a = HFEngine(model, device="cpu").generate(ids, max_new_tokens=12, temperature=0.8, seed=5)
    b = HFEngine(model, device="cpu", greedy_head=False).generate(ids, max_new_tokens=12,
                                                                   temperature=0.8, seed=5)
    assert a.token_ids == b.token_ids


def test_a_hidden_state_that_is_not_finite_falls_back_to_the_full_head() -> None:
    w = torch.randn((VOCAB, HIDDEN), generator=torch.Generator().manual_seed(4))
    head = GreedyHead(w)
    h = torch.full((1, 1, HIDDEN), float("nan"))
    assert head.candidates(h) is None
    assert int(head.logits(h).argmax()) == int(F.linear(h, w).reshape(-1).argmax())


def test_engines_of_one_model_share_one_head_until_its_weight_changes() -> None:
    model = tiny_model("llama")
    a, b = HFEngine(model, device="cpu"), HFEngine(model, device="cpu")
    assert a._greedy_head() is b._greedy_head() is not None  # one int8 copy a model
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)  # changed in place: a new copy
    c = HFEngine(model, device="cpu")
    assert c._greedy_head() is not a._greedy_head()
    ids = prompt_ids(20)
    assert c.generate(ids, max_new_tokens=10).token_ids == reference_greedy(model, ids, 10)
