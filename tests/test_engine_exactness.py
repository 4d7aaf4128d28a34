"""Invariant 2 (exactness) and 3 (a whole hit restores the stored logits or recomputes the last
token) for every supported family."""

from __future__ import annotations

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.kv import MemoryStore

from ._engine_models import FAMILIES, prompt_ids, reference_greedy, tiny_model

CHUNK = 16
NEW = 8


@pytest.mark.parametrize("keep_logits", [True, False], ids=["logits", "recompute"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cold_warm_partial_equal_generate_without_cache(family: str, keep_logits: bool) -> None:
    model = tiny_model(family)
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                      keep_logits=keep_logits)
    ids = prompt_ids(45)
    ref = reference_greedy(model, ids, NEW)

    cold = engine.generate(ids, max_new_tokens=NEW)
    assert cold.token_ids == ref
    assert cold.stats.hit_tokens == 0
    assert cold.stats.chunks_stored == 3  # two full chunks + the 13-token tail

    warm = engine.generate(ids, max_new_tokens=NEW)
    assert warm.token_ids == ref
    assert warm.stats.hit_chunks == 3  # the partial tail hits too
    if keep_logits:  # the whole prompt and its stored last logits: no forward at all
        assert warm.stats.hit_tokens == 45 and warm.stats.recomputed_tokens == 0
    else:  # ... or the last token is recomputed
        assert warm.stats.hit_tokens == 44 and warm.stats.recomputed_tokens == 1
    assert warm.stats.logits_restored is keep_logits
    assert warm.stats.chunks_stored == 0

    ids2 = ids[:37] + prompt_ids(11, seed=7)  # shares two full chunks
    ref2 = reference_greedy(model, ids2, NEW)
    part = engine.generate(ids2, max_new_tokens=NEW)
    assert part.token_ids == ref2
    assert part.stats.hit_tokens == 32
    assert part.stats.recomputed_tokens == 16


def _stores(kind: str, tmp_path):  # type: ignore[no-untyped-def]
    from semcomm.kv import DiskStore, TieredStore

    if kind == "memory":
        return MemoryStore(), None
    if kind == "disk":
        return DiskStore(tmp_path / "kv"), lambda: DiskStore(tmp_path / "kv")
    return (
        TieredStore([MemoryStore(), DiskStore(tmp_path / "kv")]),
        lambda: TieredStore([MemoryStore(), DiskStore(tmp_path / "kv")]),
    )


@pytest.mark.parametrize("kind", ["memory", "disk", "tiered"])
def test_each_lossless_path_is_exact(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model("llama")
    store, reopen = _stores(kind, tmp_path)
    ids = prompt_ids(40, seed=3)
    ref = reference_greedy(model, ids, NEW)
    engine = HFEngine(model, store=store, chunk_size=CHUNK, device="cpu")
    assert engine.generate(ids, max_new_tokens=NEW).token_ids == ref
    warm = engine.generate(ids, max_new_tokens=NEW)
    assert warm.token_ids == ref and warm.stats.hit_tokens == 40
    assert warm.stats.bytes_loaded > 0
    if reopen is not None:  # a fresh store object over the same directory (restart)
        engine2 = HFEngine(model, store=reopen(), chunk_size=CHUNK, device="cpu")
        again = engine2.generate(ids, max_new_tokens=NEW)
        assert again.token_ids == ref
        assert again.stats.hit_tokens == 40 and again.stats.logits_restored
        assert set(again.stats.hit_tiers) == {"disk"}
        if kind == "tiered":  # promoted to memory on that hit
            assert set(engine2.generate(ids, max_new_tokens=NEW).stats.hit_tiers) == {"memory"}


def test_prefill_returns_full_cache_and_logits() -> None:
    model = tiny_model("qwen2")
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(30, seed=4)
    cold = engine.prefill(ids)
    warm = engine.prefill(ids)
    assert cold.cache.get_seq_length() == warm.cache.get_seq_length() == 30
    assert warm.stats.hit_tokens == 30 and cold.stats.chunks_stored == 2
    assert torch.equal(cold.last_logits, warm.last_logits)  # the stored logits, bit for bit
    assert int(warm.last_logits.argmax()) == reference_greedy(model, ids, 1)[0]
    for lc, lw in zip(cold.cache.layers, warm.cache.layers):
        assert lc.keys[:, :, :29].equal(lw.keys[:, :, :29])  # restored bits are the stored bits


def test_stream_yields_the_same_tokens() -> None:
    model = tiny_model("qwen2")
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(33, seed=5)
    ref = reference_greedy(model, ids, NEW)
    stream = engine.generate(ids, max_new_tokens=NEW, stream=True)
    got = list(stream)
    assert got == ref
    assert stream.result is not None and stream.result.token_ids == ref
    assert stream.result.stats.chunks_stored == 3


def test_sampling_is_seeded_and_respects_top_k() -> None:
    model = tiny_model("qwen2")
    engine = HFEngine(model, chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(20, seed=6)
    a = engine.generate(ids, max_new_tokens=12, temperature=1.5, seed=11)
    b = engine.generate(ids, max_new_tokens=12, temperature=1.5, seed=11)
    c = engine.generate(ids, max_new_tokens=12, temperature=1.5, seed=12)
    assert a.token_ids == b.token_ids != c.token_ids
    one = engine.generate(ids, max_new_tokens=12, temperature=1.5, top_k=1, seed=3)
    assert one.token_ids == reference_greedy(model, ids, 12)  # top-1 sampling is greedy


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "mistral_sw"])
def test_bfloat16_cold_equals_the_models_own_generate(family: str) -> None:
    """In bfloat16 the cold path runs the model's own kernels on the same shapes as
    ``model.generate`` with its default cache: the tokens are identical (the preallocated
    cache hands attention views, which the kernels read exactly as contiguous tensors)."""
    import torch

    model = tiny_model(family).to(torch.bfloat16)
    engine = HFEngine(model, chunk_size=CHUNK, device="cpu")
    assert engine.dtype == torch.bfloat16
    ids = prompt_ids(45, seed=11)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2 * NEW,
                             do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert engine.generate(ids, max_new_tokens=2 * NEW).token_ids == ref
