"""CLI: `semcomm fusion` (train, eval, data, info)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

fusion_app = typer.Typer(
    help="Cache-to-cache fusion: train a fuser for a (sharer, receiver) pair and evaluate it.",
    no_args_is_help=True,
)

console = Console()


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


@fusion_app.command("train")
def train(
    sharer: Path = typer.Option(..., help="Sharer model folder (config.json, weights, tokenizer)."),
    receiver: Path = typer.Option(..., help="Receiver model folder."),
    data: Path = typer.Option(..., help="JSONL training data: {'shared': ..., 'answer': ...} per line."),
    out: Path = typer.Option(..., help="Output folder for fuser.safetensors + fuser.json checkpoints."),
    steps: int = typer.Option(300, help="Optimizer steps."),
    batch_size: int = typer.Option(8, help="Examples per step."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW, warmup then cosine)."),
    seed: int = typer.Option(0, help="Random seed (batches, init, gate noise)."),
    hidden: int = typer.Option(256, help="Fuser hidden size."),
    blocks: int = typer.Option(2, help="Residual MLP blocks per branch."),
    dropout: float = typer.Option(0.1, help="Dropout inside the fuser MLP."),
    mapping: str = typer.Option("last_aligned", help="Layer mapping: last_aligned, uniform, first_aligned or a comma list."),
    reduce: str = typer.Option("mean", help="Alignment reduction over sharer tokens: mean or last."),
    checkpoint_every: int = typer.Option(100, help="Write a checkpoint every N steps (0: only at the end)."),
    resume: bool = typer.Option(False, help="Continue from the checkpoint in --out."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    no_special_tokens: bool = typer.Option(False, help="Do not add BOS/special tokens to prompts."),
    answer_mode: str = typer.Option("loglik", help="How `fusion eval` should score with this fuser: loglik or letter."),
    threads: int = typer.Option(0, help="CPU threads for torch (0: torch's default; 1 is fastest for tiny models on busy cores)."),
) -> None:
    """Train a fuser with both models frozen (receiver next-token loss on answer tokens)."""
    import torch

    from ..fusion import FusionTrainer, TrainConfig, read_examples
    from ..fusion._reference import load_side

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    mp: Any = [int(x) for x in mapping.split(",")] if "," in mapping or mapping.isdigit() else mapping
    s_side = load_side(sharer, add_special_tokens=not no_special_tokens)
    r_side = load_side(receiver, add_special_tokens=not no_special_tokens)
    examples = read_examples(data)
    cfg = TrainConfig(
        steps=steps, batch_size=batch_size, lr=lr, seed=seed, checkpoint_every=checkpoint_every,
        reduce=reduce, device=dev, threads=threads,
        fuser={"hidden_dim": hidden, "num_blocks": blocks, "dropout": dropout, "mapping": mp},
    )
    command = (
        f"semcomm fusion train --sharer {sharer} --receiver {receiver} --data {data} --out {out} "
        f"--steps {steps} --batch-size {batch_size} --lr {lr} --seed {seed} --hidden {hidden} "
        f"--blocks {blocks} --mapping {mapping}"
    )
    trainer = FusionTrainer(
        s_side, r_side, examples, cfg, out=out, resume=resume,
        meta={"command": command, "answer_mode": answer_mode, "data": str(data), "examples": len(examples),
              "sharer": str(sharer), "receiver": str(receiver)},
    )
    n_r = sum(p.numel() for p in r_side.model.parameters())
    n_s = sum(p.numel() for p in s_side.model.parameters())
    console.print(
        f"fuser: {trainer.fuser.num_parameters():,} parameters (sharer {n_s:,}, receiver {n_r:,}); "
        f"layers {trainer.fuser.config.layers}; {len(trainer.encoded)} examples; device {dev}"
    )
    base = trainer.evaluate_loss(fused=False)
    with _progress() as prog:
        task = prog.add_task("train", total=steps, completed=trainer.step, info="")

        def on_step(step: int, total: int, loss: float) -> None:
            prog.update(task, completed=step, info=f"loss {loss:.3f} tau {trainer.fuser.tau:.3f}")

        result = trainer.train(on_step)
    after = trainer.evaluate_loss()
    console.print(
        f"done: {result.steps} steps in {result.seconds:.0f}s; answer loss receiver alone {base:.3f}, "
        f"fused {after:.3f}; gates {trainer.fuser.gates()}; saved to {out}"
    )


@fusion_app.command("data")
def data(
    out: Path = typer.Option(..., help="Where to write the JSONL training data."),
    answer_mode: str = typer.Option("loglik", help="loglik (QA answers) or letter (also MC letters)."),
    seed: int = typer.Option(0, help="World seed."),
) -> None:
    """Write fuser training data from the reference world (training half of the facts)."""
    from ..fusion._reference import reference_examples, write_examples
    from ..reference import build_world

    ex = reference_examples(build_world(seed=seed), answer_mode=answer_mode)
    write_examples(ex, out)
    console.print(f"wrote {len(ex)} examples to {out}")


@fusion_app.command("eval")
def eval_(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write results as JSON here."),
    png: Optional[Path] = typer.Option(None, help="Write an accuracy/latency chart (PNG) here."),
    sharer: Optional[Path] = typer.Option(None, help="Sharer folder (default: the reference sharer)."),
    receiver: Optional[Path] = typer.Option(None, help="Receiver folder (default: the reference receiver)."),
    fuser: Optional[Path] = typer.Option(None, help="Fuser folder (default: the shipped reference fuser)."),
    limit: int = typer.Option(120, help="Held-out questions to evaluate (0: all)."),
    answer_mode: str = typer.Option("", help="loglik or letter (default: the fuser's training mode)."),
    oracle: bool = typer.Option(True, help="Also run the cache-enrichment oracle experiment."),
    seed: int = typer.Option(0, help="World seed."),
    threads: int = typer.Option(1, help="CPU threads for torch during the evaluation."),
) -> None:
    """Compare receiver alone, sharer alone, text-to-text and C2C on held-out multiple choice."""
    import torch

    from ..fusion import FusionPipeline, load_fuser, read_fuser_config
    from ..fusion._eval import EvalSettings, evaluate, oracle_enrichment, plot_results
    from ..fusion._reference import (
        load_reference_sides,
        load_side,
        reference_items,
        shipped_fuser_path,
    )
    from ..reference import build_world

    if threads > 0:
        torch.set_num_threads(threads)
    if sharer is None or receiver is None:
        s_ref, r_ref = load_reference_sides()
        s_side = load_side(sharer) if sharer is not None else s_ref
        r_side = load_side(receiver) if receiver is not None else r_ref
    else:
        s_side, r_side = load_side(sharer), load_side(receiver)
    fpath = fuser or shipped_fuser_path()
    _, meta = read_fuser_config(fpath)
    fz = load_fuser(fpath, sharer=s_side.spec, receiver=r_side.spec)
    mode = answer_mode or str(meta.get("answer_mode", "loglik"))
    pipe = FusionPipeline(s_side, r_side, fz)
    items = reference_items(build_world(seed=seed), heldout=True, limit=limit or None)
    settings = EvalSettings(answer_mode=mode)
    t0 = time.perf_counter()
    with _progress() as prog:
        task = prog.add_task("eval", total=len(items), info=f"{mode}")
        results: dict[str, Any] = evaluate(pipe, items, settings, lambda i, n: prog.update(task, completed=i))
    oracle_res = oracle_enrichment(r_side, items, settings) if oracle else None
    table = Table(title=f"C2C on {len(items)} held-out questions ({mode})")
    for col in ("method", "accuracy", "seen", "unseen", "median latency", "tokens generated"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for m, r in results.items():
        table.add_row(
            m, f"{r['accuracy']:.3f}", f"{r.get('accuracy_seen', 0):.3f}",
            f"{r.get('accuracy_unseen', 0):.3f}", f"{r['latency_s'] * 1e3:.1f} ms",
            f"{r['tokens_generated']:.1f}",
        )
    console.print(table)
    summary = {
        "c2c_minus_receiver_points": (results["c2c"]["accuracy"] - results["receiver"]["accuracy"]) * 100,
        "c2c_minus_t2t_points": (results["c2c"]["accuracy"] - results["t2t"]["accuracy"]) * 100,
        "t2t_over_c2c_latency": results["t2t"]["latency_s"] / max(results["c2c"]["latency_s"], 1e-9),
    }
    console.print(
        f"C2C - receiver: {summary['c2c_minus_receiver_points']:+.1f} points; C2C - T2T: "
        f"{summary['c2c_minus_t2t_points']:+.1f} points; T2T/C2C latency: "
        f"{summary['t2t_over_c2c_latency']:.2f}x"
    )
    if oracle_res is not None:
        console.print(
            "oracle (receiver, same cache length): question {accuracy_question:.3f}, enriched "
            "{accuracy_enriched:.3f}, full context {accuracy_full_context:.3f}".format(**oracle_res)
        )
    doc: dict[str, Any] = dict(results)
    doc["summary"] = summary
    doc["oracle"] = oracle_res
    doc["setup"] = {
        "items": len(items), "answer_mode": mode, "fuser": str(fpath),
        "fuser_params": fz.num_parameters(),
        "sharer_params": sum(p.numel() for p in s_side.model.parameters()),
        "receiver_params": sum(p.numel() for p in r_side.model.parameters()),
        "fuser_gates": fz.gates(), "seconds": time.perf_counter() - t0,
        "fuser_meta": meta,
    }
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_out}")
    if png is not None:
        plot_results(results, png)
        console.print(f"wrote {png}")


@fusion_app.command("info")
def info(path: Path = typer.Argument(None, help="Fuser folder (default: the shipped reference fuser).")) -> None:
    """Show a fuser's pair, layer mapping, gates and parameter count."""
    from ..fusion import load_fuser, read_fuser_config
    from ..fusion._reference import shipped_fuser_path

    p = path or shipped_fuser_path()
    cfg, meta = read_fuser_config(p)
    fz = load_fuser(p)
    console.print(f"sharer:   {cfg.sharer.describe()}")
    console.print(f"receiver: {cfg.receiver.describe()}")
    console.print(f"layers (receiver -> sharer): {cfg.layers}")
    console.print(f"hidden {cfg.hidden_dim}, blocks {cfg.num_blocks}; parameters {fz.num_parameters():,}")
    console.print(f"gates: {fz.gates()}")
    for k in ("command", "steps", "last_loss", "train_seconds"):
        if k in meta:
            console.print(f"{k}: {meta[k]}")


def register(app: typer.Typer) -> None:
    """Attach the `fusion` command group to the main app."""
    app.add_typer(fusion_app, name="fusion")
