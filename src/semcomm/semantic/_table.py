"""The cache's in-process view of its entries: slots, per-partition vector indexes, budgets.

:class:`EntryTable` holds one :class:`Slot` (the metadata a lookup needs, no answer) per
indexed entry, in recency order, one vector index per partition, the bytes the entries take
and the answer clusters (:class:`~semcomm.semantic._clusters.AnswerClusters`). It is mutated
only under the owning :class:`~semcomm.semantic.SemanticCache`'s lock; the entry store (the
rows themselves) is the cache's business.

Invariant: every indexed vector has a slot and a label in ``labels``; removing an entry
removes all three and tells the clusters and the hit policy (``forget``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._clusters import AnswerClusters, answer_key
from ._entry import Entry, Slot
from ._index import VectorIndex

if TYPE_CHECKING:
    from ._stats import CacheStats

__all__ = ["EVICTION_POLICIES", "EntryTable", "Slot"]

log = logging.getLogger(__name__)


def _lru_victims(slots: OrderedDict[str, Slot], n: int) -> list[str]:
    return [k for k, _ in zip(slots, range(n), strict=False)]


def _lfu_victims(slots: OrderedDict[str, Slot], n: int) -> list[str]:
    # fewest hits first, ties by least recent (OrderedDict order is recency)
    order = sorted(enumerate(slots.items()), key=lambda kv: (kv[1][1].hits, kv[0]))
    return [k for _, (k, _) in order[:n]]


EVICTION_POLICIES: dict[str, Callable[[OrderedDict[str, Slot], int], list[str]]] = {
    "lru": _lru_victims,
    "lfu": _lfu_victims,
}


class EntryTable:
    """Slots, indexes and budgets of the indexed entries (see the module docstring).

    ``new_index`` makes a partition's index; ``forget`` is told the ids of removed entries
    (the hit policy's); ``stats`` counts evictions. ``max_entries`` / ``max_bytes`` are the
    budgets :meth:`enforce_budget` keeps, ``eviction`` a name from :data:`EVICTION_POLICIES`.
    """

    def __init__(self, dim: Callable[[], int], new_index: Callable[[], VectorIndex], *,
                 forget: Callable[[Sequence[str]], None], stats: CacheStats,
                 max_entries: int | None, max_bytes: int | None, eviction: str) -> None:
        self._dim = dim
        self._new_index = new_index
        self._forget = forget
        self._stats = stats
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.eviction = eviction
        self.slots: OrderedDict[str, Slot] = OrderedDict()  # recency order (LRU first)
        self.labels: dict[int, str] = {}
        self.indexes: dict[str, VectorIndex] = {}
        self.bytes = 0
        self._next_label = 1
        self.clusters = AnswerClusters(self.slots, dim)

    def __len__(self) -> int:
        return len(self.slots)

    def clear(self) -> None:
        self.slots.clear()
        self.labels.clear()
        self.indexes.clear()
        self.clusters.clear()
        self.bytes = 0

    def search(self, partition: str, vec: np.ndarray, k: int) -> tuple[list[int], list[float]]:
        """Labels and cosines of the ``k`` nearest vectors of ``partition`` (best first;
        empty when it has none)."""
        idx = self.indexes.get(partition)
        if idx is None or not len(idx):
            return [], []
        labels, sims = idx.search(vec, k)
        return labels.tolist(), sims.tolist()

    def at_label(self, label: int) -> tuple[str, Slot] | None:
        """The entry id and slot of an index label (None: gone meanwhile)."""
        eid = self.labels.get(int(label))
        s = self.slots.get(eid) if eid is not None else None
        return None if s is None or eid is None else (eid, s)

    def add(self, entries: Sequence[Entry]) -> None:
        """Index entries (a re-stored id replaces its slot), one batched add per partition."""
        dim = self._dim()
        batches: dict[str, tuple[list[int], list[np.ndarray]]] = {}
        for e in entries:
            if e.vector.shape[0] != dim:
                log.warning("skipping entry %s with dimension %d", e.id, e.vector.shape[0])
                continue
            old = self.slots.pop(e.id, None)
            if old is not None:
                label = old.label
                self.bytes -= old.nbytes
                if old.partition != e.partition:  # pragma: no cover - id collision
                    self.indexes[old.partition].remove([label])
                self.clusters.drop(e.id, old)
            else:
                label = self._next_label
                self._next_label += 1
                self.labels[label] = e.id
            labs, vecs = batches.setdefault(e.partition, ([], []))
            labs.append(label)
            vecs.append(e.vector)
            nb = e.nbytes()
            akey = answer_key(e.answer)
            cluster = e.cluster or self.clusters.of_answer(e.partition, akey) or e.id
            slot = Slot(label, e.partition, e.query, e.scope, e.tenant, e.model,
                        frozenset(e.tags), e.created_at, e.expires_at, e.ttl_s,
                        nb, e.hits, e.last_hit or e.created_at, cluster, akey, e.trust)
            self.slots[e.id] = slot
            self.clusters.add(e.id, slot, e.vector)
            self.bytes += nb
        for part, (labs, vecs) in batches.items():
            idx = self.indexes.get(part)
            if idx is None:
                idx = self.indexes[part] = self._new_index()
            idx.add(labs, np.stack(vecs))

    def remove(self, ids: Iterable[str]) -> list[str]:
        """Unindex entries; returns the ids that were indexed."""
        gone = []
        for i in ids:
            s = self.slots.pop(i, None)
            if s is None:
                continue
            self.clusters.drop(i, s)
            idx = self.indexes.get(s.partition)
            if idx is not None:
                idx.remove([s.label])
                if len(idx) == 0:
                    del self.indexes[s.partition]
            self.labels.pop(s.label, None)
            self.bytes -= s.nbytes
            gone.append(i)
        if gone:
            self._forget(gone)
        return gone

    def _over_budget(self) -> int:
        n = 0
        if self.max_entries is not None and len(self.slots) > self.max_entries:
            n = len(self.slots) - self.max_entries
        if self.max_bytes is not None and self.bytes > self.max_bytes:
            n = max(n, 1)
        return n

    def enforce_budget(self) -> list[str]:
        """Unindex the eviction policy's victims until both budgets hold; returns their ids
        (the caller deletes their rows)."""
        victims: list[str] = []
        pick = EVICTION_POLICIES[self.eviction]
        while (n := self._over_budget()) > 0:
            if self.max_bytes is not None and self.bytes > self.max_bytes:
                # evict enough for the byte budget too (average entry size estimate)
                avg = max(1, self.bytes // max(1, len(self.slots)))
                n = max(n, -(-(self.bytes - self.max_bytes) // avg))
            chosen = pick(self.slots, n)
            if not chosen:
                break
            victims.extend(self.remove(chosen))
        if victims:
            self._stats.evictions += len(victims)
        return victims

    def reload(self, entries: Sequence[Entry]) -> None:
        """Drop everything and index ``entries`` (least recently used first); enforce the
        budgets (the victims' rows are left to the caller's next sync)."""
        self.clear()
        self.add(sorted(entries, key=lambda e: e.last_hit or e.created_at))
        self.enforce_budget()
