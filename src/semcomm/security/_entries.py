"""Sealing of semantic-cache entries (SQLite rows, Redis hashes) at rest.

An entry's stored value is a sealed envelope of its JSON payload (answer, metadata). The scope is the
semantic scope string (which starts with the tenant salt digest) and the context is the entry id, so
an entry copied to another id, scope or tenant fails authentication. The entry's embedding may stay
in clear next to it for the in-process vector index; answers never do.
"""

from __future__ import annotations

import json
from typing import Any

from ._sealing import Opened, Sealer, SealStats, TenantKeyring

__all__ = ["EntrySealer"]


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
