"""C2C on the reference pair (``semcomm fusion eval/train``): the data split, training examples
and eval items of the reference world, and the evaluation run.

The split is by fact: a fixed hash of each fact id puts it in the fuser's training half or
its held-out half, across both the receiver's "seen" and "unseen" facts. The fuser never
trains on any question about a held-out fact, so held-out accuracy measures knowledge the
fuser carried from the sharer's cache, not knowledge stored in the fuser.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ...fusion import (
    EvalSettings,
    FusionExample,
    FusionPipeline,
    MCItem,
    ModelSide,
    evaluate,
    load_fuser,
    load_side,
    oracle_enrichment,
    read_fuser_config,
    shipped_fuser_path,
)

__all__ = [
    "c2c_accuracy_metric",
    "fact_is_heldout",
    "load_reference_sides",
    "read_mc_items",
    "reference_examples",
    "reference_items",
    "run_eval",
    "validation_items",
    "write_examples",
    "write_mc_items",
]

HELDOUT_FRACTION = 0.5
SPLIT_SALT = "semcomm-fusion-split-v1"




def fact_is_heldout(fact_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Deterministic per-fact split (SHA-256 of a salted id, never Python ``hash()``)."""
    h = hashlib.sha256(f"{SPLIT_SALT}:{fact_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def _background_prompt(question: str) -> str:
    # T2T: the sharer writes what it knows in the world's support-conversation form
    # ("user: ... / assistant: <one short sentence>"), the paper's "describe the background"
    return f"user: {question}\nassistant:"


def reference_items(world: Any, *, heldout: bool = True, limit: int | None = None) -> list[MCItem]:
    """Multiple-choice items of held-out (or training) facts, seen and unseen interleaved."""
    from ...reference import format_qa

    by_split: dict[str, list[MCItem]] = {"seen": [], "unseen": []}
    facts = {f.id: f for f in world.facts}
    for q in world.mc_questions("all"):
        if fact_is_heldout(q.fact_id) != heldout:
            continue
        by_split[q.split].append(
            MCItem(
                id=q.id,
                prompt=q.prompt,
                qa_prompt=format_qa(q.question),
                options=tuple(q.options),
                answer_index=int(q.answer_index),
                background_prompt=_background_prompt(q.question),
                split=q.split,
                context=facts[q.fact_id].statement,
            )
        )
    # interleave so that any prefix (a --limit) keeps the seen/unseen balance
    out: list[MCItem] = []
    for a, b in zip(by_split["unseen"], by_split["seen"]):
        out += [a, b]
    n = min(len(by_split["unseen"]), len(by_split["seen"]))
    out += by_split["unseen"][n:] + by_split["seen"][n:]
    return out[:limit] if limit else out


VAL_SALT = "semcomm-fusion-val-v1"


def fact_is_validation(fact_id: str, fraction: float = 0.15) -> bool:
    """Among training facts, those kept for validation (early stopping)."""
    h = hashlib.sha256(f"{VAL_SALT}:{fact_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def reference_examples(
    world: Any, *, answer_mode: str = "loglik", part: str = "all", statements: bool = False
) -> list[FusionExample]:
    """Training examples from the training half of the facts (all question paraphrases).

    ``loglik``: ``"question: Q answer:"`` -> ``" object."`` (what option scoring reads);
    ``letter``: also the multiple-choice prompt -> ``" c."``. ``part``: ``"all"`` training
    facts, or ``"train"``/``"val"`` (a fixed 15% of them kept for validation).
    ``statements``: also the training statement templates that end with the object.
    """
    from ...reference import format_qa

    def keep(fact_id: str) -> bool:
        if fact_is_heldout(fact_id):
            return False
        if part == "all":
            return True
        return fact_is_validation(fact_id) == (part == "val")

    out: list[FusionExample] = []
    for qa in world.qa_pairs("all"):
        if keep(qa.fact_id):
            out.append(FusionExample(shared=format_qa(qa.question), answer=f" {qa.answer}."))
    if statements:
        facts = {f.id: f for f in world.facts}
        for sent in world.sentences(heldout=False):
            f = facts[sent.fact_id]
            tail = f" {f.object}."
            if keep(f.id) and sent.text.endswith(tail) and len(sent.text) > len(tail):
                out.append(FusionExample(shared=sent.text[: -len(tail)], answer=tail))
    if answer_mode == "letter":
        for q in world.mc_questions("all"):
            if keep(q.fact_id):
                out.append(FusionExample(shared=q.prompt, answer=f" {q.letter}."))
    return out


def write_examples(examples: list[FusionExample], path: str | Path) -> Path:
    """Write examples as the JSON Lines file ``semcomm fusion train --data`` reads."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(json.dumps({"shared": ex.shared, "answer": ex.answer}) + "\n")
    return p








def load_reference_sides() -> tuple[ModelSide, ModelSide]:
    """(sharer, receiver) of the shipped reference pair."""
    s_path, r_path = _assets_paths()
    return load_side(s_path), load_side(r_path)


def _assets_paths() -> tuple[Path, Path]:
    from ...reference import receiver_path, sharer_path

    return sharer_path(), receiver_path()


def run_eval(
    *,
    sharer: str | Path | None = None,
    receiver: str | Path | None = None,
    fuser: str | Path | None = None,
    limit: int | None = None,
    answer_mode: str = "",
    oracle: bool = True,
    seed: int = 0,
    progress: Any = None,
) -> dict[str, Any]:
    """Evaluate receiver, sharer, T2T and C2C on held-out reference questions.

    Defaults: the shipped reference pair and the shipped fuser. Returns the JSON document
    ``semcomm fusion eval --json`` writes: ``{"receiver", "sharer", "t2t", "c2c"}`` (each with
    ``accuracy``, ``latency_s``...), plus ``"summary"``, ``"oracle"`` and ``"setup"``.
    """
    import time

    from ...reference import build_world

    if sharer is None or receiver is None:
        s_ref, r_ref = _assets_paths()
        sharer = sharer if sharer is not None else s_ref
        receiver = receiver if receiver is not None else r_ref
    s_side, r_side = load_side(sharer), load_side(receiver)
    fpath = Path(fuser) if fuser is not None else shipped_fuser_path()
    _, meta = read_fuser_config(fpath)
    fz = load_fuser(fpath, sharer=s_side.spec, receiver=r_side.spec)
    mode = answer_mode or str(meta.get("answer_mode", "loglik"))
    pipe = FusionPipeline(s_side, r_side, fz)
    items = reference_items(build_world(seed=seed), heldout=True, limit=limit or None)
    settings = EvalSettings(answer_mode=mode)
    t0 = time.perf_counter()
    results: dict[str, Any] = evaluate(pipe, items, settings, progress)
    oracle_res = oracle_enrichment(r_side, items, settings) if oracle else None
    summary = {
        "c2c_minus_receiver_points": (results["c2c"]["accuracy"] - results["receiver"]["accuracy"])
        * 100,
        "c2c_minus_t2t_points": (results["c2c"]["accuracy"] - results["t2t"]["accuracy"]) * 100,
        "t2t_over_c2c_latency": results["t2t"]["latency_s"]
        / max(results["c2c"]["latency_s"], 1e-9),
    }
    doc: dict[str, Any] = dict(results)
    doc["summary"] = summary
    doc["oracle"] = oracle_res
    doc["setup"] = {
        "items": len(items),
        "answer_mode": mode,
        "sharer": str(sharer),
        "receiver": str(receiver),
        "fuser": str(fpath),
        "fuser_params": fz.num_parameters(),
        "sharer_params": sum(p.numel() for p in s_side.model.parameters()),
        "receiver_params": sum(p.numel() for p in r_side.model.parameters()),
        "fuser_layers": fz.config.layers,
        "fuser_gates": fz.gates(),
        "seconds": time.perf_counter() - t0,
        "fuser_meta": meta,
    }
    return doc


def validation_items(world: Any) -> list[MCItem]:
    """Multiple-choice items for the validation facts: every question paraphrase, scored
    against the options of that fact's multiple-choice question (never a held-out fact)."""
    from ...reference import format_qa

    mcs = {q.fact_id: q for q in world.mc_questions("all")}
    out: list[MCItem] = []
    for qa in world.qa_pairs("all"):
        if fact_is_heldout(qa.fact_id) or not fact_is_validation(qa.fact_id):
            continue
        mc = mcs[qa.fact_id]
        out.append(
            MCItem(
                id=qa.id,
                prompt=mc.prompt,
                qa_prompt=format_qa(qa.question),
                options=tuple(mc.options),
                answer_index=int(mc.answer_index),
                background_prompt=_background_prompt(qa.question),
                split=qa.split,
            )
        )
    return out


def c2c_accuracy_metric(sharer: ModelSide, receiver: ModelSide, items: list[MCItem]) -> Any:
    """A ``val_metric`` for :class:`FusionTrainer`: C2C option accuracy on ``items``."""

    def metric(fuser: Any) -> float:
        pipe = FusionPipeline(sharer, receiver, fuser, check=False)
        res = evaluate(pipe, items, EvalSettings(methods=("c2c",)))
        return float(res["c2c"]["accuracy"])

    return metric


def write_mc_items(items: list[MCItem], path: str | Path) -> Path:
    """Write multiple-choice validation items as JSON Lines (``--val-data`` of ``fusion train``):
    ``{"shared": prompt, "options": [...], "answer_index": k}``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as fh:
        for it in items:
            row = {
                "shared": it.qa_prompt,
                "options": list(it.options),
                "answer_index": it.answer_index,
            }
            fh.write(json.dumps(row) + "\n")
    return p


def read_mc_items(path: str | Path) -> list[MCItem]:
    """Read multiple-choice items written by :func:`write_mc_items` (errors name the line)."""
    from ...errors import InvalidInputError

    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"validation data {p} does not exist")
    out: list[MCItem] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            shared, options, k = row["shared"], row["options"], int(row["answer_index"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(
                f"{p}:{n}: expected {{'shared', 'options', 'answer_index'}} ({exc})"
            ) from exc
        if (
            not isinstance(shared, str)
            or not isinstance(options, list)
            or not 0 <= k < len(options)
        ):
            raise InvalidInputError(f"{p}:{n}: bad 'shared', 'options' or 'answer_index'")
        out.append(
            MCItem(
                id=f"val-{n}",
                prompt=shared,
                qa_prompt=shared,
                options=tuple(map(str, options)),
                answer_index=k,
                background_prompt="",
            )
        )
    if not out:
        raise InvalidInputError(f"validation data {p} holds no items")
    return out
