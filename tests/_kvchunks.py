"""Build small, real chunk chains for the store tests (encode_chunk on tiny numpy arrays)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from semcomm.kv import (
    FORMAT_VERSION,
    ChunkKey,
    ChunkStoreBase,
    Namespace,
    StoreStats,
    chunk_keys,
    encode_chunk,
)

NS = Namespace(model="test-model", tokenizer="", dtype="float32", codec="none", tenant="t0")


def chain(n: int, *, seed: int = 0, chunk_tokens: int = 4, payload: int = 64,
          ns: Namespace = NS, format_version: int = FORMAT_VERSION,
          ) -> list[tuple[ChunkKey, bytes]]:
    """``n`` consecutive chunks of one prompt: [(key, encoded bytes)], parents linked."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=n * chunk_tokens)
    keys = chunk_keys(ns.digest, tokens, chunk_tokens)
    out: list[tuple[ChunkKey, bytes]] = []
    parent: bytes | None = None
    for i, key in enumerate(keys):
        arrays = {"k.0": rng.standard_normal(payload // 2, dtype=np.float32),
                  "v.0": rng.standard_normal(payload // 2, dtype=np.float32)}
        value = encode_chunk(namespace=ns.digest, key=key, parent=parent,
                             num_tokens=chunk_tokens, start=i * chunk_tokens, dtype="float32",
                             codec="none", codec_params={}, arrays=arrays,
                             format_version=format_version)
        out.append((key, value))
        parent = key
    return out


def singles(n: int, *, seed: int = 0, payload: int = 64) -> list[tuple[ChunkKey, bytes]]:
    """``n`` unrelated first chunks (no parents) of equal size."""
    out = []
    for i in range(n):
        out.extend(chain(1, seed=seed * 100_003 + i, payload=payload))
    return out


class DictStore(ChunkStoreBase):
    """A store of one's own as the docs describe it: ``ChunkStoreBase`` and its six required
    methods over a dict, with no validation or verification of its own (so what its ``get``
    returns is whatever was last put there, or tampered with)."""

    name = "dict"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[ChunkKey, bytes] = {}

    def get(self, key: ChunkKey) -> bytes | None:
        return self.data.get(key)

    def put(self, key: ChunkKey, value: bytes) -> None:
        self.data[key] = value

    def contains(self, key: ChunkKey) -> bool:
        return key in self.data

    def delete(self, key: ChunkKey) -> bool:
        return self.data.pop(key, None) is not None

    def scan(self) -> Iterator[ChunkKey]:
        return iter(list(self.data))

    def stats(self) -> StoreStats:
        return StoreStats(name=self.name, entries=len(self.data),
                          bytes=sum(map(len, self.data.values())), capacity_bytes=None)


def tampered(value: bytes, at: int = -20) -> bytes:
    """``value`` with one payload bit flipped (the length, header and checksum kept)."""
    data = bytearray(value)
    data[at] ^= 0x40
    return bytes(data)
