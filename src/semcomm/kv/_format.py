"""The self-describing chunk format: one chunk (all layers, keys and values) in one byte string.

Layout (little-endian)::

    b"SCKV"            4 bytes  magic
    header_len         u32      length of the header
    header             bytes    format 2: binary (below); format 1: canonical JSON
    payload            bytes    tensor blobs back to back, offsets in the header
    checksum           16 bytes XXH3-128 of everything before it

Format 2 header (written by default)::

    u16 format_version (2), u16 flags (bit 0: has a parent), u32 num_tokens, u64 start,
    u64 payload_len, u8 len(namespace), u8 len(key), u8 len(parent), u8 len(dtype),
    u16 len(codec), u32 len(codec_params), u32 len(meta), u32 len(tensor table)
    namespace, key, parent (raw digests), dtype, codec (UTF-8),
    codec_params, meta (canonical JSON objects),
    tensor table: u32 count, then per tensor u16 len(name), u8 dtype code, u8 ndim, name,
                  ndim x u64 shape, u64 offset, u64 nbytes

Format 1 (the JSON header; still read, and written with ``encode_chunk(format_version=1)``)
begins its header with ``{``; format 2 and later begin with their u16 version, so a reader tells
them apart from the first header byte and refuses any other version by number. Chunks of one
model share one tensor table byte for byte, so a reader checks each distinct table once and
then only looks it up (``_TABLES``).

No pickle: tensors are raw little-endian arrays described by dtype strings and shapes.
A reader rejects (``CorruptEntryError``) any byte string whose magic, header, sizes or checksum
is wrong, and (``NamespaceMismatchError``) one from another namespace or key than expected.
bfloat16 has no numpy dtype; it travels as ``"bfloat16"`` over ``<u2`` storage bits.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptEntryError, NamespaceMismatchError

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_FORMAT_VERSIONS",
    "Chunk",
    "ChunkHeader",
    "ChunkInfo",
    "TensorSpec",
    "decode_chunk",
    "encode_chunk",
    "hand_over",
    "read_header",
    "tensor_arrays",
    "verify_chunk",
    "verify_put",
    "withdraw",
]

FORMAT_VERSION = 2
"""The chunk format ``encode_chunk`` writes by default."""

SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})
"""Formats every reader accepts; anything else is refused with its version number."""

_MAGIC = b"SCKV"
_PREFIX = struct.Struct("<4sI")
_CHECKSUM_LEN = 16
_MAX_HEADER = 1 << 24  # 16 MiB: a header larger than this is corrupt, not big
_JSON_OPEN = 0x7B  # "{": first header byte of format 1

# format 2 fixed header: version, flags, num_tokens, start, payload_len, len(namespace), len(key),
# len(parent), len(dtype), len(codec), len(codec_params), len(meta), len(tensor table)
_V2 = struct.Struct("<HHIQQBBBBHIII")
_V2_HAS_PARENT = 1
_V2_ENTRY = struct.Struct("<HBB")  # len(name), dtype code, ndim
_U32 = struct.Struct("<I")
_U64X2 = struct.Struct("<QQ")

# numpy dtype strings accepted in a chunk ("bfloat16" is stored as raw uint16 bits)
_DTYPES = {"<f4", "<f2", "<f8", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8", "bfloat16"}
_ITEMSIZE = {d: (2 if d == "bfloat16" else np.dtype(d).itemsize) for d in _DTYPES}
_NP_DTYPES = {d: np.dtype("<u2") if d == "bfloat16" else np.dtype(d) for d in _DTYPES}
# format 2 dtype codes (append only: a code's meaning never changes)
_DTYPE_CODES = ("<f4", "<f2", "<f8", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8", "bfloat16")
_CODE_OF = {d: i + 1 for i, d in enumerate(_DTYPE_CODES)}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor blob inside the payload."""

    name: str  # e.g. "k.3" (layer 3 keys), "v.3.scale"
    dtype: str  # one of _DTYPES
    shape: tuple[int, ...]
    offset: int  # byte offset inside the payload
    nbytes: int


def _canonical(d: Mapping[str, Any]) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    if raw == b"{}":
        return {}
    try:
        d = json.loads(raw)
    except ValueError as exc:
        raise CorruptEntryError(f"unreadable chunk {what}: {exc}") from None
    if not isinstance(d, dict):
        raise CorruptEntryError(f"chunk {what} is not a JSON object")
    return d


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
    format_version: int = FORMAT_VERSION  # the encoding of the header bytes (1: JSON, 2: binary)
    meta: dict[str, Any] = field(default_factory=dict)  # free-form, e.g. layer count, writer id

    def to_bytes(self) -> bytes:
        """The header as stored, in the encoding its ``format_version`` names."""
        if self.format_version == 1:
            return self._to_json_v1()
        if self.format_version == 2:
            return self._to_binary_v2()
        raise ValueError(f"cannot write chunk format version {self.format_version} "
                         f"(supported: {sorted(SUPPORTED_FORMAT_VERSIONS)})")

    def to_json(self) -> bytes:
        """Same as :meth:`to_bytes` (the name predates the binary format 2 header)."""
        return self.to_bytes()

    def _to_json_v1(self) -> bytes:
        return _canonical({
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
        })

    def _to_binary_v2(self) -> bytes:
        ns = bytes.fromhex(self.namespace)
        key = bytes.fromhex(self.key)
        parent = b"" if self.parent is None else bytes.fromhex(self.parent)
        dtype = self.dtype.encode("utf-8")
        codec = self.codec.encode("utf-8")
        params = _canonical(self.codec_params)
        meta = _canonical(self.meta)
        table = _encode_table(self.tensors)
        if max(len(ns), len(key), len(parent), len(dtype)) > 255 or len(codec) > 0xFFFF:
            raise ValueError("chunk header field too long for format 2")
        fixed = _V2.pack(2, _V2_HAS_PARENT if self.parent is not None else 0, self.num_tokens,
                         self.start, self.payload_len, len(ns), len(key), len(parent),
                         len(dtype), len(codec), len(params), len(meta), len(table))
        return b"".join((fixed, ns, key, parent, dtype, codec, params, meta, table))

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> ChunkHeader:
        """Parse header bytes of any supported format; ``CorruptEntryError`` if they are bad."""
        mv = memoryview(raw)
        if len(mv) and mv[0] == _JSON_OPEN:
            try:
                return cls._from_json_v1(bytes(mv))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptEntryError(f"unreadable chunk header: {exc}") from None
        p = _parse_v2(mv, 0, len(mv))
        return cls(
            namespace=p.namespace.hex(), key=p.key.hex(),
            parent=None if p.parent is None else p.parent.hex(), num_tokens=p.num_tokens,
            start=p.start, dtype=p.dtype, codec=p.codec, codec_params=p.codec_params,
            tensors=p.tensors, payload_len=p.payload_len, format_version=2, meta=p.meta,
        )

    @classmethod
    def from_json(cls, raw: bytes) -> ChunkHeader:
        """Same as :meth:`from_bytes` (kept for callers of the format 1 name)."""
        return cls.from_bytes(raw)

    @classmethod
    def _from_json_v1(cls, raw: bytes) -> ChunkHeader:
        d = json.loads(raw)
        if d["format_version"] != 1:  # a JSON header is format 1 whatever it claims
            raise CorruptEntryError(
                f"unsupported chunk format version {d['format_version']!r} in a JSON header")
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


# ---- format 2 tensor tables ---------------------------------------------------------------

def _encode_table(tensors: tuple[TensorSpec, ...] | list[TensorSpec]) -> bytes:
    parts = [_U32.pack(len(tensors))]
    for t in tensors:
        name = t.name.encode("utf-8")
        code = _CODE_OF.get(t.dtype)
        if code is None:
            raise ValueError(f"tensor {t.name!r} has unsupported dtype {t.dtype!r}")
        if len(name) > 0xFFFF or len(t.shape) > 255:
            raise ValueError(f"tensor {t.name!r}: name or rank too large for format 2")
        parts.append(_V2_ENTRY.pack(len(name), code, len(t.shape)))
        parts.append(name)
        parts.append(struct.pack(f"<{len(t.shape)}Q", *t.shape))
        parts.append(_U64X2.pack(t.offset, t.nbytes))
    return b"".join(parts)


def _parse_table(raw: bytes) -> tuple[tuple[TensorSpec, ...], int]:
    """Tensor specs of a format 2 table and the payload bytes they need (their largest end)."""
    n = len(raw)
    if n < 4:
        raise CorruptEntryError("truncated tensor table")
    (count,) = _U32.unpack_from(raw, 0)
    pos = 4
    specs: list[TensorSpec] = []
    need = 0
    try:
        for _ in range(count):
            name_len, code, ndim = _V2_ENTRY.unpack_from(raw, pos)
            pos += _V2_ENTRY.size
            name = raw[pos : pos + name_len].decode("utf-8")
            pos += name_len
            shape = struct.unpack_from(f"<{ndim}Q", raw, pos)
            pos += 8 * ndim
            off, nb = _U64X2.unpack_from(raw, pos)
            pos += _U64X2.size
            if not 1 <= code <= len(_DTYPE_CODES):
                raise CorruptEntryError(f"bad dtype code {code} for tensor {name!r}")
            dt = _DTYPE_CODES[code - 1]
            if math.prod(shape) * _ITEMSIZE[dt] != nb:
                raise CorruptEntryError(f"tensor {name!r} shape/size mismatch")
            specs.append(TensorSpec(name, dt, tuple(shape), off, nb))
            need = max(need, off + nb)
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptEntryError(f"truncated or garbled tensor table: {exc}") from None
    if pos != n:
        raise CorruptEntryError(f"tensor table has {n - pos} trailing bytes")
    return tuple(specs), need


class _TableCache:
    """Checked format 2 tensor tables by their exact bytes (all chunks of a model share one).

    Bounded: when full it starts over (a process sees a handful of distinct tables: one per
    model, codec and chunk length). Lookups are one dict access under no lock (CPython dicts
    are safe for concurrent get/set); the lock only orders clearing.
    """

    __slots__ = ("_lock", "_tables", "capacity")

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._tables: dict[bytes, tuple[tuple[TensorSpec, ...], int]] = {}
        self._lock = threading.Lock()

    def get(self, raw: bytes) -> tuple[tuple[TensorSpec, ...], int]:
        hit = self._tables.get(raw)
        if hit is not None:
            return hit
        parsed = _parse_table(raw)  # raises before anything is cached
        with self._lock:
            if len(self._tables) >= self.capacity:
                self._tables.clear()
            self._tables[raw] = parsed
        return parsed


_TABLES = _TableCache()


@dataclass(frozen=True, slots=True)
class _V2Header:
    namespace: bytes
    key: bytes
    parent: bytes | None
    num_tokens: int
    start: int
    dtype: str
    codec: str
    codec_params: dict[str, Any]
    meta: dict[str, Any]
    tensors: tuple[TensorSpec, ...]
    payload_len: int


def _parse_v2(mv: memoryview, start: int, end: int) -> _V2Header:
    """Parse the format 2 header in ``mv[start:end]`` (all of it, nothing more)."""
    if end - start < 2:
        raise CorruptEntryError("chunk header too short")
    (version,) = struct.unpack_from("<H", mv, start)
    if version != 2:
        raise CorruptEntryError(
            f"unsupported chunk format version {version} (this semcomm reads "
            f"{sorted(SUPPORTED_FORMAT_VERSIONS)})")
    if end - start < _V2.size:
        raise CorruptEntryError("chunk header too short")
    (_, flags, num_tokens, first, payload_len, ns_len, key_len, parent_len, dtype_len,
     codec_len, params_len, meta_len, table_len) = _V2.unpack_from(mv, start)
    pos = start + _V2.size
    if pos + ns_len + key_len + parent_len + dtype_len + codec_len + params_len + meta_len \
            + table_len != end:
        raise CorruptEntryError("chunk header field lengths do not add up")
    has_parent = bool(flags & _V2_HAS_PARENT)
    if flags & ~_V2_HAS_PARENT or (not has_parent and parent_len):
        raise CorruptEntryError(f"bad chunk header flags {flags:#x}")
    ns = bytes(mv[pos : pos + ns_len])
    pos += ns_len
    key = bytes(mv[pos : pos + key_len])
    pos += key_len
    parent = bytes(mv[pos : pos + parent_len]) if has_parent else None
    pos += parent_len
    try:
        dtype = str(mv[pos : pos + dtype_len], "utf-8")
        pos += dtype_len
        codec = str(mv[pos : pos + codec_len], "utf-8")
        pos += codec_len
    except UnicodeDecodeError:
        raise CorruptEntryError("chunk header dtype or codec is not UTF-8") from None
    params = _json_object(bytes(mv[pos : pos + params_len]), "codec parameters")
    pos += params_len
    meta = _json_object(bytes(mv[pos : pos + meta_len]), "header meta")
    pos += meta_len
    specs, need = _TABLES.get(bytes(mv[pos:end]))
    if need > payload_len:
        raise CorruptEntryError(
            f"tensor table needs {need} payload bytes, header says {payload_len}")
    return _V2Header(ns, key, parent, num_tokens, first, dtype, codec, params, meta, specs,
                     payload_len)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A decoded chunk: its header and zero-copy numpy views of its tensors."""

    header: ChunkHeader
    arrays: dict[str, np.ndarray]
    nbytes: int  # size of the encoded chunk


class _Handover:
    """Chunk byte strings whose checksum is known to match, by identity, until a store takes one.

    ``encode_chunk`` computes a chunk's checksum over the pieces of the ``bytes`` object it
    returns, and a ``bytes`` object cannot change afterwards, so a store's ``put`` handed that
    very object need not hash it a second time (:func:`verify_put`; 135 us of a 3 MiB put on a
    loaded core here). Invariants:

    * **Only verified, immutable objects.** Entries are exact ``bytes`` objects given by
      ``encode_chunk`` (which just computed their checksum) or by a store that has just verified
      them (``TieredStore`` passing one value to each tier). A copy, a ``bytearray`` or a
      ``memoryview`` is never in here, so equal bytes from anywhere else are hashed as before.
    * **Identity, held.** An entry holds the object itself, so its ``id`` cannot be reused by
      another object while it is here, and :meth:`take` compares with ``is``.
    * **One hand-over each.** :meth:`take` removes the entry: the first store to validate the
      object skips the hash, any later one hashes it (unless it is given again).
    * **Bounded.** At most ``max_items`` entries and ``max_bytes`` bytes, none older than
      ``ttl_s`` seconds (oldest dropped first, on every :meth:`give`): a chunk nobody stores is
      released soon, and one dropped is simply hashed by the store that gets it later.

    Reads never consult it: every read verifies the checksum of the bytes it read.
    """

    __slots__ = ("_bytes", "_items", "_lock", "max_bytes", "max_items", "ttl_s")

    def __init__(self, max_items: int = 256, max_bytes: int = 256 << 20,
                 ttl_s: float = 2.0) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        # id(value) -> (value, when given), oldest first; guarded by _lock
        self._items: OrderedDict[int, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0  # total len() of the held values
        self._lock = threading.Lock()

    def give(self, value: bytes) -> None:
        """Hold ``value`` as verified (callers: see the class invariants)."""
        if type(value) is not bytes or len(value) > self.max_bytes:
            return
        now = time.monotonic()
        with self._lock:
            old = self._items.pop(id(value), None)
            if old is not None:
                self._bytes -= len(old[0])
            self._items[id(value)] = (value, now)
            self._bytes += len(value)
            self._expire(now)

    def _expire(self, now: float) -> None:
        """Drop the oldest entries beyond the bounds or the age limit (caller holds _lock)."""
        items = self._items
        while items and (len(items) > self.max_items or self._bytes > self.max_bytes
                         or now - next(iter(items.values()))[1] > self.ttl_s):
            _, (gone, _) = items.popitem(last=False)
            self._bytes -= len(gone)

    def take(self, value: object) -> bool:
        """True (and the entry removed) if ``value`` itself is held; entries past the age
        limit are released here too, so a busy store does not keep chunks nobody stored."""
        if type(value) is not bytes:
            return False
        with self._lock:
            self._expire(time.monotonic())
            entry = self._items.get(id(value))
            if entry is None or entry[0] is not value:
                return False
            del self._items[id(value)]
            self._bytes -= len(value)
            return True

    def withdraw(self, value: object) -> None:
        """Drop ``value`` if it is still held (nobody took it)."""
        self.take(value)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


_HANDOVER = _Handover()


def hand_over(value: bytes) -> None:
    """Mark ``value`` (a ``bytes`` object whose checksum was just verified) for the next ``put``.

    For stores passing one verified value on to other stores (``TieredStore``); ``encode_chunk``
    hands over what it returns by itself. Never call it for bytes that were not verified."""
    _HANDOVER.give(value)


def withdraw(value: object) -> None:
    """Undo :func:`hand_over` if no store took the value."""
    _HANDOVER.withdraw(value)


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
    format_version: int = FORMAT_VERSION,
) -> bytes:
    """Encode a chunk. ``arrays`` holds numpy arrays; names in ``bf16_names`` are uint16 bf16 bits.

    ``format_version=1`` writes the JSON header that semcomm releases before format 2 read
    (for a store shared with older readers).
    """
    if format_version not in SUPPORTED_FORMAT_VERSIONS:
        raise ValueError(f"cannot write chunk format version {format_version} "
                         f"(supported: {sorted(SUPPORTED_FORMAT_VERSIONS)})")
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
        format_version=format_version,
        meta=dict(meta or {}),
    )
    hbytes = header.to_bytes()
    prefix = _PREFIX.pack(_MAGIC, len(hbytes))
    # one copy of the tensors: the checksum streams over the pieces, join builds the result
    h = xxhash.xxh3_128(prefix)
    h.update(hbytes)
    for b in blobs:
        h.update(b)
    out = b"".join((prefix, hbytes, *blobs, h.digest()))
    _HANDOVER.give(out)  # its checksum is the one just computed: a store's put need not redo it
    return out


def _split(data: bytes | bytearray | memoryview) -> tuple[ChunkHeader, int]:
    mv = memoryview(data)
    return header_from_prefix(mv, len(mv))


def prefix_length(head: bytes | bytearray | memoryview) -> int:
    """Bytes before the payload (magic, length, header), from the first 8 bytes of a chunk."""
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
    header = ChunkHeader.from_bytes(mv[_PREFIX.size : body])
    if header.format_version not in SUPPORTED_FORMAT_VERSIONS:
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
    return Chunk(header=header, arrays=tensor_arrays(header, body, mv), nbytes=len(mv))


def tensor_arrays(header: ChunkHeader, body: int, data: bytes | bytearray | memoryview
                  ) -> dict[str, np.ndarray]:
    """Zero-copy views of the tensors ``header`` lists, in ``data`` (the chunk's bytes, its
    payload at offset ``body``). Checks each tensor's dtype, shape, size and place against the
    header; checks nothing else (the checksum is :func:`decode_chunk`'s)."""
    mv = memoryview(data)
    arrays: dict[str, np.ndarray] = {}
    for t in header.tensors:
        dt = _NP_DTYPES.get(t.dtype)
        if (dt is None or t.offset < 0 or t.nbytes < 0
                or t.offset + t.nbytes > header.payload_len or min(t.shape, default=0) < 0
                or body + t.offset + t.nbytes > len(mv)):
            raise CorruptEntryError(f"bad tensor spec {t.name!r} in chunk {header.key[:16]}")
        count = math.prod(t.shape)
        if count * dt.itemsize != t.nbytes:
            raise CorruptEntryError(f"tensor {t.name!r} shape/size mismatch")
        # offset/count views of the whole buffer: no memoryview slice per tensor (zero copy)
        arrays[t.name] = np.frombuffer(mv, dtype=dt, count=count,
                                       offset=body + t.offset).reshape(t.shape)
    return arrays


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
    return _verify(memoryview(data), expect_key, checksum=True)


def verify_put(value: bytes, *, expect_key: bytes | None = None) -> ChunkInfo:
    """:func:`verify_chunk` for a value handed to a store's ``put``.

    A value that is in the hand-over (:class:`_Handover`: the very ``bytes`` object
    ``encode_chunk`` returned, or one a store already verified) is taken out of it and checked
    like any other (framing, header, tensor table, sizes, key) except for the checksum, which
    was computed over these immutable bytes. Anything else, equal bytes in another object
    included, is checked completely. Raises ``CorruptEntryError``.
    """
    return _verify(memoryview(value), expect_key, checksum=not _HANDOVER.take(value))


def _verify(mv: memoryview, expect_key: bytes | None, *, checksum: bool) -> ChunkInfo:
    total = len(mv)
    if total < _PREFIX.size + _CHECKSUM_LEN:
        raise CorruptEntryError(f"chunk too short ({total} bytes)")
    body = prefix_length(mv)
    if body + _CHECKSUM_LEN > total:
        raise CorruptEntryError(f"bad chunk header length {body - _PREFIX.size}")
    end = total - _CHECKSUM_LEN
    if checksum and xxhash.xxh3_128_digest(mv[:end]) != bytes(mv[end:]):
        raise CorruptEntryError("chunk failed its checksum")
    if body > _PREFIX.size and mv[_PREFIX.size] == _JSON_OPEN:
        return _verify_v1(mv, body, total, expect_key)
    ns, key, parent, payload_len = _v2_ids(mv, _PREFIX.size, body)
    if body + payload_len + _CHECKSUM_LEN != total:
        raise CorruptEntryError(f"chunk size mismatch: header says {payload_len} payload "
                                f"bytes, have {end - body}")
    if expect_key is not None and key != bytes(expect_key):
        raise CorruptEntryError(
            f"chunk stored under key {bytes(expect_key).hex()[:16]} says it is {key.hex()[:16]}"
        )
    return ChunkInfo(key=key, parent=parent, namespace=ns, nbytes=total)


class _TailCache:
    """Payload bytes needed by each checked format 2 header tail (dtype, codec, parameters,
    meta and tensor table, with their lengths), by its exact bytes.

    Chunks of one model, codec and chunk length share their tail byte for byte, so a store's
    read path parses and checks a tail once (:func:`_parse_v2`) and afterwards only looks it
    up: no JSON, no string decoding per chunk. Bounded like :class:`_TableCache`.
    """

    __slots__ = ("_lock", "_tails", "capacity")

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._tails: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def get(self, tail: bytes) -> int | None:
        return self._tails.get(tail)

    def add(self, tail: bytes, need: int) -> None:
        with self._lock:
            if len(self._tails) >= self.capacity:
                self._tails.clear()
            self._tails[tail] = need


_TAILS = _TailCache()


def _v2_ids(mv: memoryview, start: int,
            end: int) -> tuple[bytes, bytes, bytes | None, int]:
    """(namespace, key, parent, payload_len) of the format 2 header in ``mv[start:end]``.

    Exactly as strict as :func:`_parse_v2` (a tail it has not seen is parsed by it), but a
    tail seen before costs one dictionary lookup.
    """
    if end - start < _V2.size:
        return _v2_slow(mv, start, end)
    (version, flags, _, _, payload_len, ns_len, key_len, parent_len, _, _, _, _,
     _) = _V2.unpack_from(mv, start)
    pos = start + _V2.size
    tail_at = pos + ns_len + key_len + parent_len
    if version != 2 or tail_at > end:
        return _v2_slow(mv, start, end)
    # the tail's lengths are part of the cache key: fixed-header bytes 26-41 (parent, dtype,
    # codec, parameter, meta and table lengths), so one tail cannot be split two ways
    tail = bytes(mv[start + _V2.size - 16 : start + _V2.size]) + bytes(mv[tail_at:end])
    need = _TAILS.get(tail)
    if need is None:
        return _v2_slow(mv, start, end, tail)
    has_parent = bool(flags & _V2_HAS_PARENT)
    if flags & ~_V2_HAS_PARENT or (not has_parent and parent_len):
        raise CorruptEntryError(f"bad chunk header flags {flags:#x}")
    if need > payload_len:
        raise CorruptEntryError(
            f"tensor table needs {need} payload bytes, header says {payload_len}")
    ns = bytes(mv[pos : pos + ns_len])
    pos += ns_len
    key = bytes(mv[pos : pos + key_len])
    pos += key_len
    parent = bytes(mv[pos : pos + parent_len]) if has_parent else None
    return ns, key, parent, payload_len


def _v2_slow(mv: memoryview, start: int, end: int,
             tail: bytes | None = None) -> tuple[bytes, bytes, bytes | None, int]:
    h = _parse_v2(mv, start, end)  # raises for anything wrong
    if tail is not None:
        _TAILS.add(tail, max((t.offset + t.nbytes for t in h.tensors), default=0))
    return h.namespace, h.key, h.parent, h.payload_len


def _verify_v1(mv: memoryview, body: int, total: int, expect_key: bytes | None) -> ChunkInfo:
    """The format 1 (JSON header) half of :func:`verify_chunk`; framing and checksum are done."""
    end = total - _CHECKSUM_LEN
    try:
        d = json.loads(bytes(mv[_PREFIX.size : body]))
    except ValueError as exc:
        raise CorruptEntryError(f"unreadable chunk header: {exc}") from None
    if not isinstance(d, dict):
        raise CorruptEntryError("chunk header is not a JSON object")
    if d.get("format_version") != 1:  # a JSON header is format 1 whatever it claims
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
