"""Measure an engine's prefill and decode costs and write a simulator calibration JSON.

Runs :class:`semcomm.engine.HFEngine` (a reference model, a model path, or a config-built model)
on this machine: prefill time of fresh prompts of several lengths, prefill time of new tokens
after a cached prefix (restored from a ``MemoryStore``), and decode speed. Fits
``prefill_s = overhead + per_token * new + per_pair * new * (cached + new / 2)`` by least squares
and writes the :class:`semcomm.routing.CostModel` fields, for
``semcomm route simulate --calibration FILE``.

Usage::

    python -m tools.train.routing_calibrate --out calib.json [--model PATH] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from semcomm.engine import HFEngine
from semcomm.kv import MemoryStore
from semcomm.routing import CostModel

console = Console(width=140)


def _model(path: str | None) -> tuple[Any, str]:
    if path:
        return path, path
    try:
        from semcomm.reference import receiver_path

        p = receiver_path()
        if (Path(p) / "config.json").is_file():
            return str(p), "reference receiver"
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back to a config-built model
        console.print(f"reference receiver unavailable ({exc}); using a config-built model")
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=768, max_position_embeddings=4096)
    return T.AutoModelForCausalLM.from_config(cfg).eval(), "config-built llama (4 layers, hidden 256)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/train_routing_calibration.json"))
    ap.add_argument("--model", default=None, help="model path or id (default: reference receiver)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, label = _model(args.model)
    engine = HFEngine(model, store=MemoryStore(), chunk_size=64, device="cpu")
    vocab = min(engine.vocab_size, 1000)
    max_pos = engine.max_positions or 2048
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, size=n).tolist()

    rows: list[tuple[int, int, float]] = []  # (new tokens, cached tokens, seconds)
    lengths = [n for n in (32, 64, 128, 256, 512, 1024) if n < max_pos // 2]
    engine.prefill(ids(32), store=False)  # warm-up
    for n in lengths:
        ts = []
        for _ in range(args.reps):
            ts.append(engine.prefill(ids(n), store=False).stats.prefill_ms / 1000.0)
        rows.append((n, 0, statistics.median(ts)))
    for cached in [c for c in (256, 512) if c + 128 < max_pos]:
        for new in (32, 128):
            ts = []
            for _ in range(args.reps):
                prefix = ids(cached)
                engine.prefill(prefix)  # stores the prefix chunks
                pre = engine.prefill(prefix + ids(new), store=False)
                ts.append(pre.stats.prefill_ms / 1000.0)
                rows.append((pre.stats.recomputed_tokens, pre.stats.hit_tokens, ts[-1]))
    a = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in rows])
    y = np.array([t for _, _, t in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    t0 = time.perf_counter()
    res = engine.generate(ids(64), max_new_tokens=48)
    tps = res.stats.decode_tokens_per_s or (48 / (time.perf_counter() - t0))
    cal = CostModel(
        prefill_overhead_s=float(coef[0]), prefill_s_per_token=float(coef[1]),
        prefill_s_per_token_pair=float(coef[2]), decode_step_s=float(1.0 / tps), decode_s_per_seq=0.0,
    )
    tab = Table(title=f"prefill measurements: {label}, {args.threads} thread(s)")
    for col in ("new tokens", "cached tokens", "measured ms", "fitted ms"):
        tab.add_column(col, justify="right")
    for n, c, t in rows:
        tab.add_row(str(n), str(c), f"{t * 1000:.2f}", f"{cal.prefill_s(n, c) * 1000:.2f}")
    console.print(tab)
    doc = {**cal.to_dict(), "source": f"tools.train.routing_calibrate: HFEngine, {label}, CPU {args.threads} thread(s)",
           "notes": "decode_s_per_seq is 0: HFEngine decodes one sequence at a time"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    console.print(doc)
    console.print(f"wrote {args.out}; use: semcomm route simulate --calibration {args.out} ...")


if __name__ == "__main__":
    main()
