"""Side by side: several ``benchmarks.vllm.check`` reports (``vllm_check.json`` files), e.g. the same
check with the connector's streamed reads on and off.

For each report: the contract's figures (second process through semcomm against vLLM's own
prefix-cache hit and against cold, first sample and medians) and, from the connector's timing
log, how long the second process's loads held the forward: the time spent in ``start_load_kv``
before the forward starts (``load_ms``) plus the forward's waits for layers the copy thread had
not written yet (``layer_wait_ms``), for the first load of the fresh process and as the median
of its repeats. Prints a table, writes JSON and a PNG.

    python -m benchmarks.vllm.compare off=/tmp/ab_streamed0.json on=/tmp/ab_streamed1.json \\
        --json benchmarks/results/vllm_streamed_ab.json --png benchmarks/results/vllm_streamed_ab.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def held_ms(t: dict[str, Any] | None) -> float | None:
    """Milliseconds a load held the forward: before it (``load_ms``) and inside it (waits)."""
    if not t or "load_ms" not in t:
        return None
    return float(t["load_ms"]) + float(t.get("layer_wait_ms", 0.0))


def summary(label: str, r: dict[str, Any]) -> dict[str, Any]:
    warm = r.get("warm_timelines") or []
    held = [held_ms(t) for t in warm]
    repeats = [h for h in held[1:] if h is not None]
    first = warm[0] if warm else {}
    return {
        "label": label,
        "connector_env": r.get("connector_env", {}),
        "cold_ttft_s": r["cold_ttft_s"], "apc_ttft_s": r["apc_ttft_s"],
        "warm_ttft_s": r["warm_ttft_s"],
        "warm_over_apc": r["warm_over_apc"], "cold_over_warm": r["cold_over_warm"],
        "warm_over_apc_median": r["warm_over_apc_median"],
        "warm_over_apc_local_median": r.get("warm_over_apc_local_median"),
        "same_text": r["same_text"], "hit_tokens": r["hit_tokens"],
        "first_load_held_ms": held[0] if held else None,
        "first_load_ms": first.get("load_ms"), "first_layer_wait_ms": first.get("layer_wait_ms"),
        "first_layer_thread_ms": first.get("layer_copy_ms"),
        "repeat_held_ms_median": statistics.median(repeats) if repeats else None,
        "warm_forward_ms_median": r.get("timeline_medians_ms", {}).get("warm", {}).get(
            "forward_ms"),
        "warm_chunk_age_s": r.get("warm_chunk_age_s"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="*", help="LABEL=PATH of a benchmarks.vllm.check JSON report")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the committed benchmarks/results/vllm_check.json, twice")
    args = ap.parse_args(argv)
    if args.quick and not args.reports:
        committed = Path(__file__).resolve().parents[1] / "results" / "vllm_check.json"
        args.reports = [f"a={committed}", f"b={committed}"]
    if not args.reports:
        ap.error("give at least one LABEL=PATH report")
    rows = []
    for item in args.reports:
        label, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"expected LABEL=PATH, got {item!r}")
        rows.append(summary(label, json.loads(Path(path).read_text())))

    from rich.console import Console
    from rich.table import Table

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    t = Table(title="bench_vllm reports side by side (ms: time a load held the forward)")
    for col in ("run", "cold/semcomm", "semcomm/APC first", "medians", "same process",
                "held first (before + waits)", "held repeats (median)", "forward (median)",
                "same text"):
        t.add_column(col)
    for s in rows:
        t.add_row(s["label"], f(s["cold_over_warm"], ".1f") + "x",
                  f(s["warm_over_apc"], ".2f") + "x", f(s["warm_over_apc_median"], ".2f") + "x",
                  f(s["warm_over_apc_local_median"], ".2f") + "x",
                  f"{f(s['first_load_held_ms'], '.1f')} ({f(s['first_load_ms'], '.1f')} + "
                  f"{f(s['first_layer_wait_ms'], '.1f')})",
                  f(s["repeat_held_ms_median"], ".1f"), f(s["warm_forward_ms_median"], ".0f"),
                  str(s["same_text"]))
    Console(width=160).print(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [s["label"] for s in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [s["first_load_held_ms"] or 0 for s in rows], 0.4,
               label="first load of the fresh process")
        ax.bar([i + 0.2 for i in x], [s["repeat_held_ms_median"] or 0 for s in rows], 0.4,
               label="repeats (median)")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("ms the load held the forward")
        ax.set_title("vLLM second process: load time before and inside the forward")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
