"""Fused generation: last-token handling, KV store hits for the sharer, clear errors."""

from __future__ import annotations

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.errors import ConfigError, InvalidInputError, NamespaceMismatchError
from semcomm.fusion import Fuser, FuserConfig, FusionPipeline, ModelSide, model_spec
from semcomm.fusion._kvio import cache_to_layers, output_cache
from semcomm.kv import MemoryStore

from ._fusion_helpers import _one_thread  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_pair


@pytest.fixture(scope="module")
def pair():
    return toy_pair("cross", seed=1)


@pytest.fixture
def sides(pair):
    return (
        ModelSide(pair.sharer, pair.sharer_tokenizer, add_special_tokens=True),
        ModelSide(pair.receiver, pair.receiver_tokenizer, prefix="ctx: ", suffix=" ->"),
    )


@pytest.fixture
def open_fuser(sides) -> Fuser:
    s, r = sides
    torch.manual_seed(0)
    f = Fuser(
        FuserConfig(sharer=s.spec, receiver=r.spec, hidden_dim=16, num_blocks=1, zero_init=False)
    )
    with torch.no_grad():
        f.gate_logit.fill_(1.0)  # hard gates open
        f.w_out.mul_(50)  # a strong projection, so fusion visibly changes logits
    return f.eval()


SHARED = "The Quick  brown fox — café 東京"


def test_first_generated_token_sees_the_fused_cache(sides, open_fuser: Fuser) -> None:
    s, r = sides
    pipe = FusionPipeline(s, r, open_fuser)
    fp = pipe.encode(SHARED)
    layers, stats = pipe.fused_layers(fp)
    assert stats["fused_tokens"] == fp.alignment.num_fused > 0
    assert layers[0][0].shape[2] == len(fp.receiver.input_ids) - 1  # last prompt token not yet fed
    ids = fp.receiver.input_ids
    # first-token logits: last prompt token run on the fused cache, vs on the plain cache
    from semcomm.fusion._kvio import cache_kwargs, layers_to_cache

    with torch.no_grad():
        out = r.model(
            input_ids=torch.tensor([ids[-1:]]),
            position_ids=torch.tensor([[len(ids) - 1]]),
            **cache_kwargs(r.model, layers_to_cache([(k.clone(), v.clone()) for k, v in layers])),
        )
        plain = r.model(input_ids=torch.tensor([ids]))
    assert not torch.allclose(out.logits[0, -1], plain.logits[0, -1], atol=1e-3)
    gen = pipe.generate(SHARED, max_new_tokens=1)
    first = int(out.logits[0, -1].argmax())
    assert gen.token_ids == ([] if first in r.eos_ids() else [first])


def test_closed_gate_generates_exactly_the_receiver_alone(sides, open_fuser: Fuser) -> None:
    s, r = sides
    pipe = FusionPipeline(s, r, open_fuser)
    open_fuser.set_gate_mode("closed")
    closed = pipe.generate(SHARED, max_new_tokens=6)
    # the receiver alone, through HF's plain forward over the full prompt, greedy
    ids = r.encode(SHARED).input_ids
    seq = list(ids)
    with torch.no_grad():
        for _ in range(len(closed.token_ids)):
            seq.append(int(r.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert closed.token_ids == seq[len(ids) :]
    assert closed.stats["fused_tokens"] > 0  # fusion ran; the closed gate made it a no-op


def test_sharer_kv_comes_from_the_store_when_cached(sides, open_fuser: Fuser) -> None:
    s, r = sides
    store = MemoryStore(capacity_bytes=64 << 20)
    engine = HFEngine(s.model, s.tokenizer, store=store, chunk_size=4, device="cpu")
    with_engine = FusionPipeline(s, r, open_fuser, sharer_engine=engine)
    direct = FusionPipeline(s, r, open_fuser)
    first = with_engine.generate(SHARED, max_new_tokens=4)
    second = with_engine.generate(SHARED, max_new_tokens=4)
    ref = direct.generate(SHARED, max_new_tokens=4)
    e1, e2 = first.stats["sharer_engine_stats"], second.stats["sharer_engine_stats"]
    assert first.stats["sharer_source"] == "engine" and e1["hit_tokens"] == 0
    n = second.stats["sharer_prompt_tokens"]
    assert (
        e2["hit_tokens"] >= n - 4 and e2["recomputed_tokens"] <= 4
    )  # cached context not recomputed
    assert store.stats().entries > 0
    assert first.token_ids == second.token_ids == ref.token_ids  # lossless restore: same answer


def test_bad_input_and_mismatched_pairs(sides, pair, open_fuser: Fuser) -> None:
    s, r = sides
    pipe = FusionPipeline(s, r, open_fuser)
    with pytest.raises(InvalidInputError, match="empty"):
        pipe.generate("")
    # a fuser built for another pair: receiver and sharer swapped (other layout)
    with pytest.raises(ConfigError, match="built for sharer"):
        FusionPipeline(r, s, open_fuser)
    # same layout, other weights: refused by fingerprint
    other = toy_pair("cross", seed=7)
    o_side = ModelSide(other.sharer, other.sharer_tokenizer, add_special_tokens=True)
    assert model_spec(other.sharer).same_layout(s.spec)
    with pytest.raises(NamespaceMismatchError, match="another sharer"):
        FusionPipeline(o_side, r, open_fuser)


def test_cache_helpers_round_trip(sides) -> None:
    s, _ = sides
    with torch.no_grad():
        out = s.model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
    layers = cache_to_layers(output_cache(out))
    assert len(layers) == s.spec.num_layers and layers[0][0].shape[2] == 3
