"""Invariant 3: a whole-prompt hit restores the logits its prefill computed, or recomputes.

The logits entry sits beside the prompt's final chunk under ``kv.logits_key``; a whole hit with
it runs no forward and gives the cold run's logits bit for bit; without it (evicted, damaged,
another prompt's, turned off) the last token is recomputed and nothing wrong is served.
"""

from __future__ import annotations

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.errors import InvalidInputError
from semcomm.kv import DiskStore, MemoryStore, decode_chunk, encode_chunk, logits_key

from ._engine_models import prompt_ids, reference_greedy, tiny_model

CHUNK = 16
NEW = 8


def _engine(model, store, **kw):  # type: ignore[no-untyped-def]
    return HFEngine(model, store=store, chunk_size=CHUNK, device="cpu", **kw)


def test_whole_hit_restores_the_cold_logits_bit_for_bit() -> None:
    model = tiny_model("llama")
    store = MemoryStore()
    eng = _engine(model, store)
    ids = prompt_ids(40, seed=11)
    cold = eng.prefill(ids)
    assert not cold.stats.logits_restored and cold.stats.recomputed_tokens == 40
    key = logits_key(eng.chunk_keys(ids)[-1])
    assert store.contains(key)
    warm = eng.prefill(ids)
    assert warm.stats.logits_restored and warm.stats.recomputed_tokens == 0
    assert warm.stats.hit_tokens == 40 and warm.stats.prefill_ms < cold.stats.prefill_ms
    assert torch.equal(warm.last_logits, cold.last_logits)
    # the logits entry is one [vocab] float32 array in a self-describing chunk
    entry = decode_chunk(store.get(key), expect_key=key, expect_namespace=eng.namespace_digest)
    assert entry.header.codec == "logits" and entry.header.num_tokens == 0
    assert entry.arrays["logits"].shape == (eng.vocab_size,)
    assert entry.header.parent == eng.chunk_keys(ids)[-1].hex()


def test_a_prefix_of_a_stored_prompt_stores_its_own_logits_on_first_use() -> None:
    model = tiny_model("qwen2")
    eng = _engine(model, MemoryStore())
    ids = prompt_ids(40, seed=12)
    eng.generate(ids, max_new_tokens=1)
    head = ids[:32]  # its two chunks are stored, its logits are not
    ref = reference_greedy(model, head, NEW)
    first = eng.generate(head, max_new_tokens=NEW)
    # its last chunk is recomputed whole (as with the cache off), then its logits stored
    assert first.stats.recomputed_tokens == 16 and not first.stats.logits_restored
    second = eng.generate(head, max_new_tokens=NEW)
    assert second.stats.logits_restored and first.token_ids == second.token_ids == ref


def test_bfloat16_logits_are_stored_as_their_16_bits_and_restore_exactly() -> None:
    model = tiny_model("llama")
    store = MemoryStore()
    eng = _engine(model, store, dtype="bfloat16")
    ids = prompt_ids(33, seed=13)
    cold = eng.generate(ids, max_new_tokens=NEW)
    entry = decode_chunk(store.get(logits_key(eng.chunk_keys(ids)[-1])))
    assert entry.arrays["logits"].dtype.itemsize == 2
    warm = eng.generate(ids, max_new_tokens=NEW)
    # nothing recomputed: a bfloat16 whole hit equals the cold run token for token
    assert warm.stats.logits_restored and warm.token_ids == cold.token_ids


def test_after_a_restart_the_disk_tier_serves_the_logits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model("mistral")
    ids = prompt_ids(37, seed=14)
    ref = reference_greedy(model, ids, NEW)
    assert _engine(model, DiskStore(tmp_path / "kv")).generate(ids, max_new_tokens=NEW).token_ids == ref
    again = _engine(model, DiskStore(tmp_path / "kv")).generate(ids, max_new_tokens=NEW)
    assert again.stats.logits_restored and set(again.stats.hit_tiers) == {"disk"}
    assert again.token_ids == ref


def test_logits_stay_inside_the_tenant() -> None:
    model = tiny_model("llama")
    store = MemoryStore()
    ids = prompt_ids(32, seed=15)
    _engine(model, store, tenant="a").generate(ids, max_new_tokens=1)
    other = _engine(model, store, tenant="b").prefill(ids)
    assert other.stats.hit_tokens == 0 and not other.stats.logits_restored
    same = _engine(model, store, tenant="a").prefill(ids)
    assert same.stats.logits_restored


def test_unusable_logits_entry_means_recompute_not_a_wrong_token() -> None:
    model = tiny_model("llama")
    store = MemoryStore()
    eng = _engine(model, store)
    ids = prompt_ids(40, seed=16)
    ref = reference_greedy(model, ids, NEW)
    eng.generate(ids, max_new_tokens=1)
    final = eng.chunk_keys(ids)[-1]
    key = logits_key(final)
    # a well-formed entry under the right key that names another prompt as its parent, holding
    # logits that would pick a different first token
    wrong = torch.zeros(eng.vocab_size)
    wrong[(ref[0] + 1) % eng.vocab_size] = 100.0
    store.delete(key)
    store.put(key, encode_chunk(
        namespace=eng.namespace_digest, key=key, parent=eng.chunk_keys(ids)[0], num_tokens=0,
        start=len(ids), dtype="float32", codec="logits", codec_params={"bf16": []},
        arrays={"logits": wrong.numpy()},
    ))
    out = eng.generate(ids, max_new_tokens=NEW)
    assert not out.stats.logits_restored and out.stats.recomputed_tokens == 8
    assert out.token_ids == ref
    # evicted logits: recomputed, then stored again
    store.delete(key)
    again = eng.generate(ids, max_new_tokens=NEW)
    assert again.stats.recomputed_tokens == 8 and again.token_ids == ref
    assert eng.generate(ids, max_new_tokens=NEW).stats.logits_restored


def test_keep_logits_off_recomputes_and_stores_no_logits() -> None:
    model = tiny_model("llama")
    store = MemoryStore()
    eng = _engine(model, store, keep_logits=False)
    ids = prompt_ids(32, seed=17)
    eng.generate(ids, max_new_tokens=1)
    assert not store.contains(logits_key(eng.chunk_keys(ids)[-1]))
    warm = eng.prefill(ids)
    assert warm.stats.recomputed_tokens == 16 and not warm.stats.logits_restored
    with pytest.raises(InvalidInputError, match="keep_logits"):
        _engine(model, store, keep_logits="yes")
