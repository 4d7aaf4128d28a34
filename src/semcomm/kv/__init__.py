"""KV prefix cache: chunk keys, the chunk format, codecs and stores (memory, disk, Redis, tiered).

This package knows nothing of transformers or HTTP: chunks are numpy arrays and bytes.
"""

from ._codecs import CODECS, CodecReport, EncodedKV, KVCodec, get_codec
from ._format import FORMAT_VERSION, Chunk, ChunkHeader, TensorSpec, decode_chunk, encode_chunk, read_header
from ._keys import LAYOUT_VERSION, ChunkKey, Namespace, NamespaceDigest, chunk_key, chunk_keys, chunk_spans
from ._disk import DiskStore
from ._memory import MemoryStore
from ._redis import RedisStore
from ._store import ChunkStore, Fetched, PrefixMatch, StoreEvent, StoreStats
from ._tiered import TieredStore

__all__ = [
    "CODECS",
    "CodecReport",
    "EncodedKV",
    "KVCodec",
    "get_codec",
    "FORMAT_VERSION",
    "LAYOUT_VERSION",
    "Chunk",
    "ChunkHeader",
    "ChunkKey",
    "ChunkStore",
    "DiskStore",
    "Fetched",
    "MemoryStore",
    "PrefixMatch",
    "RedisStore",
    "StoreEvent",
    "StoreStats",
    "TieredStore",
    "Namespace",
    "NamespaceDigest",
    "TensorSpec",
    "chunk_key",
    "chunk_keys",
    "chunk_spans",
    "decode_chunk",
    "encode_chunk",
    "read_header",
]
