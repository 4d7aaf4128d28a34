"""CLI: `semcomm reference` (build, eval, world)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

__all__ = ["register"]

reference_app = typer.Typer(
    help="The synthetic reference world and the two reference tiny models.",
    no_args_is_help=True,
)


@reference_app.command("build")
def build(
    seed: Annotated[int, typer.Option(help="World seed.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the package's "
                                                     "assets folder).")] = None,
    steps: Annotated[int | None, typer.Option(help="Override training steps (both models).")]
    = None,
    sequential: Annotated[bool, typer.Option(help="Train one model after the other with two "
                                                  "threads instead of both at once.")] = False,
    eval_limit: Annotated[int | None, typer.Option(help="Evaluate on at most N questions per "
                                                      "split (quick check builds).", min=1)]
    = None,
) -> None:
    """Regenerate the world and retrain both reference models (CPU, seeded)."""
    from semcomm.reference import ASSETS_DIR, build_all

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = out or ASSETS_DIR
    evals = build_all(target, seed=seed, steps=steps, parallel=not sequential,
                      eval_limit=eval_limit)
    _print_eval(evals)
    Console().print(f"models written to {target}")


@reference_app.command("eval")
def evaluate(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as "
                                                      "JSON to this file.")] = None,
    limit: Annotated[int | None, typer.Option(help="At most N questions per split (and 2N "
                                                      "held-out sentences).", min=1)] = None,
    models_dir: Annotated[Path | None, typer.Option(help="Folder holding sharer/ and "
                                                       "receiver/ (default: shipped).")] = None,
    seed: Annotated[int, typer.Option(help="World seed the models were built on.")] = 0,
) -> None:
    """Perplexity (held-out templates) and multiple-choice accuracy on seen/unseen facts."""
    import torch

    from semcomm.errors import ConfigError
    from semcomm.reference import assets_dir, evaluate_model, load_model
    from semcomm.reference.world import build_world

    torch.set_num_threads(1)
    base = models_dir or assets_dir()
    world = build_world(seed)
    results: dict[str, dict[str, float | int]] = {}
    for name in ("sharer", "receiver"):
        path = base / name
        if not (path / "config.json").is_file():
            raise ConfigError(f"no reference model at {path}; run `semcomm reference build`")
        model, tok = load_model(path)
        results[name] = evaluate_model(model, tok, world, limit=limit).summary()
    _print_eval(results)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


@reference_app.command("world")
def world(
    out: Annotated[Path, typer.Argument(help="Folder for the JSONL files.")],
    seed: Annotated[int, typer.Option(help="World seed.")] = 0,
) -> None:
    """Export the world (entities, facts, QA, multiple choice, ...) as JSONL files."""
    from semcomm.reference.world import build_world

    w = build_world(seed)
    paths = w.export_jsonl(out)
    Console().print(f"{len(paths)} files in {out} (world digest {w.digest()[:16]})")


def _print_eval(results: dict[str, dict[str, float | int]]) -> None:
    table = Table(title="reference models")
    cols = ["perplexity", "accuracy_seen", "accuracy_unseen", "letter_accuracy_seen",
            "letter_accuracy_unseen"]
    table.add_column("model")
    for c in cols:
        table.add_column(c.replace("_", " "), justify="right")
    for name, r in results.items():
        table.add_row(name, *(f"{float(r[c]):.3f}" for c in cols))
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Attach the `reference` command group to the main app."""
    app.add_typer(reference_app, name="reference")
