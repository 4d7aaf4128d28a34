"""Training documents for the reference models, drawn from a world.

The corpus is built in passes: each pass visits every training fact once (seeded shuffle) and
emits one document mentioning it, of a kind drawn from :data:`MIX`. Bios and conversations
mention extra facts of the same subject (and of linked entities), so every fact is seen at least
once per pass. Few multiple-choice items (most of their tokens are wrong options): facts are
learned from statements and QA, and options are scored by log-likelihood.

Only facts of the requested split ever appear: the receiver's corpus (split ``"seen"``) holds no
``"unseen"`` object anywhere, so what it knows of those facts is chance.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from ._templates import DESKS, TEMPLATES
from .world import (
    LETTERS,
    ROUTER_PROMPT,
    SYSTEM_PROMPT,
    Fact,
    SplitArg,
    World,
    format_mc,
    format_qa,
)

__all__ = ["MIX", "documents"]

# Document kinds and their weights (per fact visit).
MIX: dict[str, float] = {
    "statement": 0.32,
    "bio": 0.15,
    "qa": 0.44,
    "conversation": 0.025,
    "mc": 0.04,
    "chain": 0.025,
}


def _render(template: str, f: Fact) -> str:
    article = ("an " if f.object[0] in "aeiou" else "a ") + f.object
    return template.format(s=f.subject, o=f.object, ao=article)


def documents(world: World, split: SplitArg, seed: int) -> Iterator[str]:
    """Endless stream of training documents (one pass = one document per fact)."""
    rng = random.Random(f"semcomm-corpus:{world.seed}:{split}:{seed}")
    facts = world.facts_in(split)
    by_subject: dict[str, list[Fact]] = {}
    for f in facts:
        by_subject.setdefault(f.subject, []).append(f)
    domain: dict[str, list[str]] = {}
    for f in world.facts:  # option values may come from any fact: they are just words
        values = domain.setdefault(f.relation, [])
        if f.object not in values:
            values.append(f.object)
    kinds = list(MIX)
    weights = [MIX[k] for k in kinds]

    def statement(f: Fact) -> str:
        tpl = TEMPLATES[f.relation].train
        return _render(tpl[rng.randrange(len(tpl))], f)

    def question(f: Fact) -> str:
        qs = TEMPLATES[f.relation].questions
        return _render(qs[rng.randrange(len(qs))], f)

    while True:
        order = list(facts)
        rng.shuffle(order)
        for f in order:
            kind = rng.choices(kinds, weights)[0]
            if kind == "statement":
                yield statement(f)
            elif kind == "bio":
                others = [g for g in by_subject[f.subject] if g.id != f.id]
                extra = rng.sample(others, min(len(others), rng.randrange(1, 3)))
                parts = [f] + extra
                rng.shuffle(parts)
                yield " ".join(statement(g) for g in parts)
            elif kind == "qa":
                yield format_qa(question(f), f.object)
            elif kind == "conversation":
                linked = [g for h in by_subject[f.subject] for g in by_subject.get(h.object, [])]
                pool = [g for g in by_subject[f.subject] + linked if g.id != f.id]
                picks = [f] + rng.sample(pool, min(len(pool), rng.randrange(0, 3)))
                lines = [f"system: {SYSTEM_PROMPT}"]
                for g in picks:
                    lines += [f"user: {question(g)}", f"assistant: {statement(g)}"]
                yield "\n".join(lines)
            elif kind == "mc":
                wrong = [v for v in domain[f.relation] if v != f.object]
                opts = rng.sample(wrong, 3)
                pos = rng.randrange(4)
                opts.insert(pos, f.object)
                yield format_mc(question(f), opts, LETTERS[pos])
            else:  # chain: router step or specialist step
                desk = DESKS[TEMPLATES[f.relation].subject_kind]
                q = question(f)
                if rng.random() < 0.5:
                    yield f"system: {ROUTER_PROMPT}\nrequest: {q}\nroute: {desk}."
                else:
                    kind_word = {"people desk": "people", "company desk": "companies",
                                 "product desk": "products", "city desk": "cities"}[desk]
                    yield (
                        f"system: you are the {desk} of the atlas. answer questions about "
                        f"{kind_word} in one short sentence.\nuser: {q}\nassistant: {statement(f)}"
                    )
