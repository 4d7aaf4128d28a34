"""Invariant 2 (the cache never changes the answer) and 3 (a whole hit restores the stored logits
or recomputes the last chunk) for every supported family.

Greedy output with the cache on (cold, warm, partial hit, after a restart) is token for token
that of the same engine with the cache off; and it is the model's own greedy continuation, up
to near-ties that another kernel's float rounding may decide the other way
(``assert_greedy_of``). Bits are compared only where they hold by construction on any CPU: a
restored chunk is the chunk that was stored, restored logits are the logits that were stored.
"""

from __future__ import annotations

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.kv import MemoryStore

from ._engine_models import FAMILIES, assert_greedy_of, prompt_ids, tiny_model

CHUNK = 16
NEW = 8


def cache_off(model, ids: list[int], new: int = NEW, **kw) -> list[int]:  # type: ignore[no-untyped-def]
    """The same engine's greedy tokens with no store (nothing restored, nothing stored)."""
    return HFEngine(model, store=None, chunk_size=CHUNK, device="cpu", **kw).generate(
        ids, max_new_tokens=new).token_ids


@pytest.mark.parametrize("keep_logits", [True, False], ids=["logits", "recompute"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cold_warm_partial_equal_generate_without_cache(family: str, keep_logits: bool) -> None:
    model = tiny_model(family)
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                      keep_logits=keep_logits)
    ids = prompt_ids(45)
    ref = cache_off(model, ids, keep_logits=keep_logits)
    assert_greedy_of(model, ids, ref)

    cold = engine.generate(ids, max_new_tokens=NEW)
    assert cold.token_ids == ref
    assert cold.stats.hit_tokens == 0
    assert cold.stats.chunks_stored == 3  # two full chunks + the 13-token tail

    warm = engine.generate(ids, max_new_tokens=NEW)
    assert warm.token_ids == ref
    if keep_logits:  # the whole prompt and its stored last logits: no forward at all
        assert warm.stats.hit_tokens == 45 and warm.stats.recomputed_tokens == 0
        assert warm.stats.hit_chunks == 3  # the partial tail hits too
    else:  # ... or the last chunk is recomputed whole, as with the cache off
        assert warm.stats.hit_tokens == 32 and warm.stats.recomputed_tokens == 13
        assert warm.stats.hit_chunks == 2
    assert warm.stats.logits_restored is keep_logits
    assert warm.stats.chunks_stored == 0

    ids2 = ids[:37] + prompt_ids(11, seed=7)  # shares two full chunks
    ref2 = cache_off(model, ids2, keep_logits=keep_logits)
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
    ref = cache_off(model, ids)
    assert_greedy_of(model, ids, ref)
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
    assert_greedy_of(model, ids, [int(warm.last_logits.argmax())])
    for lc, lw in zip(cold.cache.layers, warm.cache.layers):
        assert lc.keys[:, :, :29].equal(lw.keys[:, :, :29])  # restored bits are the stored bits


def test_stream_yields_the_same_tokens() -> None:
    model = tiny_model("qwen2")
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(33, seed=5)
    ref = cache_off(model, ids)
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
    assert one.token_ids == engine.generate(ids, max_new_tokens=12).token_ids  # top-1: greedy


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "mistral_sw"])
def test_half_precision_cache_on_equals_cache_off(family: str, dtype: str) -> None:
    """``dtype=`` casts the model; the cache still never changes the answer, and the tokens are
    the cast model's own greedy continuation within that precision's rounding."""
    model = tiny_model(family)
    store = MemoryStore()
    engine = HFEngine(model, store=store, chunk_size=CHUNK, device="cpu", dtype=dtype)
    assert engine.dtype == getattr(torch, dtype) and engine.namespace.dtype == dtype
    ids = prompt_ids(45, seed=11)
    ref = cache_off(engine.model, ids, 2 * NEW)
    assert_greedy_of(engine.model, ids, ref, tol=0.05)
    for _ in range(2):  # cold, then warm
        assert engine.generate(ids, max_new_tokens=2 * NEW).token_ids == ref
    assert engine.generate(ids, max_new_tokens=1).stats.hit_tokens == 45


def test_dtype_auto_follows_the_cpu_and_a_bad_dtype_is_refused() -> None:
    from semcomm.engine import resolve_dtype
    from semcomm.engine._options import cpu_flags
    from semcomm.errors import InvalidInputError

    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert resolve_dtype("auto") == (torch.bfloat16 if native else torch.float32)
    model = tiny_model("qwen2")
    with pytest.raises(InvalidInputError, match="dtype 'float8'"):
        HFEngine(model, dtype="float8")


def test_the_engine_leaves_the_users_model_as_it_was() -> None:
    """No attribute of semcomm's on the model or its modules, no hook, the weights untouched."""
    model = tiny_model("qwen2")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    names = {n: set(vars(m)) for n, m in model.named_modules()}
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    engine.generate(prompt_ids(40), max_new_tokens=4)
    assert {n: set(vars(m)) for n, m in model.named_modules()} == names
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_prefills_run_one_chunk_at_a_time_from_any_restored_prefix() -> None:
    """How invariant 2 holds on any CPU: every prefill forward ends at a chunk boundary, so a
    chunk's KV is computed from the same inputs with the same shapes whether the positions
    before it were restored or computed in the same call."""
    model = tiny_model("llama")
    seen: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(int(kw["input_ids"].shape[1])), with_kwargs=True)
    try:
        engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                          keep_logits=False)
        ids = prompt_ids(45)
        seen.clear()
        engine.generate(ids, max_new_tokens=1)
        assert seen == [16, 16, 13]  # cold: pieces at 16 and 32
        seen.clear()
        engine.generate(ids[:37] + prompt_ids(30, seed=7), max_new_tokens=1)
        assert seen == [16, 16, 3]  # two chunks restored; [32, 48), [48, 64), [64, 67)
    finally:
        hook.remove()



def test_a_tampered_chunk_on_disk_is_a_miss_on_the_engine_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A chunk file whose payload changed after it was written is refused when the engine
    reads it (the disk tier verifies every read): the prompt is recomputed from there and the
    answer is the one the cache-off engine gives."""
    from semcomm.kv import DiskStore

    model = tiny_model("llama")
    ids = prompt_ids(40, seed=13)
    ref = cache_off(model, ids)
    writer = HFEngine(model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, device="cpu")
    assert writer.generate(ids, max_new_tokens=NEW).token_ids == ref
    writer.store.close()
    files = sorted((tmp_path / "kv").rglob("*.sckv"))
    assert len(files) == 4  # three chunks and the prompt's logits
    for f in files:  # one payload byte flipped in each, the length kept
        data = bytearray(f.read_bytes())
        data[len(data) - 20] ^= 0x40
        f.write_bytes(bytes(data))
    reader = HFEngine(model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, device="cpu")
    out = reader.generate(ids, max_new_tokens=NEW)
    assert out.stats.hit_tokens == 0 and not out.stats.logits_restored
    assert out.token_ids == ref


def test_a_tampered_chunk_in_a_store_of_ones_own_is_a_miss_on_the_engine_path() -> None:
    """The engine decodes fetched chunks without hashing them again (stores serve verified
    bytes only): a store whose ``get`` does not verify is checked by ChunkStoreBase.fetch, so
    a chunk altered in it is a miss from there on, never restored."""
    from ._kvchunks import DictStore, tampered

    model = tiny_model("llama")
    ids = prompt_ids(40, seed=13)
    ref = cache_off(model, ids)
    store = DictStore()
    engine = HFEngine(model, store=store, chunk_size=CHUNK, device="cpu")
    assert engine.generate(ids, max_new_tokens=NEW).token_ids == ref
    keys = engine.chunk_keys(ids)
    assert len(keys) == 3 and len(store.data) == 4  # three chunks and the prompt's logits
    store.data[keys[1]] = tampered(store.data[keys[1]])
    out = engine.generate(ids, max_new_tokens=NEW)
    assert out.stats.hit_tokens == CHUNK and not out.stats.logits_restored  # chunk 0 only
    assert out.token_ids == ref


def test_a_prefix_is_fetched_with_one_batched_call_per_request() -> None:
    """The engine restores a prefix with one ``fetch_many`` (one round trip to Redis, one pass
    per tier), checks presence with one ``contains_many`` and writes with one ``put_many``."""
    calls: list[str] = []

    class Counting(MemoryStore):
        def fetch(self, key):  # type: ignore[no-untyped-def]
            calls.append("fetch")
            return super().fetch(key)

        def fetch_many(self, keys):  # type: ignore[no-untyped-def]
            calls.append("fetch_many")
            return [MemoryStore.fetch(self, k) for k in keys]

        def contains(self, key):  # type: ignore[no-untyped-def]
            calls.append("contains")
            return super().contains(key)

        def contains_many(self, keys):  # type: ignore[no-untyped-def]
            calls.append("contains_many")
            return [MemoryStore.contains(self, k) for k in keys]

    engine = HFEngine(tiny_model("qwen2"), store=Counting(), chunk_size=CHUNK, device="cpu",
                      keep_logits=False)
    ids = prompt_ids(70, seed=14)
    engine.generate(ids, max_new_tokens=1)
    calls.clear()
    out = engine.generate(ids[:64] + prompt_ids(20, seed=15), max_new_tokens=1)
    assert out.stats.hit_chunks == 4
    assert calls.count("fetch_many") == 1 and "fetch" not in calls
    assert "contains" not in calls
