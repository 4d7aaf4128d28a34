"""C2C on the real pair (Qwen2.5-Coder-0.5B-Instruct -> SmolLM2-135M-Instruct), three held-out
multiple-choice sets: accuracy and latency of receiver alone, sharer alone, text-to-text and
C2C, the goals as figures, and the cache-enrichment oracle.

Each set's figures come from ``semcomm fusion eval --data SET.jsonl --json FILE`` runs (this
script runs them with ``--run``, or reads existing files). Runs of one set may cover
different methods (e.g. the baselines once, C2C with each new fuser); they are merged per
set. When the two runs differ, latency ratios across them are normalised by the receiver's
median latency *within each run* (the receiver is timed in both), so a busier machine in one
run does not move the ratio; the raw ratio is reported too.

Usage::

    python -m benchmarks.fusion.real --run --limit 100 [--sets arc_easy,piqa] \\
        [--fuser DIR] --json benchmarks/results/fusion_real.json --png benchmarks/results/fusion_real.png
    python -m benchmarks.fusion.real --inputs a.json b.json ... --json F --png F \
        [--compare old_c2c_a.json ...]

``--compare`` takes C2C runs of another fuser on the same items (e.g. the shipped one when a
new fuser is evaluated): per set its accuracy, the points between the two and a paired sign
test over the questions only one of them gets right (exact binomial, two-sided), so "beats"
and "loses by more than noise" are figures, not impressions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console
from rich.table import Table

console = Console()
METHODS = ("receiver", "sharer", "t2t", "c2c")
DATA = Path(os.environ.get("SEMCOMM_MCQA", "/work/shared/data/mcqa"))


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per set: {method: figures}, each method from the last run that has it."""
    sets: dict[str, dict[str, Any]] = {}
    for doc in docs:
        name = Path(doc["setup"]["data"]).stem
        entry = sets.setdefault(name, {"methods": {}, "runs": [], "oracle": None})
        run_id = len(entry["runs"])
        entry["runs"].append({k: doc["setup"].get(k) for k in ("items", "fuser", "seconds")})
        for m in METHODS:
            if m in doc:
                entry["methods"][m] = dict(doc[m], run=run_id, receiver_latency_s=None)
                if "receiver" in doc:
                    entry["methods"][m]["receiver_latency_s"] = doc["receiver"]["latency_s"]
        if doc.get("oracle"):
            entry["oracle"] = doc["oracle"]
    for entry in sets.values():
        ms = entry["methods"]
        goals: dict[str, Any] = {}
        if "c2c" in ms:
            for other in ("receiver", "t2t", "sharer"):
                if other in ms:
                    goals[f"c2c_minus_{other}_points"] = (
                        ms["c2c"]["accuracy"] - ms[other]["accuracy"]
                    ) * 100
            if "t2t" in ms:
                t, c = ms["t2t"], ms["c2c"]
                goals["t2t_over_c2c_latency_raw"] = t["latency_s"] / max(c["latency_s"], 1e-9)
                if t["run"] != c["run"] and t["receiver_latency_s"] and c["receiver_latency_s"]:
                    goals["t2t_over_c2c_latency"] = (t["latency_s"] / t["receiver_latency_s"]) / (
                        c["latency_s"] / c["receiver_latency_s"]
                    )
                    goals["latency_note"] = "runs differ: normalised by the receiver's latency"
                else:
                    goals["t2t_over_c2c_latency"] = goals["t2t_over_c2c_latency_raw"]
        goals["met"] = {
            "c2c_ge_receiver_plus_10": goals.get("c2c_minus_receiver_points", -1e9) >= 10,
            "c2c_ge_t2t_plus_3": goals.get("c2c_minus_t2t_points", -1e9) >= 3,
            "c2c_ge_sharer": goals.get("c2c_minus_sharer_points", -1e9) >= 0,
            "latency_t2t_over_c2c_ge_2.5": goals.get("t2t_over_c2c_latency", 0) >= 2.5,
        }
        entry["goals"] = goals
    return sets


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of ``wins`` vs ``losses`` discordant pairs (p=0.5)."""
    from math import comb

    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(sets: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """Attach another fuser's C2C run (same set, same items) to each set, in place."""
    for doc in docs:
        name = Path(doc["setup"]["data"]).stem
        entry, old = sets.get(name), doc.get("c2c")
        if entry is None or old is None or "c2c" not in entry["methods"]:
            continue
        new = entry["methods"]["c2c"]
        if new["n"] != old["n"]:
            raise SystemExit(f"{name}: --compare run has n={old['n']}, the C2C run n={new['n']}")
        a, b = new["correct"], old["correct"]
        wins = sum(x and not y for x, y in zip(a, b))
        losses = sum(y and not x for x, y in zip(a, b))
        entry["compare"] = {
            "fuser": doc["setup"].get("fuser"),
            "accuracy": old["accuracy"],
            "latency_s": old["latency_s"],
            "n": old["n"],
            "c2c_minus_compare_points": (new["accuracy"] - old["accuracy"]) * 100,
            "only_new_right": wins,
            "only_compare_right": losses,
            "sign_test_p": sign_test(wins, losses),
        }


def markdown(sets: dict[str, Any]) -> str:
    """The results as a Markdown table (docs/fusion.md, docs/BENCHMARKS.md)."""
    lines = [
        "| set | n | receiver | sharer | T2T | C2C | C2C - receiver | C2C - T2T | C2C - sharer "
        "| T2T / C2C latency |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in sets.items():
        ms, g = e["methods"], e["goals"]
        cells = []
        for m in METHODS:
            r = ms.get(m)
            cells.append(f"{r['accuracy']:.3f} ({r['latency_s']:.2f} s, n={r['n']})" if r else "-")
        pts = [
            f"{g[k]:+.1f}" if k in g else "-"
            for k in (
                "c2c_minus_receiver_points",
                "c2c_minus_t2t_points",
                "c2c_minus_sharer_points",
            )
        ]
        lat = f"{g['t2t_over_c2c_latency']:.2f}x" if "t2t_over_c2c_latency" in g else "-"
        n = max((r["n"] for r in ms.values()), default=0)
        lines.append(f"| {name} | {n} | " + " | ".join(cells + pts + [lat]) + " |")
    if any("compare" in e for e in sets.values()):
        lines += [
            "",
            "| set | n | C2C | C2C (compared fuser) | points | only C2C right | only compared "
            "right | sign test p |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, e in sets.items():
            c = e.get("compare")
            if c:
                lines.append(
                    f"| {name} | {c['n']} | {e['methods']['c2c']['accuracy']:.3f} | "
                    f"{c['accuracy']:.3f} | {c['c2c_minus_compare_points']:+.1f} | "
                    f"{c['only_new_right']} | {c['only_compare_right']} | {c['sign_test_p']:.2f} |"
                )
    return "\n".join(lines)


def plot(sets: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(sets)
    colors = {"receiver": "#999999", "sharer": "#6699cc", "t2t": "#cc9966", "c2c": "#339966"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.2
    for j, m in enumerate(METHODS):
        accs = [sets[n]["methods"].get(m, {}).get("accuracy", 0) * 100 for n in names]
        lat = []
        for n in names:
            r = sets[n]["methods"].get(m, {})
            # runs of one set may be timed under different machine load: show each latency
            # relative to the receiver's median latency in the same run
            lat.append(
                r["latency_s"] / r["receiver_latency_s"] if r.get("receiver_latency_s") else 0
            )
        xs = [i + (j - 1.5) * width for i in range(len(names))]
        a1.bar(xs, accs, width, label=m, color=colors[m])
        a2.bar(xs, lat, width, label=m, color=colors[m])
        for x, y in zip(xs, accs):
            a1.text(x, y + 0.5, f"{y:.0f}", ha="center", fontsize=7)
    if any("compare" in sets[n] for n in names):  # the compared fuser's C2C, hatched
        xs = [i + 2.5 * width for i in range(len(names))]
        accs = [sets[n].get("compare", {}).get("accuracy", 0) * 100 for n in names]
        a1.bar(xs, accs, width, label="c2c (compared fuser)", color="#99ccaa", hatch="//")
        for x, y in zip(xs, accs):
            a1.text(x, y + 0.5, f"{y:.0f}", ha="center", fontsize=7)
    for ax in (a1, a2):
        ax.set_xticks(range(len(names)), names)
    a1.set_ylabel("accuracy (%)")
    a1.set_title("held-out multiple choice (option log-likelihood)")
    a2.set_ylabel("median latency / receiver's (same run)")
    a2.set_title("latency relative to the receiver alone")
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", nargs="*", type=Path, default=[])
    ap.add_argument(
        "--compare", nargs="*", type=Path, default=[],
        help="C2C runs of another fuser on the same items (paired comparison per set)",
    )  # fmt: skip
    ap.add_argument("--run", action="store_true", help="run `semcomm fusion eval` per set")
    ap.add_argument("--sets", default="arc_easy,commonsense_qa,piqa")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--methods", default="receiver,sharer,t2t,c2c")
    ap.add_argument("--fuser", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/fusion_real.json"))
    ap.add_argument("--png", type=Path, default=Path("benchmarks/results/fusion_real.png"))
    args = ap.parse_args()
    inputs = list(args.inputs)
    if args.run:
        for name in args.sets.split(","):
            out = args.json.with_name(f"{args.json.stem}_{name}_run.json")
            cmd = [
                sys.executable, "-m", "semcomm.cli", "fusion", "eval",
                "--data", str(DATA / f"{name}.jsonl"), "--limit", str(args.limit),
                "--methods", args.methods, "--threads", str(args.threads), "--json", str(out),
            ]  # fmt: skip
            if args.fuser is not None:
                cmd += ["--fuser", str(args.fuser)]
            console.print(" ".join(cmd))
            subprocess.run(cmd, check=True)
            inputs.append(out)
    if not inputs:
        ap.error("give --inputs or --run")
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in inputs]
    sets = merge(docs)
    compare(sets, [json.loads(p.read_text(encoding="utf-8")) for p in args.compare])
    table = Table(title="C2C on the real pair (accuracy, median latency)")
    for col in ("set", "n", *METHODS, "c2c-recv", "c2c-t2t", "c2c-sharer", "t2t/c2c lat"):
        table.add_column(col, justify="right" if col != "set" else "left")
    for name, e in sets.items():
        ms, g = e["methods"], e["goals"]

        def cell(m: str, ms: dict[str, Any] = ms) -> str:
            r = ms.get(m)
            return f"{r['accuracy']:.3f} / {r['latency_s']:.2f}s" if r else "-"

        def pts(k: str, g: dict[str, Any] = g) -> str:
            return f"{g[k]:+.1f}" if k in g else "-"

        n = max((r["n"] for r in ms.values()), default=0)
        table.add_row(
            name, str(n), *[cell(m) for m in METHODS],
            pts("c2c_minus_receiver_points"), pts("c2c_minus_t2t_points"),
            pts("c2c_minus_sharer_points"),
            f"{g['t2t_over_c2c_latency']:.2f}x" if "t2t_over_c2c_latency" in g else "-",
        )  # fmt: skip
    console.print(table)
    for name, e in sets.items():
        c = e.get("compare")
        if c:
            console.print(
                f"{name}: C2C {e['methods']['c2c']['accuracy']:.3f} vs compared fuser "
                f"{c['accuracy']:.3f} ({c['c2c_minus_compare_points']:+.1f} points; only this "
                f"one right {c['only_new_right']}, only the compared one {c['only_compare_right']}"
                f", sign test p={c['sign_test_p']:.2f})"
            )
    for name, e in sets.items():
        o = e["oracle"]
        if o:
            console.print(
                f"{name} oracle (receiver, {o['n']} questions, {o['context_examples']} solved "
                f"examples): question {o['accuracy_question']:.3f}, enriched (same length) "
                f"{o['accuracy_enriched']:.3f}, examples kept {o['accuracy_full_context']:.3f}"
            )
    print(markdown(sets))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "sets": sets,
                "inputs": [str(p) for p in inputs],
                "compare": [str(p) for p in args.compare],
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    plot(sets, args.png)
    console.print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
