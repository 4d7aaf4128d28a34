"""The intent check of answer-cluster hits (``semantic._intent``): the learned metric's file
format and errors, how the cache scores a centroid hit with it, and the shipped weights on the
real MiniLM vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from semcomm.errors import ConfigError, InvalidInputError
from semcomm.semantic import (
    CallableEmbedder,
    ClusterVotePolicy,
    IntentMetric,
    SemanticCache,
    ThresholdPolicy,
    default_intent_metric,
)
from semcomm.semantic._intent import INTENT_METRIC_DIR, intent_features
from semcomm.semantic._policy import Candidate

from ._semantic_helpers import at, minilm, unit  # noqa: F401  (minilm: a fixture)

DIM = 16
E = np.eye(DIM, dtype=np.float32)
Q = E[0]


def metric(*, cos_weight: float = 0.0, bias: float = 0.0, cut: float = 0.0,
           name: str = "fixed16") -> IntentMetric:
    """A metric whose score is ``cos_weight * cos(query, centroid) + bias``."""
    w = np.zeros(2 * DIM + 2, np.float32)
    w[2 * DIM] = cos_weight
    return IntentMetric(w, bias, cut, embedder=name)


@pytest.fixture
def emb() -> CallableEmbedder:
    return CallableEmbedder(lambda texts: np.tile(E[15], (len(texts), 1)), name="fixed16",
                            dim=DIM)


class Recording(ClusterVotePolicy):
    last: list[Candidate] = []

    def decide(self, query, candidates, *, threshold=None):  # type: ignore[no-untyped-def]
        self.last = list(candidates)
        return super().decide(query, candidates, threshold=threshold)


def three_phrasings(c: SemanticCache) -> np.ndarray:
    """Cluster A: three phrasings at cos 0.80 from ``Q``; returns its unit centroid."""
    vs = [at(Q, E[k], 0.80) for k in (1, 2, 3)]
    c.store_many([f"a{i}" for i in range(3)], ["answer A"] * 3, embeddings=vs)
    return unit(np.sum(vs, axis=0))


def test_a_centroid_hit_needs_the_metrics_yes(emb) -> None:
    on = SemanticCache(embedder=emb, guard=False,
                       policy=ClusterVotePolicy(intent_metric=metric(bias=-1.0)))
    off = SemanticCache(embedder=emb, guard=False, policy=ClusterVotePolicy())
    yes = SemanticCache(embedder=emb, guard=False,
                        policy=ClusterVotePolicy(intent_metric=metric(bias=1.0)))
    for c in (on, off, yes):
        three_phrasings(c)
    assert on.lookup("q", embedding=Q) is None
    assert on.stats().intent_rejected == 1
    for c in (off, yes):
        hit = c.lookup("q", embedding=Q)
        assert hit is not None and hit.answer == "answer A" and hit.reason == "centroid"
        assert c.stats().intent_rejected == 0


def test_the_cache_scores_the_query_against_the_clusters_own_centroid(emb) -> None:
    """The score the policy reads is the metric's on the query, the cluster's unit centroid and
    its most similar member: here ``cos(query, centroid)``, against a cut between the two
    queries' cosines."""
    w = np.zeros(2 * DIM + 2, np.float32)
    w[: DIM] = 1.0  # sum of q * c: the cosine again, through the per-dimension part
    w[2 * DIM + 1] = 0.5  # and half the best member's cosine
    m = IntentMetric(w, -0.2, 1.07, embedder="fixed16")  # near: 1.118, far: 1.026
    pol = Recording(intent_metric=m)
    c = SemanticCache(embedder=emb, guard=False, policy=pol)
    cen = three_phrasings(c)
    near, far = Q, at(Q, E[4], 0.93)  # both within the centroid rule; far: lower score
    for q, served in ((near, True), (far, False)):
        hit = c.lookup("q", embedding=q)
        win = next(x for x in pol.last if x.cluster_key == pol.last[0].cluster_key)
        best = max(x.similarity for x in pol.last if x.cluster_key == win.cluster_key)
        want = float(q @ cen) + 0.5 * best - 0.2
        assert win.intent == pytest.approx(want, abs=1e-5)
        assert win.intent == pytest.approx(m.score(q, cen, best), abs=1e-6)
        assert (hit is not None) is served
    # the vote rule, lone entries and a policy without a metric carry no score
    plain = Recording()
    c2 = SemanticCache(embedder=emb, guard=False, policy=plain)
    three_phrasings(c2)
    c2.lookup("q", embedding=Q)
    assert all(x.intent is None for x in plain.last)


def test_a_refused_cluster_can_still_be_served_by_the_lone_rule(emb) -> None:
    """The intent check refuses the cluster rule's evidence only: a member at the lone
    threshold is still a hit of the threshold rule."""
    c = SemanticCache(embedder=emb, guard=False,
                      policy=ClusterVotePolicy(0.9, intent_metric=metric(bias=-1.0)))
    c.store_many(["a0", "a1"], ["answer A"] * 2,
                 embeddings=[at(Q, E[1], 0.95), at(Q, E[2], 0.80)])
    hit = c.lookup("q", embedding=Q)
    assert hit is not None and hit.reason == "threshold"


def test_save_load_round_trip_and_bad_files(tmp_path: Path) -> None:
    m = metric(cos_weight=2.0, bias=-0.5, cut=0.3)
    m.meta["train"] = {"pairs": 3}
    d = m.save(tmp_path / "m")
    back = IntentMetric.load(d)
    assert back.dim == DIM and back.cut == 0.3 and back.bias == -0.5
    assert back.embedder == "fixed16" and back.meta["train"] == {"pairs": 3}
    np.testing.assert_array_equal(back.weights, m.weights)
    q, c = at(Q, E[1], 0.6), Q
    assert back.score(q, c, 0.7) == pytest.approx(2.0 * 0.6 - 0.5, abs=1e-6)

    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "format_version": 99}))
    with pytest.raises(ConfigError, match="format"):
        IntentMetric.load(d)
    (d / "config.json").write_text(json.dumps({**cfg, "dim": 8}))
    with pytest.raises(ConfigError, match="dim"):
        IntentMetric.load(d)
    (d / "weights.npy").write_bytes(b"not an array")
    with pytest.raises(ConfigError, match="cannot read"):
        IntentMetric.load(d)
    with pytest.raises(ConfigError, match="cannot read"):
        IntentMetric.load(tmp_path / "absent")


@pytest.mark.parametrize(("weights", "bias", "match"), [
    (np.zeros(5), 0.0, "2 \\* dim \\+ 2"),
    (np.full(2 * DIM + 2, np.nan), 0.0, "finite"),
    (np.zeros(2 * DIM + 2), float("inf"), "finite"),
])
def test_bad_weights_are_refused(weights, bias, match) -> None:
    with pytest.raises(ConfigError, match=match):
        IntentMetric(weights, bias, 0.0, embedder="x")


def test_vectors_of_another_size_are_refused() -> None:
    m = metric()
    with pytest.raises(InvalidInputError, match="16-dimensional vectors, got 8"):
        m.score(np.ones(8) / 8**0.5, np.ones(8) / 8**0.5, 0.5)
    with pytest.raises(InvalidInputError, match="differ"):
        intent_features(np.ones(8), np.ones(9), 0.5)


def test_intent_check_options(emb) -> None:
    """"auto" gives the default embedder's default policy the shipped metric and nothing else
    one; True asks for it; False turns it off; a metric of another embedder, or a policy
    without clusters, is refused."""
    assert SemanticCache(embedder=emb).policy.intent_metric is None  # type: ignore[attr-defined]
    mine = metric()
    c = SemanticCache(embedder=emb, intent_check=mine)
    assert c.policy.intent_metric is mine  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="fitted on 'other'"):
        SemanticCache(embedder=emb, intent_check=metric(name="other"))
    with pytest.raises(ConfigError, match="ClusterVotePolicy"):
        SemanticCache(embedder=emb, policy=ThresholdPolicy(0.9), intent_check=mine)
    with pytest.raises(ConfigError, match="all-MiniLM"):
        SemanticCache(embedder=emb, intent_check=True)
    with pytest.raises(ConfigError, match="IntentMetric"):
        ClusterVotePolicy(intent_metric="yes")


def test_the_default_has_the_shipped_metric() -> None:
    d = SemanticCache()
    assert d.policy.intent_metric is default_intent_metric()  # type: ignore[attr-defined]
    assert SemanticCache(intent_check=False).policy.intent_metric is None  # type: ignore[attr-defined]
    # a policy passed in is the user's: "auto" leaves it as it is
    assert SemanticCache(policy=ClusterVotePolicy()).policy.intent_metric is None  # type: ignore[attr-defined]
    m = default_intent_metric()
    cfg = json.loads((INTENT_METRIC_DIR / "config.json").read_text())
    assert m.dim == 384 and m.embedder == cfg["embedder"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert m.cut == cfg["cut"] and cfg["train"]["pairs"] > 10_000


def test_server_config_turns_the_intent_check_off(tmp_path: Path) -> None:
    from semcomm.server import load_config
    from semcomm.server._gateway import Gateway
    from semcomm.server._wiring import build_semantic

    def policy(section: dict):  # type: ignore[no-untyped-def]
        cfg = load_config(None, overrides={
            "server": {"state_dir": str(tmp_path)}, "models": {"tiny": {"path": "tiny"}},
            "semantic": {"backend": "memory", **section}}, defaults=False, environ={})
        sem, note = build_semantic(cfg, Gateway(cfg))
        assert sem is not None, note
        return sem.cache.policy

    assert policy({}).intent_metric is default_intent_metric()
    assert policy({"intent_check": False}).intent_metric is None


ORDER_STATUS = ["where is my order", "has my package shipped", "track my order",
                "when will my order arrive", "what is the status of my order"]
SAME = ["is my order on the way", "where's my package now", "when is my delivery coming"]


def test_the_shipped_metric_refuses_an_action_served_its_status(minilm) -> None:  # noqa: F811
    """Real MiniLM vectors: "cancel my order" passes the centroid rule against five stored
    ways of asking where an order is; the shipped intent check refuses it and still serves
    the rewordings of the stored question."""
    served = {}
    for check in (True, False):
        c = SemanticCache(embedder=minilm, intent_check=check)
        c.store_many(ORDER_STATUS, ["order status"] * 5)
        c.store_many(["what's the weather today", "will it rain tomorrow"], ["weather"] * 2)
        served[check] = {q: (h.reason if (h := c.lookup(q)) else None)
                         for q in ["cancel my order", *SAME]}
        assert c.stats().intent_rejected == (1 if check else 0)
    assert served[False]["cancel my order"] == "centroid"
    assert served[True]["cancel my order"] is None
    assert all(served[check][q] == "centroid" for check in (True, False) for q in SAME)


def test_the_score_is_the_linear_model_of_the_features() -> None:
    """The lookup path's score equals the weights times :func:`intent_features` (the row the
    shipped model was fitted on), for the shipped weights."""
    m = default_intent_metric()
    rng = np.random.default_rng(0)
    for _ in range(5):
        q, c = (unit(x) for x in rng.normal(size=(2, m.dim)))
        best = float(rng.uniform(0.5, 1.0))
        want = float(intent_features(q, c, best).astype(np.float64) @ m.weights) + m.bias
        assert m.score(q, c, best) == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_with_cut_keeps_the_weights_and_moves_only_the_cut(emb) -> None:
    m = metric(cos_weight=1.0, cut=2.0)
    loose = m.with_cut(0.5)
    assert loose.cut == 0.5 and m.cut == 2.0 and loose.embedder == m.embedder
    np.testing.assert_array_equal(loose.weights, m.weights)
    served = {}
    for mm in (m, loose):
        c = SemanticCache(embedder=emb, guard=False, intent_check=mm)
        three_phrasings(c)
        served[mm.cut] = c.lookup("q", embedding=Q) is not None  # score 0.918
    assert served == {2.0: False, 0.5: True}
