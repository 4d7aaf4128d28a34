"""Can a stacked lone-candidate score beat the shipped cross-encoder? (development data only)

The Quora goal's limit is the verifier of lone candidates (AUC about 0.74 between right and
wrong best candidates at cos >= 0.88 on quora-val). This script asks whether a logistic
regression over what the cache already has for such a candidate separates them better:

- the shipped cross-encoder's logit, query first and cached first (one batch of two),
- the bi-encoder cosine and the lead over the nearest candidate of another answer
  (``cos - max(rival, 0.80)``, as :func:`semcomm.semantic.lead_score` reads it),
- the lexical features of :class:`semcomm.semantic.LexicalVerifier` (content-word overlap
  both ways, character trigrams, length ratio, size of the word difference).

The regression is fitted on the TRAINING file (``meancache_val.csv``, the cache protocol under
seeds 1-3, whose lookups pair other questions than the seed-0 protocol the adapter mined), never
on quora-val, which only measures: AUC of each score in the band, with a paired bootstrap
interval of the difference against the shipped P. The cross-encoder trained on that file, so
its logits there are partly in-sample; the script prints its AUC on the fit pairs it never
trained on beside the one on quora-val, which says how far the fitted weights can be trusted.
``--adapters`` adds other cross-encoder adapters (alone, and their logit averaged with the
shipped one's: an ensemble), e.g. one trained with ``bench_semantic_train_cross.py --dropout``.
Every row also gets the lone cut :func:`semcomm.semantic.calibrate_scored_cut` would choose
with that score on quora-val (target 0.90, 90 % Wilson bound), the decision-relevant figure.
No fresh set is read. Results: ``benchmarks/results/semantic_stack.{json,png}``.

    OMP_NUM_THREADS=1 python benchmarks/bench_semantic_stack.py                 # ~4 min
    OMP_NUM_THREADS=1 python benchmarks/bench_semantic_stack.py --adapters /tmp/xv4 \
        /tmp/xv4/step1000 /tmp/xv4/step2000 /tmp/xv3                            # ~6 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench_semantic_common import DEFAULT_DATA, norm, protocol_vectors, read_pairs
from bench_semantic_traffic import embed, pairs_workload
from rich.console import Console
from rich.table import Table

from semcomm.semantic import LEAD_FLOOR, LexicalGuard, calibrate_scored_cut, verifier_features
from semcomm.semantic._cross import default_cross_verifier

console = Console(width=160)
BAND = 0.88  # the band the earlier rounds measured AUC in (lone candidates at cos >= 0.88)
FLOOR = 0.80  # lone candidates considered at all (as bench_semantic_fresh.lone_candidates)
FEATURES = ("logit_fwd", "logit_rev", "cos", "lead", "jaccard", "q_missing", "c_missing",
            "trigram", "len_ratio", "diff_words")


def pair_logits(pairs: list[tuple[str, str]], batch: int = 64, xv: Any = None) -> np.ndarray:
    """A cross-encoder's logit (default: the shipped one) of each (query, cached) pair, in
    length-sorted batches (the same forward as :meth:`CrossEncoderVerifier.scores`)."""
    import torch

    xv = xv or default_cross_verifier()
    xv._load()
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    out = np.zeros(len(pairs), np.float64)
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        enc = xv._tok([pairs[i][0] for i in idx], [pairs[i][1] for i in idx], padding=True,
                      truncation=True, max_length=xv.max_length, return_tensors="pt")
        with torch.inference_mode():
            h = xv._model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            lg = xv._head((h * m).sum(1) / m.sum(1)).squeeze(-1).float().numpy()
        out[idx] = lg
    return out


def lone_rows(queries: list[str], stored: list[str], same, qv: np.ndarray, sv: np.ndarray,
              k: int = 8) -> list[dict]:
    """Per lookup: its best guard-passing stored candidate at cos >= FLOOR (every stored
    question is its own answer here), the next guard-passing one (the rival), whether serving
    the best is right (``same``) and whether it is the identical text."""
    g = LexicalGuard()
    rows = []
    for s0 in range(0, len(qv), 1024):
        sims = qv[s0 : s0 + 1024] @ sv.T
        top = np.argsort(-sims, axis=1)[:, :k]
        for r in range(len(top)):
            i = s0 + r
            q, best, rival = queries[i], None, -1.0
            for j in top[r]:
                if sims[r, j] < FLOOR:
                    break
                if not g(q, stored[j]):
                    continue
                if best is None:
                    best = int(j)
                else:
                    rival = float(sims[r, j])
                    break
            if best is None:
                continue
            c = stored[best]
            rows.append({"q": q, "c": c, "cos": float(sims[r, best]), "rival": rival,
                         "right": bool(same(q, c)),
                         "exact": " ".join(c.lower().split()) == " ".join(q.lower().split())})
    return rows


def quora_val_rows() -> tuple[Any, list[dict], int]:
    """quora-val (the validation pairs), its :func:`lone_rows` (every stored question is its
    own answer; right = in the query's duplicate component) and the number of its lookups
    that have a duplicate stored (the recall denominator)."""
    w = pairs_workload(2000, name="quora-val")
    qv, sv = embed(w.queries), embed(w.stored)
    comp = dict(zip(w.stored, w.answers, strict=True))
    exp = dict(zip(w.queries, w.expected, strict=True))
    rows = lone_rows(w.queries, w.stored,
                     lambda q, c: w.comp_of_answer[comp[c]] == exp[q],  # type: ignore[attr-defined]
                     qv, sv)
    return w, rows, int(sum(e is not None for e in w.expected))


def featurise(rows: list[dict], extra: tuple[Any, ...] = ()) -> np.ndarray:
    """FEATURES of each row, then the logit of each ``extra`` cross-encoder (query first)."""
    lf = pair_logits([(r["q"], r["c"]) for r in rows])
    lr = pair_logits([(r["c"], r["q"]) for r in rows])
    more = [pair_logits([(r["q"], r["c"]) for r in rows], xv=xv) for xv in extra]
    x = np.zeros((len(rows), len(FEATURES) + len(extra)))
    for n, r in enumerate(rows):
        lex = verifier_features(r["q"], r["c"], r["cos"], None)
        x[n] = [lf[n], lr[n], r["cos"], r["cos"] - max(r["rival"], LEAD_FLOOR), *lex[2:],
                *(m[n] for m in more)]
    return x


def auc(s: np.ndarray, y: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, s)) if 0 < y.sum() < len(y) else float("nan")


def fit_lr(x: np.ndarray, y: np.ndarray, cols: list[int], c: float = 1.0):
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    sc = StandardScaler().fit(x[:, cols])
    m = LogisticRegression(C=c, max_iter=2000).fit(sc.transform(x[:, cols]), y)
    return lambda z: m.decision_function(sc.transform(z[:, cols])), m, sc


def biencoder_pair_auc(vec: dict[str, np.ndarray], fit_rows: list[dict], val_rows: list[dict],
                       qvec: dict[str, np.ndarray], svec: dict[str, np.ndarray]) -> dict:
    """The bi-encoder's own ceiling in the band: a logistic regression on ``[u*v, |u-v|]`` of
    the two MiniLM vectors (SBERT's pair-classifier input), fitted on the labelled pairs of
    ``meancache_val.csv`` and the fit file's lone candidates, scored on quora-val's band."""
    from sklearn.linear_model import LogisticRegression

    def f(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.concatenate([u * v, np.abs(u - v)])

    x, y, seen = [], [], set()
    for a, b, lab in read_pairs(DEFAULT_DATA / "meancache_val.csv"):
        if a in vec and b in vec:
            x.append(f(vec[a], vec[b]))
            y.append(lab)
            seen.add(frozenset((norm(a), norm(b))))
    for r in fit_rows:
        if frozenset((norm(r["q"]), norm(r["c"]))) not in seen:
            x.append(f(vec[r["q"]], vec[r["c"]]))
            y.append(int(r["right"]))
    band = [r for r in val_rows if r["cos"] >= BAND and not r["exact"]]
    xq = np.stack([f(qvec[r["q"]], svec[r["c"]]) for r in band])
    yq = np.asarray([r["right"] for r in band])
    m = LogisticRegression(C=0.1, max_iter=3000).fit(np.stack(x), np.asarray(y))
    return {"fit_pairs": len(x), "band": len(band), "auc": auc(m.decision_function(xq), yq),
            "cosine_auc": auc(np.asarray([r["cos"] for r in band]), yq)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--seeds", default="1,2,3", help="meancache_val protocol seeds to fit on")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--json-name", default="semantic_stack.json")
    ap.add_argument("--adapters", type=Path, nargs="*", default=[],
                    help="other cross-encoder adapters whose logit is averaged with the "
                         "shipped one's (an ensemble; e.g. the v3 adapter of BENCHMARKS.md)")
    args = ap.parse_args()
    t0 = time.time()

    # v1's training pairs: the labelled pairs and the seed-0 protocol's top-4 mined candidates
    from bench_semantic_train_cross import training_pairs

    seen_pairs = {frozenset((norm(a), norm(b))) for a, b, _ in
                  training_pairs(DEFAULT_DATA, LexicalGuard())}
    fit_rows: list[dict] = []
    vec: dict[str, np.ndarray] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        pv, qv, sv = protocol_vectors(DEFAULT_DATA / "meancache_val.csv", seed, vec, embed)
        rows = lone_rows(pv.queries, pv.stored, pv.same, qv, sv)
        got = {frozenset((norm(r["q"]), norm(r["c"]))) for r in fit_rows}
        fit_rows += [r for r in rows if frozenset((norm(r["q"]), norm(r["c"]))) not in got]
    for r in fit_rows:
        r["in_train"] = frozenset((norm(r["q"]), norm(r["c"]))) in seen_pairs

    w, val_rows, n_pos = quora_val_rows()
    qv, sv = embed(w.queries), embed(w.stored)
    console.print(f"lone candidates at cos >= {FLOOR}: fit {len(fit_rows)} "
                  f"({sum(r['in_train'] for r in fit_rows)} of them v1 training pairs), "
                  f"quora-val {len(val_rows)}; scoring ({time.time() - t0:.0f} s)")
    from semcomm.semantic import CrossEncoderVerifier

    extra = tuple(CrossEncoderVerifier(p) for p in args.adapters)
    xf, xq = featurise(fit_rows, extra), featurise(val_rows, extra)
    yf = np.asarray([r["right"] for r in fit_rows])
    yq = np.asarray([r["right"] for r in val_rows])
    bf = (xf[:, 2] >= BAND) & ~np.asarray([r["exact"] for r in fit_rows])
    bq = (xq[:, 2] >= BAND) & ~np.asarray([r["exact"] for r in val_rows])
    lab = np.asarray([r["in_train"] for r in fit_rows])
    bienc = biencoder_pair_auc(vec, fit_rows, val_rows, dict(zip(w.queries, qv, strict=True)),
                               dict(zip(w.stored, sv, strict=True)))
    console.print(f"bi-encoder pair classifier \\[u*v, |u-v|] on {bienc['fit_pairs']} training "
                  f"pairs: AUC {bienc['auc']:.3f} on quora-val's band (cosine {bienc['cosine_auc']:.3f})")
    console.print(f"scored in {time.time() - t0:.0f} s; band: fit {bf.sum()} "
                  f"({yf[bf].mean():.2f} right), quora-val {bq.sum()} ({yq[bq].mean():.2f} right)")

    # how in-sample is the adapter on the fit file? its AUC on pairs it trained on, on those
    # it did not, and on quora-val
    insample = {"fit_band_trained": auc(xf[bf & lab, 0], yf[bf & lab]),
                "fit_band_untrained": auc(xf[bf & ~lab, 0], yf[bf & ~lab]),
                "quora_val_band": auc(xq[bq, 0], yq[bq])}
    console.print(f"cross-encoder AUC in the band: fit pairs it trained on "
                  f"{insample['fit_band_trained']:.3f}, fit pairs it did not "
                  f"{insample['fit_band_untrained']:.3f}, quora-val "
                  f"{insample['quora_val_band']:.3f}")

    ix = {f: i for i, f in enumerate(FEATURES)}
    combos = {
        "shipped P (logit_fwd)": None,
        "mean of both orders": None,
        "LR: logits + cos + lead": ["logit_fwd", "logit_rev", "cos", "lead"],
        "LR: logits + cos + lead + lexical": list(FEATURES),
        "LR: cos + lead + lexical (no cross-encoder)": [f for f in FEATURES
                                                       if not f.startswith("logit")],
        "LR on untrained fit pairs only: all": list(FEATURES),
    }
    for k, p in enumerate(args.adapters):  # ensembles: mean logit with the shipped adapter
        combos[f"mean logit with {p}"] = ("mean", [0, len(FEATURES) + k])
        combos[f"{p} alone"] = ("mean", [len(FEATURES) + k])
    if len(args.adapters) > 1:
        combos["mean logit of all adapters"] = ("mean", [0, *range(len(FEATURES),
                                                                   len(FEATURES) + len(extra))])
    rng = np.random.default_rng(0)
    boots = [rng.integers(0, bq.sum(), bq.sum()) for _ in range(args.boot)]
    base = xq[bq, 0]
    exact_q = np.asarray([r["exact"] for r in val_rows])
    yb = yq[bq]
    res_rows = []
    tab = Table(title=f"lone candidates at cos >= {BAND} on quora-val ({bq.sum()}): AUC right "
                      "vs wrong; fitted on meancache_val.csv (train file) only")
    for col in ("score", "fit on", "AUC fit band: all / untrained", "AUC quora-val [95 % CI]",
                "delta vs shipped [95 % CI]", "cut (cos / P): precision (bound) / recall"):
        tab.add_column(col)
    for name, feats in combos.items():
        if isinstance(feats, tuple):  # a plain mean of logits: nothing fitted
            cols = feats[1]
            s_all, sf = xq[:, cols].mean(1), xf[bf][:, cols].mean(1)
            coef, on, feats = None, "-", [f"col{c}" for c in cols]
        elif feats is None:
            cols = [0] if name.startswith("shipped") else [0, 1]
            s_all, sf = xq[:, cols].mean(1), xf[bf][:, cols].mean(1)
            coef, on = None, "-"
        else:
            m_fit = bf & (~lab if "untrained" in name else np.ones_like(bf))
            fn, m, sc = fit_lr(xf[m_fit], yf[m_fit], [ix[f] for f in feats])
            s_all, sf = fn(xq), fn(xf[bf])
            coef = dict(zip(feats, (m.coef_[0] / sc.scale_).tolist(), strict=True))
            coef["bias"] = float(m.intercept_[0] - (m.coef_[0] * sc.mean_ / sc.scale_).sum())
            on = f"{m_fit.sum()} band pairs"
        sq = s_all[bq]
        # the decision-relevant figure: the cut the default's rule would choose with this score
        cut = calibrate_scored_cut(xq[:, 2].tolist(), (1 / (1 + np.exp(-s_all))).tolist(),
                                   yq.tolist(), n_pos, exact=exact_q.tolist(),
                                   target_precision=0.90, confidence=0.90)
        a = auc(sq, yb)
        bs = np.array([auc(sq[i], yb[i]) for i in boots])
        d = np.array([auc(sq[i], yb[i]) - auc(base[i], yb[i]) for i in boots])
        ci, dci = np.nanpercentile(bs, [2.5, 97.5]), np.nanpercentile(d, [2.5, 97.5])
        # on the fit file's band pairs that v1 never trained on (what a snapshot is chosen by)
        sf_un = sf[~lab[bf]]
        row = {"score": name, "features": feats, "coef": coef, "fit_band_auc": auc(sf, yf[bf]),
               "fit_band_untrained_auc": auc(sf_un, yf[bf][~lab[bf]]),
               "quora_val_auc": a, "ci95": ci.tolist(), "delta": float(a - auc(base, yb)),
               "delta_ci95": dci.tolist(), "cut": {f: getattr(cut, f) for f in cut.__slots__}}
        res_rows.append(row)
        tab.add_row(name, on, f"{row['fit_band_auc']:.3f} / {row['fit_band_untrained_auc']:.3f}", f"{a:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]",
                    f"{row['delta']:+.3f} [{dci[0]:+.3f}, {dci[1]:+.3f}]",
                    f"{cut.threshold:.2f} / {cut.min_score:.2f}: {cut.precision:.3f} "
                    f"({cut.lower_bound:.3f}) / {cut.recall:.3f}")
    console.print(tab)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / args.json_name).write_text(json.dumps(
        {"band": BAND, "floor": FLOOR, "fit": {"file": "meancache_val.csv", "seeds": args.seeds,
                                               "lone": len(fit_rows), "band": int(bf.sum())},
         "quora_val": {"lone": len(val_rows), "band": int(bq.sum())},
         "adapter_auc": insample, "biencoder_pair_classifier": bienc, "rows": res_rows, "seconds": time.time() - t0}, indent=1))
    from _common import agg_figure

    with agg_figure((args.out / args.json_name).with_suffix(".png"), (9, 4.5)) as ax:
        names = [r["score"] for r in res_rows][::-1]
        a = np.asarray([r["quora_val_auc"] for r in res_rows][::-1])
        lo = a - np.asarray([r["ci95"][0] for r in res_rows][::-1])
        hi = np.asarray([r["ci95"][1] for r in res_rows][::-1]) - a
        ax.barh(names, a, xerr=[lo, hi], color="steelblue", capsize=3)
        ax.axvline(res_rows[0]["quora_val_auc"], color="black", lw=0.8, ls=":")
        ax.set_xlim(0.5, 0.9)
        ax.set_xlabel(f"AUC, right vs wrong lone candidates at cos >= {BAND} on quora-val "
                      "(95 % bootstrap CI)")
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title("stacked / ensembled lone-candidate scores (fitted on meancache_val.csv)",
                     fontsize=9)
    np.savez(Path(os.environ.get("TMPDIR", "/tmp")) / "semantic_stack_features.npz", xf=xf,
             yf=yf, bf=bf, lab=lab, xq=xq, yq=yq, bq=bq)  # to explore further without scoring
    console.print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
