"""Documents reused at any position (engine/_documents.py) on tiny config-built models.

Properties that hold on any CPU, never float bits: re-rotation is a rotation, restored document
KV equals KV computed at the new position (layer 0: a key there depends only on its token and
position), r = 1 gives full prefill's greedy tokens, tenant isolation, stored documents never
overwritten, refusal of models whose positions cannot be moved.
"""

from __future__ import annotations

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.engine import _cache_adapter as ca
from semcomm.engine._documents import (
    Document,
    DocumentReuse,
    SegmentedPrompt,
    Text,
    build_prompt,
    rope_spec,
    rotate_keys,
)
from semcomm.errors import InvalidInputError, UnsupportedModelError
from semcomm.kv import MemoryStore
from semcomm.security import TenantSalter

from ._engine_models import prompt_ids, reference_greedy, tiny_model

CHUNK = 8
ROPE_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gpt_neox", "olmo2",
                 "granite", "stablelm", "falcon"]


def _engine(name: str = "qwen2", store: object = None, **kw: object) -> HFEngine:
    return HFEngine(tiny_model(name), store=store if store is not None else MemoryStore(),
                    chunk_size=CHUNK, device="cpu", **kw)


def _segments(seed: int = 0, docs: int = 3, order: tuple[int, ...] | None = None) -> list:
    head = Text(tokens=tuple(prompt_ids(5, seed=100 + seed)))
    ds = [Document(tokens=tuple(prompt_ids(11 + 3 * i, seed=200 + i))) for i in range(docs)]
    if order is not None:
        ds = [ds[i] for i in order]
    seps = [Text(tokens=(7, 9)) for _ in ds]
    tail = Text(tokens=tuple(prompt_ids(6, seed=300 + seed)))
    out: list = [head]
    for d, s in zip(ds, seps):
        out += [d, s]
    return [*out, tail]


def test_rotation_by_zero_is_identity_and_moves_compose() -> None:
    spec = rope_spec(tiny_model("qwen2"))
    k = torch.randn(2, 4, 10, spec.head_dim)
    assert torch.allclose(rotate_keys(k, 0, spec), k, atol=1e-6)
    back = rotate_keys(rotate_keys(k, 123, spec), -123, spec)
    assert torch.allclose(back, k, atol=1e-5)
    per = rotate_keys(k, torch.arange(10), spec)
    assert torch.allclose(per[..., 3, :], rotate_keys(k[..., 3:4, :], 3, spec)[..., 0, :], atol=1e-5)


@pytest.mark.parametrize("mode", ["rotated", "unrotated"])
@pytest.mark.parametrize("name", ROPE_FAMILIES)
def test_restored_document_equals_kv_computed_at_the_new_position(name: str, mode: str) -> None:
    eng = _engine(name)
    docs = DocumentReuse(eng, anchor=(1, 5, 6), key_mode=mode)
    doc = prompt_ids(19, seed=4)
    assert docs.precompute(Document(tokens=tuple(doc))) == 3
    assert docs.precompute(Document(tokens=tuple(doc))) == 0  # stored once
    # the document at position 23 after another prefix, computed by the model itself
    prefix = prompt_ids(23, seed=5)
    cache = ca.new_cache()
    with torch.no_grad():
        eng._runner.forward(torch.tensor([prefix + doc]), cache)
    want_k, want_v = ca.cache_layers(cache)[0]
    lay = docs.layout
    bk = torch.zeros((lay.num_layers, lay.kv_heads, 64, lay.k_dim))
    bv = torch.zeros((lay.num_layers, lay.kv_heads, 64, lay.v_dim))
    from semcomm.engine._documents import BlendStats

    assert docs._fetch_document(docs.document_keys(doc), len(doc), bk, bv, 23, BlendStats())
    delta = 23 - 3 if mode == "rotated" else torch.arange(23, 42)  # unrotated: at position 0
    k = rotate_keys(bk[:, :, 23:42], delta, docs.spec)
    scale = float(want_k.abs().max())
    assert torch.allclose(k[0], want_k[0, :, 23:42], atol=1e-4 * scale, rtol=1e-4)
    assert torch.allclose(bv[0, :, 23:42], want_v[0, :, 23:42], atol=1e-5)


@pytest.mark.parametrize("selector", ["cacheblend", "epic", "prophet", "full"])
@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3"])
def test_full_recompute_gives_full_prefill_greedy(name: str, selector: str) -> None:
    eng = _engine(name)
    docs = DocumentReuse(eng)
    segs = _segments()
    for s in segs:
        if isinstance(s, Document):
            docs.precompute(s)
    ids = list(build_prompt(None, segs).ids)
    want = reference_greedy(eng.model, ids, 8)
    r = docs.generate(segs, 8, selector=selector, recompute=1.0)
    assert r.prompt_ids == ids
    assert r.token_ids == want
    assert r.stats.documents_hit == 3 and r.stats.recompute_share == 1.0
    assert r.stats.reused_tokens == 0


@pytest.mark.parametrize("selector", ["full", "prophet"])
def test_recompute_in_blocks_equals_one_forward(selector: str, monkeypatch) -> None:
    """The recomputed tokens run in blocks, each attending only up to its last position: the
    prompt's KV and the first token's logits equal one forward over them all (r = 1: full
    prefill's logits)."""
    from semcomm.engine import _documents

    segs = _segments(docs=4)

    def blended(block: int) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(_documents, "_RUN_BLOCK", block)
        docs = DocumentReuse(_engine("qwen2"), keep_blended=False)
        pre = docs.prefill(segs, selector=selector, recompute=1.0 if selector == "full" else 0.3)
        k, _ = ca.layer_tensors(pre.cache)[-1]
        return pre.last_logits, k[0].clone()

    one_logits, one_k = blended(10_000)
    for block in (3, 7):
        logits, k = blended(block)
        assert torch.allclose(logits, one_logits, atol=1e-4)
        assert torch.allclose(k, one_k, atol=1e-4)
    if selector == "full":
        eng = _engine("qwen2")
        ids = list(build_prompt(None, segs).ids)
        with torch.inference_mode():
            want = eng.model(torch.tensor([ids])).logits[0, -1].float()
        assert torch.allclose(one_logits, want, atol=1e-4)


@pytest.mark.parametrize("selector", ["cacheblend", "epic", "prophet", "concat"])
def test_partial_recompute_reports_its_budget_and_runs(selector: str) -> None:
    eng = _engine("qwen2")
    docs = DocumentReuse(eng)
    segs = _segments(docs=4)
    r = docs.generate(segs, 4, selector=selector, recompute=0.25)
    st = r.stats
    assert st.documents_computed == 4 and st.documents_hit == 0
    want = 0 if selector == "concat" else 0.25
    assert abs(st.recompute_share - want) <= 1 / st.document_tokens + 1e-9
    assert st.reused_tokens + st.recomputed_document_tokens == st.document_tokens
    assert len(r.token_ids) == 4
    # the documents are stored now: a reordered prompt hits every one
    r2 = docs.generate(_segments(docs=4, order=(3, 1, 0, 2)), 4, selector=selector,
                       recompute=0.25)
    assert r2.stats.documents_hit == 4 and r2.stats.documents_computed == 0


def test_repeated_blended_prompt_is_a_whole_hit_and_documents_stay() -> None:
    store = MemoryStore()
    eng = _engine("qwen2", store=store)
    docs = DocumentReuse(eng)
    segs = _segments(docs=3)
    for s in segs:
        if isinstance(s, Document):
            docs.precompute(s)
    doc_keys = [k for s in segs if isinstance(s, Document)
                for k in docs.document_keys(list(s.tokens))]
    before = {k: store.get(k) for k in doc_keys}
    a = docs.generate(segs, 6, selector="prophet", recompute=0.3)
    assert not a.stats.blend_hit and a.stats.chunks_stored > 0
    assert {k: store.get(k) for k in doc_keys} == before  # originals not overwritten
    b = docs.generate(segs, 6, selector="prophet", recompute=0.3)
    assert b.stats.blend_hit and b.stats.recomputed_tokens == 0
    assert b.token_ids == a.token_ids
    # another selector or budget is another blended prompt
    c = docs.generate(segs, 6, selector="epic", recompute=0.3)
    assert not c.stats.blend_hit


def test_exact_head_is_stored_under_prefix_keys_and_hit_later() -> None:
    eng = _engine("qwen2")
    docs = DocumentReuse(eng)
    head = Text(tokens=tuple(prompt_ids(20, seed=9)))  # 2 full chunks before the document
    segs = [head, Document(tokens=tuple(prompt_ids(12, seed=8))), Text(tokens=(4, 5, 6))]
    docs.generate(segs, 2, selector="epic", recompute=0.2)
    ids = list(build_prompt(None, segs).ids)
    assert eng.cached_tokens(ids) == 16  # exact chunks only, never the approximate part
    r = docs.generate(segs, 2, selector="cacheblend", recompute=0.2)
    assert r.stats.prefix_hit_tokens == 16


def test_document_keys_never_collide_with_prefix_keys() -> None:
    eng = _engine("qwen2")
    docs = DocumentReuse(eng, anchor=())
    toks = prompt_ids(20, seed=3)
    assert not set(docs.document_keys(toks)) & set(eng.chunk_keys(toks))
    other = DocumentReuse(eng, anchor=(), key_mode="unrotated")
    assert not set(docs.document_keys(toks)) & set(other.document_keys(toks))


def test_tenants_never_share_documents() -> None:
    store = MemoryStore()
    salter = TenantSalter(secret=b"k" * 32)
    model = tiny_model("llama")
    a = DocumentReuse(HFEngine(model, store=store, chunk_size=CHUNK, device="cpu", tenant="a",
                               salter=salter))
    b = DocumentReuse(HFEngine(model, store=store, chunk_size=CHUNK, device="cpu", tenant="b",
                               salter=salter))
    a2 = DocumentReuse(HFEngine(model, store=store, chunk_size=CHUNK, device="cpu", tenant="a",
                                salter=salter))
    doc = Document(tokens=tuple(prompt_ids(30, seed=1)))
    a.precompute(doc)
    assert a.is_stored(doc) and a2.is_stored(doc) and not b.is_stored(doc)
    segs = [Text(tokens=(3, 4)), doc, Text(tokens=(8, 9, 10))]
    assert b.generate(segs, 2).stats.documents_hit == 0
    assert a2.generate(segs, 2).stats.documents_hit == 1


@pytest.mark.parametrize("name,why", [("gpt2", "absolute"), ("opt", "absolute"),
                                      ("falcon_alibi", "ALiBi")])
def test_models_whose_positions_cannot_move_are_refused(name: str, why: str) -> None:
    eng = _engine(name)
    with pytest.raises(UnsupportedModelError, match=why):
        DocumentReuse(eng)


def test_sliding_window_shorter_than_the_prompt_is_refused() -> None:
    from ._engine_models import WINDOW

    eng = HFEngine(tiny_model("mistral_sw"), store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    docs = DocumentReuse(eng, anchor=())
    short = [Document(tokens=(5, 6, 7)), Text(tokens=(8, 9))]
    assert len(docs.generate(short, 2, recompute=1.0).token_ids) == 2
    long = [Document(tokens=tuple(prompt_ids(WINDOW + 4, seed=2))), Text(tokens=(8, 9))]
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        docs.generate(long, 2)


def test_bad_requests_are_refused() -> None:
    docs = DocumentReuse(_engine("qwen2"))
    segs = _segments()
    with pytest.raises(InvalidInputError, match="selector"):
        docs.generate(segs, 2, selector="nope")
    with pytest.raises(InvalidInputError, match="recompute"):
        docs.generate(segs, 2, recompute=1.5)
    with pytest.raises(InvalidInputError):
        Document(tokens=())
    with pytest.raises(InvalidInputError, match="vocabulary"):
        docs.generate([Document(tokens=(99999,))], 2)
    assert isinstance(build_prompt(None, segs), SegmentedPrompt)


def test_engine_precompute_and_segmented_generate() -> None:
    eng = _engine("qwen2")
    segs = _segments(docs=3)
    assert sum(eng.precompute(s) for s in segs if isinstance(s, Document)) > 0
    ids = list(build_prompt(None, segs).ids)
    r = eng.generate(segs, 6, selector="cacheblend", recompute=1.0)
    assert r.token_ids == reference_greedy(eng.model, ids, 6)
    assert r.prompt_ids == ids
    doc = r.stats.documents
    assert doc is not None and doc["documents_hit"] == 3 and doc["selector"] == "cacheblend"
    assert r.stats.to_dict()["documents"]["recompute_share"] == 1.0
    pieces = list(stream := eng.generate(segs, 6, recompute=0.2, stream=True))
    assert stream.result is not None and pieces == stream.result.token_ids  # no tokenizer: ids
    with pytest.raises(InvalidInputError, match="documents"):
        eng.generate(ids, 2, selector="epic")
    # HFEngine.generate passes every decoding option on to a prompt with documents
    stop_id = r.token_ids[2]
    cut = eng.generate(segs, 6, recompute=1.0, stop=[stop_id])
    assert cut.token_ids == r.token_ids[:3] and cut.stats.finish_reason == "stop"
    hot = [eng.generate(segs, 6, recompute=1.0, temperature=5.0, seed=s).token_ids
           for s in range(4)]
    assert any(t != r.token_ids for t in hot)  # temperature reaches the sampler


@pytest.mark.slow
def test_real_model_chat_segments_full_recompute_matches_the_engine() -> None:
    from semcomm.engine import System, User

    eng = HFEngine("smollm2-135m-instruct", store=MemoryStore(), dtype="float32")
    d1 = Document("(Title: Paris) Paris is the capital and most populous city of France.")
    d2 = Document("(Title: Berlin) Berlin is the capital and largest city of Germany.")
    segs = [System("Answer briefly."), User("Documents:\n"), d1, Text("\n"), d2,
            User("\nQuestion: What is the capital of Germany?\nAnswer:")]
    prompt = build_prompt(eng.tokenizer, segs)
    assert prompt.ids[slice(*prompt.spans[1])] == tuple(eng.documents().document_tokens(d2))
    want = eng.generate(list(prompt.ids), 8).token_ids
    eng.precompute(d1)
    got = eng.generate(segs, 8, selector="prophet", recompute=1.0)
    assert got.token_ids == want
    assert got.stats.documents["documents_hit"] == 1  # d2 computed alone by the request
    again = eng.generate(segs[:2] + [d2, Text("\n"), d1] + segs[-1:], 8, recompute=0.15)
    assert again.stats.documents["documents_hit"] == 2  # reordered: both stored now


def test_bfloat16_model_passes_the_rotation_check_and_full_recompute_matches() -> None:
    eng = HFEngine(tiny_model("qwen2"), store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                   dtype="bfloat16")
    segs = _segments(docs=2)
    got = eng.generate(segs, 6, selector="prophet", recompute=1.0)
    assert got.token_ids == eng.generate(list(build_prompt(None, segs).ids), 6).token_ids


def test_the_confidence_test_falls_back_to_full_prefill() -> None:
    """Below ``margin`` (top-1 minus top-2 probability of the first token) the blended prefill
    is not trusted: the prompt is prefilled in full and the tokens are full prefill's."""
    eng = _engine("qwen2")
    segs = _segments(docs=3)
    ids = list(build_prompt(None, segs).ids)
    eng.generate(segs, 2, recompute=0.0)  # documents stored
    sure = eng.generate(segs, 6, recompute=0.0, margin=1.0)  # no margin reaches 1: fallback
    doc = sure.stats.documents
    assert doc is not None and doc["fallback"] and doc["margin"] == 1.0
    assert 0 <= doc["first_margin"] < 1 and doc["reused_tokens"] == 0
    assert sure.token_ids == reference_greedy(eng.model, ids, 6)
    kept = eng.generate(segs, 6, recompute=0.0, margin=0.0)  # 0: no test
    assert not kept.stats.documents["fallback"] and kept.stats.documents["reused_tokens"] > 0
    with pytest.raises(InvalidInputError, match="margin"):
        eng.generate(segs, 2, margin=1.5)
    with pytest.raises(InvalidInputError, match="margin"):
        eng.generate(ids, 2, margin=0.1)


def test_watch_rebuilds_the_kv_at_an_unsure_step_and_decodes_on_exactly() -> None:
    """``watch``: after a kept blended prefill, the first decode step below the margin has the
    KV rebuilt in full; what follows is full prefill's continuation of the tokens so far."""
    eng = _engine("qwen2")
    segs = _segments(seed=9, docs=3)  # plain reuse drifts from full prefill after token 1
    ids = list(build_prompt(None, segs).ids)
    eng.generate(segs, 2, recompute=0.0)  # documents stored
    plain = eng.generate(segs, 12, recompute=0.0)  # off by default
    assert plain.stats.documents["repaired_at"] is None
    drift = plain.token_ids
    assert drift[1:] != reference_greedy(eng.model, ids + drift[:1], len(drift) - 1)
    res = eng.generate(segs, 12, recompute=0.0, watch=1.0)  # every step is below 1.0
    doc = res.stats.documents
    assert doc is not None and doc["repaired_at"] == 1 and doc["watch"] == 1.0
    toks = res.token_ids
    assert toks[:1] == drift[:1]
    assert toks[1:] == reference_greedy(eng.model, ids + toks[:1], len(toks) - 1)
    full = eng.generate(segs, 6, recompute=1.0, watch=1.0)  # nothing reused: nothing to watch
    assert full.stats.documents["repaired_at"] is None
    with pytest.raises(InvalidInputError, match="watch"):
        eng.generate(segs, 2, watch=1.5)
    with pytest.raises(InvalidInputError, match="watch"):
        eng.generate(ids, 2, watch=0.1)
