"""Would a larger base model make a better lone-entry verifier on Quora pairs? (validation only)

The Quora goal's limit is the cross-encoder that verifies lone candidates (AUC about 0.74
between right and wrong best candidates at cos >= 0.88 on quora-val, docs/BENCHMARKS.md).
Every verifier tried so far was MiniLM (6 layers of 384). This script trains a cross-encoder
on a base five times its size, all-mpnet-base-v2 (12 layers of 768, 110M parameters), with
the shipped adapter's training pairs (``bench_semantic_train_cross.py --recipe v1``: the
labelled pairs of ``meancache_val.csv`` and the candidates its seed-0 cache protocol offers),
and scores it on the same quora-val band. No fresh set is read.

Full back-propagation through mpnet costs about 3.5 s a batch of 32 on two cores (33 min an
epoch), so the lower layers stay frozen: their output for every training pair, in both input
orders, is computed once (``--top``: the upper layers trained, by default 4 of 12), and
the upper layers and a one-logit head on the mean-pooled tokens are trained on it (full
weights, dropout on, AdamW, warm-up then cosine decay, random input order per example).
The lower-layer states and a checkpoint (every 100 steps) go to ``--work``; a rerun resumes.

Printed and written to ``benchmarks/results/semantic_larger_cross.json``: the AUC in the band
of the new score (query first; both orders averaged; averaged with the shipped verifier's
logit), its paired bootstrap interval against the shipped verifier, and the lone cut
:func:`semcomm.semantic.calibrate_scored_cut` would choose with it on quora-val.

Put the base model together as ``bench_semantic_second_embedder.py``'s docstring says, then:

    python benchmarks/bench_semantic_larger_cross.py /tmp/mp/model/all-mpnet-base-v2   # ~50 min
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
from bench_semantic_common import DEFAULT_DATA
from bench_semantic_stack import BAND, auc, pair_logits, quora_val_rows
from bench_semantic_train_cross import (
    batches_by_length,
    lr_at,
    optimizer_step,
    training_pairs,
)
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from semcomm.semantic import LexicalGuard, calibrate_scored_cut

console = Console(width=160)


class SplitEncoder:
    """A transformers encoder cut in two: frozen lower layers, trainable upper layers and a
    one-logit head on the mean-pooled tokens."""

    def __init__(self, base: Path, top: int) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(base))
        self.enc = AutoModel.from_pretrained(str(base)).eval()
        layers = list(self.enc.encoder.layer)
        if not 0 < top <= len(layers):
            raise SystemExit(f"--top must be in 1..{len(layers)}, got {top}")
        self.split = len(layers) - top
        self.lower = torch.nn.ModuleList(layers[: self.split])
        self.upper = torch.nn.ModuleList(layers[self.split :])
        self.head = torch.nn.Linear(self.enc.config.hidden_size, 1)
        for p in self.enc.parameters():
            p.requires_grad_(False)

    def batch(self, q: list[str], c: list[str]) -> dict:
        return self.tok(q, c, padding=True, truncation=True, max_length=96, return_tensors="pt")

    def lower_states(self, q: list[str], c: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch(q, c)
        self.enc.encoder.layer = self.lower
        with torch.inference_mode():
            h = self.enc(**b).last_hidden_state
        return h, b["attention_mask"]

    def upper_logits(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        self.enc.encoder.layer = self.upper
        m4 = create_bidirectional_mask(config=self.enc.config, inputs_embeds=h,
                                       attention_mask=mask)
        out = self.enc.encoder(h, attention_mask=m4)[0]
        mf = mask.unsqueeze(-1).to(out.dtype)
        return self.head((out * mf).sum(1) / mf.sum(1)).squeeze(-1)

    def logits(self, pairs: list[tuple[str, str]], batch: int = 64) -> np.ndarray:
        """The whole model's logit of each (query, cached) pair."""
        self.upper.eval()
        out = np.zeros(len(pairs))
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        for s in range(0, len(order), batch):
            idx = order[s : s + batch]
            h, m = self.lower_states([pairs[i][0] for i in idx], [pairs[i][1] for i in idx])
            with torch.inference_mode():
                out[idx] = self.upper_logits(h, m).numpy()
        return out

    def state(self) -> dict:
        return {"upper": self.upper.state_dict(), "head": self.head.state_dict()}

    def load(self, st: dict) -> None:
        self.upper.load_state_dict(st["upper"])
        self.head.load_state_dict(st["head"])


def lower_cache(model: SplitEncoder, pairs: list[tuple[str, str, int]], f: Path) -> list:
    """Per training pair, the lower layers' states (float16, unpadded) in both input orders."""
    if f.is_file():
        return torch.load(f)  # type: ignore[no-any-return]
    cache: list[list] = [[None, None] for _ in pairs]
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    with Progress(console=console) as prog:
        task = prog.add_task("lower layers, both input orders", total=len(order))
        for s in range(0, len(order), 64):
            idx = order[s : s + 64]
            for o in (0, 1):
                h, m = model.lower_states([pairs[i][o] for i in idx],
                                          [pairs[i][1 - o] for i in idx])
                for k, i in enumerate(idx):
                    cache[i][o] = h[k, : int(m[k].sum())].to(torch.float16).clone()
            prog.advance(task, len(idx))
    tmp = f.with_suffix(".tmp")
    torch.save(cache, tmp)
    os.replace(tmp, f)
    return cache


def collate(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(h.shape[0] for h in states)
    h = torch.zeros(len(states), n, states[0].shape[1])
    m = torch.zeros(len(states), n, dtype=torch.long)
    for k, s in enumerate(states):
        h[k, : s.shape[0]] = s.float()
        m[k, : s.shape[0]] = 1
    return h, m


def train(model: SplitEncoder, pairs: list, cache: list, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    params = list(model.upper.parameters()) + list(model.head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    steps = max(1, int(len(pairs) * args.epochs / args.batch))
    ck_file = args.work / "checkpoint.pt"
    step, seconds, queue, losses = 0, 0.0, [], []
    if ck_file.is_file():
        ck = torch.load(ck_file, weights_only=False)
        model.load(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, seconds, queue, losses = ck["step"], ck["seconds"], ck["queue"], ck["losses"]
        rng.setstate(ck["rng"])
        console.print(f"resumed at step {step} of {steps}")

    def save() -> None:
        tmp = ck_file.with_suffix(".tmp")
        torch.save({"model": model.state(), "opt": opt.state_dict(), "step": step,
                    "seconds": seconds, "queue": queue, "losses": losses,
                    "rng": rng.getstate()}, tmp)
        os.replace(tmp, ck_file)

    lossf = torch.nn.BCEWithLogitsLoss()
    model.upper.train()  # dropout on
    with Progress(console=console) as prog:
        task = prog.add_task("training the upper layers", total=steps, completed=step)
        t_last = time.perf_counter()
        while step < steps:
            for g in opt.param_groups:
                g["lr"] = lr_at(step / steps, args.lr)
            if not queue:
                queue = batches_by_length(pairs, args.batch, rng)
            idx = queue.pop()
            h, m = collate([cache[i][rng.random() < 0.5] for i in idx])
            y = torch.tensor([float(pairs[i][2]) for i in idx])
            optimizer_step(opt, lossf(model.upper_logits(h, m), y), losses)
            step += 1
            now = time.perf_counter()
            seconds += now - t_last
            t_last = now
            prog.update(task, completed=step,
                        description=f"training the upper layers (loss {np.mean(losses[-50:]):.3f})")
            if step % 100 == 0:
                save()
    save()
    for p in params:
        p.requires_grad_(False)
    return {"steps": steps, "epochs": args.epochs, "seconds": round(seconds, 1),
            "final_loss": float(np.mean(losses[-100:]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=Path, help="a transformers encoder folder (all-mpnet-base-v2)")
    ap.add_argument("--top", type=int, default=4, help="upper layers trained (the rest frozen)")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--work", type=Path, default=Path("/tmp/semcomm-larger-cross"))
    ap.add_argument("--json", type=Path,
                    default=Path("benchmarks/results/semantic_larger_cross.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    model = SplitEncoder(args.base, args.top)
    pairs = training_pairs(DEFAULT_DATA, LexicalGuard())
    console.print(f"{len(pairs):,} training pairs ({sum(p[2] for p in pairs):,} same); "
                  f"{args.base.name}: layers {model.split + 1}-{model.split + args.top} of "
                  f"{model.split + args.top} trained")
    cache = lower_cache(model, pairs, args.work / f"lower_{args.base.name}_{model.split}.pt")
    trained = train(model, pairs, cache, args)
    del cache

    # quora-val: the best guard-passing lone candidate of each lookup (bench_semantic_stack.py)
    _, rows, n_pos = quora_val_rows()
    y = np.asarray([r["right"] for r in rows])
    cos = np.asarray([r["cos"] for r in rows])
    ex = np.asarray([r["exact"] for r in rows])
    band = (cos >= BAND) & ~ex
    t1 = time.perf_counter()
    fwd = model.logits([(r["q"], r["c"]) for r in rows])
    rev = model.logits([(r["c"], r["q"]) for r in rows])
    ms = (time.perf_counter() - t1) / (2 * len(rows)) * 1e3
    shipped = pair_logits([(r["q"], r["c"]) for r in rows])
    scores = {"shipped cross-encoder (MiniLM, the default)": shipped,
              f"{args.base.name}, query first": fwd,
              f"{args.base.name}, both orders averaged": (fwd + rev) / 2,
              f"{args.base.name} (both orders) averaged with the shipped logit":
                  ((fwd + rev) / 2 + shipped) / 2}
    rng = np.random.default_rng(0)
    boots = [rng.integers(0, int(band.sum()), int(band.sum())) for _ in range(args.boot)]
    yb, base = y[band], shipped[band]
    tab = Table(title=f"quora-val lone candidates at cos >= {BAND} ({band.sum()}, "
                      f"{yb.mean():.0%} right): AUC right vs wrong")
    for col in ("score", "AUC", "vs shipped [95 % CI]", "calibrated cut: precision (bound) / recall"):
        tab.add_column(col)
    res = {}
    for name, s in scores.items():
        a = auc(s[band], yb)
        d = np.asarray([auc(s[band][b], yb[b]) - auc(base[b], yb[b]) for b in boots])
        cut = calibrate_scored_cut(cos, 1 / (1 + np.exp(-s)), y, n_pos, exact=ex)
        res[name] = {"auc": a, "delta": a - auc(base, yb),
                     "delta_ci": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))],
                     "cut": {"threshold": cut.threshold, "min_score": cut.min_score,
                             "precision": cut.precision, "lower_bound": cut.lower_bound,
                             "recall": cut.recall, "reached": cut.reached}}
        tab.add_row(name, f"{a:.3f}", f"{res[name]['delta']:+.3f} [{res[name]['delta_ci'][0]:+.3f}, "
                    f"{res[name]['delta_ci'][1]:+.3f}]",
                    f"{cut.threshold:.2f} / {cut.min_score:.2f}: {cut.precision:.3f} "
                    f"({cut.lower_bound:.3f}) / {cut.recall:.3f}")
    console.print(tab)
    console.print(f"{args.base.name} cross-encoder: {ms:.1f} ms a pair on this box (batches of 64)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "base": args.base.name, "layers_trained": args.top, "layers": model.split + args.top,
        "training_pairs": len(pairs), "train": {**trained, "lr": args.lr, "batch": args.batch,
                                                "seed": args.seed},
        "band": int(band.sum()), "right_share": float(yb.mean()), "ms_per_pair": ms,
        "scores": res, "seconds": round(time.perf_counter() - t0, 1),
        "command": "python benchmarks/bench_semantic_larger_cross.py " + " ".join(sys.argv[1:]),
    }, indent=1) + "\n", encoding="utf-8")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
