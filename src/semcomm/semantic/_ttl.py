"""When a stored answer expires (:class:`Expiry`).

An entry stored with a TTL (``store(..., ttl=)`` or the cache's default ``ttl``) expires
``ttl`` seconds after it was stored, however often it is read; with ``refresh_on_hit`` every
hit restarts its TTL (the row is written back). An expired entry is never served: a lookup
that meets one unindexes it and deletes its row, and loads and syncs skip expired rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, InvalidInputError
from ._entry import Entry

if TYPE_CHECKING:
    from ._entry import Slot

__all__ = ["Expiry"]


class Expiry:
    """The cache's TTL rule: ``default`` seconds (None: entries live until evicted or
    invalidated) and ``refresh_on_hit``."""

    def __init__(self, default: float | None, refresh_on_hit: bool) -> None:
        if default is not None and default <= 0:
            raise ConfigError(f"ttl must be positive seconds or None, got {default!r}")
        self.default = default
        self.refresh_on_hit = refresh_on_hit

    def ttl_for(self, ttl: Any) -> float | None:
        """The TTL of a store call: its own ``ttl``, else the default (checked)."""
        ttl = self.default if ttl is None else ttl
        if ttl is not None and (not isinstance(ttl, (int, float)) or ttl <= 0):
            raise InvalidInputError(f"ttl must be positive seconds, got {ttl!r}")
        return ttl

    @staticmethod
    def expires_at(now: float, ttl: float | None) -> float | None:
        return None if ttl is None else now + ttl

    @staticmethod
    def slot_expired(s: Slot, now: float) -> bool:
        return s.expires_at is not None and now >= s.expires_at

    def on_hit(self, entry: Entry, s: Slot | None, now: float) -> bool:
        """A hit served ``entry`` (slot ``s``): with ``refresh_on_hit`` its TTL restarts.
        True when the row changed and must be written back."""
        if not (self.refresh_on_hit and entry.ttl_s is not None):
            return False
        entry.expires_at = now + float(entry.ttl_s)
        entry.hits += 1
        entry.last_hit = now
        if s is not None:
            s.expires_at = entry.expires_at
        return True
