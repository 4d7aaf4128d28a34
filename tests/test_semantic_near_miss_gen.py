"""The near-miss guard against generated adversarial traffic (tests/_near_misses.py): at least
1,000 pairs per kind (numbers, dates, units, negations, swapped entities), each a query that
changes what its scope's stored entries asked, on the default embedder (all-MiniLM-L6-v2) and
the default policy (cross-encoder verifier on lone candidates, answer clusters with the intent
check): none is served. Each group's control (a stored question asked again) must be served,
so a cache that serves nothing fails."""

from __future__ import annotations

from typing import Any

import pytest

from semcomm import SemanticCache

from ._near_misses import KINDS, Group, groups
from ._semantic_helpers import minilm  # noqa: F401


def run_kind(cache: SemanticCache, kind: str) -> tuple[int, list[tuple[str, str, str]], int,
                                                        int]:
    """(pairs, served [(stored nearest, query, answer)], controls, controls served)."""
    gs: list[Group] = groups(kind)
    emb = cache.embedder
    queries = [q for g in gs for q in g.queries] + [g.control for g in gs]
    vecs = emb.embed(queries)
    stored_vecs = emb.embed([q for g in gs for q, _ in g.stored])
    served: list[tuple[str, str, str]] = []
    controls_served = 0
    i = j = 0
    for n, g in enumerate(gs):
        scope = f"{kind}:{n}"
        for q, a in g.stored:  # one at a time, as the gateway stores answers
            cache.store(q, a, scope=scope, embedding=stored_vecs[j])
            j += 1
        for q in g.queries:
            hit = cache.lookup(q, scope=scope, embedding=vecs[i])
            i += 1
            if hit is not None:
                served.append((hit.query if hasattr(hit, "query") else "", q, hit.answer))
    for n, g in enumerate(gs):
        hit = cache.lookup(g.control, scope=f"{kind}:{n}", embedding=vecs[i])
        i += 1
        controls_served += hit is not None
    return i - len(gs), served, len(gs), controls_served


@pytest.fixture(scope="module")
def cache(minilm: Any) -> SemanticCache:  # noqa: F811
    return SemanticCache(embedder=minilm)


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_generated_near_miss_is_served(cache: SemanticCache, kind: str) -> None:
    pairs, served, controls, ok = run_kind(cache, kind)
    assert pairs >= 1000
    assert ok >= 0.95 * controls, f"{ok} of {controls} controls served: the cache is not serving"
    assert served == [], f"{len(served)} of {pairs} served, e.g. {served[:5]}"


def test_the_reported_pair_is_refused(cache: SemanticCache) -> None:
    """The probe's finding: 96034 was served the answer about 96033 (a cluster of number
    questions with answers that name their number)."""
    scope = "probe:96033"
    for n in (12345, 922213, 96033, 4471):
        cache.store(f"Write one sentence about the number {n}.",
                    f"The number {n} is an interesting number with many properties.",
                    scope=scope)
    assert cache.lookup("Write one sentence about the number 96034.", scope=scope) is None
    assert cache.lookup("Write one sentence about the number 96033.", scope=scope) is not None


if __name__ == "__main__":  # diagnosis: python -m tests.test_semantic_near_miss_gen
    from semcomm.semantic import default_embedder

    c = SemanticCache(embedder=default_embedder())
    for k in KINDS:
        p, s, n, ok = run_kind(c, k)
        print(f"{k}: {len(s)} of {p} served; controls {ok}/{n}")
        for row in s[:8]:
            print("   ", row)


# --- the guard's checks, one pair each (no model) ---------------------------------------------

VETOED = [
    ("How do I get a refund within 5 days?", "How do I get a refund within -5 days?", "number"),
    ("What is 3 minus 5?", "What is 5 minus 3?", "number"),
    ("Book a table for 7 pm.", "Book a table for 7 am.", "date"),
    ("What is on next week?", "What is on this week?", "date"),
    ("Is it warm in the morning?", "Is it warm in the evening?", "date"),
    ("How much is 5 kilograms?", "How much is 5 pounds?", "unit"),
    ("Is 30 minutes enough?", "Is 30 seconds enough?", "unit"),
    ("Convert 10 $ please", "Convert 10 € please", "unit"),
    ("Is it possible to pay by card?", "Is it impossible to pay by card?", "negation"),
    ("Is it legal to park here?", "Is it illegal to park here?", "negation"),
    ("Is Python better than Java?", "Is Java better than Python?", "roles"),
    ("How do I get from Paris to Lyon?", "How do I get from Lyon to Paris?", "roles"),
]
ALLOWED = [
    ("Which is better, Python or Java?", "Which is better, Java or Python?"),
    ("What is the difference between a crocodile and an alligator?",
     "What is the difference between an alligator and a crocodile?"),
    ("How many grams are in 5 kilograms?", "How many grams are in 5 kg?"),
    ("What happens on March 05?", "What happens on March 5?"),
    ("How long does shipping take?", "How many days does shipping take?"),
    ("Is it possible to pay by card?", "Can I pay by card?"),
]


@pytest.mark.parametrize(("a", "b", "reason"), VETOED)
def test_guard_vetoes(a: str, b: str, reason: str) -> None:
    from semcomm.semantic import LexicalGuard

    assert LexicalGuard().check(a, b).reason == reason
    assert LexicalGuard().check(b, a).reason == reason


@pytest.mark.parametrize(("a", "b"), ALLOWED)
def test_guard_lets_paraphrases_through(a: str, b: str) -> None:
    from semcomm.semantic import LexicalGuard

    assert LexicalGuard().check(a, b).ok and LexicalGuard().check(b, a).ok
