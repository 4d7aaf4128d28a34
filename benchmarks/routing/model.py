"""Model router benchmark: quality recovered against cost (APGR, CPT) on labelled questions.

Default data: the reference world's multiple-choice questions labelled by which reference model
answers them (``semcomm.reference.router_labels()``); ``--data`` takes any JSONL with a text field
and ``<model>_correct`` fields. Trains on the deterministic ``train`` part, evaluates on ``test``,
compares with a random router and with each model alone; writes JSON and a cost/quality PNG.

Usage::

    python -m benchmarks.routing.model [--data FILE] [--cost sharer=2 --cost receiver=1] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from semcomm.cli._tools.route_report import plot_cost_quality
from semcomm.routing import (
    ModelRouter,
    ModelSpec,
    QualityPredictor,
    load_labelled,
)
from semcomm.routing._model import evaluate_choices

console = Console(width=150)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=None, help="labelled JSONL (default: reference labels)")
    ap.add_argument("--text-field", default="question")
    ap.add_argument("--cost", action="append", default=[], help="MODEL=COST (default sharer=2, receiver=1)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--embedder", default=None, help="sentence-transformers path (default all-MiniLM-L6-v2)")
    ap.add_argument("--group-field", default="relation",
                    help="row field for a lookup-table baseline (per-group training accuracy); '' to skip")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 64 training rows, 32 test rows, no cross-validation")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    train = load_labelled(args.data, text_field=args.text_field, part="train")
    test = load_labelled(args.data, models=train.models, text_field=args.text_field, part="test")
    if args.quick:  # a smoke run: 64 training and 32 test rows (every row costs an embedding)
        train = dataclasses.replace(train, prompts=train.prompts[:64], correct=train.correct[:64])
        test = dataclasses.replace(test, prompts=test.prompts[:32], correct=test.correct[:32])
    costs = {"receiver": 1.0, "sharer": 2.0}
    for item in args.cost:
        name, _, val = item.partition("=")
        costs[name] = float(val)
    missing = [m for m in train.models if m not in costs]
    if missing:
        raise SystemExit(f"pass --cost for {missing}")
    router = ModelRouter([ModelSpec(m, costs[m]) for m in train.models], embedder=args.embedder)
    t = time.perf_counter()
    router.fit(train.prompts, train.correct, budget=0.5)
    fit_s = time.perf_counter() - t
    t = time.perf_counter()
    ev = router.evaluate(test.prompts, test.correct)
    eval_s = time.perf_counter() - t
    # a router that ignores the prompt: the same budget sweep with random scores
    rng = np.random.default_rng(0)
    rand_q = rng.random(test.correct.shape)
    rand = evaluate_choices(router.models, rand_q, test.correct, points=21, lambda_for=router._lambda_for,
                            choose=router._choose)

    # 4-fold cross-validation over all rows (the test part above is small: APGR varies by a few points)
    full = load_labelled(args.data, models=train.models, text_field=args.text_field, part="all")
    feats = router.features(full.prompts)
    fold = np.array([int.from_bytes(hashlib.blake2b(p.encode(), digest_size=4).digest(), "little") % 4
                     for p in full.prompts])
    cv = []
    for k in range(0 if args.quick else 4):
        pred = QualityPredictor().fit(feats[fold != k], full.correct[fold != k])
        cv.append(evaluate_choices(router.models, pred.predict(feats[fold == k]), full.correct[fold == k],
                                   points=21, lambda_for=router._lambda_for, choose=router._choose).apgr)

    # lookup-table baseline: each model's training accuracy within the row's group (e.g. relation)
    group_apgr = float("nan")
    if args.group_field and args.data is None:
        from semcomm.reference import router_labels

        group_of = {r["question"]: r.get(args.group_field) for r in router_labels()}
    elif args.group_field:
        group_of = {}
        for line in args.data.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                group_of[row.get(args.text_field)] = row.get(args.group_field)
    else:
        group_of = {}
    if group_of and all(group_of.get(p) is not None for p in train.prompts + test.prompts):
        acc: dict[str, list[np.ndarray]] = {}
        for p, y in zip(train.prompts, train.correct, strict=True):
            acc.setdefault(group_of[p], []).append(y)
        table = {g: np.mean(v, axis=0) for g, v in acc.items()}
        prior = train.correct.mean(axis=0)
        gq = np.array([table.get(group_of[p], prior) for p in test.prompts])
        group_apgr = evaluate_choices(router.models, gq, test.correct, points=21,
                                      lambda_for=router._lambda_for, choose=router._choose).apgr

    tab = Table(title=f"model router on {train.meta['source']}: train {len(train.prompts)}, test {ev.n}")
    for col in ("cost share", "quality", "PGR"):
        tab.add_column(col, justify="right")
    for s, q, g in zip(ev.cost_share, ev.quality, ev.pgr, strict=True):
        tab.add_row(f"{s:.3f}", f"{q:.3f}", f"{g:.3f}")
    console.print(tab)
    summary = Table(title="summary")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    for k, v in [("APGR (semcomm router)", ev.apgr), ("APGR (random scores)", rand.apgr),
                 ("APGR 4-fold CV mean", float(np.mean(cv)) if cv else float("nan")),
                 ("APGR 4-fold CV std", float(np.std(cv)) if cv else float("nan")),
                 (f"APGR ({args.group_field or 'group'} lookup table baseline)", group_apgr),
                 ("CPT50: cost share for 50% PGR", ev.cpt["cpt50"]), ("CPT80", ev.cpt["cpt80"]),
                 *[(f"quality, {m} alone", q) for m, q in ev.model_quality.items()],
                 ("oracle quality", ev.oracle_quality), ("fit seconds", fit_s), ("eval seconds", eval_s)]:
        summary.add_row(k, f"{v:.3f}")
    console.print(summary)
    plot_cost_quality(ev, args.out / "routing_model.png")
    doc = {"eval": ev.to_json(), "random": rand.to_json(), "cv_apgr": cv, "group_table_apgr": group_apgr, "costs": costs, "fit_s": fit_s, "eval_s": eval_s,
           "train": len(train.prompts), "source": train.meta["source"]}
    (args.out / "routing_model.json").write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {args.out / 'routing_model.json'} and routing_model.png")


if __name__ == "__main__":
    main()
