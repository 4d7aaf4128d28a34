"""Vector indexes over unit vectors, searched by cosine similarity (inner product).

- :class:`FlatIndex`: exact, numpy, contiguous ``(n, dim)`` float32 matrix. Removal swaps the
  last row into the hole, so the matrix never holds a deleted vector.
- :class:`HNSWIndex`: usearch HNSW over int8-quantised vectors, candidates re-scored exactly
  in float32; removal deletes the node from the graph and the float32 row. Used above ``hnsw_min`` vectors (see ``benchmarks/bench_semantic_speed.py`` for the
  cross-over measurement).
- :class:`AutoIndex`: starts flat and migrates to HNSW once it grows past ``hnsw_min``.

Labels are ints chosen by the caller (the cache maps them to entry ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["AutoIndex", "FlatIndex", "HNSWIndex", "VectorIndex", "make_index"]


class VectorIndex(Protocol):
    dim: int

    def add(self, labels: Sequence[int], vectors: np.ndarray) -> None: ...
    def remove(self, labels: Sequence[int]) -> int: ...
    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...
    def __len__(self) -> int: ...
    def __contains__(self, label: int) -> bool: ...
    def nbytes(self) -> int: ...


class FlatIndex:
    """Exact inner-product search. Invariant: ``_vecs[:n]`` holds exactly the live vectors and
    ``_labels[i]`` labels row ``i``; ``_pos`` is the inverse map."""

    def __init__(self, dim: int, *, capacity: int = 64) -> None:
        self.dim = dim
        self._vecs = np.zeros((capacity, dim), dtype=np.float32)
        self._labels = np.zeros(capacity, dtype=np.int64)
        self._pos: dict[int, int] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __contains__(self, label: int) -> bool:
        return label in self._pos

    def nbytes(self) -> int:
        return int(self._n * (self.dim * 4 + 8))

    def _grow(self, need: int) -> None:
        cap = self._vecs.shape[0]
        if need <= cap:
            return
        new = max(need, cap * 2)
        v = np.zeros((new, self.dim), dtype=np.float32)
        v[: self._n] = self._vecs[: self._n]
        lab = np.zeros(new, dtype=np.int64)
        lab[: self._n] = self._labels[: self._n]
        self._vecs, self._labels = v, lab

    def add(self, labels: Sequence[int], vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        self._grow(self._n + len(labels))
        for lab, vec in zip(labels, vectors, strict=True):
            lab = int(lab)
            pos = self._pos.get(lab)
            if pos is None:
                pos = self._n
                self._n += 1
                self._pos[lab] = pos
                self._labels[pos] = lab
            self._vecs[pos] = vec

    def remove(self, labels: Sequence[int]) -> int:
        removed = 0
        for lab in labels:
            pos = self._pos.pop(int(lab), None)
            if pos is None:
                continue
            last = self._n - 1
            if pos != last:
                self._vecs[pos] = self._vecs[last]
                moved = int(self._labels[last])
                self._labels[pos] = moved
                self._pos[moved] = pos
            self._vecs[last] = 0.0
            self._n -= 1
            removed += 1
        # shrink when mostly empty so deleted capacity is returned
        if self._vecs.shape[0] > 256 and self._n < self._vecs.shape[0] // 4:
            cap = max(64, self._n * 2)
            self._vecs = self._vecs[:cap].copy()
            self._labels = self._labels[:cap].copy()
        return removed

    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(labels, similarities)`` of the ``k`` nearest, best first."""
        if self._n == 0 or k <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        sims = self._vecs[: self._n] @ np.asarray(vector, dtype=np.float32).reshape(self.dim)
        k = min(k, self._n)
        if k < self._n:
            idx = np.argpartition(-sims, k - 1)[:k]
        else:
            idx = np.arange(self._n)
        idx = idx[np.argsort(-sims[idx], kind="stable")]
        return self._labels[idx].copy(), sims[idx].astype(np.float32)

    def vectors(self) -> np.ndarray:
        """Live vectors (a view; for tests and migration)."""
        return self._vecs[: self._n]

    def labels(self) -> np.ndarray:
        return self._labels[: self._n]


HNSW_OPTIONS = ("connectivity", "expansion_search", "expansion_add", "dtype", "oversample",
                "threads")


def check_hnsw_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Validate HNSW graph options (names of :class:`HNSWIndex` keywords) by building a tiny
    index with them; returns a copy. Unknown names or bad values raise ``ConfigError``."""
    from ..errors import ConfigError

    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ConfigError(f"hnsw options must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(HNSW_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown hnsw option(s) {unknown}; choose from {list(HNSW_OPTIONS)}")
    for name in ("connectivity", "expansion_add", "oversample"):
        v = options.get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"hnsw option {name} must be a positive int, got {v!r}")
    try:
        HNSWIndex(4, **options)
    except ConfigError:
        raise
    except Exception as exc:  # usearch rejects e.g. an unknown dtype
        raise ConfigError(f"bad hnsw options {options!r}: {exc}") from exc
    return dict(options)


class HNSWIndex:
    """usearch HNSW graph for navigation, exact float32 similarities for the answer.

    The graph stores vectors quantised to int8 (``dtype="i8"``, cosine metric: the vectors are
    unit, so cosine equals inner product); that makes inserts ~5x and searches ~4x faster than
    float32 on AVX-512 and keeps recall@1 at least as high on 384-d vectors
    (``benchmarks/bench_semantic_speed.py``). The ``oversample * k`` graph candidates are then
    re-scored against an exact float32 copy (a :class:`FlatIndex`), so the similarities the hit
    policies compare with thresholds are exact, not quantised. Degree ``connectivity=32``: on
    vectors with MiniLM's covariance it reaches a given recall at half the latency of M=16 from
    100k entries up, for inserts about half as fast (``benchmarks/bench_semantic_hnsw_ef.py``).
    ``expansion_search="auto"`` widens the search as the graph grows (:meth:`auto_ef`); pass an
    int to fix it. Batch adds run on ``threads`` threads (0: all cores)."""

    def __init__(self, dim: int, *, connectivity: int = 32, expansion_add: int = 128,
                 expansion_search: int | str = "auto", dtype: str = "i8", threads: int = 0,
                 oversample: int = 2) -> None:
        from usearch.index import Index

        from ..errors import ConfigError

        if expansion_search != "auto" and (not isinstance(expansion_search, int)
                                           or expansion_search < 1):
            raise ConfigError(f"expansion_search must be a positive int or 'auto', got "
                              f"{expansion_search!r}")
        self.dim = dim
        self.threads = threads
        self.oversample = max(1, int(oversample))
        self.expansion_search = expansion_search
        self._index = Index(ndim=dim, metric="cos", dtype=dtype, connectivity=connectivity,
                            expansion_add=expansion_add, expansion_search=128)
        self._ef = 128
        self._exact = FlatIndex(dim)

    @staticmethod
    def auto_ef(n: int) -> int:
        """Search breadth for ``n`` vectors: 64 up to 300k, then ``64 * (n / 300k) ** 0.58``
        (multiple of 16, at most 1024): 128 at 1M. Chosen by paraphrase recall (a lookup moved
        from a stored vector as far as labelled duplicates are; right when the exactly closest
        entry comes back) on vectors drawn with the mean and covariance of all-MiniLM-L6-v2
        question embeddings, M=32, int8 graph: 100k: 0.998 at ef 64; 300k: 0.994 at 64; 1M:
        0.932 at 64, 0.982 at 128, 0.996 at 256 (``benchmarks/bench_semantic_hnsw_ef.py``).
        Latency grows about linearly with ef. Isotropic random vectors (no structure) need far
        more: pin ``expansion_search`` for such data."""
        if n <= 300_000:
            return 64
        return min(1024, int(round(64 * (n / 300_000) ** 0.58 / 16)) * 16)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, label: int) -> bool:
        return int(label) in self._exact

    def nbytes(self) -> int:
        return int(self._index.memory_usage) + self._exact.nbytes()

    def add(self, labels: Sequence[int], vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        labs = np.asarray(labels, dtype=np.uint64).reshape(-1)
        if len(self._index):
            present = np.fromiter((int(x) in self._exact for x in labs), dtype=bool,
                                  count=len(labs))
            if present.any():
                self._index.remove(labs[present])
        # batch inserts run in parallel; single inserts stay on the caller's thread
        self._index.add(labs, vectors, threads=self.threads if len(labs) > 256 else 1)
        self._exact.add(labs.astype(np.int64).tolist(), vectors)

    def remove(self, labels: Sequence[int]) -> int:
        labs = [int(x) for x in labels if int(x) in self._exact]
        if not labs:
            return 0
        self._index.remove(np.asarray(labs, dtype=np.uint64))
        self._exact.remove(labs)
        return len(labs)

    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(labels, similarities)`` of the ``k`` nearest, best first; similarities are
        exact float32 inner products."""
        n = len(self._index)
        if n == 0 or k <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        q = np.asarray(vector, dtype=np.float32).reshape(self.dim)
        ef = self.auto_ef(n) if self.expansion_search == "auto" else int(self.expansion_search)
        if ef != self._ef:
            # usearch defines the setter; its type information marks the property read-only
            self._index.expansion_search = self._ef = ef  # type: ignore[misc]
        m = self._index.search(q, min(k * self.oversample, n), threads=1)
        keys = np.asarray(m.keys, dtype=np.int64).reshape(-1)
        pos = self._exact._pos
        rows = np.fromiter((pos[int(x)] for x in keys), dtype=np.int64, count=len(keys))
        sims = self._exact._vecs[rows] @ q
        order = np.argsort(-sims, kind="stable")[:k]
        return keys[order], sims[order].astype(np.float32)

    def vectors_of(self, labels: Sequence[int]) -> np.ndarray:
        pos = self._exact._pos
        return self._exact._vecs[[pos[int(x)] for x in labels]].copy()


class AutoIndex:
    """Flat until ``hnsw_min`` vectors, then HNSW (migrated once, in place; ``hnsw``: its
    :class:`HNSWIndex` options)."""

    def __init__(self, dim: int, *, hnsw_min: int = 20_000,
                 hnsw: dict[str, Any] | None = None) -> None:
        self.dim = dim
        self.hnsw_min = hnsw_min
        self.hnsw_options = dict(hnsw or {})
        self._impl: FlatIndex | HNSWIndex = FlatIndex(dim)

    @property
    def kind(self) -> str:
        return "flat" if isinstance(self._impl, FlatIndex) else "hnsw"

    def __len__(self) -> int:
        return len(self._impl)

    def __contains__(self, label: int) -> bool:
        return label in self._impl

    def nbytes(self) -> int:
        return self._impl.nbytes()

    def add(self, labels: Sequence[int], vectors: np.ndarray) -> None:
        self._impl.add(labels, vectors)
        if isinstance(self._impl, FlatIndex) and len(self._impl) >= self.hnsw_min:
            flat = self._impl
            h = HNSWIndex(self.dim, **self.hnsw_options)
            h.add(flat.labels().tolist(), flat.vectors())
            self._impl = h

    def remove(self, labels: Sequence[int]) -> int:
        return self._impl.remove(labels)

    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self._impl.search(vector, k)


_KINDS = {"flat": FlatIndex, "hnsw": HNSWIndex, "auto": AutoIndex}


def make_index(kind: str, dim: int) -> VectorIndex:
    """Build an index by name: ``"flat"``, ``"hnsw"`` or ``"auto"``."""
    from ..errors import ConfigError

    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ConfigError(f"unknown index kind {kind!r}; choose one of {sorted(_KINDS)}") from None
    return cls(dim)  # type: ignore[no-any-return]
