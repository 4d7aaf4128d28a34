"""Semantic entries sealed at rest in SQLite and Redis: unreadable without the key, and tampered,
moved or forged rows are rejected, counted and removed (never served)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from semcomm.security import EntrySealer, TenantKeyring, TenantSalter
from semcomm.semantic import RedisEntryStore, SemanticCache, SQLiteEntryStore
from semcomm.semantic._entry import encode_entry

from ._semantic_helpers import bow_embed

SECRET = "at-rest-test-secret-0123456789ab"
Q = "what is the diagnosis of patient 0042"
A = "Patient 0042: asthma, prescribe inhaler"


def _store(kind: str, tmp: Path, url: str, secret: str = SECRET) -> Any:
    sealer = EntrySealer(TenantKeyring(secret))
    if kind == "sqlite":
        return SQLiteEntryStore(tmp / "sem.sqlite3", sealer=sealer)
    return RedisEntryStore(url, sealer=sealer)


@pytest.fixture(params=["sqlite", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cache(kind: str, tmp_path: Path, redis_url: str) -> Iterator[SemanticCache]:
    c = SemanticCache(embedder=bow_embed, store=_store(kind, tmp_path, redis_url),
                      salter=TenantSalter(SECRET))
    yield c
    c.close()


def _raw_rows(kind: str, tmp: Path, url: str) -> dict[str, dict[str, bytes]]:
    if kind == "sqlite":
        with sqlite3.connect(tmp / "sem.sqlite3") as db:
            return {r[0]: {"header": r[1].encode(), "answer": r[2].encode()}
                    for r in db.execute("SELECT id, header, answer FROM entries")}
    import redis

    r = redis.Redis.from_url(url)
    out = {}
    for k in r.keys("semcomm:sem:e:*"):
        h = r.hgetall(k)
        out[k.decode().rsplit(":", 1)[1]] = {"header": h[b"header"], "answer": h[b"answer"]}
    return out


def _overwrite(kind: str, tmp: Path, url: str, entry_id: str, row: Any) -> None:
    """Write a row straight into the backend (what an attacker with storage access does)."""
    if kind == "sqlite":
        with sqlite3.connect(tmp / "sem.sqlite3") as db:
            db.execute("INSERT OR REPLACE INTO entries(id, version, header, vector, answer, "
                       "checksum) VALUES (?, 1, ?, ?, ?, ?)",
                       (entry_id, row.header, row.vector, row.answer, row.checksum))
        return
    import redis

    redis.Redis.from_url(url).hset(f"semcomm:sem:e:{entry_id}", mapping={
        "header": row.header, "vector": row.vector, "answer": row.answer,
        "checksum": row.checksum})


def test_rows_are_unreadable_at_rest(cache: SemanticCache, kind: str, tmp_path: Path,
                                     redis_url: str) -> None:
    cache.store(Q, A, tenant="acme")
    hit = cache.lookup(Q, tenant="acme")
    assert hit is not None and hit.answer == A
    rows = _raw_rows(kind, tmp_path, redis_url)
    assert len(rows) == 1
    (row,) = rows.values()
    assert b"asthma" not in row["answer"] and b"0042" not in row["header"] + row["answer"]
    # another process with the same secret reads it; one with another secret cannot
    assert _store(kind, tmp_path, redis_url).get(hit.entry_id).answer == A
    other = _store(kind, tmp_path, redis_url, secret="z" * 32)
    assert other.get(hit.entry_id) is None and other.corrupt == 1


def test_tampered_moved_and_forged_rows_are_rejected(kind: str, tmp_path: Path,
                                                     redis_url: str) -> None:
    store = _store(kind, tmp_path, redis_url)
    vec = np.ones(64, dtype=np.float32) / 8.0
    from semcomm.semantic import Entry

    def entry(i: str, answer: str, tenant: str = "t" * 64) -> Entry:
        return Entry(id=i, partition="p" * 32, query=Q, answer=answer, vector=vec, tenant=tenant)

    store.put(entry("a1", A))
    store.put(entry("b1", "Globex answer", tenant="u" * 64))
    good_b = store.get("b1")
    assert good_b is not None
    # 1. move: tenant B's sealed row copied under tenant A's id, header patched to match
    sealed_b = EntrySealer(TenantKeyring(SECRET)).seal_entry(entry("b1", "Globex answer", "u" * 64))
    import dataclasses

    _overwrite(kind, tmp_path, redis_url, "a1", encode_entry(dataclasses.replace(
        sealed_b, id="a1", tenant="t" * 64)))
    # 2. forge: a plain (unsealed) poisoned answer, valid checksum, written without the secret
    _overwrite(kind, tmp_path, redis_url, "f1", encode_entry(entry("f1", "POISON: wire money")))
    assert store.get("a1") is None and store.get("f1") is None  # never served
    assert store.corrupt == 2
    assert store.get("b1").answer == "Globex answer"
    assert set(_raw_rows(kind, tmp_path, redis_url)) == {"b1"}  # bad rows removed


@pytest.mark.parametrize("seal", [True, False])
def test_server_seals_kv_at_rest_by_default(seal: bool, tmp_path: Path) -> None:
    from semcomm.server import load_config
    from semcomm.server._wiring import build_kv_store

    sections: dict[str, Any] = {"server": {"state_dir": str(tmp_path), "secret": SECRET},
                                "models": {"t": {"path": "tiny"}}}
    if not seal:
        sections["security"] = {"seal_at_rest": False}
    store, _ = build_kv_store(load_config(None, overrides=sections, defaults=False, environ={}))
    disk = next(t for t in store.tiers if t.name == "disk")
    assert (disk.sealer is not None) == seal


def test_rotation_through_config_keeps_old_chunks_readable(tmp_path: Path) -> None:
    from semcomm.kv import DiskStore
    from semcomm.security import ChunkSealer, keyring_from_config

    from .test_security_reliability import _chunk

    old, new = "old-secret-for-rotation-0001", "new-secret-for-rotation-0002"
    key, data = _chunk(7, 4096)
    DiskStore(tmp_path / "kv", sealer=ChunkSealer(keyring_from_config({"seal_secrets": [old]}))
              ).put(key, data)
    rotated = ChunkSealer(keyring_from_config({"seal_secrets": [old, new]}))
    store = DiskStore(tmp_path / "kv", sealer=rotated)
    assert store.get(key) == data  # sealed under version 1, still readable
    key2, data2 = _chunk(8, 4096)
    store.put(key2, data2)  # new writes use version 2
    raw2 = (tmp_path / "kv" / key2.hex()[:2] / f"{key2.hex()}.sckv").read_bytes()
    raw1 = (tmp_path / "kv" / key.hex()[:2] / f"{key.hex()}.sckv").read_bytes()
    assert not rotated.needs_reseal(raw2) and rotated.needs_reseal(raw1)
    retired = DiskStore(tmp_path / "kv", sealer=ChunkSealer(keyring_from_config(
        {"seal_secrets": [new]})))  # old secret dropped: old entries are rejected, new ones read
    assert retired.get(key2) == data2
    assert retired.get(key) is None and retired.stats().corrupt == 1
