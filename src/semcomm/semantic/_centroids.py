"""Answer-cluster centroids of one partition: what the default hit policy's centroid rule reads.

A cluster is the set of stored phrasings that led to one answer (docs/semantic.md). For every
cluster of two or more members, :class:`ClusterCentroids` keeps the sum of its members' unit
vectors, so that a lookup can ask, for the clusters it met among its nearest neighbours:

- ``centroid``: the query's cosine to the cluster's centroid (the normalised mean of its
  members);
- ``cohesion``: how close the cluster's own members are to it: the mean, over members, of a
  member's cosine to the centroid of the *other* members. From the sum ``S`` of ``n`` unit
  vectors the mean of ``m . S`` over members is exactly ``|S|^2 / n``, and this module uses
  that mean in ``(m . S - 1) / |S - m|`` (``|S - m|^2 = |S|^2 - 2 m . S + 1``): exact for
  two members (their cosine), within Jensen's gap for more, and O(d) to keep up to date;
- ``rival``: the best centroid cosine of any *other* cluster of the partition, also those
  none of whose members is among the neighbours (the top-1 / top-2 cluster margin).

Invariants: ``_mat[:len(_keys)]`` holds one unit centroid per cluster with ``_n >= 2`` and no
pending recount, row ``i`` belongs to ``_keys[i]`` and ``_rows`` is the inverse map;
``_coh[i]`` is that cluster's cohesion. Lone entries keep nothing here (a cache of 100k
distinct answers holds no sums). A vector that is not at hand (a removed member, or the first
member of a cluster that just reached two) is not needed: the cluster is marked dirty and
recounted from its members' vectors in the index before the next lookup reads it
(:meth:`recount`). Mutated only under the owning cache's lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CentroidView", "ClusterCentroids"]


@dataclass(frozen=True, slots=True)
class CentroidView:
    """One cluster as one lookup sees it."""

    centroid: float  # cosine of the query to the cluster's centroid
    cohesion: float  # its members' mean cosine to the centroid of the others
    rival: float  # best centroid cosine of another multi-member cluster (-1.0: none)
    members: int


def _cohesion(s: np.ndarray, n: int) -> float:
    s2 = float(s @ s)
    return (s2 / n - 1.0) / max(1e-12, s2 - 2.0 * s2 / n + 1.0) ** 0.5


class ClusterCentroids:
    """Centroids of the multi-member answer clusters of one partition (see module docstring)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._sum: dict[str, np.ndarray] = {}  # cluster -> sum of member vectors (float64)
        self._n: dict[str, int] = {}  # cluster -> members counted in _sum
        self._dirty: set[str] = set()  # clusters that lost a member: recount before reading
        self._rows: dict[str, int] = {}
        self._keys: list[str] = []
        self._mat = np.zeros((8, dim), dtype=np.float32)
        self._coh = np.zeros(8, dtype=np.float64)

    def __len__(self) -> int:
        """Clusters with a centroid row (two or more members, counted)."""
        return len(self._keys)

    def counted(self, cluster: str) -> int:
        """Members counted in ``cluster``'s sum (0: none kept)."""
        return self._n.get(cluster, 0)

    @property
    def dirty(self) -> frozenset[str]:
        return frozenset(self._dirty)

    def add(self, cluster: str, vector: np.ndarray, members: int) -> None:
        """A member (its unit vector) joined ``cluster``, which now has ``members`` members. A
        counted cluster is updated in O(d); one that just reached two members (the first
        member's vector is not kept here) or has a pending recount is marked dirty."""
        if members < 2:
            return  # a lone entry: its vector is in the index
        n = self._n.get(cluster)
        if n is None or n != members - 1 or cluster in self._dirty:
            self.discard(cluster)
            return
        self._sum[cluster] = self._sum[cluster] + np.asarray(vector, np.float64).reshape(self.dim)
        self._n[cluster] = members
        self._refresh(cluster)

    def discard(self, cluster: str) -> None:
        """A member left ``cluster``: its row is dropped until :meth:`recount`."""
        self._dirty.add(cluster)
        self._drop_row(cluster)

    def recount(self, cluster: str, vectors: np.ndarray) -> None:
        """Set ``cluster``'s members to ``vectors`` (``(n, dim)``; n may be 0)."""
        self._dirty.discard(cluster)
        vs = np.asarray(vectors, dtype=np.float64).reshape(-1, self.dim)
        if len(vs) < 2:  # a lone entry keeps no sum: its vector is in the index
            self._sum.pop(cluster, None)
            self._n.pop(cluster, None)
            self._drop_row(cluster)
            return
        self._sum[cluster] = vs.sum(axis=0)
        self._n[cluster] = len(vs)
        self._refresh(cluster)

    def _refresh(self, cluster: str) -> None:
        n = self._n.get(cluster, 0)
        if n < 2:
            self._drop_row(cluster)
            return
        s = self._sum[cluster]
        norm = float(np.linalg.norm(s))
        if norm <= 1e-12:  # members cancel out: no direction to compare with
            self._drop_row(cluster)
            return
        row = self._rows.get(cluster)
        if row is None:
            row = len(self._keys)
            if row >= self._mat.shape[0]:
                cap = 2 * self._mat.shape[0]
                mat = np.zeros((cap, self.dim), dtype=np.float32)
                mat[:row] = self._mat[:row]
                coh = np.zeros(cap, dtype=np.float64)
                coh[:row] = self._coh[:row]
                self._mat, self._coh = mat, coh
            self._rows[cluster] = row
            self._keys.append(cluster)
        self._mat[row] = s / norm
        self._coh[row] = _cohesion(s, n)

    def _drop_row(self, cluster: str) -> None:
        row = self._rows.pop(cluster, None)
        if row is None:
            return
        last = len(self._keys) - 1
        if row != last:
            moved = self._keys[last]
            self._mat[row] = self._mat[last]
            self._coh[row] = self._coh[last]
            self._keys[row] = moved
            self._rows[moved] = row
        self._keys.pop()

    def _rows_sims(self, query: np.ndarray, among: Sequence[str] | None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(rows, cosines of ``query`` to their centroids): every row, or only the rows of the
        clusters in ``among``."""
        q = np.asarray(query, dtype=np.float32).reshape(self.dim)
        if among is None:
            rows = np.arange(len(self._keys))
            return rows, self._mat[: len(self._keys)] @ q
        rows = np.fromiter(dict.fromkeys(self._rows[c] for c in among if c in self._rows),
                           dtype=np.int64)
        return rows, (self._mat[rows] @ q if len(rows) else np.zeros(0, np.float32))

    def nearest_other(self, query: np.ndarray, cluster: str,
                      among: Sequence[str] | None = None) -> tuple[str, float] | None:
        """The cluster other than ``cluster`` whose centroid is nearest ``query``, and its
        cosine (None: no other); ``among``: look only at these clusters."""
        rows, sims = self._rows_sims(query, among)
        own = self._rows.get(cluster)
        keep = rows != own if own is not None else np.ones(len(rows), bool)
        if not keep.any():
            return None
        rows, sims = rows[keep], sims[keep]
        best = int(np.argmax(sims))
        return self._keys[int(rows[best])], float(sims[best])

    def centroid_vector(self, cluster: str) -> np.ndarray | None:
        """The unit centroid of ``cluster`` (a view; None: no centroid row)."""
        row = self._rows.get(cluster)
        return None if row is None else self._mat[row]

    def view(self, query: np.ndarray, clusters: Sequence[str],
             among: Sequence[str] | None = None) -> dict[str, CentroidView]:
        """How ``query`` (a unit vector) sits against each of ``clusters`` that has a centroid.
        The rival is the best other centroid of the partition: one ``(clusters) x dim``
        product for the whole lookup; with ``among`` (the cache passes the clusters of a
        wider neighbour search when the partition holds many clusters), the best other
        centroid of ``among`` and ``clusters``, so the cost stays bounded."""
        want = [c for c in dict.fromkeys(clusters) if c in self._rows]
        if not want:
            return {}
        rows, sims = self._rows_sims(query, None if among is None else [*clusters, *among])
        by_row = dict(zip(rows.tolist(), sims.tolist(), strict=True))
        top = np.argpartition(-sims, 1)[:2] if len(sims) > 2 else np.arange(len(sims))
        order = top[np.argsort(-sims[top], kind="stable")]
        first = int(rows[order[0]])
        second = float(sims[order[1]]) if len(order) > 1 else -1.0
        out: dict[str, CentroidView] = {}
        for c in want:
            row = self._rows[c]
            rival = second if row == first else float(by_row[first])
            out[c] = CentroidView(float(by_row[row]), float(self._coh[row]), rival, self._n[c])
        return out
