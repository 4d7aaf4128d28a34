"""Answer clusters: which stored phrasings share one answer, and how the cache learns it.

A cluster is the set of entries of one partition whose answers are the same text (case and
spacing aside), or whose answers the cache found to mean the same (``answer_match``). Two
collaborators of :class:`~semcomm.semantic.SemanticCache` keep them:

- :class:`AnswerClusters`, the bookkeeping (mutated only under the owning cache's lock, no
  I/O): the cluster of each answer text, the members of each cluster, the centroids of the
  clusters of two or more phrasings per partition (:mod:`._centroids`), the guard checks a
  cluster waives, and the figures a lookup's candidates get from them (:meth:`views`);
- :class:`AnswerLinker`, the learning (it reads answers from the entry store and compares
  them outside the lock): a stored entry joins the cluster of a neighbour whose answer means
  the same (:meth:`~AnswerLinker.link`), and a lookup the centroid rule refused for a rival
  cluster alone joins the two when their answers agree (:meth:`~AnswerLinker.join_rival`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._centroids import ClusterCentroids
from ._entry import Entry, Slot
from ._policy import Candidate, IntentCheck
from ._shadow import MIN_EMBED_WORDS, answers_agree

if TYPE_CHECKING:
    from ._index import VectorIndex
    from ._stats import CacheStats


__all__ = ["MIN_TRUST", "AnswerClusters", "AnswerLinker", "answer_key"]

log = logging.getLogger(__name__)

MIN_TRUST = 0.75
"""An entry whose trust fell below this is neither served nor part of its cluster's centroid."""

# differing cluster pairs remembered (cleared when full)
_MAX_DISTINCT_PAIRS = 65_536
# a stored query links to a neighbour's cluster only when it is at least this similar to it
_LINK_FLOOR = 0.5
# guard checks waived for a cluster whose own members already differ in that respect
_WAIVABLE = frozenset({"number", "entity", "date", "question"})


def answer_key(answer: str) -> str:
    """Digest of the normalised answer text: entries with equal keys share a cluster."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(" ".join(answer.lower().split()).encode())


class AnswerClusters:
    """The answer clusters of the cache's indexed entries (see the module docstring).

    ``slots`` is the entry table's slot map (read, and a merged member's ``cluster`` set);
    ``dim`` gives the embedding dimension when a partition's first centroid is made.
    Invariant: every member of ``members[c]`` is a slot whose ``cluster`` is ``c``.
    """

    def __init__(self, slots: Mapping[str, Slot], dim: Callable[[], int]) -> None:
        self._slots = slots
        self._dim = dim
        # (partition, answer key) -> cluster, and how many indexed entries carry that answer
        self._by_answer: dict[tuple[str, str], str] = {}
        self._refs: dict[tuple[str, str], int] = {}
        self._members: dict[str, set[str]] = {}
        # cluster -> answer key -> guard checks waived (computed on demand, dropped when its
        # members change)
        self._waived: dict[str, dict[str, frozenset[str]]] = {}
        # partition -> centroids of its multi-member clusters (the centroid rule's view)
        self.centroids: dict[str, ClusterCentroids] = {}
        # cluster pairs whose answers were compared and differ (not compared again)
        self.distinct: set[tuple[str, str]] = set()

    def clear(self) -> None:
        for d in (self._by_answer, self._refs, self._members, self._waived, self.centroids,
                  self.distinct):
            d.clear()

    def of_answer(self, partition: str, akey: str) -> str:
        """The cluster of the entries of ``partition`` whose answer has key ``akey`` ("":
        none)."""
        return self._by_answer.get((partition, akey), "")

    def size(self, cluster: str) -> int:
        return len(self._members.get(cluster, ()))

    def a_member(self, cluster: str) -> str:
        """Any member of ``cluster`` ("": none)."""
        return next(iter(self._members.get(cluster, ())), "")

    def _centroids_of(self, partition: str) -> ClusterCentroids:
        cc = self.centroids.get(partition)
        if cc is None:
            cc = self.centroids[partition] = ClusterCentroids(self._dim())
        return cc

    def add(self, eid: str, s: Slot, vector: np.ndarray) -> None:
        """Entry ``eid`` (slot ``s``, unit ``vector``) was indexed into ``s.cluster``."""
        ak = (s.partition, s.answer_key)
        self._by_answer.setdefault(ak, s.cluster)
        self._refs[ak] = self._refs.get(ak, 0) + 1
        members = self._members.setdefault(s.cluster, set())
        members.add(eid)
        self._waived.pop(s.cluster, None)
        if len(members) >= 2:
            cc = self._centroids_of(s.partition)
            if s.trust < MIN_TRUST or cc.counted(s.cluster) != len(members) - 1:
                cc.discard(s.cluster)  # recounted from its trusted members before a lookup
            else:
                cc.add(s.cluster, vector, len(members))

    def drop(self, eid: str, s: Slot) -> None:
        """Entry ``eid`` (slot ``s``) left the index."""
        ak = (s.partition, s.answer_key)
        n = self._refs.get(ak, 0) - 1
        if n <= 0:
            self._refs.pop(ak, None)
            self._by_answer.pop(ak, None)
        else:
            self._refs[ak] = n
        m = self._members.get(s.cluster)
        if m is not None:
            m.discard(eid)
            if not m:
                del self._members[s.cluster]
        self._waived.pop(s.cluster, None)
        cc = self.centroids.get(s.partition)
        if cc is not None:
            cc.discard(s.cluster)

    def trust_moved(self, s: Slot) -> None:
        """``s`` crossed :data:`MIN_TRUST`: it leaves or rejoins its cluster's centroid."""
        cc = self.centroids.get(s.partition)
        if cc is not None:
            cc.discard(s.cluster)

    def merge(self, partition: str, keep: str, gone: str) -> int:
        """Move every member of cluster ``gone`` into ``keep`` (in memory; a reload links them
        again when a lookup meets them). Returns the number moved."""
        moved = self._members.pop(gone, set())
        if not moved:
            return 0
        members = self._members.setdefault(keep, set())
        for eid in moved:
            s = self._slots.get(eid)
            if s is None:
                continue
            s.cluster = keep
            members.add(eid)
            ak = (s.partition, s.answer_key)
            if self._by_answer.get(ak) == gone:
                self._by_answer[ak] = keep
        self._waived.pop(keep, None)
        self._waived.pop(gone, None)
        cc = self._centroids_of(partition)
        cc.recount(gone, np.zeros((0, cc.dim)))
        cc.discard(keep)
        return len(moved)

    def views(self, partition: str, vec: np.ndarray, cands: Sequence[Candidate],
              index: VectorIndex | None, among: Sequence[str] | None = None,
              metric: IntentCheck | None = None) -> None:
        """Fill in each candidate's cluster centroid, cohesion and rival (see
        :mod:`._centroids`), and with an intent ``metric`` its score of the query against the
        candidate's cluster (:mod:`._intent`): the default policy's centroid rule reads them.
        Clusters whose members changed are recounted first from their vectors in ``index``
        (an index that cannot give vectors back leaves them out)."""
        cc = self.centroids.get(partition)
        if cc is None or not cands:
            return
        vectors_of = getattr(index, "vectors_of", None)
        for cluster in cc.dirty:
            if vectors_of is None:
                break
            # distrusted members (trust below MIN_TRUST) are no candidates and no part of the
            # centroid either
            labels = [self._slots[m].label for m in self._members.get(cluster, ())
                      if m in self._slots and self._slots[m].partition == partition
                      and self._slots[m].trust >= MIN_TRUST]
            cc.recount(cluster, vectors_of(labels) if labels else np.zeros((0, cc.dim)))
        views = cc.view(vec, [c.cluster_key for c in cands], among)
        for c in cands:
            v = views.get(c.cluster_key)
            if v is not None:
                c.centroid, c.cohesion, c.rival = v.centroid, v.cohesion, v.rival
        if metric is not None and views:
            best: dict[str, float] = {}
            for c in cands:
                if c.cluster_key in views:
                    best[c.cluster_key] = max(best.get(c.cluster_key, -1.0), c.similarity)
            score = {k: metric.score(vec, cc.centroid_vector(k), b)  # type: ignore[arg-type]
                     for k, b in best.items()}
            for c in cands:
                if c.cluster_key in score:
                    c.intent = score[c.cluster_key]

    def waived_checks(self, cluster: str, akey: str) -> frozenset[str]:
        """Guard checks waived for a candidate of ``cluster`` whose answer key is ``akey``:
        those the cluster's members with that same answer text already disagree on (the answer
        evidently does not depend on them). Members whose answers only resemble it
        (``answer_match``) do not count: a generated answer that names its own number ("The
        number 96033 is ...") resembles the one about 96034 without being it."""
        per = self._waived.get(cluster)
        if per is None:
            from ._guard import text_features

            by_answer: dict[str, list[Any]] = {}
            for m in self._members.get(cluster, ()):
                slot = self._slots.get(m)
                if slot is not None:
                    by_answer.setdefault(slot.answer_key, []).append(text_features(slot.query))
            per = {}
            for key, feats in by_answer.items():
                kinds = set()
                if len(feats) > 1:
                    for kind, attr in (("number", "numbers"), ("entity", "entities"),
                                       ("date", "dates"), ("question", "qwords")):
                        if len({getattr(f, attr) for f in feats}) > 1:
                            kinds.add(kind)
                per[key] = frozenset(kinds & _WAIVABLE)
            self._waived[cluster] = per
        return per.get(akey, frozenset())


class _Table(Protocol):
    """What the answer linker reads of the cache's entry table (``_table.EntryTable``)."""

    @property
    def clusters(self) -> AnswerClusters: ...

    @property
    def slots(self) -> Mapping[str, Slot]: ...

    @property
    def indexes(self) -> Mapping[str, VectorIndex]: ...

    def search(self, partition: str, vec: np.ndarray, k: int) -> tuple[list[int], list[float]]: ...

    def at_label(self, label: int) -> tuple[str, Slot] | None: ...


class AnswerLinker:
    """Answer-equivalence learning (see the module docstring): compares answers read from
    the entry store (``entry``) by ``match`` (``answer_match``: a cosine on the answers'
    embeddings by ``embed``, a callable judge, or None: the same text only) and records what
    it learns in ``table.clusters``, under ``lock``; answers are read and compared outside
    it. ``k()``: how many neighbours of a stored query are looked at."""

    def __init__(self, table: _Table, lock: threading.RLock, stats: CacheStats, *,
                 entry: Callable[[str], Entry | None], match: Any,
                 embed: Callable[[list[str]], np.ndarray], k: Callable[[], int]) -> None:
        self._table = table
        self._lock = lock
        self._stats = stats
        self._entry = entry
        self.match = match
        self._embed = embed
        self._k = k

    def agree(self, a: str, b: str) -> bool:
        return answers_agree(a, b, self.match, self._embed)

    def link(self, partition: str, entries: Sequence[Entry]) -> None:
        """Set each new entry's cluster: that of an entry with the same answer text, or (a
        single store) of a near neighbour (query similarity >= 0.5) whose answer means the
        same. Entries of one batch with equal answers share a cluster."""
        clusters = self._table.clusters
        batch: dict[str, str] = {}
        for e in entries:
            ak = answer_key(e.answer)
            with self._lock:
                old = self._table.slots.get(e.id)
                if old is not None and old.answer_key == ak:
                    e.cluster, e.trust = old.cluster, old.trust  # same answer re-stored
                    continue
                e.cluster = clusters.of_answer(partition, ak) or batch.get(ak, "")
            # by meaning only for one answer at a time (a miss the model just answered): bulk
            # loads link by text, without a neighbour search per entry
            if not e.cluster and self.match is not None and len(entries) == 1 and (
                    callable(self.match) or len(e.answer.split()) >= MIN_EMBED_WORDS):
                e.cluster = self._match_neighbour(partition, e)
            if e.cluster:
                with self._lock:
                    self._stats.linked += 1
            batch.setdefault(ak, e.cluster or e.id)

    def _match_neighbour(self, partition: str, e: Entry) -> str:
        near = []
        with self._lock:
            labels, sims = self._table.search(partition, e.vector, self._k())
            for lab, sim in zip(labels, sims, strict=True):
                if sim < _LINK_FLOOR:
                    break
                hit = self._table.at_label(lab)
                if hit is not None and hit[0] != e.id and hit[1].trust >= MIN_TRUST:
                    near.append((hit[0], hit[1].cluster))
        for eid, cluster in near:
            other = self._entry(eid)
            if other is not None and self.agree(e.answer, other.answer):
                return cluster
        return ""

    def join_rival(self, partition: str, vec: np.ndarray, cands: list[Candidate],
                   win: Candidate, among: list[str] | None,
                   metric: IntentCheck | None) -> bool:
        """Join the cluster that blocked ``win`` (the nearest other centroid, or a nearer lone
        candidate) into ``win``'s when their answers agree; refresh the candidates' cluster
        figures. False: no rival, or answers that differ (remembered)."""
        if self.match is None:
            return False
        clusters = self._table.clusters
        keep = win.cluster_key
        with self._lock:
            cc = clusters.centroids.get(partition)
            other = cc.nearest_other(vec, keep, among) if cc is not None else None
        lone = max((c for c in cands if c.centroid is None and c.cluster_key != keep),
                   key=lambda c: c.similarity, default=None)
        if lone is not None and (other is None or lone.similarity >= other[1]):
            gone, gone_entry = lone.cluster_key, lone.entry_id
        elif other is not None:
            gone = other[0]
            with self._lock:
                gone_entry = clusters.a_member(gone)
        else:
            return False
        pair = (min(keep, gone), max(keep, gone))
        if not gone_entry or pair in clusters.distinct:
            return False
        a, b = self._entry(win.entry_id), self._entry(gone_entry)
        if a is None or b is None:
            return False
        if not self.agree(a.answer, b.answer):
            if len(clusters.distinct) >= _MAX_DISTINCT_PAIRS:
                clusters.distinct.clear()
            clusters.distinct.add(pair)
            return False
        with self._lock:
            moved = clusters.merge(partition, keep, gone)
            if not moved:
                return False
            self._stats.linked += moved
            for c in cands:
                if c.cluster_key == gone:
                    c.cluster = keep
                c.centroid = c.cohesion = c.rival = c.intent = None
            clusters.views(partition, vec, cands, self._table.indexes.get(partition), among,
                           metric)
        log.debug("joined answer cluster %s (%d entries) into %s", gone, moved, keep)
        return True
