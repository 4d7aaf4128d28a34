"""Isolation conformance: every store and every router, two tenants.

For each KV store (memory, disk, sealed disk, sealed Redis, tiered over all three), each prefix
index the replica router can use (approximate, precise from store events) and each semantic entry
store: tenant B never hits what tenant A cached (zero cross-tenant hits) AND each tenant hits its
own entries (so the zero is not just caching being off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from semcomm.engine import HFEngine
from semcomm.kv import DiskStore, MemoryStore, RedisStore, TieredStore
from semcomm.routing import ReplicaRouter
from semcomm.security import ChunkSealer, TenantKeyring, TenantSalter

from ._semantic_helpers import bow_embed

SECRET = "isolation-test-secret-0123456789"
PROMPT = ("You are the billing assistant of Acme Corp. Internal note: the customer's card ends in "
          "4417 and the account is flagged for review. Question: why was I charged twice?")


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    from semcomm.reference import build_tiny_model

    return build_tiny_model()


@pytest.fixture
def salter() -> TenantSalter:
    return TenantSalter(SECRET)


def _sealer() -> ChunkSealer:
    return ChunkSealer(TenantKeyring(SECRET))


StoreFactory = Callable[[Path, str], Any]

STORES: dict[str, StoreFactory] = {
    "memory": lambda tmp, url: MemoryStore(),
    "disk": lambda tmp, url: DiskStore(tmp / "kv"),
    "disk-sealed": lambda tmp, url: DiskStore(tmp / "kv", sealer=_sealer()),
    "redis-sealed": lambda tmp, url: RedisStore(url, sealer=_sealer()),
    "tiered": lambda tmp, url: TieredStore([MemoryStore(), DiskStore(tmp / "kv", sealer=_sealer()),
                                            RedisStore(url, sealer=_sealer())]),
}


@pytest.fixture(params=sorted(STORES))
def store(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str) -> Iterator[Any]:
    s = STORES[request.param](tmp_path, redis_url)
    yield s
    close = getattr(s, "close", None)
    if close is not None:
        close()


def test_kv_store_two_tenants(store: Any, tiny: tuple[Any, Any], salter: TenantSalter) -> None:
    model, tok = tiny
    eng = {t: HFEngine(model, tok, store=store, chunk_size=16, tenant=t, salter=salter,
                       device="cpu") for t in ("acme", "globex")}
    first = eng["acme"].generate(PROMPT, max_new_tokens=2)
    assert first.stats.hit_tokens == 0
    again = eng["acme"].generate(PROMPT, max_new_tokens=2)
    assert again.stats.hit_tokens >= len(first.prompt_ids) - 16  # hits within a tenant
    assert again.token_ids == first.token_ids
    cross = eng["globex"].generate(PROMPT, max_new_tokens=2)
    assert cross.stats.hit_tokens == 0  # zero cross-tenant hits
    assert eng["globex"].cached_tokens(PROMPT) > 0  # ... and B now has its own copy
    assert eng["globex"].generate(PROMPT, max_new_tokens=2).stats.hit_tokens > 0
    # a tenantless (public) engine sees neither tenant's chunks
    public = HFEngine(model, tok, store=store, chunk_size=16, tenant=None, salter=salter,
                      device="cpu")
    assert public.cached_tokens(PROMPT) == 0


@pytest.mark.parametrize("index", ["approximate", "precise"])
def test_replica_router_two_tenants(index: str, tiny: tuple[Any, Any], salter: TenantSalter) -> None:
    """One router shared by tenants: affinity (a cache-membership oracle) never crosses tenants."""
    model, tok = tiny
    stores = [MemoryStore(), MemoryStore()]
    router = ReplicaRouter(2, index=index, chunk_size=16, policy="default")
    if index == "precise":
        for i, s in enumerate(stores):
            s.subscribe(router.subscriber(i))
    eng = {(t, r): HFEngine(model, tok, store=stores[r], chunk_size=16, tenant=t, salter=salter,
                            device="cpu") for t in ("acme", "globex") for r in (0, 1)}
    ids = eng[("acme", 0)].tokenize(PROMPT)

    def route(tenant: str) -> Any:
        keys = eng[(tenant, 0)].chunk_keys(ids)  # the tenant's own namespace
        d = router.route(keys=keys, num_tokens=len(ids))
        eng[(tenant, d.slot)].generate(ids, max_new_tokens=1)
        router.complete(d)
        return d

    a1 = route("acme")
    assert a1.matched_chunks == 0
    a2 = route("acme")
    assert a2.matched_chunks > 0 and a2.slot == a1.slot  # affinity within the tenant
    b1 = route("globex")
    assert b1.matched_chunks == 0  # no cross-tenant affinity
    b2 = route("globex")
    assert b2.matched_chunks > 0


SEMANTIC_STORES = ["memory", "sqlite", "redis"]


@pytest.fixture(params=SEMANTIC_STORES)
def semantic_cache(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str,
                   salter: TenantSalter) -> Iterator[Any]:
    from semcomm.semantic import SemanticCache

    store = {"memory": "memory", "sqlite": f"sqlite:///{tmp_path / 'sem.sqlite3'}",
             "redis": redis_url}[request.param]
    cache = SemanticCache(embedder=bow_embed, store=store, salter=salter)
    yield cache
    cache.close()


def test_semantic_cache_two_tenants(semantic_cache: Any) -> None:
    q = "why was my card charged twice this month"
    semantic_cache.store(q, "Acme internal: duplicate charge on card 4417", tenant="acme")
    hit = semantic_cache.lookup(q, tenant="acme")
    assert hit is not None and "4417" in hit.answer  # hits within a tenant
    assert semantic_cache.lookup(q, tenant="globex") is None  # zero cross-tenant hits
    assert semantic_cache.lookup(q) is None  # nor for the public (tenantless) scope
    semantic_cache.store(q, "Globex answer", tenant="globex")
    assert semantic_cache.lookup(q, tenant="globex").answer == "Globex answer"
    assert semantic_cache.lookup(q, tenant="acme").answer.endswith("4417")
