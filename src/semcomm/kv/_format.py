"""The self-describing chunk format: one chunk (all layers, keys and values) in one byte string.

Layout (little-endian)::

    b"SCKV"            4 bytes  magic
    header_len         u32      length of the header JSON
    header             JSON     canonical (sorted keys), UTF-8; see ChunkHeader
    payload            bytes    tensor blobs back to back, offsets in the header
    checksum           16 bytes XXH3-128 of everything before it

No pickle: tensors are raw little-endian arrays described by dtype strings and shapes.
A reader rejects (``CorruptEntryError``) any byte string whose magic, header, sizes or checksum
is wrong, and (``NamespaceMismatchError``) one from another namespace or key than expected.
bfloat16 has no numpy dtype; it travels as ``"bfloat16"`` over ``<u2`` storage bits.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptEntryError, NamespaceMismatchError

__all__ = [
    "FORMAT_VERSION",
    "Chunk",
    "ChunkHeader",
    "ChunkInfo",
    "TensorSpec",
    "decode_chunk",
    "encode_chunk",
    "read_header",
    "verify_chunk",
]

FORMAT_VERSION = 1
_MAGIC = b"SCKV"
_PREFIX = struct.Struct("<4sI")
_CHECKSUM_LEN = 16
_MAX_HEADER = 1 << 24  # 16 MiB: a header larger than this is corrupt, not big

# numpy dtype strings accepted in a chunk ("bfloat16" is stored as raw uint16 bits)
_DTYPES = {"<f4", "<f2", "<f8", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8", "bfloat16"}
_ITEMSIZE = {d: (2 if d == "bfloat16" else np.dtype(d).itemsize) for d in _DTYPES}
_NP_DTYPES = {d: np.dtype("<u2") if d == "bfloat16" else np.dtype(d) for d in _DTYPES}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor blob inside the payload."""

    name: str  # e.g. "k.3" (layer 3 keys), "v.3.scale"
    dtype: str  # one of _DTYPES
    shape: tuple[int, ...]
    offset: int  # byte offset inside the payload
    nbytes: int


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """Metadata of one chunk; everything needed to validate and decode it."""

    namespace: str  # hex namespace digest
    key: str  # hex chunk key
    parent: str | None  # hex parent key (None for the first chunk: its parent is the namespace)
    num_tokens: int  # tokens covered by this chunk
    start: int  # position of the chunk's first token in the prompt
    dtype: str  # KV dtype as computed by the model ("float32", "bfloat16", ...)
    codec: str  # codec name
    codec_params: dict[str, Any]
    tensors: tuple[TensorSpec, ...]
    payload_len: int
    format_version: int = FORMAT_VERSION
    meta: dict[str, Any] = field(default_factory=dict)  # free-form, e.g. layer count, writer id

    def to_json(self) -> bytes:
        d = {
            "format_version": self.format_version,
            "namespace": self.namespace,
            "key": self.key,
            "parent": self.parent,
            "num_tokens": self.num_tokens,
            "start": self.start,
            "dtype": self.dtype,
            "codec": self.codec,
            "codec_params": self.codec_params,
            "tensors": [
                [t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors
            ],
            "payload_len": self.payload_len,
            "meta": self.meta,
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> ChunkHeader:
        d = json.loads(raw)
        tensors = tuple(
            TensorSpec(name=str(n), dtype=str(dt), shape=tuple(int(s) for s in shp),
                       offset=int(off), nbytes=int(nb))
            for n, dt, shp, off, nb in d["tensors"]
        )
        return cls(
            namespace=str(d["namespace"]),
            key=str(d["key"]),
            parent=None if d["parent"] is None else str(d["parent"]),
            num_tokens=int(d["num_tokens"]),
            start=int(d["start"]),
            dtype=str(d["dtype"]),
            codec=str(d["codec"]),
            codec_params=dict(d["codec_params"]),
            tensors=tensors,
            payload_len=int(d["payload_len"]),
            format_version=int(d["format_version"]),
            meta=dict(d.get("meta", {})),
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """A decoded chunk: its header and zero-copy numpy views of its tensors."""

    header: ChunkHeader
    arrays: dict[str, np.ndarray]
    nbytes: int  # size of the encoded chunk


def _np_dtype(name: str) -> np.dtype:
    return np.dtype("<u2") if name == "bfloat16" else np.dtype(name)


def encode_chunk(
    *,
    namespace: bytes,
    key: bytes,
    parent: bytes | None,
    num_tokens: int,
    start: int,
    dtype: str,
    codec: str,
    codec_params: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    bf16_names: frozenset[str] = frozenset(),
    meta: Mapping[str, Any] | None = None,
) -> bytes:
    """Encode a chunk. ``arrays`` holds numpy arrays; names in ``bf16_names`` are uint16 bf16 bits."""
    specs: list[TensorSpec] = []
    blobs: list[bytes | memoryview] = []
    offset = 0
    for name, arr in arrays.items():
        # np.require keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d)
        arr = np.require(np.asarray(arr), requirements="C")
        dt = "bfloat16" if name in bf16_names else arr.dtype.newbyteorder("<").str
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if dt not in _DTYPES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {arr.dtype}")
        # a flat uint8 view: memoryview.cast refuses shapes with a zero (empty tensors)
        mv = arr.reshape(-1).view(np.uint8).data
        specs.append(TensorSpec(name, dt, tuple(arr.shape), offset, mv.nbytes))
        blobs.append(mv)
        offset += mv.nbytes
    header = ChunkHeader(
        namespace=bytes(namespace).hex(),
        key=bytes(key).hex(),
        parent=None if parent is None else bytes(parent).hex(),
        num_tokens=int(num_tokens),
        start=int(start),
        dtype=dtype,
        codec=codec,
        codec_params=dict(codec_params),
        tensors=tuple(specs),
        payload_len=offset,
        meta=dict(meta or {}),
    )
    hjson = header.to_json()
    out = bytearray(_PREFIX.size + len(hjson) + offset + _CHECKSUM_LEN)
    _PREFIX.pack_into(out, 0, _MAGIC, len(hjson))
    pos = _PREFIX.size
    out[pos : pos + len(hjson)] = hjson
    pos += len(hjson)
    for b in blobs:
        n = len(b)
        out[pos : pos + n] = b
        pos += n
    out[pos:] = xxhash.xxh3_128_digest(memoryview(out)[:pos])
    return bytes(out)


def _split(data: bytes | bytearray | memoryview) -> tuple[ChunkHeader, int]:
    mv = memoryview(data)
    return header_from_prefix(mv, len(mv))


def prefix_length(head: bytes | bytearray | memoryview) -> int:
    """Bytes before the payload (magic, length, header JSON), from the first 8 bytes of a chunk."""
    if len(head) < _PREFIX.size:
        raise CorruptEntryError(f"chunk too short ({len(head)} bytes)")
    magic, hlen = _PREFIX.unpack_from(head, 0)
    if magic != _MAGIC:
        raise CorruptEntryError(f"bad chunk magic {bytes(magic)!r}")
    if hlen > _MAX_HEADER:
        raise CorruptEntryError(f"bad chunk header length {hlen}")
    return int(_PREFIX.size + hlen)


def header_from_prefix(
    head: bytes | bytearray | memoryview, total_len: int
) -> tuple[ChunkHeader, int]:
    """Parse the header from the start of a chunk of ``total_len`` bytes (for scanning files).

    ``head`` must hold at least :func:`prefix_length` bytes. Returns the header and the payload
    offset. Checks sizes against ``total_len``; does not verify the checksum.
    """
    mv = memoryview(head)
    if total_len < _PREFIX.size + _CHECKSUM_LEN:
        raise CorruptEntryError(f"chunk too short ({total_len} bytes)")
    body = prefix_length(mv)
    if body + _CHECKSUM_LEN > total_len or body > len(mv):
        raise CorruptEntryError(f"bad chunk header length {body - _PREFIX.size}")
    try:
        header = ChunkHeader.from_json(bytes(mv[_PREFIX.size : body]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptEntryError(f"unreadable chunk header: {exc}") from None
    if header.format_version != FORMAT_VERSION:
        raise CorruptEntryError(f"unsupported chunk format version {header.format_version}")
    if body + header.payload_len + _CHECKSUM_LEN != total_len:
        raise CorruptEntryError(
            f"chunk size mismatch: header says {header.payload_len} payload bytes, "
            f"have {total_len - body - _CHECKSUM_LEN}"
        )
    return header, body


def read_header(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and sanity-check the header only (cheap; for scanning). Does not verify the checksum."""
    return _split(data)[0]


def decode_chunk(
    data: bytes | bytearray | memoryview,
    *,
    expect_key: bytes | None = None,
    expect_namespace: bytes | None = None,
    verify: bool = True,
) -> Chunk:
    """Validate and decode a chunk. Raises ``CorruptEntryError`` or ``NamespaceMismatchError``."""
    header, body = _split(data)
    if header.meta.get("sealed"):  # security.ChunkSealer: ciphertext must never decode as tensors
        raise CorruptEntryError(f"chunk {header.key[:16]} is sealed; open it with the store's sealer")
    mv = memoryview(data)
    end = len(mv) - _CHECKSUM_LEN
    if verify and xxhash.xxh3_128_digest(mv[:end]) != bytes(mv[end:]):
        raise CorruptEntryError(f"chunk {header.key[:16]} failed its checksum")
    if expect_key is not None and header.key != bytes(expect_key).hex():
        raise CorruptEntryError(
            f"chunk stored under key {bytes(expect_key).hex()[:16]} says it is {header.key[:16]}"
        )
    if expect_namespace is not None and header.namespace != bytes(expect_namespace).hex():
        raise NamespaceMismatchError(
            f"chunk belongs to namespace {header.namespace[:16]}, expected "
            f"{bytes(expect_namespace).hex()[:16]}"
        )
    arrays: dict[str, np.ndarray] = {}
    for t in header.tensors:
        dt = _NP_DTYPES.get(t.dtype)
        if (dt is None or t.offset < 0 or t.nbytes < 0
                or t.offset + t.nbytes > header.payload_len or min(t.shape, default=0) < 0):
            raise CorruptEntryError(f"bad tensor spec {t.name!r} in chunk {header.key[:16]}")
        count = math.prod(t.shape)
        if count * dt.itemsize != t.nbytes:
            raise CorruptEntryError(f"tensor {t.name!r} shape/size mismatch")
        # offset/count views of the whole buffer: no memoryview slice per tensor (zero copy)
        arrays[t.name] = np.frombuffer(mv, dtype=dt, count=count,
                                       offset=body + t.offset).reshape(t.shape)
    return Chunk(header=header, arrays=arrays, nbytes=len(mv))


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What a store needs to know about a verified chunk (see :func:`verify_chunk`)."""

    key: bytes  # the chunk's own key, from its header
    parent: bytes | None  # its parent key (None for a chain's first chunk)
    namespace: bytes  # its namespace digest
    nbytes: int  # encoded size


def _hex_field(d: Mapping[str, Any], name: str, *, optional: bool = False) -> bytes | None:
    v = d.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise CorruptEntryError(f"chunk header field {name!r} is missing or not a string")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise CorruptEntryError(f"chunk header field {name!r} is not hex") from None


def verify_chunk(
    data: bytes | bytearray | memoryview, *, expect_key: bytes | None = None
) -> ChunkInfo:
    """Check a chunk completely (framing, header, tensor table, checksum, key) without decoding.

    The stores' read and write path: as strict as :func:`decode_chunk` about what it accepts,
    but it builds no arrays (a 24-layer chunk has 48 tensors), so it costs about one checksum.
    Raises ``CorruptEntryError``.
    """
    mv = memoryview(data)
    total = len(mv)
    if total < _PREFIX.size + _CHECKSUM_LEN:
        raise CorruptEntryError(f"chunk too short ({total} bytes)")
    body = prefix_length(mv)
    if body + _CHECKSUM_LEN > total:
        raise CorruptEntryError(f"bad chunk header length {body - _PREFIX.size}")
    end = total - _CHECKSUM_LEN
    if xxhash.xxh3_128_digest(mv[:end]) != bytes(mv[end:]):
        raise CorruptEntryError("chunk failed its checksum")
    try:
        d = json.loads(bytes(mv[_PREFIX.size : body]))
    except ValueError as exc:
        raise CorruptEntryError(f"unreadable chunk header: {exc}") from None
    if not isinstance(d, dict):
        raise CorruptEntryError("chunk header is not a JSON object")
    if d.get("format_version") != FORMAT_VERSION:
        raise CorruptEntryError(f"unsupported chunk format version {d.get('format_version')!r}")
    payload_len = d.get("payload_len")
    if not isinstance(payload_len, int) or body + payload_len + _CHECKSUM_LEN != total:
        raise CorruptEntryError(f"chunk size mismatch: header says {payload_len!r} payload bytes, "
                                f"have {end - body}")
    tensors = d.get("tensors")
    if not isinstance(tensors, list):
        raise CorruptEntryError("chunk header has no tensor table")
    for t in tensors:
        # plain type checks instead of numpy calls: this loop runs for every tensor of every
        # chunk read from disk or Redis (48 for a 24-layer model)
        ok = type(t) is list and len(t) == 5
        if ok:
            _, dt, shape, off, nb = t
            isz = _ITEMSIZE.get(dt) if type(dt) is str else None
            ok = (isz is not None and type(shape) is list and type(off) is int
                  and type(nb) is int and off >= 0 and off + nb <= payload_len
                  and all(type(x) is int and x >= 0 for x in shape)
                  and math.prod(shape) * isz == nb)
        if not ok:
            raise CorruptEntryError(f"bad tensor spec {t!r}"[:200])
    key = _hex_field(d, "key")
    assert key is not None
    if expect_key is not None and key != bytes(expect_key):
        raise CorruptEntryError(
            f"chunk stored under key {bytes(expect_key).hex()[:16]} says it is {key.hex()[:16]}"
        )
    ns = _hex_field(d, "namespace")
    assert ns is not None
    return ChunkInfo(key=key, parent=_hex_field(d, "parent", optional=True), namespace=ns,
                     nbytes=total)
