"""Train one reference model on the world (CPU, seeded) and ship it as a transformers folder.

The recipe that works on two CPU cores in minutes (an earlier trial with ten templates, many
multiple-choice items and ~50 exposures per fact learned the templates but not the facts):
a reduced vocabulary, few templates, mostly statements and QA, hundreds of exposures per fact,
packed 128-token blocks, AdamW with peak learning rate 3e-3, warmup then cosine decay.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._corpus import MIX, documents
from .world import SplitArg, World

__all__ = ["RECEIVER_SPEC", "SHARER_SPEC", "ModelSpec", "TrainResult", "train_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture and recipe of one reference model."""

    name: str  # "sharer" | "receiver"
    family: str  # "llama" | "qwen2"
    facts: SplitArg  # which facts the corpus holds
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int
    batch: int = 32
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 40
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    seed: int = 0


SHARER_SPEC = ModelSpec("sharer", "llama", "all", hidden=192, layers=4, heads=4, kv_heads=4,
                        intermediate=512, steps=560, batch=16)
RECEIVER_SPEC = ModelSpec("receiver", "qwen2", "seen", hidden=160, layers=5, heads=4, kv_heads=2,
                          intermediate=448, steps=520, batch=16)


@dataclass(slots=True)
class TrainResult:
    """What a training run did (recorded in the model card)."""

    spec: ModelSpec
    params: int
    tokens: int
    minutes: float
    losses: list[float] = field(default_factory=list)  # per step
    exposures_per_fact: float = 0.0  # documents per training fact (passes over the facts)
    n_facts: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (losses smoothed to at most 100 points)."""
        k = max(1, len(self.losses) // 100)
        curve = [round(float(np.mean(self.losses[i : i + k])), 4)
                 for i in range(0, len(self.losses), k)]
        return {"spec": asdict(self.spec), "params": self.params, "tokens": self.tokens,
                "minutes": round(self.minutes, 2), "final_loss": round(self.final_loss, 4),
                "exposures_per_fact": round(self.exposures_per_fact, 1),
                "n_facts": self.n_facts, "loss_curve": curve}

    @property
    def final_loss(self) -> float:
        tail = self.losses[-50:]
        return float(np.mean(tail)) if tail else float("nan")


def _config(spec: ModelSpec, tok: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common = {
        "vocab_size": len(tok),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    if spec.family == "llama":
        return LlamaConfig(**common)
    if spec.family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(f"unknown family {spec.family!r}")


def _token_stream(world: World, spec: ModelSpec, tok: Any, n_tokens: int) -> tuple[np.ndarray, int]:
    """Packed ``[BOS] doc [EOS]`` stream of at least ``n_tokens``; also the number of documents."""
    gen = documents(world, spec.facts, spec.seed)
    eos = tok.eos_token_id
    parts: list[np.ndarray] = []
    total = 0
    n_docs = 0
    while total < n_tokens:
        docs = list(islice(gen, 4096))
        n_docs += len(docs)
        for ids in tok(docs)["input_ids"]:
            arr = np.asarray(ids + [eos], dtype=np.int32)
            parts.append(arr)
            total += len(arr)
    return np.concatenate(parts), n_docs


def _lr_at(step: int, spec: ModelSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    floor = spec.lr * spec.min_lr_ratio
    return floor + (spec.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def train_model(world: World, spec: ModelSpec, tok: Any, threads: int = 2,
                show_progress: bool = True) -> tuple[Any, TrainResult]:
    """Train ``spec`` on ``world`` with tokenizer ``tok``; returns (fp32 model, result)."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    random.seed(spec.seed)
    np.random.seed(spec.seed)
    torch.manual_seed(spec.seed)

    need = spec.steps * spec.batch * spec.seq_len
    stream, n_docs = _token_stream(world, spec, tok, need)
    n_blocks = len(stream) // spec.seq_len
    blocks = torch.from_numpy(stream[: n_blocks * spec.seq_len].astype(np.int64)).view(
        n_blocks, spec.seq_len)
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(spec.seed))
    blocks = blocks[order]
    n_facts = len(world.facts_in(spec.facts))
    # documents actually trained on (the stream is cut at need tokens)
    exposures = n_docs * min(1.0, need / len(stream)) / max(n_facts, 1)

    model = AutoModelForCausalLM.from_config(_config(spec, tok), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.98), eps=1e-8,
    )
    log.info("training %s: %d params, %d steps, %d tokens, %.0f docs per fact",
             spec.name, params, spec.steps, need, exposures)
    losses: list[float] = []
    start = time.perf_counter()
    model.train()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), disable=not show_progress) as bar:
        task = bar.add_task(f"train {spec.name}", total=spec.steps, loss="-")
        for step in range(spec.steps):
            lo = (step * spec.batch) % (n_blocks - spec.batch)
            x = blocks[lo : lo + spec.batch]
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, spec)
            out = model(input_ids=x, labels=x)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
            if step % 10 == 0 or step == spec.steps - 1:
                bar.update(task, completed=step + 1, loss=f"{np.mean(losses[-10:]):.3f}")
            if not show_progress and (step % 50 == 0 or step == spec.steps - 1):
                log.info("%s step %d/%d loss %.3f (%.1f min)", spec.name, step + 1, spec.steps,
                         np.mean(losses[-50:]), (time.perf_counter() - start) / 60)
    minutes = (time.perf_counter() - start) / 60
    model.eval()
    return model, TrainResult(spec, params, need, minutes, losses, exposures, n_facts)


def save_loss_plot(result: TrainResult, path: Path) -> None:
    """Loss curve PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ls = np.asarray(result.losses)
    ax.plot(ls, alpha=0.3, lw=0.8, label="step")
    k = 25
    if len(ls) > k:
        ax.plot(np.arange(k - 1, len(ls)), np.convolve(ls, np.ones(k) / k, mode="valid"),
                lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{result.spec.name} ({result.spec.family}, {result.params / 1e6:.2f}M params)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def mix_description() -> str:
    """The corpus mix, for the model card."""
    return ", ".join(f"{k} {v:.0%}" for k, v in MIX.items())


def dump_json(obj: Any, path: Path) -> None:
    """Sorted-key JSON file."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
