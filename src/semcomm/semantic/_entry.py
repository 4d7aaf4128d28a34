"""A cache entry and its self-describing, checksummed row form.

A row is three parts, stored side by side by every entry store:

- ``header``: canonical JSON (sorted keys, no spaces) with the format version, entry id,
  partition, stored query, model, tags, times, TTL, embedder name and vector dimension;
- ``vector``: ``dim`` little-endian float32 values;
- ``answer``: UTF-8 text (callers serialise structured answers to JSON themselves);

plus ``checksum`` = hex XXH3-128 over ``header || 0x00 || vector || 0x00 || answer``. A reader
rejects a row whose version is unknown, whose header does not parse or name its own id, whose
vector has the wrong size, or whose checksum does not match (:class:`CorruptEntryError`).
No pickle anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptEntryError

__all__ = ["ENTRY_FORMAT_VERSION", "Entry", "Row", "Slot", "decode_entry", "encode_entry"]

ENTRY_FORMAT_VERSION = 1


@dataclass(slots=True)
class Entry:
    """One stored answer. ``hits``/``last_hit``/``expires_at`` change on hits; the rest is
    write-once."""

    id: str  # hex digest of (partition, query); the same query in a partition overwrites
    partition: str  # hex digest of scope + tenant digest + model + context window
    query: str  # the query text as stored (for near-miss checks and verifiers)
    answer: str
    vector: np.ndarray  # (dim,) float32, unit norm
    model: str = ""
    scope: str = "default"  # the readable scope name
    tenant: str = "public"  # tenant salt digest (never the tenant id or the salt)
    tags: tuple[str, ...] = ()
    created_at: float = 0.0
    ttl_s: float | None = None
    expires_at: float | None = None
    hits: int = 0
    last_hit: float = 0.0
    embedder: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # JSON-able extras
    cluster: str = ""  # answer cluster (the id of its first entry); "" -> set when indexed
    trust: float = 1.0  # lowered when a served answer is contradicted (see SemanticCache.feedback)

    def nbytes(self) -> int:
        """Approximate footprint: vector + texts + fixed overhead."""
        return int(self.vector.nbytes + len(self.answer.encode()) + len(self.query.encode()) + 256)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True, slots=True)
class Row:
    """The stored form of an :class:`Entry`."""

    id: str
    header: str
    vector: bytes
    answer: str
    checksum: str


def _checksum(header: bytes, vector: bytes, answer: bytes) -> str:
    h = xxhash.xxh3_128()
    h.update(header)
    h.update(b"\x00")
    h.update(vector)
    h.update(b"\x00")
    h.update(answer)
    return h.hexdigest()


def encode_entry(e: Entry) -> Row:
    vec = np.ascontiguousarray(e.vector, dtype="<f4")
    header = json.dumps(
        {
            "v": ENTRY_FORMAT_VERSION,
            "id": e.id,
            "partition": e.partition,
            "query": e.query,
            "model": e.model,
            "scope": e.scope,
            "tenant": e.tenant,
            "tags": list(e.tags),
            "created_at": e.created_at,
            "ttl_s": e.ttl_s,
            "expires_at": e.expires_at,
            "hits": e.hits,
            "last_hit": e.last_hit,
            "embedder": e.embedder,
            "dim": int(vec.shape[0]),
            "metadata": e.metadata,
            # written only when set, so rows written before clusters existed stay byte-identical
            **({"cluster": e.cluster} if e.cluster else {}),
            **({"trust": e.trust} if e.trust != 1.0 else {}),
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    vb = vec.tobytes()
    return Row(e.id, header, vb, e.answer, _checksum(header.encode(), vb, e.answer.encode()))


def decode_entry(row: Row) -> Entry:
    """Validate and decode a row; raises :class:`CorruptEntryError` naming the problem."""
    try:
        hb = row.header.encode() if isinstance(row.header, str) else bytes(row.header)
        ab = row.answer.encode() if isinstance(row.answer, str) else bytes(row.answer)
    except (UnicodeError, TypeError) as exc:
        raise CorruptEntryError(f"entry {row.id!r}: unreadable text ({exc})") from None
    if _checksum(hb, bytes(row.vector), ab) != row.checksum:
        raise CorruptEntryError(f"entry {row.id!r}: checksum mismatch")
    try:
        h = json.loads(hb)
    except ValueError as exc:
        raise CorruptEntryError(f"entry {row.id!r}: header is not JSON ({exc})") from None
    if not isinstance(h, dict) or h.get("v") != ENTRY_FORMAT_VERSION:
        raise CorruptEntryError(f"entry {row.id!r}: unknown format version {h.get('v')!r}")
    if h.get("id") != row.id:
        raise CorruptEntryError(f"entry {row.id!r}: header names id {h.get('id')!r}")
    dim = int(h["dim"])
    if len(row.vector) != dim * 4:
        raise CorruptEntryError(f"entry {row.id!r}: vector has {len(row.vector)} bytes, "
                                f"header says dim {dim}")
    vec = np.frombuffer(bytes(row.vector), dtype="<f4").astype(np.float32)
    return Entry(
        id=h["id"], partition=h["partition"], query=h["query"], answer=ab.decode(),
        vector=vec, model=h["model"], scope=h["scope"], tenant=h["tenant"], tags=tuple(h["tags"]),
        created_at=h["created_at"], ttl_s=h["ttl_s"], expires_at=h["expires_at"],
        hits=h["hits"], last_hit=h["last_hit"], embedder=h["embedder"], metadata=h["metadata"],
        cluster=str(h.get("cluster", "")), trust=float(h.get("trust", 1.0)),
    )


@dataclass(slots=True)
class Slot:
    """In-process metadata for one indexed entry (mutated only under the cache lock)."""

    label: int
    partition: str
    query: str
    scope: str
    tenant: str
    model: str
    tags: frozenset[str]
    created_at: float
    expires_at: float | None
    ttl_s: float | None
    nbytes: int
    hits: int = 0
    last_access: float = 0.0
    cluster: str = ""  # answer cluster key (an entry id)
    answer_key: str = ""  # digest of the normalised answer text
    trust: float = 1.0
