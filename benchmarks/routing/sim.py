"""Replica routing benchmark: hit rate, TTFT, capacity at a TTFT SLO, decision latency, scale.

Goals checked (ratios measured in this one run):

* hit ratio      default hit rate / affinity hit rate >= 0.95 on every trace
* hotspot p99    default p99 TTFT / least-loaded p99 TTFT <= 1.10 under a Zipf hotspot
* capacity       default capacity / round-robin capacity >= 2 (max rate scale with TTFT p90 <= SLO)
* decision p99   < 1 ms at 64 replicas (live ReplicaRouter, token ids -> chunk keys -> policy)
* scale          1000 replicas x 100k requests (``--scale``), wall time on one core

Usage::

    python -m benchmarks.routing.sim --trace /path/mooncake_trace.jsonl [--out DIR] [--scale]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.common import agg_figure
from semcomm.cli._tools.route_report import plot_ttft_cdf, sim_table
from semcomm.cli._tools.route_sim import SimConfig, capacity_at_slo, simulate
from semcomm.cli._tools.route_trace import (
    TraceRequest,
    load_trace,
    shared_prefix_workload,
    write_trace,
)
from semcomm.kv import Namespace
from semcomm.routing import ReplicaRouter
from semcomm.security import NO_TENANT_DIGEST

POLICIES = ["round-robin", "least-loaded", "affinity", "weighted", "gated", "two-choice", "default"]
console = Console(width=170)


def other_traces(out: Path) -> dict[str, Path]:
    """Synthetic traces in the Mooncake format (written to disk and read back like any trace)."""
    specs: dict[str, dict[str, Any]] = {
        # multi-turn chat: 160 system prompts, 4-turn conversations, mild skew
        "conversation": {"groups": 160, "prompts_per_group": 12, "system_len": 4096, "question_len": 512,
                         "output_len": 256, "turns": 4, "zipf_s": 0.6, "rate": 8.0, "seed": 11},
        # tool agent: 64 long tool preambles (16k tokens: 2048 blocks in all), skewed use
        "toolagent": {"groups": 64, "prompts_per_group": 60, "system_len": 16384, "question_len": 1024,
                      "output_len": 96, "turns": 1, "zipf_s": 1.0, "rate": 8.0, "seed": 12},
    }
    paths = {}
    for name, kw in specs.items():
        p = out / f"trace_{name}.jsonl"
        write_trace(shared_prefix_workload(**kw), p)
        paths[name] = p
    return paths


def hotspot_trace() -> list[TraceRequest]:
    """One group takes ~30% of the traffic (Zipf 1.2 over 32 groups), more than a replica can serve."""
    return shared_prefix_workload(groups=32, prompts_per_group=128, system_len=8192, question_len=1024,
                                  output_len=128, zipf_s=1.2, rate=60.0, seed=1)


def decision_latency(replicas: int = 64, requests: int = 3000, seed: int = 0) -> dict[str, dict[str, float]]:
    """Live router: full prompt token ids -> chunk keys -> index match -> policy, per call."""
    rng = np.random.default_rng(seed)
    ns = Namespace(model="bench", tokenizer="bench", dtype="bfloat16", codec="lossless", tenant=NO_TENANT_DIGEST)
    systems = [rng.integers(3, 32000, size=int(rng.integers(1024, 6144))).tolist() for _ in range(200)]
    out: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        router = ReplicaRouter(replicas, policy=policy, namespace=ns.digest, chunk_size=256,
                               capacity_chunks=2000, index="approximate")
        times = np.empty(requests)
        cpu = np.empty(requests)
        pending = []
        for i in range(requests):
            prompt = systems[int(rng.zipf(1.3)) % len(systems)] + rng.integers(3, 32000, size=256).tolist()
            t, c = time.perf_counter_ns(), time.thread_time_ns()
            d = router.route(prompt)
            cpu[i] = (time.thread_time_ns() - c) / 1000.0
            times[i] = (time.perf_counter_ns() - t) / 1000.0
            pending.append(d)
            if len(pending) > 4 * replicas:  # keep ~4 requests in flight per replica
                router.complete(pending.pop(0))
        out[policy] = {"p50_us": float(np.percentile(times, 50)), "p99_us": float(np.percentile(times, 99)),
                       "cpu_p50_us": float(np.percentile(cpu, 50)), "cpu_p99_us": float(np.percentile(cpu, 99)),
                       "prompt_tokens_mean": float(np.mean([len(s) + 256 for s in systems]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=Path("../shared/data/traces/mooncake_synthetic_trace.jsonl"),
                    help="Mooncake-format JSONL trace")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT p90 SLO (s) for the capacity search")
    ap.add_argument("--scale", action="store_true", help="also run 1000 replicas x 100k requests")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 300 Mooncake requests, no synthetic traces, short searches")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"replicas": args.replicas, "slo_ttft_p90_s": args.slo}

    traces: dict[str, list[TraceRequest]] = {"mooncake": load_trace(args.trace)}
    if args.quick:
        traces["mooncake"] = traces["mooncake"][:300]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for name, path in other_traces(Path(tmp)).items():
                traces[name] = load_trace(path)

    # 1. hit rate and TTFT per policy, per trace, at rate x1 and x3
    hit_rows = []
    report["traces"] = {}
    for tname, trace in traces.items():
        report["traces"][tname] = {}
        for scale in (1.0, 3.0):
            results = [simulate(trace, SimConfig(replicas=args.replicas, policy=p, rate_scale=scale))
                       for p in POLICIES]
            console.print(sim_table(results, title=f"{tname} ({len(trace)} requests), rate x{scale:g}"))
            by = {r.policy: r for r in results}
            ratio = by["default"].hit_rate / max(by["affinity"].hit_rate, 1e-9)
            hit_rows.append((tname, scale, by["affinity"].hit_rate, by["default"].hit_rate, ratio))
            report["traces"][tname][f"x{scale:g}"] = {p: r.to_json() for p, r in by.items()}
            if tname == "mooncake" and scale == 3.0:
                plot_ttft_cdf(results, args.out / "routing_sim_cdf_mooncake.png", title="Mooncake trace, rate x3")

    # 2. hotspot: default vs least-loaded p99
    hot = hotspot_trace()[:400] if args.quick else hotspot_trace()
    hot_res = [simulate(hot, SimConfig(replicas=args.replicas, policy=p)) for p in POLICIES]
    console.print(sim_table(hot_res, title="hotspot (Zipf 1.2, 32 groups, 60 req/s)"))
    plot_ttft_cdf(hot_res, args.out / "routing_sim_cdf_hotspot.png", title="hotspot workload")
    hb = {r.policy: r for r in hot_res}
    report["hotspot"] = {p: r.to_json() for p, r in hb.items()}
    hot_ratio = hb["default"].ttft_p99_s / hb["least-loaded"].ttft_p99_s

    # 3. capacity at the TTFT SLO
    cap: dict[str, dict[str, float]] = {}
    cap_policies = ("round-robin", "default") if args.quick else (
        "round-robin", "least-loaded", "affinity", "two-choice", "default")
    for tname in traces:
        cap[tname] = {}
        for p in cap_policies:
            c, _ = capacity_at_slo(traces[tname], SimConfig(replicas=args.replicas, policy=p),
                                   slo_ttft_s=args.slo, iterations=2 if args.quick else 5)
            cap[tname][p] = c
    report["capacity_rate_scale"] = cap

    # 4. decision latency at 64 replicas
    lat = decision_latency(requests=300 if args.quick else 3000)
    report["decision_latency_64"] = lat

    # 5. scale
    if args.scale:
        big = shared_prefix_workload(groups=2000, prompts_per_group=50, system_len=4096, question_len=512,
                                     output_len=64, zipf_s=0.8, rate=2000.0, seed=0)
        t = time.perf_counter()
        res = simulate(big, SimConfig(replicas=1000, policy="default", capacity_blocks=200))
        report["scale"] = {"replicas": 1000, "requests": len(big), "wall_s": time.perf_counter() - t,
                           "hit_rate": res.hit_rate, "ttft_p99_s": res.ttft_p99_s, "completed": res.completed}

    # summary
    t = Table(title="routing goals")
    t.add_column("goal")
    t.add_column("measured", justify="right")
    t.add_column("target", justify="right")
    t.add_column("met")
    goals = []
    for tname, scale, a, d, ratio in hit_rows:
        goals.append((f"hit rate default/affinity, {tname} x{scale:g} ({d:.3f}/{a:.3f})", ratio, ">= 0.95", ratio >= 0.95))
    hot_name = f"hotspot p99 TTFT default/least-loaded ({hb['default'].ttft_p99_s:.2f}s/" \
        f"{hb['least-loaded'].ttft_p99_s:.2f}s)"
    goals.append((hot_name, hot_ratio, "<= 1.10", hot_ratio <= 1.10))
    for tname, caps in cap.items():
        r = caps["default"] / max(caps["round-robin"], 1e-9)
        goals.append((f"capacity default/round-robin, {tname} (x{caps['default']:.2f}/x{caps['round-robin']:.2f})",
                      r, ">= 2", r >= 2.0))
    # CPU time of the deciding thread: on a shared host, wall-clock p99 measures the scheduler's
    # time slices (other processes preempting this one), not the router; both are reported.
    p99 = lat["default"]["cpu_p99_us"]
    goals.append(("decision p99 at 64 replicas, default, thread CPU time (us)", p99, "< 1000", p99 < 1000))
    goals.append(("decision p99 at 64 replicas, default, wall clock (us)", lat["default"]["p99_us"], "< 1000",
                  lat["default"]["p99_us"] < 1000))
    if "scale" in report:
        goals.append(("1000 replicas x 100k requests, wall s", report["scale"]["wall_s"], "few minutes",
                      report["scale"]["wall_s"] < 300))
    for g, v, target, ok in goals:
        t.add_row(g, f"{v:.3f}", target, "yes" if ok else "NO")
    console.print(t)
    lt = Table(title="decision latency, 64 replicas")
    lt.add_column("policy")
    for col in ("wall p50 us", "wall p99 us", "CPU p50 us", "CPU p99 us"):
        lt.add_column(col, justify="right")
    for p, v in lat.items():
        lt.add_row(p, f"{v['p50_us']:.0f}", f"{v['p99_us']:.0f}", f"{v['cpu_p50_us']:.0f}", f"{v['cpu_p99_us']:.0f}")
    console.print(lt)
    report["goals"] = [{"goal": g, "value": v, "target": tg, "met": ok} for g, v, tg, ok in goals]
    _plot_capacity(cap, args.out / "routing_sim.png", args.slo)
    (args.out / "routing_sim.json").write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.out / 'routing_sim.json'} and PNGs in {args.out}")


def _plot_capacity(cap: dict[str, dict[str, float]], path: Path, slo: float) -> None:
    with agg_figure(path, (7, 4)) as ax:
        names = list(cap)
        pols = list(next(iter(cap.values())))
        w = 0.8 / len(pols)
        for j, p in enumerate(pols):
            ax.bar([i + j * w for i in range(len(names))], [cap[n][p] for n in names], w, label=p)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))], names)
        ax.set_ylabel(f"max rate scale with TTFT p90 <= {slo:g}s")
        ax.set_title("capacity at TTFT SLO")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
