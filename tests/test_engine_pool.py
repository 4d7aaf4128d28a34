"""The engine's idle K/V buffer pool: reused buffers hold the last request's bytes, and nothing
of them may reach the next request's attention."""

from __future__ import annotations

import pytest

from semcomm.engine import HFEngine
from semcomm.errors import InvalidInputError
from semcomm.kv import MemoryStore

from ._engine_models import prompt_ids, reference_greedy, tiny_model

CHUNK = 16
NEW = 6


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # full layers; sliding-window layers
def test_reused_buffers_give_exact_output_for_every_kind_of_request(family: str) -> None:
    model = tiny_model(family)
    eng = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    assert eng.kv_pool is not None and eng.kv_pool.idle_bytes == 0
    long = prompt_ids(60, seed=21)
    eng.generate(long, max_new_tokens=NEW)
    assert eng.kv_pool.idle_bytes > 0  # handed back when the decode loop ended
    # cold (another prompt), whole hit, partial hit and a shorter cold prompt, each on the
    # previous request's dirty buffer
    cases = [prompt_ids(45, seed=22), prompt_ids(45, seed=22), long[:40] + prompt_ids(9, seed=23),
             prompt_ids(7, seed=24), long]
    for ids in cases:
        before = eng.kv_pool.reused
        out = eng.generate(ids, max_new_tokens=NEW)
        assert eng.kv_pool.reused == before + 1
        assert out.token_ids == reference_greedy(model, ids, NEW)


def test_a_buffer_is_never_handed_to_two_requests_and_the_pool_is_bounded() -> None:
    model = tiny_model("llama")
    eng = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu")
    pool = eng.kv_pool
    assert pool is not None
    ids = prompt_ids(40, seed=25)
    a = eng.prefill(ids)  # the caller owns a's cache: its buffer stays out of the pool
    eng.generate(ids, max_new_tokens=NEW)
    b = eng.prefill(ids)  # takes the buffer that generate gave back
    assert a.buffers is not None and b.buffers is not None
    assert a.buffers[0].data_ptr() != b.buffers[0].data_ptr()
    assert pool.idle_bytes == 0
    k, v = b.buffers
    small = HFEngine(model, store=None, chunk_size=CHUNK, device="cpu",
                     kv_pool_bytes=k.nbytes + v.nbytes - 1)
    small.generate(ids, max_new_tokens=NEW)
    assert small.kv_pool is not None and small.kv_pool.idle_bytes == 0  # too big to keep


def test_pool_off_and_bad_sizes() -> None:
    model = tiny_model("llama")
    off = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu", kv_pool_bytes=0)
    assert off.kv_pool is None
    ids = prompt_ids(20, seed=26)
    assert off.generate(ids, max_new_tokens=NEW).token_ids == reference_greedy(model, ids, NEW)
    for bad in (-1, 1.5, "big", True):
        with pytest.raises(InvalidInputError, match="kv_pool_bytes"):
            HFEngine(model, chunk_size=CHUNK, device="cpu", kv_pool_bytes=bad)


def test_dirty_buffer_bytes_do_not_leak_into_a_cold_request() -> None:
    """Fill the idle buffer with huge values: a cold prompt's output must not change."""
    model = tiny_model("qwen2")
    eng = HFEngine(model, store=None, chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(30, seed=27)
    ref = reference_greedy(model, ids, NEW)
    eng.generate(prompt_ids(50, seed=28), max_new_tokens=NEW)
    assert eng.kv_pool is not None
    for k, v in list(eng.kv_pool._idle.values()):
        k.fill_(1e4)
        v.fill_(float("nan"))
    out = eng.generate(ids, max_new_tokens=NEW)
    assert eng.kv_pool.reused == 1 and out.stats.hit_tokens == 0 and out.token_ids == ref
