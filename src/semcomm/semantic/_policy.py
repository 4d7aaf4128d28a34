"""Hit policies: given the ranked candidates for a query, decide whether to answer from cache.

One unit everywhere: **cosine similarity** in [-1, 1] between unit embeddings (a threshold
of 0.9 means "cos >= 0.9"). Candidates reach a policy already filtered: same partition (scope,
tenant, model, context window), readable by the caller's tags, unexpired, and passed by the
lexical near-miss guard (:mod:`._guard`).

Policies (registry :data:`POLICIES`, chosen by name or passed as objects):

- ``"cluster"`` :class:`ClusterVotePolicy` (the default): the stored phrasings that led to one
  answer (a cluster) are judged together: the query is served a cluster's answer at a lower
  similarity than a lone entry's when it is as close to the cluster's centroid as the
  cluster's own phrasings are and clearly closer to it than to any other cluster's (the
  centroid rule; ``rule="vote"``: the earlier neighbour vote); a lone entry is served by the
  fixed threshold.
- ``"threshold"`` :class:`ThresholdPolicy`: hit when ``similarity >= threshold``; the threshold
  can be overridden per call; an optional verifier must also agree.
- ``"calibrated"``: a :class:`ThresholdPolicy` whose threshold comes from labelled pairs at a
  target precision (:func:`calibrate_threshold`, ``semcomm cache calibrate``).
- ``"error_bounded"`` :class:`ErrorBoundedPolicy`: the user sets ``max_error``; thresholds are
  learned online from verifier calls (vCache-style), see the class docstring.

A policy object meets :class:`HitPolicy`: ``decide`` and ``forget`` and the members the cache
reads (``name``, ``min_similarity``, ``scorer``, ``uses_centroids``, ``intent_metric``);
:class:`PolicyBase` gives them defaults, and the shipped policies subclass it.

A verifier is any ``f(query, cached_query) -> bool`` ("would the model answer both the same?"):
a cross-encoder, a rule, or the model itself.
"""

from __future__ import annotations

import math
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, InvalidInputError

__all__ = [
    "CLUSTER_RULES",
    "DEFAULT_THRESHOLD",
    "LEAD_FLOOR",
    "POLICIES",
    "VERIFIED_MIN_SCORE",
    "VERIFIED_THRESHOLD",
    "CalibrationResult",
    "Candidate",
    "ClusterVotePolicy",
    "Decision",
    "ErrorBoundedPolicy",
    "HitPolicy",
    "IntentCheck",
    "PolicyBase",
    "ScoredCut",
    "Scorer",
    "ThresholdPolicy",
    "Verifier",
    "calibrate_scored_cut",
    "calibrate_threshold",
    "lead_score",
    "make_policy",
]

Scorer = Callable[..., float]
"""``scorer(query, best, runner_up) -> P(right)``: sees the best and the runner-up candidate."""

Verifier = Callable[[str, str], bool]
"""``verifier(query, cached_query) -> bool``: True when the cached answer is right for query."""

DEFAULT_THRESHOLD = 0.92
"""Default cosine threshold (with the lexical guard on), chosen on meancache_val.csv (2,000-pair
cache protocol) as the most precise setting that keeps recall near 30 %; measured test-split
precision and recall are in docs/BENCHMARKS.md."""


@dataclass(slots=True)
class Candidate:
    """One stored entry offered to a policy (best first)."""

    entry_id: str
    query: str  # the stored entry's query text
    similarity: float  # cosine similarity to the lookup query
    cluster: str = ""  # the answer cluster the entry belongs to ("" -> its own)
    # filled in by the cache for a member of a cluster of 2+ phrasings (semantic._centroids),
    # for policies that set ``uses_centroids``; None otherwise:
    centroid: float | None = None  # cosine of the lookup query to the cluster's centroid
    cohesion: float | None = None  # the cluster's members' mean cosine to the others' centroid
    rival: float | None = None  # best centroid cosine of another cluster (-1.0: none)
    # filled in with the centroid figures when the policy has an ``intent_metric``
    # (semantic._intent): its score of the lookup query against this candidate's cluster
    intent: float | None = None

    @property
    def cluster_key(self) -> str:
        return self.cluster or self.entry_id


@dataclass(slots=True)
class Decision:
    """A policy's verdict: the candidate to serve, or None for a miss."""

    candidate: Candidate | None
    verified: bool = False  # a verifier confirmed this hit
    verifications: int = 0  # verifier calls spent on this lookup
    reason: str = ""  # "threshold" | "centroid" | "vote" | "verified" | "scored-hit" | "scored" |
    # "exploit" | "below" | "centroid-rejected" | "intent-rejected" | "rejected" | "budget"
    score: float = 0.0  # the evidence the decision rests on (similarity, or a vote margin)
    # a miss the centroid rule refused for the rival margin alone (floor and spread met): its
    # nearest-centroid candidate. The cache may then join the rival's cluster into this one,
    # when their answers mean the same, and decide again (SemanticCache.lookup)
    rival_blocked: Candidate | None = None


VERIFIED_THRESHOLD = 0.91
"""Lone-entry cosine floor of the default policy when the shipped cross-encoder verifies every
lone candidate (MiniLM cosine units; ``SemanticCache()`` with the default embedder)."""

VERIFIED_MIN_SCORE = 0.65
"""Cross-encoder ``P(same question)`` a lone candidate at or above :data:`VERIFIED_THRESHOLD`
needs. Both values are chosen by :func:`calibrate_scored_cut` on a validation split only
(``python -m benchmarks.semantic.fresh --calibrate``: the 2,000 ``meancache_test.csv``
protocol pairs, none of which the cross-encoder trained on, though 314 of their texts occur in
its training file; the cut with the most recall whose precision
has a one-sided 90 % Wilson lower bound >= 0.90). The previous (0.88, 0.7) was read off the same
split without a margin (0.901 there, 0.872 on fresh pairs). docs/BENCHMARKS.md gives the fresh
held-out figures."""


LEAD_FLOOR = 0.80
"""A rival less similar than this counts as this similar in :func:`lead_score` (a lone
candidate with no rival near it gets the lead it would have over a rival at 0.80)."""


def lead_score(p: float, best: Candidate, candidates: Sequence[Candidate], weight: float,
               floor: float = LEAD_FLOOR) -> float:
    """``p`` (a verifier's P(right) for ``best``) moved by how far ``best`` leads its nearest
    rival: ``sigmoid(logit(p) + weight * (best.similarity - max(rival, floor)))``, the rival
    being the most similar candidate of another answer cluster. A query that sits as close to
    another stored question as to the best one is more often wrong on QQP-style traffic (the
    runner-up is a different question of the same topic): on the validation pairs this lead
    separates right from wrong lone candidates about as well as the cross-encoder does, and the
    two together better than either (docs/BENCHMARKS.md)."""
    if not weight:
        return p
    rival = max((c.similarity for c in candidates if c.cluster_key != best.cluster_key),
                default=floor)
    lead = best.similarity - max(rival, floor)
    q = min(max(p, 1e-6), 1.0 - 1e-6)
    z = math.log(q / (1.0 - q)) + weight * lead
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


class IntentCheck(Protocol):
    """A learned check of centroid hits (:class:`~semcomm.semantic.IntentMetric`): the cache
    fills in ``score(query, centroid, best)`` as ``Candidate.intent``; a hit needs ``cut``."""

    cut: float

    def score(self, query: np.ndarray, centroid: np.ndarray, best: float) -> float: ...


@runtime_checkable
class HitPolicy(Protocol):
    """Everything :class:`~semcomm.semantic.SemanticCache` reads of a hit policy.

    :class:`PolicyBase` gives every member but :meth:`decide` a default; a policy object that
    has only some of them is adopted by :func:`make_policy` (the others take those defaults).
    """

    name: str  # reported as ``stats().policy``

    @property
    def scorer(self) -> Scorer | None:
        """A score that reads the runner-up next to the best candidate: the cache then offers
        one candidate below :attr:`min_similarity` as that runner-up."""
        ...

    @property
    def intent_metric(self) -> IntentCheck | None:
        """The intent check of centroid hits: the cache fills in ``Candidate.intent`` with its
        score of the query against each candidate's cluster."""
        ...

    @property
    def min_similarity(self) -> float:
        """No candidate below this cosine can be served: the cache neither guards nor offers
        it (except one runner-up for a ``scorer``). ``-inf``: no floor."""
        ...

    @property
    def uses_centroids(self) -> bool:
        """The cache fills in the candidates' cluster figures (``centroid``, ``cohesion``,
        ``rival``) only for a policy that reads them."""
        ...

    def decide(self, query: str, candidates: Sequence[Candidate], *,
               threshold: float | None = None) -> Decision:
        """The verdict for one lookup; ``threshold`` overrides the policy's for this call."""
        ...

    def forget(self, entry_ids: Sequence[str]) -> None:
        """These entries left the cache (evicted, expired, invalidated)."""
        ...


class PolicyBase:
    """Defaults of the :class:`HitPolicy` members: no floor, no runner-up scorer, no intent
    check, no centroid figures, nothing to forget. Subclass it to write a policy of your own
    (:meth:`decide` is then all that is needed); the shipped policies do."""

    name: str = "custom"
    scorer: Scorer | None = None
    intent_metric: IntentCheck | None = None

    @property
    def min_similarity(self) -> float:
        return -math.inf

    @property
    def uses_centroids(self) -> bool:
        return False

    def decide(self, query: str, candidates: Sequence[Candidate], *,
               threshold: float | None = None) -> Decision:
        """Serve one of ``candidates`` (best first) or refuse: what a subclass writes."""
        raise NotImplementedError(f"{type(self).__name__} does not decide (subclass "
                                  "PolicyBase and write decide)")

    def forget(self, entry_ids: Sequence[str]) -> None:
        return None


_MEMBERS = ("name", "scorer", "intent_metric", "min_similarity", "uses_centroids", "forget")


class _Adopted(PolicyBase):
    """A policy object with ``decide`` but not every :class:`HitPolicy` member (written
    before the protocol named them): the members it has are read from it, the others take
    :class:`PolicyBase`'s defaults. ``inner`` is the object itself. Which members it has is
    looked at once, here."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._has = frozenset(m for m in _MEMBERS if hasattr(inner, m))
        self.name = str(inner.name) if "name" in self._has else type(inner).__name__

    @property
    def scorer(self) -> Scorer | None:  # type: ignore[override]
        return self.inner.scorer if "scorer" in self._has else None

    @property
    def intent_metric(self) -> IntentCheck | None:  # type: ignore[override]
        return self.inner.intent_metric if "intent_metric" in self._has else None

    @property
    def min_similarity(self) -> float:
        return float(self.inner.min_similarity) if "min_similarity" in self._has else -math.inf

    @property
    def uses_centroids(self) -> bool:
        return bool(self.inner.uses_centroids) if "uses_centroids" in self._has else False

    def decide(self, query: str, candidates: Sequence[Candidate], *,
               threshold: float | None = None) -> Decision:
        return self.inner.decide(query, candidates, threshold=threshold)

    def forget(self, entry_ids: Sequence[str]) -> None:
        if "forget" in self._has:
            self.inner.forget(entry_ids)

    def __repr__(self) -> str:
        return repr(self.inner)


def _check_threshold(t: float) -> float:
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not -1.0 <= float(t) <= 1.0:
        raise ConfigError(f"threshold must be a cosine similarity in [-1, 1], got {t!r}")
    return float(t)


class ThresholdPolicy(PolicyBase):
    """Hit when the best candidate's cosine similarity is at least ``threshold``.

    With a ``scorer`` (e.g. :class:`~semcomm.semantic.LexicalVerifier` or the cross-encoder),
    the best candidate above the threshold must also score at least ``min_score`` given the
    runner-up (an identical text, case and spacing aside, needs no score); with
    ``lead_weight`` the score is first moved by the candidate's cosine lead over its nearest
    rival of another answer (:func:`lead_score`).
    With a ``verifier``, candidates above the threshold are offered best first (at most
    ``max_verify``) and the first one the verifier accepts is served.
    """

    name = "threshold"

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, *, verifier: Verifier | None = None,
                 max_verify: int = 2, scorer: Scorer | None = None,
                 min_score: float = 0.5, lead_weight: float = 0.0,
                 lead_floor: float = LEAD_FLOOR) -> None:
        self.threshold = _check_threshold(threshold)
        self.verifier = verifier
        self.max_verify = max_verify
        self.scorer = scorer
        self.min_score = min_score
        if not isinstance(lead_weight, (int, float)) or isinstance(lead_weight, bool) or \
                not 0.0 <= float(lead_weight) <= 1000.0:
            raise ConfigError(f"lead_weight must be logits per unit of cosine in [0, 1000], "
                              f"got {lead_weight!r}")
        self.lead_weight = float(lead_weight)
        self.lead_floor = _check_threshold(lead_floor)

    def decide(self, query: str, candidates: Sequence[Candidate], *,
               threshold: float | None = None) -> Decision:
        t = self.threshold if threshold is None else _check_threshold(threshold)
        above = [c for c in candidates if c.similarity >= t]
        if not above:
            return Decision(None, reason="below")
        if self.scorer is not None:
            best = above[0]
            runner = candidates[1] if len(candidates) > 1 else None
            same_text = " ".join(best.query.lower().split()) == " ".join(query.lower().split())
            if not same_text:
                p = lead_score(float(self.scorer(query, best, runner)), best, candidates,
                               self.lead_weight, self.lead_floor)
                if p < self.min_score:
                    return Decision(None, verifications=1, reason="scored", score=p)
                if self.verifier is None:
                    return Decision(best, verified=True, verifications=1, reason="scored-hit",
                                    score=p)
            above = [best]
        if self.verifier is None:
            return Decision(above[0], reason="threshold")
        spent = 0
        for c in above[: self.max_verify]:
            spent += 1
            if self.verifier(query, c.query):
                return Decision(c, verified=True, verifications=spent, reason="verified")
        return Decision(None, verifications=spent, reason="rejected")

    @property
    def min_similarity(self) -> float:
        """No candidate below this similarity can be served (the cache skips guarding them)."""
        return self.threshold

    def forget(self, entry_ids: Sequence[str]) -> None:
        pass

    def __repr__(self) -> str:
        return f"ThresholdPolicy(threshold={self.threshold}, verifier={self.verifier!r})"


@dataclass(frozen=True, slots=True)
class ClusterVote:
    """The vote of the candidates for one lookup (see :class:`ClusterVotePolicy`)."""

    cluster: str  # the winning cluster ("" when no candidate)
    best: Candidate | None  # its most similar member
    votes: float  # the winner's votes: sum of (similarity - base) over its members
    margin: float  # the winner's votes minus the runner-up cluster's
    support: int  # the winner's members at or above ``base``


def cluster_vote(candidates: Sequence[Candidate], base: float) -> ClusterVote:
    """Group candidates by answer cluster; each member votes ``max(0, similarity - base)``."""
    votes: dict[str, float] = {}
    support: dict[str, int] = {}
    best: dict[str, Candidate] = {}
    for c in candidates:
        k = c.cluster_key
        if c.similarity >= base:
            votes[k] = votes.get(k, 0.0) + (c.similarity - base)
            support[k] = support.get(k, 0) + 1
        else:
            votes.setdefault(k, 0.0)
        if k not in best or c.similarity > best[k].similarity:
            best[k] = c
    if not votes:
        return ClusterVote("", None, 0.0, 0.0, 0)
    ranked = sorted(votes, key=lambda k: (-votes[k], -best[k].similarity))
    win = ranked[0]
    runner = votes[ranked[1]] if len(ranked) > 1 else 0.0
    return ClusterVote(win, best[win], votes[win], votes[win] - runner, support.get(win, 0))


CLUSTER_RULES = ("centroid", "vote")
"""How :class:`ClusterVotePolicy` decides a cluster hit (its ``rule``)."""


class ClusterVotePolicy(ThresholdPolicy):
    """Answer clusters serve together: the default policy.

    Several stored phrasings that led to one answer form a cluster (the cache links them: same
    answer text, or answers that mean the same). A cluster's answer is served at a lower
    similarity than a lone entry's when the evidence of the whole cluster says so; ``rule``
    says how.

    ``rule="centroid"`` (the default). The cache gives each candidate of a cluster of two or
    more phrasings its query's cosine to the cluster's centroid, the cluster's cohesion (its
    own phrasings' mean cosine to the centroid of the others) and the rival: the best centroid
    cosine of any other cluster (:mod:`semcomm.semantic._centroids`). The cluster whose
    centroid is nearest is served (its most similar member) when

    - its most similar member and its centroid are both at least ``centroid_floor`` similar,
    - the query is no farther from the centroid than the cluster's own phrasings are, less
      ``spread`` (a per-cluster threshold from its members' spread: a tight cluster asks for a
      close query, a loose one accepts a looser one), and
    - its centroid beats the rival, and every lone candidate of another answer, by at least
      ``rival_margin`` (the top-1 / top-2 cluster margin: a query that sits between two
      answers is not served either), and
    - with an ``intent_metric`` (:class:`~semcomm.semantic.IntentMetric`; the default
      ``SemanticCache()`` has the shipped one), its score of the query against the cluster
      reaches the metric's ``cut``: a learned metric on the vectors that tells an action from
      its topic ("make a vacation request" against a cluster of "is my vacation request
      approved" phrasings) where cosine does not. The cache fills in the score
      (``Candidate.intent``); a refusal is ``reason="intent-rejected"``.

    ``rule="vote"`` (the earlier default; also what ``"centroid"`` falls back to when the
    candidates carry no centroid figures, e.g. built by hand): each of the nearest neighbours
    at or above ``base`` votes ``similarity - base`` for its cluster; the winner is served when
    at least ``support`` of its members voted, its votes beat the runner-up cluster's by at
    least ``margin`` and its best member is at least ``floor`` similar.

    Either way a candidate the cluster rule does not serve can still be served

    - when it alone reaches ``threshold`` (the fixed-threshold rule; verifier and scorer
      apply to this path exactly as in :class:`ThresholdPolicy`), or
    - with a ``judge`` (``f(query, best, runner_up) -> P``, e.g.
      :class:`~semcomm.semantic.JudgeVerifier`; off by default), when the best candidate is in
      ``[judge_floor, threshold)`` and the judge gives it ``P >= judge_min`` (a verified hit).

    The centroid rule's defaults were chosen on development FAQ traffic only (CLINC150's
    development and banking intents, with a quarter of the intents left unstored so that their
    phrasings are near-miss out-of-scope queries; docs/BENCHMARKS.md) and measured once on
    held-out traffic. A stricter floor and spread chosen by the FAQ goal on every development
    set (0.58 / 0.08, ``bench_semantic_rule.py --pick goal``, in git history) was measured once on
    held-out traffic and not adopted: it cost 4.5 points of recall for 0.15 points of
    out-of-scope hits there (docs/BENCHMARKS.md). A lone entry per answer (every answer distinct) behaves exactly like
    ``ThresholdPolicy(threshold)``.
    """

    name = "cluster"

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, *, rule: str = "centroid",
                 centroid_floor: float = 0.55, spread: float = 0.10,
                 rival_margin: float = 0.10, base: float = 0.5,
                 margin: float = 0.2, floor: float = 0.6, support: int = 2,
                 verifier: Verifier | None = None, max_verify: int = 2,
                 scorer: Scorer | None = None, min_score: float = 0.5,
                 lead_weight: float = 0.0, lead_floor: float = LEAD_FLOOR,
                 judge: Scorer | None = None, judge_floor: float = 0.85,
                 judge_min: float = 0.5, intent_metric: Any = None) -> None:
        super().__init__(threshold, verifier=verifier, max_verify=max_verify, scorer=scorer,
                         min_score=min_score, lead_weight=lead_weight, lead_floor=lead_floor)
        if rule not in CLUSTER_RULES:
            raise ConfigError(f"cluster rule must be one of {list(CLUSTER_RULES)}, got {rule!r}")
        self.rule = rule
        if intent_metric is not None and not (callable(getattr(intent_metric, "score", None))
                                              and hasattr(intent_metric, "cut")):
            raise ConfigError("intent_metric must be an IntentMetric (score(query, centroid, "
                              f"best) and cut), got {type(intent_metric).__name__}")
        self.intent_metric = intent_metric
        if judge is not None and not callable(judge):
            raise ConfigError(f"judge must be callable f(query, best, runner_up) -> P, got "
                              f"{type(judge).__name__}")
        self.judge = judge
        self.judge_floor = _check_threshold(judge_floor)
        self.judge_min = float(judge_min)
        self.base = _check_threshold(base)
        self.floor = _check_threshold(floor)
        self.centroid_floor = _check_threshold(centroid_floor)
        for what, v in (("spread", spread), ("rival_margin", rival_margin)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 2.0:
                raise ConfigError(f"{what} must be a cosine difference in [0, 2], got {v!r}")
        self.spread = float(spread)
        self.rival_margin = float(rival_margin)
        if not isinstance(support, int) or support < 2:
            raise ConfigError(f"support must be an integer >= 2, got {support!r}")
        if not 0.0 <= float(margin):
            raise ConfigError(f"margin must be >= 0, got {margin!r}")
        self.margin = float(margin)
        self.support = support

    @property
    def uses_centroids(self) -> bool:
        """The cache fills in the candidates' centroid figures only for a policy that reads
        them."""
        return self.rule == "centroid"

    def _centroid_case(self, candidates: Sequence[Candidate]
                       ) -> tuple[Candidate, Candidate, float, float, float] | None:
        """(nearest-centroid candidate, its cluster's most similar member, centroid cosine,
        cohesion, rival) or None when no candidate carries centroid figures."""
        multi = [c for c in candidates if c.centroid is not None and c.cohesion is not None]
        if not multi:
            return None
        win = max(multi, key=lambda c: (c.centroid, c.similarity))
        key = win.cluster_key
        best = max((c for c in candidates if c.cluster_key == key), key=lambda c: c.similarity)
        rival = max([-1.0 if win.rival is None else win.rival] +
                    [c.similarity for c in candidates
                     if c.centroid is None and c.cluster_key != key])
        return win, best, float(win.centroid), float(win.cohesion), rival  # type: ignore[arg-type]

    def _centroid_decision(self, candidates: Sequence[Candidate]) -> Decision | None:
        """The centroid rule: a cluster hit, a cluster miss, or None (the rule does not apply:
        no candidate carries centroid figures), see the class docstring. A miss for the rival
        margin alone carries its nearest-centroid candidate as ``rival_blocked``."""
        case = self._centroid_case(candidates)
        if case is None:
            return None
        win, best, cen, coh, rival = case
        margin = cen - rival
        near = (best.similarity >= self.centroid_floor and cen >= self.centroid_floor
                and cen >= coh - self.spread)
        if near and margin >= self.rival_margin:
            if (self.intent_metric is not None and win.intent is not None
                    and win.intent < self.intent_metric.cut):
                return Decision(None, reason="intent-rejected", score=margin)
            return Decision(best, reason="centroid", score=margin)
        return Decision(None, reason="centroid-rejected", score=margin,
                        rival_blocked=win if near and rival > -1.0 else None)

    def rival_blocked(self, candidates: Sequence[Candidate]) -> Candidate | None:
        """The nearest-centroid candidate when the centroid rule refuses it for the rival margin
        alone (floor and spread are met); None otherwise. :meth:`decide` reports the same as
        ``Decision.rival_blocked`` on a miss: the cache then asks whether the rival's answer
        means the same as this one's, and if so joins the two clusters (answer-equivalence
        learning) and decides again."""
        if self.rule != "centroid":
            return None
        d = self._centroid_decision(candidates)
        return None if d is None else d.rival_blocked

    def decide(self, query: str, candidates: Sequence[Candidate], *,
               threshold: float | None = None) -> Decision:
        cluster = self._centroid_decision(candidates) if self.rule == "centroid" else None
        if cluster is not None and cluster.candidate is not None:
            return cluster
        if cluster is None:
            v = cluster_vote(candidates, self.base)
            if (v.best is not None and v.support >= self.support and v.margin >= self.margin
                    and v.best.similarity >= self.floor):
                return Decision(v.best, reason="vote", score=v.margin)
        d = super().decide(query, candidates, threshold=threshold)
        if d.candidate is not None:
            d.score = d.candidate.similarity
            return d
        t = self.threshold if threshold is None else threshold
        if self.judge is not None and candidates and \
                self.judge_floor <= candidates[0].similarity < t:
            best = candidates[0]
            p = float(self.judge(query, best, candidates[1] if len(candidates) > 1 else None))
            if p >= self.judge_min:
                return Decision(best, verified=True, verifications=d.verifications + 1,
                                reason="judged", score=p)
            d = Decision(None, verifications=d.verifications + 1, reason="judge-rejected",
                         score=p)
        elif cluster is not None and d.reason == "below":
            return cluster  # the nearer miss: the cluster rule's, with its margin
        if cluster is not None:
            d.rival_blocked = cluster.rival_blocked
        return d

    @property
    def min_similarity(self) -> float:
        """Candidates below ``base`` neither vote nor can be served (nor judged)."""
        return min(self.base, self.centroid_floor, self.threshold,
                   self.judge_floor if self.judge else 1.0)

    def __repr__(self) -> str:
        if self.rule == "centroid":
            return (f"ClusterVotePolicy(threshold={self.threshold}, rule='centroid', "
                    f"centroid_floor={self.centroid_floor}, spread={self.spread}, "
                    f"rival_margin={self.rival_margin}, intent_metric={self.intent_metric!r})")
        return (f"ClusterVotePolicy(threshold={self.threshold}, rule='vote', base={self.base}, "
                f"margin={self.margin}, floor={self.floor}, support={self.support})")


def _wilson_upper(wrong: int, n: int, z: float) -> float:
    """One-sided Wilson upper bound on a binomial proportion."""
    if n == 0:
        return 1.0
    p = wrong / n
    denom = 1 + z * z / n
    centre = p + z * z / (2 * n)
    rad = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + rad) / denom)


_PENDING = 4096
"""Observations :class:`ErrorBoundedPolicy` records before it adds them to its bin counters."""


class ErrorBoundedPolicy(PolicyBase):
    """Serve a hit only where the learned error rate of hits is at most ``max_error``.

    How it works (after vCache, simplified to a form whose bound is easy to state):

    - Every verifier call records an observation ``(similarity, correct)``, globally and on the
      entry it was about.
    - The **global threshold** is the lowest similarity ``t`` such that the one-sided Wilson
      upper bound (confidence ``1 - alpha``) on the error rate of observations with
      ``similarity >= t`` is at most ``max_error``, with at least ``min_obs`` of them. Before
      enough evidence exists it is 1.0: nothing is served unverified.
    - Each **entry's threshold** is the global one, raised above the highest similarity at which
      that entry was ever found wrong.
    - **Exploit**: best candidate at or above its entry threshold -> hit without verification
      (except a random ``explore_rate`` share, verified to keep the estimate honest).
    - **Explore**: between ``floor`` and the entry threshold, call the verifier (the model) if
      the budget allows; a confirmed candidate is served as a verified hit.
    - **Budget**: verifier calls are limited to ``budget`` x lookups (+ ``burst``).

    **Bounded memory.** Observations are not kept one by one: the policy counts them, and the
    wrong ones among them, per similarity bin of width ``resolution`` (default 0.001: 2,001
    bins over [-1, 1], two counters each), and a refresh of the threshold is one pass over the
    bins whatever the number of observations. The counts are exact, so the Wilson bound of a
    region ``similarity >= t`` is the same statistic as over the raw observations; only the
    candidate thresholds are the bins' lower edges (a bin's edge is a candidate only when the
    bin holds observations, so a served region reaches at most one bin width below the
    observations that certify it). The entries' highest wrong similarities are kept for at
    most ``max_entries`` entries (the cache calls :meth:`forget` for entries that leave it; an
    entry beyond the cap, the one wrong longest ago first, falls back to the global
    threshold, which the bound is about).

    **What is bounded.** With confidence about ``1 - alpha`` the error rate of the traffic in
    the served region (``similarity >= threshold``) is at most ``max_error``: the bound holds
    for the share of wrong answers among unverified hits (and so for the share of wrong answers
    among all lookups, which vCache bounds), provided verification is right and the traffic
    does not drift. The share measured on ``m`` served hits may exceed ``max_error`` by its own
    sampling noise, about ``z * sqrt(max_error * (1 - max_error) / m)`` at the same
    confidence; the lowest passing threshold is taken without correcting for the scan over
    thresholds, so the confidence is nominal.
    """

    name = "error_bounded"

    def __init__(self, max_error: float = 0.02, *, verifier: Verifier | None = None,
                 budget: float = 1.0, burst: int = 50, floor: float = 0.5,
                 explore_rate: float = 0.02, alpha: float = 0.05, min_obs: int = 30,
                 seed: int | None = 0, resolution: float = 0.001,
                 max_entries: int = 100_000) -> None:
        if not 0.0 < max_error < 1.0:
            raise ConfigError(f"max_error must be in (0, 1), got {max_error!r}")
        if budget < 0:
            raise ConfigError(f"budget must be >= 0, got {budget!r}")
        if not isinstance(resolution, (int, float)) or isinstance(resolution, bool) or \
                not 1e-6 <= float(resolution) <= 0.1:
            raise ConfigError(f"resolution must be a cosine width in [1e-6, 0.1], "
                              f"got {resolution!r}")
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ConfigError(f"max_entries must be a positive integer, got {max_entries!r}")
        self.max_error = max_error
        self.verifier = verifier
        self.budget = budget
        self.burst = burst
        self.floor = _check_threshold(floor)
        self.explore_rate = explore_rate
        self._z = float(_norm_ppf(1 - alpha))
        self.min_obs = min_obs
        self.max_entries = max_entries
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        nbins = int(round(2.0 / float(resolution))) + 1
        # bin i holds similarities in [_edges[i], _edges[i + 1]); the last one, 1.0 (and above)
        self._edges = [round(-1.0 + 2.0 * i / (nbins - 1), 9) for i in range(nbins)]
        self._per_unit = (nbins - 1) / 2.0
        # per bin: observations (row 0) and the wrong ones among them (row 1); float64 counts
        # are exact up to 2**53
        self._counts = np.zeros((2, nbins), dtype=np.float64)
        # bins of the observations not yet counted (at most _PENDING: counted in one go)
        self._pending: list[int] = []
        self._pending_wrong: list[int] = []
        # entry -> highest similarity it was found wrong at (least recently wrong first)
        self._entry_neg: OrderedDict[str, float] = OrderedDict()
        self._lookups = 0
        self.verifications = 0
        self._threshold = 1.0
        self._dirty = False

    @property
    def threshold(self) -> float:
        """The current global threshold (1.0 until enough evidence)."""
        with self._lock:
            return self._refresh()

    @property
    def observations(self) -> int:
        """Verified outcomes recorded so far."""
        with self._lock:
            return int(self._counts[0].sum()) + len(self._pending)

    def entry_threshold(self, entry_id: str) -> float:
        with self._lock:
            t = self._refresh()
            neg = self._entry_neg.get(entry_id)
            return t if neg is None else max(t, math.nextafter(neg, 2.0))

    def observe(self, entry_id: str, similarity: float, correct: bool) -> None:
        """Record one verified outcome (also usable with outcomes learned elsewhere)."""
        sim = float(similarity)
        if not math.isfinite(sim):
            raise InvalidInputError(f"similarity must be a finite cosine, got {similarity!r}")
        edges = self._edges
        b = min(max(int((sim + 1.0) * self._per_unit), 0), len(edges) - 1)
        if edges[b] > sim and b > 0:  # rounding at a bin edge
            b -= 1
        elif b + 1 < len(edges) and edges[b + 1] <= sim:
            b += 1
        with self._lock:
            self._pending.append(b)
            if not correct:
                self._pending_wrong.append(b)
                neg = self._entry_neg.pop(entry_id, -2.0)
                self._entry_neg[entry_id] = max(neg, sim)
                if len(self._entry_neg) > self.max_entries:
                    self._entry_neg.popitem(last=False)
            if len(self._pending) >= _PENDING:
                self._count_pending()
            self._dirty = True

    def _count_pending(self) -> None:
        """Add the observations recorded since the last count to the bin counters."""
        n = self._counts.shape[1]
        for row, pending in enumerate((self._pending, self._pending_wrong)):
            if pending:
                self._counts[row] += np.bincount(pending, minlength=n)
                pending.clear()

    def _refresh(self) -> float:
        """The global threshold from the bin counts (under the lock): O(bins)."""
        if not self._dirty:
            return self._threshold
        self._dirty = False
        self._count_pending()
        # observations at or above each bin's edge, and the wrong ones among them
        at_or_above = np.cumsum(self._counts[:, ::-1], axis=1)[:, ::-1]
        cand = np.flatnonzero((self._counts[0] > 0) & (at_or_above[0] >= self.min_obs))
        n, w = at_or_above[0, cand], at_or_above[1, cand]
        z, z2 = self._z, self._z * self._z
        p = w / n
        upper = (p + z2 / (2 * n) + z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (
            1 + z2 / n)
        ok = cand[upper <= self.max_error]
        self._threshold = self._edges[int(ok[0])] if len(ok) else 1.0
        return self._threshold

    @property
    def min_similarity(self) -> float:
        """Candidates below ``floor`` are never served or verified."""
        return self.floor

    def _may_verify(self) -> bool:
        return self.verifications < self.budget * self._lookups + self.burst

    def decide(self, query: str, candidates: Sequence[Candidate], *,
               threshold: float | None = None) -> Decision:
        if self.verifier is None:
            raise ConfigError("error_bounded policy needs a verifier (verifier=f(query, cached))")
        with self._lock:
            self._lookups += 1
        if not candidates or candidates[0].similarity < self.floor:
            return Decision(None, reason="below")
        c = candidates[0]
        t = self.entry_threshold(c.entry_id)
        if threshold is not None:
            t = max(t, _check_threshold(threshold))
        exploit = c.similarity >= t
        if exploit and not (self.explore_rate and self._rng.random() < self.explore_rate):
            return Decision(c, reason="exploit")
        with self._lock:
            allowed = self._may_verify()
            if allowed:
                self.verifications += 1
        if not allowed:
            return Decision(None, reason="budget")
        ok = bool(self.verifier(query, c.query))
        self.observe(c.entry_id, c.similarity, ok)
        if ok:
            return Decision(c, verified=True, verifications=1, reason="verified")
        return Decision(None, verifications=1, reason="rejected")

    def forget(self, entry_ids: Sequence[str]) -> None:
        with self._lock:
            for i in entry_ids:
                self._entry_neg.pop(i, None)

    def __repr__(self) -> str:
        return (f"ErrorBoundedPolicy(max_error={self.max_error}, budget={self.budget}, "
                f"floor={self.floor}, verifier={self.verifier!r})")


def _norm_ppf(p: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation; |error| < 1e-9)."""
    a = [-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00]
    b = [-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01]
    c = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00]
    d = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
         3.754408661907416e00]
    if not 0 < p < 1:
        raise ValueError(p)
    lo = 0.02425
    if p < lo:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - lo:
        return -_norm_ppf(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


@dataclass(slots=True)
class CalibrationResult:
    """Outcome of :func:`calibrate_threshold`."""

    threshold: float  # lowest cosine threshold meeting the target precision
    precision: float  # measured at that threshold
    recall: float
    target_precision: float
    n_pairs: int
    curve: list[tuple[float, float, float]]  # (threshold, precision, recall), descending t
    reached: bool  # False: no threshold met the target; threshold is the best-precision one


def calibrate_threshold(similarities: Sequence[float], labels: Sequence[int | bool], *,
                        target_precision: float = 0.99, vetoed: Sequence[bool] | None = None,
                        min_support: int = 20) -> CalibrationResult:
    """Lowest threshold whose precision on labelled pairs reaches ``target_precision``.

    ``vetoed[i]`` marks pairs the lexical guard rejects (never a hit, whatever the threshold).
    ``min_support`` predicted positives are needed before a precision counts.
    """
    if not 0.0 < target_precision <= 1.0:
        raise ConfigError(f"target precision must be in (0, 1], got {target_precision!r}")
    sims = np.asarray(similarities, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    if sims.shape != y.shape or sims.ndim != 1 or len(sims) == 0:
        raise InvalidInputError("calibration needs equally long, non-empty similarity and "
                                "label lists")
    if not y.any():
        raise InvalidInputError("calibration pairs contain no positive (duplicate) label")
    v = np.zeros_like(y) if vetoed is None else np.asarray(vetoed, dtype=bool)
    eligible = ~v
    order = np.argsort(-sims, kind="stable")
    s, yy, el = sims[order], y[order], eligible[order]
    tp = np.cumsum(yy & el)
    pp = np.cumsum(el)
    total_pos = int(y.sum())
    curve: list[tuple[float, float, float]] = []
    best: tuple[float, float, float] | None = None
    best_prec: tuple[float, float, float] | None = None
    for i in range(len(s)):
        if i + 1 < len(s) and s[i + 1] == s[i]:
            continue
        if pp[i] == 0:
            continue
        prec = float(tp[i] / pp[i])
        rec = float(tp[i] / total_pos)
        curve.append((float(s[i]), prec, rec))
        if pp[i] >= min(min_support, max(1, len(s) // 4)):
            if prec >= target_precision:
                best = (float(s[i]), prec, rec)
            if best_prec is None or prec > best_prec[1]:
                best_prec = (float(s[i]), prec, rec)
    reached = best is not None
    pick = best or best_prec or curve[0]
    return CalibrationResult(threshold=pick[0], precision=pick[1], recall=pick[2],
                             target_precision=target_precision, n_pairs=len(s), curve=curve,
                             reached=reached)


@dataclass(frozen=True, slots=True)
class ScoredCut:
    """Outcome of :func:`calibrate_scored_cut`: one (cosine, score) cut and what it measured."""

    threshold: float  # lone-candidate cosine floor
    min_score: float  # verifier score the candidate needs at or above it
    hits: int  # validation lookups served at this cut
    precision: float  # measured on the validation lookups
    lower_bound: float  # one-sided Wilson lower bound on precision at ``confidence``
    recall: float  # right hits / ``n_positive``
    reached: bool  # False: no cut's lower bound met the target (the most precise one is given)


def calibrate_scored_cut(similarities: Sequence[float], scores: Sequence[float],
                         right: Sequence[bool], n_positive: int, *,
                         target_precision: float = 0.9, confidence: float = 0.9,
                         thresholds: Sequence[float] | None = None,
                         min_scores: Sequence[float] | None = None,
                         exact: Sequence[bool] | None = None,
                         min_hits: int = 30) -> ScoredCut:
    """The verified lone-candidate cut with the most recall whose precision clears
    ``target_precision`` with a margin, from labelled validation lookups.

    Each lookup ``i`` contributes its best candidate: cosine ``similarities[i]``, verifier
    score ``scores[i]`` (e.g. the cross-encoder's P) and whether serving it is ``right[i]``;
    ``exact[i]`` marks an identical text (served without a score, as the policy does).
    ``n_positive`` lookups have a right answer stored (the recall denominator). A cut
    ``(t, p)`` serves ``similarity >= t and (score >= p or exact)``; it qualifies when it serves
    at least ``min_hits`` lookups and the one-sided Wilson lower bound on its precision at
    ``confidence`` is at least ``target_precision``: a cut chosen this way keeps the target on
    fresh traffic of the same kind with about that confidence (less the optimism of taking the
    best of the grid). Of the qualifying cuts the one with the most recall is returned (ties:
    the higher cosine, then the higher score).
    """
    if not 0.0 < target_precision < 1.0:
        raise ConfigError(f"target precision must be in (0, 1), got {target_precision!r}")
    if not 0.5 <= confidence < 1.0:
        raise ConfigError(f"confidence must be in [0.5, 1), got {confidence!r}")
    sim = np.asarray(similarities, dtype=np.float64)
    sc = np.asarray(scores, dtype=np.float64)
    ok = np.asarray(right, dtype=bool)
    ex = np.zeros_like(ok) if exact is None else np.asarray(exact, dtype=bool)
    if not (sim.shape == sc.shape == ok.shape == ex.shape) or sim.ndim != 1 or len(sim) == 0:
        raise InvalidInputError("calibration needs equally long, non-empty similarity, score, "
                                "right (and exact) lists")
    if int(n_positive) < max(1, int(ok.sum())):
        raise InvalidInputError(f"n_positive ({n_positive}) is below the number of right "
                                f"candidates ({int(ok.sum())})")
    ts = np.round(np.arange(0.80, 0.971, 0.01), 2) if thresholds is None else thresholds
    ps = np.round(np.arange(0.30, 0.951, 0.05), 2) if min_scores is None else min_scores
    z = _norm_ppf(confidence)
    best: ScoredCut | None = None
    most_precise: ScoredCut | None = None
    for t in ts:
        for p in ps:
            hit = (sim >= float(t)) & ((sc >= float(p)) | ex)
            n = int(hit.sum())
            if n < min_hits:
                continue
            k = int((hit & ok).sum())
            cut = ScoredCut(float(t), float(p), n, k / n, 1.0 - _wilson_upper(n - k, n, z),
                            k / int(n_positive), False)
            if most_precise is None or cut.lower_bound > most_precise.lower_bound:
                most_precise = cut
            if cut.lower_bound >= target_precision and (
                    best is None or (cut.recall, cut.threshold, cut.min_score)
                    > (best.recall, best.threshold, best.min_score)):
                best = cut
    if best is not None:
        return ScoredCut(best.threshold, best.min_score, best.hits, best.precision,
                         best.lower_bound, best.recall, True)
    if most_precise is None:
        raise InvalidInputError(f"no cut serves {min_hits}+ validation lookups")
    return most_precise


POLICIES: dict[str, Callable[..., Any]] = {
    "cluster": ClusterVotePolicy,
    "threshold": ThresholdPolicy,
    "calibrated": ThresholdPolicy,  # build with a threshold from calibrate_threshold()
    "error_bounded": ErrorBoundedPolicy,
}


def make_policy(spec: Any = None, **kwargs: Any) -> HitPolicy:
    """A policy from ``None`` (the default: :class:`ClusterVotePolicy`), a registry name, or a
    policy object."""
    if spec is None:
        return ClusterVotePolicy(**kwargs)
    if isinstance(spec, str):
        try:
            factory = POLICIES[spec]
        except KeyError:
            raise ConfigError(f"unknown hit policy {spec!r}; choose one of {sorted(POLICIES)}") \
                from None
        return factory(**kwargs)  # type: ignore[no-any-return]
    if isinstance(spec, HitPolicy):
        return spec
    if hasattr(spec, "decide"):
        return _Adopted(spec)
    raise ConfigError(f"policy must be a name from {sorted(POLICIES)} or a policy object, "
                      f"got {type(spec).__name__}")
