"""Vector indexes over unit vectors, searched by cosine similarity (inner product).

- :class:`FlatIndex`: exact, numpy, contiguous ``(n, dim)`` float32 matrix. Removal swaps the
  last row into the hole, so the matrix never holds a deleted vector.
- :class:`HNSWIndex`: usearch HNSW over int8-quantised vectors, candidates re-scored exactly
  in float32; removal deletes the node from the graph and the float32 row. Used above ``hnsw_min`` vectors (see ``benchmarks.semantic.speed`` for the
  cross-over measurement).
- :class:`IVFIndex`: faiss inverted lists over 8-bit scalar-quantised vectors (k-means cells,
  only the cells nearest the query are scanned), candidates re-scored exactly in float32; exact
  (flat) until ``min_train`` vectors, then trained and rebuilt in a background thread as it
  grows. The fastest index measured for cache lookups at 100k-1M entries
  (``bench_semantic_index.py, in git history``).
- :class:`AutoIndex`: starts flat and migrates to IVF (or HNSW) once it grows past ``min_size``.

Labels are ints chosen by the caller (the cache maps them to entry ids).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["AutoIndex", "FlatIndex", "HNSWIndex", "IVFIndex", "VectorIndex", "make_index"]

log = logging.getLogger(__name__)


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

    def vectors_of(self, labels: Sequence[int]) -> np.ndarray:
        """The stored vectors of ``labels`` (a copy, ``(len(labels), dim)``)."""
        return self._vecs[[self._pos[int(x)] for x in labels]].copy()

    def labels(self) -> np.ndarray:
        return self._labels[: self._n]


HNSW_OPTIONS = ("connectivity", "expansion_search", "expansion_add", "dtype", "oversample",
                "threads")


def _check_options(kind: str, options: dict[str, Any] | None, names: tuple[str, ...],
                   build: Any) -> dict[str, Any]:
    """Validate index options by name, then by building a tiny index with them (``build``);
    returns a copy. Unknown names or bad values raise ``ConfigError``."""
    from ..errors import ConfigError

    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ConfigError(f"{kind} options must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(f"unknown {kind} option(s) {unknown}; choose from {list(names)}")
    try:
        build(4, **options)
    except ConfigError:
        raise
    except Exception as exc:  # e.g. usearch rejects an unknown dtype
        raise ConfigError(f"bad {kind} options {options!r}: {exc}") from exc
    return dict(options)


def check_hnsw_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Validate HNSW graph options (names of :class:`HNSWIndex` keywords)."""
    from ..errors import ConfigError

    for name in ("connectivity", "expansion_add", "oversample"):
        v = (options or {}).get(name, 1) if isinstance(options, dict) else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"hnsw option {name} must be a positive int, got {v!r}")
    return _check_options("hnsw", options, HNSW_OPTIONS, HNSWIndex)


class HNSWIndex:
    """usearch HNSW graph for navigation, exact float32 similarities for the answer.

    The graph stores vectors quantised to int8 (``dtype="i8"``, cosine metric: the vectors are
    unit, so cosine equals inner product); that makes inserts ~5x and searches ~4x faster than
    float32 on AVX-512 and keeps recall@1 at least as high on 384-d vectors
    (``benchmarks.semantic.speed``). The ``oversample * k`` graph candidates are then
    re-scored against an exact float32 copy (a :class:`FlatIndex`), so the similarities the hit
    policies compare with thresholds are exact, not quantised. Degree ``connectivity=32``: on
    vectors with MiniLM's covariance it reaches a given recall at half the latency of M=16 from
    100k entries up, for inserts about half as fast (``bench_semantic_hnsw_ef.py, in git history``).
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
        0.932 at 64, 0.982 at 128, 0.996 at 256 (``bench_semantic_hnsw_ef.py, in git history``).
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


IVF_OPTIONS = ("nlist", "nprobe", "oversample", "min_train", "background", "seed")


def check_ivf_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Validate IVF options (names of :class:`IVFIndex` keywords)."""
    return _check_options("ivf", options, IVF_OPTIONS, IVFIndex)


class _Build:
    """A rebuild of an :class:`IVFIndex` running on a snapshot, and the changes made since."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.log: list[tuple[str, np.ndarray, np.ndarray | None]] = []
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None


class IVFIndex:
    """faiss inverted-file index for navigation, exact float32 similarities for the answer.

    Vectors are grouped into ``nlist`` k-means cells; a search scores the query against the
    cell centres and scans only the ``nprobe`` nearest cells, whose vectors are stored as int8
    codes (faiss ``IndexIVFScalarQuantizer``, inner product; see :meth:`_make`). The
    ``oversample * k`` candidates are re-scored against an exact float32 copy (a
    :class:`FlatIndex`), so the similarities the hit policies compare with thresholds are
    exact. A cache lookup is a paraphrase of a stored question (cosine ~0.9 to it, ~0.4 to the
    rest), which sits in the same or a neighbouring cell, so few cells need scanning: on
    vectors with MiniLM's covariance at 1M entries it finds the right entry more often than the
    HNSW graph at a quarter of its latency (0.992 at 0.61 ms against 0.976 at 2.59 ms), builds
    21x faster and takes single inserts 11x faster (one centre assignment, no graph walk)
    (``bench_semantic_index.py, in git history``).

    Lifecycle: below ``min_train`` vectors the exact copy is searched (flat). At ``min_train``
    the cells are trained and the index built; after as many adds as the index held when it
    was built (growth to 2x, or full turnover of an LRU-bounded cache whose topics drift) it is
    rebuilt with ``nlist`` sized for the new count. With ``background=True`` (default) a
    (re)build trains on a snapshot in a thread (faiss releases the GIL) while the previous index
    keeps serving; changes made meanwhile are replayed when it is adopted, so no add or remove
    is lost. A build holds a transient copy of the vectors. ``wait()`` blocks until a pending
    build is adopted.

    ``nlist="auto"``: the power of two nearest ``4 * sqrt(2 n)`` (anticipating growth to the
    next rebuild; 4096 at 1M). ``nprobe="auto"``: ``sqrt(nlist)`` (32 cells of 1024, 64 of
    4096), chosen by paraphrase recall (:meth:`auto_nprobe`). Pass ints to pin either.
    """

    def __init__(self, dim: int, *, nlist: int | str = "auto", nprobe: int | str = "auto",
                 oversample: int = 2, min_train: int = 20_000, background: bool = True,
                 seed: int = 0) -> None:
        from ..errors import ConfigError

        try:
            import faiss  # noqa: F401
        except ImportError as exc:  # pragma: no cover - faiss-cpu is a dependency
            raise ConfigError("IVFIndex needs faiss: pip install faiss-cpu") from exc
        for name, v, lo in (("nlist", nlist, 1), ("nprobe", nprobe, 1)):
            if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise ConfigError(f"ivf option {name} must be a positive int or 'auto', got {v!r}")
        for name, v, lo in (("oversample", oversample, 1), ("min_train", min_train, 64),
                            ("seed", seed, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"ivf option {name} must be an int >= {lo}, got {v!r}")
        if not isinstance(background, bool):
            raise ConfigError(f"ivf option background must be a bool, got {background!r}")
        self.dim = dim
        self.nlist, self.nprobe = nlist, nprobe
        self.oversample = oversample
        self.min_train = min_train
        self.background = background
        self.seed = seed
        self._exact = FlatIndex(dim)
        self._ivf: Any = None  # the live faiss index (None: search the exact copy)
        self._scale = 1.0  # its code scale
        self._built_n = 0  # vectors when the live index was built
        self._adds = 0  # adds since then
        self._job: _Build | None = None
        self.builds = 0

    # -- sizing ---------------------------------------------------------------------------
    @staticmethod
    def auto_nlist(n: int) -> int:
        """Cells for an index built over ``n`` vectors: the power of two nearest
        ``4 * sqrt(2 n)``, 64 to 65,536 (the index is rebuilt when it doubles)."""
        want = 4.0 * math.sqrt(2.0 * max(1, n))
        return int(min(65_536, max(64, 2 ** round(math.log2(want)))))

    @staticmethod
    def auto_nprobe(nlist: int) -> int:
        """Cells scanned per search: ``sqrt(nlist)``, at least 8. On vectors with MiniLM's
        covariance, paraphrase recall is 0.99 at 100k entries (1024 cells, 32 scanned) and at
        1M (4096 cells, 64 scanned); ``bench_semantic_index.py, in git history``."""
        return max(8, int(round(math.sqrt(nlist))))

    @property
    def kind(self) -> str:
        return "flat" if self._ivf is None else "ivf"

    @property
    def cells(self) -> int:
        return 0 if self._ivf is None else int(self._ivf.nlist)

    def __len__(self) -> int:
        return len(self._exact)

    def __contains__(self, label: int) -> bool:
        return int(label) in self._exact

    def nbytes(self) -> int:
        n = self._exact.nbytes()
        if self._ivf is not None:
            # codes + ids + the id -> list map, and the centres
            n += int(self._ivf.ntotal) * (self._ivf.code_size + 8 + 16)
            n += int(self._ivf.nlist) * self.dim * 4
        return n

    # -- building -------------------------------------------------------------------------
    def _make(self, vectors: np.ndarray, labels: np.ndarray, nlist: int) -> tuple[Any, float]:
        """Train and fill a faiss index over ``vectors`` (scaled in place); returns it with its
        scale. Codes are the vectors times ``scale``, rounded to int8 (``QT_8bit_direct_signed``,
        no residuals): one multiply-add per dimension, ~1.5x faster to scan than faiss's
        trained 8-bit codes on residuals at the same recall."""
        import faiss

        rng = np.random.default_rng(self.seed)
        cap = 64 * nlist
        pick = (np.sort(rng.choice(len(vectors), cap, replace=False)) if len(vectors) > cap
                else slice(None))
        # one scale for all dimensions (inner products keep their order): the largest
        # coordinate, ignoring the rarest 1e-5, maps to 127; the few beyond are clipped
        peak = float(np.quantile(np.abs(vectors[pick][:100_000]), 1 - 1e-5))
        scale = 127.0 / max(peak, 1e-6)
        np.multiply(vectors, scale, out=vectors)
        np.clip(vectors, -127.0, 127.0, out=vectors)
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFScalarQuantizer(quantizer, self.dim, nlist,
                                            faiss.ScalarQuantizer.QT_8bit_direct_signed,
                                            faiss.METRIC_INNER_PRODUCT, False)
        ivf.cp.niter = 10
        ivf.cp.seed = self.seed
        ivf.cp.max_points_per_centroid = 64
        ivf.cp.min_points_per_centroid = 4
        ivf.train(np.ascontiguousarray(vectors[pick]))
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
        ivf.add_with_ids(vectors, labels)
        return ivf, scale

    def _codes(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` in the live index's code scale."""
        return np.clip(vectors * self._scale, -127.0, 127.0).astype(np.float32)

    def _start_build(self) -> None:
        n = len(self._exact)
        nlist = self.auto_nlist(n) if self.nlist == "auto" else int(self.nlist)
        nlist = max(1, min(nlist, n // 4))
        job = _Build(n)
        vectors = self._exact.vectors().copy()
        labels = self._exact.labels().copy()

        def run() -> None:
            try:
                job.result = self._make(vectors, labels, nlist)
            except BaseException as exc:  # surfaced when adopted
                job.error = exc
            finally:
                job.done.set()

        self._job = job
        self._adds = 0
        if self.background:
            job.thread = threading.Thread(target=run, name="semcomm-ivf-build", daemon=True)
            job.thread.start()
        else:
            run()
            self._adopt()

    def _adopt(self) -> None:
        """Swap in a finished build, replaying the changes made while it ran."""
        job = self._job
        if job is None or not job.done.is_set():
            return
        self._job = None
        if job.error is not None:
            log.warning("IVF index build failed (%s); still serving the previous index", job.error)
            return
        ivf, scale = job.result
        for op, labs, vecs in job.log:
            ivf.remove_ids(labs)
            if op == "add":
                assert vecs is not None
                ivf.add_with_ids(np.clip(vecs * scale, -127.0, 127.0).astype(np.float32), labs)
        self._ivf, self._scale, self._built_n = ivf, scale, job.n
        self.builds += 1

    def _maybe_build(self) -> None:
        if self._job is not None:
            self._adopt()
            return
        n = len(self._exact)
        if n < self.min_train:
            return
        if self._ivf is None or self._adds >= max(self._built_n, self.min_train):
            self._start_build()

    def wait(self, timeout: float | None = None, *, lock: Any = None) -> bool:
        """Block until a pending (re)build is adopted; True when none is pending. ``lock``: the
        lock the caller's other calls into this index hold (taken only to adopt, not while
        waiting)."""
        job = self._job
        if job is not None:
            job.done.wait(timeout)
            with lock if lock is not None else contextlib.nullcontext():
                self._adopt()
        return self._job is None

    # -- VectorIndex ----------------------------------------------------------------------
    def add(self, labels: Sequence[int], vectors: np.ndarray) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        labs = np.asarray(labels, dtype=np.int64).reshape(-1)
        self._exact.add(labs.tolist(), vectors)
        if self._ivf is not None:
            self._ivf.remove_ids(labs)  # re-added labels replace their vector
            self._ivf.add_with_ids(self._codes(vectors), labs)
        if self._job is not None:
            self._job.log.append(("add", labs, vectors))
        self._adds += len(labs)
        self._maybe_build()

    def remove(self, labels: Sequence[int]) -> int:
        labs = np.asarray([int(x) for x in labels if int(x) in self._exact], dtype=np.int64)
        if not len(labs):
            return 0
        self._exact.remove(labs.tolist())
        if self._ivf is not None:
            self._ivf.remove_ids(labs)
        if self._job is not None:
            self._job.log.append(("remove", labs, None))
        if len(self._exact) < self.min_train // 2 and self._job is None:
            self._ivf, self._built_n, self._adds = None, 0, 0  # shrunk: exact is as fast again
        return len(labs)

    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(labels, similarities)`` of the ``k`` nearest, best first; similarities are
        exact float32 inner products."""
        if self._job is not None and self._job.done.is_set():
            self._adopt()
        if self._ivf is None:
            return self._exact.search(vector, k)
        n = len(self._exact)
        if n == 0 or k <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        q = np.asarray(vector, dtype=np.float32).reshape(1, self.dim)
        nprobe = self.auto_nprobe(self._ivf.nlist) if self.nprobe == "auto" else int(self.nprobe)
        self._ivf.nprobe = min(nprobe, self._ivf.nlist)
        _, ids = self._ivf.search(q * self._scale, min(k * self.oversample, n))
        keys = ids[0][ids[0] >= 0]
        pos = self._exact._pos
        rows = np.fromiter((pos[int(x)] for x in keys), dtype=np.int64, count=len(keys))
        sims = self._exact._vecs[rows] @ q[0]
        order = np.argsort(-sims, kind="stable")[:k]
        return keys[order], sims[order].astype(np.float32)

    def vectors_of(self, labels: Sequence[int]) -> np.ndarray:
        pos = self._exact._pos
        return self._exact._vecs[[pos[int(x)] for x in labels]].copy()


class AutoIndex:
    """The cache's default index. ``large="ivf"``: an :class:`IVFIndex`, which searches exactly
    up to ``min_size`` vectors and then builds its inverted lists (``ivf``: its options).
    ``large="hnsw"``: flat until ``min_size`` vectors, then migrated once, in place, to an
    :class:`HNSWIndex` (``hnsw``: its options). ``large=None`` (default): "hnsw" when ``hnsw``
    options or ``hnsw_min`` (the earlier name of ``min_size``) are given, else "ivf"."""

    def __init__(self, dim: int, *, min_size: int = 20_000, large: str | None = None,
                 hnsw: dict[str, Any] | None = None, ivf: dict[str, Any] | None = None,
                 hnsw_min: int | None = None) -> None:
        from ..errors import ConfigError

        if large is None:
            large = "hnsw" if hnsw or hnsw_min is not None else "ivf"
        if large not in ("ivf", "hnsw"):
            raise ConfigError(f"AutoIndex large= must be 'ivf' or 'hnsw', got {large!r}")
        self.dim = dim
        self.min_size = hnsw_min if hnsw_min is not None else min_size
        self.hnsw_min = self.min_size  # name kept for callers of the HNSW-only version
        self.large = large
        self.hnsw_options = dict(hnsw or {})
        self.ivf_options = dict(ivf or {})
        self._impl: FlatIndex | HNSWIndex | IVFIndex
        if large == "ivf":
            opts = {"min_train": self.min_size, **self.ivf_options}
            self._impl = IVFIndex(dim, **opts)
        else:
            self._impl = FlatIndex(dim)

    @property
    def kind(self) -> str:
        if isinstance(self._impl, IVFIndex):
            return self._impl.kind
        return "flat" if isinstance(self._impl, FlatIndex) else "hnsw"

    def __len__(self) -> int:
        return len(self._impl)

    def __contains__(self, label: int) -> bool:
        return label in self._impl

    def nbytes(self) -> int:
        return self._impl.nbytes()

    def add(self, labels: Sequence[int], vectors: np.ndarray) -> None:
        self._impl.add(labels, vectors)
        if isinstance(self._impl, FlatIndex) and len(self._impl) >= self.min_size:
            flat = self._impl
            h = HNSWIndex(self.dim, **self.hnsw_options)
            h.add(flat.labels().tolist(), flat.vectors())
            self._impl = h

    def remove(self, labels: Sequence[int]) -> int:
        return self._impl.remove(labels)

    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self._impl.search(vector, k)

    def vectors_of(self, labels: Sequence[int]) -> np.ndarray:
        return self._impl.vectors_of(labels)

    def wait(self, timeout: float | None = None, *, lock: Any = None) -> bool:
        """Block until a pending IVF build is adopted (no-op for the other kinds)."""
        if isinstance(self._impl, IVFIndex):
            return self._impl.wait(timeout, lock=lock)
        return True


_KINDS = {"flat": FlatIndex, "hnsw": HNSWIndex, "ivf": IVFIndex, "auto": AutoIndex}


def make_index(kind: str, dim: int) -> VectorIndex:
    """Build an index by name: ``"flat"``, ``"hnsw"``, ``"ivf"`` or ``"auto"``."""
    from ..errors import ConfigError

    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ConfigError(f"unknown index kind {kind!r}; choose one of {sorted(_KINDS)}") from None
    return cls(dim)  # type: ignore[no-any-return]
