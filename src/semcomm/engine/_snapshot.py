"""KV snapshots: the KV of one prompt, exported by an engine and imported by another.

A snapshot is the prompt's token ids plus its chunks in the chunk format (each chunk carries
its namespace digest, key and checksum). Serialized layout (little-endian)::

    b"SCSN"  u32 header_len  header JSON  tokens (<u4 * num_tokens)  chunk bytes...  XXH3-128
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import CorruptEntryError

__all__ = ["KVSnapshot"]

_MAGIC = b"SCSN"
_PREFIX = struct.Struct("<4sI")
_VERSION = 1
_CHECKSUM = 16


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The KV of a prompt in one namespace; import it with ``HFEngine.import_snapshot``."""

    namespace: bytes  # 32-byte namespace digest of the engine that made it
    token_ids: tuple[int, ...]  # the prompt's tokens
    chunk_size: int  # chunking used for ``chunks``
    codec: str  # codec spec of the namespace
    chunks: tuple[bytes, ...]  # encoded chunks in order (the last may be partial)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def to_bytes(self) -> bytes:
        header = json.dumps(
            {
                "version": _VERSION,
                "namespace": self.namespace.hex(),
                "chunk_size": self.chunk_size,
                "codec": self.codec,
                "num_tokens": len(self.token_ids),
                "chunk_lens": [len(c) for c in self.chunks],
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        toks = np.asarray(self.token_ids, dtype="<u4").tobytes()
        body = b"".join([_PREFIX.pack(_MAGIC, len(header)), header, toks, *self.chunks])
        return body + xxhash.xxh3_128_digest(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVSnapshot:
        mv = memoryview(data)
        if len(mv) < _PREFIX.size + _CHECKSUM:
            raise CorruptEntryError("snapshot too short")
        if xxhash.xxh3_128_digest(mv[:-_CHECKSUM]) != bytes(mv[-_CHECKSUM:]):
            raise CorruptEntryError("snapshot failed its checksum")
        magic, hlen = _PREFIX.unpack_from(mv, 0)
        if magic != _MAGIC:
            raise CorruptEntryError(f"not a semcomm snapshot (magic {bytes(magic)!r})")
        try:
            h = json.loads(bytes(mv[_PREFIX.size : _PREFIX.size + hlen]))
            if h["version"] != _VERSION:
                raise CorruptEntryError(f"unsupported snapshot version {h['version']}")
            pos = _PREFIX.size + hlen
            n = int(h["num_tokens"])
            toks = np.frombuffer(mv[pos : pos + 4 * n], dtype="<u4")
            pos += 4 * n
            chunks = []
            for ln in h["chunk_lens"]:
                chunks.append(bytes(mv[pos : pos + int(ln)]))
                pos += int(ln)
            if pos != len(mv) - _CHECKSUM or len(toks) != n:
                raise CorruptEntryError("snapshot size mismatch")
            return cls(
                namespace=bytes.fromhex(h["namespace"]),
                token_ids=tuple(int(t) for t in toks),
                chunk_size=int(h["chunk_size"]),
                codec=str(h["codec"]),
                chunks=tuple(chunks),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptEntryError(f"unreadable snapshot header: {exc}") from None
