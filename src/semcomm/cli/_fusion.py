"""CLI: `semcomm fusion` (train, eval, data, info)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

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
    sharer: Annotated[
        str,
        typer.Option(
            help="Sharer model: a catalog name (semcomm models list), a model folder "
            "(config.json, weights, tokenizer) or a hub id available offline."
        ),
    ],
    receiver: Annotated[str, typer.Option(help="Receiver model (as --sharer).")],
    data: Annotated[
        Path, typer.Option(help="JSONL training data: {'shared': ..., 'answer': ...} per line.")
    ],
    out: Annotated[
        Path, typer.Option(help="Output folder for fuser.safetensors + fuser.json checkpoints.")
    ],
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 300,
    batch_size: Annotated[int, typer.Option(help="Examples per step.")] = 8,
    lr: Annotated[
        float, typer.Option(help="Peak learning rate (AdamW, warmup then cosine).")
    ] = 1e-3,
    seed: Annotated[int, typer.Option(help="Random seed (batches, init, gate noise).")] = 0,
    hidden: Annotated[int, typer.Option(help="Fuser hidden size.")] = 256,
    blocks: Annotated[int, typer.Option(help="Residual MLP blocks per branch.")] = 2,
    dropout: Annotated[float, typer.Option(help="Dropout inside the fuser MLP.")] = 0.1,
    mapping: Annotated[
        str,
        typer.Option(help="Layer mapping: last_aligned, uniform, first_aligned or a comma list."),
    ] = "last_aligned",
    reduce: Annotated[
        str, typer.Option(help="Alignment reduction over sharer tokens: mean or last.")
    ] = "mean",
    checkpoint_every: Annotated[
        int, typer.Option(help="Write a checkpoint every N steps (0: only at the end).")
    ] = 100,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in --out.")] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "auto",
    no_special_tokens: Annotated[
        bool, typer.Option(help="Do not add BOS/special tokens to prompts.")
    ] = False,
    sharer_template: Annotated[
        str,
        typer.Option(
            help="The sharer's prompt around the shared text, e.g. a chat template "
            "'<|im_start|>user\\n{shared}<|im_end|>\\n<|im_start|>assistant\\n'."
        ),
    ] = "{shared}",
    receiver_template: Annotated[
        str,
        typer.Option(help="The receiver's prompt around the shared text (as --sharer-template)."),
    ] = "{shared}",
    answer_mode: Annotated[
        str, typer.Option(help="How `fusion eval` should score with this fuser: loglik or letter.")
    ] = "loglik",
    val_data: Annotated[
        Path | None,
        typer.Option(
            help="Validation JSONL: multiple choice {'question','choices','answer'} (C2C "
            "option log-likelihood accuracy) or {'shared','options','answer_index'} (best C2C "
            "accuracy kept) or {'shared','answer'} (best loss kept)."
        ),
    ] = None,
    eval_every: Annotated[
        int, typer.Option(help="Validate every N steps (with --val-data).")
    ] = 100,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.01,
    threads: Annotated[
        int,
        typer.Option(
            help="CPU threads for torch (0: torch's default; 1 is fastest for tiny models on busy cores)."
        ),
    ] = 0,
    bf16: Annotated[
        bool, typer.Option(help="bfloat16 autocast for the models and the fuser (fp32 weights).")
    ] = False,
    max_prompt_tokens: Annotated[
        int, typer.Option(help="Skip examples whose receiver prompt is longer than this.")
    ] = 512,
    intermediate_mult: Annotated[
        float, typer.Option(help="Fuser MLP inner width as a multiple of --hidden.")
    ] = 2.0,
    objective: Annotated[
        str,
        typer.Option(
            help="answer: cross-entropy on the answer ({'shared','answer'} data); choice: "
            "cross-entropy over the choices' summed log-probabilities (multiple-choice data, "
            "the loglik rule of `fusion eval --data`)."
        ),
    ] = "answer",
    gate_lr: Annotated[
        float, typer.Option(help="Peak learning rate of the gate logits (0: --lr).")
    ] = 0.0,
    answer_weight: Annotated[
        float,
        typer.Option(help="--objective choice: add this x the correct choice's token loss."),
    ] = 0.0,
    init: Annotated[
        Path | None,
        typer.Option(help="Start a fresh run from this fuser folder's weights (same shapes)."),
    ] = None,
    prefill_cache: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the frozen models' prompt KV per example: computed once, read "
            "back in later epochs and validation (lossless; may be added on --resume)."
        ),
    ] = None,
) -> None:
    """Train a fuser with both models frozen (receiver next-token loss on answer tokens).

    Runs checkpoint every --checkpoint-every steps; --resume continues from --out (optimizer
    state, step, losses and wall time included), so a run can be spread over sessions.
    """
    import torch

    from ..fusion import FusionTrainer, TrainConfig, load_side, read_examples
    from ._tools.fusion_reference import c2c_accuracy_metric, read_mc_items

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    mp: Any = (
        [int(x) for x in mapping.split(",")] if "," in mapping or mapping.isdigit() else mapping
    )
    s_side = load_side(sharer, add_special_tokens=not no_special_tokens, template=sharer_template)
    r_side = load_side(
        receiver, add_special_tokens=not no_special_tokens, template=receiver_template
    )
    from ..fusion import read_mcqa

    examples: Any = read_mcqa(data) if objective == "choice" else read_examples(data)
    cfg = TrainConfig(
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        checkpoint_every=checkpoint_every,
        reduce=reduce,
        device=dev,
        threads=threads,
        weight_decay=weight_decay,
        eval_every=eval_every if val_data is not None else 0,
        bf16=bf16,
        max_prompt_tokens=max_prompt_tokens,
        objective=objective,
        gate_lr=gate_lr,
        answer_weight=answer_weight,
        fuser={
            "hidden_dim": hidden,
            "num_blocks": blocks,
            "dropout": dropout,
            "mapping": mp,
            "intermediate_mult": intermediate_mult,
        },
    )
    command = (
        f"semcomm fusion train --sharer {sharer} --receiver {receiver} --data {data} --out {out} "
        f"--steps {steps} --batch-size {batch_size} --lr {lr} --seed {seed} --hidden {hidden} "
        f"--blocks {blocks} --intermediate-mult {intermediate_mult} --dropout {dropout} "
        f"--mapping {mapping} --weight-decay {weight_decay} --max-prompt-tokens {max_prompt_tokens}"
        f" --checkpoint-every {checkpoint_every} --threads {threads}"
        + (" --bf16" if bf16 else "")
        + (f" --objective {objective}" if objective != "answer" else "")
        + (f" --gate-lr {gate_lr}" if gate_lr else "")
        + (f" --answer-weight {answer_weight}" if answer_weight else "")
        + (f" --init {init}" if init is not None else "")
        + (f" --prefill-cache {prefill_cache}" if prefill_cache is not None else "")
        + (f" --val-data {val_data} --eval-every {eval_every}" if val_data is not None else "")
        + (f" --sharer-template '{sharer_template}'" if sharer_template != "{shared}" else "")
        + (f" --receiver-template '{receiver_template}'" if receiver_template != "{shared}" else "")
    )
    val_examples = None
    val_metric = None
    if val_data is not None:
        first = next(
            (ln for ln in val_data.read_text(encoding="utf-8").splitlines() if ln.strip()), ""
        )
        if '"choices"' in first:
            from ..fusion import c2c_mcqa_metric

            val_metric = c2c_mcqa_metric(s_side, r_side, read_mcqa(val_data), bf16=bf16)
        elif '"options"' in first:
            val_metric = c2c_accuracy_metric(s_side, r_side, read_mc_items(val_data))
        else:
            val_examples = read_examples(val_data)
    trainer = FusionTrainer(
        s_side,
        r_side,
        examples,
        cfg,
        out=out,
        resume=resume,
        meta={
            "command": command,
            "answer_mode": answer_mode,
            "data": str(data),
            "examples": len(examples),
            "sharer": str(sharer),
            "receiver": str(receiver),
        },
        val_examples=val_examples,
        val_metric=val_metric,
        init=init,
        prefill_cache=prefill_cache,
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
            info = f"loss {loss:.3f} tau {trainer.fuser.tau:.3f}" + _cache_info(trainer)
            prog.update(task, completed=step, info=info)

        result = trainer.train(on_step)
    after = trainer.evaluate_loss()
    console.print(
        f"done: {result.steps} steps in {result.seconds:.0f}s; {objective} loss receiver alone "
        f"{base:.3f}, "
        f"fused {after:.3f}; gates {trainer.fuser.gates()}; saved to {out}"
        + _cache_info(trainer)
    )


def _cache_info(trainer: Any) -> str:
    """`; prefill cache H hits M misses` (per model and example) when the cache is on."""
    cache = trainer.prefill_cache
    if cache is None:
        return ""
    st = cache.stats
    bad = f" ({st.rewritten} rewritten)" if st.rewritten else ""
    return f"; prefill cache {st.hits} hits {st.misses} misses{bad}"


@fusion_app.command("data")
def data(
    out: Annotated[Path, typer.Option(help="Where to write the JSONL training data.")],
    answer_mode: Annotated[
        str, typer.Option(help="loglik (QA answers) or letter (also MC letters).")
    ] = "loglik",
    val_out: Annotated[
        Path | None,
        typer.Option(
            help="Also write validation questions here (15% of the training facts, then left "
            "out of --out)."
        ),
    ] = None,
    statements: Annotated[
        bool, typer.Option(help="Also train on statements ending with the object.")
    ] = False,
    seed: Annotated[int, typer.Option(help="World seed.")] = 0,
) -> None:
    """Write fuser training data from the reference world (training half of the facts)."""
    from ..reference import build_world
    from ._tools.fusion_reference import (
        reference_examples,
        validation_items,
        write_examples,
        write_mc_items,
    )

    world = build_world(seed=seed)
    part = "train" if val_out is not None else "all"
    ex = reference_examples(world, answer_mode=answer_mode, part=part, statements=statements)
    write_examples(ex, out)
    console.print(f"wrote {len(ex)} examples to {out}")
    if val_out is not None:
        items = validation_items(world)
        write_mc_items(items, val_out)
        console.print(f"wrote {len(items)} validation questions to {val_out}")


@fusion_app.command("data-mcqa")
def data_mcqa(
    out: Annotated[Path, typer.Option(help="Where to write the JSONL training data.")],
    mcqa: Annotated[
        list[Path],
        typer.Option(help="Multiple-choice JSONL files (repeat); only their tails are used."),
    ],
    skip: Annotated[
        int,
        typer.Option(
            help="Leading items of each file kept out of training (evaluation + rule choice)."
        ),
    ] = 600,
    instructions: Annotated[
        Path | None, typer.Option(help="Instruction JSONL ({'prompt', 'completion'}) to mix in.")
    ] = None,
    instruction_limit: Annotated[int, typer.Option(help="Most instruction rows to add.")] = 1000,
    choices: Annotated[
        bool,
        typer.Option(
            help="Write multiple-choice rows ({'question', 'choices', 'answer'}) for "
            "`fusion train --objective choice` or --val-data, instead of answer rows."
        ),
    ] = False,
    take: Annotated[
        int, typer.Option(help="With --choices: items per file after --skip (0: all).")
    ] = 0,
) -> None:
    """Write fuser training rows for a real pair from multiple-choice tails (+ instructions)."""
    from ..errors import InvalidInputError
    from ..fusion import build_choice_rows, build_training_rows

    rows: list[dict[str, Any]]
    if choices:
        if instructions is not None:
            raise InvalidInputError("--choices writes multiple-choice rows only; drop --instructions")
        rows = build_choice_rows(list(mcqa), skip=skip, take=take or None)
    else:
        rows = build_training_rows(
            list(mcqa), skip=skip, instruction_file=instructions, instruction_limit=instruction_limit
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    console.print(f"wrote {len(rows)} rows to {out} (first {skip} items of each file left out)")


@fusion_app.command("eval")
def eval_(
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write results as JSON here.")
    ] = None,
    png: Annotated[
        Path | None, typer.Option(help="Write an accuracy/latency chart (PNG) here.")
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            help="Multiple-choice JSONL ({'question', 'choices', 'answer'}): evaluate the real "
            "pair (default sharer qwen2.5-coder-0.5b-instruct, receiver smollm2-135m-instruct, "
            "the fuser shipped for them). Without --data: the reference world."
        ),
    ] = None,
    sharer: Annotated[
        str | None,
        typer.Option(help="Sharer: catalog name, folder or hub id (default: see --data)."),
    ] = None,
    receiver: Annotated[
        str | None, typer.Option(help="Receiver: catalog name, folder or hub id.")
    ] = None,
    fuser: Annotated[
        Path | None, typer.Option(help="Fuser folder (default: the fuser shipped for the pair).")
    ] = None,
    limit: Annotated[
        int, typer.Option(help="Questions to evaluate, the first N in file order (0: all).")
    ] = 0,
    skip: Annotated[int, typer.Option(help="With --data: leading items to skip first.")] = 0,
    answer_mode: Annotated[
        str,
        typer.Option(
            help="Scoring rule: loglik (summed log-probability of each choice's text) or letter "
            "(logits of the choice letters); reference world default: the fuser's training mode."
        ),
    ] = "",
    analysis_tokens: Annotated[
        int, typer.Option(help="With --data: most tokens the sharer writes for text-to-text.")
    ] = 32,
    methods: Annotated[
        str, typer.Option(help="With --data: comma list of receiver, sharer, t2t, c2c.")
    ] = "receiver,sharer,t2t,c2c",
    fp32: Annotated[
        bool, typer.Option(help="With --data: float32 compute instead of bfloat16.")
    ] = False,
    weights: Annotated[
        str,
        typer.Option(
            help="With --data: bf16 (models cast to bfloat16, fastest) or fp32 (float32 "
            "weights under bfloat16 autocast)."
        ),
    ] = "bf16",
    oracle: Annotated[
        bool | None,
        typer.Option(
            help="Also run the cache-enrichment oracle (default: on for the reference world, "
            "off with --data)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="With --data: cpu, cuda or auto.")] = "cpu",
    seed: Annotated[int, typer.Option(help="World seed.")] = 0,
    threads: Annotated[
        int,
        typer.Option(
            help="CPU threads for torch during the evaluation (0: torch's default; 1, the "
            "default, is the fastest on busy shared cores)."
        ),
    ] = -1,
) -> None:
    """Compare receiver alone, sharer alone, text-to-text and C2C on held-out multiple choice."""
    import torch

    from ..reference import build_world
    from ._tools.fusion_reference import reference_items, run_eval

    if threads < 0:
        threads = 1
    if threads > 0:
        torch.set_num_threads(threads)
    if data is not None:
        _eval_mcqa(
            data,
            json_out=json_out,
            png=png,
            sharer=sharer,
            receiver=receiver,
            fuser=fuser,
            limit=limit,
            skip=skip,
            rule=answer_mode or "loglik",
            analysis_tokens=analysis_tokens,
            methods=methods,
            bf16=not fp32,
            oracle=bool(oracle),
            device=device,
            weights=weights,
        )
        return
    oracle = True if oracle is None else oracle
    total = len(reference_items(build_world(seed=seed), heldout=True, limit=limit or None))
    with _progress() as prog:
        task = prog.add_task("eval", total=total, info="")
        doc = run_eval(
            sharer=Path(sharer) if sharer else None,
            receiver=Path(receiver) if receiver else None,
            fuser=fuser,
            limit=limit,
            answer_mode=answer_mode,
            oracle=oracle,
            seed=seed,
            progress=lambda i, n: prog.update(task, completed=i),
        )
    results = {m: doc[m] for m in ("receiver", "sharer", "t2t", "c2c")}
    setup = doc["setup"]
    table = Table(title=f"C2C on {setup['items']} held-out questions ({setup['answer_mode']})")
    for col in ("method", "accuracy", "seen", "unseen", "median latency", "tokens generated"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for m, r in results.items():
        table.add_row(
            m,
            f"{r['accuracy']:.3f}",
            f"{r.get('accuracy_seen', 0):.3f}",
            f"{r.get('accuracy_unseen', 0):.3f}",
            f"{r['latency_s'] * 1e3:.1f} ms",
            f"{r['tokens_generated']:.1f}",
        )
    console.print(table)
    summary = doc["summary"]
    console.print(
        f"C2C - receiver: {summary['c2c_minus_receiver_points']:+.1f} points; C2C - T2T: "
        f"{summary['c2c_minus_t2t_points']:+.1f} points; T2T/C2C latency: "
        f"{summary['t2t_over_c2c_latency']:.2f}x; fuser {setup['fuser_params']:,} parameters "
        f"(receiver {setup['receiver_params']:,}, sharer {setup['sharer_params']:,})"
    )
    _write_outputs(console, doc, results, json_out, png)


def _eval_mcqa(
    data: Path,
    *,
    json_out: Path | None,
    png: Path | None,
    sharer: str | None,
    receiver: str | None,
    fuser: Path | None,
    limit: int,
    skip: int,
    rule: str,
    analysis_tokens: int,
    methods: str,
    bf16: bool,
    oracle: bool,
    device: str,
    weights: str,
) -> None:
    from ..errors import InvalidInputError
    from ..fusion import METHODS, McqaSettings, read_mcqa, run_mcqa_eval

    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    bad = [m for m in chosen if m not in METHODS]
    if bad or not chosen:
        raise InvalidInputError(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    if rule not in ("loglik", "letter"):
        raise InvalidInputError(f"--answer-mode must be loglik or letter, got {rule!r}")
    total = len(read_mcqa(data, limit=limit or None, skip=skip))
    settings = McqaSettings(rule=rule, analysis_tokens=analysis_tokens, bf16=bf16, methods=chosen)
    with _progress() as prog:
        task = prog.add_task("eval", total=total, info="")
        doc = run_mcqa_eval(
            data,
            limit=limit or None,
            skip=skip,
            sharer=sharer,
            receiver=receiver,
            fuser=fuser,
            settings=settings,
            oracle=oracle,
            device=device,
            weights=weights,
            progress=lambda i, n: prog.update(task, completed=i),
        )
    setup = doc["setup"]
    if setup.get("c2c_note"):
        console.print(f"[yellow]{setup['c2c_note']}[/]")
    chosen = tuple(setup.get("methods") or chosen)
    table = Table(title=f"{data.name}: {setup['items']} questions, rule {rule}")
    extra = ["loglik_mean"] if rule == "loglik" else []
    for col in ("method", "accuracy", *extra, "median latency", "tokens generated"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for m in chosen:
        r = doc[m]
        table.add_row(
            m,
            f"{r['accuracy']:.3f}",
            *[f"{r[f'accuracy_{x}']:.3f}" for x in extra],
            f"{r['latency_s'] * 1e3:.0f} ms",
            f"{r['tokens_generated']:.1f}",
        )
    console.print(table)
    if doc["summary"]:
        console.print(
            "; ".join(
                f"{k} {v:+.1f}" if k.endswith("points") else f"{k} {v:.2f}x"
                for k, v in doc["summary"].items()
            )
        )
    _print_complementarity(doc.get("complementarity") or {})
    _write_outputs(console, doc, {m: doc[m] for m in chosen}, json_out, png)


def _print_complementarity(comp: dict[str, Any]) -> None:
    """Per rule: each model alone, the questions only one gets right, the best-of-two oracle
    and (with C2C) the share of the receiver -> oracle gap it closes."""
    by_rule = comp.get("by_rule") or {}
    if not by_rule:
        return
    table = Table(title="where the pair is complementary (per rule)")
    cols = ("rule", "receiver", "sharer", "only receiver", "only sharer", "oracle", "T2T", "C2C",
            "gap closed")
    for col in cols:
        table.add_column(col, justify="left" if col == "rule" else "right")

    def f(x: Any, pct: bool = False) -> str:
        return "-" if x is None else (f"{x * 100:.0f}%" if pct else f"{x:.3f}")

    for rule, c in by_rule.items():
        table.add_row(rule, f(c["receiver"]), f(c["sharer"]), f(c["only_receiver"]),
                      f(c["only_sharer"]), f(c["either_right"]), f(c.get("t2t")), f(c.get("c2c")),
                      f(c.get("c2c_gap_closed"), pct=True))
    console.print(table)


@fusion_app.command("info")
def info(
    path: Annotated[
        Path | None, typer.Argument(help="Fuser folder (default: the shipped reference fuser).")
    ] = None,
) -> None:
    """Show a fuser's pair, layer mapping, gates and parameter count."""
    from ..fusion import load_fuser, read_fuser_config, shipped_fuser_path

    p = path or shipped_fuser_path()
    cfg, meta = read_fuser_config(p)
    fz = load_fuser(p)
    console.print(f"sharer:   {cfg.sharer.describe()}")
    console.print(f"receiver: {cfg.receiver.describe()}")
    console.print(f"layers (receiver -> sharer): {cfg.layers}")
    console.print(
        f"hidden {cfg.hidden_dim}, blocks {cfg.num_blocks}; parameters {fz.num_parameters():,}"
    )
    console.print(f"gates: {fz.gates()}")
    for k in ("command", "steps", "last_loss", "train_seconds"):
        if k in meta:
            console.print(f"{k}: {meta[k]}")



def _write_outputs(console: Any, doc: dict[str, Any], results: dict[str, Any],
                   json_out: Path | None, png: Path | None) -> None:
    """The oracle line, the JSON file and the PNG chart shared by both eval paths."""
    from ..fusion import plot_results

    if doc["oracle"] is not None:
        console.print(
            "oracle (receiver, same cache length): question {accuracy_question:.3f}, enriched "
            "{accuracy_enriched:.3f}, full context {accuracy_full_context:.3f}".format(
                **doc["oracle"]
            )
        )
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_out}")
    if png is not None:
        plot_results(results, png)
        console.print(f"wrote {png}")

def register(app: typer.Typer) -> None:
    """Attach the `fusion` command group to the main app."""
    app.add_typer(fusion_app, name="fusion")
