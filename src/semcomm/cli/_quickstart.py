"""CLI: `semcomm quickstart` - what each reuse layer saves, cold then warm.

Part 1, the KV prefix cache through the engine:
The workload is a shared system prompt and multi-turn follow-ups (6 requests). The cold pass
starts from an empty TieredStore (memory + a disk directory); the warm pass is a fresh engine
and a fresh memory tier over the same disk directory (a restart): its hits come from disk,
then from memory once promoted. ``quickstart_model()`` picks the model: the real default
SmolLM2-135M-Instruct from ``semcomm.models`` (pulled, digest-checked and converted on first
use, with a progress bar), falling back to the shipped reference receiver when it cannot be
pulled.

Part 2, the whole request path (``semcomm.server.run_demo``): the embedded default server
configuration run in-process on a customer-support and agent-chain workload, cold then warm,
reporting per stage (semantic cache, KV prefix cache, pipelines) what was saved, with a PNG and a
self-contained HTML report.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["quickstart_model", "quickstart_workload", "register", "run_quickstart"]

QUICKSTART_CHUNK = 32  # the support prompts are 200-300 tokens; 32-token chunks show turn-level reuse

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
    """(model, tokenizer, description) used by the quickstart.

    The real default model (:data:`semcomm.models.DEFAULT_MODEL`, SmolLM2-135M-Instruct),
    pulled on first use. When it cannot be pulled (no package index reachable), the shipped
    reference receiver, and as a last resort a config-built model with random weights; the
    description says which one answered.
    """
    from ..errors import SemcommError
    from ..models import DEFAULT_MODEL, model_path

    try:
        path = model_path(DEFAULT_MODEL)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        return model, tokenizer, f"{DEFAULT_MODEL} (real instruct model, float32) from {path}"
    except (SemcommError, OSError) as exc:
        import logging

        logging.getLogger("semcomm.quickstart").warning(
            "%s is not available (%s); the quickstart uses the reference receiver", DEFAULT_MODEL,
            exc)
    try:
        from ..reference import load_receiver, receiver_path

        model, tokenizer = load_receiver()
        return model, tokenizer, f"reference receiver (Qwen2-style, trained) from {receiver_path()}"
    except (ImportError, OSError, FileNotFoundError):
        return _config_built_model()


def _config_built_model() -> tuple[Any, Any, str]:
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


def quickstart_workload(source: str = "built-in") -> list[tuple[str, list[dict[str, str]]]]:
    """(label, chat messages) for each request: one user's multi-turn follow-ups, then other
    users under the same system prompt. The built-in Northwind Rail support workload (real
    English, for real models), or ``source="reference"``: the reference world's."""
    if source == "reference":
        from ..reference import build_world

        convs = [c.messages() for c in build_world().conversations(n=12, turns=3)]
        pairs = [c[1:3] for c in convs if len(c) >= 3]  # (user, assistant) exchanges
        if len(pairs) >= 6:
            system = convs[0][0]
            reqs: list[tuple[str, list[dict[str, str]]]] = []
            history = [system]
            for i, (u_msg, a_msg) in enumerate(pairs[:3]):  # one user's three turns
                reqs.append((f"A{i + 1}", history + [u_msg]))
                history = history + [u_msg, a_msg]
            for j, (u_msg, _) in enumerate(pairs[3:6]):  # other users, same system prompt
                reqs.append((f"{'BCD'[j]}1", [system, u_msg]))
            return reqs
    reqs = []
    history = [{"role": "system", "content": _SYSTEM}]
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

        from ..models import resolve_model

        path = resolve_model(model_path)  # a catalog name, a hub id or a local path
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        desc = f"model {model_path}" + (f" from {path}" if path != model_path else "")
    else:
        model, tokenizer, desc = quickstart_model()
    reqs = quickstart_workload("reference" if desc.startswith("reference") else "built-in")
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
                "question": msgs[-1]["content"],
                "answer": c.text,
            }
            for r, c, (_, msgs) in zip(rows, cold, reqs)
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

    console = Console(width=max(Console().width, 110))
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
    answers = Table(title="What the model answered (the same text cold and warm)")
    answers.add_column("req")
    answers.add_column("question")
    answers.add_column("answer")
    for r in report["requests"]:
        answers.add_row(r["request"], r["question"], (r.get("answer") or "").strip())
    console.print(answers)


def _print_gateway(demo: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    table = Table(title="Full request path (semcomm server, in-process): cold round, then warm round")
    for col in ("", "cold", "warm"):
        table.add_column(col, justify="left" if not col else "right")
    c, w = demo["cold"], demo["warm"]
    for key, label in (("requests", "requests"), ("prompt_tokens", "prompt tokens"),
                       ("semantic_hits", "semantic hits"),
                       ("kv_tokens_saved", "prompt tokens restored from KV"),
                       ("share_not_recomputed", "share of prompt not recomputed"),
                       ("latency_ms_total", "total latency (ms)"),
                       ("ttft_ms_median", "median TTFT (ms)")):
        if key in c:
            table.add_row(label, f"{c[key]:,}" if isinstance(c[key], int) else f"{c[key]:,.3g}",
                          f"{w[key]:,}" if isinstance(w[key], int) else f"{w[key]:,.3g}")
    console.print(table)
    stages = Table(title="Saved per stage (both rounds)")
    for col in ("stage", "hits", "tokens saved", "ms saved (est.)"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for layer, v in demo["stages"].items():
        stages.add_row(layer, str(v["hits"]), f"{v['tokens_saved']:,}",
                       f"{v['ms_saved_estimated']:,.0f}")
    console.print(stages)
    sp = demo["speedup"]
    console.print(f"warm round vs cold on the same requests: total latency {sp['latency_total']}x "
                  f"lower, median TTFT {sp['ttft_median']}x lower")


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
            typer.Option("--model", help="Catalog name (`semcomm models list`), hub id or local "
                         "path (default: smollm2-135m-instruct)."),
        ] = None,
        max_new_tokens: Annotated[
            int, typer.Option("--max-new-tokens", help="Tokens to generate per request.")
        ] = 16,
        full_path: Annotated[
            bool,
            typer.Option("--full-path/--kv-only",
                         help="Also run the whole request path through the embedded server "
                         "(semantic cache, model and replica routing, KV cache, pipelines)."),
        ] = True,
        html: Annotated[
            Path | None,
            typer.Option("--html", help="Write the full-path HTML report to FILE "
                         "(default: $SEMCOMM_HOME/quickstart.html)."),
        ] = None,
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
            with Console().status("KV prefix cache: running the workload cold, then warm..."):
                report = run_quickstart(model, max_new_tokens=max_new_tokens, home=home)
            _print(report)
            png_path = png if png is not None else home / "quickstart.png"
            _chart(report, png_path)
            Console().print(f"chart: {png_path}")
            if full_path:
                from ._tools.demo import run_demo, write_demo_chart, write_demo_report

                with Console().status("full request path: cold round, then warm round...") as st:
                    demo = run_demo(max_tokens=max_new_tokens,
                                    progress=lambda name: st.update(f"full request path: {name}"))
                _print_gateway(demo)
                html_path = html if html is not None else home / "quickstart.html"
                gw_png = png_path.with_name(png_path.stem + "-gateway.png")
                write_demo_report(demo, html_path)
                write_demo_chart(demo, gw_png)
                Console().print(f"report: {html_path}  chart: {gw_png}")
                report["gateway"] = demo
        finally:
            torch.set_num_threads(prev_threads)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report, indent=2))
            Console().print(f"figures: {json_path}")
