"""Can a learned metric on MiniLM vectors tell a near-miss twin intent from a right
answer-cluster hit? Development data only, cross-validated by intent.

Exploration behind the out-of-scope goal (docs/BENCHMARKS.md, "semantic cache"): the hits are
``centroid_hits`` (every centroid-rule hit of ``SemanticCache()`` on the
seven development sets). The 74 development and banking intents are split into ``--folds``
seeded folds; for each fold a model is fitted on pairs made only from the other folds' CLINC
``train`` phrasings (a cluster of 5 phrasings of one intent against another phrasing of it,
labelled same, or a phrasing of another intent near its centroid, labelled different) and
scores the hits whose query belongs to a held-out intent (``strict``: the served cluster's
intent is held out too). Reported: AUC between right and out-of-scope hits and the share of
out-of-scope hits removed when 4 % / 8 % of the right ones may go, against the cosine signals
the rule already reads.

    python -m tools.train.semantic_intent             # the table (~2 min)
    python -m tools.train.semantic_intent --fit 30     # and write the shipped model
    python -m tools.train.semantic_intent --cost       # lookup p50 with / without

``--cost`` times the lookups of one development set (clinc-holdout-0, vectors given, no
cross-encoder) through ``SemanticCache()`` with and without the intent check, in alternating
order over ``--reps`` rounds, and prints the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
from benchmarks.semantic.common import (
    BANKING_INTENTS,
    DEFAULT_DATA,
    DEV_FAQ_INTENTS,
    FAQWorkload,
    clinc_faq,
    clinc_holdout,
    dev_train_phrasings,
)
from benchmarks.semantic.fresh import with_unstored_oos
from benchmarks.semantic.traffic import embed, right
from rich.console import Console
from rich.progress import track
from rich.table import Table

from semcomm import SemanticCache
from semcomm.semantic import (
    VERIFIED_MIN_SCORE,
    VERIFIED_THRESHOLD,
    ClusterVotePolicy,
    default_embedder,
)
from semcomm.semantic._cross import default_cross_verifier
from semcomm.semantic._embed import DEFAULT_EMBEDDER_NAME
from semcomm.semantic._intent import INTENT_METRIC_DIR, IntentMetric, intent_features

console = Console(width=200)
RAW = False


LOSSES = (0.04, 0.08)  # share of right hits a signal may drop


def dev_sets(seed: int) -> dict[str, FAQWorkload]:
    """The seven development FAQ sets (CLINC150 development and banking intents, four holdouts)."""
    out = {
        "clinc-dev": with_unstored_oos(clinc_faq("train", DEV_FAQ_INTENTS,
                                                 queries_per_intent=20), seed)[0],
        "clinc-banking": with_unstored_oos(clinc_faq("val", BANKING_INTENTS), seed)[0],
        "clinc-dev-val": with_unstored_oos(clinc_faq("val", DEV_FAQ_INTENTS), seed + 1)[0],
    }
    for s in range(4):
        out[f"clinc-holdout-{s}"] = clinc_holdout(s)[0]
    return out


class _Recording(ClusterVotePolicy):
    """The default policy, remembering the candidates of its last decision."""

    last: list = []

    def decide(self, query, candidates, *, threshold=None):  # type: ignore[no-untyped-def]
        self.last = list(candidates)
        return super().decide(query, candidates, threshold=threshold)


def centroid_hits(seed: int) -> list[dict]:
    """Every centroid-rule hit of the default policy on the development sets."""
    xv = default_cross_verifier()
    out = []
    for name, w in dev_sets(seed).items():
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


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def features(q: np.ndarray, members: np.ndarray) -> np.ndarray:
    """One row per (query, cluster): the shipped model's features (``intent_features``:
    elementwise products and squared differences against the unit centroid, the cosines to the
    centroid and to the best member); ``--raw`` adds the two vectors themselves."""
    c = unit(members.mean(0))
    f = intent_features(q, c, float((members @ q).max()))
    return np.concatenate([f, q, c]) if RAW else f


def training_pairs(intents: list[str], vecs: dict[str, np.ndarray], rng: np.random.Generator,
                   *, clusters: int, floor: float) -> tuple[np.ndarray, np.ndarray]:
    x, y = [], []
    pool = np.concatenate([vecs[i] for i in intents])
    owner = np.concatenate([[k] * len(vecs[i]) for k, i in enumerate(intents)])
    for k, i in enumerate(intents):
        v = vecs[i]
        for _ in range(clusters):
            pick = rng.choice(len(v), size=5, replace=False)
            m = v[pick]
            c = unit(m.mean(0))
            rest = np.setdiff1d(np.arange(len(v)), pick)
            for j in rng.choice(rest, size=min(20, len(rest)), replace=False):
                x.append(features(v[j], m))
                y.append(1)
            sims = pool @ c
            near = np.flatnonzero((owner != k) & (sims >= floor))
            near = near[np.argsort(-sims[near])][:20]
            for j in near:
                x.append(features(pool[j], m))
                y.append(0)
    return np.asarray(x, np.float32), np.asarray(y)


def fit(x: np.ndarray, y: np.ndarray, c: float, mlp: int) -> tuple[object, Callable]:
    """A model and its score function (a log-odds)."""
    if mlp:
        from sklearn.neural_network import MLPClassifier

        m = MLPClassifier((mlp,), alpha=1.0 / c, max_iter=300, early_stopping=True,
                          random_state=0).fit(x, y)

        def score(xs: np.ndarray) -> np.ndarray:
            p = np.clip(m.predict_proba(xs)[:, 1], 1e-6, 1 - 1e-6)
            return np.log(p / (1 - p))
        return m, score
    from sklearn.linear_model import LogisticRegression

    m = LogisticRegression(C=c, max_iter=5000, class_weight="balanced").fit(x, y)
    return m, m.decision_function


def cost(reps: int) -> dict[str, object]:
    import time


    w = dev_sets(0)["clinc-holdout-0"]
    sv, qv = embed(w.stored), embed(w.queries)
    caches = {}
    for check in (True, False):
        c = SemanticCache(embedder=default_embedder(), max_entries=None, intent_check=check,
                          cross_encoder=False)
        c.store_many(w.stored, w.answers, embeddings=list(sv))
        caches[check] = c
    p50: dict[bool, list[float]] = {True: [], False: []}
    for rep in track(range(reps), description="rounds", console=console):
        for check in ((True, False) if rep % 2 else (False, True)):
            lat = []
            for q, v in zip(w.queries, qv, strict=True):
                t = time.perf_counter()
                caches[check].lookup(q, embedding=v)
                lat.append(time.perf_counter() - t)
            p50[check].append(float(np.median(lat)) * 1e3)
    ratio = float(np.median(p50[True]) / np.median(p50[False]))
    console.print(f"lookup p50 over {len(w.queries):,} lookups, {reps} rounds: with the intent "
                  f"check {np.round(p50[True], 4)} ms, without {np.round(p50[False], 4)} ms; "
                  f"ratio of the medians {ratio:.3f}")
    return {"lookups": len(w.queries), "p50_ms_with": p50[True], "p50_ms_without": p50[False],
            "ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--clusters", type=int, default=6, help="clusters drawn per intent")
    ap.add_argument("--floor", type=float, default=0.45,
                    help="other intents' phrasings at this cosine to a centroid or more are its "
                         "negatives (the 20 nearest)")
    ap.add_argument("--C", type=float, nargs="+", default=[1.0, 10.0, 30.0, 100.0])
    ap.add_argument("--raw", action="store_true", help="also the query and centroid vectors")
    ap.add_argument("--mlp", type=int, default=0, help="hidden units of an MLP (0: logistic)")
    ap.add_argument("--loss", type=float, default=None,
                    help="--fit: the cut drops this share of the right hits, pooled, out of "
                         "sample (default: the largest share at which no development set loses "
                         "more than --max-set-loss of its own)")
    ap.add_argument("--max-set-loss", type=float, default=0.04)
    ap.add_argument("--fit", type=float, default=None, metavar="C",
                    help="fit the shipped model with this C on all 74 intents and write it")
    ap.add_argument("--out", type=Path, default=INTENT_METRIC_DIR)
    ap.add_argument("--cost", action="store_true",
                    help="only time lookups with and without the check")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--json", type=Path,
                    default=Path("benchmarks/results/train_semantic_intent.json"))
    args = ap.parse_args()
    global RAW
    RAW = args.raw
    if args.cost:
        out_cost = cost(args.reps)
        path = args.json.with_name(args.json.stem + "_cost.json")
        path.write_text(json.dumps(out_cost, indent=1))
        return
    if args.fit is not None and (args.raw or args.mlp):
        ap.error("--fit writes the linear model of intent_features: no --raw, no --mlp")
    cs = sorted(set(args.C) | ({args.fit} if args.fit is not None else set()))

    d = json.loads((DEFAULT_DATA / "clinc150" / "clinc150_dev.json").read_text())
    intent_of: dict[str, str] = {}
    for split in ("train", "val"):
        for t, i in d[split]:
            intent_of.setdefault(t, i)
    intents, by = dev_train_phrasings()
    vecs = {i: unit(embed(by[i])) for i in intents}
    hits = centroid_hits(0)
    for h in hits:
        h["q_intent"] = intent_of.get(h["query"])
        own = [intent_of.get(m) for m in h["members"]]
        h["c_intent"] = max(set(own), key=own.count)
    order = list(intents)
    random.Random(7).shuffle(order)
    fold_of = {i: k % args.folds for k, i in enumerate(order)}
    scores = {c: np.full(len(hits), np.nan) for c in cs}
    lab = np.array([h["label"] for h in hits])
    fold_pos: dict[float, list[tuple[list[int], np.ndarray]]] = {}  # per fold: hits, own 'same'
    xh = np.stack([features(unit(h["vec"]), unit(embed(h["members"]))) for h in hits])
    for f in track(range(args.folds), description="folds", console=console):
        train = [i for i in intents if fold_of[i] != f]
        x, y = training_pairs(train, vecs, np.random.default_rng(f), clusters=args.clusters,
                              floor=args.floor)
        idx = [k for k, h in enumerate(hits) if fold_of.get(h["q_intent"], -1) == f]
        for c in cs:
            score = fit(x, y, c, args.mlp)[1]
            scores[c][idx] = score(xh[idx])
            fold_pos.setdefault(c, []).append((idx, score(x[y == 1])))
        console.print(f"fold {f}: {len(x):,} training pairs ({int(y.sum()):,} same), "
                      f"{len(idx)} hits scored")
    scored = ~np.isnan(scores[cs[0]])
    sets = np.array([h["set"] for h in hits])
    right = scored & (lab == "right")
    losses: dict[float, float] = {}
    fold_cuts: dict[float, list[dict[str, object]]] = {}
    for c in cs:
        # the pooled share of right hits the cut may drop: given, or the largest on a grid at
        # which no development set loses more than --max-set-loss of its own right hits
        def worst(loss: float, c: float = c) -> float:
            cut = np.quantile(scores[c][right], loss)
            return max(float((scores[c][right & (sets == st)] < cut).mean())
                       for st in set(sets[right]))
        grid = [x for x in np.arange(0.005, 0.1001, 0.005)
                if worst(float(x)) <= args.max_set_loss]
        losses[c] = args.loss if args.loss is not None else float(max(grid, default=0.005))
        for f, (idx, own_pos) in enumerate(fold_pos[c]):
            held = scores[c][idx][lab[idx] == "right"]
            cut_f = float(np.quantile(held, losses[c]))
            fold_cuts.setdefault(c, []).append(
                {"cut": cut_f, "train_same_below": float((own_pos < cut_f).mean()),
                 "own_same_q": [float(v) for v in np.quantile(own_pos, [0.1, 0.25, 0.5])]})
            console.print(f"C={c:g} fold {f}: its cut {cut_f:.2f} (drops {losses[c]:.1%} of its "
                          f"held-out right hits) has {fold_cuts[c][-1]['train_same_below']:.3f}"
                          f" of its own training 'same' pairs below")
        cut = np.quantile(scores[c][right], losses[c])
        per_set = {st: round(float((scores[c][right & (sets == st)] < cut).mean()), 4)
                   for st in sorted(set(sets[right]))}
        console.print(f"C={c:g}: pooled loss {losses[c]:.1%} (worst set {worst(losses[c]):.1%}), "
                      f"twins removed {float((scores[c][scored & (lab == 'oos')] < cut).mean()):.2f};"
                      f" right hits lost per set {per_set}")
    strict = np.array([fold_of.get(h["q_intent"], -1) == fold_of.get(h["c_intent"], -2)
                       for h in hits])
    signals = {"best": np.array([h["best"] for h in hits]),
               "centroid": np.array([h["centroid"] for h in hits]),
               **{f"metric C={c:g}": s for c, s in scores.items()}}
    rows = {}
    t = Table(title="right vs out-of-scope centroid hits (development sets, by-intent CV)")
    for col in ("signal", "subset", "right", "oos", "AUC",
                *(f"oos removed @{x:.0%}" for x in LOSSES)):
        t.add_column(col)
    for name, v in signals.items():
        for sub, mask in (("all", scored), ("strict", scored & strict)):
            r, o = v[mask & (lab == "right")], v[mask & (lab == "oos")]
            row: dict[str, float] = {"right": len(r), "oos": len(o), "auc": auc(r, o)}
            for loss in LOSSES:
                cut = np.quantile(r, loss)
                row[f"oos_removed_at_{loss:.2f}"] = float((o < cut).mean()) if len(o) else 0.0
            rows[f"{name}/{sub}"] = row
            t.add_row(name, sub, str(len(r)), str(len(o)), f"{row['auc']:.3f}",
                      *(f"{row[f'oos_removed_at_{x:.2f}']:.2f}" for x in LOSSES))
    console.print(t)
    out: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                              "cut_loss": {f"{c:g}": v for c, v in losses.items()},
                              "fold_cuts": {f"{c:g}": fc for c, fc in fold_cuts.items()}}
    if args.fit is not None:
        x, y = training_pairs(intents, vecs, np.random.default_rng(len(intents)),
                              clusters=args.clusters, floor=args.floor)
        m = fit(x, y, args.fit, 0)[0]
        # a model fitted on all intents scores lower than the fold models (more intents: harder
        # negatives), so the fold models' cut is carried over as the share of its own training
        # 'same' pairs it leaves below, not as a number
        share = float(np.mean([float(r["train_same_below"])  # type: ignore[arg-type]
                               for r in fold_cuts[args.fit]]))
        own_pos = m.decision_function(x[y == 1])  # type: ignore[attr-defined]
        cut = float(np.quantile(own_pos, share))
        metric = IntentMetric(m.coef_[0], float(m.intercept_[0]), cut,  # type: ignore[attr-defined]
                              embedder=DEFAULT_EMBEDDER_NAME, meta={"train": {
                                  "data": "clinc150_dev.json train phrasings of the 74 "
                                          "development and banking intents",
                                  "pairs": len(x), "same": int(y.sum()), "C": args.fit,
                                  "clusters_per_intent": args.clusters, "floor": args.floor,
                                  "cut_loss": losses[args.fit],
                                  "max_set_loss": args.max_set_loss, "cv_folds": args.folds,
                                  "cut_train_same_share": share,
                                  "cv": rows[f"metric C={args.fit:g}/all"],
                                  "command": "python -m tools.train.semantic_intent "
                                             f"--fit {args.fit:g}"}})
        metric.save(args.out)
        console.print(f"final model: quantiles 10/25/50% of its training 'same' scores "
                      f"{np.round(np.quantile(own_pos, [0.1, 0.25, 0.5]), 2)}; the cut leaves "
                      f"{share:.3f} of them below (the folds' mean)")
        own = np.array([metric.score(unit(h["vec"]), unit(embed(h["members"])).mean(0) /
                                     np.linalg.norm(unit(embed(h["members"])).mean(0)),
                                     h["best"]) for h in hits])
        kept = float((own[lab == "right"] >= cut).mean())
        console.print(f"wrote {metric!r} to {args.out}; in sample it keeps {kept:.3f} of the "
                      f"right hits and {float((own[lab == 'oos'] >= cut).mean()):.3f} of the "
                      "twins")
        out["fit"] = {"cut": cut, "in_sample_right_kept": kept}
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
