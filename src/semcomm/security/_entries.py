"""Sealing of semantic-cache entries (SQLite rows, Redis hashes) at rest.

:meth:`EntrySealer.seal_entry` turns a ``semcomm.semantic`` entry into its at-rest form: the query
and the answer (the user's prompt and the model's reply) move into one AES-GCM envelope, stored
base64 in the ``answer`` field, the ``query`` field is emptied and ``metadata["sealed"]`` says so.
What stays in clear is what a store needs to index and expire entries without a key: id,
partition, tenant salt digest, model, scope, times, the embedding vector.

The scope of the data key is the entry's partition (a digest over scope, tenant salt digest, model
and context) prefixed by its tenant digest, so tenants never share a key. The associated data binds
id, partition, tenant, model, scope, embedder, tags, creation time and a digest of the vector: an
entry copied under another id or tenant, stripped of the tags that restrict its readers, or given
another vector (to make a poisoned answer match other questions), fails authentication. Hit
counters and expiry times change on reads and are not bound. :meth:`EntrySealer.open_entry` reverses it; a store given a sealer rejects
unsealed entries (written by someone without the server secret).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from typing import Any, TypeVar

import numpy as np

from ._sealing import Opened, SealedEntryError, Sealer, SealStats, TenantKeyring

__all__ = ["ENTRY_SEAL_ALG", "EntrySealer"]

ENTRY_SEAL_ALG = "aes-256-gcm/v1"
_META_KEY = "sealed"

E = TypeVar("E")


def _with(entry: E, **fields: Any) -> E:
    """A shallow copy of ``entry`` with ``fields`` replaced (cheaper than dataclasses.replace,
    which re-runs ``__init__``; this is on the load path of every sealed entry)."""
    out = copy.copy(entry)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


class EntrySealer:
    """Seals and opens semantic entries; failures raise ``SealedEntryError`` and are counted."""

    def __init__(self, keyring: TenantKeyring | None = None) -> None:
        self._sealer = Sealer(keyring, kind="semantic-entry")

    @property
    def keyring(self) -> TenantKeyring:
        return self._sealer.keyring

    def stats(self) -> SealStats:
        return self._sealer.stats()

    def seal(self, payload: bytes, *, scope: str, entry_id: str) -> bytes:
        """Seal raw entry bytes for ``scope``, bound to ``entry_id``."""
        return self._sealer.seal(payload, scope=scope, context=entry_id.encode("utf-8"))

    def open_ex(self, blob: bytes, *, scope: str, entry_id: str) -> Opened:
        return self._sealer.open_ex(blob, scope=scope, context=entry_id.encode("utf-8"))

    def open(self, blob: bytes, *, scope: str, entry_id: str) -> bytes:
        return self.open_ex(blob, scope=scope, entry_id=entry_id).plaintext

    def seal_json(self, obj: Any, *, scope: str, entry_id: str) -> bytes:
        """Seal a JSON-serialisable object (canonical JSON, UTF-8)."""
        raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
        return self.seal(raw, scope=scope, entry_id=entry_id)

    def open_json(self, blob: bytes, *, scope: str, entry_id: str) -> Any:
        return json.loads(self.open(blob, scope=scope, entry_id=entry_id))

    # -- whole entries (duck-typed on semcomm.semantic's Entry dataclass) -------------------
    @staticmethod
    def _binding(entry: Any) -> tuple[str, bytes]:
        vec = np.ascontiguousarray(entry.vector, dtype="<f4").tobytes()
        ctx = json.dumps(
            {"id": entry.id, "partition": entry.partition, "tenant": entry.tenant,
             "model": entry.model, "scope": entry.scope, "embedder": entry.embedder,
             "tags": sorted(entry.tags), "created_at": entry.created_at,
             "vector": hashlib.blake2b(vec, digest_size=32).hexdigest()},
            sort_keys=True, separators=(",", ":"),
        ).encode("utf-8")
        return f"{entry.tenant}/{entry.partition}", ctx

    @staticmethod
    def is_sealed_entry(entry: Any) -> bool:
        return isinstance(entry.metadata, dict) and entry.metadata.get(_META_KEY) == ENTRY_SEAL_ALG

    def seal_entry(self, entry: E) -> E:
        """The at-rest form of ``entry`` (a new object; ``entry`` is not changed)."""
        e: Any = entry
        if self.is_sealed_entry(e):
            raise ValueError(f"entry {e.id!r} is already sealed")
        scope, ctx = self._binding(e)
        payload = json.dumps({"q": e.query, "a": e.answer}, separators=(",", ":"),
                             ensure_ascii=False).encode("utf-8")
        blob = self._sealer.seal(payload, scope=scope, context=ctx)
        return _with(entry, query="", answer=base64.b64encode(blob).decode("ascii"),
                     metadata={**e.metadata, _META_KEY: ENTRY_SEAL_ALG})

    def open_entry(self, entry: E) -> E:
        """Authenticate and restore a sealed entry; :class:`SealedEntryError` (counted) if it
        was tampered with, moved, or never sealed."""
        e: Any = entry
        if not self.is_sealed_entry(e):
            self._sealer.count_rejection("unsealed")
            raise SealedEntryError(f"semantic entry {e.id!r} is not sealed but sealing is required")
        scope, ctx = self._binding(e)
        try:
            blob = base64.b64decode(e.answer.encode("ascii"), validate=True)
        except (ValueError, UnicodeError):
            self._sealer.count_rejection("malformed")
            raise SealedEntryError(f"semantic entry {e.id!r}: sealed answer is not base64") from None
        payload = json.loads(self._sealer.open(blob, scope=scope, context=ctx))
        meta = {k: v for k, v in e.metadata.items() if k != _META_KEY}
        return _with(entry, query=payload["q"], answer=payload["a"], metadata=meta)
