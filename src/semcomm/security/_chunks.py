"""Sealing of KV chunks at rest: the header stays readable, the payload is AES-GCM sealed.

A sealed chunk is still an ``SCKV`` container (see :mod:`semcomm.kv._format`), so a store can
rebuild its index with ``read_header`` without any key. What changes:

* ``header.meta["sealed"] = "aes-256-gcm/v1"`` and ``payload_len`` is the envelope's length;
* the payload is a :mod:`~semcomm.security._sealing` envelope of the plaintext tensor blobs, whose
  associated data is the sealed header's exact JSON bytes (namespace, key, parent, shapes, codec):
  a payload moved under another header, key or namespace fails authentication;
* the data key's scope is the chunk's namespace digest, which folds in the tenant salt digest, so
  each tenant (and each model/codec namespace) has its own key;
* the XXH3 checksum is recomputed over the sealed bytes (torn writes are still caught cheaply).

:meth:`ChunkSealer.open` returns the exact bytes ``encode_chunk`` produced, so everything downstream
(``decode_chunk``, the engine) is unchanged. A store given a sealer refuses unsealed chunks: they
could only have been written by someone without the server secret.
"""

from __future__ import annotations

import struct

import xxhash

from ..errors import CorruptEntryError
from ..kv import ChunkHeader, read_header
from ._sealing import Opened, SealedEntryError, Sealer, SealStats, TenantKeyring, envelope_version

__all__ = ["SEAL_ALG", "SEAL_META_KEY", "ChunkSealer"]

SEAL_META_KEY = "sealed"
SEAL_ALG = "aes-256-gcm/v1"

_PREFIX = struct.Struct("<4sI")  # magic, header_len (kv._format layout)
_MAGIC = b"SCKV"
_CHECKSUM_LEN = 16


def _build(header_json: bytes, *payload: bytes | memoryview) -> bytes:
    """An SCKV container: prefix, header, payload pieces, XXH3-128 of everything before it."""
    n = _PREFIX.size + len(header_json) + sum(len(p) for p in payload)
    out = bytearray(n + _CHECKSUM_LEN)
    _PREFIX.pack_into(out, 0, _MAGIC, len(header_json))
    pos = _PREFIX.size
    for piece in (header_json, *payload):
        out[pos : pos + len(piece)] = piece
        pos += len(piece)
    out[n:] = xxhash.xxh3_128_digest(memoryview(out)[:n])
    return bytes(out)


def _parts(data: bytes | bytearray | memoryview) -> tuple[ChunkHeader, bytes, memoryview]:
    """(header, raw header JSON, payload view) of a structurally valid chunk with a good checksum."""
    mv = memoryview(data)
    header = read_header(mv)  # CorruptEntryError on bad magic/sizes
    end = len(mv) - _CHECKSUM_LEN
    if xxhash.xxh3_128_digest(mv[:end]) != bytes(mv[end:]):
        raise CorruptEntryError(f"chunk {header.key[:16]} failed its checksum")
    hlen = _PREFIX.unpack_from(mv, 0)[1]
    raw = bytes(mv[_PREFIX.size : _PREFIX.size + hlen])
    return header, raw, mv[_PREFIX.size + hlen : end]


class ChunkSealer:
    """Seals and opens encoded KV chunks (a ``sealer=`` for DiskStore/RedisStore).

    ``seal(chunk_bytes) -> stored_bytes`` and ``open(stored_bytes) -> chunk_bytes``; failures raise
    :class:`SealedEntryError` (also a ``CorruptEntryError``) and are counted in :meth:`stats`.
    """

    def __init__(self, keyring: TenantKeyring | None = None) -> None:
        self._sealer = Sealer(keyring, kind="kv-chunk")

    @property
    def keyring(self) -> TenantKeyring:
        return self._sealer.keyring

    def stats(self) -> SealStats:
        return self._sealer.stats()

    @staticmethod
    def is_sealed(stored: bytes) -> bool:
        """Whether a (structurally valid) chunk's header says it is sealed."""
        return read_header(stored).meta.get(SEAL_META_KEY) == SEAL_ALG

    def seal(self, chunk: bytes) -> bytes:
        """Seal the payload of an ``encode_chunk`` byte string."""
        header, _raw, payload = _parts(chunk)
        if SEAL_META_KEY in header.meta:
            raise ValueError(f"chunk {header.key[:16]} is already sealed")
        sealed_len = len(payload) + 36  # ENVELOPE_OVERHEAD; known before encryption
        sealed_header = ChunkHeader(
            namespace=header.namespace, key=header.key, parent=header.parent,
            num_tokens=header.num_tokens, start=header.start, dtype=header.dtype,
            codec=header.codec, codec_params=header.codec_params, tensors=header.tensors,
            payload_len=sealed_len, format_version=header.format_version,
            meta={**header.meta, SEAL_META_KEY: SEAL_ALG},
        )
        hjson = sealed_header.to_json()
        parts = self._sealer.seal_parts(payload, scope=header.namespace, context=hjson)
        assert sum(len(p) for p in parts) == sealed_len
        return _build(hjson, *parts)

    def open_ex(self, stored: bytes) -> tuple[bytes, Opened]:
        """Authenticate a sealed chunk and return (plain chunk bytes, :class:`Opened` info)."""
        header, raw, envelope = _parts(stored)
        if header.meta.get(SEAL_META_KEY) != SEAL_ALG:
            self._sealer.count_rejection("unsealed")
            raise SealedEntryError(
                f"chunk {header.key[:16]} is not sealed but this store requires sealing "
                "(written without the server secret)"
            )
        opened = self._sealer.open_ex(envelope, scope=header.namespace, context=raw)
        meta = {k: v for k, v in header.meta.items() if k != SEAL_META_KEY}
        plain_header = ChunkHeader(
            namespace=header.namespace, key=header.key, parent=header.parent,
            num_tokens=header.num_tokens, start=header.start, dtype=header.dtype,
            codec=header.codec, codec_params=header.codec_params, tensors=header.tensors,
            payload_len=len(opened.plaintext), format_version=header.format_version, meta=meta,
        )
        return _build(plain_header.to_json(), opened.plaintext), opened

    def open(self, stored: bytes) -> bytes:
        """Authenticate a sealed chunk; returns the exact bytes ``encode_chunk`` produced."""
        return self.open_ex(stored)[0]

    def needs_reseal(self, stored: bytes) -> bool:
        """Whether a sealed chunk was sealed under an older key version (cheap, unauthenticated)."""
        try:
            _header, _raw, envelope = _parts(stored)
            return envelope_version(envelope) != self.keyring.current
        except (CorruptEntryError, SealedEntryError):
            return False
