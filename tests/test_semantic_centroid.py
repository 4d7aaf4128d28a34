"""The default policy's centroid rule for answer clusters: the rival-cluster margin, the
per-cluster spread threshold, the centroid bookkeeping under stores, deletes and reloads, and
one near-miss twin the real MiniLM embedding cannot separate by similarity alone."""

from __future__ import annotations

import numpy as np
import pytest

from semcomm.errors import ConfigError
from semcomm.semantic import CallableEmbedder, ClusterVotePolicy, SemanticCache
from semcomm.semantic._centroids import ClusterCentroids

from ._semantic_helpers import at, minilm, unit  # noqa: F401  (minilm: a fixture)

DIM = 16
E = np.eye(DIM, dtype=np.float32)
Q = E[0]  # every lookup below is this vector


@pytest.fixture
def emb() -> CallableEmbedder:
    # texts never embed in these tests (vectors are given); any fixed vector will do
    return CallableEmbedder(lambda texts: np.tile(E[15], (len(texts), 1)), name="fixed16",
                            dim=DIM)


def cache(emb: CallableEmbedder, rule: str = "centroid") -> SemanticCache:
    return SemanticCache(embedder=emb, policy=ClusterVotePolicy(rule=rule), guard=False)


def between_two(c: SemanticCache, b_cos: float | None) -> None:
    """Cluster A: three phrasings at cos 0.80 from the query. Cluster B (``b_cos``): two at
    ``b_cos``, in other directions, so that the query sits between the two answers."""
    for i, k in enumerate((1, 2, 3)):
        c.store(f"a{i}", "answer A", embedding=at(Q, E[k], 0.80))
    if b_cos is not None:
        for i, k in enumerate((4, 5)):
            c.store(f"b{i}", "answer B", embedding=at(Q, E[k], b_cos))


@pytest.mark.parametrize(("b_cos", "rule", "served"), [
    (None, "centroid", "answer A"),  # A alone: its centroid is near, no rival
    (0.75, "centroid", None),  # A's centroid 0.918, B's 0.848: margin 0.07 < 0.10
    (0.60, "centroid", "answer A"),  # B's centroid 0.68: margin 0.24
    (0.75, "vote", "answer A"),  # the earlier rule: A's votes 0.90 beat B's 0.50 by 0.40
])
def test_a_query_between_two_answers_is_refused_by_the_rival_margin(emb, b_cos, rule,
                                                                    served) -> None:
    c = cache(emb, rule)
    between_two(c, b_cos)
    hit = c.lookup("query", embedding=Q)
    assert (hit.answer if hit else None) == served
    if hit is not None:
        assert hit.reason == ("vote" if rule == "vote" else "centroid")


def spread_cluster(c: SemanticCache, spread: float) -> float:
    """Three phrasings around a centre at cos 0.80 from the query, ``spread`` apart from it
    (0.25: a tight cluster, members' cosine 0.94; 0.8: a loose one, 0.61). Returns the query's
    cosine to a member."""
    centre = unit(0.8 * Q + 0.6 * E[1])
    for i, k in enumerate((2, 3, 4)):
        c.store(f"t{i}", "answer T", embedding=unit(centre + spread * E[k]))
    return float(unit(centre + spread * E[2]) @ Q)


def test_a_tight_cluster_asks_for_a_closer_query_than_a_loose_one(emb) -> None:
    tight = cache(emb)
    near = spread_cluster(tight, 0.25)
    # the query is at 0.78 from each member, but the members are at 0.94 from each other:
    # it is farther from the centroid than the cluster's own phrasings, less the spread 0.10
    assert 0.77 < near < 0.78 and tight.lookup("query", embedding=Q) is None
    loose = cache(emb)
    far = spread_cluster(loose, 0.8)
    # at only 0.62 from each member of a loose cluster, the query is as close as they are
    hit = loose.lookup("query", embedding=Q)
    assert far < 0.63 and hit is not None and hit.answer == "answer T"
    assert hit.reason == "centroid"
    # the earlier vote rule serves the tight cluster (three votes of 0.28, no rival)
    vote = cache(emb, "vote")
    spread_cluster(vote, 0.25)
    assert vote.lookup("query", embedding=Q) is not None


def placed_cluster(c: SemanticCache, centre_cos: float, spread: float) -> float:
    """Three phrasings around a centre at ``centre_cos`` from the query, ``spread`` apart from
    it. Returns the query's cosine to a member."""
    centre = unit(centre_cos * Q + np.sqrt(1 - centre_cos ** 2) * E[1])
    for i, k in enumerate((2, 3, 4)):
        c.store(f"t{i}", "answer T", embedding=unit(centre + spread * E[k]))
    return float(unit(centre + spread * E[2]) @ Q)


@pytest.mark.parametrize(("centre_cos", "spread", "member", "stricter"), [
    # a loose cluster whose nearest phrasing is at 0.571: over the floor 0.55, under 0.58
    (0.75, 0.85, (0.56, 0.58), {"centroid_floor": 0.58}),
    # nearer phrasings (0.643), but the query is farther from the centroid than the members
    # are, by more than a spread of 0.08 and less than the default 0.10
    (0.75, 0.60, (0.64, 0.65), {"spread": 0.08}),
])
def test_floor_and_spread_each_refuse_a_query_at_the_edge_of_a_cluster(
        emb, centre_cos, spread, member, stricter) -> None:
    """The default (floor 0.55, spread 0.10) serves a query at the edge of a cluster; the
    stricter values that a rule search (``bench_semantic_rule.py``, since removed) chose on
    development traffic (0.58 / 0.08, measured on held-out traffic and not adopted:
    docs/BENCHMARKS.md) refuse it,
    each by its own test."""
    default = ClusterVotePolicy()
    assert (default.centroid_floor, default.spread, default.rival_margin) == (0.55, 0.10, 0.10)
    c = SemanticCache(embedder=emb, policy=default, guard=False)
    cos = placed_cluster(c, centre_cos, spread)
    assert member[0] < cos < member[1]
    hit = c.lookup("query", embedding=Q)
    assert hit is not None and hit.answer == "answer T" and hit.reason == "centroid"
    for kw in (stricter, {"centroid_floor": 0.58, "spread": 0.08}):
        strict = SemanticCache(embedder=emb, policy=ClusterVotePolicy(**kw), guard=False)
        placed_cluster(strict, centre_cos, spread)
        assert strict.lookup("query", embedding=Q) is None


def test_the_default_cache_uses_the_centroid_rule(emb) -> None:
    c = SemanticCache(embedder=emb)
    assert isinstance(c.policy, ClusterVotePolicy) and c.policy.rule == "centroid"
    assert c.policy.uses_centroids
    between_two(c, 0.75)
    assert c.lookup("query", embedding=Q) is None


def test_centroids_follow_deletes_and_reloads(emb, tmp_path) -> None:
    c = SemanticCache(embedder=emb, path=tmp_path / "c.db", policy=ClusterVotePolicy(),
                      guard=False)
    between_two(c, 0.75)
    assert c.lookup("query", embedding=Q) is None  # B is a close rival
    b = [e.id for e in c.entries() if e.answer == "answer B"]
    assert c.invalidate(b[0]) == 1
    # B is down to one phrasing: a lone entry at 0.75, no centroid; A's margin is 0.17
    hit = c.lookup("query", embedding=Q)
    assert hit is not None and hit.answer == "answer A"
    c.store("b-again", "answer B", embedding=at(Q, E[6], 0.75))
    assert c.lookup("query", embedding=Q) is None  # the rival cluster is back
    c.close()
    again = SemanticCache(embedder=emb, path=tmp_path / "c.db", policy=ClusterVotePolicy(),
                          guard=False)
    assert again.lookup("query", embedding=Q) is None  # rebuilt from the file: the same
    assert len(next(iter(again._table.clusters.centroids.values()))) == 2
    again.close()


def test_cluster_centroids_keep_exact_figures_and_no_lone_sums() -> None:
    cc = ClusterCentroids(DIM)
    a, b, c3 = at(Q, E[1], 0.9), at(Q, E[2], 0.9), at(Q, E[3], 0.7)
    cc.add("lone", a, 1)  # a lone entry: nothing kept
    assert len(cc) == 0 and not cc.dirty
    cc.add("k", a, 1)
    cc.add("k", b, 2)  # reached two members: the first one's vector is not here
    assert cc.dirty == {"k"} and cc.view(Q, ["k"]) == {}
    cc.recount("k", np.stack([a, b]))
    v = cc.view(Q, ["k"])["k"]
    cen = unit(a + b)
    assert v.centroid == pytest.approx(float(cen @ Q), abs=1e-6)
    assert v.cohesion == pytest.approx(float(a @ b), abs=1e-6)  # two members: their cosine
    assert v.rival == -1.0 and v.members == 2
    cc.add("k", c3, 3)  # counted: updated in place
    assert not cc.dirty
    v3 = cc.view(Q, ["k"])["k"]
    assert v3.centroid == pytest.approx(float(unit(a + b + c3) @ Q), abs=1e-6)
    cc.add("j", at(Q, E[4], 0.5), 1)
    cc.recount("j", np.stack([at(Q, E[4], 0.5), at(Q, E[5], 0.5)]))
    assert cc.view(Q, ["k"])["k"].rival == pytest.approx(
        float(unit(at(Q, E[4], 0.5) + at(Q, E[5], 0.5)) @ Q), abs=1e-6)
    cc.discard("j")
    assert cc.view(Q, ["k"])["k"].rival == -1.0 and len(cc) == 1
    cc.recount("j", np.zeros((1, DIM)) + E[4])  # down to one member: no row, no sum
    assert len(cc) == 1 and "j" not in cc._sum


def test_centroid_rule_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="cluster rule"):
        ClusterVotePolicy(rule="mean")
    with pytest.raises(ConfigError, match="spread"):
        ClusterVotePolicy(spread=-0.1)
    with pytest.raises(ConfigError, match="rival_margin"):
        ClusterVotePolicy(rival_margin=True)  # type: ignore[arg-type]


# five stored phrasings of "when do I change my oil" and five of "which gas does my car take"
# (CLINC150 train, oil_change_when / gas_type); "how do I change my oil" is another intent
# (oil_change_how) that no entry answers
OIL_WHEN = ["when do you think i should change my oil",
            "about how long before i need another oil change",
            "how do i know when i have to change my oil",
            "at what time should i get my oil changed next",
            "at which mileage, should i get my oil changed"]
GAS_TYPE = ["does my car need specific fuel", "which type of gas do i need to put in my car",
            "i wanna know the gad i need to fill this car up with",
            "tell me the fuel my car takes", "what kind of gas should i use to fill the car"]
TWINS = ["teach me how to change my oil", "how do i change my oil and what kind do i need",
         "please explain the steps to change oil", "what do i need to change my oil"]
PARAPHRASES = ["when should i change my oil next", "how often do i need an oil change",
               "is it time for an oil change"]


def test_a_near_miss_twin_is_refused_with_the_real_embedder(minilm) -> None:  # noqa: F811
    served = {}
    for rule in ("centroid", "vote"):
        c = SemanticCache(embedder=minilm, policy=ClusterVotePolicy(rule=rule))
        c.store_many(OIL_WHEN, ["oil: when"] * 5)
        c.store_many(GAS_TYPE, ["gas type"] * 5)
        served[rule] = {q: (h.answer if (h := c.lookup(q)) else None)
                        for q in TWINS + PARAPHRASES}
    assert all(served["centroid"][q] is None for q in TWINS)
    assert all(served["centroid"][q] == "oil: when" for q in PARAPHRASES)
    # the neighbour vote serves every twin the "when" answer (0.65-0.74 from a member)
    assert all(served["vote"][q] == "oil: when" for q in TWINS)


@pytest.mark.parametrize("same_meaning", [True, False])
def test_a_rival_cluster_whose_answer_means_the_same_is_joined(emb, same_meaning) -> None:
    calls = []

    def agree(a: str, b: str) -> bool:
        calls.append((a, b))
        return same_meaning

    c = SemanticCache(embedder=emb, policy=ClusterVotePolicy(), guard=False, answer_match=agree)
    # one answer in two wordings, bulk-loaded: linked by text only, so two clusters
    c.store_many([f"a{i}" for i in range(3)], ["Refunds take 5 days."] * 3,
                 embeddings=[at(Q, E[k], 0.80) for k in (1, 2, 3)])
    c.store_many(["b0", "b1"], ["A refund needs five days."] * 2,
                 embeddings=[at(Q, E[k], 0.75) for k in (4, 5)])
    linked = c.stats().linked  # links made by the stores (same text)
    first = c.lookup("query", embedding=Q)
    second = c.lookup("query", embedding=Q)
    if same_meaning:  # joined: one cluster, no rival left
        assert first is not None and first.reason == "centroid" and second is not None
        assert c.stats().linked == linked + 2 and len(calls) == 1
    else:  # the rival answer differs: refused, and not compared again
        assert first is None and second is None
        assert c.stats().linked == linked and len(calls) == 1


def test_a_contradicted_member_leaves_its_cluster_centroid(emb) -> None:
    c = cache(emb)
    for i, k in enumerate((1, 2)):
        c.store(f"a{i}", "answer A", embedding=at(Q, E[k], 0.80))
    hit = c.lookup("query", embedding=Q)
    assert hit is not None and hit.reason == "centroid"
    (cc,) = c._table.clusters.centroids.values()
    assert len(cc) == 1
    c.feedback(hit, correct=False)  # trust 0.5: neither a candidate nor part of the centroid
    other = c.lookup("query", embedding=Q)  # the one trusted member alone: a lone entry
    assert other is None and len(cc) == 0
    c.feedback(hit.entry_id, correct=True)  # trust 0.75 again: back in the sum
    assert c.lookup("query", embedding=Q) is not None and len(cc) == 1


def test_clear_drops_the_centroids(emb) -> None:
    c = cache(emb)
    between_two(c, None)
    assert c.lookup("query", embedding=Q) is not None and c._table.clusters.centroids
    c.clear()
    assert not c._table.clusters.centroids and c.lookup("query", embedding=Q) is None
    between_two(c, 0.75)  # built again from the new entries: B is a rival again
    assert c.lookup("query", embedding=Q) is None


@pytest.mark.parametrize("b_cos", [0.75, 0.60])
def test_many_clusters_take_rivals_from_a_wider_neighbourhood(emb, monkeypatch, b_cos) -> None:
    import semcomm.semantic._cache as cache_mod

    # three candidates per lookup: A's phrasings; B's are no candidates, only rivals
    full = SemanticCache(embedder=emb, policy=ClusterVotePolicy(), guard=False, candidates=3)
    between_two(full, b_cos)
    monkeypatch.setattr(cache_mod, "_RIVAL_SCAN_ROWS", 1)  # two clusters count as many
    wide = SemanticCache(embedder=emb, policy=ClusterVotePolicy(), guard=False, candidates=3)
    between_two(wide, b_cos)
    wide.lookup("query", embedding=Q)  # recounts the clusters the stores left dirty
    assert len(next(iter(wide._table.clusters.centroids.values()))) == 2  # from now on: "many" clusters
    a, b = full.lookup("query", embedding=Q), wide.lookup("query", embedding=Q)
    assert (a.answer if a else None) == (b.answer if b else None)
    assert (b is None) == (b_cos == 0.75)  # B's centroid is found among the neighbours
