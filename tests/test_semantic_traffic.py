"""Answer clusters, answer learning, trust, shadow mode and the near-miss guard kinds of real
traffic (no model: vectors are given, answers embed with a bag-of-words toy)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from typer.testing import CliRunner

from semcomm.errors import ConfigError, InvalidInputError
from semcomm.semantic import (
    CallableEmbedder,
    ClusterVotePolicy,
    LexicalGuard,
    SemanticCache,
    ThresholdPolicy,
    read_shadow_log,
    shadow_report,
)
from semcomm.semantic._entry import Entry, decode_entry, encode_entry

from ._semantic_helpers import at, unit

DIM = 16


def _bow(texts: list[str]) -> np.ndarray:
    out = np.zeros((len(texts), DIM), np.float32)
    for i, t in enumerate(texts):
        for w in t.lower().split():
            out[i, sum(map(ord, w)) % DIM] += 1.0
        out[i, 0] += 1e-3
    return out


@pytest.fixture
def emb() -> CallableEmbedder:
    return CallableEmbedder(_bow, name="bow16", dim=DIM)


@pytest.fixture
def axes() -> np.ndarray:
    return np.eye(DIM, dtype=np.float32)


def test_cluster_of_agreeing_phrasings_serves_below_the_threshold(emb, axes) -> None:
    e = axes
    cache = SemanticCache(embedder=emb)
    assert isinstance(cache.policy, ClusterVotePolicy)
    q = e[0]
    # three phrasings of one answer, each at cos 0.80 from the query (below 0.92)
    for i, k in enumerate((1, 2, 3)):
        cache.store(f"how do i freeze my card {i}", "Cards > Freeze", embedding=at(q, e[k], 0.8))
    hit = cache.lookup("lock my card please", embedding=q)
    assert hit is not None and hit.answer == "Cards > Freeze" and hit.reason == "centroid"
    assert 0.79 < hit.similarity < 0.81
    # the same vectors with three different answers: no cluster, nothing above 0.92 -> miss
    lone = SemanticCache(embedder=emb)
    for i, k in enumerate((1, 2, 3)):
        lone.store(f"how do i freeze my card {i}", f"answer {i}", embedding=at(q, e[k], 0.8))
    assert lone.lookup("lock my card please", embedding=q) is None
    # the fixed-threshold policy ignores clusters
    fixed = SemanticCache(embedder=emb, threshold=0.92)
    for i, k in enumerate((1, 2, 3)):
        fixed.store(f"how do i freeze my card {i}", "Cards > Freeze", embedding=at(q, e[k], 0.8))
    assert fixed.lookup("lock my card please", embedding=q) is None


@pytest.mark.parametrize(("sims_a", "sims_b", "served"), [
    ((0.80, 0.80), (), "A"),  # two agreeing members: margin 0.6
    ((0.80,), (), None),  # one member at 0.80: below the fixed threshold
    ((0.93,), (), "A"),  # one member above the threshold
    ((0.80, 0.80), (0.80, 0.80), None),  # two clusters tie: margin 0
    ((0.62, 0.62), (), "A"),  # margin 0.24 >= 0.2, best 0.62 >= floor 0.6
    ((0.58, 0.58, 0.58), (), None),  # votes enough but below the floor
])
def test_vote_rule_table(sims_a, sims_b, served) -> None:
    from semcomm.semantic import Candidate

    cands = [Candidate(f"a{i}", "qa", s, "A") for i, s in enumerate(sims_a)]
    cands += [Candidate(f"b{i}", "qb", s, "B") for i, s in enumerate(sims_b)]
    cands.sort(key=lambda c: -c.similarity)
    d = ClusterVotePolicy(rule="vote").decide("q", cands)
    assert (d.candidate.cluster if d.candidate else None) == served
    # candidates without centroid figures (built by hand): the centroid rule votes the same
    d = ClusterVotePolicy().decide("q", cands)
    assert (d.candidate.cluster if d.candidate else None) == served


def test_policy_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        ClusterVotePolicy(support=1)
    with pytest.raises(ConfigError):
        ClusterVotePolicy(base=2.0)
    with pytest.raises(ConfigError):
        SemanticCache(mode="dry-run")
    with pytest.raises(ConfigError):
        SemanticCache(answer_match=1.5)


def test_guard_waived_only_where_the_cluster_itself_varies(emb, axes) -> None:
    e = axes
    q = e[0]
    cache = SemanticCache(embedder=emb)
    # the stored phrasings differ in their amounts, so the answer does not depend on one
    cache.store("transfer 50 dollars to savings", "Payments > Transfer",
                embedding=at(q, e[1], 0.8))
    cache.store("move 1200 dollars between my accounts", "Payments > Transfer",
                embedding=at(q, e[2], 0.8))
    hit = cache.lookup("send 300 dollars to checking", embedding=q)
    assert hit is not None and hit.answer == "Payments > Transfer"
    # ... but they agree on being positive: a negated query is still vetoed
    assert cache.lookup("do not send 300 dollars to checking", embedding=q) is None
    # a cluster whose members share one amount keeps the number check
    same = SemanticCache(embedder=emb)
    same.store("what is the fee for 50 dollars", "fee A", embedding=at(q, e[1], 0.8))
    same.store("fee on a 50 dollar transfer", "fee A", embedding=at(q, e[2], 0.8))
    assert same.lookup("what is the fee for 300 dollars", embedding=q) is None
    assert same.lookup("what is the fee for 50 dollars please", embedding=q) is not None


def test_answer_equivalence_links_a_new_phrasing_to_the_cluster(emb, axes) -> None:
    e = axes
    q = e[0]
    agree_calls = []

    def same_meaning(a: str, b: str) -> bool:
        agree_calls.append((a, b))
        return "refund" in a.lower() and "refund" in b.lower()

    cache = SemanticCache(embedder=emb, answer_match=same_meaning)
    cache.store("how do i get my money back", "Refunds take 5 days: Orders > Refund",
                embedding=at(q, e[1], 0.8))
    # a miss answered by the model with other words that mean the same: linked
    cache.store("can i return an order", "Open Orders and press Refund; it takes 5 days",
                embedding=at(q, e[2], 0.8))
    assert agree_calls and cache.stats().linked == 1
    hit = cache.lookup("i want a refund", embedding=q)
    assert hit is not None and hit.reason == "centroid"
    # an answer that means something else is not linked: two lone entries, a miss
    other = SemanticCache(embedder=emb, answer_match=same_meaning)
    other.store("how do i get my money back", "Refunds take 5 days: Orders > Refund",
                embedding=at(q, e[1], 0.8))
    other.store("can i return an order", "Returns are not possible",
                embedding=at(q, e[2], 0.8))
    assert other.stats().linked == 0
    assert other.lookup("i want a refund", embedding=q) is None


def test_short_label_answers_link_only_by_text(emb, axes) -> None:
    e = axes
    cache = SemanticCache(embedder=emb)  # default answer_match=0.9 by embedding
    cache.store("first question", "A1", embedding=at(e[0], e[1], 0.8))
    cache.store("second question", "A2", embedding=at(e[0], e[2], 0.8))
    assert cache.stats().linked == 0
    cache.store("third question", "a1 ", embedding=at(e[0], e[3], 0.8))
    assert cache.stats().linked == 1


def test_contradicted_entry_loses_trust_then_goes(emb, axes, tmp_path) -> None:
    e = axes
    path = tmp_path / "c.sqlite"
    cache = SemanticCache(embedder=emb, path=path)
    cache.store("how do i close my account", "Settings > Close", embedding=e[0])
    hit = cache.lookup("how do i close my account", embedding=e[0])
    assert hit is not None
    assert cache.feedback(hit, correct=False) == 0.5
    assert cache.lookup("how do i close my account", embedding=e[0]) is None
    assert cache.stats().distrusted == 1
    # trust is stored with the entry: a reopened cache does not serve it either
    again = SemanticCache(embedder=emb, path=path)
    assert again.lookup("how do i close my account", embedding=e[0]) is None
    assert cache.feedback(hit.entry_id, correct=True) == 0.75
    assert cache.lookup("how do i close my account", embedding=e[0]) is not None
    assert cache.feedback(hit.entry_id, correct=False) == 0.25
    assert cache.feedback(hit.entry_id, correct=False) == 0.0
    assert len(cache) == 0
    with pytest.raises(InvalidInputError):
        cache.feedback("", correct=False)


def test_entry_rows_keep_cluster_and_trust_and_old_rows_still_decode() -> None:
    v = unit(np.arange(1, DIM + 1, dtype=np.float32))
    plain = Entry(id="x", partition="p", query="q", answer="a", vector=v)
    row = encode_entry(plain)
    assert "cluster" not in row.header and "trust" not in row.header  # as before clusters
    assert decode_entry(row).cluster == "" and decode_entry(row).trust == 1.0
    e = Entry(id="x", partition="p", query="q", answer="a", vector=v, cluster="c1", trust=0.5)
    back = decode_entry(encode_entry(e))
    assert (back.cluster, back.trust) == ("c1", 0.5)


def test_shadow_mode_never_serves_and_records_agreement(emb, axes, tmp_path) -> None:
    e = axes
    log = tmp_path / "shadow.jsonl"
    cache = SemanticCache(embedder=emb, mode="shadow", shadow_log=log)
    cache.store("how do i reset my password", "Settings > Security", embedding=e[0])
    cache.store("where is my order", "Orders > Track", embedding=e[1])
    assert cache.lookup("how can i reset my password", embedding=at(e[0], e[2], 0.95)) is None
    cache.store("how can i reset my password", "settings >  security",
                embedding=at(e[0], e[2], 0.95))  # the model's answer: the same text
    assert cache.lookup("where is my parcel", embedding=at(e[1], e[3], 0.95)) is None
    cache.store("where is my parcel", "Ask the courier", embedding=at(e[1], e[3], 0.95))
    assert cache.lookup("something new", embedding=e[5]) is None
    cache.store("something new", "new answer", embedding=e[5])
    st = cache.stats()
    assert (st.hits, st.shadow_lookups, st.shadow_would_hit) == (0, 3, 2)
    recs = list(cache.shadow.records)
    assert [(r.would_serve, r.agree) for r in recs] == [(True, True), (True, False),
                                                         (False, None)]
    # the disagreement lowered the trust of the entry that would have been served
    assert st.contradicted == 1
    rep = cache.shadow_report()
    assert rep.would_hit == 2 and rep.estimated_precision == 0.5
    assert read_shadow_log(log)[1].agree is False  # the same records in the file
    assert "Security" not in log.read_text()  # no answers in the log


def test_shadow_report_bands_and_cut() -> None:
    from semcomm.semantic import ShadowRecord

    rng = random.Random(0)
    recs = []
    for _ in range(400):
        s = rng.uniform(0.6, 1.0)
        recs.append(ShadowRecord(t=0.0, scope="s", similarity=s, would_serve=s >= 0.9,
                                 reason="", entry_id="e", agree=rng.random() < (s - 0.5) * 2))
    rep = shadow_report(recs, target_precision=0.85)
    assert rep.lookups == 400 and rep.would_hit == sum(r.would_serve for r in recs)
    top = [b for b in rep.bands if b.lo >= 0.95][0]
    low = [b for b in rep.bands if b.lo == 0.6][0]
    assert low.would_hit == 0 and top.precision is not None and top.precision > 0.85
    # agree probability 2 (s - 0.5) averages t over s >= t: the cut lands near 0.85
    assert rep.threshold is not None and 0.78 < rep.threshold < 0.92
    with pytest.raises(ConfigError):
        shadow_report(recs, target_precision=0.0)


def test_cache_report_cli(tmp_path) -> None:
    from semcomm.cli import app
    from semcomm.semantic import ShadowLog, ShadowRecord

    log = tmp_path / "s.jsonl"
    sl = ShadowLog(log)
    for i in range(60):
        s = 0.7 + i * 0.005
        sl.add(ShadowRecord(t=0.0, scope="s", similarity=s, would_serve=s > 0.8, reason="",
                            entry_id="e", agree=s > 0.75))
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    r = CliRunner().invoke(app, ["cache", "report", str(log), "--plot", str(png), "--json",
                                 str(js), "--target-precision", "0.95"])
    assert r.exit_code == 0, r.output
    assert "would-be hit rate" in r.output and "cosine cut" in r.output
    assert png.stat().st_size > 1000
    d = json.loads(js.read_text())
    assert d["lookups"] == 60 and 0.74 < d["threshold"] < 0.76
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    r = CliRunner().invoke(app, ["cache", "report", str(bad), "--plot", str(png)])
    assert isinstance(r.exception, InvalidInputError) and "not a shadow record" in str(
        r.exception)


def test_replayed_stream_recall_grows_precision_holds(emb) -> None:
    """Intents as directions; phrasings scattered around them (cos ~0.75 to their centre).
    Misses are answered and stored, wrong hits fed back: later traffic hits more, as
    precisely."""
    rng = np.random.default_rng(0)
    dim, n_int = DIM, 12
    centres = np.linalg.qr(rng.standard_normal((dim, dim)))[0][:n_int].astype(np.float32)

    def phrasing(k: int) -> np.ndarray:
        noise = rng.standard_normal(dim).astype(np.float32)
        noise -= (noise @ centres[k]) * centres[k]
        return unit(0.7 * centres[k] + 0.714 * noise / np.linalg.norm(noise))

    cache = SemanticCache(embedder=emb)
    for k in range(n_int):
        cache.store(f"seed phrasing of intent {k}", f"answer for intent {k}",
                    embedding=phrasing(k))
    halves: list[tuple[int, int]] = []
    for _ in range(2):
        hits = ok = 0
        for i in range(80):
            k = int(rng.integers(n_int))
            v = phrasing(k)
            q = f"customer phrasing {len(halves)}-{i}"
            h = cache.lookup(q, embedding=v)
            if h is None:
                cache.store(q, f"answer for intent {k}", embedding=v)
                continue
            hits += 1
            ok += h.answer == f"answer for intent {k}"
            if h.answer != f"answer for intent {k}":
                cache.feedback(h, correct=False)
        halves.append((hits, ok))
    (h1, ok1), (h2, ok2) = halves
    # recall grows with traffic (the centroid rule already serves 46 of the first 80, where
    # the earlier vote rule served 28), and most of the second half is served
    assert h2 > h1 and h2 > 40
    assert ok2 / h2 >= ok1 / max(1, h1) - 0.02  # precision does not fall


@pytest.mark.parametrize(("a", "b", "reason"), [
    ("How do I improve my speaking skills?", "How do I improve my speaking and listening skills?",
     "scope"),
    ("What do employees at Google think about the acquisition by Motorola?",
     "What do employees at Motorola think about the acquisition by Google?", "roles"),
    ("Can you have a mental illness and not be insane?",
     "Can you not have a mental illness and be insane?", "roles"),
    ("Is the HP M605n a good printer?", "Is the HP M605x a good printer?", "code"),
    ("What should I wear in winter in Delhi?", "What should I wear in summer in Delhi?",
     "antonym"),
    ("What is the difference between the HP M605n and the HP M605x?",
     "What is the difference between the HP M605n and M605x printers?", ""),
    ("How can I reset my password?", "How do I reset my password?", ""),
    ("What are the pros and cons of living in Pune?",
     "What are the pros and cons of living in Pune today?", "date"),
])
def test_guard_near_miss_kinds(a, b, reason) -> None:
    assert LexicalGuard().check(a, b).reason == reason
    assert LexicalGuard().check(b, a).reason == reason


def test_threshold_shortcut_is_still_a_fixed_threshold(emb) -> None:
    assert type(SemanticCache(embedder=emb, threshold=0.8).policy) is ThresholdPolicy


def test_judge_serves_borderline_lone_candidates_only(emb, axes) -> None:
    e = axes
    calls = []

    def judge(query, best, runner_up) -> float:
        calls.append(best.similarity)
        return 0.9 if "password" in query else 0.1

    cache = SemanticCache(embedder=emb, policy=ClusterVotePolicy(judge=judge, judge_floor=0.85))
    cache.store("how do i reset my password", "Settings > Security", embedding=e[0])
    hit = cache.lookup("forgot my password", embedding=at(e[0], e[1], 0.88))
    assert hit is not None and hit.verified and hit.reason == "judged"
    assert cache.lookup("forgot my username", embedding=at(e[0], e[1], 0.88)) is None
    assert cache.lookup("forgot my password", embedding=at(e[0], e[1], 0.80)) is None  # below
    assert cache.lookup("forgot my password", embedding=at(e[0], e[1], 0.95)) is not None
    assert len(calls) == 2  # only the two lookups in [0.85, 0.92) asked the judge
    with pytest.raises(ConfigError):
        ClusterVotePolicy(judge="yes")  # type: ignore[arg-type]


def test_judge_model_loads_lazily() -> None:
    import subprocess
    import sys

    code = ("import sys; import semcomm.semantic as s; j = s.JudgeVerifier(); "
            "print(j._model is None, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "False"]


def test_server_config_shadow_mode(tmp_path) -> None:
    from semcomm.server import load_config
    from semcomm.server._gateway import Gateway
    from semcomm.server._wiring import build_semantic

    def cfg(mode):  # type: ignore[no-untyped-def]
        return load_config(None, overrides={
            "server": {"state_dir": str(tmp_path)}, "models": {"tiny": {"path": "tiny"}},
            "semantic": {"backend": "memory", "mode": mode}}, defaults=False, environ={})

    c = cfg("shadow")
    sem, note = build_semantic(c, Gateway(c))
    assert sem is not None, note
    assert sem.cache.mode == "shadow"
    assert sem.cache.shadow.path == tmp_path / "semantic_shadow.jsonl"
    served, _ = build_semantic(cfg("serve"), Gateway(cfg("serve")))
    assert served is not None and served.cache.mode == "serve"
    with pytest.raises(ConfigError):
        cfg("dry-run")


def test_dashboard_shows_shadow_mode_live_through_the_gateway(tmp_path) -> None:
    """[semantic] mode = "shadow" on the gateway with the tiny model: nothing is served from the
    cache, and /dashboard's data shows the would-be hits, the estimated precision by band and
    the cut for 95 % precision as requests arrive."""
    import asyncio

    from semcomm.server import load_config
    from semcomm.server._backends import GenRequest
    from semcomm.server._dashboard import dashboard_data
    from semcomm.server._wiring import build_gateway

    def gateway(mode):  # type: ignore[no-untyped-def]
        return build_gateway(load_config(None, overrides={
            "server": {"state_dir": str(tmp_path / mode), "max_tokens_limit": 16},
            "models": {"tiny": {"path": "tiny", "max_batch": 1}},
            "kv": {"tiers": ["memory"]},
            "semantic": {"enabled": True, "backend": "memory", "mode": mode}},
            defaults=False, environ={}))

    async def ask(gw, text):  # type: ignore[no-untyped-def]
        req = GenRequest(model="tiny", messages=[{"role": "user", "content": text}],
                         prompt=None, max_tokens=6, stop=[], tenant=None, stream=False)
        served = await gw.serve(req, endpoint="chat")
        return served.hits_header, [i async for i in served.items][-1].text

    gw = gateway("shadow")
    asyncio.run(gw.startup())
    try:
        assert dashboard_data(gw)["semantic_shadow"]["lookups"] == 0
        q = "How do I reset my account password?"

        async def main() -> list[tuple[str, str]]:
            return [await ask(gw, t) for t in (q, q, q, "What is the capital of Peru?")]

        runs = asyncio.run(main())
        assert all(h != "semantic" for h, _ in runs)  # shadow mode never serves
        assert runs[0][1] == runs[1][1] != ""  # the model answered the repeat itself
        sh = dashboard_data(gw)["semantic_shadow"]
        # 4 lookups: the first found nothing, the repeats would have hit (and the greedy model
        # gave the same answer: they agree), the unrelated question would not
        assert (sh["lookups"], sh["would_hit"], sh["compared"]) == (4, 2, 2)
        assert sh["would_hit_rate"] == 0.5 and sh["estimated_precision"] == 1.0
        top = [b for b in sh["bands"] if b["hi"] == 1.0][0]
        assert (top["would_hit"], top["precision"]) == (2, 1.0)
        assert sh["target_precision"] == 0.95 and sh["awaiting_answer"] == 0
    finally:
        asyncio.run(gw.shutdown())
    served = gateway("serve")
    assert dashboard_data(served)["semantic_shadow"] is None
