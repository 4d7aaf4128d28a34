"""The semantic answer cache (:class:`SemanticCache`)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, InvalidInputError
from ._context import ContextLike, Scope, context_window, entry_id, partition_key
from ._embed import Embedder, as_embedder
from ._entry import Entry
from ._guard import LexicalGuard
from ._index import (
    AutoIndex,
    FlatIndex,
    HNSWIndex,
    IVFIndex,
    VectorIndex,
    check_hnsw_options,
    check_ivf_options,
)
from ._policy import DEFAULT_THRESHOLD, Candidate, HitPolicy, ThresholdPolicy, make_policy
from ._stores import EntryStore, MemoryEntryStore, SQLiteEntryStore, Sync

__all__ = ["EVICTION_POLICIES", "CacheStats", "Hit", "SemanticCache", "open_store"]

log = logging.getLogger(__name__)

ScopeLike = str | Scope


@dataclass(frozen=True, slots=True)
class Hit:
    """A cache hit."""

    answer: str
    similarity: float  # cosine similarity between the query and the stored query
    entry_id: str
    age_s: float  # seconds since the entry was stored
    query: str  # the stored query that matched
    scope: str
    model: str
    tags: tuple[str, ...]
    metadata: dict[str, Any]
    verified: bool = False  # a verifier confirmed this hit


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
    invalidated: int = 0
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


@dataclass(slots=True)
class _Slot:
    """In-process metadata for one indexed entry (mutated only under the cache lock)."""

    label: int
    partition: str
    query: str
    scope: str
    tenant: str
    model: str
    tags: frozenset[str]
    created_at: float
    expires_at: float | None
    ttl_s: float | None
    nbytes: int
    hits: int = 0
    last_access: float = 0.0


def _lru_victims(slots: OrderedDict[str, _Slot], n: int) -> list[str]:
    return [k for k, _ in zip(slots, range(n), strict=False)]


def _lfu_victims(slots: OrderedDict[str, _Slot], n: int) -> list[str]:
    # fewest hits first, ties by least recent (OrderedDict order is recency)
    order = sorted(enumerate(slots.items()), key=lambda kv: (kv[1][1].hits, kv[0]))
    return [k for _, (k, _) in order[:n]]


EVICTION_POLICIES: dict[str, Callable[[OrderedDict[str, _Slot], int], list[str]]] = {
    "lru": _lru_victims,
    "lfu": _lfu_victims,
}


def open_store(store: Any = None, path: str | os.PathLike[str] | None = None) -> EntryStore:
    """An entry store from an object, a URL (``redis://``, ``sqlite:///``, ``memory://``)
    or a SQLite path."""
    if store is not None and path is not None:
        raise ConfigError("pass either path= (SQLite) or store=, not both")
    if store is None:
        return MemoryEntryStore() if path is None else SQLiteEntryStore(path)
    if isinstance(store, str):
        if store.startswith(("redis://", "rediss://", "unix://")):
            from ._redis import RedisEntryStore

            return RedisEntryStore(store)
        if store.startswith("sqlite:///"):
            return SQLiteEntryStore(store[len("sqlite:///"):])
        if store in ("memory", "memory://"):
            return MemoryEntryStore()
        raise ConfigError(f"unknown store URL {store!r}; use redis://..., sqlite:///path or memory")
    if all(hasattr(store, m) for m in ("put", "get", "delete", "poll", "load_all")):
        return store  # type: ignore[no-any-return]
    raise ConfigError(f"store must be a URL or an entry store object, got {type(store).__name__}")


_INDEX_KINDS: dict[str, Callable[[int], VectorIndex]] = {
    "flat": FlatIndex,
    "hnsw": HNSWIndex,
    "ivf": IVFIndex,
    "auto": AutoIndex,
}


class SemanticCache:
    """A semantic answer cache: paraphrases of a stored query get its stored answer.

    Invariants:

    - a key is (query meaning, partition); the partition is exact: scope name, tenant salt
      digest, model identity and the context window (system prompt + last ``context_turns``
      turns) -- see :mod:`semcomm.semantic._context`;
    - every indexed vector has a slot and a stored row; eviction, expiry, invalidation and
      deletes seen from other processes remove the vector from the index;
    - a row that fails validation is never served (deleted, counted in ``corrupt``).

    Parameters: ``embedder`` (None -> all-MiniLM-L6-v2; a model path, SentenceTransformer,
    callable or :class:`~semcomm.semantic.Embedder`), ``path`` (SQLite file; None -> memory),
    ``store`` (an entry store or a URL), ``policy`` (None -> fixed threshold
    :data:`DEFAULT_THRESHOLD`; a name from :data:`POLICIES` or a policy object), ``threshold``
    (shortcut for the fixed-threshold policy), ``guard`` (the lexical near-miss guard; False
    disables it), ``context_turns``, ``max_entries`` / ``max_bytes`` with ``eviction``
    ("lru"/"lfu"), ``ttl`` (default TTL seconds) with ``refresh_on_hit`` (a hit restarts the
    entry's TTL; default False: an answer expires ``ttl`` seconds after it was stored however
    often it is read), ``index`` ("auto", "flat", "ivf" or "hnsw"; "auto": exact up to 20,000
    vectors per partition, then inverted lists, or the HNSW graph when ``hnsw`` options are
    given) with ``ivf`` (options for :class:`~semcomm.semantic.IVFIndex`: ``nlist``,
    ``nprobe`` (int or "auto"), ``oversample``, ``min_train``, ``background``, ``seed``) and
    ``hnsw`` (options for the HNSW graph: ``connectivity``, ``expansion_search`` (int or
    "auto"), ``expansion_add``, ``dtype``, ``oversample``, ``threads``), ``salter`` (a
    :class:`semcomm.security.TenantSalter`), ``candidates`` (neighbours examined per lookup),
    ``verifier`` (``f(query, cached_query) -> bool``) with ``verify_scopes`` (scope names whose
    hits are served only after the verifier confirms them: for high-stakes scopes),
    ``cross_encoder`` (default False; True: the best candidate at or above the threshold of
    a policy the cache builds -- the default, ``threshold=`` or a policy name -- is served only
    when the shipped :class:`~semcomm.semantic.CrossEncoderVerifier` gives it ``P >= 0.5``,
    identical text needs no check; or any scorer ``f(query, best, runner_up) -> P``). The
    cross-encoder learned QQP's strict notion of "duplicate": more precise hits on QQP-like
    traffic, fewer hits on loose everyday paraphrases.
    """

    def __init__(
        self,
        embedder: Any = None,
        path: str | os.PathLike[str] | None = None,
        store: Any = None,
        policy: Any = None,
        *,
        threshold: float | None = None,
        guard: LexicalGuard | bool | None = True,
        context_turns: int = 2,
        max_entries: int | None = 100_000,
        max_bytes: int | None = None,
        eviction: str = "lru",
        ttl: float | None = None,
        refresh_on_hit: bool = False,
        index: str = "auto",
        salter: Any = None,
        candidates: int = 8,
        sync_interval_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        verifier: Callable[[str, str], bool] | None = None,
        verify_scopes: Iterable[str] = (),
        cross_encoder: Any = False,
        hnsw: dict[str, Any] | None = None,
        ivf: dict[str, Any] | None = None,
    ) -> None:
        if threshold is not None and policy is not None:
            raise ConfigError("pass either threshold= or policy=, not both")
        self.policy: HitPolicy = (ThresholdPolicy(threshold) if threshold is not None
                                  else make_policy(policy))
        built_here = policy is None or isinstance(policy, str)
        if cross_encoder is not None and cross_encoder is not False and built_here and \
                isinstance(self.policy, ThresholdPolicy) and self.policy.scorer is None:
            if cross_encoder is True:
                from ._cross import default_cross_verifier

                cross_encoder = default_cross_verifier()
            if not callable(cross_encoder):
                raise ConfigError("cross_encoder must be True, False or a scorer "
                                  f"f(query, best, runner_up) -> P, got {type(cross_encoder).__name__}")
            self.policy.scorer = cross_encoder
            self.policy.min_score = float(getattr(cross_encoder, "threshold", 0.5))
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy {eviction!r}; choose one of "
                              f"{sorted(EVICTION_POLICIES)}")
        if index not in _INDEX_KINDS:
            raise ConfigError(f"unknown index kind {index!r}; choose one of {sorted(_INDEX_KINDS)}")
        self.hnsw_options = check_hnsw_options(hnsw)
        self.ivf_options = check_ivf_options(ivf)
        if hnsw and ivf:
            raise ConfigError("pass hnsw= or ivf= options, not both: they configure different "
                              "indexes")
        for name, v in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
        if ttl is not None and ttl <= 0:
            raise ConfigError(f"ttl must be positive seconds or None, got {ttl!r}")
        if context_turns < 0:
            raise ConfigError(f"context_turns must be >= 0, got {context_turns!r}")
        self.verify_scopes = frozenset(verify_scopes)
        if self.verify_scopes and verifier is None:
            raise ConfigError("verify_scopes needs a verifier: pass verifier=f(query, cached_query)")
        if verifier is not None and not callable(verifier):
            raise ConfigError(f"verifier must be callable, got {type(verifier).__name__}")
        self.verifier = verifier
        self.embedder: Embedder = as_embedder(embedder)
        self.backend: EntryStore = open_store(store, path)
        self.guard: LexicalGuard | None = (LexicalGuard() if guard is True or guard is None
                                           else (guard or None))
        self.context_turns = context_turns
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.eviction = eviction
        self.default_ttl = ttl
        self.refresh_on_hit = refresh_on_hit
        self.index_kind = index
        self.k = max(1, candidates)
        self.sync_interval_s = sync_interval_s
        self._salter = salter
        self._clock = clock
        self._lock = threading.RLock()
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # recency order (LRU first)
        self._labels: dict[int, str] = {}
        self._next_label = 1
        self._indexes: dict[str, VectorIndex] = {}
        self._bytes = 0
        self._dim: int | None = None
        self._stats = CacheStats()
        self._last_sync = 0.0
        self._loaded = False

    # -- setup -----------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.embedder.dim)
        return self._dim

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            meta = self.backend.read_meta()
            dim = self.dim
            if meta.get("dim") and int(meta["dim"]) != dim:
                raise ConfigError(
                    f"this cache holds {meta['dim']}-dimensional embeddings "
                    f"(embedder {meta.get('embedder', '?')!r}) but embedder "
                    f"{self.embedder.name!r} gives {dim}; open it with the same embedder or "
                    "use a new cache path")
            if meta.get("embedder") and meta["embedder"] != self.embedder.name:
                log.warning("semantic cache was written by embedder %r, now read with %r",
                            meta["embedder"], self.embedder.name)
            if not meta.get("dim"):
                self.backend.write_meta({"dim": str(dim), "embedder": self.embedder.name})
            self._rebuild()
            self._loaded = True

    def _rebuild(self) -> None:
        self._slots.clear()
        self._labels.clear()
        self._indexes.clear()
        self._bytes = 0
        now = self._clock()
        live = [e for e in self.backend.load_all() if not e.expired(now)]
        live.sort(key=lambda e: e.last_hit or e.created_at)
        self._index_entries(live)
        self._enforce_budget()

    def _tenant_digest(self, tenant: str | None) -> str:
        if tenant is None:
            from ..security import NO_TENANT_DIGEST

            return NO_TENANT_DIGEST
        if self._salter is None:
            from ..security import TenantSalter

            self._salter = TenantSalter()
        return str(self._salter.digest(tenant))

    def _resolve(self, scope: ScopeLike, context: ContextLike, model: str | None,
                 tenant: str | None) -> tuple[str, str, str, str]:
        if isinstance(scope, Scope):
            sc = scope
            if tenant is not None and sc.tenant is not None and tenant != sc.tenant:
                raise InvalidInputError("tenant given twice with different values")
            tenant = tenant if tenant is not None else sc.tenant
        elif isinstance(scope, str):
            sc = Scope(scope)
        else:
            raise InvalidInputError(f"scope must be a string or a Scope, got {type(scope).__name__}")
        if model is not None and not isinstance(model, str):
            raise InvalidInputError(f"model must be a string, got {type(model).__name__}")
        td = self._tenant_digest(tenant)
        window = context_window(context, self.context_turns)
        return partition_key(sc.name, td, model or "", window), sc.name, td, model or ""

    @staticmethod
    def _check_query(query: Any, what: str = "query") -> str:
        if not isinstance(query, str):
            raise InvalidInputError(f"{what} must be a string, got {type(query).__name__}")
        if not query.strip():
            raise InvalidInputError(f"{what} must not be empty")
        return query

    def _embed(self, text: str, embedding: Any = None) -> np.ndarray:
        if embedding is None:
            vec = self.embedder.embed([text])[0]
        else:
            vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
            n = float(np.linalg.norm(vec))
            if n > 0:
                vec = vec / n
        if vec.shape[0] != self.dim:
            raise InvalidInputError(f"embedding has dimension {vec.shape[0]}, this cache "
                                    f"uses {self.dim}")
        return vec.astype(np.float32, copy=False)

    # -- index maintenance (under lock) ---------------------------------------------------------
    def _new_index(self) -> VectorIndex:
        if self.index_kind == "hnsw":
            return HNSWIndex(self.dim, **self.hnsw_options)
        if self.index_kind == "ivf":
            return IVFIndex(self.dim, **self.ivf_options)
        if self.index_kind == "auto":
            return AutoIndex(self.dim, hnsw=self.hnsw_options, ivf=self.ivf_options)
        return _INDEX_KINDS[self.index_kind](self.dim)

    def _index_entry(self, e: Entry) -> None:
        self._index_entries([e])

    def _index_entries(self, entries: Sequence[Entry]) -> None:
        """Add entries to their partitions' indexes, one batched add per partition."""
        batches: dict[str, tuple[list[int], list[np.ndarray]]] = {}
        for e in entries:
            if e.vector.shape[0] != self.dim:
                log.warning("skipping entry %s with dimension %d", e.id, e.vector.shape[0])
                continue
            old = self._slots.pop(e.id, None)
            if old is not None:
                label = old.label
                self._bytes -= old.nbytes
                if old.partition != e.partition:  # pragma: no cover - id collision
                    self._indexes[old.partition].remove([label])
            else:
                label = self._next_label
                self._next_label += 1
                self._labels[label] = e.id
            labs, vecs = batches.setdefault(e.partition, ([], []))
            labs.append(label)
            vecs.append(e.vector)
            nb = e.nbytes()
            self._slots[e.id] = _Slot(label, e.partition, e.query, e.scope, e.tenant, e.model,
                                      frozenset(e.tags), e.created_at, e.expires_at, e.ttl_s,
                                      nb, e.hits, e.last_hit or e.created_at)
            self._bytes += nb
        for part, (labs, vecs) in batches.items():
            idx = self._indexes.get(part)
            if idx is None:
                idx = self._indexes[part] = self._new_index()
            idx.add(labs, np.stack(vecs))

    def _unindex(self, ids: Iterable[str]) -> list[str]:
        gone = []
        for i in ids:
            s = self._slots.pop(i, None)
            if s is None:
                continue
            idx = self._indexes.get(s.partition)
            if idx is not None:
                idx.remove([s.label])
                if len(idx) == 0:
                    del self._indexes[s.partition]
            self._labels.pop(s.label, None)
            self._bytes -= s.nbytes
            gone.append(i)
        if gone:
            self.policy.forget(gone)
        return gone

    def _over_budget(self) -> int:
        n = 0
        if self.max_entries is not None and len(self._slots) > self.max_entries:
            n = len(self._slots) - self.max_entries
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            n = max(n, 1)
        return n

    def _enforce_budget(self) -> list[str]:
        victims: list[str] = []
        pick = EVICTION_POLICIES[self.eviction]
        while (n := self._over_budget()) > 0:
            if self.max_bytes is not None and self._bytes > self.max_bytes:
                # evict enough for the byte budget too (average entry size estimate)
                avg = max(1, self._bytes // max(1, len(self._slots)))
                n = max(n, -(-(self._bytes - self.max_bytes) // avg))
            chosen = pick(self._slots, n)
            if not chosen:
                break
            victims.extend(self._unindex(chosen))
        if victims:
            self._stats.evictions += len(victims)
        return victims

    def _apply_sync(self, sync: Sync) -> None:
        if sync.reset:
            self._rebuild()
            return
        if sync.deletes:
            self._unindex(sync.deletes)
        now = self._clock()
        self._index_entries([e for e in sync.upserts if not e.expired(now)])
        if sync.upserts:
            victims = self._enforce_budget()
            if victims:
                self.backend.delete(victims)

    def sync(self) -> None:
        """Apply inserts and deletes made by other processes (lookups do this themselves)."""
        self._ensure_loaded()
        with self._lock:
            self._apply_sync(self.backend.poll())
            self._last_sync = time.monotonic()

    def _maybe_sync(self) -> None:
        if isinstance(self.backend, MemoryEntryStore):
            return
        if time.monotonic() - self._last_sync >= self.sync_interval_s:
            self.sync()

    # -- public API ------------------------------------------------------------------------
    def lookup(self, query: str, *, scope: ScopeLike = "default", context: ContextLike = None,
               model: str | None = None, tenant: str | None = None,
               tags: Iterable[str] = (), threshold: float | None = None,
               embedding: Any = None) -> Hit | None:
        """Return a :class:`Hit` for a stored query that means the same, or None.

        ``tags``: the reader's tags; an entry stored with tags is visible only to readers that
        hold all of them. ``threshold`` overrides the policy's cosine threshold for this call.
        ``embedding`` skips the embedder (a precomputed vector for ``query``).
        """
        self._check_query(query)
        part, scope_name, _, _ = self._resolve(scope, context, model, tenant)
        reader = frozenset(tags)
        self._ensure_loaded()
        self._maybe_sync()
        vec = self._embed(query, embedding)
        now = self._clock()
        with self._lock:
            self._stats.lookups += 1
            idx = self._indexes.get(part)
            cands: list[Candidate] = []
            expired: list[str] = []
            if idx is not None and len(idx):
                labels, sims = idx.search(vec, self.k)
                # candidates below the policy's floor can never be served; one is looked at only
                # as the runner-up a scorer reads next to a servable best, otherwise they are
                # not guarded or offered at all
                floor = getattr(self.policy, "min_similarity", None)
                if floor is not None and threshold is not None:
                    floor = min(float(floor), float(threshold))
                scored = getattr(self.policy, "scorer", None) is not None
                for lab, sim in zip(labels.tolist(), sims.tolist(), strict=True):
                    if floor is not None and sim < floor and (
                            len(cands) >= 2 or not cands or not scored):
                        break
                    eid = self._labels.get(int(lab))
                    s = self._slots.get(eid) if eid is not None else None
                    if s is None:
                        continue
                    if s.expires_at is not None and now >= s.expires_at:
                        expired.append(eid)  # type: ignore[arg-type]
                        continue
                    if not s.tags <= reader:
                        continue
                    if self.guard is not None and not self.guard(query, s.query):
                        self._stats.guarded += 1
                        continue
                    cands.append(Candidate(eid, s.query, float(sim)))  # type: ignore[arg-type]
            if expired:
                self._unindex(expired)
                self._stats.expired += len(expired)
        if expired:
            self.backend.delete(expired)
        decision = self.policy.decide(query, cands, threshold=threshold)
        self._stats.verifications += decision.verifications
        c = decision.candidate
        verified = decision.verified
        if c is not None and scope_name in self.verify_scopes and not verified:
            # sensitive scope: nothing is served that the verifier has not confirmed
            assert self.verifier is not None
            with self._lock:
                self._stats.verifications += 1
            if self.verifier(query, c.query):
                verified = True
            else:
                with self._lock:
                    self._stats.verifier_rejections += 1
                c = None
        if c is None:
            with self._lock:
                self._stats.misses += 1
            return None
        entry = self.backend.get(c.entry_id)
        with self._lock:
            if entry is None or entry.expired(now):
                self._unindex([c.entry_id])
                self._stats.misses += 1
                self._stats.corrupt = self.backend.corrupt
                return None
            s = self._slots.get(c.entry_id)
            if s is not None:
                s.hits += 1
                s.last_access = now
                self._slots.move_to_end(c.entry_id)
            self._stats.hits += 1
            refresh = self.refresh_on_hit and entry.ttl_s is not None
            if refresh:
                entry.expires_at = now + float(entry.ttl_s)  # type: ignore[arg-type]
                entry.hits += 1
                entry.last_hit = now
                if s is not None:
                    s.expires_at = entry.expires_at
        if refresh:
            self.backend.put(entry)
        return Hit(answer=entry.answer, similarity=c.similarity, entry_id=entry.id,
                   age_s=max(0.0, now - entry.created_at), query=entry.query, scope=entry.scope,
                   model=entry.model, tags=entry.tags, metadata=dict(entry.metadata),
                   verified=verified)

    def store(self, query: str, answer: str, *, scope: ScopeLike = "default",
              context: ContextLike = None, model: str | None = None, tenant: str | None = None,
              ttl: float | None = None, tags: Iterable[str] = (),
              metadata: dict[str, Any] | None = None, embedding: Any = None) -> str:
        """Store ``answer`` for ``query``; returns the entry id (same query + partition
        overwrites). ``ttl`` seconds (default: the cache's ``ttl``)."""
        return self.store_many([query], [answer], scope=scope, context=context, model=model,
                               tenant=tenant, ttl=ttl, tags=tags, metadata=metadata,
                               embeddings=None if embedding is None else [embedding])[0]

    def store_many(self, queries: Sequence[str], answers: Sequence[str], *,
                   scope: ScopeLike = "default", context: ContextLike = None,
                   model: str | None = None, tenant: str | None = None,
                   ttl: float | None = None, tags: Iterable[str] = (),
                   metadata: dict[str, Any] | None = None,
                   embeddings: Any = None) -> list[str]:
        """Store several answers in one batch (one embedding batch, one transaction)."""
        if isinstance(queries, str) or isinstance(answers, str):
            raise InvalidInputError("store_many takes lists of queries and answers")
        if len(queries) != len(answers):
            raise InvalidInputError(f"{len(queries)} queries but {len(answers)} answers")
        for q in queries:
            self._check_query(q)
        for a in answers:
            if not isinstance(a, str):
                raise InvalidInputError(f"answer must be a string, got {type(a).__name__} "
                                        "(serialise structured answers to JSON)")
        ttl = self.default_ttl if ttl is None else ttl
        if ttl is not None and (not isinstance(ttl, (int, float)) or ttl <= 0):
            raise InvalidInputError(f"ttl must be positive seconds, got {ttl!r}")
        tag_t = tuple(sorted(set(tags)))
        if any(not isinstance(t, str) or not t for t in tag_t):
            raise InvalidInputError("tags must be non-empty strings")
        meta = dict(metadata or {})
        part, sc, td, mdl = self._resolve(scope, context, model, tenant)
        self._ensure_loaded()
        if embeddings is None:
            vecs = self.embedder.embed(list(queries))
        else:
            vecs = np.stack([self._embed(q, e) for q, e in zip(queries, embeddings, strict=True)])
        if vecs.shape[1] != self.dim:
            raise InvalidInputError(f"embedding has dimension {vecs.shape[1]}, this cache "
                                    f"uses {self.dim}")
        now = self._clock()
        entries = [
            Entry(id=entry_id(part, q), partition=part, query=q, answer=a, vector=v, model=mdl,
                  scope=sc, tenant=td, tags=tag_t, created_at=now, ttl_s=ttl,
                  expires_at=None if ttl is None else now + ttl, embedder=self.embedder.name,
                  metadata=meta)
            for q, a, v in zip(queries, answers, vecs, strict=True)
        ]
        put_many = getattr(self.backend, "put_many", None)
        if put_many is not None:
            put_many(entries)
        else:
            for e in entries:
                self.backend.put(e)
        with self._lock:
            self._index_entries(entries)
            self._stats.stores += len(entries)
            victims = self._enforce_budget()
        if victims:
            self.backend.delete(victims)
        return [e.id for e in entries]

    def invalidate(self, entry_id: str | None = None, *, tag: str | None = None,
                   scope: ScopeLike | None = None, tenant: str | None = None,
                   model: str | None = None) -> int:
        """Delete entries by id, by tag, or by scope (optionally narrowed by tenant and model).
        Returns how many were deleted."""
        if entry_id is None and tag is None and scope is None:
            raise InvalidInputError("invalidate() needs an entry id, a tag or a scope "
                                    "(use clear() to drop everything)")
        self._ensure_loaded()
        self._maybe_sync()
        sname: str | None = None
        td: str | None = None
        if scope is not None:
            if isinstance(scope, Scope):  # a Scope names its tenant (None: the public one)
                sname = scope.name
                td = self._tenant_digest(tenant if tenant is not None else scope.tenant)
            else:  # a bare scope name: every tenant's entries in it, unless tenant= narrows
                sname = scope
                td = self._tenant_digest(tenant) if tenant is not None else None
        with self._lock:
            ids = []
            for i, s in self._slots.items():
                if entry_id is not None and i != entry_id:
                    continue
                if tag is not None and tag not in s.tags:
                    continue
                if sname is not None and s.scope != sname:
                    continue
                if td is not None and s.tenant != td:
                    continue
                if model is not None and s.model != model:
                    continue
                ids.append(i)
            gone = self._unindex(ids)
            self._stats.invalidated += len(gone)
        if gone:
            self.backend.delete(gone)
        return len(gone)

    def clear(self) -> None:
        """Drop every entry (in this store: other processes sharing it see the clear)."""
        self.backend.clear()
        with self._lock:
            self._slots.clear()
            self._labels.clear()
            self._indexes.clear()
            self._bytes = 0
            if hasattr(self.backend, "poll"):
                self.backend.poll()  # consume our own clear

    def stats(self) -> CacheStats:
        """Counters and sizes (reads a persistent store's index first; never loads a model
        for an empty in-memory cache)."""
        if not isinstance(self.backend, MemoryEntryStore):
            self._ensure_loaded()
        with self._lock:
            st = CacheStats(**{k: getattr(self._stats, k) for k in CacheStats.__slots__})  # type: ignore[attr-defined]
            st.entries = len(self._slots)
            st.bytes = self._bytes
            st.corrupt = self.backend.corrupt
            st.errors = int(getattr(self.backend, "errors", 0))
            st.store = self.backend.name
            kinds = {getattr(i, "kind", type(i).__name__) for i in self._indexes.values()}
            st.index = ",".join(sorted(kinds)) or self.index_kind
            st.policy = getattr(self.policy, "name", type(self.policy).__name__)
            st.max_entries = self.max_entries
            st.max_bytes = self.max_bytes
            st.extra = {"partitions": len(self._indexes),
                        "index_vectors": sum(len(i) for i in self._indexes.values())}
            return st

    def wait_index(self, timeout: float | None = None) -> bool:
        """Block until every partition's pending index build (IVF cells are trained in a
        background thread while the previous index serves) is in use; True when none is left
        pending. Lookups and stores go on meanwhile."""
        with self._lock:
            indexes = list(self._indexes.values())
        return all([idx.wait(timeout, lock=self._lock) for idx in indexes if hasattr(idx, "wait")])

    def entries(self) -> list[Entry]:
        """All live entries (validated rows from the store), for export."""
        self._ensure_loaded()
        now = self._clock()
        return [e for e in self.backend.load_all() if not e.expired(now)]

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> SemanticCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        self._ensure_loaded()
        return len(self._slots)

    # -- async twins -----------------------------------------------------------------------
    # Embedding is CPU-bound and store I/O may block: both run in a worker thread so the event
    # loop stays responsive; the index search itself takes microseconds.
    async def alookup(self, query: str, **kwargs: Any) -> Hit | None:
        """Async :meth:`lookup`."""
        return await asyncio.to_thread(self.lookup, query, **kwargs)

    async def astore(self, query: str, answer: str, **kwargs: Any) -> str:
        """Async :meth:`store`."""
        return await asyncio.to_thread(self.store, query, answer, **kwargs)

    async def astore_many(self, queries: Sequence[str], answers: Sequence[str],
                          **kwargs: Any) -> list[str]:
        return await asyncio.to_thread(self.store_many, queries, answers, **kwargs)

    async def ainvalidate(self, entry_id: str | None = None, **kwargs: Any) -> int:
        return await asyncio.to_thread(self.invalidate, entry_id, **kwargs)

    async def aclear(self) -> None:
        await asyncio.to_thread(self.clear)

    async def astats(self) -> CacheStats:
        return self.stats()


__all__ += ["DEFAULT_THRESHOLD"]
