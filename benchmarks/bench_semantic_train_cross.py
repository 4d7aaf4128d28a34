"""Train the cross-encoder verifier shipped in ``semcomm/semantic/assets/cross_verifier``.

The packaged all-MiniLM-L6-v2 gets a LoRA adapter (rank 16 on every attention and MLP
projection, 0.66 M trainable parameters) and a one-logit head on the mean-pooled tokens; both
texts are read together (``[CLS] query [SEP] cached [SEP]``, order swapped at random while
training). Training pairs come from ``meancache_val.csv`` only:

- every labelled pair of the file (duplicate or not), and
- what a cache would actually offer: the val split run through the cache protocol (store every
  first question, look up every second), the top-4 stored questions of each lookup with cosine
  >= 0.75 that pass the lexical guard, labelled by the duplicate components.

Then the held-out test protocol (``meancache_test.csv``, 2,000 pairs, as
``bench_semantic_quality.py``) is scored: for each lookup, the best cosine candidate that passes
the guard, with the cross-encoder's probability; the table gives precision and recall of
"cosine >= t and P >= p" for a few cuts. The default cut stored in ``config.json`` is
``threshold`` (P).

    python benchmarks/bench_semantic_train_cross.py                 # ~30 min on 2 CPU cores
    python benchmarks/bench_semantic_train_cross.py --epochs 0.05   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from bench_semantic_common import DEFAULT_DATA, build_protocol, read_pairs
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from semcomm.semantic import LexicalGuard, default_embedder
from semcomm.semantic._cross import CROSS_VERIFIER_DIR, FORMAT_VERSION, LORA_TARGETS, lora_wrap

console = Console()


def embed(texts: list[str]) -> np.ndarray:
    emb = default_embedder()
    return np.concatenate([emb.embed(texts[s : s + 256]) for s in range(0, len(texts), 256)])


def training_pairs(data: Path, guard: LexicalGuard) -> list[tuple[str, str, int]]:
    pairs = [(a, b, y) for a, b, y in read_pairs(data / "meancache_val.csv")]
    pv = build_protocol(data / "meancache_val.csv", seed=0)
    sims = embed(pv.queries) @ embed(pv.stored).T
    top = np.argsort(-sims, axis=1)[:, :4]
    for i, q in enumerate(pv.queries):
        for j in top[i]:
            if sims[i, j] < 0.75:
                break
            c = pv.stored[j]
            if guard(q, c):
                pairs.append((q, c, int(pv.same(q, c))))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=CROSS_VERIFIER_DIR)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/semantic_cross.json"))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.5, help="default P cut in config.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from transformers import AutoModel, AutoTokenizer

    from semcomm.semantic._cross import _base_path

    base = _base_path()
    tok = AutoTokenizer.from_pretrained(base)
    enc = AutoModel.from_pretrained(base)
    adapters = lora_wrap(enc, args.rank, args.alpha)
    head = torch.nn.Linear(enc.config.hidden_size, 1)
    guard = LexicalGuard()

    def logits(q: list[str], c: list[str]) -> torch.Tensor:
        b = tok(q, c, padding=True, truncation=True, max_length=96, return_tensors="pt")
        h = enc(**b).last_hidden_state
        m = b["attention_mask"].unsqueeze(-1).float()
        return head((h * m).sum(1) / m.sum(1)).squeeze(-1)

    pairs = training_pairs(args.data, guard)
    params = [p for a in adapters for p in (a.lora_a, a.lora_b)] + list(head.parameters())
    console.print(f"{len(pairs):,} training pairs ({sum(p[2] for p in pairs):,} positive), "
                  f"{sum(p.numel() for p in params):,} trainable parameters")
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    steps = max(1, int(len(pairs) * args.epochs / args.batch))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps,
                                                pct_start=0.1)
    lossf = torch.nn.BCEWithLogitsLoss()
    order: list[int] = []
    losses = []
    t0 = time.perf_counter()
    # eval mode (no dropout): the adapter is small and the base stays as packaged
    with Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn(),
                  console=console) as prog:
        task = prog.add_task("train", total=steps, loss=float("nan"))
        for _ in range(steps):
            if not order:
                order = list(range(len(pairs)))
                random.shuffle(order)
            idx = [order.pop() for _ in range(min(args.batch, len(order)))]
            q = [pairs[i][0] for i in idx]
            c = [pairs[i][1] for i in idx]
            y = torch.tensor([float(pairs[i][2]) for i in idx])
            swap = [random.random() < 0.5 for _ in idx]
            q2 = [cc if w else qq for qq, cc, w in zip(q, c, swap, strict=True)]
            c2 = [qq if w else cc for qq, cc, w in zip(q, c, swap, strict=True)]
            loss = lossf(logits(q2, c2), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            prog.update(task, advance=1, loss=float(np.mean(losses[-50:])))
    train_s = time.perf_counter() - t0

    from safetensors.torch import save_file

    tensors = {}
    for i in range(len(enc.encoder.layer)):
        for j, target in enumerate(LORA_TARGETS):
            a = adapters[i * len(LORA_TARGETS) + j]
            tensors[f"layer{i}.{target}.lora_a"] = a.lora_a.detach().to(torch.float16).contiguous()
            tensors[f"layer{i}.{target}.lora_b"] = a.lora_b.detach().to(torch.float16).contiguous()
    tensors["head.weight"] = head.weight.detach().float().contiguous()
    tensors["head.bias"] = head.bias.detach().float().contiguous()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "adapter.safetensors"))
    cfg = {"format_version": FORMAT_VERSION, "base": None, "base_name": "all-MiniLM-L6-v2",
           "rank": args.rank, "alpha": args.alpha, "layers": len(enc.encoder.layer),
           "targets": list(LORA_TARGETS), "pooling": "mean", "max_length": 96,
           "threshold": args.threshold,
           "train": {"data": "meancache_val.csv", "pairs": len(pairs), "epochs": args.epochs,
                     "lr": args.lr, "batch": args.batch, "seed": args.seed,
                     "seconds": round(train_s, 1), "final_loss": float(np.mean(losses[-50:])),
                     "command": "python benchmarks/bench_semantic_train_cross.py"}}
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
    console.print(f"wrote {args.out} ({(args.out / 'adapter.safetensors').stat().st_size:,} bytes)"
                  f" after {train_s:.0f} s")
    evaluate(args, guard)


def evaluate(args: argparse.Namespace, guard: LexicalGuard) -> None:
    """Held-out test protocol: precision/recall of cosine + guard with and without the cross-
    encoder, through the shipped loader (what users run)."""
    from semcomm.semantic import CrossEncoderVerifier

    xv = CrossEncoderVerifier(args.out)
    pt = build_protocol(args.data / "meancache_test.csv", seed=0, limit=2000)
    sims = embed(pt.queries) @ embed(pt.stored).T
    top = np.argsort(-sims, axis=1)[:, :8]
    hd = pt.has_dup_stored()
    n = len(pt.queries)
    cos = np.full(n, -np.inf)
    prob = np.zeros(n)
    right = np.zeros(n, bool)
    with Progress(console=console) as prog:
        task = prog.add_task("scoring the test protocol", total=n)
        for i, q in enumerate(pt.queries):
            for j in top[i]:
                if guard(q, pt.stored[j]):
                    cos[i] = sims[i, j]
                    right[i] = pt.same(q, pt.stored[j])
                    if cos[i] >= 0.80:
                        prob[i] = xv.score(q, pt.stored[j])
                    break
            prog.advance(task)
    rows = []
    tbl = Table(title="test protocol (2,000 pairs): best guarded candidate")
    for col in ("cosine >=", "P >=", "hits", "precision", "recall"):
        tbl.add_column(col)
    for t in (0.85, 0.88, 0.90, 0.92, 0.94):
        for p in (0.0, 0.5, 0.6, 0.7, 0.8):
            hit = (cos >= t) & (prob >= p) if p else cos >= t
            nh = int(hit.sum())
            prec = float(right[hit].mean()) if nh else 1.0
            rec = float((hit & right).sum() / max(1, hd.sum()))
            rows.append({"cos": t, "p": p, "hits": nh, "precision": prec, "recall": rec})
            tbl.add_row(f"{t:.2f}", f"{p:.1f}" if p else "-", str(nh), f"{prec:.3f}", f"{rec:.3f}")
    console.print(tbl)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "queries_with_duplicate": int(hd.sum())},
                                    indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
