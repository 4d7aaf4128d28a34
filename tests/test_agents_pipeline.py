"""Agents sharing text (engine/_agents.py) on a config-built Qwen2-shaped model with a byte
tokenizer and a chat template (random weights: the tests compare tokens and counts, never
float bits).

What could break and is checked: reuse at recompute 1.0 gives full prefill's tokens; a forced
fallback is full prefill; reused tokens are counted per agent and in the share; anchors are
used, placed at the new position as the model would compute them (layer 0) and evicted under
their budget; another tenant never sees them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from semcomm.cli._quickstart import _config_built_model
from semcomm.engine import (
    Agent,
    AgentPipeline,
    AnchorPool,
    BlendStats,
    Document,
    DocumentReuse,
    HFEngine,
    System,
    Text,
    User,
    build_prompt,
    extract_choice,
    extract_number,
)
from semcomm.engine import _cache_adapter as ca
from semcomm.errors import InvalidInputError
from semcomm.kv import MemoryStore

QUESTION = "Tom has 3 apples and buys 4 more. How many apples?"
SOLVERS = [Agent("a", "You solve.", "Answer:", 6), Agent("b", "You check.", "Check:", 6),
           Agent("c", "You teach.", "Teach:", 6)]
JUDGE = Agent("judge", "You judge.", "Best (1-3):", 3, judge=True)


@pytest.fixture(scope="module")
def parts() -> tuple[Any, Any]:
    model, tokenizer, _ = _config_built_model()
    return model, tokenizer


def _engine(parts: tuple[Any, Any], store: Any = "new", tenant: str | None = None,
            chunk: int = 512) -> HFEngine:
    model, tok = parts
    return HFEngine(model, tok, store=MemoryStore() if store == "new" else store,
                    chunk_size=chunk, device="cpu", tenant=tenant)


def _run(parts: tuple[Any, Any], reuse: bool, **kw: Any) -> Any:
    eng = _engine(parts) if reuse else _engine(parts, store=None)
    pipe = AgentPipeline(eng, SOLVERS, JUDGE, reuse=reuse, **kw)
    return pipe, pipe.run(QUESTION)


def test_recompute_one_gives_full_prefill_tokens(parts: tuple[Any, Any]) -> None:
    _, full = _run(parts, reuse=False)
    _, reuse = _run(parts, reuse=True, selector="full", recompute=1.0, gate="off",
                    judge_gate="off")
    assert [t.mode for t in reuse.turns] == ["full", "reuse", "reuse", "reuse"]
    assert [t.tokens for t in reuse.turns] == [t.tokens for t in full.turns]
    assert all(t.reused_tokens == 0 for t in reuse.turns)  # r = 1 keeps nothing reused
    assert full.pick is not None and reuse.pick == full.pick  # the judge's candidate number


def test_forced_fallback_is_full_prefill(parts: tuple[Any, Any]) -> None:
    _, full = _run(parts, reuse=False)
    _, forced = _run(parts, reuse=True, selector="concat", recompute=0.0, gate="always",
                     judge_gate="always")
    assert [t.mode for t in forced.turns] == ["full", "fallback", "fallback", "fallback"]
    assert all(t.gate_detail == {"forced": True} for t in forced.turns[1:])
    assert [t.tokens for t in forced.turns] == [t.tokens for t in full.turns]
    assert forced.reused_share == 0.0


def test_reused_tokens_are_counted(parts: tuple[Any, Any]) -> None:
    pipe, run = _run(parts, reuse=True, selector="concat", recompute=0.0, gate="off",
                     judge_gate="off", watch=0.0)
    tok = parts[1]
    q = Document(QUESTION)
    answers: list[Document] = []
    for i, turn in enumerate(run.turns):
        agent = (SOLVERS + [JUDGE])[i]
        prompt = build_prompt(tok, AgentPipeline.segments(agent, q, answers))
        assert turn.prompt_tokens == len(prompt.ids)
        # agent 1 has nothing to reuse; later ones reuse every shared token at r = 0
        assert turn.reused_tokens == (0 if i == 0 else prompt.document_tokens)
        assert turn.anchor_segments == (0 if i == 0 else len(prompt.spans))
        if not agent.judge:
            answers.append(Document(tokens=tuple(turn.tokens)))
    saved = sum(t.reused_tokens + t.prefix_hit_tokens for t in run.turns)
    assert run.reused_share == pytest.approx(saved / sum(t.prompt_tokens for t in run.turns))
    assert 0 < run.reused_share < 1
    assert pipe.pool.stats()["hits"] >= 1 + 2 + 3


def test_anchor_is_placed_as_the_model_computes_it(parts: tuple[Any, Any]) -> None:
    """Layer 0's KV depends only on token and position: an anchor captured at one position and
    placed at another equals the model's own KV there."""
    eng = _engine(parts)
    shared = DocumentReuse(eng, pool=AnchorPool())
    seg = eng.tokenizer("a shared answer of some length", add_special_tokens=False)["input_ids"]
    pre_a = eng.tokenizer("<|im_start|>user\nfirst context ", add_special_tokens=False)["input_ids"]
    pre_b = eng.tokenizer("<|im_start|>system\nanother, longer context\n",
                          add_special_tokens=False)["input_ids"]

    def kv(prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cache = ca.new_cache()
        with torch.no_grad():
            eng._runner.forward(torch.tensor([prefix + seg]), cache)
        return ca.stack_range(cache, len(prefix), len(prefix) + len(seg))

    k_a, v_a = kv(pre_a)
    assert shared.capture(seg, k_a, v_a, len(pre_a), "a")
    lay = shared.layout
    at = len(pre_b)
    bk = torch.zeros((lay.num_layers, lay.kv_heads, at + len(seg), lay.k_dim))
    bv = torch.zeros((lay.num_layers, lay.kv_heads, at + len(seg), lay.v_dim))
    stats = BlendStats()
    assert shared._place_anchor(seg, at, bk, bv, stats)
    assert stats.documents_anchored == 1 and stats.anchored_tokens == len(seg)
    placed = bk[:, :, at:]
    k_b, v_b = kv(pre_b)
    assert torch.allclose(placed[0], k_b[0], atol=1e-4)
    assert torch.allclose(bv[0, :, at:], v_b[0], atol=1e-5)
    assert not torch.allclose(k_a[0], k_b[0], atol=1e-3)  # the move was needed


def test_anchors_are_evicted_under_their_budget() -> None:
    t = torch.zeros((2, 2, 5, 3))
    one = 2 * t.numel() * t.element_size()  # keys + values
    pool = AnchorPool(budget_bytes=2 * one, per_segment=2)
    assert pool.put(b"x", t, t, 0, "a") and pool.put(b"y", t, t, 0, "b")
    assert pool.get(b"x") is not None  # x used: y is now the least recently used
    assert pool.put(b"z", t, t, 0, "c")
    assert pool.has(b"x") and pool.has(b"z") and not pool.has(b"y")
    assert pool.nbytes == 2 * one and pool.evictions == 1
    big = torch.zeros((2, 2, 50, 3))
    assert not pool.put(b"w", big, big, 0, "d")  # alone over the budget: nothing kept
    wide = AnchorPool(budget_bytes=10 * one, per_segment=2)
    for i in range(3):
        wide.put(b"s", t + i, t, i, str(i))
    got = wide.get(b"s")
    assert len(wide) == 2 and got is not None and got.source == "2"
    with pytest.raises(InvalidInputError):
        AnchorPool(budget_bytes=-1)


def test_pipeline_anchor_memory_stays_bounded(parts: tuple[Any, Any]) -> None:
    eng = _engine(parts)
    budget = 40_000
    pipe = AgentPipeline(eng, SOLVERS, JUDGE, pool=AnchorPool(budget), gate="off",
                         judge_gate="off")
    pipe.run(QUESTION)
    pipe.run("A train leaves at 3 and arrives at 5. How long is the trip?")
    st = pipe.pool.stats()
    assert st["bytes"] <= budget and st["evictions"] > 0 and st["anchors"] >= 1


def test_another_tenant_never_sees_the_anchors(parts: tuple[Any, Any]) -> None:
    store = MemoryStore()
    pool = AnchorPool()
    a = AgentPipeline(_engine(parts, store=store, tenant="alice"), SOLVERS, JUDGE, pool=pool,
                      gate="off", judge_gate="off")
    ra = a.run(QUESTION)
    assert sum(t.anchor_segments for t in ra.turns) > 0
    held = len(pool)
    b = AgentPipeline(_engine(parts, store=store, tenant="bob"), SOLVERS, JUDGE, pool=pool,
                      gate="off", judge_gate="off")
    tok = QUESTION  # the same text: the same tokens, another namespace
    qkey_a = a.shared.segment_key(a.engine.tokenizer(tok, add_special_tokens=False)["input_ids"])
    qkey_b = b.shared.segment_key(b.engine.tokenizer(tok, add_special_tokens=False)["input_ids"])
    assert qkey_a != qkey_b and pool.has(qkey_a) and not pool.has(qkey_b)
    first = b.run_agent(SOLVERS[0], Document(QUESTION), [])[0]
    assert first.mode == "full" and first.anchor_segments == 0  # nothing of alice's to reuse
    assert len(pool) >= held


def test_an_engine_with_anchors_reuses_them_and_never_stores_their_blend(
        parts: tuple[Any, Any]) -> None:
    """HFEngine(anchors=...): a prompt with nothing at hand is prefilled in full and keeps its
    document and its answer as anchors; the next prompt places both from them; a blend over
    anchors is never stored as the documents' blend (asked twice, it is blended twice)."""
    model, tok = parts
    pool = AnchorPool()
    eng = HFEngine(model, tok, store=MemoryStore(), chunk_size=512, device="cpu", anchors=pool)
    q = Document(QUESTION)
    first = eng.generate([System("You solve."), User("Problem:\n"), q, Text("\n\nAnswer:")], 6)
    d = first.stats.documents
    assert d["full_prefill"] and d["anchors_captured"] == 2 and len(pool) == 2
    answer = tuple(t for t in first.token_ids if t not in eng.eos_token_ids)
    segs = [System("You check."), User("Problem:\n"), q, Text("\n\nAnswer 1:\n"),
            Document(tokens=answer), Text("\n\nCheck:")]
    for _ in range(2):
        d = eng.generate(segs, 6, selector="concat").stats.documents
        assert d["documents_anchored"] == 2 and d["documents_hit"] == 0
        assert not d["blend_hit"] and not d["full_prefill"]
    # every token recomputed over the anchors: full prefill's tokens
    exact = eng.generate(segs, 6, selector="full")
    plain = _engine(parts, store=None).generate(list(exact.prompt_ids), 6)
    assert exact.stats.documents["documents_anchored"] == 2
    assert exact.token_ids == plain.token_ids
    # without a pool the same first prompt computes its document alone and stores it
    alone = _engine(parts).generate([System("You solve."), User("Problem:\n"), q,
                                     Text("\n\nAnswer:")], 6).stats.documents
    assert not alone["full_prefill"] and alone["documents_computed"] == 1
    assert alone["anchors_captured"] == 0


def test_answer_extraction() -> None:
    assert extract_number("so 3 + 4 = 7. The answer is 7.") == "7"
    assert extract_number("The answer is $1,250.00") == "1250"
    assert extract_number("no digits") is None
    assert extract_choice("The answer is C.", 4) == 2
    assert extract_choice("B. breathing mask", 4) == 1
    assert extract_choice("nothing", 4) is None


def test_bad_settings_are_refused(parts: tuple[Any, Any]) -> None:
    eng = _engine(parts)
    with pytest.raises(InvalidInputError):
        AgentPipeline(eng, SOLVERS, gate="sometimes")
    with pytest.raises(InvalidInputError):
        AgentPipeline(eng, SOLVERS, selector="magic")
    with pytest.raises(InvalidInputError):
        AgentPipeline(eng, [])


def test_without_anchors_segments_come_from_stored_documents(parts: tuple[Any, Any]) -> None:
    pipe, run = _run(parts, reuse=True, selector="concat", recompute=0.0, gate="off",
                     judge_gate="off", anchors=False)
    assert pipe.pool is None and all(t.anchor_segments == 0 for t in run.turns)
    # agent 1 ran in full and stored the question and its answer computed alone; every later
    # agent finds all its shared segments stored
    for i, t in enumerate(run.turns[1:], 1):
        assert t.mode == "reuse" and t.stored_segments == min(i, 3) + 1
        assert t.computed_segments == 0


def test_watch_rebuilds_the_kv_and_decodes_on_from_exact_kv(parts: tuple[Any, Any]) -> None:
    # plain reuse (r = 0) with watch = 1.0: every step is "unsure", so each reused solver's KV
    # is rebuilt in full right after its first token, and the rest of its answer is what full
    # prefill decodes after that token
    _, run = _run(parts, reuse=True, selector="concat", recompute=0.0, gate="off",
                  judge_gate="off", watch=1.0)
    ref = _engine(parts, store=None)
    tok = parts[1]
    q = Document(QUESTION)
    answers: list[Document] = []
    for i, (agent, turn) in enumerate(zip(SOLVERS, run.turns)):
        if i == 0:
            assert turn.mode == "full" and turn.repaired_at is None
        else:
            assert turn.mode == "reuse" and turn.repaired_at == 1
            assert turn.saved_tokens == 0  # its prompt ended up recomputed in full
            ids = list(build_prompt(tok, AgentPipeline.segments(agent, q, answers)).ids)
            rest = ref.generate(ids + turn.tokens[:1], len(turn.tokens) - 1, temperature=0.0)
            assert turn.tokens[1:] == rest.token_ids[:len(turn.tokens) - 1]
        answers.append(Document(tokens=tuple(turn.tokens)))
    # watch = 0 never rebuilds
    _, plain = _run(parts, reuse=True, selector="concat", recompute=0.0, gate="off",
                    judge_gate="off", watch=0.0)
    assert all(t.repaired_at is None for t in plain.turns)
    with pytest.raises(InvalidInputError):
        AgentPipeline(_engine(parts), SOLVERS, watch=1.5)


def test_the_judge_has_its_own_margin(parts: tuple[Any, Any]) -> None:
    # a judge margin above any possible margin makes the judge fall back; the solvers keep
    # their reuse (margin 0)
    _, run = _run(parts, reuse=True, selector="concat", recompute=0.0, gate="margin",
                  judge_gate="margin", margin=0.0, judge_margin=1.01)
    assert [t.mode for t in run.turns[1:-1]] == ["reuse", "reuse"]
    assert run.turns[-1].mode == "fallback"


# ----------------------------------------------------------------------- KVCOMM's offsets
def _exact_doc_kv(eng: HFEngine, prompt: Any, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    cache = ca.new_cache()
    with torch.no_grad():
        eng._runner.forward(torch.tensor([list(prompt.ids)]), cache)
    s, e = prompt.spans[i]
    return ca.stack_range(cache, s, e)


def test_a_learned_offset_turns_the_anchor_into_the_exact_kv(parts: tuple[Any, Any]) -> None:
    """One exact sample of a slot: its mean offset is exact minus anchor, so the same prompt
    placed again from the same anchor gets its exact KV back (at another position than the
    anchor's, keys in the position-0 frame both ways); without offsets it does not."""
    eng = _engine(parts)
    pool = AnchorPool()
    shared = DocumentReuse(eng, pool=pool, offsets=1, keep_blended=False)
    q = Document(QUESTION)
    a_segs = [System("You solve."), User("Problem:\n"), q, Text("\n\nAnswer:")]
    b_segs = [System("You are a longer, different role."), User("Problem:\n"), q,
              Text("\n\nCheck:")]
    first = shared.prefill(a_segs, selector="concat", store=False)
    assert first.stats.full_prefill and not first.stats.offset_warmup  # nothing at hand
    shared.capture_prompt(first.prompt, first.cache)  # the anchor, context: a's layout
    warm = shared.prefill(b_segs, selector="concat", store=False)
    assert warm.stats.full_prefill and warm.stats.offset_warmup  # b's slot has no sample
    learned = BlendStats()
    shared.capture_prompt(warm.prompt, warm.cache, stats=learned)
    assert learned.offsets_learned == 1 and pool.stats()["offsets"] == 1
    exact_k, exact_v = _exact_doc_kv(eng, warm.prompt)
    s, e = warm.prompt.spans[0]
    assert s != first.prompt.spans[0][0]  # placed at another position than computed
    again = shared.prefill(b_segs, selector="concat", store=False)
    st = again.stats
    assert not st.full_prefill and st.documents_anchored == 1 and st.offsets_applied == 1
    k, v = ca.stack_range(again.cache, s, e)
    assert torch.allclose(k, exact_k, atol=1e-4) and torch.allclose(v, exact_v, atol=1e-4)
    plain = DocumentReuse(eng, pool=AnchorPool(), keep_blended=False)  # a's anchor alone
    plain.capture_prompt(first.prompt, first.cache)
    off = plain.prefill(b_segs, selector="concat", store=False)
    assert off.stats.documents_anchored == 1 and off.stats.offsets_applied == 0
    k0, _ = ca.stack_range(off.cache, s, e)
    assert (k0 - exact_k).abs().max() > 10 * (k - exact_k).abs().max()


def test_pipeline_offsets_warm_up_then_apply(parts: tuple[Any, Any]) -> None:
    """Agents learn their slots' offsets on the first question (prefilled in full: warmup) and
    add them on the next one; offsets are held in the pool's budget."""
    eng = _engine(parts)
    pipe = AgentPipeline(eng, SOLVERS, JUDGE, pool=AnchorPool(), gate="off", judge_gate="off",
                         watch=0.0, offsets=1)
    one = pipe.run(QUESTION)
    assert [t.mode for t in one.turns] == ["full", "warmup", "warmup", "warmup"]
    assert all(t.offsets_learned >= 1 for t in one.turns[1:])
    assert one.reused_share == pytest.approx(
        sum(t.prefix_hit_tokens for t in one.turns) / one.prompt_tokens)
    two = pipe.run("A train leaves at 3 and arrives at 5. How long is the trip?")
    assert [t.mode for t in two.turns] == ["full", "reuse", "reuse", "reuse"]
    assert all(t.offsets_applied == t.anchor_segments > 0 for t in two.turns[1:])
    st = pipe.pool.stats()
    assert st["offsets"] >= 3 and st["bytes"] <= st["budget_bytes"]
    off = AgentPipeline(_engine(parts), SOLVERS, JUDGE, pool=AnchorPool(), gate="off",
                        judge_gate="off", watch=0.0)
    assert [t.mode for t in off.run(QUESTION).turns] == ["full", "reuse", "reuse", "reuse"]


def test_offsets_are_evicted_under_the_budget_and_bad_settings_refused(
        parts: tuple[Any, Any]) -> None:
    t = torch.ones((2, 2, 5, 3))
    pool = AnchorPool(budget_bytes=700)  # one offset of 5 positions: 500 bytes
    assert pool.learn(b"s1", t, t) and pool.offset_samples(b"s1") == 1
    assert pool.learn(b"s1", 3 * t, t)  # a second sample: the mean of the two
    assert pool.offset(b"s1", 5, min_samples=3) is None  # two samples only
    dk, dv, m = pool.offset(b"s1", 5)
    assert m == 5 and torch.allclose(dk, 2 * t) and torch.allclose(dv, t)
    assert not pool.learn(b"big", torch.ones((2, 2, 50, 3)), torch.ones((2, 2, 50, 3)))
    assert pool.learn(b"s2", t, t) and pool.offset_samples(b"s1") == 0  # s1 evicted
    assert pool.nbytes <= 700 and pool.evictions >= 1
    eng = _engine(parts)
    with pytest.raises(InvalidInputError, match="offsets"):
        DocumentReuse(eng, pool=AnchorPool(), offsets=-1)
    with pytest.raises(InvalidInputError, match="pool"):
        DocumentReuse(eng, offsets=1)
    # a slot is named under the engine's namespace: another tenant's layout key differs
    p = build_prompt(eng.tokenizer, [System("r"), Document(QUESTION)])
    other = DocumentReuse(_engine(parts, tenant="bob"), pool=AnchorPool(), offsets=1)
    assert DocumentReuse(eng, pool=AnchorPool(), offsets=1).layout_key(p) != other.layout_key(p)
