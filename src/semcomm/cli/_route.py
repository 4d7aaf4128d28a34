"""CLI: `semcomm route` (simulate replica routing, synthesize traces, train and evaluate model routers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

route_app = typer.Typer(
    help="Model and replica routing: simulate policies on traces, train and evaluate model routers.",
    no_args_is_help=True,
)


@route_app.command("simulate")
def simulate_cmd(
    trace: Annotated[Path, typer.Option("--trace", help="Mooncake-format JSONL trace to replay.")],
    replicas: Annotated[int, typer.Option("--replicas", help="Number of replicas.")] = 8,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="Replica policy: round-robin, least-loaded, affinity, weighted, gated, two-choice, "
            "default. Several, comma-separated, compare them (JSON then holds 'results').",
        ),
    ] = "default",
    rate_scale: Annotated[float, typer.Option("--rate-scale", help="Multiply the arrival rate by X.")] = 1.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Write a TTFT CDF chart here.")] = None,
    index: Annotated[
        str, typer.Option("--index", help="Prefix index source: precise (store events) or approximate.")
    ] = "precise",
    capacity_blocks: Annotated[
        int, typer.Option("--capacity-blocks", help="KV capacity per replica in trace blocks.")
    ] = 1000,
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per trace block.")] = 512,
    slo: Annotated[float, typer.Option("--slo", help="TTFT SLO in seconds.")] = 2.0,
    capacity: Annotated[
        bool,
        typer.Option("--capacity", help="Also search the max rate scale whose TTFT p90 meets the SLO."),
    ] = False,
    calibration: Annotated[
        Path | None, typer.Option("--calibration", help="Cost-model calibration JSON (engine benchmarks).")
    ] = None,
) -> None:
    """Replay a trace through simulated replicas and report hit rate, TTFT, queueing, imbalance."""
    from ..routing import CostModel, make_policy
    from ._tools.route_report import plot_ttft_cdf, sim_table
    from ._tools.route_sim import SimConfig, capacity_at_slo, simulate
    from ._tools.route_trace import load_trace

    console = Console()
    names = [p.strip() for p in policy.split(",") if p.strip()]
    for name in names:
        make_policy(name)  # unknown names fail before any work
    requests = load_trace(trace, block_size=block_size)
    cost = CostModel.from_json(calibration) if calibration else CostModel()
    results = []
    payloads = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as prog:
        for name in names:
            task = prog.add_task(f"simulating {name}", total=len(requests))
            cfg = SimConfig(
                replicas=replicas, policy=name, index=index, capacity_blocks=capacity_blocks,
                block_size=block_size, rate_scale=rate_scale, slo_ttft_s=slo, cost=cost,
            )
            def _advance(n: int, t: TaskID = task) -> None:
                prog.update(t, completed=n)

            res = simulate(requests, cfg, progress=_advance)
            prog.update(task, completed=len(requests))
            payload = res.to_json()
            payload["index"] = index
            payload["trace"] = str(trace)
            if capacity:
                prog.update(task, description=f"capacity search {name}")
                cap, probes = capacity_at_slo(requests, cfg, slo_ttft_s=slo)
                payload["capacity_rate_scale"] = cap
                payload["capacity_probes"] = probes
                payload["slo_ttft_s"] = slo
            results.append(res)
            payloads.append(payload)
    console.print(sim_table(results, title=f"{trace.name}: {replicas} replicas, rate x{rate_scale:g}"))
    if capacity:
        for p in payloads:
            console.print(f"{p['policy']}: capacity at TTFT p90 <= {slo:g}s: rate x{p['capacity_rate_scale']:.2f}")
    if json_out is not None:
        doc = payloads[0] if len(payloads) == 1 else {"results": payloads}
        json_out.write_text(json.dumps(doc, indent=2), encoding="utf-8")
        console.print(f"wrote {json_out}")
    if png is not None:
        plot_ttft_cdf(results, png, title=f"TTFT CDF: {trace.name}")
        console.print(f"wrote {png}")


@route_app.command("synth")
def synth_cmd(
    out: Annotated[Path, typer.Option("--out", help="Mooncake-format JSONL file to write.")],
    groups: Annotated[int, typer.Option(help="Shared system prompts (groups).")] = 32,
    prompts_per_group: Annotated[int, typer.Option(help="Conversations per group.")] = 64,
    system_len: Annotated[int, typer.Option(help="System prompt tokens.")] = 8192,
    question_len: Annotated[int, typer.Option(help="Question tokens per turn.")] = 1024,
    output_len: Annotated[int, typer.Option(help="Answer tokens per turn.")] = 128,
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = 1,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of group popularity (0 = uniform).")] = 0.0,
    rate: Annotated[float, typer.Option(help="Poisson arrival rate, requests/s.")] = 8.0,
    num_requests: Annotated[int | None, typer.Option(help="Requests (default: every conversation turn once).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Write a synthetic shared-prefix workload (groups x prompts, Zipf skew, multi-turn) as a trace."""
    from ._tools.route_trace import shared_prefix_workload, write_trace

    reqs = shared_prefix_workload(
        groups=groups, prompts_per_group=prompts_per_group, system_len=system_len,
        question_len=question_len, output_len=output_len, turns=turns, zipf_s=zipf, rate=rate,
        num_requests=num_requests, seed=seed,
    )
    write_trace(reqs, out)
    Console().print(f"wrote {len(reqs)} requests to {out}")


def _parse_costs(costs: list[str], names: list[str]) -> dict[str, float]:
    from ..errors import ConfigError

    out: dict[str, float] = {}
    for item in costs:
        name, sep, val = item.partition("=")
        try:
            out[name.strip()] = float(val)
        except ValueError:
            raise ConfigError(f"--cost must look like MODEL=NUMBER, got {item!r}") from None
        if not sep:
            raise ConfigError(f"--cost must look like MODEL=NUMBER, got {item!r}")
    missing = [n for n in names if n not in out]
    if missing:
        # reference data: the sharer (trained on every fact) is the strong, costlier model
        defaults = {"receiver": 1.0, "sharer": 2.0}
        if all(n in defaults for n in missing):
            out.update({n: defaults[n] for n in missing})
        else:
            raise ConfigError(f"no --cost given for model(s) {missing}; pass --cost NAME=COST for each")
    return {n: out[n] for n in names}


@route_app.command("train")
def train_cmd(
    out: Annotated[Path, typer.Option("--out", help="Where to write the trained router (JSON).")],
    data: Annotated[
        Path | None,
        typer.Option("--data", help="Labelled JSONL (text + '<model>_correct' fields). Default: the "
                     "reference world's router labels."),
    ] = None,
    cost: Annotated[
        list[str] | None, typer.Option("--cost", help="MODEL=COST, relative cost per request (repeat).")
    ] = None,
    budget: Annotated[float, typer.Option("--budget", help="Cost share to calibrate to (0..1).")] = 0.5,
    text_field: Annotated[str, typer.Option("--text-field", help="JSON field holding the prompt.")] = "question",
    part: Annotated[str, typer.Option("--part", help="Rows to train on: train, test or all.")] = "train",
    embedder: Annotated[
        str | None, typer.Option("--embedder", help="Sentence-transformers model path (default MiniLM).")
    ] = None,
) -> None:
    """Train a model router (quality predictor on local embeddings) and calibrate it to a budget."""
    from ..routing import ModelRouter, ModelSpec, load_labelled

    console = Console()
    ds = load_labelled(data, text_field=text_field, part=part)
    costs = _parse_costs(cost or [], ds.models)
    router = ModelRouter([ModelSpec(n, costs[n]) for n in ds.models], embedder=embedder)
    with console.status(f"embedding {len(ds.prompts)} prompts and training"):
        router.fit(ds.prompts, ds.correct, budget=budget)
    router.save(out)
    console.print(
        f"trained on {len(ds.prompts)} prompts ({ds.meta['source']}, part {part}); models "
        f"{', '.join(f'{m.name} (cost {m.cost:g})' for m in router.models)}; lambda {router.cost_weight:.4f} "
        f"for cost share {budget:g}; wrote {out}"
    )


@route_app.command("eval")
def eval_cmd(
    router_path: Annotated[Path, typer.Option("--router", help="Trained router JSON (from `route train`).")],
    data: Annotated[
        Path | None, typer.Option("--data", help="Labelled JSONL. Default: the reference router labels.")
    ] = None,
    part: Annotated[str, typer.Option("--part", help="Rows to evaluate: train, test or all.")] = "test",
    text_field: Annotated[str, typer.Option("--text-field", help="JSON field holding the prompt.")] = "question",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the evaluation as JSON.")] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Write the cost/quality curve PNG.")] = None,
    embedder: Annotated[
        str | None, typer.Option("--embedder", help="Sentence-transformers model path (default MiniLM).")
    ] = None,
) -> None:
    """Evaluate a model router: quality vs cost share, PGR, APGR, CPT(50%/80%), curve PNG."""
    from rich.table import Table

    from ..errors import InvalidInputError
    from ..routing import ModelRouter, load_labelled
    from ._tools.route_report import plot_cost_quality

    console = Console()
    router = ModelRouter.load(router_path, embedder=embedder)
    names = [m.name for m in router.models]
    ds = load_labelled(data, models=names, text_field=text_field, part=part)
    if ds.models != names:
        raise InvalidInputError(f"data models {ds.models} differ from the router's {names}")
    with console.status(f"evaluating on {len(ds.prompts)} prompts"):
        ev = router.evaluate(ds.prompts, ds.correct)
    t = Table(title=f"model router on {ds.meta['source']} ({part}, {ev.n} prompts)")
    for col in ("cost share", "quality", "PGR"):
        t.add_column(col, justify="right")
    for s, q, g in zip(ev.cost_share, ev.quality, ev.pgr, strict=True):
        t.add_row(f"{s:.3f}", f"{q:.3f}", f"{g:.3f}")
    console.print(t)
    alone = ", ".join(f"{k} {v:.3f}" for k, v in ev.model_quality.items())
    console.print(f"APGR {ev.apgr:.3f} (random 0.5); CPT50 {ev.cpt['cpt50']:.3f}, CPT80 {ev.cpt['cpt80']:.3f}; "
                  f"alone: {alone}; oracle {ev.oracle_quality:.3f}")
    if json_out is not None:
        json_out.write_text(json.dumps(ev.to_json(), indent=2), encoding="utf-8")
        console.print(f"wrote {json_out}")
    if png is not None:
        plot_cost_quality(ev, png)
        console.print(f"wrote {png}")


def register(app: typer.Typer) -> None:
    """Attach the `route` command group to the main app."""
    app.add_typer(route_app, name="route")
