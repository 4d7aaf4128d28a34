"""Semantic-cache quality on held-out QQP pairs (MeanCache splits), cache-shaped protocol.

Tune on ``meancache_val.csv``, report on ``meancache_test.csv``. Store every first question,
look up every second one against all stored entries; a hit is right when the returned entry's
question is in the query's duplicate component (see ``benchmarks.semantic.common``). Reports, in one
run and on the same embeddings:

- cosine only (the GPTCache-style baseline), cosine + lexical guard, at the default threshold
  and along the precision/recall curve (PNG);
- the opt-in cross-encoder verifier (``SemanticCache(cross_encoder=True)``) at a few cuts;
- the default SemanticCache end to end (store/lookup through the public API);
- error-bounded mode at 1 %, 2 %, 5 % with a simulated model (the duplicate components) as the
  verifier, as vCache evaluates: measured error and hit rate;
- GPTCache 0.1.44 (same embedder, SQLite + Faiss, SearchDistanceEvaluation) at the same cosine
  cut, when ``gptcache`` and ``faiss`` are installed (``pip install 'semcomm[bench]'``).

    python -m benchmarks.semantic.quality --quick     # 2,000 pairs per split
    python -m benchmarks.semantic.quality             # full splits
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

from benchmarks.common import agg_figure

# one intra-op thread: on a shared, small CPU, more threads mostly wait for each other
torch.set_num_threads(int(os.environ.get("SEMCOMM_BENCH_THREADS", "1")))

from rich.console import Console
from rich.table import Table

from benchmarks.semantic.common import (
    DEFAULT_DATA,
    Protocol,
    build_protocol,
    curve,
    outcomes,
    pr_at,
)
from semcomm import SemanticCache
from semcomm.semantic import (
    DEFAULT_THRESHOLD,
    ErrorBoundedPolicy,
    LexicalGuard,
    default_embedder,
)

console = Console()


def embed_cached(p: Protocol, name: str, cache_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    f = cache_dir / f"{name}.npz"
    # a protocol with a pair limit is a prefix of the longer one (same seed): reuse its vectors
    stem = name.rsplit("_n", 1)[0]
    for g in sorted(cache_dir.glob(f"{stem}_n*.npz")):
        d = np.load(g)
        if d["sv"].shape[0] >= len(p.stored):
            n = len(p.stored)
            return d["sv"][:n], d["qv"][:n]
    emb = default_embedder()
    from rich.progress import Progress

    sv, qv = [], []
    with Progress(console=console) as prog:
        task = prog.add_task(f"embedding {name}", total=len(p.stored))
        for s in range(0, len(p.stored), 256):
            sv.append(emb.embed(p.stored[s : s + 256]))
            qv.append(emb.embed(p.queries[s : s + 256]))
            prog.advance(task, len(sv[-1]))
    a, b = np.concatenate(sv), np.concatenate(qv)
    np.savez(f, sv=a, qv=b)
    return a, b


def tune(o, hd, target: float) -> float:
    """Lowest threshold reaching ``target`` precision (with at least 30 hits)."""
    best = 1.0
    for t in np.arange(0.99, 0.70, -0.005):
        prec, _, nh = pr_at(o, hd, float(t))
        if nh >= 30 and prec >= target:
            best = float(t)
    return best


def end_to_end(p: Protocol, sv: np.ndarray, qv: np.ndarray, **kw) -> dict:
    cache = SemanticCache(embedder=default_embedder(), max_entries=None, **kw)
    t0 = time.perf_counter()
    cache.store_many(p.stored, [str(i) for i in range(len(p.stored))], embeddings=list(sv))
    t_store = time.perf_counter() - t0
    hits = right = 0
    lat = []
    false_hits = []
    for i, (q, v) in enumerate(zip(p.queries, qv, strict=True)):
        t = time.perf_counter()
        h = cache.lookup(q, embedding=v)
        lat.append(time.perf_counter() - t)
        if h is not None:
            hits += 1
            j = int(h.answer)
            ok = p.same(q, p.stored[j])
            right += ok
            if not ok:  # kept for reading: is it a cache error or a label of the data set?
                false_hits.append({"similarity": round(h.similarity, 4), "query": q,
                                   "cached_question": p.stored[j], "own_pair": j == i})
    hd = int(p.has_dup_stored().sum())
    return {"hits": hits, "precision": right / hits if hits else 1.0, "recall": right / hd,
            "hit_rate": hits / len(p.queries), "lookup_p50_ms": float(np.median(lat) * 1e3),
            "store_s": t_store, "false_hits": false_hits}


def cross_encoder_rows(p: Protocol, o, hd: np.ndarray, cuts) -> list[dict]:
    """Precision/recall of cosine + guard + the shipped cross-encoder (P >= its threshold)."""
    from rich.progress import Progress

    from semcomm.semantic import CrossEncoderVerifier

    xv = CrossEncoderVerifier()
    lo = min(cuts)
    prob = np.zeros(len(p.queries))
    todo = [i for i in range(len(p.queries)) if o.cand[i] >= 0 and o.sim[i] >= lo]
    with Progress(console=console) as prog:
        task = prog.add_task("cross-encoder", total=len(todo))
        for i in todo:
            prob[i] = xv.score(p.queries[i], p.stored[int(o.cand[i])])
            prog.advance(task)
    out = []
    for t in cuts:
        hit = (o.sim >= t) & (prob >= xv.threshold)
        nh = int(hit.sum())
        out.append({"config": "cosine + guard + cross-encoder (opt-in)", "threshold": float(t),
                    "min_p": xv.threshold, "hits": nh,
                    "precision": float(o.right[hit].mean()) if nh else 1.0,
                    "recall": float((hit & o.right).sum() / max(1, hd.sum()))})
    return out


def error_bounded(p: Protocol, sv: np.ndarray, qv: np.ndarray, bound: float, seed: int) -> dict:
    """Stream the lookups in random order; the verifier is a simulated model (same component)."""
    calls = 0

    def model_agrees(query: str, cached: str) -> bool:
        nonlocal calls
        calls += 1
        return p.same(query, cached)

    pol = ErrorBoundedPolicy(max_error=bound, verifier=model_agrees, budget=1.0, seed=seed)
    cache = SemanticCache(embedder=default_embedder(), policy=pol, max_entries=None)
    cache.store_many(p.stored, [str(i) for i in range(len(p.stored))], embeddings=list(sv))
    order = list(range(len(p.queries)))
    random.Random(seed).shuffle(order)
    served = wrong = verified = 0
    for i in order:
        h = cache.lookup(p.queries[i], embedding=qv[i])
        if h is None:
            continue
        if h.verified:
            verified += 1
        else:
            served += 1
            wrong += not p.same(p.queries[i], p.stored[int(h.answer)])
    n = len(order)
    return {"bound": bound, "lookups": n, "unverified_hits": served,
            "hit_rate": served / n, "error_rate_all_lookups": wrong / n,
            "error_rate_of_hits": wrong / served if served else 0.0,
            "verified_hits": verified, "verifier_calls": calls,
            "final_threshold": pol.threshold}


def gptcache_run(p: Protocol, sv: np.ndarray, qv: np.ndarray, cos_cut: float) -> dict:
    try:
        import faiss  # noqa: F401
        from gptcache import Cache, Config
        from gptcache.adapter.api import get, put
        from gptcache.manager import CacheBase, VectorBase, get_data_manager
        from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation
    except ImportError as exc:
        return {"error": f"gptcache/faiss not importable: {exc}"}
    vec = {q: v for q, v in zip(p.stored, sv, strict=True)}
    vec.update({q: v for q, v in zip(p.queries, qv, strict=True)})
    tmp = tempfile.mkdtemp(prefix="gptcache-bench-")
    c = Cache()
    dm = get_data_manager(CacheBase("sqlite", sql_url=f"sqlite:///{tmp}/g.db"),
                          VectorBase("faiss", dimension=sv.shape[1],
                                     index_path=f"{tmp}/faiss.index"),
                          max_size=len(p.stored) + 10)
    # GPTCache maps similarity_threshold tau to cos >= 2*tau - 1 with SearchDistanceEvaluation
    tau = (cos_cut + 1) / 2
    from gptcache.processor.pre import get_prompt

    c.init(pre_embedding_func=get_prompt, embedding_func=lambda x, **_: vec[x], data_manager=dm,
           similarity_evaluation=SearchDistanceEvaluation(),
           config=Config(similarity_threshold=tau))
    t0 = time.perf_counter()
    for i, q in enumerate(p.stored):
        put(q, str(i), cache_obj=c)
    t_store = time.perf_counter() - t0
    hits = right = 0
    lat = []
    for q in p.queries:
        t = time.perf_counter()
        a = get(q, cache_obj=c)
        lat.append(time.perf_counter() - t)
        if a is not None:
            hits += 1
            right += p.same(q, p.stored[int(a)])
    hd = int(p.has_dup_stored().sum())
    return {"similarity_threshold": tau, "cos_cut": cos_cut, "hits": hits,
            "precision": right / hits if hits else 1.0, "recall": right / hd,
            "lookup_p50_ms": float(np.median(lat) * 1e3), "store_s": t_store}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--quick", action="store_true", help="smoke run: 100 pairs per split")
    ap.add_argument("--limit", type=int, default=None, help="pairs per split")
    ap.add_argument("--test-limit", type=int, default=None, help="pairs of the test split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--emb-cache", type=Path, default=Path(tempfile.gettempdir()) / "semcomm-emb")
    ap.add_argument("--no-gptcache", action="store_true")
    args = ap.parse_args()
    limit = args.limit or (100 if args.quick else None)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"protocol": "store first questions, look up second; right = same duplicate "
                 "component", "limit": limit, "seed": args.seed,
                 "default_threshold": DEFAULT_THRESHOLD}
    guard = LexicalGuard()
    prot, emb = {}, {}
    for split in ("val", "test"):
        lim = args.test_limit if split == "test" and args.test_limit else limit
        p = build_protocol(args.data / f"meancache_{split}.csv", seed=args.seed, limit=lim)
        prot[split] = p
        emb[split] = embed_cached(p, f"{split}_s{args.seed}_n{len(p.stored)}", args.emb_cache)
    # tune on val
    pv = prot["val"]
    ov_g = outcomes(pv, *emb["val"][::-1], guard=guard)
    hdv = pv.has_dup_stored()
    tuned = {str(tp): tune(ov_g, hdv, tp) for tp in (0.95, 0.97, 0.99)}
    res["val_tuned_thresholds_with_guard"] = tuned
    # report on test
    pt = prot["test"]
    sv, qv = emb["test"]
    hd = pt.has_dup_stored()
    o_cos = outcomes(pt, qv, sv, guard=None)
    o_g = outcomes(pt, qv, sv, guard=guard)
    ts = np.round(np.arange(0.70, 1.0001, 0.01), 3)
    res["test"] = {
        "pairs": len(pt.stored), "queries_with_duplicate_stored": int(hd.sum()),
        "curve_cosine_only": curve(o_cos, hd, ts),
        "curve_cosine_guard": curve(o_g, hd, ts),
    }
    tbl = Table(title=f"semantic cache quality on meancache_test ({len(pt.stored)} pairs, "
                f"{int(hd.sum())} with a duplicate stored)")
    for col in ("configuration", "threshold", "hit precision", "recall", "hits"):
        tbl.add_column(col)
    rows = []
    for name, o in (("cosine only (GPTCache-style)", o_cos), ("cosine + lexical guard", o_g)):
        for t in sorted({0.90, 0.93, 0.95, DEFAULT_THRESHOLD, tuned["0.97"]}):
            prec, rec, nh = pr_at(o, hd, t)
            rows.append({"config": name, "threshold": t, "precision": prec, "recall": rec,
                         "hits": nh})
            tbl.add_row(name, f"{t:.3f}", f"{prec:.3f}", f"{rec:.3f}", str(nh))
    res["test"]["table"] = rows
    # the opt-in cross-encoder (SemanticCache(cross_encoder=True)): the best guarded candidate
    # at or above the cosine cut is served when the cross-encoder gives it P >= 0.5
    ce = cross_encoder_rows(pt, o_g, hd, (0.85, 0.88, 0.90, DEFAULT_THRESHOLD))
    res["test"]["cross_encoder"] = ce
    for r in ce:
        rows.append(r)
        tbl.add_row(r["config"], f"{r['threshold']:.3f}", f"{r['precision']:.3f}",
                    f"{r['recall']:.3f}", str(r["hits"]))
    e2e = end_to_end(pt, sv, qv)
    res["test"]["default_semantic_cache"] = e2e
    tbl.add_row("SemanticCache() defaults, end to end", f"{DEFAULT_THRESHOLD:.3f}",
                f"{e2e['precision']:.3f}", f"{e2e['recall']:.3f}", str(e2e["hits"]))
    if not args.no_gptcache:
        g = gptcache_run(pt, sv, qv, DEFAULT_THRESHOLD)
        res["test"]["gptcache"] = g
        if "error" in g:
            console.print(f"[yellow]GPTCache not run: {g['error']}")
        else:
            tbl.add_row("GPTCache 0.1.44 (sqlite+faiss, same embedder)", f"{g['cos_cut']:.3f}",
                        f"{g['precision']:.3f}", f"{g['recall']:.3f}", str(g["hits"]))
    console.print(tbl)
    eb_rows = []
    etbl = Table(title="error-bounded mode (simulated model as verifier)")
    for col in ("bound", "error (all lookups)", "error (of hits)", "hit rate", "verified hits",
                "verifier calls", "learned threshold"):
        etbl.add_column(col)
    for b in (0.01, 0.02, 0.05):
        r = error_bounded(pt, sv, qv, b, args.seed)
        eb_rows.append(r)
        etbl.add_row(f"{b:.0%}", f"{r['error_rate_all_lookups']:.4f}",
                     f"{r['error_rate_of_hits']:.4f}", f"{r['hit_rate']:.3f}",
                     str(r["verified_hits"]), str(r["verifier_calls"]),
                     f"{r['final_threshold']:.3f}")
    res["test"]["error_bounded"] = eb_rows
    console.print(etbl)
    _plot(res, args.out / "semantic_quality.png")
    (args.out / "semantic_quality.json").write_text(json.dumps(res, indent=1))
    console.print(f"wrote {args.out / 'semantic_quality.json'} and semantic_quality.png")


def _plot(res: dict, path: Path) -> None:
    with agg_figure(path, (6, 4.5)) as ax:
        for key, label in (("curve_cosine_only", "cosine only"),
                           ("curve_cosine_guard", "cosine + lexical guard")):
            c = res["test"][key]
            ax.plot([x[2] for x in c], [x[1] for x in c], marker=".", label=label)
        ce = res["test"].get("cross_encoder", [])
        if ce:
            ax.plot([r["recall"] for r in ce], [r["precision"] for r in ce], marker="^",
                    label="+ cross-encoder (opt-in)")
        d = res["test"]["default_semantic_cache"]
        ax.scatter([d["recall"]], [d["precision"]], color="red", zorder=3, label="SemanticCache()")
        g = res["test"].get("gptcache", {})
        if "precision" in g:
            ax.scatter([g["recall"]], [g["precision"]], color="black", marker="x", zorder=3,
                       label="GPTCache, same cut")
        ax.axhline(0.95, color="gray", ls=":")
        ax.set_xlabel("recall (queries with a duplicate stored)")
        ax.set_ylabel("hit precision")
        ax.set_title("meancache_test, cache protocol")
        ax.legend()


if __name__ == "__main__":
    main()
