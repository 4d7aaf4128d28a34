"""KV-headroom routing at scale, in the simulator: token-aware balancing against blind routing.

Each simulated replica holds at most ``--kv-tokens`` of live KV (prompt plus output of every
request from its prefill to its last token); a request starts only when its KV fits and waits
at its replica otherwise (``semcomm.cli._tools.route_sim``, ``SimConfig.kv_tokens``). The same
trace is replayed with the router told each replica's headroom (``kv_aware``, what the server's
replica router does with ``LocalBackend.kv_headroom``) and without, for the default and
least-loaded policies, at several arrival-rate scales. Reported: TTFT p50/p99, how many requests
waited for KV and their p99 wait, the prefix hit rate, the peak live KV per replica.

Usage: ``python -m benchmarks.routing.memory [--trace FILE] [--replicas 16] [--kv-tokens N]
[--scales 1,2,3] [--json F] [--png F]``. The default trace is the Mooncake-format synthetic trace
in ``../shared/data/traces``; the figures in docs/BENCHMARKS.md come from one run of the
defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.common import agg_figure
from semcomm.cli._tools.route_sim import SimConfig, simulate
from semcomm.cli._tools.route_trace import load_trace

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
console = Console(width=None if sys.stdout.isatty() else 150)


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(args.trace)[:300] if args.quick else load_trace(args.trace)
    rows: list[dict[str, Any]] = []
    cases = [(s, p, aware) for s in args.scales for p in ("default", "least-loaded")
             for aware in (True, False)]
    for scale, policy, aware in track(cases, description="simulations", console=console):
        res = simulate(trace, SimConfig(replicas=args.replicas, policy=policy, rate_scale=scale,
                                        kv_tokens=args.kv_tokens, kv_aware=aware))
        assert res.completed == res.requests
        rows.append({"rate_scale": scale, "policy": policy, "kv_aware": aware,
                     **res.to_json()})
    return {"trace": str(args.trace), "requests": len(trace), "replicas": args.replicas,
            "kv_tokens": args.kv_tokens, "rows": rows}


def show(rep: dict[str, Any]) -> None:
    t = Table(title=f"KV-headroom routing: {rep['requests']} requests, {rep['replicas']} replicas, "
                    f"{rep['kv_tokens']:,} tokens of live KV each")
    for c in ("rate x", "policy", "headroom known", "TTFT p50 s", "TTFT p99 s",
              "waited for KV", "KV wait p99 s", "hit rate", "peak KV"):
        t.add_column(c, justify="right")
    for r in rep["rows"]:
        t.add_row(f"{r['rate_scale']:g}", r["policy"], "yes" if r["kv_aware"] else "no",
                  f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}", str(r["memory_waits"]),
                  f"{r['memory_wait_p99_s']:.2f}", f"{r['hit_rate']:.3f}",
                  f"{r['kv_peak_fraction']:.2f}")
    console.print(t)


def chart(rep: dict[str, Any], path: Path) -> None:
    with agg_figure(path, (8, 4.5)) as ax:
        for policy, marker in (("default", "o"), ("least-loaded", "s")):
            for aware, style in ((True, "-"), (False, "--")):
                pts = [(r["rate_scale"], r["ttft_p99_s"]) for r in rep["rows"]
                       if r["policy"] == policy and r["kv_aware"] is aware]
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, marker=marker,
                        label=f"{policy}, headroom {'known' if aware else 'unknown'}")
        ax.set_yscale("log")
        ax.set_xlabel("arrival-rate scale")
        ax.set_ylabel("TTFT p99 (s, log)")
        ax.set_title(f"{rep['replicas']} replicas, {rep['kv_tokens']:,} tokens of KV each")
        ax.legend()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=65_536,
                   help="live KV per replica in tokens (the trace's prompts average 15k)")
    p.add_argument("--scales", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.0, 2.0, 3.0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: the first 300 requests at rate x1 and x2")
    p.add_argument("--json", type=Path, default=RESULTS / "routing_memory.json")
    p.add_argument("--png", type=Path, default=RESULTS / "routing_memory.png")
    args = p.parse_args(argv)
    if args.quick:
        args.scales = [1.0, 2.0]
    rep = run(args)
    show(rep)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rep, indent=1))
    chart(rep, args.png)
    console.print(f"wrote {args.json} and {args.png}")
    by = {(r["rate_scale"], r["policy"], r["kv_aware"]): r for r in rep["rows"]}
    for s in args.scales:
        a, b = by[(s, "default", True)], by[(s, "default", False)]
        console.print(f"rate x{s:g}, default policy: TTFT p99 blind / aware "
                      f"{b['ttft_p99_s'] / max(a['ttft_p99_s'], 1e-9):.2f}x; waited for KV "
                      f"{a['memory_waits']} aware against {b['memory_waits']} blind")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
