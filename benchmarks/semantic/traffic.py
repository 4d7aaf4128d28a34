"""Semantic cache on support-bot traffic: the issue's goals in one run, against plain MiniLM
cosine and GPTCache on the same vectors.

Workloads (``benchmarks.semantic.common``; what each is used for):

- ``clinc-dev`` (DEVELOPMENT: the policy's defaults were chosen here): CLINC150, 44
  single-answer intents outside banking, 5 stored phrasings per intent from ``train``, 20 other
  ``train`` phrasings per intent as queries, plus the 100 ``oos_train`` queries.
- ``clinc-banking`` (HELD OUT, the issue's "banking-support intent set"; banking77 is not in the
  data, so CLINC150's banking and credit-card domains, 30 intents): 5 stored phrasings per
  intent from ``train``, all 600 ``val`` phrasings as queries, plus the 100 ``oos_val`` queries.
- ``clinc-dev-val`` (HELD OUT queries of the development intents): the 880 ``val`` phrasings.
- ``quora-faq`` (HELD OUT, another FAQ-like set): ``meancache_test.csv`` duplicate components
  of 3+ questions are answers (up to 5 stored, one looked up), 3,000 questions without a
  duplicate stored as distractors and 3,000 others looked up as out-of-scope.
- ``quora-pairs`` (HELD OUT, the issue's Quora goal): the cache protocol of
  ``benchmarks.semantic.quality`` on 2,000 ``meancache_test.csv`` pairs.

Also: lookup p50 at 100k entries (synthetic vectors with the mean and covariance of the
Quora-FAQ embeddings, vectors given, no embedding, no judge), a replayed stream (answer
learning: misses are answered and stored, hits checked and fed back; recall and precision per
quarter), and shadow mode on a replayed stream (estimated precision from answer agreement
against the precision measured with the labels).

    python -m benchmarks.semantic.traffic             # ~10 min on a free 2-core box
    python -m benchmarks.semantic.traffic --judge-samples 0   # without the judge rows
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

from benchmarks.common import agg_figure

torch.set_num_threads(int(os.environ.get("SEMCOMM_BENCH_THREADS", "1")))

from rich.console import Console
from rich.table import Table

from benchmarks.semantic.common import (
    BANKING_INTENTS,
    DEFAULT_DATA,
    DEV_FAQ_INTENTS,
    FAQWorkload,
    Protocol,
    build_protocol,
    clinc_faq,
    quora_faq,
)
from semcomm import SemanticCache
from semcomm.semantic import CallableEmbedder, default_embedder

console = Console()
PREVIOUS = "previous default (vote rule, lone cut 0.91 / 0.65)"
NO_CROSS = "SemanticCache(cross_encoder=False) (centroid rule + 0.92)"
EMB_DIR = Path(tempfile.gettempdir()) / "semcomm-emb"


def embed(texts: list[str]) -> np.ndarray:
    """MiniLM vectors, cached on disk by the texts' digest (re-runs embed nothing)."""
    h = hashlib.sha1("\n".join(texts).encode()).hexdigest()[:16]
    f = EMB_DIR / f"faq_{h}.npy"
    if f.exists():
        return np.load(f)
    EMB_DIR.mkdir(parents=True, exist_ok=True)
    with console.status(f"embedding {len(texts)} texts"):
        v = default_embedder().embed(texts)
    np.save(f, v)
    return v


def pairs_workload(limit: int, *, offset: int = 0, name: str = "quora-pairs") -> FAQWorkload:
    """The QQP cache protocol as an FAQ: every stored question is its own answer; a query's
    right answers are the stored questions of its duplicate component. ``offset``: skip the
    protocol's first pairs (``meancache_test.csv``, seed 0; pairs 0-1999 are the classic
    2,000-pair set, later ones are fresh blocks for ``benchmarks.semantic.fresh``)."""
    full = build_protocol(DEFAULT_DATA / "meancache_test.csv", seed=0,
                          limit=offset + limit)
    p = Protocol(full.stored[offset:], full.queries[offset:], full.labels[offset:], full.comp)
    return protocol_workload(p, name)


def protocol_workload(p: Protocol, name: str) -> FAQWorkload:
    """A pair protocol as an FAQ workload (see :func:`pairs_workload`)."""
    from benchmarks.semantic.common import norm

    comp_of = [p.comp.get(norm(s)) for s in p.stored]
    answers = [f"answer:{i}" for i in range(len(p.stored))]
    stored_comps = set(comp_of)
    expected = []
    for q in p.queries:
        c = p.comp.get(norm(q))
        expected.append(f"comp:{c}" if c in stored_comps else None)
    w = FAQWorkload(name, p.stored, answers, p.queries, expected)
    w.comp_of_answer = {a: f"comp:{c}" for a, c in zip(answers, comp_of, strict=True)}  # type: ignore[attr-defined]
    return w


def previous_default() -> object:
    """The default policy before the centroid rule: the neighbour vote, same lone cut."""
    from semcomm.semantic import VERIFIED_MIN_SCORE, VERIFIED_THRESHOLD, ClusterVotePolicy
    from semcomm.semantic._cross import default_cross_verifier

    return ClusterVotePolicy(VERIFIED_THRESHOLD, scorer=default_cross_verifier(),
                             min_score=VERIFIED_MIN_SCORE, rule="vote")


def right(w: FAQWorkload, answer: str, expected: str | None) -> bool:
    if expected is None:
        return False
    m = getattr(w, "comp_of_answer", None)
    return (m[answer] if m is not None else answer) == expected


def score(w: FAQWorkload, served: list[str | None]) -> dict:
    ins = w.in_scope()
    hits = [i for i, a in enumerate(served) if a is not None]
    ok = sum(right(w, served[i], w.expected[i]) for i in hits)  # type: ignore[arg-type]
    oos = sum(1 for i in hits if w.expected[i] is None)
    return {"hits": len(hits), "precision": ok / len(hits) if hits else 1.0,
            "recall": ok / max(1, int(ins.sum())),
            "oos_hit_rate": oos / max(1, int((~ins).sum()))}


def run_semcomm(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray, **kw) -> tuple[dict, list]:
    cache = SemanticCache(embedder=default_embedder(), max_entries=None, **kw)
    cache.store_many(w.stored, w.answers, embeddings=list(sv))
    xv = getattr(cache.policy, "scorer", None)
    calls0, sec0 = getattr(xv, "calls", 0), getattr(xv, "seconds", 0.0)
    served, lat = [], []
    for q, v in zip(w.queries, qv, strict=True):
        t = time.perf_counter()
        h = cache.lookup(q, embedding=v)
        lat.append(time.perf_counter() - t)
        served.append(None if h is None else h.answer)
    r = score(w, served)
    a = np.asarray(lat) * 1e3
    r["lookup_p50_ms"] = float(np.percentile(a, 50))
    r["lookup_p90_ms"] = float(np.percentile(a, 90))
    calls = getattr(xv, "calls", 0) - calls0
    r["scored_share"] = calls / max(1, len(w.queries))  # lookups that ran the cross-encoder
    r["ms_per_scored_lookup"] = (1e3 * (getattr(xv, "seconds", 0.0) - sec0) / calls
                                 if calls else None)
    return r, served


def run_cosine(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray, cut: float) -> dict:
    """Plain MiniLM cosine: the nearest stored phrasing's answer when cos >= cut."""
    sims = qv @ sv.T
    j = sims.argmax(1)
    best = sims[np.arange(len(j)), j]
    return score(w, [w.answers[k] if s >= cut else None for k, s in zip(j, best, strict=True)])


def run_gptcache(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray, cut: float) -> dict:
    out = gptcache_served(w, sv, qv, cut)
    if isinstance(out, dict):
        return out
    served, lat = out
    r = score(w, served)
    r["cos_cut"] = cut
    r["lookup_p50_ms"] = float(np.median(lat) * 1e3)
    return r


def gptcache_served(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray,
                    cut: float) -> tuple[list, list[float]] | dict:
    """GPTCache 0.1.44 on the workload: (answer served per query or None, seconds per get), or
    ``{"error": ...}`` when gptcache/faiss are not importable."""
    try:
        import faiss  # noqa: F401
        from gptcache import Cache, Config
        from gptcache.adapter.api import get, put
        from gptcache.manager import CacheBase, VectorBase, get_data_manager
        from gptcache.processor.pre import get_prompt
        from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation
    except ImportError as exc:
        return {"error": f"gptcache/faiss not importable: {exc}"}
    vec = {q: v for q, v in zip(w.stored, sv, strict=True)}
    vec.update({q: v for q, v in zip(w.queries, qv, strict=True)})
    # GPTCache commits to SQLite on every get: keep its files in memory where the box allows
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = tempfile.mkdtemp(prefix="gptcache-traffic-", dir=shm)
    # GPTCache writes its index when the process exits (its own atexit hook, registered by
    # init below); exit hooks run last-registered first, so this removal runs after that write
    atexit.register(shutil.rmtree, tmp, True)
    c = Cache()
    dm = get_data_manager(CacheBase("sqlite", sql_url=f"sqlite:///{tmp}/g.db"),
                          VectorBase("faiss", dimension=sv.shape[1],
                                     index_path=f"{tmp}/faiss.index"),
                          max_size=len(w.stored) + 10)
    # SearchDistanceEvaluation maps similarity_threshold tau to cos >= 2 tau - 1
    c.init(pre_embedding_func=get_prompt, embedding_func=lambda x, **_: vec[x], data_manager=dm,
           similarity_evaluation=SearchDistanceEvaluation(),
           config=Config(similarity_threshold=(cut + 1) / 2))
    for q, a in zip(w.stored, w.answers, strict=True):
        put(q, a, cache_obj=c)
    served, lat = [], []
    for q in w.queries:
        t = time.perf_counter()
        served.append(get(q, cache_obj=c))
        lat.append(time.perf_counter() - t)
    return served, lat


def replay_learning(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray, seed: int,
                    policy: object = None) -> list[dict]:
    """Answer learning on a replayed stream: the cache starts with the stored phrasings; each
    query is looked up; a hit is checked (a wrong one is fed back as contradicted, as a user
    regenerating would); a miss is answered by the "model" (the right answer; out-of-scope
    queries get an answer of their own) and stored. Recall and precision per quarter."""
    cache = SemanticCache(embedder=default_embedder(), max_entries=None, policy=policy)
    cache.store_many(w.stored, w.answers, embeddings=list(sv))
    order = list(range(len(w.queries)))
    random.Random(seed).shuffle(order)
    quarters = [order[i * len(order) // 4:(i + 1) * len(order) // 4] for i in range(4)]
    out = []
    for qi, part in enumerate(quarters):
        hits = ok = ins = 0
        for i in part:
            e = w.expected[i]
            ins += e is not None
            h = cache.lookup(w.queries[i], embedding=qv[i])
            if h is not None:
                hits += 1
                good = right(w, h.answer, e)
                ok += good
                if not good:
                    cache.feedback(h, correct=False)
                    cache.store(w.queries[i], e or f"own:{i}", embedding=qv[i])
            else:
                cache.store(w.queries[i], e or f"own:{i}", embedding=qv[i])
        out.append({"quarter": qi + 1, "lookups": len(part), "hits": hits,
                    "precision": ok / hits if hits else 1.0, "recall": ok / max(1, ins)})
    st = cache.stats()
    out.append({"linked": st.linked, "contradicted": st.contradicted, "entries": st.entries})
    return out


TEMPLATES = ("To {x}, open the app, choose Help and follow the {x} steps.",
             "You can {x} in the app: Help, then the {x} page.",
             "Go to Help in the app; the {x} page explains how to {x}.")


def replay_shadow(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray, seed: int,
                  policy: object = None) -> dict:
    """Shadow mode on a labelled stream whose answers are texts: each intent's answer is one of
    three phrasings (templates), so agreement is decided by answer embeddings (the default
    ``answer_match``), not by equal labels. Estimated precision (agreement of would-be hits
    with the real answer) against measured precision (the labels)."""
    rng = random.Random(seed)

    def text(label: str) -> str:
        x = label.removeprefix("answer:").replace("_", " ")
        return rng.choice(TEMPLATES).format(x=x)

    cache = SemanticCache(embedder=default_embedder(), max_entries=None, mode="shadow",
                          policy=policy)
    ids = cache.store_many(w.stored, [text(a) for a in w.answers], embeddings=list(sv))
    label_of = dict(zip(ids, w.answers, strict=True))  # entry id -> the right answer's label
    order = list(range(len(w.queries)))
    rng.shuffle(order)
    for i in order:
        e = w.expected[i]
        cache.lookup(w.queries[i], embedding=qv[i])  # None: shadow mode never serves
        real = text(e) if e is not None else f"a reply about something else entirely, number {i}"
        label_of[cache.store(w.queries[i], real, embedding=qv[i])] = e or f"own:{i}"
    # records are finished in stream order (each by the store of its query)
    recs = list(cache.shadow.records)
    assert len(recs) == len(order)
    served = [(r, w.expected[i]) for r, i in zip(recs, order, strict=True) if r.would_serve]
    measured_ok = sum(label_of.get(r.entry_id) == e for r, e in served)
    measured_n = len(served)
    rep = cache.shadow_report(target_precision=0.95)
    return {"lookups": rep.lookups, "would_hit_rate": rep.would_hit_rate,
            "estimated_precision": rep.estimated_precision,
            "measured_precision": measured_ok / measured_n if measured_n else None,
            "threshold_for_0.95": rep.threshold, "report": rep.as_dict()}


def judge_rows(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray, n: int, model: str) -> dict:
    """The instruct-model judge on lone borderline candidates (0.85 <= cos < 0.92, guard
    passed): how well its yes separates right from wrong, and its cost per call."""
    from semcomm.semantic import JudgeVerifier, LexicalGuard

    g = LexicalGuard()
    sims = qv @ sv.T
    j = sims.argmax(1)
    best = sims[np.arange(len(j)), j]
    pool = [i for i in range(len(w.queries)) if 0.85 <= best[i] < 0.92
            and g(w.queries[i], w.stored[j[i]])]
    pick = random.Random(0).sample(pool, min(n, len(pool)))
    judge = JudgeVerifier(model, threads=torch.get_num_threads())
    ps, ys = [], []
    for i in pick:
        ps.append(judge.score(w.queries[i], w.stored[j[i]]))
        ys.append(right(w, w.answers[j[i]], w.expected[i]))
    yes = [y for p, y in zip(ps, ys, strict=True) if p >= judge.threshold]
    return {"model": model, "n": len(pick), "positives": int(sum(ys)),
            "yes": len(yes), "precision_yes": round(sum(yes) / len(yes), 3) if yes else None,
            "recall_yes": round(sum(yes) / max(1, sum(ys)), 3),
            "mean_p_right": float(np.mean([p for p, y in zip(ps, ys, strict=True) if y]))
            if any(ys) else None,
            "mean_p_wrong": float(np.mean([p for p, y in zip(ps, ys, strict=True) if not y]))
            if not all(ys) else None,
            "ms_per_call": judge.ms_per_call}


def lookup_speed(vecs_like: np.ndarray, n: int, q: int, seed: int) -> dict:
    """Lookup p50 with ``n`` entries (default cache, vectors given, no judge model)."""
    rng = np.random.default_rng(seed)
    x = vecs_like.astype(np.float64)
    mean = x.mean(0)
    chol = np.linalg.cholesky(np.cov((x - mean).T) + 1e-6 * np.eye(x.shape[1]))
    z = rng.standard_normal((n, x.shape[1]))
    v = (mean + z @ chol.T).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    dim = v.shape[1]
    emb = CallableEmbedder(lambda t: np.zeros((len(t), dim)), name="none", dim=dim)
    cache = SemanticCache(embedder=emb, max_entries=None)
    texts = [f"stored question {i}" for i in range(n)]
    for s in range(0, n, 10_000):
        cache.store_many(texts[s:s + 10_000], [f"answer {i}" for i in range(s, min(n, s + 10_000))],
                         embeddings=list(v[s:s + 10_000]))
    cache.wait_index()
    lat, ok = [], 0
    for i in rng.integers(0, n, q):
        noise = rng.standard_normal(dim).astype(np.float32)
        qv = v[i] + 0.35 * noise / np.linalg.norm(noise)
        t = time.perf_counter()
        h = cache.lookup(texts[i], embedding=qv)
        lat.append(time.perf_counter() - t)
        ok += h is not None and h.answer == f"answer {i}"
    a = np.asarray(lat) * 1e3
    return {"entries": n, "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99)), "hit_ok": ok / q,
            "index": cache.stats().index}


def lookup_speed_traffic(w: FAQWorkload, sv: np.ndarray, qv: np.ndarray, n: int,
                         seed: int, cluster_size: int = 1) -> dict:
    """The default ``SemanticCache()`` at ``n`` entries on real lookups: the workload's stored
    questions (real texts and vectors) plus synthetic distractors (vectors with the mean and
    covariance of the stored ones) up to ``n``; every query of the workload looked up with its
    real text and vector, so the cross-encoder runs exactly where it would on that traffic.
    ``cluster_size`` > 1: the distractors share answers in groups of that many (answer
    clusters whose centroids every lookup with a cluster candidate compares against)."""
    rng = np.random.default_rng(seed)
    x = sv.astype(np.float64)
    mean = x.mean(0)
    chol = np.linalg.cholesky(np.cov((x - mean).T) + 1e-6 * np.eye(x.shape[1]))
    m = n - len(w.stored)
    v = (mean + rng.standard_normal((m, x.shape[1])) @ chol.T).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    cache = SemanticCache(embedder=default_embedder(), max_entries=None)
    xv = getattr(cache.policy, "scorer", None)
    cache.store_many(w.stored, w.answers, embeddings=list(sv))
    for s in range(0, m, 10_000):
        k = min(m, s + 10_000)
        cache.store_many([f"synthetic distractor {i}" for i in range(s, k)],
                         [f"distractor answer {i // cluster_size}" for i in range(s, k)],
                         embeddings=list(v[s:k]))
    cache.wait_index()
    calls0, sec0 = getattr(xv, "calls", 0), getattr(xv, "seconds", 0.0)
    lat, served = [], []
    for q, qe in zip(w.queries, qv, strict=True):
        t = time.perf_counter()
        h = cache.lookup(q, embedding=qe)
        lat.append(time.perf_counter() - t)
        served.append(None if h is None else h.answer)
    a = np.asarray(lat) * 1e3
    calls = getattr(xv, "calls", 0) - calls0
    r = score(w, served)
    r.update({"entries": len(cache), "lookups": len(lat), "p50_ms": float(np.percentile(a, 50)),
              "p90_ms": float(np.percentile(a, 90)), "p99_ms": float(np.percentile(a, 99)),
              "scored_share": calls / len(lat),
              "ms_per_scored_lookup": 1e3 * (getattr(xv, "seconds", 0.0) - sec0) / calls
              if calls else None, "index": cache.stats().index,
              "cluster_size": cluster_size})
    return r


def pair_sets(data: Path) -> dict:
    """The verified band on development pair sets the cross-encoder never saw (MRPC and STS
    ``val``: news and forum sentences, not questions): of the pairs at cos >= 0.88 that pass the
    guard, how many the labels call the same (MRPC: paraphrase; STS: score >= 4), with and
    without the cross-encoder's ``P >= 0.7``."""
    import csv

    from semcomm.semantic import VERIFIED_MIN_SCORE, VERIFIED_THRESHOLD, LexicalGuard
    from semcomm.semantic._cross import default_cross_verifier

    sets = {"mrpc-val": (data / "pairs" / "para_msr_msr-para-val.tsv", 3, 4, lambda v: v == "1"),
            "sts-val": (data / "pairs" / "sts_semeval-sts_all_2015.val.tsv", 1, 2,
                        lambda v: float(v) >= 4.0)}
    g, xv, out = LexicalGuard(), default_cross_verifier(), {}
    for name, (path, ia, ib, same) in sets.items():
        rows = []
        with open(path, newline="", encoding="utf-8") as fh:
            for r in csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE):
                try:
                    float(r[0])  # MRPC's header line has "Quality" here
                    rows.append((r[ia], r[ib], bool(same(r[0]))))
                except (IndexError, ValueError):
                    continue
        va, vb = embed([a for a, _, _ in rows]), embed([b for _, b, _ in rows])
        cos = (va * vb).sum(1)
        band = [(a, b, y) for (a, b, y), c in zip(rows, cos, strict=True)
                if c >= VERIFIED_THRESHOLD and g(a, b)]
        yes = [(a, b, y) for a, b, y in band if xv.score(a, b) >= VERIFIED_MIN_SCORE]
        out[name] = {"pairs": len(rows), "same": int(sum(y for *_, y in rows)),
                     "band_pairs": len(band), "band_precision": float(np.mean(
                         [y for *_, y in band])) if band else None,
                     "verified_pairs": len(yes), "verified_precision": float(np.mean(
                         [y for *_, y in yes])) if yes else None}
    return out


def _floors(floors: list[float], out: Path) -> None:
    """The previous default policy (the vote rule) with another cluster-vote floor (the best
    member's similarity a vote needs; default 0.6) on the four FAQ workloads: does a higher
    floor keep loose topic clusters from out-of-scope queries without losing CLINC's recall?"""
    from semcomm.semantic import VERIFIED_MIN_SCORE, VERIFIED_THRESHOLD, ClusterVotePolicy
    from semcomm.semantic._cross import default_cross_verifier

    wl = {"clinc-dev (development)": clinc_faq("train", DEV_FAQ_INTENTS, queries_per_intent=20),
          "clinc-banking (held out)": clinc_faq("val", BANKING_INTENTS),
          "clinc-dev-val (held out)": clinc_faq("val", DEV_FAQ_INTENTS),
          "quora-faq (held out)": quora_faq(DEFAULT_DATA / "meancache_test.csv")}
    res: dict = {}
    tbl = Table(title="vote floor (precision / recall / out-of-scope hit rate)")
    tbl.add_column("floor")
    for name in wl:
        tbl.add_column(name)
    for f in floors:
        res[str(f)] = row = {}
        for name, w in wl.items():
            pol = ClusterVotePolicy(VERIFIED_THRESHOLD, scorer=default_cross_verifier(),
                                    min_score=VERIFIED_MIN_SCORE, floor=f, rule="vote")
            row[name], _ = run_semcomm(w, embed(w.stored), embed(w.queries), policy=pol)
        tbl.add_row(str(f), *(f"{r['precision']:.3f} / {r['recall']:.3f} / "
                              f"{r['oos_hit_rate']:.3f}" for r in row.values()))
    console.print(tbl)
    out.mkdir(parents=True, exist_ok=True)
    (out / "semantic_traffic_floors.json").write_text(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 5 intents per CLINC set, 100 Quora pairs, 50 distractors, "
                         "no judge, 1,000 entries for the speed rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--speed-entries", type=int, default=100_000)
    ap.add_argument("--speed-queries", type=int, default=500)
    ap.add_argument("--no-gptcache", action="store_true")
    ap.add_argument("--no-cross", action="store_true", help="skip the opt-in cross-encoder rows")
    ap.add_argument("--judge-samples", type=int, default=40,
                    help="borderline Quora candidates the instruct-model judge scores (0: none)")
    ap.add_argument("--judge-model", default="smollm2-135m-instruct")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    ap.add_argument("--pair-sets-only", action="store_true",
                    help="only the MRPC/STS check of the verified band "
                         "(semantic_traffic_pairsets.json)")
    ap.add_argument("--floors", default="",
                    help="only: the default policy with these vote floors (e.g. 0.6,0.65,0.7) "
                         "on the FAQ workloads (semantic_traffic_floors.json)")
    args = ap.parse_args()
    if args.floors:
        _floors([float(f) for f in args.floors.split(",")], args.out)
        return
    if args.pair_sets_only:
        ps = pair_sets(DEFAULT_DATA)
        for k, v in ps.items():
            console.print(f"{k}: {v}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "semantic_traffic_pairsets.json").write_text(json.dumps(ps, indent=1))
        return
    if args.plot_only:
        _plot(json.loads((args.out / "semantic_traffic.json").read_text()),
              args.out / "semantic_traffic.png")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    n_int = 5 if args.quick else None  # --quick: the first intents of each CLINC set
    if args.quick:
        args.pairs, args.judge_samples = 100, 0
        args.speed_entries, args.speed_queries = 1000, 20
    wl = {
        "clinc-dev (development)": clinc_faq("train", DEV_FAQ_INTENTS[:n_int],
                                             queries_per_intent=3 if args.quick else 20),
        "clinc-banking (held out)": clinc_faq("val", BANKING_INTENTS[:n_int]),
        "clinc-dev-val (held out)": clinc_faq("val", DEV_FAQ_INTENTS[:n_int]),
        "quora-faq (held out)": quora_faq(DEFAULT_DATA / "meancache_test.csv",
                                          distractors=50 if args.quick else 3000),
        "quora-pairs (held out)": pairs_workload(args.pairs),
    }
    vecs = {k: (embed(w.stored), embed(w.queries)) for k, w in wl.items()}
    res: dict = {"seed": args.seed, "workloads": {}}
    tbl = Table(title="semantic cache on FAQ traffic (precision / recall / out-of-scope hits)")
    for col in ("workload", "configuration", "precision", "recall", "OOS hit rate", "hits",
                "scored", "p50 / p90 ms"):
        tbl.add_column(col)
    for name, w in wl.items():
        sv, qv = vecs[name]
        console.log(f"workload {name}: {len(w.stored)} stored, {len(w.queries)} queries")
        rows = {}
        rows["SemanticCache() default"], served = run_semcomm(w, sv, qv)
        rows[PREVIOUS], _ = run_semcomm(w, sv, qv, policy=previous_default())
        rows[NO_CROSS], _ = run_semcomm(w, sv, qv, cross_encoder=False)
        rows["SemanticCache(threshold=0.92) (fixed threshold, no votes)"], _ = run_semcomm(
            w, sv, qv, threshold=0.92)
        for cut in (0.92, 0.80, 0.75):
            rows[f"plain MiniLM cosine >= {cut:.2f}"] = run_cosine(w, sv, qv, cut)
        if not args.no_cross and ("quora-pairs" in name or "banking" in name):
            rows["cross_encoder=True (opt-in: votes + 0.92 and P >= 0.5)"], _ = run_semcomm(
                w, sv, qv, policy="cluster", cross_encoder=True)
        if not args.no_gptcache:
            rows["GPTCache 0.1.44 at cos 0.80 (same vectors)"] = run_gptcache(w, sv, qv, 0.80)
        res["workloads"][name] = {"stored": len(w.stored), "queries": len(w.queries),
                                  "in_scope": int(w.in_scope().sum()), "rows": rows}
        for cfg, r in rows.items():
            if "error" in r:
                console.print(f"[yellow]{cfg}: {r['error']}")
                continue
            lat = (f"{r['lookup_p50_ms']:.2f} / {r['lookup_p90_ms']:.2f}"
                   if "lookup_p90_ms" in r else "")
            tbl.add_row(name, cfg, f"{r['precision']:.3f}", f"{r['recall']:.3f}",
                        f"{r['oos_hit_rate']:.3f}", str(r["hits"]),
                        f"{r['scored_share']:.0%}" if r.get("scored_share") else "", lat)
    console.print(tbl)
    bank = "clinc-banking (held out)"
    res["replay_learning"] = replay_learning(wl[bank], *vecs[bank], args.seed)
    t2 = Table(title=f"answer learning on a replayed stream ({bank})")
    for col in ("quarter", "lookups", "hits", "precision", "recall"):
        t2.add_column(col)
    for r in res["replay_learning"][:4]:
        t2.add_row(str(r["quarter"]), str(r["lookups"]), str(r["hits"]),
                   f"{r['precision']:.3f}", f"{r['recall']:.3f}")
    console.print(t2)
    console.print(res["replay_learning"][4])
    if not args.quick:  # the previous default's replay: the same code path with another policy
        res["replay_learning_previous"] = prev = replay_learning(
            wl[bank], *vecs[bank], args.seed, policy=previous_default())
        console.print(f"{PREVIOUS}: recall by quarter "
                      f"{[round(r['recall'], 3) for r in prev[:4]]}, precision "
                      f"{[round(r['precision'], 3) for r in prev[:4]]}")
    res["shadow_previous"] = {}
    res["shadow"] = {}
    for name in ("clinc-dev (development)", bank, "clinc-dev-val (held out)"):
        res["shadow"][name] = s = replay_shadow(wl[name], *vecs[name], args.seed)
        console.print(f"shadow replay {name}: would-be hit rate {s['would_hit_rate']:.3f}, "
                      f"estimated precision {s['estimated_precision']:.3f}, measured "
                      f"{s['measured_precision']:.3f}")
        if args.quick:
            continue
        res["shadow_previous"][name] = s = replay_shadow(wl[name], *vecs[name], args.seed,
                                                         policy=previous_default())
        console.print(f"  {PREVIOUS}: would-be hit rate {s['would_hit_rate']:.3f}, estimated "
                      f"{s['estimated_precision']:.3f}, measured {s['measured_precision']:.3f}")
    if args.judge_samples:
        res["judge"] = j = judge_rows(wl["quora-pairs (held out)"],
                                      *vecs["quora-pairs (held out)"], args.judge_samples,
                                      args.judge_model)
        console.print(f"judge {j['model']}: {j['ms_per_call']:.0f} ms per call; on {j['n']} "
                      f"borderline candidates ({j['positives']} right): precision of yes "
                      f"{j['precision_yes']}, recall {j['recall_yes']}")
    allv = np.concatenate([vecs["quora-faq (held out)"][0], vecs[bank][0]])
    res["speed"] = sp = lookup_speed(allv, args.speed_entries, args.speed_queries, args.seed)
    console.print(f"lookup at {sp['entries']} entries: p50 {sp['p50_ms']:.3f} ms, p99 "
                  f"{sp['p99_ms']:.3f} ms ({sp['index']}, {sp['hit_ok']:.0%} found their entry)")
    qp = "quora-pairs (held out)"
    res["speed_traffic"] = st = lookup_speed_traffic(wl[qp], *vecs[qp], args.speed_entries,
                                                     args.seed)
    console.print(f"default SemanticCache() at {st['entries']} entries on the {qp} lookups: "
                  f"p50 {st['p50_ms']:.3f} ms, p90 {st['p90_ms']:.2f} ms, p99 {st['p99_ms']:.2f} "
                  f"ms; cross-encoder on {st['scored_share']:.1%} of lookups, "
                  f"{st['ms_per_scored_lookup'] or 0:.1f} ms each; precision "
                  f"{st['precision']:.3f}, recall {st['recall']:.3f} ({st['index']})")
    (args.out / "semantic_traffic.json").write_text(json.dumps(res, indent=1, default=float))
    _plot(res, args.out / "semantic_traffic.png")
    console.print(f"wrote {args.out / 'semantic_traffic.json'} and semantic_traffic.png")


def _plot(res: dict, path: Path) -> None:
    with agg_figure(path, (8, 5)) as ax:
        marks = {"SemanticCache() default": ("o", "red"),
                 NO_CROSS: ("o", "green"), PREVIOUS: ("D", "purple"),
                 "SemanticCache(threshold=0.92) (fixed threshold, no votes)": ("s", "orange"),
                 "plain MiniLM cosine >= 0.80": ("^", "blue"),
                 "plain MiniLM cosine >= 0.75": ("v", "blue"),
                 "GPTCache 0.1.44 at cos 0.80 (same vectors)": ("x", "black")}
        shapes = ["o", "s", "^", "v", "D"]
        for wi, (name, w) in enumerate(res["workloads"].items()):
            xs, ys = [], []
            for cfg, (m, col) in marks.items():
                r = w["rows"].get(cfg)
                if r is None or "precision" not in r:
                    continue
                ax.scatter([r["recall"]], [r["precision"]], marker=shapes[wi % len(shapes)],
                           color=col, s=70 if col == "red" else 40,
                           zorder=3 if col == "red" else 2)
                if cfg == "SemanticCache() default":
                    ax.annotate(name.split(" (")[0], (r["recall"], r["precision"]), fontsize=7,
                                xytext=(4, -10), textcoords="offset points")
                xs.append(r["recall"])
                ys.append(r["precision"])
        for wi, name in enumerate(res["workloads"]):
            ax.scatter([], [], marker=shapes[wi % len(shapes)], color="gray", label=name)
        ax.legend(fontsize=7, loc="lower left")
        ax.axhline(0.95, color="gray", ls=":")
        ax.axvline(0.50, color="gray", ls=":")
        ax.set_xlabel("recall (in-scope queries served right)")
        ax.set_ylabel("hit precision")
        ax.set_title("red: SemanticCache() (centroid rule + cross-encoder on lone hits), purple: "
                     "previous default (vote rule),\ngreen: cross_encoder=False, orange: "
                     "threshold 0.92, blue: cosine 0.80/0.75, black: GPTCache 0.80", fontsize=8)


if __name__ == "__main__":
    main()
