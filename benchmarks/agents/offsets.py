"""KVCOMM's offsets on and off, side by side: reads pairs of ``benchmarks.agents.bench`` JSON
files (the same command with ``--offsets 0`` and ``--offsets 1``) and writes one summary JSON
and a PNG (final-answer agreement, judge agreement, solver answers identical to full
prefill's, reused share; one group of bars per setting).

Usage: ``python -m benchmarks.agents.offsets --pair LABEL OFF.json ON.json [--pair ...]
[--json benchmarks/results/agents_offsets.json] [--png benchmarks/results/agents_offsets.png]``.
``--quick``: runs ``benchmarks.agents.bench --quick`` with ``--offsets 0`` and ``1`` (the
reference receiver, seconds) and reports that pair.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.common import RESULTS, write_json

METRICS = ("agreement", "judge_agreement", "solvers_identical", "reused_share")


def summarize(path: Path) -> dict[str, Any]:
    """One bench file (one model, one set): the reuse pipeline's figures against full."""
    doc = json.loads(path.read_text())
    (model, sets), = doc["results"].items()
    (name, res), = sets.items()
    s = res["summary"]["reuse"]
    same = total = 0
    for row in res["rows"]:
        for f, r in zip(row["full"]["turns"], row["reuse"]["turns"]):
            if f["name"] != "judge":
                total += 1
                same += f["text"] == r["text"]
    full_ttft = res["summary"]["full"]["ttft_by_agent_s"]
    return {"model": model, "set": name, "n": s["n"], "args": {k: doc["args"][k] for k in (
        "watch", "judge_gate", "offsets", "selector", "recompute", "gate")},
            "agreement": s["agreement"], "judge_agreement": s["judge_agreement"],
            "solvers_identical": same / max(1, total), "reused_share": s["reused_share"],
            "repairs": s["repairs"], "warmups": s.get("warmups", 0),
            "offsets_applied": s.get("offsets_applied", 0),
            "accuracy": {"full": res["summary"]["full"]["accuracy"], "reuse": s["accuracy"]},
            "last_agent_ttft_ratio": full_ttft[-1] / s["ttft_by_agent_s"][-1]}


def plot(rows: dict[str, dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
    for ax, (label, pair) in zip(axes[0], rows.items()):
        xs = range(len(METRICS))
        for k, (key, colour) in enumerate((("off", "#999999"), ("on", "#1f77b4"))):
            ax.bar([x + (k - 0.5) * 0.38 for x in xs], [pair[key][m] for m in METRICS], 0.38,
                   label=f"offsets {key}", color=colour)
        ax.set_xticks(list(xs), ["final\nidentical", "judge\npick", "solvers\nidentical",
                                 "reused\nshare"], fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(label, fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", nargs=3, action="append", default=[],
                    metavar=("LABEL", "OFF", "ON"))
    ap.add_argument("--quick", action="store_true", help="a smoke run on the reference receiver")
    ap.add_argument("--json", type=Path, default=RESULTS / "agents_offsets.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "agents_offsets.png")
    a = ap.parse_args()
    if a.quick:
        files = [a.json.with_name(f"{a.json.stem}_quick_offsets{o}.json") for o in (0, 1)]
        for o, f in enumerate(files):
            subprocess.run([sys.executable, "-m", "benchmarks.agents.bench", "--quick",
                            "--offsets", str(o), "--json", str(f),
                            "--png", str(f.with_suffix(".png"))], check=True)
        a.pair.append(("quick", *files))
    if not a.pair:
        ap.error("give --pair LABEL OFF.json ON.json (or --quick)")
    rows = {label: {"off": summarize(Path(off)), "on": summarize(Path(on))}
            for label, off, on in a.pair}
    for label, pair in rows.items():
        print(label + ": " + ", ".join(
            f"{m} {pair['off'][m]:.2f} -> {pair['on'][m]:.2f}" for m in METRICS))
    write_json(a.json, rows, Console())
    plot(rows, a.png)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
