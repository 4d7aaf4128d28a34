"""Bad input, unsupported models and snapshots: clear errors, stored data untouched."""

from __future__ import annotations

from typing import Any

import pytest
import transformers as T

from semcomm.engine import HFEngine, KVSnapshot
from semcomm.errors import (
    CodecError,
    CorruptEntryError,
    InvalidInputError,
    NamespaceMismatchError,
    UnsupportedModelError,
)
from semcomm.kv import MemoryStore
from semcomm.security import TenantSalter

from ._engine_models import assert_greedy_of, prompt_ids, tiny_model

CHUNK = 16
_SMALL: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 128}


def _contents(store: MemoryStore) -> dict[bytes, bytes | None]:
    return {k: store.get(k) for k in store.scan()}


@pytest.fixture
def warm_engine() -> tuple[HFEngine, MemoryStore, list[int]]:
    store = MemoryStore()
    engine = HFEngine(tiny_model("qwen2"), store=store, chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(40)
    engine.generate(ids, max_new_tokens=2)
    return engine, store, ids


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "empty"),
        ("", "empty"),
        ([5, 300, 7], "out of the vocabulary"),
        ([5, -1], "out of the vocabulary"),
        ([5, "x"], "integers"),
        (list(range(3, 250)) + [4] * 20, "maximum of 256 positions"),
        ("some text", "needs a tokenizer"),
        ([{"role": "user", "content": "hi"}], "tokenizer"),
        (3.5, "prompt must be"),
    ],
)
def test_bad_prompts_raise_and_leave_the_store_intact(
    warm_engine: tuple[HFEngine, MemoryStore, list[int]], prompt: Any, match: str
) -> None:
    engine, store, ids = warm_engine
    before = _contents(store)
    with pytest.raises(InvalidInputError, match=match):
        engine.generate(prompt, max_new_tokens=4)
    assert _contents(store) == before
    assert engine.generate(ids, max_new_tokens=2).stats.hit_tokens == 40  # still served


def test_prompt_plus_new_tokens_over_the_maximum(warm_engine: Any) -> None:
    engine, _, _ = warm_engine
    with pytest.raises(InvalidInputError, match="exceeds"):
        engine.generate(prompt_ids(250), max_new_tokens=10)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        engine.generate([5, 6], max_new_tokens=-1)


@pytest.mark.parametrize("spec", ["zstd", "int3", "int4:x9", "fp8:g32", "int4:gX"])
def test_unknown_or_bad_codec(spec: str) -> None:
    with pytest.raises(CodecError) as err:
        HFEngine(tiny_model("qwen2"), codec=spec, device="cpu")
    if spec in ("zstd", "int3"):
        assert "lossless" in str(err.value) and "int4" in str(err.value)  # names the known ones


@pytest.mark.parametrize(
    ("config", "why"),
    [
        # sliding-window layers are restored exactly (tests/test_engine_sliding.py); these not
        (lambda: T.Llama4TextConfig(**_SMALL, num_key_value_heads=2, head_dim=16,
                                    attention_chunk_size=8), "chunked_attention"),
        (lambda: T.MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2),
         "linear_attention"),
    ],
)
def test_unsupported_models_are_refused_with_the_reason(config: Any, why: str) -> None:
    model = T.AutoModelForCausalLM.from_config(config())
    with pytest.raises(UnsupportedModelError, match=why):
        HFEngine(model, store=MemoryStore(), device="cpu")


def test_snapshot_round_trip_continues_exactly() -> None:
    model = tiny_model("gpt2")
    a = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(50, seed=8)
    snap = a.snapshot(ids[:35])
    assert snap.num_tokens == 35 and len(snap.chunks) == 3
    data = snap.to_bytes()
    back = KVSnapshot.from_bytes(data)
    assert back == snap

    store_b = MemoryStore()
    b = HFEngine(model, store=store_b, chunk_size=CHUNK, device="cpu")
    r = b.generate(ids, max_new_tokens=6, snapshot=back)  # continue from the snapshot
    assert_greedy_of(model, ids, r.token_ids)
    assert r.stats.hit_tokens == 35 and set(r.stats.hit_tiers) == {"snapshot"}

    c = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    assert c.import_snapshot(data) == 3  # or import it into the store, then hit normally
    r2 = c.generate(ids[:35], max_new_tokens=6)
    # no stored logits: the last (partial) chunk is recomputed whole, as with the cache off
    assert r2.stats.hit_tokens == 32 and r2.token_ids == HFEngine(
        model, chunk_size=CHUNK, device="cpu").generate(ids[:35], max_new_tokens=6).token_ids

    d = HFEngine(model, store=MemoryStore(), chunk_size=8, device="cpu")  # other chunking
    assert d.import_snapshot(snap) == 5
    assert d.generate(ids[:35], max_new_tokens=1).stats.hit_tokens == 32


def test_snapshot_from_another_namespace_is_refused() -> None:
    model = tiny_model("qwen2")
    snap = HFEngine(model, chunk_size=CHUNK, device="cpu").snapshot(prompt_ids(20))
    salter = TenantSalter(secret=b"s" * 32)
    for other in (
        HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, codec="int8", device="cpu"),
        HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, tenant="t1", salter=salter,
                 device="cpu"),
        HFEngine(tiny_model("qwen2", seed=5), store=MemoryStore(), chunk_size=CHUNK, device="cpu"),
    ):
        with pytest.raises(NamespaceMismatchError):
            other.import_snapshot(snap)
        with pytest.raises(NamespaceMismatchError):
            other.generate(prompt_ids(20), max_new_tokens=1, snapshot=snap)
        assert other.store is not None and list(other.store.scan()) == []


def test_damaged_snapshot_is_refused() -> None:
    engine = HFEngine(tiny_model("qwen2"), store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    data = bytearray(engine.snapshot(prompt_ids(20)).to_bytes())
    data[len(data) // 2] ^= 0x40
    with pytest.raises(CorruptEntryError):
        KVSnapshot.from_bytes(bytes(data))
    with pytest.raises(CorruptEntryError):
        engine.import_snapshot(bytes(data[:-3]))
