"""Semantic-cache speed: lookup latency without embedding at 10k/100k/1M entries, index
choice (flat, IVF, HNSW), whole-hit latency with MiniLM on CPU, inserts/s, memory per entry, and
GPTCache (SQLite + Faiss) on the same vectors.

    python -m benchmarks.semantic.speed --quick     # 10k and 100k entries
    python -m benchmarks.semantic.speed             # adds 1M entries

Vectors come from ``benchmarks.semantic.common.VectorModel`` (dim 384): ``--data minilm`` (default)
draws them with the mean and covariance of all-MiniLM-L6-v2 question embeddings, ``--data iso``
as isotropic random unit vectors (the hardest case for the graph index). Lookups are a stored
vector moved by half a paraphrase-sized difference (cosine ~0.97), so every lookup should hit
its own entry at the default threshold; ``hit_ok`` says how many did.

    python -m benchmarks.semantic.speed --sizes 1000000 --lookup-only --cache-only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.semantic.common import VectorModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

from benchmarks.common import agg_figure

# one intra-op thread: on a shared, small CPU, more threads mostly wait for each other
torch.set_num_threads(int(os.environ.get("SEMCOMM_BENCH_THREADS", "1")))

from rich.console import Console
from rich.table import Table

from semcomm import SemanticCache
from semcomm.semantic import CallableEmbedder, FlatIndex, HNSWIndex, IVFIndex, default_embedder

console = Console()
DIM = 384


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


MODEL: VectorModel | None = None  # set by main() from --data


def noisy(rng: np.random.Generator, v: np.ndarray) -> np.ndarray:
    """A lookup vector for stored vector ``v``: half a paraphrase-sized move."""
    assert MODEL is not None
    return MODEL.paraphrase(rng, v, scale=0.5)[0]


def pct(lat: list[float]) -> tuple[float, float]:
    a = np.asarray(lat) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _ivf(dim: int) -> IVFIndex:
    return IVFIndex(dim, background=False)


def bench_index(n: int, vecs: np.ndarray, rng: np.random.Generator, q: int,
                kinds: tuple[str, ...]) -> dict:
    out = {}
    for name, cls in (("flat", FlatIndex), ("ivf", _ivf), ("hnsw", HNSWIndex)):
        if name not in kinds or (name == "flat" and n > 200_000):
            continue
        idx = cls(DIM)
        t0 = time.perf_counter()
        idx.add(np.arange(n, dtype=np.int64), vecs[:n])
        build = time.perf_counter() - t0
        picks = rng.integers(0, n, q)
        lat, found = [], 0
        for i in picks:
            qv = noisy(rng, vecs[i])
            t = time.perf_counter()
            labels, _ = idx.search(qv, 8)
            lat.append(time.perf_counter() - t)
            found += int(labels[0]) == int(i)
        p50, p99 = pct(lat)
        out[name] = {"build_s": build, "p50_ms": p50, "p99_ms": p99, "recall@1": found / q}
        del idx
        gc.collect()
    return out


def bench_cache(n: int, vecs: np.ndarray, rng: np.random.Generator, q: int) -> dict:
    """The full lookup path (sync, candidates, guard, policy, store read), no embedding."""
    emb = CallableEmbedder(lambda t: np.zeros((len(t), DIM)), name="none", dim=DIM)
    gc.collect()
    before = rss_bytes()
    cache = SemanticCache(embedder=emb, max_entries=None, index="auto")
    queries = [f"stored question number {i}" for i in range(n)]
    t0 = time.perf_counter()
    for s in range(0, n, 10_000):
        cache.store_many(queries[s : s + 10_000], [f"answer {i}" for i in range(s, min(n, s + 10_000))],
                         embeddings=list(vecs[s : s + 10_000]))
    cache.wait_index()  # a background index build still running is part of the insert cost
    ins = time.perf_counter() - t0
    gc.collect()
    mem = rss_bytes() - before
    picks = rng.integers(0, n, q)
    lat, hits = [], 0
    for i in picks:
        qv = noisy(rng, vecs[i])
        t = time.perf_counter()
        h = cache.lookup(queries[i], embedding=qv)
        lat.append(time.perf_counter() - t)
        hits += h is not None and h.answer == f"answer {i}"
    p50, p99 = pct(lat)
    st = cache.stats()
    del cache
    gc.collect()
    return {"inserts_per_s": n / ins, "bytes_per_entry_rss": mem / n, "p50_ms": p50,
            "p99_ms": p99, "hit_ok": hits / q, "index": st.index}


def bench_sqlite_inserts(n: int, vecs: np.ndarray) -> dict:
    emb = CallableEmbedder(lambda t: np.zeros((len(t), DIM)), name="none", dim=DIM)
    d = tempfile.mkdtemp()
    cache = SemanticCache(embedder=emb, path=Path(d) / "s.sqlite", max_entries=None)
    t0 = time.perf_counter()
    for s in range(0, n, 1000):
        cache.store_many([f"q{i}" for i in range(s, s + 1000)], ["a"] * 1000,
                         embeddings=list(vecs[s : s + 1000]))
    batched = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    m = min(n, 1000)
    for i in range(m):
        cache.store(f"single {i}", "a", embedding=vecs[i])
    single = m / (time.perf_counter() - t0)
    cache.close()
    return {"sqlite_inserts_per_s_batched": batched, "sqlite_inserts_per_s_single": single}


def bench_whole_hit(q: int, entries: int = 1000) -> dict:
    emb = default_embedder()
    cache = SemanticCache(embedder=emb)
    stored = [f"How do I configure feature number {i} of the product?" for i in range(entries)]
    cache.store_many(stored, [f"answer {i}" for i in range(entries)])
    lat, hits = [], 0
    for i in range(q):
        query = f"How can I configure feature number {i} of the product?"
        t = time.perf_counter()
        h = cache.lookup(query)
        lat.append(time.perf_counter() - t)
        hits += h is not None
    p50, p99 = pct(lat)
    return {"p50_ms": p50, "p99_ms": p99, "hit_rate": hits / q, "entries": entries}


def bench_gptcache(n: int, vecs: np.ndarray, rng: np.random.Generator, q: int) -> dict:
    try:
        import faiss  # noqa: F401
        from gptcache import Cache, Config
        from gptcache.adapter.api import get, put
        from gptcache.manager import CacheBase, VectorBase, get_data_manager
        from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation
    except ImportError as exc:
        return {"error": str(exc)}
    tmp = tempfile.mkdtemp(prefix="gptcache-speed-")
    table = {}
    c = Cache()
    dm = get_data_manager(CacheBase("sqlite", sql_url=f"sqlite:///{tmp}/g.db"),
                          VectorBase("faiss", dimension=DIM, index_path=f"{tmp}/f.index"),
                          max_size=n + 10)
    from gptcache.processor.pre import get_prompt

    c.init(pre_embedding_func=get_prompt, embedding_func=lambda x, **_: table[x], data_manager=dm,
           similarity_evaluation=SearchDistanceEvaluation(), config=Config(similarity_threshold=0.9))
    t0 = time.perf_counter()
    for i in range(n):
        key = f"stored question number {i}"
        table[key] = vecs[i]
        put(key, f"answer {i}", cache_obj=c)
    ins = time.perf_counter() - t0
    lat, ok = [], 0
    for i in rng.integers(0, n, q):
        key = f"lookup {i}"
        table[key] = noisy(rng, vecs[i])
        t = time.perf_counter()
        a = get(key, cache_obj=c)
        lat.append(time.perf_counter() - t)
        ok += a == f"answer {i}"
    p50, p99 = pct(lat)
    return {"entries": n, "inserts_per_s": n / ins, "p50_ms": p50, "p99_ms": p99,
            "hit_ok": ok / q}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1,000 entries, 50 queries, small SQLite and GPTCache rows")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--sizes", type=str, default="", help="comma-separated entry counts")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--no-gptcache", action="store_true")
    ap.add_argument("--gptcache-entries", type=int, default=10_000)
    ap.add_argument("--lookup-only", action="store_true",
                    help="only the per-size index and lookup rows (no SQLite, MiniLM or GPTCache "
                         "rows): for a machine without the embedder")
    ap.add_argument("--cache-only", action="store_true",
                    help="skip the bare index rows (flat, IVF, HNSW): one build per size")
    ap.add_argument("--index-kinds", default="flat,ivf,hnsw",
                    help="bare index rows to measure (an HNSW build of 1M takes ~25 min)")
    ap.add_argument("--data", choices=("minilm", "iso"), default="minilm",
                    help="vector model (benchmarks.semantic.common.VectorModel)")
    ap.add_argument("--json-name", default="semantic_speed.json")
    args = ap.parse_args()
    global MODEL
    with console.status("fitting the vector model"):
        MODEL = VectorModel(args.data, dim=DIM, n_questions=300 if args.quick else 6000)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [1_000] if args.quick else [10_000, 100_000, 1_000_000]
    if args.quick:
        args.queries, args.gptcache_entries = min(args.queries, 50), min(args.gptcache_entries, 1000)
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    vecs = MODEL.sample(rng, max(max(sizes), 1_000 if args.quick else 20_000))
    res: dict = {"dim": DIM, "data": args.data, "queries": args.queries, "sizes": {}}
    t1 = Table(title="lookup latency without embedding (ms)")
    for col in ("entries", "flat p50/p99", "IVF p50/p99 (recall@1)", "HNSW p50/p99 (recall@1)",
                "SemanticCache p50/p99", "index", "inserts/s", "bytes/entry (RSS)"):
        t1.add_column(col)
    for n in sizes:
        console.print(f"[bold]{n} entries")
        ix = {} if args.cache_only else bench_index(n, vecs, rng, args.queries,
                                                    tuple(args.index_kinds.split(",")))
        ca = bench_cache(n, vecs, rng, args.queries)
        res["sizes"][n] = {"index": ix, "cache": ca}

        def cell(kind: str, recall: bool = True, ix: dict = ix) -> str:
            r = ix.get(kind)
            if not r:
                return "-"
            return (f"{r['p50_ms']:.3f}/{r['p99_ms']:.3f}"
                    + (f" ({r['recall@1']:.3f})" if recall else ""))

        t1.add_row(f"{n:,}", cell("flat", recall=False), cell("ivf"), cell("hnsw"),
                   f"{ca['p50_ms']:.3f}/{ca['p99_ms']:.3f} (ok {ca['hit_ok']:.3f})", ca["index"],
                   f"{ca['inserts_per_s']:,.0f}", f"{ca['bytes_per_entry_rss']:,.0f}")
    console.print(t1)
    res["cpu_count"] = os.cpu_count()
    if args.lookup_only:
        (args.out / args.json_name).write_text(json.dumps(res, indent=1))
        console.print(f"wrote {args.out / args.json_name}")
        return
    res["sqlite"] = bench_sqlite_inserts(1_000 if args.quick else 20_000, vecs)
    res["whole_hit_minilm"] = (bench_whole_hit(20, entries=100) if args.quick
                               else bench_whole_hit(min(args.queries, 200)))
    w = res["whole_hit_minilm"]
    console.print(f"whole hit with MiniLM (embed + lookup), CPU: p50 {w['p50_ms']:.1f} ms, "
                  f"p99 {w['p99_ms']:.1f} ms, hit rate {w['hit_rate']:.2f}")
    console.print(f"SQLite inserts/s: batched {res['sqlite']['sqlite_inserts_per_s_batched']:,.0f}"
                  f", single {res['sqlite']['sqlite_inserts_per_s_single']:,.0f}")
    if not args.no_gptcache:
        g = bench_gptcache(args.gptcache_entries, vecs, rng, args.queries)
        res["gptcache"] = g
        if "error" in g:
            console.print(f"[yellow]GPTCache not run: {g['error']}")
        else:
            ours = res["sizes"][min(sizes)]["cache"]
            console.print(f"GPTCache sqlite+faiss at {g['entries']:,}: lookup p50 "
                          f"{g['p50_ms']:.3f} ms p99 {g['p99_ms']:.3f} ms, inserts/s "
                          f"{g['inserts_per_s']:,.0f}; SemanticCache at {min(sizes):,}: p50 "
                          f"{ours['p50_ms']:.3f} ms ({g['p50_ms'] / ours['p50_ms']:.1f}x faster)")
    (args.out / args.json_name).write_text(json.dumps(res, indent=1))
    _plot(res, args.out / "semantic_speed.png")
    console.print(f"wrote {args.out / args.json_name}")


def _plot(res: dict, path: Path) -> None:
    ns = sorted(int(n) for n in res["sizes"])
    with agg_figure(path, (6, 4)) as ax:
        for key, label in (("flat", "flat (numpy)"), ("ivf", "IVF (faiss)"),
                           ("hnsw", "HNSW (usearch)")):
            xs = [n for n in ns if key in res["sizes"][n]["index"]]
            ax.plot(xs, [res["sizes"][n]["index"][key]["p50_ms"] for n in xs], marker="o", label=label)
        ax.plot(ns, [res["sizes"][n]["cache"]["p50_ms"] for n in ns], marker="s",
                label="SemanticCache.lookup (no embedding)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("entries")
        ax.set_ylabel("p50 latency (ms)")
        ax.legend()


if __name__ == "__main__":
    main()
