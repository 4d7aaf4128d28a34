"""Deterministic chunk keys: a hash chain rooted in the namespace digest.

    key_{-1} = H(canonical JSON of the Namespace)          (the namespace digest)
    key_i    = H(key_{i-1} || u32le(tokens of chunk i))

``H`` is BLAKE2b with a 32-byte digest. Never Python ``hash()`` (salted per process), never
pickle: the same tokens give the same keys in any process, on any machine, after any restart.
The last chunk may be partial (fewer than ``chunk_size`` tokens); its key differs from any full
chunk's because the hashed byte string is shorter, so short prompts get a reusable key too.
The replica router uses these very functions, so its prefix keys equal the store's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NewType

import numpy as np

__all__ = [
    "LAYOUT_VERSION",
    "ChunkKey",
    "Namespace",
    "NamespaceDigest",
    "chunk_key",
    "chunk_keys",
    "chunk_spans",
    "logits_key",
]

ChunkKey = NewType("ChunkKey", bytes)
"""32-byte BLAKE2b digest naming one chunk *and its whole prefix*; not a hash of the chunk alone."""

NamespaceDigest = NewType("NamespaceDigest", bytes)
"""32-byte digest of a :class:`Namespace`; the root of every key chain in that namespace."""

LAYOUT_VERSION = 1
"""Bump when the meaning of stored KV bytes changes (tensor layout, RoPE handling)."""

_DIGEST_SIZE = 32


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two KV chunks to be interchangeable."""

    model: str  # model fingerprint (architecture + weights digest)
    tokenizer: str  # tokenizer fingerprint ("" when the engine has no tokenizer)
    dtype: str  # KV dtype as computed, e.g. "float32", "bfloat16"
    codec: str  # codec name with its parameters, e.g. "int4:g32"
    tenant: str  # tenant salt digest (security.NO_TENANT_DIGEST for public data)
    adapter: str = ""  # LoRA/adapter fingerprint, "" for none
    layout: int = LAYOUT_VERSION

    def canonical_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode("utf-8")

    @property
    def digest(self) -> NamespaceDigest:
        return NamespaceDigest(hashlib.blake2b(self.canonical_json(), digest_size=_DIGEST_SIZE).digest())


def chunk_key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> ChunkKey:
    """Key of one chunk given its parent key (the namespace digest for the first chunk)."""
    arr = np.asarray(tokens, dtype="<u4")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(arr.tobytes())
    return ChunkKey(h.digest())


def chunk_spans(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` token spans of the chunks of a prompt; the last may be partial."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


def chunk_keys(
    namespace: NamespaceDigest | bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_size: int,
    *,
    include_partial: bool = True,
) -> list[ChunkKey]:
    """Keys of every chunk of ``tokens`` in order (the partial tail last, unless excluded)."""
    arr = np.asarray(tokens, dtype="<u4")
    keys: list[ChunkKey] = []
    parent: bytes = bytes(namespace)
    for start, end in chunk_spans(len(arr), chunk_size):
        if end - start < chunk_size and not include_partial:
            break
        parent = chunk_key(parent, arr[start:end])
        keys.append(ChunkKey(parent))
    return keys


_LOGITS_TAG = b"semcomm.logits/1"


def logits_key(prompt_key: bytes) -> ChunkKey:
    """Key of the last-position logits stored beside a prompt whose final chunk is ``prompt_key``.

    Derived from the chain key, so it names the whole prompt in its namespace (tenant included)
    and can never equal a chunk key (a chunk key hashes a parent key and u32 token ids).
    """
    return ChunkKey(hashlib.blake2b(_LOGITS_TAG + bytes(prompt_key), digest_size=_DIGEST_SIZE).digest())
