"""C2C with the larger sharer, Qwen2.5-Coder-1.5B-Instruct, and two receivers at once
(Qwen2.5-Coder-0.5B-Instruct and SmolLM2-135M-Instruct) on multiple-choice sets.

For each set, one pass over the questions evaluates both pairs: the sharer's prefill,
scoring and text-to-text analysis run once per question and enter both pairs' figures
(:func:`semcomm.fusion.evaluate_mcqa_receivers`), so each pair's figures are those of
``semcomm fusion eval --data SET --sharer qwen2.5-coder-1.5b-instruct --receiver R`` on the
same items, at about half the cost of two runs. C2C runs for a receiver when a fuser is
shipped for its pair (or given with ``--fuser RECEIVER=DIR``); otherwise the receiver, the
sharer and T2T still run and the complementarity table is filled.

Reported per set and pair, under both log-likelihood rules (summed, per-token mean): each
model alone, the questions only one of them gets right, the best-of-two oracle, T2T, C2C and
the share of the receiver -> oracle gap C2C closes; median latencies.

Usage (from the repository root)::

    python -m benchmarks.fusion.larger_sharer --quick          # 3 ARC-Easy items, seconds
    python -m benchmarks.fusion.larger_sharer --limit 100      # the three sets, items 0-99
    python -m benchmarks.fusion.larger_sharer --inputs DIR     # re-merge stored per-set runs

Per-set, per-pair results (the ``fusion eval --json`` format) go to ``--out-dir``
(default ``benchmarks/results/fusion_larger_sharer/``); a set already there is not rerun
(delete it or pass ``--force``), so an interrupted run continues with the next set. The
merged table goes to ``--json`` (default ``benchmarks/results/fusion_larger_sharer.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARER = "qwen2.5-coder-1.5b-instruct"
RECEIVERS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
SETS = ("arc_easy", "commonsense_qa", "piqa")
DATA = Path(os.environ.get("SEMCOMM_MCQA", "/work/shared/data/mcqa"))
RESULTS = Path("benchmarks/results")
METHODS = ("receiver", "sharer", "t2t", "c2c")


def _pair_file(out_dir: Path, set_name: str, receiver: str, skip: int, limit: int) -> Path:
    return out_dir / f"{set_name}_{skip}-{skip + limit}_{receiver}.json"


def run_sets(args: argparse.Namespace) -> None:
    import torch

    from semcomm.fusion import McqaSettings, evaluate_mcqa_receivers, load_fuser, read_mcqa
    from semcomm.fusion._mcqa import complementarity, find_pair_fuser, goal_summary, load_pair_side

    torch.set_num_threads(args.threads)
    fusers = dict(x.split("=", 1) for x in args.fuser)
    receivers = [r for r in args.receivers.split(",") if r]
    todo = [
        s for s in args.sets.split(",")
        if args.force or not all(
            _pair_file(args.out_dir, s, r, args.skip, args.limit).exists() for r in receivers
        )
    ]
    if not todo:
        print("every set is already in", args.out_dir)
        return
    t_load = time.perf_counter()
    sharer = load_pair_side(args.sharer)
    _ = sharer.spec  # the fingerprint a fuser checks, from the weights as stored
    sharer.model.to(torch.bfloat16)
    sides: dict[str, Any] = {}
    for r in receivers:
        side = load_pair_side(r)
        _ = side.spec
        side.model.to(torch.bfloat16)
        path = fusers.get(r) or find_pair_fuser(args.sharer, r)
        fz = load_fuser(path, sharer=sharer.spec, receiver=side.spec) if path else None
        sides[r] = (side, fz, str(path) if path else None)
    print(f"models loaded in {time.perf_counter() - t_load:.0f} s")
    settings = McqaSettings(methods=tuple(m for m in args.methods.split(",") if m))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for set_name in todo:
        data = DATA / f"{set_name}.jsonl"
        qs = read_mcqa(data, limit=args.limit, skip=args.skip)
        t0 = time.perf_counter()

        def progress(i: int, n: int, set_name: str = set_name, t0: float = t0) -> None:
            if i % 10 == 0 or i == n:
                print(f"{set_name}: {i}/{n} ({time.perf_counter() - t0:.0f} s)", flush=True)

        res = evaluate_mcqa_receivers(
            sharer, {r: (s, fz) for r, (s, fz, _) in sides.items()}, qs, settings, progress
        )
        seconds = time.perf_counter() - t0
        for r, by_method in res.items():
            doc: dict[str, Any] = dict(by_method)
            doc["summary"] = goal_summary(by_method)
            doc["complementarity"] = complementarity(by_method)
            doc["oracle"] = None
            doc["setup"] = {
                "data": str(data), "items": len(qs), "skip": args.skip, "rule": settings.rule,
                "analysis_tokens": settings.analysis_tokens, "bf16": True, "weights": "bf16",
                "device": "cpu", "threads": torch.get_num_threads(), "sharer": args.sharer,
                "receiver": r, "fuser": sides[r][2], "methods": list(by_method),
                "seconds_both_pairs": seconds,
                "note": "one pass for both receivers: the sharer's stages are timed once and "
                "counted in each pair's latencies",
                "command": "python -m benchmarks.fusion.larger_sharer "
                f"--limit {args.limit} --skip {args.skip} --sets {set_name}",
            }
            path = _pair_file(args.out_dir, set_name, r, args.skip, args.limit)
            path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"{set_name}: {len(qs)} questions, both pairs, {seconds:.0f} s", flush=True)


def merge(out_dir: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for f in sorted(out_dir.glob("*.json")):
        doc = json.loads(f.read_text(encoding="utf-8"))
        setup = doc["setup"]
        key = f"{Path(setup['data']).stem} {setup['skip']}-{setup['skip'] + setup['items']} " \
              f"{setup['sharer']} -> {setup['receiver']}"
        row: dict[str, Any] = {"n": setup["items"], "file": str(f)}
        for m in METHODS:
            if m in doc:
                row[m] = {
                    "accuracy": doc[m]["accuracy"],
                    "accuracy_loglik_mean": doc[m].get("accuracy_loglik_mean"),
                    "latency_s": doc[m]["latency_s"],
                }
        row["complementarity"] = doc.get("complementarity", {}).get("by_rule", {})
        row["summary"] = doc.get("summary", {})
        rows[key] = row
    return rows


def markdown(rows: dict[str, Any]) -> str:
    head = ("| set, pair | rule | receiver | sharer | only receiver | only sharer | oracle | T2T "
            "| C2C | gap closed | median latency r / s / T2T / C2C |")
    lines = [head, "|" + "---|" * 11]
    for key, row in rows.items():
        lat = " / ".join(
            f"{row[m]['latency_s']:.2f}" if m in row else "-" for m in METHODS
        )
        for rule, c in row["complementarity"].items():
            def f(x: Any) -> str:
                return "-" if x is None else f"{x:.3f}"

            gap = c.get("c2c_gap_closed")
            lines.append(
                f"| {key} | {rule} | {f(c['receiver'])} | {f(c['sharer'])} | "
                f"{f(c['only_receiver'])} | {f(c['only_sharer'])} | {f(c['either_right'])} | "
                f"{f(c.get('t2t'))} | {f(c.get('c2c'))} | "
                f"{'-' if gap is None else f'{gap * 100:.0f}%'} | {lat} s |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sharer", default=SHARER)
    ap.add_argument("--receivers", default=",".join(RECEIVERS))
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--methods", default="receiver,sharer,t2t,c2c")
    ap.add_argument("--fuser", action="append", default=[], metavar="RECEIVER=DIR",
                    help="a fuser for the pair (sharer -> RECEIVER); default: the shipped one")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=RESULTS / "fusion_larger_sharer")
    ap.add_argument("--json", type=Path, default=RESULTS / "fusion_larger_sharer.json")
    ap.add_argument("--inputs", type=Path, default=None, help="only merge the runs in this folder")
    ap.add_argument("--force", action="store_true", help="rerun sets already in --out-dir")
    ap.add_argument("--quick", action="store_true", help="3 ARC-Easy items, to a scratch folder")
    args = ap.parse_args()
    if args.quick:
        import tempfile

        args.sets, args.limit, args.force = "arc_easy", 3, True
        args.out_dir = Path(tempfile.mkdtemp(prefix="larger_sharer_"))
        args.json = args.out_dir / "merged.json"
    if args.inputs is None:
        run_sets(args)
        src = args.out_dir
    else:
        src = args.inputs
    rows = merge(src)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    print(markdown(rows))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
