"""Which vector index serves a semantic cache best: IVF (faiss, the default above 20k entries)
against the HNSW graph (usearch), by paraphrase recall, search latency and insert cost.

Vectors come from ``bench_semantic_common.VectorModel`` (``--data minilm``: a Gaussian with the
mean and covariance of all-MiniLM-L6-v2 question embeddings; ``--data iso``: random unit
vectors). For each size, each index is built once over the same vectors and searched with the
same lookups:

* paraphrase recall: a lookup is a stored vector moved by a paraphrase-sized difference (median
  cosine 0.89 to it, like labelled duplicates); right when the exactly most similar stored
  vector comes back first -- the recall a cache needs, since a hit requires an entry that close;
* search p50/p99 for those lookups (hits) and for fresh vectors with nothing close stored
  (misses; most lookups of a real cache);
* build time of the whole index and single inserts per second into the built index.

IVF is swept over ``--nprobes`` (cells scanned; "auto" is what ``IVFIndex`` uses), HNSW over
``--efs`` (M=32, int8 graph). Table, JSON (``benchmarks/results/semantic_index_<data>.json``) and
a recall-latency PNG.

    python benchmarks/bench_semantic_index.py --sizes 100000                 # ~3 min, 2 cores
    python benchmarks/bench_semantic_index.py --sizes 1000000 --no-hnsw      # ~5 min
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import agg_figure
from bench_semantic_common import VectorModel, exact_best

from semcomm.semantic import HNSWIndex, IVFIndex

console = Console()
DIM = 384


def measure(idx, queries: np.ndarray, want: np.ndarray | None) -> dict:
    lat, ok = [], 0
    for i, q in enumerate(queries):
        t = time.perf_counter()
        labels, _ = idx.search(q, 8)
        lat.append(time.perf_counter() - t)
        if want is not None:
            ok += int(labels[0]) == int(want[i])
    a = np.asarray(lat) * 1e3
    out = {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}
    if want is not None:
        out["recall"] = ok / len(queries)
    return out


def single_inserts(idx, model: VectorModel, rng: np.random.Generator, start: int, m: int) -> float:
    extra = model.sample(rng, m)
    t = time.perf_counter()
    for i in range(m):
        idx.add([start + i], extra[i : i + 1])
    rate = m / (time.perf_counter() - t)
    idx.remove(list(range(start, start + m)))
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000")
    ap.add_argument("--nprobes", default="16,32,auto,96,128")
    ap.add_argument("--efs", default="64,128,256")
    ap.add_argument("--no-hnsw", action="store_true", help="IVF only (an HNSW build of 1M "
                    "vectors takes ~25 min on 2 cores)")
    ap.add_argument("--data", choices=("minilm", "iso"), default="minilm")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--inserts", type=int, default=2000, help="single inserts timed per index")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = args.json or Path(f"benchmarks/results/semantic_index_{args.data}.json")
    rng = np.random.default_rng(0)
    with console.status("fitting the vector model"):
        model = VectorModel(args.data, dim=DIM)
    res: dict = {"dim": DIM, "data": args.data, "queries": args.queries, "sizes": {}}
    tbl = Table(title=f"cache index by paraphrase recall and latency ({args.data} vectors)")
    for col in ("entries", "index", "setting", "paraphrase recall", "hit p50/p99 ms",
                "miss p50 ms", "build s", "single inserts/s"):
        tbl.add_column(col)
    for n in (int(x) for x in args.sizes.split(",")):
        with console.status(f"drawing {n:,} vectors and exact answers"):
            v = model.sample(rng, n)
            para = model.paraphrase(rng, v[rng.integers(0, n, args.queries)])
            fresh = model.sample(rng, args.queries)
            want = exact_best(v, para)
        entry: dict = {"ivf": {}, "hnsw": {}}
        kinds = [("ivf", [x for x in args.nprobes.split(",")])]
        if not args.no_hnsw:
            kinds.append(("hnsw", [x for x in args.efs.split(",")]))
        for kind, settings in kinds:
            idx = (IVFIndex(DIM, background=False, min_train=min(20_000, n)) if kind == "ivf"
                   else HNSWIndex(DIM))
            t0 = time.perf_counter()
            with console.status(f"building {kind} over {n:,} vectors"):
                idx.add(np.arange(n, dtype=np.int64), v)
            build = time.perf_counter() - t0
            ins = single_inserts(idx, model, rng, n, args.inserts)
            entry[kind] = {"build_s": build, "single_inserts_per_s": ins, "rows": []}
            if kind == "ivf":
                entry[kind]["nlist"] = idx.cells
                entry[kind]["auto_nprobe"] = IVFIndex.auto_nprobe(idx.cells)
            for s in settings:
                if kind == "ivf":
                    idx.nprobe = s if s == "auto" else int(s)
                    label = (f"nprobe {IVFIndex.auto_nprobe(idx.cells)} (auto) of {idx.cells}"
                             if s == "auto" else f"nprobe {s} of {idx.cells}")
                else:
                    idx.expansion_search = int(s)
                    label = f"M 32, ef {s}"
                hit = measure(idx, para, want)
                miss = measure(idx, fresh, None)
                row = {"setting": s, "label": label, "paraphrase_recall": hit["recall"],
                       "hit_p50_ms": hit["p50_ms"], "hit_p99_ms": hit["p99_ms"],
                       "miss_p50_ms": miss["p50_ms"], "miss_p99_ms": miss["p99_ms"]}
                entry[kind]["rows"].append(row)
                tbl.add_row(f"{n:,}", kind, label, f"{hit['recall']:.3f}",
                            f"{hit['p50_ms']:.3f}/{hit['p99_ms']:.3f}", f"{miss['p50_ms']:.3f}",
                            f"{build:.0f}", f"{ins:,.0f}")
                console.print(f"{n:,} {kind} {label}: recall {hit['recall']:.3f} "
                              f"p50 {hit['p50_ms']:.3f} ms, miss p50 {miss['p50_ms']:.3f} ms")
            del idx
            gc.collect()
        res["sizes"][n] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))  # partial results survive a long run
    console.print(tbl)
    _plot(res, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


def _plot(res: dict, path: Path) -> None:
    with agg_figure(path, (6.5, 4.2)) as ax:
        for n, entry in res["sizes"].items():
            for kind, marker in (("ivf", "o"), ("hnsw", "s")):
                rows = entry[kind].get("rows") if entry[kind] else None
                if not rows:
                    continue
                ax.plot([r["hit_p50_ms"] for r in rows], [r["paraphrase_recall"] for r in rows],
                        marker=marker, label=f"{kind.upper()} {int(n):,}")
        ax.set_xscale("log")
        ax.set_xlabel("search p50 (ms), paraphrase lookups")
        ax.set_ylabel("paraphrase recall")
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
