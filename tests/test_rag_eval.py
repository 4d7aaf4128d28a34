"""``semcomm rag eval``: scoring, data validation, and the output contract on a real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from semcomm.cli import app
from semcomm.cli._tools.rag_eval import (
    exact_match,
    f1_score,
    load_items,
    normalize_answer,
    rag_segments,
)
from semcomm.engine import Document, User
from semcomm.errors import InvalidInputError

ITEM = {"question": "What is the capital of Germany?", "answers": ["Berlin"],
        "ctxs": [{"title": "Paris", "text": "Paris is the capital of France."},
                 {"title": "Berlin", "text": "Berlin is the capital of Germany."},
                 {"title": "Rome", "text": "Rome is the capital of Italy."}]}


def test_scores_follow_squad_normalisation() -> None:
    assert normalize_answer("The  Berlin!") == "berlin"
    assert exact_match("the Berlin.", ["Berlin"]) == 1.0
    assert exact_match("Berlin, Germany", ["Berlin"]) == 0.0
    assert f1_score("Berlin, Germany", ["Berlin"]) == pytest.approx(2 / 3)
    assert f1_score("nothing", ["Berlin", "nothing at all"]) == pytest.approx(2 * (1 / 3) / (1 + 1 / 3))
    assert f1_score("", ["Berlin"]) == 0.0


def test_items_load_from_json_or_jsonl_in_file_order(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([ITEM, {**ITEM, "question": "second"}]))
    (tmp_path / "a.jsonl").write_text(json.dumps(ITEM) + "\n" + json.dumps({**ITEM, "question": "second"}) + "\n")
    for name in ("a.json", "a.jsonl"):
        items = load_items(tmp_path / name, 1)
        assert [i["question"] for i in items] == [ITEM["question"]]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(InvalidInputError, match="ctxs"):
        load_items(tmp_path / "bad.jsonl", 5)
    with pytest.raises(InvalidInputError, match="no data file"):
        load_items(tmp_path / "missing.json", 1)


def test_segments_keep_the_file_order_and_first_k() -> None:
    segs = rag_segments(ITEM, 2)
    docs = [s for s in segs if isinstance(s, Document)]
    assert [d.text for d in docs] == ["(Title: Paris) Paris is the capital of France.",
                                      "(Title: Berlin) Berlin is the capital of Germany."]
    assert isinstance(segs[-1], User) and "Germany" in (segs[-1].text or "")


@pytest.mark.slow
def test_rag_eval_writes_the_contract(tmp_path: Path) -> None:
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps(ITEM) + "\n" + json.dumps({**ITEM, "question": "Capital of Italy?",
                                                          "answers": ["Rome"]}) + "\n")
    out = tmp_path / "out.json"
    res = CliRunner().invoke(app, ["rag", "eval", "--data", str(data), "--limit", "1",
                                   "--json", str(out), "--docs", "2", "--selector", "epic",
                                   "--recompute", "0.5", "--max-new-tokens", "8",
                                   "--margin", "1.0"])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    for mode in ("full", "prefix", "concat", "reuse"):
        assert {"f1", "em", "ttft_s", "n"} <= set(got[mode]) and got[mode]["n"] == 1
    assert 0 <= got["reuse"]["agreement"] <= 1
    assert got["reuse"]["recompute"] == pytest.approx(0.5, abs=0.05)
    assert got["concat"]["recompute"] == 0.0
    assert got["full"]["agreement"] == 1.0 and got["prefix"]["agreement"] == 1.0
    assert got["meta"]["selector"] == "epic"
    # --margin 1.0 adds "gated": no first token is that sure, so it falls back to full prefill
    assert got["gated"]["fallback"] == 1.0 and got["gated"]["agreement"] == 1.0
    assert got["meta"]["margin"] == 1.0


@pytest.mark.slow
def test_anchor_head_computes_passages_after_the_prompts_own_head(tmp_path: Path) -> None:
    from semcomm.cli._tools.rag_eval import Runner
    from semcomm.models import DEFAULT_MODEL

    with pytest.raises(InvalidInputError, match="anchor"):
        Runner(DEFAULT_MODEL, anchor="middle")
    head = Runner(DEFAULT_MODEL, anchor="head")
    plain = Runner(DEFAULT_MODEL)
    prompt = head.prepare(ITEM, None)
    first = prompt.spans[0][0]
    assert list(head.docs.anchor) == list(prompt.ids[:first])  # instruction and first label
    assert len(head.docs.anchor) > len(plain.docs.anchor)
    assert head.docs.root != plain.docs.root  # stored apart from the template-anchored copies
    doc = Document("(Title: Rome) Rome is the capital of Italy.")
    assert head.docs.precompute(doc) > 0 and head.docs.is_stored(doc)
    out = tmp_path / "out.json"
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps(ITEM) + "\n")
    res = CliRunner().invoke(app, ["rag", "eval", "--data", str(data), "--limit", "1",
                                   "--json", str(out), "--docs", "2", "--anchor", "head",
                                   "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["meta"]["anchor"] == "head"
