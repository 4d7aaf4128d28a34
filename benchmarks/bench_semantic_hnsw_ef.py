"""HNSW graph degree (M) and search breadth (ef) against recall and latency as the cache grows.

Vectors come from ``bench_semantic_common.VectorModel``: ``--data minilm`` (default) draws them
from a Gaussian with the mean and covariance of all-MiniLM-L6-v2 question embeddings, ``--data
iso`` from isotropic random unit vectors (the hardest case). For each size and M the graph
semcomm builds (usearch, int8, ef_add 128) is built once, then every ef is measured on it:

* paraphrase recall: a lookup is a stored vector moved by a paraphrase-sized difference
  (median cosine 0.88 to it, like labelled duplicates); right when the exactly most similar
  stored vector comes back first. This is the recall a semantic cache needs: a hit requires a
  stored entry that close.
* neighbour recall: a fresh vector with nothing close stored; right when its exact nearest
  neighbour comes back first. Such a neighbour sits far below any hit threshold, so missing it
  changes no answer; shown to explain why recall@1 on random queries overstates the need.

This is the evidence behind ``HNSWIndex``'s defaults (M and ``auto_ef``).

    python benchmarks/bench_semantic_hnsw_ef.py --sizes 300000              # ~10 min, 2 cores
    python benchmarks/bench_semantic_hnsw_ef.py --sizes 1000000 --connectivity 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_semantic_common import VectorModel, exact_best

from semcomm.semantic import HNSWIndex

console = Console()
DIM = 384


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,300000")
    ap.add_argument("--efs", default="32,64,128,256,512")
    ap.add_argument("--connectivity", default="16,32", help="comma-separated graph degrees M")
    ap.add_argument("--data", choices=("minilm", "iso"), default="minilm")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--json", type=Path, default=None,
                    help="default: benchmarks/results/semantic_hnsw_ef_<data>.json")
    args = ap.parse_args()
    out = args.json or Path(f"benchmarks/results/semantic_hnsw_ef_{args.data}.json")
    rng = np.random.default_rng(0)
    with console.status("fitting the vector model"):
        model = VectorModel(args.data, dim=DIM)
    res: dict = {"dim": DIM, "data": args.data, "queries": args.queries, "sizes": {}}
    tbl = Table(title=f"HNSW (int8) recall@1 and search latency by M and ef ({args.data} vectors)")
    for col in ("entries", "M", "ef", "paraphrase recall", "neighbour recall", "p50 ms",
                "p99 ms", "auto ef"):
        tbl.add_column(col)
    for n in (int(x) for x in args.sizes.split(",")):
        with console.status(f"drawing {n:,} vectors"):
            v = model.sample(rng, n)
            picks = rng.integers(0, n, args.queries)
            para = model.paraphrase(rng, v[picks])
            fresh = model.sample(rng, args.queries)
            want_para, want_fresh = exact_best(v, para), exact_best(v, fresh)
        cos = np.percentile(np.einsum("ij,ij->i", para, v[picks]), [10, 50, 90])
        entry: dict = {"paraphrase_cos_p10_p50_p90": cos.tolist(),
                       "auto_ef": HNSWIndex.auto_ef(n), "by_m": {}}
        for m in (int(x) for x in args.connectivity.split(",")):
            h = HNSWIndex(DIM, connectivity=m)
            t0 = time.perf_counter()
            with console.status(f"building M={m} over {n:,} vectors"):
                h.add(list(range(n)), v)
            build = time.perf_counter() - t0
            rows = []
            for ef in (int(x) for x in args.efs.split(",")):
                h.expansion_search = ef
                lat, ok_p, ok_f = [], 0, 0
                for i in range(args.queries):
                    t = time.perf_counter()
                    labels, _ = h.search(para[i], 8)
                    lat.append(time.perf_counter() - t)
                    ok_p += int(labels[0]) == int(want_para[i])
                    ok_f += int(h.search(fresh[i], 8)[0][0]) == int(want_fresh[i])
                p50, p99 = (float(np.percentile(np.asarray(lat) * 1e3, p)) for p in (50, 99))
                row = {"ef": ef, "paraphrase_recall": ok_p / args.queries,
                       "neighbour_recall": ok_f / args.queries, "p50_ms": p50, "p99_ms": p99}
                rows.append(row)
                tbl.add_row(f"{n:,}", str(m), str(ef), f"{row['paraphrase_recall']:.3f}",
                            f"{row['neighbour_recall']:.3f}", f"{p50:.3f}", f"{p99:.3f}",
                            str(HNSWIndex.auto_ef(n)))
                console.print(f"{n:,} M={m} ef={ef}: paraphrase {row['paraphrase_recall']:.3f} "
                              f"neighbour {row['neighbour_recall']:.3f} p50 {p50:.3f} ms")
            entry["by_m"][m] = {"build_s": build, "rows": rows}
            del h
        res["sizes"][n] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))  # partial results survive a long run
    console.print(tbl)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
