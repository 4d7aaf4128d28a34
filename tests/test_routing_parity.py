"""The router's keys are exactly the KV store's chunk keys (namespace + chunk_keys, and a real engine)."""

from __future__ import annotations

import pytest

from semcomm.kv import MemoryStore, Namespace, chunk_keys, logits_key
from semcomm.routing import ReplicaRouter
from semcomm.security import NO_TENANT_DIGEST

from ._engine_models import prompt_ids, tiny_model


def _ns(tenant: str = NO_TENANT_DIGEST) -> Namespace:
    return Namespace(model="m", tokenizer="t", dtype="float32", codec="lossless", tenant=tenant)


@pytest.mark.parametrize("n_tokens", [1, 15, 16, 17, 100])
def test_router_keys_equal_store_keys(n_tokens: int) -> None:
    ns = _ns()
    router = ReplicaRouter(2, namespace=ns.digest, chunk_size=16)
    ids = list(range(3, 3 + n_tokens))
    assert router.keys_for(ids) == chunk_keys(ns.digest, ids, 16)  # partial tail included
    assert len(router.keys_for(ids)) == -(-n_tokens // 16)


def test_tenant_namespaces_never_share_router_matches() -> None:
    a, b = _ns("tenant-a-digest"), _ns("tenant-b-digest")
    ra = ReplicaRouter(2, policy="affinity", namespace=a.digest, chunk_size=16, index="approximate")
    ids = list(range(64))
    ra.route(ids)
    assert ra.route(ids).matched_chunks == 4  # same tenant: hit
    keys_b = chunk_keys(b.digest, ids, 16)
    assert ra.index.match(keys_b) == {}  # other tenant's keys: zero hits
    assert set(keys_b).isdisjoint(ra.keys_for(ids))


def test_precise_index_fed_by_a_real_engine_store() -> None:
    """An HFEngine writes chunks; the router, fed by the store's events, matches them all."""
    from semcomm.engine import HFEngine

    stores = [MemoryStore(), MemoryStore()]
    engines = [HFEngine(tiny_model("llama"), store=s, chunk_size=8, device="cpu") for s in stores]
    router = ReplicaRouter(
        ["r0", "r1"], policy="affinity", index="precise",
        namespace=engines[0].namespace_digest, chunk_size=engines[0].chunk_size,
    )
    assert engines[0].namespace_digest == engines[1].namespace_digest
    for name, store in zip(["r0", "r1"], stores, strict=True):
        store.subscribe(router.subscriber(name))
    ids = prompt_ids(37)
    engines[1].prefill(ids)
    chunks = set(engines[1].chunk_keys(ids))
    # the store holds the prompt's chunks and, beside the final one, its last logits
    assert set(stores[1].scan()) == chunks | {logits_key(engines[1].chunk_keys(ids)[-1])}
    assert set(router.keys_for(ids)) == chunks
    d = router.route(ids)
    assert d.replica == "r1" and d.matched_chunks == len(chunks) == 5
    assert d.cached_tokens == 36  # the router prices the last token as recomputed
    # a conversation that extends the prompt still lands on r1
    d2 = router.route(ids + prompt_ids(9, seed=5))
    assert d2.replica == "r1" and d2.matched_chunks == 4  # the partial tail chunk differs
    # eviction events remove the replica's match
    for k in list(stores[1].scan()):
        stores[1].delete(k)
    router.complete(d)
    router.complete(d2)
    assert router.route(ids).matched_chunks == 0
