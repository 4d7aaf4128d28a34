"""The semantic answer cache (:class:`SemanticCache`): the lookup and store paths.

A lookup resolves its partition (:mod:`._context`), catches up with the entry store
(:class:`~._sync.StoreSync`), embeds the query and gathers the candidates: the partition's
nearest entries (:class:`~._table.EntryTable`) that are unexpired (:class:`~._ttl.Expiry`),
readable with the reader's tags, trusted and passed by the lexical guard (:mod:`._guard`),
with their answer clusters' figures when the policy reads them
(:class:`~._clusters.AnswerClusters`). The hit policy (:mod:`._policy`) decides; a miss it
refused for a rival answer alone is decided once more after the two clusters join, when their
answers mean the same (:class:`~._clusters.AnswerLinker`). A sensitive scope's verifier has the
last word; the hit is read from the store and served, or in shadow mode recorded instead
(:class:`~._shadow.ShadowTracker`).

A store validates, embeds, links each entry to an answer cluster, writes the rows, indexes
them and keeps the entry and byte budgets (evicting by the ``eviction`` policy).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import numpy as np

from ..errors import ConfigError, InvalidInputError
from ._clusters import MIN_TRUST, AnswerLinker
from ._context import ContextLike, Scope, context_window, entry_id, partition_key
from ._embed import DEFAULT_EMBEDDER_NAME, Embedder, as_embedder
from ._entry import Entry, Slot
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
    Decision,
    HitPolicy,
    ThresholdPolicy,
    make_policy,
)
from ._shadow import MODES, ShadowLog, ShadowTracker
from ._stats import CacheStats
from ._stores import EntryStore, MemoryEntryStore, SQLiteEntryStore
from ._sync import StoreSync
from ._table import EVICTION_POLICIES, EntryTable
from ._ttl import Expiry

__all__ = ["EVICTION_POLICIES", "CacheStats", "Hit", "SemanticCache", "open_store"]

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


# a lookup refused for a rival cluster alone may join at most this many clusters into its
# nearest one when their answers agree (each join costs an answer comparison: one embedding of
# two answers, once per cluster pair)
_MAX_MERGES = 2
# above this many cluster centroids in a partition (a product of about 0.35 ms on the loaded box
# of docs/BENCHMARKS.md), a lookup's rival is the best centroid among the clusters of its
# _RIVAL_NEIGHBOURS nearest entries instead of all of them: on the development FAQ sets the two
# agree on every margin decision from 16 neighbours on (the sets of bench_semantic_rule.py, in git history)
_RIVAL_SCAN_ROWS = 8192
_RIVAL_NEIGHBOURS = 32
# one contradiction costs this much trust; an agreement gives back half of it
_CONTRADICTION = 0.5
# an entry at or below this trust is deleted
_DROP_TRUST = 0.0


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


_T = TypeVar("_T")


class _Kept(Generic[_T]):
    """A :class:`SemanticCache` setting that one of its collaborators keeps: read and set
    through it (``cache.max_entries = 10`` takes effect at the next store)."""

    def __init__(self, owner: str, name: str) -> None:
        self.owner, self.name = owner, name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Kept[_T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> _T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.owner), self.name)

    def __set__(self, obj: object, value: _T) -> None:
        setattr(getattr(obj, self.owner), self.name, value)


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

    max_entries = _Kept[int | None]("_table", "max_entries")
    max_bytes = _Kept[int | None]("_table", "max_bytes")
    eviction = _Kept[str]("_table", "eviction")
    default_ttl = _Kept[float | None]("_expiry", "default")
    refresh_on_hit = _Kept[bool]("_expiry", "refresh_on_hit")
    sync_interval_s = _Kept[float]("_sync", "interval_s")
    answer_match = _Kept[Any]("_linker", "match")

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
        self._expiry = Expiry(ttl, refresh_on_hit)
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
        self.mode = mode
        self.shadow = ShadowLog(shadow_log)
        self.backend: EntryStore = open_store(store, path)
        self.guard: LexicalGuard | None = (LexicalGuard() if guard is True or guard is None
                                           else (guard or None))
        self.context_turns = context_turns
        self.index_kind = index
        self.k = max(1, candidates)
        self._salter = salter
        self._clock = clock
        self._dim: int | None = None
        self._lock = threading.RLock()
        self._stats = CacheStats()
        # the collaborators (each mutated under self._lock)
        self._table = EntryTable(lambda: self.dim, self._new_index,
                                 forget=lambda ids: self.policy.forget(ids), stats=self._stats,
                                 max_entries=max_entries, max_bytes=max_bytes,
                                 eviction=eviction)
        self._linker = AnswerLinker(self._table, self._lock, self._stats,
                                    entry=self.backend.get, match=answer_match,
                                    embed=lambda texts: self.embedder.embed(texts),
                                    k=lambda: self.k)
        self._sync = StoreSync(self.backend, self._table, self._lock,
                               embedder_name=self.embedder.name, dim=lambda: self.dim,
                               clock=clock, interval_s=sync_interval_s)
        self._shadow = ShadowTracker(self.shadow, self._lock, self._stats,
                                     entry=self.backend.get, agree=self._linker.agree,
                                     feedback=self._feedback_entry)

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

    # -- setup -----------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.embedder.dim)
        return self._dim

    def _new_index(self) -> VectorIndex:
        if self.index_kind == "hnsw":
            return HNSWIndex(self.dim, **self.hnsw_options)
        if self.index_kind == "ivf":
            return IVFIndex(self.dim, **self.ivf_options)
        if self.index_kind == "auto":
            return AutoIndex(self.dim, hnsw=self.hnsw_options, ivf=self.ivf_options)
        return _INDEX_KINDS[self.index_kind](self.dim)

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

    def sync(self) -> None:
        """Apply inserts and deletes made by other processes (lookups do this themselves)."""
        self._sync.sync()

    # -- lookup ----------------------------------------------------------------------------
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
        self._sync.ensure_loaded()
        self._sync.maybe_sync()
        vec = self._embed(query, embedding)
        now = self._clock()
        cands, among = self._candidates(query, part, vec, reader, threshold, now)
        decision = self._decide(query, part, vec, cands, among, threshold)
        c, verified = self._verify_scope(query, scope_name, decision)
        if self.mode == "shadow":
            self._shadow.record(query, part, scope_name, c or (cands[0] if cands else None),
                                c is not None, decision.reason, now)
            return None
        return self._serve(c, decision.reason, verified, now)

    def _candidates(self, query: str, part: str, vec: np.ndarray, reader: frozenset[str],
                    threshold: float | None, now: float
                    ) -> tuple[list[Candidate], list[str] | None]:
        """The partition's nearest entries the policy is offered, best first, and the
        clusters whose centroids are the rivals (None: all of the partition's).

        A candidate is unexpired (an expired entry is removed on the way), readable with the
        ``reader``'s tags, trusted and passed by the guard; it carries its cluster's figures
        when the policy uses centroids. Entries below the policy's ``min_similarity`` can never
        be served: one is looked at only as the runner-up a ``scorer`` reads next to a servable
        best, otherwise they are not guarded or offered at all."""
        policy, table = self.policy, self._table
        cands: list[Candidate] = []
        expired: list[str] = []
        among: list[str] | None = None
        with self._lock:
            self._stats.lookups += 1
            idx = table.indexes.get(part)
            if idx is not None and len(idx):
                cc = table.clusters.centroids.get(part) if policy.uses_centroids else None
                wide = cc is not None and len(cc) > _RIVAL_SCAN_ROWS
                labels, sims = table.search(part, vec, max(self.k, _RIVAL_NEIGHBOURS) if wide
                                            else self.k)
                if wide:  # many clusters: rivals among a wider neighbourhood's clusters
                    among = [table.slots[e].cluster for e in
                             (table.labels.get(int(x)) for x in labels)
                             if e is not None and e in table.slots]
                    labels, sims = labels[: self.k], sims[: self.k]
                floor = policy.min_similarity
                if threshold is not None:
                    floor = min(float(floor), float(threshold))
                scored = policy.scorer is not None
                for lab, sim in zip(labels, sims, strict=True):
                    if sim < floor and (len(cands) >= 2 or not cands or not scored):
                        break
                    found = table.at_label(lab)
                    if found is None:
                        continue
                    eid, s = found
                    if Expiry.slot_expired(s, now):
                        expired.append(eid)
                        continue
                    if not s.tags <= reader:
                        continue
                    if s.trust < MIN_TRUST:
                        self._stats.distrusted += 1
                        continue
                    if not self._guard_ok(query, s):
                        self._stats.guarded += 1
                        continue
                    cands.append(Candidate(eid, s.query, float(sim), s.cluster))
            if expired:
                table.remove(expired)
                self._stats.expired += len(expired)
            if policy.uses_centroids:
                table.clusters.views(part, vec, cands, table.indexes.get(part), among,
                                     policy.intent_metric)
        if expired:
            self.backend.delete(expired)
        return cands, among

    def _guard_ok(self, query: str, s: Slot) -> bool:
        g = self.guard
        if g is None:
            return True
        check = getattr(g, "check", None)
        if check is None:
            return bool(g(query, s.query))
        r = check(query, s.query)
        if r.ok:
            return True
        clusters = self._table.clusters
        return clusters.size(s.cluster) > 1 and r.reason in clusters.waived_checks(
            s.cluster, s.answer_key)

    def _decide(self, query: str, part: str, vec: np.ndarray, cands: list[Candidate],
                among: list[str] | None, threshold: float | None) -> Decision:
        """The policy's decision on ``cands``. A miss refused for a rival answer alone
        (``Decision.rival_blocked``) may be one answer the store did not link (e.g. a bulk
        load of answers worded differently): when the rival's answer means the same, its
        cluster joins the blocked one and the policy decides on the joined candidates (at
        most :data:`_MAX_MERGES` joins)."""
        decision = self.policy.decide(query, cands, threshold=threshold)
        joins = 0
        while (decision.candidate is None and decision.rival_blocked is not None
               and joins < _MAX_MERGES
               and self._linker.join_rival(part, vec, cands, decision.rival_blocked, among,
                                           self.policy.intent_metric)):
            joins += 1
            decision = self.policy.decide(query, cands, threshold=threshold)
        self._stats.verifications += decision.verifications
        if decision.reason == "intent-rejected":
            self._stats.intent_rejected += 1
        return decision

    def _verify_scope(self, query: str, scope: str,
                      decision: Decision) -> tuple[Candidate | None, bool]:
        """A sensitive scope (``verify_scopes``) serves nothing the verifier has not
        confirmed: (the candidate to serve or None, whether it is verified)."""
        c, verified = decision.candidate, decision.verified
        if c is not None and scope in self.verify_scopes and not verified:
            assert self.verifier is not None
            with self._lock:
                self._stats.verifications += 1
            if self.verifier(query, c.query):
                verified = True
            else:
                with self._lock:
                    self._stats.verifier_rejections += 1
                c = None
        return c, verified

    def _serve(self, c: Candidate | None, reason: str, verified: bool, now: float) -> Hit | None:
        """The hit for ``c``, read from the store (None: a miss, or the row is gone)."""
        if c is None:
            with self._lock:
                self._stats.misses += 1
            return None
        entry = self.backend.get(c.entry_id)
        with self._lock:
            if entry is None or entry.expired(now):
                self._table.remove([c.entry_id])
                self._stats.misses += 1
                self._stats.corrupt = self.backend.corrupt
                return None
            s = self._table.slots.get(c.entry_id)
            if s is not None:
                s.hits += 1
                s.last_access = now
                self._table.slots.move_to_end(c.entry_id)
            self._stats.hits += 1
            refresh = self._expiry.on_hit(entry, s, now)
        if refresh:
            self.backend.put(entry)
        return Hit(answer=entry.answer, similarity=c.similarity, entry_id=entry.id,
                   age_s=max(0.0, now - entry.created_at), query=entry.query, scope=entry.scope,
                   model=entry.model, tags=entry.tags, metadata=dict(entry.metadata),
                   verified=verified, cluster=c.cluster_key, reason=reason)

    # -- shadow mode and feedback -----------------------------------------------------------
    @property
    def shadow_pending(self) -> int:
        """Shadowed lookups still waiting for the model's real answer to be stored."""
        return len(self._shadow)

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
        self._sync.ensure_loaded()
        return self._feedback_entry(eid, bool(correct))

    def _feedback_entry(self, eid: str, correct: bool) -> float:
        with self._lock:
            s = self._table.slots.get(eid)
            if s is None:
                return 0.0
            if correct:
                trust = min(1.0, s.trust + _CONTRADICTION / 2)
            else:
                trust = s.trust - _CONTRADICTION
                self._stats.contradicted += 1
            if trust == s.trust:
                return trust
            if (s.trust < MIN_TRUST) != (trust < MIN_TRUST):
                self._table.clusters.trust_moved(s)  # it leaves or rejoins the centroid's sum
            s.trust = trust
            drop = trust <= _DROP_TRUST
            if drop:
                self._table.remove([eid])
                self._stats.invalidated += 1
        if drop:
            self.backend.delete([eid])
            return 0.0
        entry = self.backend.get(eid)
        if entry is not None:
            entry.trust = trust
            self.backend.put(entry)
        return trust

    # -- store -----------------------------------------------------------------------------
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
        ttl = self._expiry.ttl_for(ttl)
        tag_t = tuple(sorted(set(tags)))
        if any(not isinstance(t, str) or not t for t in tag_t):
            raise InvalidInputError("tags must be non-empty strings")
        meta = dict(metadata or {})
        part, sc, td, mdl = self._resolve(scope, context, model, tenant)
        self._sync.ensure_loaded()
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
                  expires_at=Expiry.expires_at(now, ttl), embedder=self.embedder.name,
                  metadata=meta)
            for q, a, v in zip(queries, answers, vecs, strict=True)
        ]
        if self.shadow_pending:
            for q, a in zip(queries, answers, strict=True):
                self._shadow.finish(part, q, a)
        self._linker.link(part, entries)
        put_many = getattr(self.backend, "put_many", None)
        if put_many is not None:
            put_many(entries)
        else:
            for e in entries:
                self.backend.put(e)
        with self._lock:
            self._table.add(entries)
            self._stats.stores += len(entries)
            victims = self._table.enforce_budget()
        if victims:
            self.backend.delete(victims)
        return [e.id for e in entries]

    # -- maintenance -------------------------------------------------------------------------
    def invalidate(self, entry_id: str | None = None, *, tag: str | None = None,
                   scope: ScopeLike | None = None, tenant: str | None = None,
                   model: str | None = None) -> int:
        """Delete entries by id, by tag, or by scope (optionally narrowed by tenant and model).
        Returns how many were deleted."""
        if entry_id is None and tag is None and scope is None:
            raise InvalidInputError("invalidate() needs an entry id, a tag or a scope "
                                    "(use clear() to drop everything)")
        self._sync.ensure_loaded()
        self._sync.maybe_sync()
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
            for i, s in self._table.slots.items():
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
            gone = self._table.remove(ids)
            self._stats.invalidated += len(gone)
        if gone:
            self.backend.delete(gone)
        return len(gone)

    def clear(self) -> None:
        """Drop every entry (in this store: other processes sharing it see the clear)."""
        self._sync.clear()

    def stats(self) -> CacheStats:
        """Counters and sizes (reads a persistent store's index first; never loads a model
        for an empty in-memory cache)."""
        if not isinstance(self.backend, MemoryEntryStore):
            self._sync.ensure_loaded()
        with self._lock:
            st = CacheStats(**{k: getattr(self._stats, k) for k in CacheStats.__slots__})  # type: ignore[attr-defined]
            st.entries = len(self._table)
            st.bytes = self._table.bytes
            st.corrupt = self.backend.corrupt
            st.errors = int(getattr(self.backend, "errors", 0))
            st.store = self.backend.name
            indexes = self._table.indexes.values()
            kinds = {getattr(i, "kind", type(i).__name__) for i in indexes}
            st.index = ",".join(sorted(kinds)) or self.index_kind
            st.policy = self.policy.name
            st.max_entries = self.max_entries
            st.max_bytes = self.max_bytes
            st.extra = {"partitions": len(indexes),
                        "index_vectors": sum(len(i) for i in indexes)}
            return st

    def wait_index(self, timeout: float | None = None) -> bool:
        """Block until every partition's pending index build (IVF cells are trained in a
        background thread while the previous index serves) is in use; True when none is left
        pending. Lookups and stores go on meanwhile."""
        with self._lock:
            indexes = list(self._table.indexes.values())
        return all([idx.wait(timeout, lock=self._lock) for idx in indexes if hasattr(idx, "wait")])

    def entries(self) -> list[Entry]:
        """All live entries (validated rows from the store), for export."""
        self._sync.ensure_loaded()
        now = self._clock()
        return [e for e in self.backend.load_all() if not e.expired(now)]

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> SemanticCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        self._sync.ensure_loaded()
        return len(self._table)

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
