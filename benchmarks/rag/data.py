"""Development and check sets for ``semcomm rag eval`` in its item shape
``{"question", "answers": [...], "ctxs": [{"title", "text"}, ...]}``.

* ``nq``: Natural Questions (open) with its gold Wikipedia passage at position ``i % K`` of
  item ``i`` and ``K - 1`` distractors: other questions' gold passages (seeded, none containing
  an answer string), the "lost in the middle" set-up (../shared/data/rag/nq_open_oracle.jsonl).
* ``nq-long``: the same with 4 passages to a document, so 10 documents make prompts of about
  5.2k tokens (the 2k-6k-token prompts of a retriever that returns larger chunks).
* ``kv``: synthetic key-value retrieval: 75 (UUID, UUID) records cut into K documents of JSON
  lines, "the value of key X?" (../shared/data/rag/kv_retrieval_75_keys.jsonl).
* ``boolq``: BoolQ yes/no questions over their passage plus other questions' passages
  (../shared/data/workloads/boolq_dev.jsonl); used to check, not to tune.

Usage: ``python -m benchmarks.rag.data --set nq --n 20 --docs 10 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
SOURCES = {
    "nq": SHARED / "rag" / "nq_open_oracle.jsonl",
    "kv": SHARED / "rag" / "kv_retrieval_75_keys.jsonl",
    "boolq": SHARED / "workloads" / "boolq_dev.jsonl",
}


def _rows(path: Path, n: int) -> list[dict[str, Any]]:
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
            if len(out) >= n:
                break
    return out


def nq(n: int, docs: int, seed: int = 0, passages: int = 1) -> list[dict[str, Any]]:
    """``passages`` > 1: each document is that many passages (title line, text), so 10
    documents make the 2k-6k-token prompts of a retriever that returns larger chunks; the
    gold passage moves through every document and every place inside one."""
    pool = _rows(SOURCES["nq"], max(n * 4, 400))
    rng = random.Random(seed)
    items = []
    for i, row in enumerate(pool[:n]):
        gold = row["ctxs"][0]
        answers = [a.lower() for a in row["answers"]]
        others = [r["ctxs"][0] for j, r in enumerate(pool) if j != i
                  and not any(a in r["ctxs"][0]["text"].lower() for a in answers)]
        ctxs = rng.sample(others, docs * passages - 1)
        ctxs.insert(i % (docs * passages), gold)
        if passages > 1:
            ctxs = [{"title": "", "text": "\n\n".join(
                f'{c.get("title", "")}\n{c["text"]}' for c in ctxs[d * passages:(d + 1) * passages])}
                for d in range(docs)]
        items.append({"question": row["question"], "answers": row["answers"],
                      "ctxs": [{"title": c.get("title", ""), "text": c["text"]} for c in ctxs],
                      "gold": (i % (docs * passages)) // passages})
    return items


def kv(n: int, docs: int, seed: int = 0) -> list[dict[str, Any]]:
    items = []
    for row in _rows(SOURCES["kv"], n):
        recs = row["ordered_kv_records"]
        per = -(-len(recs) // docs)
        ctxs = []
        for d in range(docs):
            part = recs[d * per : (d + 1) * per]
            if part:
                ctxs.append({"title": "", "text": "\n".join(
                    f'"{k}": "{v}"' for k, v in part)})
        items.append({"question": f'What is the value associated with the key "{row["key"]}"?',
                      "answers": [row["value"]], "ctxs": ctxs})
    return items


def boolq(n: int, docs: int, seed: int = 0) -> list[dict[str, Any]]:
    pool = _rows(SOURCES["boolq"], max(n * 4, 200))
    rng = random.Random(seed)
    items = []
    for i, row in enumerate(pool[:n]):
        gold = {"title": row.get("title", ""), "text": row["passage"]}
        others = [{"title": r.get("title", ""), "text": r["passage"]} for r in pool
                  if r["passage"] != row["passage"]]
        ctxs = rng.sample(others, docs - 1)
        ctxs.insert(i % docs, gold)
        yes = str(row["answer"]).lower() in ("true", "yes")
        items.append({"question": row["question"].rstrip("?") + "? Answer yes or no.",
                      "answers": ["yes" if yes else "no"], "ctxs": ctxs})
    return items


def nq_long(n: int, docs: int, seed: int = 0) -> list[dict[str, Any]]:
    return nq(n, docs, seed, passages=4)


BUILDERS = {"nq": nq, "nq-long": nq_long, "kv": kv, "boolq": boolq}


def write(name: str, n: int, docs: int, out: Path) -> Path:
    items = BUILDERS[name](n, docs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(it) + "\n" for it in items))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=sorted(BUILDERS), default="nq")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--docs", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    print(write(a.set, a.n, a.docs, a.out))


if __name__ == "__main__":
    main()
