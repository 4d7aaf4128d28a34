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
from ._centroids import ClusterCentroids
from ._context import ContextLike, Scope, context_window, entry_id, partition_key
from ._embed import DEFAULT_EMBEDDER_NAME, Embedder, as_embedder
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
from ._policy import (
    DEFAULT_THRESHOLD,
    VERIFIED_MIN_SCORE,
    VERIFIED_THRESHOLD,
    Candidate,
    ClusterVotePolicy,
    HitPolicy,
    ThresholdPolicy,
    make_policy,
)
from ._shadow import MIN_EMBED_WORDS, MODES, ShadowLog, ShadowRecord, answers_agree
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
    cluster: str = ""  # the answer cluster that served it
    reason: str = ""  # the policy's reason: "centroid" (a cluster hit), "threshold", ...


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
    cluster: str = ""  # answer cluster key (an entry id)
    answer_key: str = ""  # digest of the normalised answer text
    trust: float = 1.0


# an entry whose trust fell below this is neither served nor part of its cluster's centroid
_MIN_TRUST = 0.75
# clusters a lookup may join into its nearest one when their answers agree (each join costs an
# answer comparison: one embedding of two answers, once per cluster pair)
_MAX_MERGES = 2
# above this many cluster centroids in a partition (a product of about 0.35 ms on the loaded box
# of docs/BENCHMARKS.md), a lookup's rival is the best centroid among the clusters of its
# _RIVAL_NEIGHBOURS nearest entries instead of all of them: on the development FAQ sets the two
# agree on every margin decision from 16 neighbours on (the sets of bench_semantic_rule.py, in git history)
_RIVAL_SCAN_ROWS = 8192
_RIVAL_NEIGHBOURS = 32
# differing cluster pairs remembered (cleared when full)
_MAX_DISTINCT_PAIRS = 65_536
# one contradiction costs this much trust; an agreement gives back half of it
_CONTRADICTION = 0.5
# an entry at or below this trust is deleted
_DROP_TRUST = 0.0
# a stored query links to a neighbour's cluster only when it is at least this similar to it
_LINK_FLOOR = 0.5
# guard checks waived for a cluster whose own members already differ in that respect
_WAIVABLE = frozenset({"number", "entity", "date", "question"})


def _answer_key(answer: str) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(" ".join(answer.lower().split()).encode())


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
    ``store`` (an entry store or a URL), ``policy`` (None ->
    :class:`~semcomm.semantic.ClusterVotePolicy`: answer clusters served by their centroids, a
    lone entry needs
    :data:`DEFAULT_THRESHOLD`, or with the default embedder :data:`VERIFIED_THRESHOLD` and the
    cross-encoder's yes (``cross_encoder``); a name from :data:`POLICIES` or a policy object), ``threshold``
    (shortcut for the fixed-threshold policy, no clusters), ``guard`` (the lexical near-miss guard; False
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
    ``cross_encoder`` (default "auto": with the default embedder and no ``policy=`` or
    ``threshold=``, the policy is ``ClusterVotePolicy(VERIFIED_THRESHOLD, scorer=<the shipped
    CrossEncoderVerifier>, min_score=VERIFIED_MIN_SCORE)``: a lone candidate at cos >= 0.91 is
    served only when the cross-encoder gives it ``P >= 0.65``; cluster hits and identical texts
    are not scored; one MiniLM pair forward per scored lookup, see docs/BENCHMARKS.md; with
    another embedder "auto" means off, its cosines are on another scale. False: the plain
    0.92 rule. True: the best candidate at or above the threshold of a policy the cache builds
    -- ``threshold=`` or a policy name -- is served only when the cross-encoder gives it
    ``P >= 0.5``; or any scorer ``f(query, best, runner_up) -> P``). The cross-encoder learned
    QQP's strict notion of "duplicate": more precise hits on QQP-like traffic, fewer hits on
    loose everyday paraphrases ("How can I lose weight fast?" / "How do I lose weight fast?"
    is refused). ``intent_check`` (default "auto": with the default embedder and a cluster
    policy the cache builds, the shipped :class:`~semcomm.semantic.IntentMetric`) is the
    learned check every centroid hit must also pass (an action is not its topic: "make a
    vacation request" is not served a cluster of "is my vacation request approved"
    phrasings); microseconds a lookup, no model call; False turns it off, True asks for the
    shipped one (default embedder only), or pass an ``IntentMetric`` fitted on your embedder.

    Answer clusters: entries of one partition whose answers are the same text (case and
    spacing aside) or, with ``answer_match`` (default 0.8: cosine of the two answers'
    embeddings, chosen on a development stream (docs/BENCHMARKS.md), checked against the stored query's near neighbours only; a callable
    ``f(answer_a, answer_b) -> bool``; None: same text only), mean the same, form one cluster.
    The default policy (:class:`~semcomm.semantic.ClusterVotePolicy`, ``rule="centroid"``)
    serves a cluster by its centroid (the cache keeps one per cluster of 2+ phrasings,
    :mod:`semcomm.semantic._centroids`; a lookup refused for a rival cluster alone joins the
    two when their answers agree by ``answer_match``), and the lexical guard waives its number,
    entity, date and
    question-word checks for a cluster whose own phrasings already differ in that respect (the
    answer evidently does not depend on it). :meth:`feedback` lowers the trust of an entry whose
    served answer was contradicted.

    ``mode``: "serve" (default) or "shadow": every lookup returns None (the model answers), and
    the cache records what it would have served; the next :meth:`store` of the same query
    compares the real answer with it (see :mod:`semcomm.semantic._shadow`, ``shadow_log`` a
    JSONL file for ``semcomm cache report``).
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
        cross_encoder: Any = "auto",
        intent_check: Any = "auto",
        hnsw: dict[str, Any] | None = None,
        ivf: dict[str, Any] | None = None,
        answer_match: Any = 0.8,
        mode: str = "serve",
        shadow_log: str | os.PathLike[str] | None = None,
    ) -> None:
        if threshold is not None and policy is not None:
            raise ConfigError("pass either threshold= or policy=, not both")
        self.policy: HitPolicy = (ThresholdPolicy(threshold) if threshold is not None
                                  else make_policy(policy))
        self.embedder: Embedder = as_embedder(embedder)
        built_here = policy is None or isinstance(policy, str)
        if isinstance(cross_encoder, str) and cross_encoder == "auto":
            # the default: with the default embedder (the cosine scale the band was measured
            # on), every lone candidate at cos >= VERIFIED_THRESHOLD is checked by the shipped
            # cross-encoder; cluster hits and identical texts are not (docs/semantic.md)
            cross_encoder = False
            if policy is None and threshold is None and \
                    getattr(self.embedder, "name", "") == DEFAULT_EMBEDDER_NAME:
                from ._cross import default_cross_verifier

                self.policy = ClusterVotePolicy(VERIFIED_THRESHOLD, scorer=default_cross_verifier(),
                                                min_score=VERIFIED_MIN_SCORE)
        self._set_intent_check(intent_check, built_here)
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
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; choose one of {sorted(MODES)}")
        if answer_match is not None and not callable(answer_match) and not (
                isinstance(answer_match, (int, float)) and not isinstance(answer_match, bool)
                and 0.0 < float(answer_match) <= 1.0):
            raise ConfigError("answer_match must be a cosine in (0, 1], a callable "
                              f"f(answer_a, answer_b) -> bool or None, got {answer_match!r}")
        self.answer_match = answer_match
        self.mode = mode
        self.shadow = ShadowLog(shadow_log)
        self._pending: OrderedDict[tuple[str, str], ShadowRecord] = OrderedDict()
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
        # answer clusters (under the lock): (partition, answer key) -> cluster, how many indexed
        # entries carry that answer, the members of each cluster and which guard checks each
        # cluster waives (computed on demand, dropped when its members change)
        self._answer_cluster: dict[tuple[str, str], str] = {}
        self._answer_refs: dict[tuple[str, str], int] = {}
        self._members: dict[str, set[str]] = {}
        # cluster -> answer text digest -> guard checks waived (see _waived_checks)
        self._waived: dict[str, dict[str, frozenset[str]]] = {}
        # partition -> centroids of its multi-member answer clusters (the centroid rule's view)
        self._centroids: dict[str, ClusterCentroids] = {}
        # cluster pairs whose answers were compared and differ (not compared again)
        self._distinct_answers: set[tuple[str, str]] = set()
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
        for d in (self._answer_cluster, self._answer_refs, self._members, self._waived,
                  self._centroids, self._distinct_answers):
            d.clear()
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
            if old is not None:
                self._drop_member(e.id, old)
            labs, vecs = batches.setdefault(e.partition, ([], []))
            labs.append(label)
            vecs.append(e.vector)
            nb = e.nbytes()
            akey = _answer_key(e.answer)
            cluster = e.cluster or self._answer_cluster.get((e.partition, akey)) or e.id
            slot = _Slot(label, e.partition, e.query, e.scope, e.tenant, e.model,
                         frozenset(e.tags), e.created_at, e.expires_at, e.ttl_s,
                         nb, e.hits, e.last_hit or e.created_at, cluster, akey, e.trust)
            self._slots[e.id] = slot
            self._add_member(e.id, slot, e.vector)
            self._bytes += nb
        for part, (labs, vecs) in batches.items():
            idx = self._indexes.get(part)
            if idx is None:
                idx = self._indexes[part] = self._new_index()
            idx.add(labs, np.stack(vecs))

    def _add_member(self, eid: str, s: _Slot, vector: np.ndarray) -> None:
        ak = (s.partition, s.answer_key)
        self._answer_cluster.setdefault(ak, s.cluster)
        self._answer_refs[ak] = self._answer_refs.get(ak, 0) + 1
        members = self._members.setdefault(s.cluster, set())
        members.add(eid)
        self._waived.pop(s.cluster, None)
        if len(members) >= 2:
            cc = self._centroids.get(s.partition)
            if cc is None:
                cc = self._centroids[s.partition] = ClusterCentroids(self.dim)
            if s.trust < _MIN_TRUST or cc.counted(s.cluster) != len(members) - 1:
                cc.discard(s.cluster)  # recounted from its trusted members before a lookup
            else:
                cc.add(s.cluster, vector, len(members))

    def _drop_member(self, eid: str, s: _Slot) -> None:
        ak = (s.partition, s.answer_key)
        n = self._answer_refs.get(ak, 0) - 1
        if n <= 0:
            self._answer_refs.pop(ak, None)
            self._answer_cluster.pop(ak, None)
        else:
            self._answer_refs[ak] = n
        m = self._members.get(s.cluster)
        if m is not None:
            m.discard(eid)
            if not m:
                del self._members[s.cluster]
        self._waived.pop(s.cluster, None)
        cc = self._centroids.get(s.partition)
        if cc is not None:
            cc.discard(s.cluster)

    def _merge_rival(self, part: str, vec: np.ndarray, cands: list[Candidate],
                     win: Candidate, among: list[str] | None) -> bool:
        """Join the cluster that blocked ``win`` (the nearest other centroid, or a nearer lone
        candidate) into ``win``'s when their answers agree (``answer_match``); refresh the
        candidates' cluster figures. False: no rival, or answers that differ (remembered)."""
        if self.answer_match is None:
            return False
        keep = win.cluster_key
        with self._lock:
            cc = self._centroids.get(part)
            other = cc.nearest_other(vec, keep, among) if cc is not None else None
        lone = max((c for c in cands if c.centroid is None and c.cluster_key != keep),
                   key=lambda c: c.similarity, default=None)
        if lone is not None and (other is None or lone.similarity >= other[1]):
            gone, gone_entry = lone.cluster_key, lone.entry_id
        elif other is not None:
            gone = other[0]
            with self._lock:
                gone_entry = next(iter(self._members.get(gone, ())), "")
        else:
            return False
        pair = (min(keep, gone), max(keep, gone))
        if not gone_entry or pair in self._distinct_answers:
            return False
        a, b = self.backend.get(win.entry_id), self.backend.get(gone_entry)
        if a is None or b is None:
            return False
        if not answers_agree(a.answer, b.answer, self.answer_match, self.embedder.embed):
            if len(self._distinct_answers) >= _MAX_DISTINCT_PAIRS:
                self._distinct_answers.clear()
            self._distinct_answers.add(pair)
            return False
        with self._lock:
            moved = self._merge_clusters(part, keep, gone)
            if not moved:
                return False
            for c in cands:
                if c.cluster_key == gone:
                    c.cluster = keep
                c.centroid = c.cohesion = c.rival = c.intent = None
            self._cluster_views(part, vec, cands, among)
        log.debug("joined answer cluster %s (%d entries) into %s", gone, moved, keep)
        return True

    def _merge_clusters(self, part: str, keep: str, gone: str) -> int:
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
            if self._answer_cluster.get(ak) == gone:
                self._answer_cluster[ak] = keep
        self._waived.pop(keep, None)
        self._waived.pop(gone, None)
        cc = self._centroids.get(part)
        if cc is None:
            cc = self._centroids[part] = ClusterCentroids(self.dim)
        cc.recount(gone, np.zeros((0, self.dim)))
        cc.discard(keep)
        self._stats.linked += len(moved)
        return len(moved)

    def _set_intent_check(self, intent_check: Any, built_here: bool) -> None:
        """``intent_check``: "auto" (the shipped metric when the policy is the default's
        cluster policy with the default embedder), True (the shipped metric; the default
        embedder only), False (none) or an :class:`~semcomm.semantic.IntentMetric`."""
        if isinstance(intent_check, str) and intent_check == "auto":
            intent_check = (built_here and isinstance(self.policy, ClusterVotePolicy)
                            and getattr(self.embedder, "name", "") == DEFAULT_EMBEDDER_NAME)
            if not intent_check:
                return
        if intent_check is False or intent_check is None:
            if isinstance(self.policy, ClusterVotePolicy) and built_here:
                self.policy.intent_metric = None
            return
        if not isinstance(self.policy, ClusterVotePolicy):
            raise ConfigError("intent_check applies to the answer-cluster policy "
                              f"(ClusterVotePolicy), not {type(self.policy).__name__}")
        if intent_check is True:
            from ._intent import default_intent_metric

            intent_check = default_intent_metric()
        name = getattr(intent_check, "embedder", None)
        if name is not None and name != getattr(self.embedder, "name", name):
            raise ConfigError(f"intent_check was fitted on {name!r} vectors, this cache embeds "
                              f"with {getattr(self.embedder, 'name', '?')!r}")
        self.policy.intent_metric = intent_check

    def _cluster_views(self, part: str, vec: np.ndarray, cands: list[Candidate],
                       among: list[str] | None = None) -> None:
        """Fill in each candidate's cluster centroid, cohesion and rival (see
        :mod:`._centroids`): the centroid rule of the default policy reads them."""
        cc = self._centroids.get(part)
        if cc is None or not cands:
            return
        idx = self._indexes.get(part)
        vectors_of = getattr(idx, "vectors_of", None)
        for cluster in cc.dirty:
            if vectors_of is None:
                break  # an index that cannot give vectors back: those clusters stay out
            # distrusted members (trust below _MIN_TRUST) are no candidates and no part of the
            # centroid either
            labels = [self._slots[m].label for m in self._members.get(cluster, ())
                      if m in self._slots and self._slots[m].partition == part
                      and self._slots[m].trust >= _MIN_TRUST]
            cc.recount(cluster, vectors_of(labels) if labels else np.zeros((0, self.dim)))
        views = cc.view(vec, [c.cluster_key for c in cands], among)
        for c in cands:
            v = views.get(c.cluster_key)
            if v is not None:
                c.centroid, c.cohesion, c.rival = v.centroid, v.cohesion, v.rival
        metric = getattr(self.policy, "intent_metric", None)
        if metric is not None and views:
            # the intent check's score of the query against each cluster met (semantic._intent)
            best: dict[str, float] = {}
            for c in cands:
                if c.cluster_key in views:
                    best[c.cluster_key] = max(best.get(c.cluster_key, -1.0), c.similarity)
            score = {k: metric.score(vec, cc.centroid_vector(k), b) for k, b in best.items()}
            for c in cands:
                if c.cluster_key in score:
                    c.intent = score[c.cluster_key]

    def _waived_checks(self, cluster: str, answer_key: str) -> frozenset[str]:
        """Guard checks waived for a candidate of ``cluster`` whose answer text is
        ``answer_key``: those the cluster's members with that same answer text already disagree
        on (the answer evidently does not depend on them). Members whose answers only resemble
        it (``answer_match``) do not count: a generated answer that names its own number ("The
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
        return per.get(answer_key, frozenset())

    def _guard_ok(self, query: str, s: _Slot) -> bool:
        g = self.guard
        if g is None:
            return True
        check = getattr(g, "check", None)
        if check is None:
            return bool(g(query, s.query))
        r = check(query, s.query)
        if r.ok:
            return True
        return len(self._members.get(s.cluster, ())) > 1 and r.reason in self._waived_checks(
            s.cluster, s.answer_key)

    def _unindex(self, ids: Iterable[str]) -> list[str]:
        gone = []
        for i in ids:
            s = self._slots.pop(i, None)
            if s is None:
                continue
            self._drop_member(i, s)
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
            among: list[str] | None = None  # rival clusters (None: all of the partition)
            if idx is not None and len(idx):
                cc = self._centroids.get(part) if getattr(self.policy, "uses_centroids",
                                                          False) else None
                wide = cc is not None and len(cc) > _RIVAL_SCAN_ROWS
                labels, sims = idx.search(vec, max(self.k, _RIVAL_NEIGHBOURS) if wide
                                          else self.k)
                if wide:  # many clusters: rivals among a wider neighbourhood's clusters
                    among = [self._slots[e].cluster for e in
                             (self._labels.get(int(x)) for x in labels.tolist())
                             if e is not None and e in self._slots]
                    labels, sims = labels[: self.k], sims[: self.k]
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
                    if s.trust < _MIN_TRUST:
                        self._stats.distrusted += 1
                        continue
                    if not self._guard_ok(query, s):
                        self._stats.guarded += 1
                        continue
                    cands.append(Candidate(eid, s.query, float(sim),  # type: ignore[arg-type]
                                           s.cluster))
            if expired:
                self._unindex(expired)
                self._stats.expired += len(expired)
            if getattr(self.policy, "uses_centroids", False):
                self._cluster_views(part, vec, cands, among)
        if expired:
            self.backend.delete(expired)
        decision = self.policy.decide(query, cands, threshold=threshold)
        blocked = getattr(self.policy, "rival_blocked", None)
        for _ in range(_MAX_MERGES):
            # refused for a rival cluster alone: if the rival's answer means the same, the two
            # are one answer cluster the store did not link (e.g. a bulk load of answers worded
            # differently); join them and decide again
            win = blocked(cands) if blocked is not None and decision.candidate is None else None
            if win is None or not self._merge_rival(part, vec, cands, win, among):
                break
            decision = self.policy.decide(query, cands, threshold=threshold)
        self._stats.verifications += decision.verifications
        if decision.reason == "intent-rejected":
            self._stats.intent_rejected += 1
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
        if self.mode == "shadow":
            self._shadow_lookup(query, part, scope_name, c or (cands[0] if cands else None),
                                c is not None, decision.reason, now)
            return None
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
                   verified=verified, cluster=c.cluster_key, reason=decision.reason)

    def _shadow_lookup(self, query: str, part: str, scope: str, c: Candidate | None,
                       would_serve: bool, reason: str, now: float) -> None:
        """Shadow mode: remember what would have been served until the real answer is stored."""
        entry = self.backend.get(c.entry_id) if c is not None else None
        rec = ShadowRecord(t=now, scope=scope, similarity=None if c is None else c.similarity,
                           would_serve=would_serve and entry is not None,
                           reason=reason if entry is not None or c is None else "gone",
                           entry_id="" if c is None else c.entry_id,
                           cluster="" if c is None else c.cluster_key, query=query,
                           cached_answer="" if entry is None else entry.answer)
        with self._lock:
            self._stats.misses += 1
            self._stats.shadow_lookups += 1
            self._stats.shadow_would_hit += rec.would_serve
            key = (part, " ".join(query.split()))
            self._pending.pop(key, None)
            self._pending[key] = rec
            while len(self._pending) > self.shadow.records.maxlen:  # type: ignore[operator]
                _, old = self._pending.popitem(last=False)
                self.shadow.add(old)  # never compared: logged with agree=None

    def _finish_shadow(self, part: str, query: str, answer: str) -> None:
        with self._lock:
            rec = self._pending.pop((part, " ".join(query.split())), None)
        if rec is None:
            return
        if rec.entry_id:
            rec.agree = answers_agree(answer, rec.cached_answer, self.answer_match,
                                      self.embedder.embed)
            if rec.would_serve:
                self._feedback_entry(rec.entry_id, rec.agree)
        self.shadow.add(rec)

    @property
    def shadow_pending(self) -> int:
        """Shadowed lookups still waiting for the model's real answer to be stored."""
        with self._lock:
            return len(self._pending)

    def shadow_report(self, *, target_precision: float = 0.95, **kw: Any) -> Any:
        """:func:`~semcomm.semantic.shadow_report` over this cache's finished shadow records."""
        from ._shadow import shadow_report

        return shadow_report(list(self.shadow.records), target_precision=target_precision, **kw)

    def feedback(self, hit: Hit | str, correct: bool) -> float:
        """Tell the cache whether a served answer was right (``hit`` or its entry id).

        A contradiction (the user regenerated, a check disagreed) halves the entry's trust: an
        entry below 0.75 is no longer served and leaves its cluster's centroid; a second
        contradiction deletes it. A confirmation gives back a quarter. Returns the new trust
        (0.0 when the entry was deleted or is unknown)."""
        eid = hit.entry_id if isinstance(hit, Hit) else hit
        if not isinstance(eid, str) or not eid:
            raise InvalidInputError("feedback() needs a Hit or an entry id")
        self._ensure_loaded()
        return self._feedback_entry(eid, bool(correct))

    def _feedback_entry(self, eid: str, correct: bool) -> float:
        with self._lock:
            s = self._slots.get(eid)
            if s is None:
                return 0.0
            if correct:
                trust = min(1.0, s.trust + _CONTRADICTION / 2)
            else:
                trust = s.trust - _CONTRADICTION
                self._stats.contradicted += 1
            if trust == s.trust:
                return trust
            if (s.trust < _MIN_TRUST) != (trust < _MIN_TRUST) and s.partition in self._centroids:
                self._centroids[s.partition].discard(s.cluster)  # it leaves or rejoins the sum
            s.trust = trust
            drop = trust <= _DROP_TRUST
            if drop:
                self._unindex([eid])
                self._stats.invalidated += 1
        if drop:
            self.backend.delete([eid])
            return 0.0
        entry = self.backend.get(eid)
        if entry is not None:
            entry.trust = trust
            self.backend.put(entry)
        return trust

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
        if self._pending:
            for q, a in zip(queries, answers, strict=True):
                self._finish_shadow(part, q, a)
        self._link_clusters(part, entries)
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

    def _link_clusters(self, part: str, entries: Sequence[Entry]) -> None:
        """Answer-equivalence learning: a new entry joins the cluster of an entry with the same
        answer text, or (a single store) of a near neighbour (query similarity >= 0.5) whose
        answer means the same (``answer_match``). Entries of one batch with equal answers share
        a cluster."""
        batch: dict[str, str] = {}
        for e in entries:
            ak = _answer_key(e.answer)
            with self._lock:
                old = self._slots.get(e.id)
                if old is not None and old.answer_key == ak:
                    e.cluster, e.trust = old.cluster, old.trust  # same answer re-stored
                    continue
                e.cluster = self._answer_cluster.get((part, ak)) or batch.get(ak, "")
            # by meaning only for one answer at a time (a miss the model just answered): bulk
            # loads link by text, without a neighbour search per entry
            if not e.cluster and self.answer_match is not None and len(entries) == 1 and (
                    callable(self.answer_match) or len(e.answer.split()) >= MIN_EMBED_WORDS):
                e.cluster = self._match_neighbour(part, e)
            if e.cluster:
                with self._lock:
                    self._stats.linked += 1
            batch.setdefault(ak, e.cluster or e.id)

    def _match_neighbour(self, part: str, e: Entry) -> str:
        with self._lock:
            idx = self._indexes.get(part)
            if idx is None or not len(idx):
                return ""
            labels, sims = idx.search(e.vector, self.k)
            near = []
            for lab, sim in zip(labels.tolist(), sims.tolist(), strict=True):
                if sim < _LINK_FLOOR:
                    break
                eid = self._labels.get(int(lab))
                s = self._slots.get(eid) if eid is not None else None
                if s is not None and eid is not None and eid != e.id and s.trust >= _MIN_TRUST:
                    near.append((eid, s.cluster))
        for eid, cluster in near:
            other = self.backend.get(eid)
            if other is not None and answers_agree(e.answer, other.answer, self.answer_match,
                                                   self.embedder.embed):
                return cluster
        return ""

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
            self._answer_cluster.clear()
            self._answer_refs.clear()
            self._members.clear()
            self._waived.clear()
            self._centroids.clear()
            self._distinct_answers.clear()
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
