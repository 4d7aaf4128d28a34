"""Evaluation: the four methods, the oracle, the letter parser, the CLI contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from semcomm.cli import app
from semcomm.cli._tools.fusion_reference import (
    fact_is_heldout,
    reference_examples,
    reference_items,
    write_examples,
)
from semcomm.fusion import FusionPipeline, ModelSide
from semcomm.fusion._eval import (
    EvalSettings,
    evaluate,
    oracle_enrichment,
    parse_letter,
    plot_results,
)
from semcomm.reference import build_world

from ._fusion_helpers import _one_thread  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_pair


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        (" c.", "c"),
        ("B", "b"),
        (" (d) west", "d"),
        ("\n[a]", "a"),
        (" cat", None),
        ("", None),
        (" e.", None),
    ],
)
def test_parse_letter(text: str, letter: str | None) -> None:
    assert parse_letter(text) == letter


@pytest.fixture(scope="module")
def world():
    return build_world(seed=0)


def test_reference_split_is_by_fact_and_disjoint(world) -> None:
    held = reference_items(world, heldout=True)
    train_ex = reference_examples(world)
    held_facts = {i.id.removeprefix("mc-") for i in held}
    assert held and train_ex
    assert all(fact_is_heldout(f) for f in held_facts)
    # no training example mentions a held-out question
    train_text = {e.shared for e in train_ex}
    assert not any(i.qa_prompt in train_text for i in held)
    # seen and unseen interleaved so a prefix stays balanced
    assert {i.split for i in held[:4]} == {"seen", "unseen"}


@pytest.fixture(scope="module")
def toy_sides():
    p = toy_pair("cross", seed=2)
    return (
        ModelSide(p.sharer, p.sharer_tokenizer, add_special_tokens=True),
        ModelSide(p.receiver, p.receiver_tokenizer),
    )


@pytest.mark.parametrize("mode", ["loglik", "letter"])
def test_evaluate_reports_every_method(toy_sides, world, mode: str, tmp_path: Path) -> None:
    from semcomm.fusion import Fuser, FuserConfig

    s, r = toy_sides
    fuser = Fuser(FuserConfig(sharer=s.spec, receiver=r.spec, hidden_dim=8, num_blocks=0))
    pipe = FusionPipeline(s, r, fuser)
    items = reference_items(world, limit=4)
    res = evaluate(pipe, items, EvalSettings(answer_mode=mode, background_tokens=3))
    assert set(res) == {"receiver", "sharer", "t2t", "c2c"}
    for v in res.values():
        assert 0.0 <= v["accuracy"] <= 1.0 and v["latency_s"] > 0 and v["n"] == 4
        assert {"accuracy_seen", "accuracy_unseen"} <= set(v)
    assert res["t2t"]["tokens_generated"] > 0  # the sharer wrote background
    # zero-init fuser with an open gate: C2C must equal the receiver alone exactly
    assert res["c2c"]["accuracy"] == res["receiver"]["accuracy"]
    png = plot_results(res, tmp_path / "c2c.png")
    assert png.stat().st_size > 1000


def test_oracle_enrichment_runs(toy_sides, world) -> None:
    _, r = toy_sides
    items = reference_items(world, limit=3)
    out = oracle_enrichment(r, items)
    assert out["n"] == 3
    for k in ("accuracy_question", "accuracy_enriched", "accuracy_full_context"):
        assert 0.0 <= out[k] <= 1.0


def test_cli_train_then_eval_on_a_saved_pair(tmp_path: Path, world) -> None:
    p = toy_pair("cross", seed=3)
    s_dir, r_dir = p.save(tmp_path)
    data = write_examples(reference_examples(world)[:16], tmp_path / "train.jsonl")
    out = tmp_path / "fuser"
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "fusion",
            "train",
            "--sharer",
            str(s_dir),
            "--receiver",
            str(r_dir),
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--hidden",
            "8",
            "--receiver-template",
            "context: {shared}\\nanswer:",
            "--blocks",
            "1",
            "--checkpoint-every",
            "2",
            "--threads",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert (out / "fuser.safetensors").exists() and json.loads((out / "fuser.json").read_text())[
        "meta"
    ]["steps"] == 3
    js = tmp_path / "eval.json"
    res = runner.invoke(
        app,
        [
            "fusion",
            "eval",
            "--sharer",
            str(s_dir),
            "--receiver",
            str(r_dir),
            "--fuser",
            str(out),
            "--limit",
            "2",
            "--json",
            str(js),
            "--no-oracle",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(js.read_text())
    for m in ("receiver", "sharer", "t2t", "c2c"):
        assert 0.0 <= doc[m]["accuracy"] <= 1.0 and doc[m]["latency_s"] > 0
    # a fuser for another pair is refused with a clear message (sharer and receiver swapped)
    res = runner.invoke(
        app,
        [
            "fusion",
            "eval",
            "--sharer",
            str(r_dir),
            "--receiver",
            str(s_dir),
            "--fuser",
            str(out),
            "--limit",
            "2",
            "--no-oracle",
        ],
    )
    assert res.exit_code != 0 and "built for sharer" in str(res.exception)


def test_contract_eval_on_the_shipped_pair(tmp_path: Path) -> None:
    """`semcomm fusion eval --json FILE` defaults: shipped reference pair + shipped fuser.

    Fails loudly if the reference models are retrained without retraining the fuser
    (fingerprints differ): rerun the command in docs/fusion.md.
    """
    js = tmp_path / "c2c.json"
    res = CliRunner().invoke(
        app, ["fusion", "eval", "--json", str(js), "--limit", "6", "--no-oracle"]
    )
    assert res.exit_code == 0, (res.output, res.exception)
    doc = json.loads(js.read_text())
    for m in ("receiver", "sharer", "t2t", "c2c"):
        assert 0.0 <= doc[m]["accuracy"] <= 1.0 and doc[m]["latency_s"] > 0
    assert doc["setup"]["items"] == 6 and doc["t2t"]["tokens_generated"] > 0


def test_score_options_batched_matches_one_by_one_and_keeps_the_cache(toy_sides) -> None:
    from semcomm.fusion._eval import score_options
    from semcomm.fusion._kvio import cache_to_layers, output_cache

    _, r = toy_sides
    ids = r.tokenizer("question: where is norwood? answer:")["input_ids"]
    with torch.no_grad():
        layers = cache_to_layers(
            output_cache(r.model(input_ids=torch.tensor([ids[:-1]]), use_cache=True))
        )
    before = [(k.clone(), v.clone()) for k, v in layers]
    opts = [
        r.tokenizer(f" {o}.", add_special_tokens=False)["input_ids"]
        for o in ("west", "north east", "c")
    ]
    batched = score_options(r.model, layers, [ids[-1]], len(ids) - 1, opts)
    single = [score_options(r.model, layers, [ids[-1]], len(ids) - 1, [o])[0] for o in opts]
    assert batched == pytest.approx(single, abs=1e-4)
    for (k, v), (k0, v0) in zip(layers, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    # and the scores are the plain model's log-probabilities of the full sequences
    with torch.no_grad():
        logp = torch.log_softmax(r.model(input_ids=torch.tensor([ids + opts[0]])).logits[0], -1)
    ref = sum(float(logp[len(ids) - 1 + j, t]) for j, t in enumerate(opts[0]))
    assert batched[0] == pytest.approx(ref, abs=1e-4)


def test_prompt_templates() -> None:
    from semcomm.errors import ConfigError
    from semcomm.fusion import split_template

    assert split_template("<u>\\n{shared}</u>") == ("<u>\n", "</u>")
    with pytest.raises(ConfigError, match="exactly once"):
        split_template("no placeholder")
