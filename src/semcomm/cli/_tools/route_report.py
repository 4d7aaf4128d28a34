"""Tables and charts for ``semcomm route`` (rich tables, matplotlib PNGs with the Agg backend):
simulation results and the model router's quality against cost."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.table import Table

from ...routing import RouterEval
from .route_sim import SimResult

__all__ = ["plot_cost_quality", "plot_ttft_cdf", "sim_table"]


def sim_table(results: Sequence[SimResult], title: str = "replica routing simulation") -> Table:
    """One row per result: hit rate, TTFT quantiles, queueing, imbalance, decision time."""
    t = Table(title=title)
    for col in (
        "policy", "replicas", "rate x", "requests", "hit rate", "TTFT p50 s", "TTFT p90 s",
        "TTFT p99 s", "queue p99 s", "load imb.", "decision p99 us", "CPU p99 us",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        t.add_row(
            r.policy, str(r.replicas), f"{r.rate_scale:g}", str(r.requests), f"{r.hit_rate:.3f}",
            f"{r.ttft_p50_s:.3f}", f"{r.ttft_p90_s:.3f}", f"{r.ttft_p99_s:.3f}",
            f"{r.queue_p99_s:.3f}", f"{r.load_imbalance:.2f}", f"{r.decision_p99_us:.0f}",
            f"{r.decision_cpu_p99_us:.0f}",
        )
    return t


def plot_ttft_cdf(results: Sequence[SimResult], path: str | Path, title: str = "TTFT CDF") -> Path:
    """TTFT cumulative distribution per policy (log x axis) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in results:
        v = np.sort(np.asarray(r.ttft_s, dtype=np.float64))
        v = v[np.isfinite(v)]
        if not len(v):
            continue
        ax.plot(np.maximum(v, 1e-3), np.arange(1, len(v) + 1) / len(v),
                label=f"{r.policy} (hit {r.hit_rate:.2f}, p99 {r.ttft_p99_s:.2f}s)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_cost_quality(ev: RouterEval, path: str | Path, title: str = "model router: quality vs cost") -> Path:
    """Quality against cost share for the router, the random-router line and each model alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    order = np.argsort(ev.cost_share, kind="stable")
    xs = np.asarray(ev.cost_share)[order]
    ys = np.asarray(ev.quality)[order]
    ax.plot(xs, ys, marker="o", ms=3, label=f"semcomm router (APGR {ev.apgr:.2f})")
    if ev.cheapest and ev.costliest:  # a random mix of the two anchors lies on this line
        lo, hi = ev.model_quality[ev.cheapest], ev.model_quality[ev.costliest]
        ax.plot([0, 1], [lo, hi], ls="--", color="grey", label="random mix of cheapest and costliest")
    for n, v in ev.model_quality.items():
        ax.axhline(v, ls=":", lw=1, color="black")
        ax.text(0.01, v, f" {n} alone", va="bottom", fontsize=8)
    ax.axhline(ev.oracle_quality, ls=":", lw=1, color="green")
    ax.text(0.01, ev.oracle_quality, " oracle", va="bottom", fontsize=8, color="green")
    ax.set_xlabel("cost share (0 = cheapest model always, 1 = costliest always)")
    ax.set_ylabel("quality (fraction answered well)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
