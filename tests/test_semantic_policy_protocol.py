"""The HitPolicy protocol is what the cache reads of a policy, and the rival join is data."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from semcomm.semantic import (
    CallableEmbedder,
    Candidate,
    ClusterVotePolicy,
    Decision,
    ErrorBoundedPolicy,
    HitPolicy,
    PolicyBase,
    SemanticCache,
    ThresholdPolicy,
)

from ._semantic_helpers import at

DIM = 16
E = np.eye(DIM, dtype=np.float32)
Q = E[0]
PROTOCOL = {"name", "scorer", "intent_metric", "min_similarity", "uses_centroids", "decide",
            "forget"}


@pytest.fixture
def emb() -> CallableEmbedder:
    return CallableEmbedder(lambda texts: np.tile(E[15], (len(texts), 1)), name="fixed16",
                            dim=DIM)


class Watched(ClusterVotePolicy):
    """Records every attribute read from semcomm.semantic outside the policy module."""

    reads: set[str]

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
        if "semcomm/semantic/" in caller and not caller.endswith("/_policy.py") and \
                not name.startswith("__"):  # isinstance() reads __class__
            object.__getattribute__(self, "reads").add(name)
        return super().__getattribute__(name)


def test_the_cache_reads_only_what_the_protocol_declares(emb) -> None:
    pol = Watched()
    pol.reads = set()
    c = SemanticCache(embedder=emb, policy=pol, guard=False, max_entries=6,
                      answer_match=lambda a, b: True)
    # one answer in two wordings (two clusters, one a rival of the other: joined at lookup)
    c.store_many([f"a{i}" for i in range(3)], ["Refunds take 5 days."] * 3,
                 embeddings=[at(Q, E[k], 0.80) for k in (1, 2, 3)])
    c.store_many(["b0", "b1"], ["A refund needs five days."] * 2,
                 embeddings=[at(Q, E[k], 0.75) for k in (4, 5)])
    hit = c.lookup("query", embedding=Q)
    assert hit is not None and hit.reason == "centroid"
    c.store_many(["c0", "c1"], ["other"] * 2, embeddings=[E[6], E[7]])  # evicts one
    c.invalidate(tag="none")
    assert c.stats().policy == "cluster"
    assert pol.reads and pol.reads <= PROTOCOL, pol.reads - PROTOCOL


def test_the_shipped_policies_meet_the_protocol() -> None:
    for pol in (ThresholdPolicy(), ClusterVotePolicy(), ErrorBoundedPolicy()):
        assert isinstance(pol, HitPolicy) and isinstance(pol, PolicyBase)
    assert ErrorBoundedPolicy().scorer is None and not ErrorBoundedPolicy().uses_centroids
    assert ThresholdPolicy(0.9).min_similarity == 0.9 and PolicyBase().min_similarity < -1


def test_a_policy_object_with_decide_only_is_adopted_with_defaults(emb) -> None:
    class Old:  # written before the protocol named what the cache reads
        def decide(self, query, candidates, *, threshold=None):  # type: ignore[no-untyped-def]
            return Decision(candidates[0] if candidates else None, reason="old")

    old = Old()
    c = SemanticCache(embedder=emb, policy=old, guard=False)
    assert isinstance(c.policy, PolicyBase) and c.policy.inner is old  # type: ignore[attr-defined]
    c.store("a", "answer A", embedding=at(Q, E[1], 0.2))  # far, but no floor: offered
    hit = c.lookup("query", embedding=Q)
    assert hit is not None and hit.reason == "old" and c.stats().policy == "Old"
    assert c.invalidate(scope="default") == 1  # no forget(): nothing to tell it

    class Floored(Old):
        name = "floored"
        min_similarity = 0.5
        forgotten: list[str] = []

        def forget(self, ids):  # type: ignore[no-untyped-def]
            self.forgotten.extend(ids)

    f = Floored()
    c = SemanticCache(embedder=emb, policy=f, guard=False)
    c.store("a", "answer A", embedding=at(Q, E[1], 0.2))
    assert c.lookup("query", embedding=Q) is None  # below its floor: not offered
    assert c.stats().policy == "floored"
    eid = c.store("b", "answer B", embedding=at(Q, E[2], 0.9))
    assert c.lookup("query", embedding=Q) is not None
    c.invalidate(eid)
    assert f.forgotten == [eid]


def cands(rival: float) -> list[Candidate]:
    """A cluster of phrasings whose centroid is at 0.85 from the query (cohesion 0.80), its
    rival centroid at ``rival``."""
    return [Candidate(f"a{i}", f"a{i}", 0.80 - 0.01 * i, "A", centroid=0.85, cohesion=0.80,
                      rival=rival) for i in range(3)]


def test_a_miss_for_the_rival_margin_alone_says_so_on_the_decision() -> None:
    pol = ClusterVotePolicy()
    blocked = pol.decide("q", cands(0.80))  # margin 0.05 < 0.10
    assert blocked.candidate is None and blocked.reason == "centroid-rejected"
    assert blocked.rival_blocked is not None and blocked.rival_blocked.cluster_key == "A"
    again = pol.rival_blocked(cands(0.80))  # the method says the same
    assert again is not None and again.entry_id == blocked.rival_blocked.entry_id
    served = pol.decide("q", cands(0.60))
    assert served.candidate is not None and served.rival_blocked is None
    far = cands(0.80)
    for c in far:
        c.centroid = 0.60  # farther from the centroid than its own phrasings: not the rival
    assert pol.decide("q", far).rival_blocked is None
    assert ClusterVotePolicy(rule="vote").decide("q", cands(0.80)).rival_blocked is None
    assert ThresholdPolicy().decide("q", cands(0.80)).rival_blocked is None
