"""Determinism across processes (invariant 1) and tenant isolation (invariant 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from semcomm.engine import HFEngine
from semcomm.kv import DiskStore, MemoryStore
from semcomm.security import TenantSalter

from ._engine_models import prompt_ids, reference_greedy, tiny_model

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 16

_WRITER = """
import json, sys
from semcomm.engine import HFEngine
from semcomm.kv import DiskStore
from tests._engine_models import prompt_ids, tiny_model
engine = HFEngine(tiny_model("qwen3"), store=DiskStore(sys.argv[1]), chunk_size=16, device="cpu")
ids = prompt_ids(50, seed=9)
r = engine.generate(ids, max_new_tokens=6)
print(json.dumps({"keys": [k.hex() for k in engine.chunk_keys(ids)], "tokens": r.token_ids,
                  "stored": r.stats.chunks_stored}))
"""


def test_disk_store_written_by_another_process_serves_exact_hits(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, str(tmp_path / "kv")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["stored"] == 4

    model = tiny_model("qwen3")
    engine = HFEngine(model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(50, seed=9)
    assert [k.hex() for k in engine.chunk_keys(ids)] == theirs["keys"]  # same keys, any process
    ours = engine.generate(ids, max_new_tokens=6)
    # the whole prompt, and the last logits the other process stored beside it
    assert ours.stats.hit_tokens == 50 and ours.stats.logits_restored
    assert ours.stats.chunks_stored == 0
    assert ours.token_ids == theirs["tokens"] == reference_greedy(model, ids, 6)


def test_tenants_never_share_and_same_tenant_hits() -> None:
    model = tiny_model("llama")
    store = MemoryStore()
    salter = TenantSalter(secret=b"k" * 32)
    ids = prompt_ids(40, seed=2)

    def engine(tenant: str | None) -> HFEngine:
        return HFEngine(model, store=store, chunk_size=CHUNK, tenant=tenant, salter=salter,
                        device="cpu")

    a = engine("acme")
    assert a.generate(ids, max_new_tokens=2).stats.chunks_stored == 3
    b = engine("globex")
    rb = b.generate(ids, max_new_tokens=2)
    assert rb.stats.hit_tokens == 0  # zero cross-tenant hits ...
    assert rb.stats.chunks_stored == 3  # ... and its own chunks under its own keys
    assert engine(None).generate(ids, max_new_tokens=2).stats.hit_tokens == 0  # public != tenant
    again = engine("acme").generate(ids, max_new_tokens=2)
    assert again.stats.hit_tokens == 40  # the same tenant does hit
    assert set(a.chunk_keys(ids)).isdisjoint(b.chunk_keys(ids))


def test_namespace_covers_model_codec_and_dtype() -> None:
    ids = prompt_ids(20)
    base = HFEngine(tiny_model("qwen2"), chunk_size=CHUNK, device="cpu")
    same = HFEngine(tiny_model("qwen2"), chunk_size=CHUNK, device="cpu")
    other_w = HFEngine(tiny_model("qwen2", seed=1), chunk_size=CHUNK, device="cpu")
    other_c = HFEngine(tiny_model("qwen2"), chunk_size=CHUNK, codec="int4", device="cpu")
    other_d = HFEngine(tiny_model("qwen2"), chunk_size=CHUNK, dtype="bfloat16", device="cpu")
    assert base.namespace_digest == same.namespace_digest
    digests = {e.namespace_digest for e in (base, other_w, other_c, other_d)}
    assert len(digests) == 4
    assert base.chunk_keys(ids) != other_c.chunk_keys(ids)


_REDIS_WRITER = """
import json, sys
from semcomm.engine import HFEngine
from semcomm.kv import RedisStore
from tests._engine_models import prompt_ids, tiny_model
engine = HFEngine(tiny_model("olmo2"), store=RedisStore(sys.argv[1]), chunk_size=16, device="cpu")
r = engine.generate(prompt_ids(45, seed=12), max_new_tokens=6)
print(json.dumps({"tokens": r.token_ids, "stored": r.stats.chunks_stored,
                  "hit": r.stats.hit_tokens}))
"""


@pytest.mark.redis
def test_two_processes_share_hits_through_redis(redis_url: str) -> None:
    from semcomm.kv import RedisStore

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _REDIS_WRITER, redis_url],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["stored"] == 3 and theirs["hit"] == 0

    model = tiny_model("olmo2")
    engine = HFEngine(model, store=RedisStore(redis_url), chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(45, seed=12)
    ours = engine.generate(ids, max_new_tokens=6)
    assert ours.stats.hit_tokens == 45 and set(ours.stats.hit_tiers) == {"redis"}
    assert ours.token_ids == theirs["tokens"] == reference_greedy(model, ids, 6)


@pytest.mark.redis
def test_redis_outage_turns_into_misses(own_redis) -> None:  # type: ignore[no-untyped-def]
    from semcomm.errors import BackendDownWarning
    from semcomm.kv import RedisStore

    model = tiny_model("qwen2")
    store = RedisStore(own_redis.url, timeout_s=0.2, retry_interval_s=5.0)
    engine = HFEngine(model, store=store, chunk_size=CHUNK, device="cpu")
    ids = prompt_ids(40, seed=13)
    ref = reference_greedy(model, ids, 4)
    assert engine.generate(ids, max_new_tokens=4).stats.chunks_stored == 3
    assert engine.generate(ids, max_new_tokens=4).stats.hit_tokens == 40
    own_redis.stop()
    with pytest.warns(BackendDownWarning):
        down = engine.generate(ids, max_new_tokens=4)
    assert down.token_ids == ref  # served, exactly, without the cache
    assert down.stats.hit_tokens == 0
