"""KV codecs: bytes per token vs lossless, relative K/V error, next-token KL and greedy agreement.

For each prompt the lossless engine prefills and stores the prompt; each codec engine stores
the same KV through its codec, restores the prompt from its store (all but the last token,
which is recomputed on top of the restored, dequantized prefix) and reports:

* bytes/token and the ratio against lossless (the chunk bytes actually loaded);
* relative error ||K - K'|| / ||K|| and ||V - V'|| / ||V|| of the restored prefix;
* KL(p_lossless || p_codec) of the next-token distribution, and top-1 agreement;
* greedy agreement: how many of the next ``--new`` greedy tokens match the lossless run.

Model: ``--model PATH`` (any HF causal LM folder, e.g. the reference receiver), else the
reference receiver if it is installed, else a config-built Qwen2.5-0.5B-shaped model with
random weights (4 of 24 layers; its logits are nearly flat, so KL there is a lower bound).
transformers' QuantizedCache (fp8 backend) is run side by side on the same greedy task.

Usage: ``python -m benchmarks.kv.codecs [--quick] [--json FILE] [--model PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.common import write_json
from semcomm.engine import GenerationStats, HFEngine, PrefillResult
from semcomm.kv import MemoryStore
from semcomm.kv._codecs import relative_error

CODECS = ["lossless", "fp8", "int8", "int4", "int2", "int4:g32:r32", "int2:g32:r32:o0.01"]
console = Console(width=None if sys.stdout.isatty() else 150)


def load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    if args.model:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model).eval(), None, args.model
    try:
        from semcomm.reference._assets import load_receiver

        model, tok = load_receiver(dtype=torch.float32)
        return model.eval(), tok, "reference receiver (float32)"
    except Exception:  # noqa: BLE001 - not built yet: fall back to a config-built model
        from transformers import AutoModelForCausalLM, Qwen2Config

        cfg = Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
            rope_theta=1_000_000.0, tie_word_embeddings=True, use_sliding_window=False,
        )
        torch.manual_seed(0)
        return (AutoModelForCausalLM.from_config(cfg).eval(), None,
                "Qwen2.5-0.5B-shaped, 4 of 24 layers, random weights")


def make_prompts(tok: Any, model: Any, n: int, n_tok: int) -> list[list[int]]:
    """Text from the reference world when there is a tokenizer, else random token ids."""
    if tok is not None:
        from semcomm.reference import build_world

        facts = [f.statement for f in build_world().facts]
        out = []
        for i in range(n):
            ids: list[int] = []
            j = i * 37
            while len(ids) < n_tok:
                ids += tok(facts[j % len(facts)] + ". ")["input_ids"]
                j += 1
            out.append(ids[:n_tok])
        return out
    vocab = model.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=n_tok).tolist() for _ in range(n)]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def greedy_match(a: list[int], b: list[int]) -> float:
    """Fraction of the reference continuation ``a`` that ``b`` reproduces before diverging."""
    if a == b:
        return 1.0
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), 1)


def hf_quantized_greedy(model: Any, ids: list[int], new: int) -> list[int] | str:
    try:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                             do_sample=False, cache_implementation="quantized",
                             cache_config={"backend": "fp8"}, pad_token_id=0)
        return out[0, len(ids):].tolist()
    except Exception as exc:  # noqa: BLE001 - record why it does not run
        return f"{type(exc).__name__}: {str(exc)[:100]}"


def bf16_agreement(model: Any, tok: Any, prompts: list[list[int]], args: argparse.Namespace
                   ) -> dict[str, float]:
    """bfloat16, lossless codec: warm (restored) vs the model's own greedy without a cache."""
    # a second copy loaded afresh: an engine may attach state to a model that does not deepcopy
    m16 = load(args)[0].to(torch.bfloat16)
    # keep_logits=False: the restored prefix with the last token recomputed (a whole hit with
    # its stored logits is the cold run, bit for bit)
    eng = HFEngine(m16, tok, store=MemoryStore(1 << 34), chunk_size=args.chunk_size, device="cpu",
                   keep_logits=False)
    top1, match = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            ref_logits = m16(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1].float()
        ref = m16.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new,
                           do_sample=False, use_cache=False, pad_token_id=0)[0, len(ids):].tolist()
        eng.prefill(ids)  # cold: stores the prompt
        warm = eng.prefill(ids)
        assert warm.stats.hit_tokens + warm.stats.recomputed_tokens == len(ids)
        top1.append(float(int(warm.last_logits.argmax()) == int(ref_logits.argmax())))
        match.append(greedy_match(ref, eng.generate(ids, max_new_tokens=args.new).token_ids))
    return {"top1_agreement": statistics.mean(top1), "greedy_match": statistics.mean(match)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tok, desc = load(args)
    n_prompts = 1 if args.quick else 4
    if args.quick:  # a smoke run: one short prompt, a few new tokens
        args.new = min(args.new, 4)
    max_pos = getattr(model.config, "max_position_embeddings", 4096)
    n_tok = min(384 if args.quick else 1024, max_pos - args.new - 1)
    prompts = make_prompts(tok, model, n_prompts, n_tok)
    base = HFEngine(model, tok, store=MemoryStore(1 << 34), chunk_size=args.chunk_size,
                    device="cpu", keep_logits=False)
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in CODECS}
    hf_rows: list[float] = []
    for ids in track(prompts, description="prompts", console=console):
        ref_pre = base.prefill(ids)
        ref_gen = base.generate(ids, max_new_tokens=args.new).token_ids
        ref_layers = [(layer.keys, layer.values) for layer in ref_pre.cache.layers]
        hf = hf_quantized_greedy(model, ids, args.new)
        if isinstance(hf, list):
            hf_rows.append(greedy_match(ref_gen, hf))
        for spec in CODECS:
            eng = HFEngine(model, tok, store=MemoryStore(1 << 34), chunk_size=args.chunk_size,
                           codec=spec, device="cpu", keep_logits=False)
            fake = PrefillResult(cache=ref_pre.cache, last_logits=torch.empty(0), input_ids=ids,
                                 stats=GenerationStats(prompt_tokens=len(ids)))
            eng._store_chunks(fake, eng.chunk_keys(ids))
            pre = eng.prefill(ids)
            st = pre.stats
            assert st.hit_tokens > 0 and st.hit_tokens + st.recomputed_tokens == len(ids)
            t = st.hit_tokens
            k_err = statistics.mean(relative_error(rk[:, :, :t], layer.keys[:, :, :t])
                                    for (rk, _), layer in zip(ref_layers, pre.cache.layers))
            v_err = statistics.mean(relative_error(rv[:, :, :t], layer.values[:, :, :t])
                                    for (_, rv), layer in zip(ref_layers, pre.cache.layers))
            gen = eng.generate(ids, max_new_tokens=args.new).token_ids
            r = rows[spec]
            for name, val in (
                ("bytes_per_token", st.bytes_loaded / len(ids)),
                ("k_rel_error", k_err), ("v_rel_error", v_err),
                ("kl", kl(ref_pre.last_logits, pre.last_logits)),
                ("top1", float(int(ref_pre.last_logits.argmax()) == int(pre.last_logits.argmax()))),
                ("greedy_match", greedy_match(ref_gen, gen)),
            ):
                r.setdefault(name, []).append(float(val))
    out_bf16 = bf16_agreement(model, tok, prompts, args)
    lossless_bpt = statistics.mean(rows["lossless"]["bytes_per_token"])
    out = {
        "model": desc, "prompt_tokens": n_tok, "prompts": n_prompts, "new_tokens": args.new,
        "chunk_size": args.chunk_size, "dtype": str(next(model.parameters()).dtype),
        "codecs": {},
        "hf_quantized_fp8_greedy_match": statistics.mean(hf_rows) if hf_rows else None,
        "bf16_lossless": out_bf16,
    }
    for spec, r in rows.items():
        m = {k: statistics.mean(v) for k, v in r.items()}
        m["ratio_vs_lossless"] = lossless_bpt / m["bytes_per_token"]
        out["codecs"][spec] = m
    return out


def show(res: dict[str, Any]) -> None:
    console.print(f"[bold]KV codecs[/] - {res['model']} ({res['dtype']}), {res['prompts']} prompts "
                  f"x {res['prompt_tokens']} tokens, chunk {res['chunk_size']}")
    t = Table()
    for c in ("codec", "bytes/token", "ratio", "K rel err", "V rel err", "KL next token",
              "top-1 agree", f"greedy match ({res['new_tokens']})"):
        t.add_column(c, justify="right")
    for spec, m in res["codecs"].items():
        t.add_row(spec, f"{m['bytes_per_token']:.0f}", f"{m['ratio_vs_lossless']:.2f}x",
                  f"{m['k_rel_error']:.4f}", f"{m['v_rel_error']:.4f}", f"{m['kl']:.1e}",
                  f"{m['top1']:.2f}", f"{m['greedy_match']:.2f}")
    hf = res["hf_quantized_fp8_greedy_match"]
    t.add_row("HF QuantizedCache fp8 (live)", "-", "-", "-", "-", "-", "-",
              "n/a" if hf is None else f"{hf:.2f}")
    console.print(t)
    b = res["bf16_lossless"]
    console.print(f"bfloat16, lossless, warm vs the model without cache: top-1 agreement "
                  f"{b['top1_agreement']:.2f}, greedy match {b['greedy_match']:.2f} "
                  f"(float32 is token-identical; see tests/test_engine_exactness.py)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 prompt x 384 tokens, 4 new")
    p.add_argument("--json", type=Path, help="write the results as JSON")
    p.add_argument("--model", help="HF model folder (default: reference receiver or config-built)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--new", type=int, default=16, help="greedy tokens compared")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args)
    show(res)
    if args.json:
        write_json(args.json, res, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
