"""HNSW search breadth (ef) against recall@1 and latency as the graph grows.

Random unit vectors (dim 384, MiniLM's size; the hardest case for a graph index), the graph
semcomm builds (usearch, M=16, ef_add 128, int8), one build per size, then every ef on the same
graph; a lookup is a stored vector plus small noise, right when its own id comes back first.
This is the evidence behind ``HNSWIndex.auto_ef``.

    python benchmarks/bench_semantic_hnsw_ef.py --sizes 300000      # ~6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from semcomm.semantic import HNSWIndex

console = Console()
DIM = 384


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,300000")
    ap.add_argument("--efs", default="64,128,256,512,1024")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/semantic_hnsw_ef.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    res: dict = {"dim": DIM, "queries": args.queries, "sizes": {}}
    tbl = Table(title="HNSW (M=16, int8) recall@1 and search latency by ef")
    for col in ("entries", "ef", "recall@1", "p50 ms", "p99 ms", "auto ef"):
        tbl.add_column(col)
    for n in (int(x) for x in args.sizes.split(",")):
        v = rng.standard_normal((n, DIM)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        h = HNSWIndex(DIM)
        t0 = time.perf_counter()
        with console.status(f"building {n:,} vectors"):
            h.add(list(range(n)), v)
        build = time.perf_counter() - t0
        picks = rng.integers(0, n, args.queries)
        qs = v[picks] + 0.05 * rng.standard_normal((args.queries, DIM)).astype(np.float32) / DIM**0.5
        qs /= np.linalg.norm(qs, axis=1, keepdims=True)
        rows = []
        for ef in (int(x) for x in args.efs.split(",")):
            h.expansion_search = ef
            lat, ok = [], 0
            for i, q in zip(picks, qs, strict=True):
                t = time.perf_counter()
                labels, _ = h.search(q, 8)
                lat.append(time.perf_counter() - t)
                ok += int(labels[0]) == int(i)
            p50, p99 = (float(np.percentile(np.asarray(lat) * 1e3, p)) for p in (50, 99))
            rows.append({"ef": ef, "recall@1": ok / args.queries, "p50_ms": p50, "p99_ms": p99})
            tbl.add_row(f"{n:,}", str(ef), f"{ok / args.queries:.3f}", f"{p50:.3f}", f"{p99:.3f}",
                        str(HNSWIndex.auto_ef(n)))
        res["sizes"][n] = {"build_s": build, "auto_ef": HNSWIndex.auto_ef(n), "rows": rows}
    console.print(tbl)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
