"""The reference world: determinism, structure, splits and renderings."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from semcomm.errors import InvalidInputError
from semcomm.reference import LETTERS, SYSTEM_PROMPT, build_world, format_mc, format_qa


@pytest.fixture(scope="module")
def world():
    return build_world(0)


def test_same_seed_gives_identical_bytes_in_another_process(world) -> None:
    code = "from semcomm.reference import build_world; print(build_world(0).digest())"
    # PYTHONHASHSEED differs per process by default: the digest must not depend on it.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""})
    assert out.stdout.strip() == world.digest()
    assert build_world(0).to_json() == world.to_json()


def test_different_seed_gives_a_different_world(world) -> None:
    other = build_world(1)
    assert other.digest() != world.digest()
    assert [f.object for f in other.facts] != [f.object for f in world.facts]


def test_export_jsonl_is_sorted_json_and_byte_stable(world, tmp_path) -> None:
    a = world.export_jsonl(tmp_path / "a")
    b = build_world(0).export_jsonl(tmp_path / "b")
    assert [p.name for p in a] == [p.name for p in b]
    for pa, pb in zip(a, b):
        assert pa.read_bytes() == pb.read_bytes()
    facts = [json.loads(line) for line in (tmp_path / "a" / "facts.jsonl").read_text().splitlines()]
    assert len(facts) == len(world.facts)
    first = (tmp_path / "a" / "facts.jsonl").read_text().splitlines()[0]
    assert first == json.dumps(facts[0], sort_keys=True, separators=(",", ":"))


def test_world_size_and_relations(world) -> None:
    kinds = Counter(e.kind for e in world.entities)
    assert kinds == {"person": 100, "city": 20, "company": 24, "product": 40}
    assert len({e.name for e in world.entities}) == len(world.entities)  # names are unique
    assert len(world.facts) == 100 * 3 + 20 + 24 * 3 + 40 * 2
    assert {f.relation for f in world.facts} == set(world.relations)


def test_split_is_half_per_relation_and_disjoint(world) -> None:
    seen, unseen = world.facts_in("seen"), world.facts_in("unseen")
    assert len(seen) + len(unseen) == len(world.facts)
    assert not {f.id for f in seen} & {f.id for f in unseen}
    for rel in world.relations:
        n_seen = sum(f.relation == rel for f in seen)
        n_all = sum(f.relation == rel for f in world.facts)
        assert abs(n_seen - n_all / 2) <= 0.5


def test_text_is_lowercase_ascii_with_few_punctuation_marks(world) -> None:
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789 .,?:\n")
    for text in world.texts():
        assert set(text) <= allowed, text


def test_heldout_templates_never_appear_in_train_sentences(world) -> None:
    train = {s.text for s in world.sentences()}
    held = world.sentences(heldout=True)
    assert held and not train & {s.text for s in held}
    assert all(s.heldout for s in held)


def test_mc_questions_have_four_distinct_options_with_the_answer(world) -> None:
    mcs = world.mc_questions()
    assert len(mcs) == len(world.facts)
    positions = Counter(m.answer_index for m in mcs)
    assert set(positions) == {0, 1, 2, 3}
    for m in mcs:
        fact = world.fact(m.fact_id)
        assert len(set(m.options)) == 4 and m.answer == fact.object
        assert m.letter == LETTERS[m.answer_index] and m.split == fact.split
        assert m.prompt == format_mc(m.question, m.options) and m.prompt.endswith("answer:")
        assert m.qa_prompt == format_qa(m.question)
    assert {m.split for m in world.mc_questions("seen")} == {"seen"}


def test_paraphrase_groups_and_near_misses(world) -> None:
    groups = world.paraphrase_groups()
    assert len(groups) == len(world.facts)
    assert all(len(set(g.questions)) == 4 for g in groups)
    misses = world.near_misses()
    assert Counter(n.kind for n in misses) == {
        "entity": len(world.facts), "negation": len(world.facts), "number": 40, "date": 24}
    for n in misses:
        assert n.anchor != n.negative and n.anchor_answer != n.negative_answer
    assert all(" not " in n.negative for n in world.near_misses("negation"))
    with pytest.raises(InvalidInputError, match="near-miss kind"):
        world.near_misses("colour")


def test_conversations_share_the_system_prompt_and_state_their_facts(world) -> None:
    convs = world.conversations()
    assert len(convs) == len(world.entities)
    for c in convs:
        assert c.turns[0].role == "system" and c.turns[0].content == SYSTEM_PROMPT
        assert [t.role for t in c.turns[1:]] == ["user", "assistant"] * len(c.fact_ids)
        for fid, answer in zip(c.fact_ids, c.turns[2::2]):
            assert world.fact(fid).object in answer.content
    assert max(len(c.fact_ids) for c in convs) == 3
    assert all(c.split == "seen" for c in world.conversations(split="seen"))


def test_agent_chains_route_to_the_desk_of_the_subject(world) -> None:
    chains = world.agent_chains()
    assert len(chains) == len(world.facts)
    desks = {"person": "people desk", "company": "company desk", "product": "product desk",
             "city": "city desk"}
    for a in chains:
        kind = world.entity(world.fact(a.fact_id).subject_id).kind
        assert a.route == desks[kind]
        assert a.router_prompt.endswith("route:") and a.request in a.router_prompt
        assert a.specialist_prompt.endswith("assistant:") and a.answer == world.fact(a.fact_id).statement


def test_bad_arguments_raise_clear_errors(world) -> None:
    with pytest.raises(InvalidInputError, match="people"):
        build_world(0, people=10_000)
    with pytest.raises(InvalidInputError, match="seen_fraction"):
        build_world(0, seen_fraction=1.5)
    with pytest.raises(InvalidInputError, match="split"):
        world.facts_in("maybe")
    with pytest.raises(InvalidInputError, match="no fact"):
        world.fact("fact-9999")


def test_world_cli_exports_the_same_jsonl(world, tmp_path) -> None:
    from typer.testing import CliRunner

    from semcomm.cli import app

    result = CliRunner().invoke(app, ["reference", "world", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert world.digest()[:16] in result.output
    api = world.export_jsonl(tmp_path / "api")
    for path in api:
        assert (tmp_path / "cli" / path.name).read_bytes() == path.read_bytes()
