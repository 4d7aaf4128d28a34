"""``semcomm agents eval``: the data shapes it reads and the output contract it writes (on the
reference receiver, a tiny shipped model: seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from semcomm.cli import app
from semcomm.cli._tools.agents_eval import correct, load_items, summarize
from semcomm.errors import InvalidInputError


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _eval_reference(data: Path, out: Path, *extra: str) -> dict:
    """``semcomm agents eval`` of 2 questions, 2 solvers, 4 new tokens, ``--watch 0`` on the
    shipped reference receiver; the JSON it wrote."""
    from semcomm.reference import receiver_path

    res = CliRunner().invoke(app, ["agents", "eval", "--data", str(data), "--limit", "2",
                                   "--json", str(out), "--agents", "2", "--model",
                                   str(receiver_path()), "--max-new-tokens", "4",
                                   "--watch", "0", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_both_data_shapes_and_the_limit(tmp_path: Path) -> None:
    gsm = _write(tmp_path / "g.jsonl", [
        {"question": "2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"},
        {"question": "1,000+1?", "answer": "#### 1,001"},
        {"question": "x", "answer": "#### 3"}])
    items = load_items(gsm, 2)
    assert [it["answer"] for it in items] == ["4", "1001"] and items[0]["kind"] == "math"
    assert correct("4", items[0]) and correct("4.0", items[0]) and not correct("5", items[0])
    mc = _write(tmp_path / "m.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 1}])
    (it,) = load_items(mc)
    assert it["kind"] == "choice" and correct(1, it) and not correct(0, it)
    with pytest.raises(InvalidInputError):
        load_items(_write(tmp_path / "bad.jsonl", [{"question": "q", "answer": 3}]))
    with pytest.raises(InvalidInputError):
        load_items(_write(tmp_path / "oob.jsonl", [{"question": "q", "choices": ["a"],
                                                     "answer": 2}]))


def test_summary_counts_the_reused_share_over_all_agents() -> None:
    def row(saved: int, prompt: int, agree: bool) -> dict:
        turns = [{"name": "a", "ttft_s": 1.0, "mode": "full", "reused_tokens": 0,
                  "prompt_tokens": prompt // 2},
                 {"name": "j", "ttft_s": 0.5, "mode": "reuse", "reused_tokens": saved,
                  "prompt_tokens": prompt - prompt // 2}]
        return {"reuse": {"correct": True, "latency_s": 2.0, "prompt_tokens": prompt,
                          "saved_tokens": saved, "turns": turns, "agree": agree,
                          "judge_agree": True}}
    s = summarize([row(30, 100, True), row(10, 100, False)], ["reuse"])["reuse"]
    assert s["reused_share"] == pytest.approx(0.2)
    assert s["agreement"] == 0.5 and s["judge_agreement"] == 1.0
    assert s["last_agent_ttft_s"] == 0.5 and s["ttft_by_agent_s"] == [1.0, 0.5]
    assert s["fallbacks"] == 0 and s["reused_turns"] == 2


def test_eval_writes_the_contract(tmp_path: Path) -> None:
    data = _write(tmp_path / "g.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"},
        {"question": "Ann had 9 pens and lost 2. How many?", "answer": "#### 7"},
        {"question": "never read", "answer": "#### 1"}])
    out = tmp_path / "r.json"
    got = _eval_reference(data, out)  # watch 0: reuse kept past the first token
    for mode in ("full", "reuse"):
        assert {"accuracy", "latency_s", "last_agent_ttft_s", "n"} <= set(got[mode])
        assert got[mode]["n"] == 2
    assert {"agreement", "judge_agreement", "reused_share", "repairs"} <= set(got["reuse"])
    assert got["reuse"]["repairs"] == 0 and got["meta"]["watch"] == 0
    assert 0 < got["reuse"]["reused_share"] < 1
    assert len(got["rows"]) == 2 and got["meta"]["agents"] == 2
    assert [t["name"] for t in got["rows"][0]["reuse"]["turns"]][-1] == "judge"
    bad = CliRunner().invoke(app, ["agents", "eval", "--data", str(data), "--limit", "1",
                                   "--json", str(out), "--pipeline", "nope"])
    assert bad.exit_code != 0


def test_eval_offsets_warm_up_on_the_first_question_then_apply(tmp_path: Path) -> None:
    data = _write(tmp_path / "g.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"},
        {"question": "Ann had 9 pens and lost 2. How many?", "answer": "#### 7"}])
    got = _eval_reference(data, tmp_path / "r.json", "--gate", "off", "--offsets", "1")
    first, second = (r["reuse"]["turns"] for r in got["rows"])
    assert [t["mode"] for t in first[:2]] == ["full", "warmup"]
    assert first[1]["offsets_learned"] >= 1
    assert second[1]["mode"] == "reuse" and second[1]["offsets_applied"] >= 1
    assert got["reuse"]["warmups"] >= 1 and got["reuse"]["offsets_applied"] >= 1
    assert got["meta"]["offsets"] == 1
