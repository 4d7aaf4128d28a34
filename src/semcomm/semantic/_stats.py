"""The semantic cache's counters (:class:`CacheStats`), shared by the cache and its parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CacheStats"]


@dataclass(slots=True)
class CacheStats:
    """Counters since this cache object was created (entries/bytes: current)."""

    entries: int = 0
    bytes: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    expired: int = 0
    guarded: int = 0  # candidates vetoed by the lexical guard
    verifications: int = 0
    verifier_rejections: int = 0  # hits refused by the verifier of a sensitive scope
    intent_rejected: int = 0  # cluster hits the intent check refused (semantic._intent)
    invalidated: int = 0
    distrusted: int = 0  # candidates skipped because a served answer of theirs was contradicted
    linked: int = 0  # stored entries that joined an existing answer cluster
    contradicted: int = 0  # feedback(correct=False) and shadow disagreements on would-be hits
    shadow_lookups: int = 0  # lookups answered by the model in shadow mode
    shadow_would_hit: int = 0  # of those, the ones the cache would have served
    corrupt: int = 0
    errors: int = 0  # backend errors (lookups degraded to misses)
    store: str = ""
    index: str = ""
    policy: str = ""
    max_entries: int | None = None
    max_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]
        d["hit_rate"] = self.hit_rate
        return d
