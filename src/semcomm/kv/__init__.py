"""KV prefix cache: chunk keys, the chunk format, codecs and stores (memory, disk, Redis, tiered).

This package knows nothing of transformers or HTTP: chunks are numpy arrays and bytes.
The codecs (which need torch) load on first use, so worker processes that only move chunk
bytes (stores, routing) import this package without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._disk import DiskStore
from ._disk_io import ChunkPieces, staging_buffer
from ._format import (
    FORMAT_VERSION,
    Chunk,
    ChunkHeader,
    TensorSpec,
    decode_chunk,
    encode_chunk,
    read_header,
    tensor_arrays,
)
from ._keys import (
    LAYOUT_VERSION,
    ChunkKey,
    Namespace,
    NamespaceDigest,
    chunk_key,
    chunk_keys,
    chunk_spans,
    logits_key,
)
from ._memory import MemoryStore
from ._redis import RedisStore
from ._store import ChunkStore, ChunkStoreBase, Fetched, PrefixMatch, StoreEvent, StoreStats
from ._tiered import TieredStore

if TYPE_CHECKING:  # pragma: no cover
    from ._codecs import CODECS, CodecReport, EncodedKV, KVCodec, get_codec

_LAZY_CODECS = frozenset({"CODECS", "CodecReport", "EncodedKV", "KVCodec", "get_codec"})


def __getattr__(name: str) -> Any:
    if name in _LAZY_CODECS:
        value = getattr(importlib.import_module("._codecs", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "LAYOUT_VERSION",
    "Chunk",
    "ChunkHeader",
    "ChunkKey",
    "ChunkPieces",
    "ChunkStore",
    "ChunkStoreBase",
    "CodecReport",
    "DiskStore",
    "EncodedKV",
    "Fetched",
    "KVCodec",
    "MemoryStore",
    "Namespace",
    "NamespaceDigest",
    "PrefixMatch",
    "RedisStore",
    "StoreEvent",
    "StoreStats",
    "TensorSpec",
    "TieredStore",
    "chunk_key",
    "chunk_keys",
    "chunk_spans",
    "decode_chunk",
    "encode_chunk",
    "get_codec",
    "logits_key",
    "read_header",
    "staging_buffer",
    "tensor_arrays",
]
