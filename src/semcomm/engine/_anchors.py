"""Anchors: a shared segment's KV as some prompt computed it *in context*, bounded in bytes.

A document reused at another position is closer to what the new prompt needs when its KV was
computed in some prompt's context than when it was computed alone (KVCOMM, NeurIPS'25, keeps
such in-context copies as its anchors). Two kinds are kept (engine/_documents.py captures
them): every document of a prompt whose documents were all computed in context (prefilled in
full, a fallback of the confidence test, or ``r = 1``), and the answer a prompt with documents
generated (its own decode KV, keyed by its token ids, so a later prompt that carries the answer
as a document of the same tokens finds it).

**Offsets** (KVCOMM's placeholder offsets): where the same prompt layout (an agent's role,
labels and ask, the documents left out) places a segment from an anchor of the same source
layout again and again (an agent pipeline, request after request), the difference between
the segment's exact KV in that prompt and its re-rotated anchor is much the same for every
request. :meth:`AnchorPool.learn` keeps its running mean per *slot* (target layout, segment
index, the anchor's source) and per token position, keys in the position-0 frame;
:meth:`AnchorPool.offset` returns it for the next request of that slot to add to its anchor.

Invariants: the pool holds at most ``budget_bytes`` of copies and offsets (least recently used evicted
first; one anchor larger than the budget is not kept) and at most ``per_segment`` anchors of
one segment (the oldest evicted first). A segment's key is the last link of its document key
chain, which roots at the engine's namespace digest (model, dtype, codec, **tenant**): another
tenant's engine computes other keys and never reads an anchor it did not make, even from a
shared pool. Thread-safe (the workers of one model share a pool).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = ["DEFAULT_ANCHOR_BUDGET", "Anchor", "AnchorPool", "Offset"]

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
    context: bytes = b""  # where it was computed: its layout slot (empty: not known)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass(slots=True)
class Offset:
    """A slot's running sums of (exact KV - placed anchor KV) per token position: ``[L, H,
    T, D]`` float32 (keys rotated to position 0) and ``count[T]`` samples per position."""

    sum_k: torch.Tensor
    sum_v: torch.Tensor
    count: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.sum_k, self.sum_v, self.count))

    @property
    def samples(self) -> int:
        return int(self.count[0]) if self.count.numel() else 0

    def add(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        n, have = dk.shape[2], self.sum_k.shape[2]
        if n > have:  # a longer segment: grow (new positions start at zero samples)
            pad = [0, 0, 0, n - have]
            self.sum_k = torch.nn.functional.pad(self.sum_k, pad)
            self.sum_v = torch.nn.functional.pad(self.sum_v, pad)
            self.count = torch.nn.functional.pad(self.count, [0, n - have])
        self.sum_k[:, :, :n] += dk.float()
        self.sum_v[:, :, :n] += dv.float()
        self.count[:n] += 1

    def mean(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The mean offsets of the first ``m <= n`` positions that have samples, and ``m``."""
        m = min(n, int((self.count > 0).sum()))
        c = self.count[:m].clamp_min(1).to(torch.float32)[None, None, :, None]
        return self.sum_k[:, :, :m] / c, self.sum_v[:, :, :m] / c, m


class AnchorPool:
    """Anchors of shared segments, bounded (module docstring): at most ``budget_bytes`` in all
    and ``per_segment`` per segment."""

    def __init__(self, budget_bytes: int = DEFAULT_ANCHOR_BUDGET, per_segment: int = 4):
        if budget_bytes < 0 or per_segment < 1:
            raise InvalidInputError("an anchor pool takes budget_bytes >= 0 and per_segment >= 1")
        self.budget_bytes = int(budget_bytes)
        self.per_segment = int(per_segment)
        self._items: OrderedDict[tuple[bytes, int], Anchor] = OrderedDict()  # LRU order
        self._offsets: OrderedDict[bytes, Offset] = OrderedDict()  # LRU order
        self._lock = threading.RLock()  # a get() rank may read offset_samples()
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

    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, start: int, source: str,
            context: bytes = b"") -> bool:
        """Keep a copy; False when it alone exceeds the budget (nothing kept)."""
        a = Anchor(bytes(key), k.detach().clone(), v.detach().clone(), int(start), source,
                   bytes(context))
        if a.nbytes > self.budget_bytes:
            return False
        with self._lock:
            same = [ik for ik in self._items if ik[0] == a.key]
            while len(same) >= self.per_segment:
                self._drop(same.pop(0))
            self._serial += 1
            self._items[(a.key, self._serial)] = a
            self.nbytes += a.nbytes
            self._evict()
        return True

    def _evict(self) -> None:
        """Least recently used first, anchors before offsets (an offset sums many requests)."""
        while self.nbytes > self.budget_bytes and self._items:
            self._drop(next(iter(self._items)))
        while self.nbytes > self.budget_bytes and self._offsets:
            _, o = self._offsets.popitem(last=False)
            self.nbytes -= o.nbytes
            self.evictions += 1

    def _drop(self, ik: tuple[bytes, int]) -> None:
        a = self._items.pop(ik)
        self.nbytes -= a.nbytes
        self.evictions += 1

    def anchors(self, key: bytes) -> list[Anchor]:
        """The segment's anchors, most recent first, not marked used (no hit counted)."""
        with self._lock:
            return [self._items[ik] for ik in sorted((ik for ik in self._items if ik[0] == key),
                                                     key=lambda t: -t[1])]

    # ------------------------------------------------------------- offsets
    def learn(self, slot: bytes, dk: torch.Tensor, dv: torch.Tensor) -> bool:
        """Add one sample (``[L, H, n, D]``, keys rotated to position 0) to a slot's offset;
        False when the offset alone would exceed the budget (nothing kept)."""
        with self._lock:
            o = self._offsets.pop(slot, None)
            if o is None:  # empty, grown to the sample's length by add()
                o = Offset(dk.new_zeros((*dk.shape[:2], 0, dk.shape[3]), dtype=torch.float32),
                           dv.new_zeros((*dv.shape[:2], 0, dv.shape[3]), dtype=torch.float32),
                           torch.zeros(0, dtype=torch.int32, device=dk.device))
            else:
                self.nbytes -= o.nbytes
            o.add(dk, dv)
            if o.nbytes > self.budget_bytes:
                return False
            self._offsets[slot] = o
            self.nbytes += o.nbytes
            self._evict()
            return slot in self._offsets

    def offset(self, slot: bytes, n: int, min_samples: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """A slot's mean offsets of its first ``m <= n`` positions and ``m`` (marked used;
        read under the lock, so a concurrent :meth:`learn` is not half seen), or None when
        it has fewer than ``min_samples`` samples."""
        with self._lock:
            o = self._offsets.get(slot)
            if o is None or o.samples < min_samples:
                return None
            self._offsets.move_to_end(slot)
            return o.mean(n)

    def offset_samples(self, slot: bytes) -> int:
        with self._lock:
            o = self._offsets.get(slot)
            return o.samples if o is not None else 0

    def has(self, key: bytes) -> bool:
        with self._lock:
            return any(ik[0] == key for ik in self._items)

    def get(self, key: bytes, rank: Callable[[Anchor], Any] | None = None) -> Anchor | None:
        """The segment's best anchor by ``rank`` (ties and default: the most recent), marked
        used, or None."""
        with self._lock:
            found = [ik for ik in self._items if ik[0] == key]
            if not found:
                self.misses += 1
                return None
            ik = max(found, key=lambda t: (rank(self._items[t]), t[1]) if rank else t[1])
            self._items.move_to_end(ik)
            self.hits += 1
            return self._items[ik]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._offsets.clear()
            self.nbytes = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"anchors": len(self._items),
                    "segments": len({k for k, _ in self._items}), "offsets": len(self._offsets),
                    "bytes": self.nbytes,
                    "budget_bytes": self.budget_bytes, "evictions": self.evictions,
                    "hits": self.hits, "misses": self.misses}
