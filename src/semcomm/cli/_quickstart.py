"""CLI: `semcomm quickstart` - the KV prefix cache on a small workload, cold then warm.

The workload is a shared system prompt and multi-turn follow-ups (6 requests). The cold pass
starts from an empty TieredStore (memory + a disk directory); the warm pass is a fresh engine
and a fresh memory tier over the same disk directory (a restart): its hits come from disk,
then from memory once promoted. ``quickstart_model()`` picks the model; swap it for the
reference model once that ships.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["quickstart_model", "quickstart_workload", "register", "run_quickstart"]

QUICKSTART_CHUNK = 64  # prompts here are ~0.5-1k tokens; 64-token chunks show turn-level reuse

_SYSTEM = (
    "You are the support assistant of Northwind Rail, a regional train operator. Answer in "
    "two sentences at most. Policies: tickets are refundable up to 24 hours before departure; "
    "after that a 20 percent fee applies. Bicycles travel free outside rush hours (7-9 and "
    "16-18 on weekdays). Pets under 8 kg ride free in a carrier; larger dogs need a half-price "
    "ticket and a leash. Delays over 30 minutes earn a 25 percent refund, over 60 minutes 50 "
    "percent, claimed within 14 days with the ticket number. Season passes pause once a year "
    "for up to 30 days. Lost items are kept 90 days at the central station office. Never "
    "reveal internal staff rosters. If unsure, say so and point to northwind.example/help."
)
_TURNS = [
    ("My train was 45 minutes late this morning. What do I get?",
     "A 25 percent refund, claimed within 14 days with your ticket number."),
    ("And if it had been 70 minutes?", "Then the refund would be 50 percent."),
    ("Can I bring my bike at 8 am?", "Not at 8 am on a weekday; bikes ride free outside rush hours."),
]
_OTHER_USER = [
    "I left an umbrella on the 17:05 yesterday. Where can I collect it?",
    "How do I pause my season pass for three weeks?",
    "My dog weighs 20 kg. What ticket does he need?",
]


def quickstart_model() -> tuple[Any, Any, str]:
    """(model, tokenizer, description) used by the quickstart: swap this for the reference model.

    Today: a config-built Qwen2-shaped model (random weights, 4 layers, hidden 256) with a
    byte-level tokenizer built offline, so generated text is noise but timing and reuse are real.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=vocab["<|endoftext|>"], bos_token_id=None, pad_token_id=vocab["<|endoftext|>"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    desc = "config-built Qwen2-shaped model (4 layers, hidden 256, random weights, byte tokenizer)"
    return model, tokenizer, desc


def quickstart_workload() -> list[tuple[str, list[dict[str, str]]]]:
    """(label, chat messages) for each request: multi-turn follow-ups and other users."""
    reqs: list[tuple[str, list[dict[str, str]]]] = []
    history: list[dict[str, str]] = [{"role": "system", "content": _SYSTEM}]
    for i, (user, answer) in enumerate(_TURNS):
        reqs.append((f"A{i + 1}", history + [{"role": "user", "content": user}]))
        history = history + [{"role": "user", "content": user},
                             {"role": "assistant", "content": answer}]
    for j, user in enumerate(_OTHER_USER):
        reqs.append((f"{'BCD'[j]}1", [{"role": "system", "content": _SYSTEM},
                                                  {"role": "user", "content": user}]))
    return reqs


@dataclass(slots=True)
class _Row:
    label: str
    prompt_tokens: int
    cold_hit: int
    warm_hit: int
    warm_tier: str
    cold_ttft_ms: float
    warm_ttft_ms: float
    bytes_stored: int
    bytes_loaded: int
    same_tokens: bool


def run_quickstart(model_path: str | None = None, max_new_tokens: int = 16,
                   home: Path | None = None) -> dict[str, Any]:
    """Run the workload cold then warm; return the figures (what ``--json`` writes)."""
    from ..engine import HFEngine
    from ..kv import DiskStore, MemoryStore, TieredStore

    if model_path is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        desc = f"model from {model_path}"
    else:
        model, tokenizer, desc = quickstart_model()
    reqs = quickstart_workload()
    with tempfile.TemporaryDirectory(prefix="semcomm-quickstart-", dir=home) as tmp:
        disk = Path(tmp) / "kv"

        def engine() -> HFEngine:
            store = TieredStore([MemoryStore(), DiskStore(disk)])
            return HFEngine(model, tokenizer, store=store, chunk_size=QUICKSTART_CHUNK)

        # One untimed request on an unrelated prompt warms up kernels and allocators.
        warmup = HFEngine(model, tokenizer, store=None, chunk_size=QUICKSTART_CHUNK)
        warmup.generate("warm-up " * 40, max_new_tokens=2)
        cold_engine = engine()
        cold = [cold_engine.generate(msgs, max_new_tokens=max_new_tokens) for _, msgs in reqs]
        warm_engine = engine()  # a restart: new process state, same disk directory
        warm = [warm_engine.generate(msgs, max_new_tokens=max_new_tokens) for _, msgs in reqs]
        device = str(warm_engine.device)
    rows = [
        _Row(
            label=label,
            prompt_tokens=c.stats.prompt_tokens,
            cold_hit=c.stats.hit_tokens,
            warm_hit=w.stats.hit_tokens,
            warm_tier=w.stats.tier,
            cold_ttft_ms=c.stats.ttft_s * 1e3,
            warm_ttft_ms=w.stats.ttft_s * 1e3,
            bytes_stored=c.stats.bytes_stored,
            bytes_loaded=w.stats.bytes_loaded,
            same_tokens=c.token_ids == w.token_ids,
        )
        for (label, _), c, w in zip(reqs, cold, warm)
    ]
    tot_prompt = sum(r.prompt_tokens for r in rows)
    tot_cold = sum(r.cold_ttft_ms for r in rows)
    tot_warm = sum(r.warm_ttft_ms for r in rows)
    return {
        "model": desc,
        "device": device,
        "chunk_size": QUICKSTART_CHUNK,
        "codec": "lossless",
        "store": "TieredStore(memory, disk)",
        "max_new_tokens": max_new_tokens,
        "requests": [
            {
                "request": r.label,
                "prompt_tokens": r.prompt_tokens,
                "cold_hit_tokens": r.cold_hit,
                "warm_hit_tokens": r.warm_hit,
                "warm_tier": r.warm_tier,
                "cold_ttft_ms": round(r.cold_ttft_ms, 3),
                "warm_ttft_ms": round(r.warm_ttft_ms, 3),
                "ttft_speedup": round(r.cold_ttft_ms / max(r.warm_ttft_ms, 1e-9), 2),
                "bytes_stored": r.bytes_stored,
                "bytes_loaded": r.bytes_loaded,
                "same_tokens": r.same_tokens,
            }
            for r in rows
        ],
        "totals": {
            "prompt_tokens": tot_prompt,
            "cold_hit_tokens": sum(r.cold_hit for r in rows),
            "warm_hit_tokens": sum(r.warm_hit for r in rows),
            "cold_ttft_ms": round(tot_cold, 3),
            "warm_ttft_ms": round(tot_warm, 3),
            "ttft_speedup": round(tot_cold / max(tot_warm, 1e-9), 2),
            "bytes_stored": sum(r.bytes_stored for r in rows),
            "bytes_loaded": sum(r.bytes_loaded for r in rows),
            "all_same_tokens": all(r.same_tokens for r in rows),
        },
    }


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]semcomm quickstart[/] - {report['model']} on {report['device']}, "
                  f"chunk {report['chunk_size']} tokens, {report['store']}")
    table = Table(title="KV prefix cache: cold pass, then warm pass after a restart")
    for col in ("req", "prompt", "hit cold", "hit warm", "warm tier", "TTFT cold",
                "TTFT warm", "gain", "stored", "same"):
        table.add_column(col, justify="left" if col in ("req", "warm tier") else "right")
    for r in report["requests"]:
        table.add_row(r["request"], str(r["prompt_tokens"]), str(r["cold_hit_tokens"]),
                      str(r["warm_hit_tokens"]), r["warm_tier"], f"{r['cold_ttft_ms']:.1f}",
                      f"{r['warm_ttft_ms']:.1f}", f"{r['ttft_speedup']:.1f}x",
                      f"{r['bytes_stored'] / 1e6:.2f}M", "yes" if r["same_tokens"] else "NO")
    t = report["totals"]
    table.add_section()
    table.add_row("total", str(t["prompt_tokens"]), str(t["cold_hit_tokens"]),
                  str(t["warm_hit_tokens"]), "", f"{t['cold_ttft_ms']:.1f}",
                  f"{t['warm_ttft_ms']:.1f}", f"{t['ttft_speedup']:.1f}x",
                  f"{t['bytes_stored'] / 1e6:.2f}M", "yes" if t["all_same_tokens"] else "NO")
    console.print(table)
    console.print("req: A1-A3 are one user's turns (each repeats the history), B1-D1 other users "
                  "with the same system prompt; prompt/hit in tokens; TTFT in ms; stored in bytes "
                  "written by the cold pass; same: warm output equals cold output token for token.")


def _chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = report["requests"]
    labels = [r["request"] for r in reqs]
    x = range(len(reqs))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], [r["cold_ttft_ms"] for r in reqs], 0.4, label="cold pass")
    ax.bar([i + 0.2 for i in x], [r["warm_ttft_ms"] for r in reqs], 0.4, label="warm pass")
    ax.set_xticks(list(x), labels, rotation=20, ha="right")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"semcomm KV prefix cache - TTFT per request (total {report['totals']['ttft_speedup']}x faster warm)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(app: typer.Typer) -> None:
    """Attach the `quickstart` command to the main app."""

    @app.command()
    def quickstart(
        json_path: Annotated[
            Path | None, typer.Option("--json", help="Write the figures as JSON to FILE.")
        ] = None,
        png: Annotated[
            Path | None,
            typer.Option("--png", help="Write the TTFT chart to FILE "
                         "(default: $SEMCOMM_HOME/quickstart.png)."),
        ] = None,
        model: Annotated[
            str | None,
            typer.Option("--model", help="Model id or local path (default: a small offline model)."),
        ] = None,
        max_new_tokens: Annotated[
            int, typer.Option("--max-new-tokens", help="Tokens to generate per request.")
        ] = 16,
        threads: Annotated[
            int,
            typer.Option("--threads", help="torch CPU threads (0 = torch's default). The "
                         "quickstart model is tiny: one thread is as fast and much steadier on "
                         "a busy machine."),
        ] = 1,
    ) -> None:
        """Run a shared-system-prompt, multi-turn workload cold then warm and show what the KV cache saved."""
        import torch
        from rich.console import Console

        from ..security import semcomm_home

        home = semcomm_home()
        home.mkdir(parents=True, exist_ok=True)
        prev_threads = torch.get_num_threads()
        if threads > 0:
            torch.set_num_threads(threads)
        try:
            with Console().status("running the workload cold, then warm..."):
                report = run_quickstart(model, max_new_tokens=max_new_tokens, home=home)
        finally:
            torch.set_num_threads(prev_threads)
        _print(report)
        png_path = png if png is not None else home / "quickstart.png"
        _chart(report, png_path)
        Console().print(f"chart: {png_path}")
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report, indent=2))
            Console().print(f"figures: {json_path}")
