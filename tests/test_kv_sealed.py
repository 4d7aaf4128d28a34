"""Stores with a sealer: chunks at rest are AES-GCM sealed; forged or altered ones never served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import xxhash

from semcomm.kv import DiskStore, RedisStore, read_header
from semcomm.security import ChunkSealer, TenantKeyring

from ._kvchunks import chain

SECRET = "s" * 32


def stored_path(store: DiskStore, key: bytes) -> Path:
    return store.path / key.hex()[:2] / f"{key.hex()}.sckv"


def reseal_checksum(data: bytes) -> bytes:
    """Fix the outer XXH3 after an edit, as a forger would (only the AEAD can notice)."""
    return data[:-16] + xxhash.xxh3_128_digest(data[:-16])


@pytest.fixture(params=["disk", "redis"])
def sealed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[object, object]]:
    sealer = ChunkSealer(TenantKeyring(SECRET))
    if request.param == "disk":
        store = DiskStore(tmp_path / "kv", sealer=sealer)
        yield store, None
    else:
        url = request.getfixturevalue("redis_url")
        store = RedisStore(url, sealer=sealer)
        client = redis.Redis.from_url(url)
        yield store, client
        client.close()
    store.close()


def raw_get(store: object, client: object, key: bytes) -> bytes:
    if isinstance(store, DiskStore):
        return stored_path(store, key).read_bytes()
    return client.get("semcomm:kv:" + key.hex())  # type: ignore[attr-defined,no-any-return]


def raw_set(store: object, client: object, key: bytes, data: bytes) -> None:
    if isinstance(store, DiskStore):
        stored_path(store, key).write_bytes(data)
    else:
        client.set("semcomm:kv:" + key.hex(), data)  # type: ignore[attr-defined]


def test_sealed_at_rest_plain_to_the_caller(sealed: tuple[object, object]) -> None:
    store, client = sealed
    (k, v), = chain(1)
    store.put(k, v)  # type: ignore[attr-defined]
    at_rest = raw_get(store, client, k)
    assert read_header(at_rest).meta.get("sealed") and at_rest[-200:] != v[-200:]
    assert store.get(k) == v  # type: ignore[attr-defined]


@pytest.mark.parametrize("attack", ["unsealed", "tampered", "swapped"])
def test_forged_or_altered_chunks_are_rejected(sealed: tuple[object, object], attack: str) -> None:
    store, client = sealed
    (k0, v0), (k1, v1) = chain(2)
    store.put(k0, v0)  # type: ignore[attr-defined]
    store.put(k1, v1)  # type: ignore[attr-defined]
    if attack == "unsealed":  # written without the server secret
        forged = v0
    elif attack == "tampered":
        b = bytearray(raw_get(store, client, k0))
        b[-40] ^= 1
        forged = reseal_checksum(bytes(b))
    else:  # chunk 1's sealed bytes, relabelled as chunk 0 in the (readable) header
        forged = raw_get(store, client, k1).replace(k1.hex().encode(), k0.hex().encode(), 1)
        forged = reseal_checksum(forged)
    raw_set(store, client, k0, forged)
    assert store.get(k0) is None  # type: ignore[attr-defined]
    st = store.stats()  # type: ignore[attr-defined]
    assert st.corrupt == 1
    assert not store.contains(k0)  # type: ignore[attr-defined]
    assert store.get(k1) == v1  # type: ignore[attr-defined]
