"""What separates a right answer-cluster hit from a near-miss twin, on development FAQ traffic
only: the evidence behind the out-of-scope goal's status in docs/BENCHMARKS.md.

The default policy's centroid rule serves some phrasings of an unstored intent that is the twin
of a stored one ("how do I change my oil" against a stored "when do I change my oil"). On the
four clinc-holdout splits and clinc-dev / clinc-banking / clinc-dev-val (``bench_semantic_rule``'s
development sets; no fresh lookup is read), every hit of ``SemanticCache()`` by the centroid rule
is labelled right, wrong (another stored intent) or out of scope, and each candidate signal is
scored by its AUC between right and out-of-scope hits and by the share of out-of-scope hits it
removes when it may drop 4 % / 8 % of the right ones:

- the cosine of the query to the cluster's most similar phrasing, to its centroid, the slack
  over the spread test (``centroid - (cohesion - spread)``) and the margin over the rival;
- a per-cluster Mahalanobis distance of the query from the centroid under the pooled
  within-intent covariance of CLINC ``train`` phrasings (shrunk halfway to a multiple of the
  identity; the held-out quarter's intents left out), relative to the members' own distances;
- the shipped cross-encoder's P for the query and the most similar phrasing;
- the query's content words that no phrasing of the cluster has (``novel_words``: minus their
  IDF over CLINC ``train`` phrasings of the development intents, as a share of the query's
  own IDF mass; a query that asks for an action the cluster never names scores low), and
  the same count unweighted (``novel_count``);
- ``combined_cv``: a logistic regression over all the signals above (right against out of
  scope), each set's hits scored by the model fitted on the other six sets (leave one set
  out), so that its figures are out of sample; ``combined_cv_free`` the same without the
  cross-encoder (no model call);
- an instruct judge's P(yes) (``JudgeVerifier``, SmolLM2-135M and Qwen2.5-Coder-0.5B) on a
  seeded sample of ``--judge-sample`` right and as many out-of-scope hits, with its cost.

    python benchmarks/bench_semantic_twins.py               # ~6 min on the shared 2-core box
    python benchmarks/bench_semantic_twins.py --judge-sample 0   # without the judges
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench_semantic_common import dev_train_phrasings, holdout_quarter
from bench_semantic_rule import dev_sets
from bench_semantic_traffic import embed, right
from rich.console import Console
from rich.table import Table

from semcomm import SemanticCache
from semcomm.semantic import (
    VERIFIED_MIN_SCORE,
    VERIFIED_THRESHOLD,
    ClusterVotePolicy,
    JudgeVerifier,
    default_embedder,
)
from semcomm.semantic._cross import default_cross_verifier

console = Console(width=160)
LOSSES = (0.04, 0.08)  # share of right hits a signal may drop


class _Recording(ClusterVotePolicy):
    """The default policy, remembering the candidates of its last decision."""

    last: list = []

    def decide(self, query, candidates, *, threshold=None):  # type: ignore[no-untyped-def]
        self.last = list(candidates)
        return super().decide(query, candidates, threshold=threshold)


SET_LOOKUPS: dict[str, dict[str, int]] = {}  # per development set: in-scope / oos lookups


def centroid_hits(seed: int) -> list[dict]:
    """Every centroid-rule hit of the default policy on the development sets."""
    xv = default_cross_verifier()
    out = []
    for name, w in dev_sets(seed).items():
        ins = w.in_scope()
        SET_LOOKUPS[name] = {"in_scope": int(ins.sum()), "oos": int((~ins).sum())}
        sv, qv = embed(w.stored), embed(w.queries)
        pol = _Recording(VERIFIED_THRESHOLD, scorer=xv, min_score=VERIFIED_MIN_SCORE)
        cache = SemanticCache(embedder=default_embedder(), max_entries=None, policy=pol)
        cache.store_many(w.stored, w.answers, embeddings=list(sv))
        members: dict[str, list[str]] = {}
        for q, a in zip(w.stored, w.answers, strict=True):
            members.setdefault(a, []).append(q)
        for q, v, e in zip(w.queries, qv, w.expected, strict=True):
            h = cache.lookup(q, embedding=v)
            if h is None or h.reason != "centroid":
                continue
            win = max((c for c in pol.last if c.centroid is not None),
                      key=lambda c: (c.centroid, c.similarity))
            lone = [c.similarity for c in pol.last
                    if c.centroid is None and c.cluster_key != win.cluster_key]
            out.append({"set": name, "query": q, "vec": v, "answer": h.answer,
                        "members": members[h.answer],
                        "label": "right" if right(w, h.answer, e) else
                        ("oos" if e is None else "wrong"),
                        "best": h.similarity, "centroid": float(win.centroid),
                        "slack": float(win.centroid) - (float(win.cohesion) - pol.spread),
                        "margin": float(win.centroid) - max([float(win.rival), *lone])})
    return out


def mahalanobis(hits: list[dict]) -> None:
    """Each hit's Mahalanobis distance from its cluster's centroid over the members' own
    (leave-one-out) distances, under the pooled within-intent covariance of CLINC ``train``
    phrasings of the development intents (for a clinc-holdout split, without its held-out
    quarter)."""
    intents, by = dev_train_phrasings()
    vecs = {i: embed(by[i]) for i in intents}
    # the quarter clinc_holdout(s) leaves unstored
    held = {f"clinc-holdout-{s}": holdout_quarter(intents, random.Random(100 + s))
            for s in range(4)}
    prec: dict[frozenset[str], np.ndarray] = {}
    for h in hits:
        excl = frozenset(held.get(h["set"], set()))
        if excl not in prec:
            x = np.concatenate([vecs[i] - vecs[i].mean(0) for i in intents if i not in excl])
            s = x.T @ x / len(x)
            dim = s.shape[0]
            prec[excl] = np.linalg.inv(0.5 * s + 0.5 * np.trace(s) / dim * np.eye(dim))
        p = prec[excl]
        m = embed(h["members"])
        mu = m.mean(0)
        own = [float((m[k] - np.delete(m, k, 0).mean(0)) @ p @ (m[k] - np.delete(m, k, 0).mean(0)))
               for k in range(len(m))]
        dq = h["vec"] - mu
        h["mahalanobis_ratio"] = -float(dq @ p @ dq) / float(np.mean(own))  # higher: nearer


def novel_words(hits: list[dict]) -> None:
    """Each hit's share of the query's content-word IDF that no member of its cluster carries
    (negated: higher is nearer), IDF over the development intents' CLINC ``train`` phrasings."""
    import math

    from semcomm.semantic._verifier import _content

    intents, by = dev_train_phrasings()
    docs = [_content(t) for i in intents for t in by[i]]
    df: dict[str, int] = {}
    for d in docs:
        for w in d:
            df[w] = df.get(w, 0) + 1
    idf = {w: math.log((1 + len(docs)) / (1 + n)) + 1.0 for w, n in df.items()}
    top = math.log(1 + len(docs)) + 1.0  # a word never seen in the development phrasings
    for h in hits:
        q = _content(h["query"])
        have = frozenset().union(*(_content(m) for m in h["members"]))
        mass = sum(idf.get(w, top) for w in q) or 1.0
        new = [w for w in q if w not in have]
        h["novel_words"] = -sum(idf.get(w, top) for w in new) / mass
        h["novel_count"] = -float(len(new))


COMBINED = ("best", "centroid", "slack", "margin", "mahalanobis_ratio", "cross_encoder",
            "novel_words")


def combined_cv(hits: list[dict], features: tuple[str, ...] = COMBINED,
                key: str = "combined_cv") -> None:
    """``combined_cv`` of each right or out-of-scope hit: a logistic regression over
    :data:`COMBINED` fitted on the other development sets' hits (leave one set out); wrong-
    intent hits get the score of the fold of their set too (they are not fitted on)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x = np.asarray([[h[k] for k in features] for h in hits], dtype=np.float64)
    y = np.asarray([h["label"] == "right" for h in hits])
    fit = np.asarray([h["label"] != "wrong" for h in hits])
    sets = np.asarray([h["set"] for h in hits])
    for name in sorted(set(sets)):
        tr, te = fit & (sets != name), sets == name
        sc = StandardScaler().fit(x[tr])
        m = LogisticRegression(max_iter=2000, class_weight="balanced").fit(sc.transform(x[tr]),
                                                                          y[tr])
        for i, z in zip(np.where(te)[0], m.decision_function(sc.transform(x[te])), strict=True):
            hits[i][key] = float(z)


def filtered_sets(hits: list[dict], key: str, loss: float) -> dict:
    """Per development set: the out-of-scope hit rate and the centroid-rule hits kept when
    every hit whose out-of-fold ``key`` is below the pooled ``loss`` quantile of the right
    hits' is refused (what a filter at that cut would leave)."""
    v = np.asarray([h[key] for h in hits])
    lab = np.asarray([h["label"] for h in hits])
    cut = float(np.quantile(v[lab == "right"], loss))
    out = {"cut": cut}
    for name, n in SET_LOOKUPS.items():
        m = np.asarray([h["set"] == name for h in hits])
        keep = m & (v >= cut)
        out[name] = {"oos_before": float((m & (lab == "oos")).sum() / max(1, n["oos"])),
                     "oos_after": float((keep & (lab == "oos")).sum() / max(1, n["oos"])),
                     "right_kept": float((keep & (lab == "right")).sum() /
                                         max(1, (m & (lab == "right")).sum()))}
    return out


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


def signal_row(hits: list[dict], key: str) -> dict:
    lab = np.asarray([h["label"] for h in hits])
    v = np.asarray([h[key] for h in hits], dtype=np.float64)
    row = {"auc_right_vs_oos": auc(v[lab == "right"], v[lab == "oos"]),
           "auc_right_vs_wrong": auc(v[lab == "right"], v[lab == "wrong"])}
    for loss in LOSSES:
        t = np.quantile(v[lab == "right"], loss)
        row[f"oos_removed_at_{loss:.2f}"] = float(((v < t) & (lab == "oos")).sum() /
                                                  max(1, (lab == "oos").sum()))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-name", default="semantic_twins.json")
    ap.add_argument("--judge-sample", type=int, default=50,
                    help="right and out-of-scope hits each the judges score (0: no judge)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("SEMCOMM_BENCH_THREADS", "1")))
    t0 = time.perf_counter()
    hits = centroid_hits(args.seed)
    counts = {k: sum(h["label"] == k for h in hits) for k in ("right", "wrong", "oos")}
    console.print(f"{len(hits)} centroid-rule hits on the development sets: {counts}")
    mahalanobis(hits)
    novel_words(hits)
    xv = default_cross_verifier()
    for h in hits:
        sims = embed(h["members"]) @ h["vec"]
        h["best_member"] = h["members"][int(np.argmax(sims))]
        h["cross_encoder"] = float(xv.score(h["query"], h["best_member"]))
    combined_cv(hits)
    # the same without the model call (every signal but the cross-encoder costs nothing)
    combined_cv(hits, tuple(k for k in COMBINED if k != "cross_encoder"), "combined_cv_free")
    signals = {k: signal_row(hits, k) for k in (*COMBINED, "novel_count", "combined_cv",
                                                 "combined_cv_free")}
    filt = {f"{k}@{loss:.2f}": filtered_sets(hits, k, loss) for k in ("best", "combined_cv_free")
            for loss in LOSSES}
    for k, r in filt.items():
        console.print(f"{k}: " + "; ".join(
            f"{n} oos {v['oos_before']:.3f}->{v['oos_after']:.3f} right kept "
            f"{v['right_kept']:.2f}" for n, v in r.items() if n != "cut"))
    judges: dict[str, dict] = {}
    if args.judge_sample:
        rng = random.Random(args.seed)
        sample = (rng.sample([h for h in hits if h["label"] == "oos"], args.judge_sample) +
                  rng.sample([h for h in hits if h["label"] == "right"], args.judge_sample))
        for model in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"):
            j = JudgeVerifier(model, threads=1)
            p = np.asarray([j.score(h["query"], h["best_member"]) for h in sample])
            ok = np.asarray([h["label"] == "right" for h in sample])
            cos = np.asarray([h["best"] for h in sample])
            judges[model] = {"hits": len(sample), "auc_right_vs_oos": auc(p[ok], p[~ok]),
                             "cosine_auc_same_sample": auc(cos[ok], cos[~ok]),
                             "mean_p_right": float(p[ok].mean()),
                             "mean_p_oos": float(p[~ok].mean()), "ms_per_call": j.ms_per_call}
    tbl = Table(title="right vs out-of-scope centroid-rule hits on development FAQ traffic")
    for col in ("signal", "AUC right / oos", "AUC right / wrong",
                *(f"oos removed, {loss:.0%} of right lost" for loss in LOSSES)):
        tbl.add_column(col)
    for k, r in signals.items():
        tbl.add_row(k, f"{r['auc_right_vs_oos']:.3f}", f"{r['auc_right_vs_wrong']:.3f}",
                    *(f"{r[f'oos_removed_at_{loss:.2f}']:.2f}" for loss in LOSSES))
    console.print(tbl)
    for m, r in judges.items():
        console.print(f"judge {m} on {r['hits']} hits: AUC {r['auc_right_vs_oos']:.3f} (cosine "
                      f"on the same hits {r['cosine_auc_same_sample']:.3f}), mean P(yes) right "
                      f"{r['mean_p_right']:.2f} / out of scope {r['mean_p_oos']:.2f}, "
                      f"{r['ms_per_call']:.0f} ms per call")
    res = {"seed": args.seed, "hits": counts, "signals": signals, "judges": judges,
           "filtered": filt, "combined_features": list(COMBINED),
           "seconds": round(time.perf_counter() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    js = args.out / args.json_name
    js.write_text(json.dumps(res, indent=1))
    from _common import agg_figure

    with agg_figure(js.with_suffix(".png"), (8, 4.5)) as ax:
        names = list(signals) + [f"judge {m.split('-')[0]}" for m in judges]
        aucs = [signals[k]["auc_right_vs_oos"] for k in signals] + \
            [judges[m]["auc_right_vs_oos"] for m in judges]
        ax.barh(names, aucs, color=["steelblue"] * len(signals) + ["gray"] * len(judges))
        ax.axvline(0.5, color="black", lw=0.8, ls=":")
        ax.set_xlim(0.3, 1.0)
        ax.set_xlabel("AUC, right vs out-of-scope centroid-rule hits (development sets)")
        ax.set_title("what separates a near-miss twin from a right cluster hit", fontsize=9)
    console.print(f"wrote {js} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
