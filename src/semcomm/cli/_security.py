"""CLI: `semcomm security` (attack harness, salt digests, key checks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["register"]

security_app = typer.Typer(
    name="security",
    help="Tenant isolation and side-channel checks: the prefix-probing attack harness, salt digests.",
    no_args_is_help=True,
)


@security_app.command("probe")
def probe(
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="Write the report as JSON to this file.")] = None,
    trials: Annotated[int, typer.Option(
        min=2, help="Victim prompts attacked per configuration.")] = 8,
    candidates: Annotated[int, typer.Option(
        min=2, max=8, help="Candidate secrets per prompt (K; chance = 1/K).")] = 8,
    workload: Annotated[int, typer.Option(
        min=1, help="Benign requests per user per configuration (throughput figure).")] = 12,
    per_defense: Annotated[bool, typer.Option(
        "--per-defense/--no-per-defense",
        help="Also attack with salts alone, no probe detection (on with --full).")] = False,
    full: Annotated[bool, typer.Option(
        "--full", help="Longer configuration: 40 trials (several minutes).")] = False,
    seed: Annotated[int, typer.Option(
        help="Seed of the victim's secrets and the attacker's order.")] = 0,
) -> None:
    """Run the prefix-probing timing attack against a live `semcomm serve` it starts itself.

    The attacker tenant guesses the victim's secret from the time to first token of its probes,
    once with defenses off (shared cache, no salts, no probe detection) and once with them on
    (server-derived per-tenant salts + probe detection). Reports each success rate, chance, and
    the benign throughput of both configurations.
    """
    from ._tools.probe_harness import CANDIDATES, ProbeHarnessConfig, run_probe_harness

    console = Console()
    per_defense = per_defense or full
    cfg = ProbeHarnessConfig(candidates=CANDIDATES[:candidates], trials=40 if full else trials,
                             workload_requests=workload, per_defense=per_defense, seed=seed)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting the server", total=(3 if per_defense else 2) * cfg.trials)
        done = {"n": 0}

        def progress(stage: str, i: int, n: int) -> None:
            done["n"] += 1
            bar.update(task, completed=done["n"], description=f"{stage} trial {i}/{n}")

        report = run_probe_harness(cfg, progress=progress)
    table = Table(title="prefix-probing timing attack (TTFT oracle)")
    table.add_column("configuration")
    table.add_column("attacker success", justify="right")
    table.add_column("chance", justify="right")
    table.add_column("own hit / miss ms", justify="right")
    table.add_column("probe right / wrong ms", justify="right")
    table.add_column("throttled", justify="right")
    table.add_column("benign req/s", justify="right")
    rows = [(mode, m["attack"], f"{m['throughput_rps']:.1f}") for mode, m in report["modes"].items()]
    rows += [(mode, a, "-") for mode, a in report["attacks_per_defense"].items()]
    for mode, a, rps in rows:
        table.add_row(
            mode.replace("_", " "), f"{a['success']:.2f}", f"{report['chance']:.3f}",
            f"{a['calib_hit_ms']:.1f} / {a['calib_miss_ms']:.1f}",
            f"{a['probe_correct_ms']:.1f} / {a['probe_wrong_ms']:.1f}",
            f"{a['probes_throttled']}/{a['probes_sent']}", rps,
        )
    console.print(table)
    console.print(
        f"success off {report['success_defenses_off']:.2f}, on {report['success_defenses_on']:.2f}, "
        f"chance {report['chance']:.3f}; throughput cost of the defenses "
        f"{100 * report['throughput_cost']:.1f}% ({report['elapsed_s']:.0f}s)"
    )
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
        console.print(f"wrote {json_out}")


@security_app.command("salt-digest")
def salt_digest(
    tenant: Annotated[str, typer.Argument(help="Tenant id as configured on the server.")],
) -> None:
    """Print the salt digest of a tenant under this machine's server secret (never the salt)."""
    from ..security import TenantSalter

    typer.echo(TenantSalter().digest(tenant))


def register(app: typer.Typer) -> None:
    """Attach the `security` command group to the main app."""
    app.add_typer(security_app, name="security")
