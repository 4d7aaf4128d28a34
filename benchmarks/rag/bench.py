"""Documents reused at any position: answer quality against TTFT, per selector and budget.

For each model and data set (benchmarks/rag/data.py: ``nq`` and ``kv`` development sets,
``boolq`` a check set), every question is answered by full prefill, prefix-only caching,
plain concatenation (r = 0) and each selector (cacheblend, epic, prophet) at each budget, all
from the same token ids (``semcomm.cli._tools.rag_eval``, what ``semcomm rag eval`` runs).
Reported per mode: F1, EM, agreement with full prefill's greedy answer, KL(full || mode) of
the first next-token distribution, TTFT median / p90 and the ratios to full and to prefix.
A table, JSON and one PNG (F1, and KL to full prefill, against TTFT per selector; one column
per model and set).

``--keys`` also measures the storage choice: document keys stored as computed (rotated at
the anchor's positions, moved by the difference) or un-rotated (at position 0, moved by the
target position), per codec: the error of the restored layer-0 keys against keys computed at
the target position, and the restore time.

Usage: ``python -m benchmarks.rag.bench [--quick] [--models a,b] [--sets nq,kv,boolq]
[--n 10] [--docs 10] [--budgets 0.15,0.3] [--threads 1] [--keys] [--json FILE] [--png FILE]``;
``--plot-from FILE`` redraws the tables and the PNG of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from benchmarks.common import write_json
from benchmarks.rag import data as rag_data
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from semcomm.cli._tools.rag_eval import Mode, Runner, run_eval

RESULTS = Path(__file__).resolve().parents[1] / "results"
SELECTORS = ("cacheblend", "epic", "prophet")
console = Console(width=None if sys.stdout.isatty() else 160)


def modes_for(selectors: list[str], budgets: list[float]) -> list[Mode]:
    out = [Mode("full", "full"), Mode("prefix", "prefix"), Mode("concat", "blend", "concat", 0.0)]
    for sel in selectors:
        for r in budgets:
            out.append(Mode(f"{sel}@{r:g}", "blend", sel, r))
    return out


def table(title: str, summary: dict[str, Any]) -> Table:
    t = Table(title=title)
    for col in ("mode", "F1", "F1/full", "EM", "agree", "KL", "recompute", "TTFT med s",
                "p90 s", "full/mode", "prefix/mode", "n"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    full, pre = summary["full"], summary["prefix"]
    for name, s in summary.items():
        rel = s["f1"] / full["f1"] if full["f1"] else float("nan")
        t.add_row(name, f"{s['f1']:.3f}", f"{rel:.2f}", f"{s['em']:.2f}",
                  "-" if s["agreement"] is None else f"{s['agreement']:.2f}",
                  "-" if s["kl"] is None else f"{s['kl']:.3f}", f"{s['recompute']:.3f}",
                  f"{s['ttft_s']:.3f}", f"{s['ttft_p90_s']:.3f}",
                  f"{full['ttft_s'] / s['ttft_s']:.2f}x", f"{pre['ttft_s'] / s['ttft_s']:.2f}x",
                  str(s["n"]))
    return t


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, s) for m, sets in results.items() for s in sets]
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7.5), squeeze=False)
    for col, (m, s) in enumerate(panels):
        summ = results[m][s]["summary"]
        for row, (key, label) in enumerate((("f1", "answer F1"),
                                            ("kl", "KL(full || mode), first token"))):
            ax = axes[row][col]
            for name, marker, color in (("full", "s", "black"), ("prefix", "D", "grey"),
                                        ("concat", "x", "red")):
                y = summ[name][key]
                if y is not None:
                    ax.scatter(summ[name]["ttft_s"], y, marker=marker, s=60, label=name,
                               color=color)
            for sel, color in zip(SELECTORS, ("tab:blue", "tab:orange", "tab:green")):
                pts = sorted((v["ttft_s"], v[key]) for k, v in summ.items()
                             if k.startswith(sel + "@") and v[key] is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=sel,
                            color=color)
            ax.set_xscale("log")
            ax.set_xlabel("TTFT median (s, log)")
            ax.set_ylabel(label)
            ax.set_title(f"{m} / {s} (n={summ['full']['n']})", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"wrote {path}")


def key_modes(model: str, codecs: list[str], n_docs: int = 4) -> list[dict[str, Any]]:
    """Restored layer-0 keys vs keys computed at the target position, per key mode and codec."""
    from semcomm.engine import Document, DocumentReuse, HFEngine
    from semcomm.engine import _cache_adapter as ca
    from semcomm.engine._documents import BlendStats, rotate_keys
    from semcomm.kv import MemoryStore

    items = rag_data.nq(n_docs, 2)
    base = HFEngine(model, store=None)
    rows = []
    for codec in codecs:
        for mode in ("rotated", "unrotated"):
            eng = HFEngine(base.model, base.tokenizer, store=MemoryStore(), codec=codec)
            docs = DocumentReuse(eng, key_mode=mode, keep_blended=False)
            errs, times = [], []
            for it in items:
                doc = Document(f"(Title: {it['ctxs'][0]['title']}) {it['ctxs'][0]['text']}")
                toks = docs.document_tokens(doc)
                docs.precompute(doc)
                prefix = docs.document_tokens(Document(it["ctxs"][1]["text"]))
                q = len(docs.anchor) + len(prefix)
                cache = ca.new_cache()
                with torch.inference_mode():
                    eng._runner.forward(torch.tensor([list(docs.anchor) + prefix + toks]), cache)
                want = ca.cache_layers(cache)[0][0][0, :, q:]
                lay = docs.layout
                bk = torch.empty((lay.num_layers, lay.kv_heads, len(toks), lay.k_dim))
                bv = torch.empty((lay.num_layers, lay.kv_heads, len(toks), lay.v_dim))
                t0 = time.perf_counter()
                assert docs._fetch_document(docs.document_keys(toks), len(toks), bk, bv, 0,
                                            BlendStats())
                delta = (q - len(docs.anchor) if mode == "rotated"
                         else torch.arange(q, q + len(toks)))
                bk = rotate_keys(bk, delta, docs.spec)
                times.append(time.perf_counter() - t0)
                errs.append(float((bk[0] - want).norm() / want.norm()))
            rows.append({"model": model, "codec": codec, "keys": mode,
                         "layer0_key_rel_error": statistics.fmean(errs),
                         "restore_ms": 1e3 * statistics.median(times)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="RAG: documents reused at any position")
    ap.add_argument("--quick", action="store_true", help="smollm2 only, 3 NQ questions of 5 "
                    "passages, budget 0.15")
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--sets", default="nq,kv,boolq", help="names, each optionally with its "
                    "own question count: nq:10,kv:4")
    ap.add_argument("--n", type=int, default=10, help="questions per set")
    ap.add_argument("--docs", type=int, default=10)
    ap.add_argument("--budgets", default="0.15,0.3")
    ap.add_argument("--selectors", default=",".join(SELECTORS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--keys", action="store_true", help="also measure the key storage modes")
    ap.add_argument("--json", type=Path, default=RESULTS / "rag.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "rag.png")
    ap.add_argument("--plot-from", type=Path, default=None,
                    help="only draw the PNG (and print the tables) of an earlier JSON")
    a = ap.parse_args()
    if a.plot_from is not None:
        saved = json.loads(a.plot_from.read_text())["results"]
        for model, sets in saved.items():
            for name, res in sets.items():
                console.print(table(f"{model} / {name}: {res['n']} questions, "
                                    f"{res.get('prompt_tokens_mean', 0):.0f} prompt tokens (mean)",
                                    res["summary"]))
        plot(saved, a.png)
        return
    if a.quick:
        a.models, a.sets, a.n, a.docs, a.budgets = "smollm2-135m-instruct", "nq", 3, 5, "0.15"
    torch.set_num_threads(a.threads)
    budgets = [float(x) for x in a.budgets.split(",") if x]
    selectors = [s for s in a.selectors.split(",") if s]
    modes = modes_for(selectors, budgets)
    results: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="semcomm-rag-"))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        for model in [m for m in a.models.split(",") if m]:
            runner = Runner(model)
            results[model] = {}
            for spec in [s for s in a.sets.split(",") if s]:
                name, _, count = spec.partition(":")  # "nq:10": 10 questions of that set
                path = rag_data.write(name, int(count or a.n), a.docs, tmp / f"{name}.jsonl")
                items = [json.loads(x) for x in path.read_text().splitlines()]
                task = progress.add_task(f"{model} {name}", total=len(items))

                def report(stage: str, done: int, total: int, task: Any = task) -> None:
                    if stage == "answering":
                        progress.update(task, completed=done)

                res = run_eval(model, items, modes, docs=a.docs, runner=runner,
                               max_new_tokens=a.max_new_tokens, progress=report)
                res["prompt_tokens_mean"] = statistics.fmean(r["prompt_tokens"] for r in res["rows"])
                results[model][name] = res
                console.print(table(f"{model} / {name}: {len(items)} questions, {a.docs} passages,"
                                    f" {res['prompt_tokens_mean']:.0f} prompt tokens (mean),"
                                    f" {a.threads} thread(s)", res["summary"]))
                write_json(a.json, {"args": vars(a) | {"json": str(a.json), "png": str(a.png)},
                                    "results": results}, console)
    out: dict[str, Any] = {"args": vars(a) | {"json": str(a.json), "png": str(a.png)},
                           "results": results}
    if a.keys:
        rows = []
        for model in [m for m in a.models.split(",") if m]:
            rows += key_modes(model, ["lossless", "int8", "int4"])
        t = Table(title="document key storage: rotated vs un-rotated (layer-0 keys vs computed)")
        for col in ("model", "codec", "keys", "rel error", "restore ms"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["model"], r["codec"], r["keys"], f"{r['layer0_key_rel_error']:.2e}",
                      f"{r['restore_ms']:.2f}")
        console.print(t)
        out["key_modes"] = rows
    write_json(a.json, out, console)
    plot(results, a.png)


if __name__ == "__main__":
    main()
