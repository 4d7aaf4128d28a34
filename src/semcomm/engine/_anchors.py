"""Anchors: a shared segment's KV as some prompt computed it *in context*, bounded in bytes.

A document reused at another position is closer to what the new prompt needs when its KV was
computed in some prompt's context than when it was computed alone (KVCOMM, NeurIPS'25, keeps
such in-context copies as its anchors). Two kinds are kept (engine/_documents.py captures
them): every document of a prompt whose documents were all computed in context (prefilled in
full, a fallback of the confidence test, or ``r = 1``), and the answer a prompt with documents
generated (its own decode KV, keyed by its token ids, so a later prompt that carries the answer
as a document of the same tokens finds it).

Invariants: the pool holds at most ``budget_bytes`` of copies (least recently used evicted
first; one anchor larger than the budget is not kept) and at most ``per_segment`` anchors of
one segment (the oldest evicted first). A segment's key is the last link of its document key
chain, which roots at the engine's namespace digest (model, dtype, codec, **tenant**): another
tenant's engine computes other keys and never reads an anchor it did not make, even from a
shared pool. Thread-safe (the workers of one model share a pool).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = ["DEFAULT_ANCHOR_BUDGET", "Anchor", "AnchorPool"]

DEFAULT_ANCHOR_BUDGET = 256 << 20


@dataclass(slots=True)
class Anchor:
    """A segment's KV as computed in some prompt: ``k``/``v`` ``[L, H, n, D]``, keys as
    computed at positions ``start..start+n``. Written once, by :meth:`AnchorPool.put`."""

    key: bytes  # the segment's document key (tenant-bound)
    k: torch.Tensor
    v: torch.Tensor
    start: int  # the position of its first token where it was computed
    source: str  # who computed it (an agent's name, "prompt", "answer")

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class AnchorPool:
    """Anchors of shared segments, bounded (module docstring): at most ``budget_bytes`` in all
    and ``per_segment`` per segment."""

    def __init__(self, budget_bytes: int = DEFAULT_ANCHOR_BUDGET, per_segment: int = 4):
        if budget_bytes < 0 or per_segment < 1:
            raise InvalidInputError("an anchor pool takes budget_bytes >= 0 and per_segment >= 1")
        self.budget_bytes = int(budget_bytes)
        self.per_segment = int(per_segment)
        self._items: OrderedDict[tuple[bytes, int], Anchor] = OrderedDict()  # LRU order
        self._lock = threading.Lock()
        self._serial = 0
        self.nbytes = 0
        self.evictions = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def segments(self) -> int:
        with self._lock:
            return len({k for k, _ in self._items})

    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, start: int, source: str) -> bool:
        """Keep a copy; False when it alone exceeds the budget (nothing kept)."""
        a = Anchor(bytes(key), k.detach().clone(), v.detach().clone(), int(start), source)
        if a.nbytes > self.budget_bytes:
            return False
        with self._lock:
            same = [ik for ik in self._items if ik[0] == a.key]
            while len(same) >= self.per_segment:
                self._drop(same.pop(0))
            self._serial += 1
            self._items[(a.key, self._serial)] = a
            self.nbytes += a.nbytes
            while self.nbytes > self.budget_bytes:
                self._drop(next(iter(self._items)))
        return True

    def _drop(self, ik: tuple[bytes, int]) -> None:
        a = self._items.pop(ik)
        self.nbytes -= a.nbytes
        self.evictions += 1

    def has(self, key: bytes) -> bool:
        with self._lock:
            return any(ik[0] == key for ik in self._items)

    def get(self, key: bytes) -> Anchor | None:
        """The segment's most recent anchor (marked used), or None."""
        with self._lock:
            found = [ik for ik in self._items if ik[0] == key]
            if not found:
                self.misses += 1
                return None
            ik = max(found, key=lambda t: t[1])
            self._items.move_to_end(ik)
            self.hits += 1
            return self._items[ik]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"anchors": len(self._items),
                    "segments": len({k for k, _ in self._items}), "bytes": self.nbytes,
                    "budget_bytes": self.budget_bytes, "evictions": self.evictions,
                    "hits": self.hits, "misses": self.misses}
