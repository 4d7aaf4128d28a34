"""C2C on multiple-choice files: reading, scoring rules, the four methods, the CLI contract,
training from model folders with bf16 and resume, streaming; one real-pair check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from semcomm.cli import app
from semcomm.errors import InvalidInputError
from semcomm.fusion import Fuser, FuserConfig, FusionPipeline, ModelSide
from semcomm.fusion._mcqa import (
    McqaSettings,
    MCQuestion,
    build_training_rows,
    evaluate_mcqa,
    read_mcqa,
    score_choices,
    shared_text,
    shipped_pair_fuser_path,
)

from ._fusion_helpers import _one_thread  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_pair

QUESTIONS: list[dict[str, Any]] = [
    {"question": "Which fox is red?", "choices": ["the red fox", "a blue dog"], "answer": 0},
    {"question": "Where is the river?", "choices": ["tower", "café", "東京 river"], "answer": 2},
    {"question": "What is blue?", "choices": ["dog", "blue river", "fox", "red"], "answer": 1},
    {"question": "Which tower?", "choices": ["red tower", "blue tower"], "answer": 1},
]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pair():
    return toy_pair("cross", seed=3)


@pytest.fixture
def sides(pair):
    return (
        ModelSide(pair.sharer, pair.sharer_tokenizer, suffix="Answer:", add_special_tokens=True),
        ModelSide(
            pair.receiver, pair.receiver_tokenizer, suffix="Answer:", add_special_tokens=True
        ),
    )


def _fuser(sides, *, open_gates: bool) -> Fuser:
    s, r = sides
    torch.manual_seed(0)
    f = Fuser(FuserConfig(sharer=s.spec, receiver=r.spec, hidden_dim=16, num_blocks=1))
    if open_gates:
        with torch.no_grad():
            f.gate_logit.fill_(1.0)
            f.w_out.normal_(0, 5.0)  # a strong projection: fusion visibly changes scores
    return f.eval()


def test_read_mcqa_order_skip_limit_and_errors(tmp_path: Path) -> None:
    f = _write(tmp_path / "q.jsonl", QUESTIONS)
    assert [q.question for q in read_mcqa(f, limit=2)] == [
        "Which fox is red?",
        "Where is the river?",
    ]
    got = read_mcqa(f, skip=1, limit=2)
    assert [q.answer for q in got] == [2, 1] and got[0].choices[2] == "東京 river"
    bad = _write(
        tmp_path / "bad.jsonl", [QUESTIONS[0], {"question": "x", "choices": ["a"], "answer": 0}]
    )
    with pytest.raises(InvalidInputError, match=r"bad.jsonl:2"):
        read_mcqa(bad)
    out_of_range = _write(
        tmp_path / "oor.jsonl", [{"question": "x", "choices": ["a", "b"], "answer": 2}]
    )
    with pytest.raises(InvalidInputError, match="answer"):
        read_mcqa(out_of_range)
    with pytest.raises(InvalidInputError, match="does not exist"):
        read_mcqa(tmp_path / "missing.jsonl")


def test_shared_text_by_rule() -> None:
    q = MCQuestion("Which?", ("x", "y"), 1)
    assert shared_text(q) == "Question: Which?\n"
    assert shared_text(q, "letter") == "Question: Which?\nA. x\nB. y\n"


def test_training_rows_leave_the_evaluated_head_out(tmp_path: Path) -> None:
    f = _write(tmp_path / "q.jsonl", QUESTIONS + [QUESTIONS[0]])  # a duplicate of a head item
    instr = _write(
        tmp_path / "i.jsonl",
        [
            {"prompt": "Say hi", "completion": "hi<|endoftext|>"},
            {"prompt": "Long", "completion": "x" * 500},
        ],
    )
    rows = build_training_rows([f], skip=2, instruction_file=instr, instruction_limit=5)
    shared = [r["shared"] for r in rows]
    assert "Question: Which fox is red?\n" not in shared  # head item and its duplicate
    assert "Question: Where is the river?\n" not in shared
    assert {"shared": "Question: What is blue?\n", "answer": " blue river"} in rows
    assert {"shared": "Say hi\n", "answer": " hi"} in rows and len(rows) == 3


def test_score_choices_matches_full_sequence_logprobs(sides) -> None:
    _, r = sides
    tok = r.tokenizer
    ids = tok("Question: Which fox is red?\nAnswer:")["input_ids"]
    with torch.no_grad():
        out = r.model(input_ids=torch.tensor([ids[:-1]]), use_cache=True)
    from semcomm.fusion._kvio import cache_to_layers, output_cache

    layers = cache_to_layers(output_cache(out))
    choices = ("the red fox", "a blue dog")
    sc = score_choices(r, layers, ids[-1], len(ids) - 1, choices, bf16=False)
    for k, c in enumerate(choices):
        opt = tok(" " + c, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(r.model(input_ids=torch.tensor([ids + opt])).logits[0], -1)
        ref = sum(float(logp[len(ids) - 1 + j, t]) for j, t in enumerate(opt))
        assert sc["loglik"][k] == pytest.approx(ref, abs=1e-4)
        assert sc["loglik_mean"][k] == pytest.approx(ref / len(opt), abs=1e-4)
    letters = [tok(f" {x}", add_special_tokens=False)["input_ids"][-1] for x in "AB"]
    assert sc["letter"] == pytest.approx([float(logp[len(ids) - 1, t]) for t in letters], abs=1e-4)


def test_four_methods_and_closed_fuser_equals_receiver(sides, tmp_path: Path) -> None:
    s, r = sides
    qs = read_mcqa(_write(tmp_path / "q.jsonl", QUESTIONS))
    st = McqaSettings(analysis_tokens=4, bf16=False)
    res = evaluate_mcqa(s, r, _fuser(sides, open_gates=False), qs, st)
    for m in ("receiver", "sharer", "t2t", "c2c"):
        assert res[m]["n"] == 4 and 0.0 <= res[m]["accuracy"] <= 1.0 and res[m]["latency_s"] > 0
    # zero-initialised fuser: the fused cache is the receiver's, so every rule agrees
    assert res["c2c"]["accuracy_loglik_mean"] == res["receiver"]["accuracy_loglik_mean"]
    assert res["c2c"]["accuracy"] == res["receiver"]["accuracy"]
    assert res["t2t"]["tokens_generated"] > 0
    assert res["c2c"]["median_sharer_prefill_s"] > 0 and "median_fuse_s" in res["c2c"]
    letter = evaluate_mcqa(
        s, r, None, qs, McqaSettings(rule="letter", bf16=False, methods=("sharer",))
    )
    assert (
        set(letter["sharer"]) >= {"accuracy", "accuracy_letter"}
        and "accuracy_loglik" not in letter["sharer"]
    )
    with pytest.raises(InvalidInputError, match="c2c needs a fuser"):
        evaluate_mcqa(s, r, None, qs, st)


def test_open_fuser_changes_c2c_scores(sides) -> None:
    from semcomm.fusion._mcqa import fused_prompt_layers

    s, r = sides
    shared = "Question: Which fox is red?\n"
    closed, ids, _ = fused_prompt_layers(s, r, _fuser(sides, open_gates=False), shared, False)
    opened, ids2, stages = fused_prompt_layers(s, r, _fuser(sides, open_gates=True), shared, False)
    assert ids == ids2 and stages["fuse"] >= 0
    a = score_choices(r, closed, ids[-1], len(ids) - 1, ("the red fox", "a blue dog"), False)
    b = score_choices(r, opened, ids[-1], len(ids) - 1, ("the red fox", "a blue dog"), False)
    assert a["loglik"] != pytest.approx(b["loglik"], abs=1e-3)


@pytest.fixture(scope="module")
def folders(pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("toy_models")
    for name, model, tok in (
        ("sharer", pair.sharer, pair.sharer_tokenizer),
        ("receiver", pair.receiver, pair.receiver_tokenizer),
    ):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "sharer", root / "receiver"


def test_cli_train_resume_and_eval_contract(folders, tmp_path: Path) -> None:
    s_dir, r_dir = folders
    data = _write(
        tmp_path / "train.jsonl",
        [
            {
                "shared": shared_text(MCQuestion(q["question"], tuple(q["choices"]), q["answer"])),
                "answer": " " + q["choices"][q["answer"]],
            }
            for q in QUESTIONS
        ],
    )
    out = tmp_path / "fz"
    base = [
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
        "--batch-size",
        "2",
        "--hidden",
        "16",
        "--blocks",
        "1",
        "--bf16",
        "--threads",
        "1",
        "--checkpoint-every",
        "1",
        "--device",
        "cpu",
        "--sharer-template",
        "{shared}Answer:",
        "--receiver-template",
        "{shared}Answer:",
    ]
    runner = CliRunner()
    res = runner.invoke(app, [*base, "--steps", "2"])
    assert res.exit_code == 0, (res.output, res.exception)
    res = runner.invoke(app, [*base, "--steps", "3", "--resume"])
    assert res.exit_code == 0, (res.output, res.exception)
    state = json.loads((out / "train_state.json").read_text())
    assert state["step"] == 3 and len(state["losses"]) == 3 and state["config"]["bf16"] is True
    meta = json.loads((out / "fuser.json").read_text())["meta"]
    assert "--bf16" in meta["command"] and meta["steps"] == 3

    qfile = _write(tmp_path / "q.jsonl", QUESTIONS)
    js, png = tmp_path / "c2c.json", tmp_path / "c2c.png"
    res = runner.invoke(
        app,
        [
            "fusion",
            "eval",
            "--data",
            str(qfile),
            "--limit",
            "3",
            "--json",
            str(js),
            "--png",
            str(png),
            "--sharer",
            str(s_dir),
            "--receiver",
            str(r_dir),
            "--fuser",
            str(out),
            "--analysis-tokens",
            "3",
            "--fp32",
        ],
    )
    assert res.exit_code == 0, (res.output, res.exception)
    doc = json.loads(js.read_text())
    for m in ("receiver", "sharer", "t2t", "c2c"):
        assert set(doc[m]) >= {"accuracy", "latency_s", "n"}
        assert 0.0 <= doc[m]["accuracy"] <= 1.0 and doc[m]["latency_s"] > 0 and doc[m]["n"] == 3
    assert doc["setup"]["items"] == 3 and png.stat().st_size > 0
    res = runner.invoke(app, ["fusion", "eval", "--data", str(qfile), "--methods", "receiver,nope"])
    assert res.exit_code != 0 and "nope" in str(res.exception)


def test_stream_yields_the_generated_text(sides) -> None:
    s, r = sides
    pipe = FusionPipeline(s, r, _fuser(sides, open_gates=True))
    shared = "Question: Which fox is red?\n"
    stats: dict = {}
    pieces = list(pipe.stream(shared, max_new_tokens=6, stats=stats))
    gen = pipe.generate(shared, max_new_tokens=6)
    assert "".join(pieces) == gen.text
    assert stats["generated_tokens"] == len(gen.token_ids) and stats["fused_tokens"] > 0
    if gen.token_ids:
        assert len(pieces) >= 1 and "first_piece_ms" in stats
    # closing early stops decoding
    it = pipe.stream(shared, max_new_tokens=50, stats=(early := dict[str, Any]()))
    next(it, None)
    it.close()
    assert early.get("generated_tokens", 0) <= 2


def test_text_pieces_hold_back_partial_utf8() -> None:
    from semcomm.fusion._pipeline import text_pieces

    table = {1: "a", 2: "\ufffd", 3: "é"}

    class Tok:  # token 2 + 3 form one character
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            text = "".join(table[i] for i in ids)
            return text.replace("\ufffdé", "é")

    assert list(text_pieces([1, 2, 3, 1], Tok())) == ["a", "é", "a"]


def _real_pair_available() -> bool:
    try:
        from semcomm.models import is_pulled

        return (
            all(is_pulled(n) for n in ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"))
            and (shipped_pair_fuser_path() / "fuser.json").exists()
        )
    except Exception:
        return False


@pytest.mark.skipif(not _real_pair_available(), reason="real pair not pulled")
def test_real_pair_eval_contract_with_the_shipped_fuser(tmp_path: Path) -> None:
    """The default pair and shipped fuser on 2 questions (C2C and the receiver only)."""
    qfile = _write(tmp_path / "q.jsonl", QUESTIONS[:2])
    js = tmp_path / "real.json"
    res = CliRunner().invoke(
        app,
        [
            "fusion",
            "eval",
            "--data",
            str(qfile),
            "--limit",
            "2",
            "--json",
            str(js),
            "--methods",
            "receiver,c2c",
        ],
    )
    assert res.exit_code == 0, (res.output, res.exception)
    doc = json.loads(js.read_text())
    assert doc["c2c"]["n"] == 2 and doc["setup"]["fuser_params"] > 0
    assert doc["setup"]["receiver"] == "smollm2-135m-instruct"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_train_step_and_eval(sides, tmp_path: Path) -> None:
    """The GPU recipe's code path: bf16 training steps and the evaluation on CUDA."""
    from semcomm.fusion import FusionExample, FusionTrainer, TrainConfig

    s, r = sides
    rows = [
        FusionExample(shared_text(MCQuestion(q["question"], tuple(q["choices"]), 0)), " x")
        for q in QUESTIONS
    ]
    cfg = TrainConfig(steps=2, batch_size=2, device="cuda", bf16=True, fuser={"hidden_dim": 16})
    tr = FusionTrainer(s, r, rows, cfg, out=tmp_path)
    assert tr.train().steps == 2
    qs = read_mcqa(_write(tmp_path / "q.jsonl", QUESTIONS))
    res = evaluate_mcqa(s, r, tr.fuser, qs, McqaSettings(methods=("receiver", "c2c")))
    assert res["c2c"]["n"] == 4
