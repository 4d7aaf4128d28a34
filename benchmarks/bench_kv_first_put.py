"""DiskStore: does a pass of puts that starts a while after the store was opened pay extra?

A store used to re-list its whole directory (256 shard directories) in the first ``put`` after
a second; the re-listing now runs on a background thread that waits while the store is in use
(docs/kv.md, "Several processes"). This times a pass of ``"flush"`` puts (every chunk just
encoded, the directory emptied and synced before each pass, its shard directories kept) started
at once after opening the store and one started ``--delay`` seconds later, in alternating
pairs, and reports the median of the per-pair ratios (late / at once; 1.0: no extra cost).

    python benchmarks/bench_kv_first_put.py --json benchmarks/results/kv_first_put.json \\
        --png benchmarks/results/kv_first_put.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_stores import chunk_set  # noqa: E402

from semcomm.kv import DiskStore  # noqa: E402


def empty(root: Path) -> None:
    for shard in root.iterdir():
        if shard.is_dir():
            for f in shard.iterdir():
                f.unlink()


def pairs(root: Path, tokens: int, n: int, rounds: int, delay: float) -> dict[str, Any]:
    DiskStore(root).close()  # the directory and its 256 shard directories
    times: dict[float, list[float]] = {0.0: [], delay: []}
    for r in range(rounds):
        for d in ((0.0, delay) if r % 2 == 0 else (delay, 0.0)):
            items = chunk_set(n, tokens, 24, 2, 64, seed=r)  # Qwen2.5-0.5B-shaped fp16
            os.sync()
            store = DiskStore(root, capacity_bytes=8 << 30)
            opened = time.monotonic()
            while time.monotonic() - opened < d:
                time.sleep(0.005)
            t0 = time.perf_counter()
            for k, v in items:
                store.put(k, v)
            times[d].append(time.perf_counter() - t0)
            store.close()
            empty(root)
    ratios = [late / now for now, late in zip(times[0.0], times[delay])]
    return {"tokens": tokens, "chunks": n, "ratio_median": statistics.median(ratios),
            "ratios": ratios, "at_once_us": statistics.median(times[0.0]) / n * 1e6,
            "late_us": statistics.median(times[delay]) / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,256", help="tokens per chunk, comma separated")
    ap.add_argument("--mib", type=int, default=32, help="MiB of chunks per pass")
    ap.add_argument("--rounds", type=int, default=10, help="pairs per size")
    ap.add_argument("--delay", type=float, default=1.1, help="seconds before the late pass")
    ap.add_argument("--dir", default=None, help="directory for the store (default: a tmp dir)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="semcomm-first-put-"))
    rows = []
    try:
        for t in (int(x) for x in args.tokens.split(",")):
            one = len(chunk_set(2, t, 24, 2, 64)[1][1])
            rows.append(pairs(work / f"t{t}", t, max(4, (args.mib << 20) // one), args.rounds,
                              args.delay))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    table = Table(title=f"flush pass started {args.delay} s after opening vs at once "
                        f"(median of {args.rounds} alternating pairs)")
    for col in ("tokens", "chunks", "at once us/chunk", "late us/chunk", "late / at once"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["tokens"]), str(r["chunks"]), f"{r['at_once_us']:.0f}",
                      f"{r['late_us']:.0f}", f"{r['ratio_median']:.2f}x")
    Console().print(table)
    report = {"benchmark": "kv_first_put", "delay_s": args.delay, "rounds": args.rounds,
              "load_average": list(os.getloadavg()), "rows": rows}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    if args.png:
        from _common import agg_figure

        with agg_figure(Path(args.png), (6, 4)) as ax:
            ax.bar([f"{r['tokens']} tokens" for r in rows], [r["ratio_median"] for r in rows])
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_ylabel("pass time, late / at once")
            ax.set_title(f"DiskStore flush pass {args.delay} s after opening", fontsize=9)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
