"""The multiple-choice training objective: its loss is the evaluator's choice scores under
softmax, gradients reach the fuser (gates included, at their own learning rate), the loss
falls, and the best-by-validation fuser is on disk and survives a resume."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from semcomm.errors import ConfigError, InvalidInputError
from semcomm.fusion import Fuser, FuserConfig, FusionTrainer, ModelSide, TrainConfig, load_fuser
from semcomm.fusion._mcqa import (
    MCQuestion,
    build_choice_rows,
    fused_prompt_layers,
    read_mcqa,
    score_choices,
    shared_text,
)
from semcomm.fusion._train import choice_loss, choice_scores, collate_choices, encode_choice_example

from ._fusion_helpers import WORDS, _one_thread  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_pair

FUSER: dict[str, Any] = {"hidden_dim": 16, "num_blocks": 1, "dropout": 0.0}


@pytest.fixture(scope="module")
def pair():
    return toy_pair("cross", seed=3)


@pytest.fixture
def sides(pair) -> tuple[ModelSide, ModelSide]:
    return (
        ModelSide(pair.sharer, pair.sharer_tokenizer, suffix="Answer:", add_special_tokens=True),
        ModelSide(
            pair.receiver, pair.receiver_tokenizer, suffix="Answer:", add_special_tokens=True
        ),
    )


def questions(n: int = 12) -> list[MCQuestion]:
    """The answer is the question's third word, among 2-4 choices of different lengths:
    learnable only by reading the (fused) question."""
    out = []
    for i in range(n):
        w = [WORDS[(i * 3 + k) % len(WORDS)] for k in range(4)]
        k = 2 + i % 3
        choices = [w[2]] + [WORDS[(i * 5 + 1 + j) % len(WORDS)] + " tower" * j for j in range(k)]
        choices = list(dict.fromkeys(c for c in choices))[:k]
        ans = i % len(choices)
        choices[0], choices[ans] = choices[ans], choices[0]
        out.append(MCQuestion(f"which is {' '.join(w)}?", tuple(choices), ans))
    return out


def _open_fuser(s: ModelSide, r: ModelSide) -> Fuser:
    torch.manual_seed(0)
    f = Fuser(FuserConfig(sharer=s.spec, receiver=r.spec, **FUSER))
    with torch.no_grad():
        f.gate_logit.fill_(1.0)
        f.w_out.normal_(0, 2.0)  # a fuser that visibly changes the scores
    return f.eval()


def test_choice_loss_is_minus_log_softmax_of_the_evaluators_scores(sides) -> None:
    s, r = sides
    fz = _open_fuser(s, r)
    qs = questions(5)
    items = [encode_choice_example(s, r, q, reduce="mean") for q in qs]
    # several questions of different lengths and choice counts in one padded batch
    batch = collate_choices(items, 0, 0)
    with torch.no_grad():
        scores, tokens = choice_scores(fz, s.model, r.model, batch)
        loss = choice_loss(fz, s.model, r.model, batch)
    want = []
    for i, q in enumerate(qs):
        fused, ids, _ = fused_prompt_layers(s, r, fz, shared_text(q), False)
        ref = score_choices(r, fused, ids[-1], len(ids) - 1, q.choices, False)["loglik"]
        got = scores[i, : len(q.choices)].tolist()
        assert got == pytest.approx(ref, abs=1e-4)
        assert torch.isinf(scores[i, len(q.choices) :]).all()
        assert tokens[i, : len(q.choices)].tolist() == [
            len(r.tokenizer(" " + c, add_special_tokens=False)["input_ids"]) for c in q.choices
        ]
        want.append(-torch.log_softmax(torch.tensor(ref), 0)[q.answer])
    assert float(loss) == pytest.approx(float(torch.stack(want).mean()), abs=1e-4)
    # the answer term adds the correct choice's mean token loss
    with torch.no_grad():
        both = choice_loss(fz, s.model, r.model, batch, answer_weight=0.5)
    right = scores.gather(1, batch.answer[:, None])[:, 0]
    n = tokens.gather(1, batch.answer[:, None])[:, 0]
    assert float(both) == pytest.approx(float(loss + 0.5 * (-right / n).mean()), abs=1e-4)
    # the fuser changes the scores: fusion is not a no-op in this check
    with torch.no_grad():
        alone, _ = choice_scores(None, s.model, r.model, batch)
    assert not torch.allclose(alone[0, :2], scores[0, :2], atol=1e-3)


def test_gradient_reaches_the_fuser_and_the_loss_falls(sides) -> None:
    s, r = sides
    qs = questions(12)
    cfg = TrainConfig(
        steps=30,
        batch_size=6,
        lr=1e-2,
        gate_lr=0.1,
        warmup=2,
        checkpoint_every=0,
        objective="choice",
        fuser=FUSER,
    )
    tr = FusionTrainer(s, r, qs, cfg)
    groups = tr.optimizer.param_groups
    assert [g["params"] for g in groups][1] == [tr.fuser.gate_logit]
    assert groups[1]["weight_decay"] == 0.0
    # first step from the zero-initialised projection: the gradient reaches it through the
    # receiver's forward over the fused cache (the only path while the projection is zero)
    tr.fuser.train()
    loss = tr._loss(tr.fuser, tr.batch(random.Random(0)))
    loss.backward()
    g = tr.fuser.w_out.grad
    assert g is not None and float(g.abs().sum()) > 0
    assert not any(p.requires_grad for p in r.model.parameters())
    tr.fuser.zero_grad(set_to_none=True)
    alone = tr.evaluate_loss(fused=False)
    before = tr.evaluate_loss()
    assert before == pytest.approx(alone, abs=1e-5)  # zero-init: starts at the receiver alone
    start = {k: v.detach().clone() for k, v in tr.fuser.state_dict().items()}
    tr.train()
    after = tr.evaluate_loss()
    assert after < before - 0.1, (before, after)
    # every part learned; the gate logits moved at their own (larger) rate
    for name in ("w_in", "w_out", "w_weight", "block_up"):
        assert not torch.equal(getattr(tr.fuser, name).detach(), start[name]), name
    assert float((tr.fuser.gate_logit.detach() - start["gate_logit"]).abs().max()) > 0.2


def test_best_by_validation_is_saved_and_survives_resume(sides, tmp_path: Path) -> None:
    s, r = sides
    scores = iter([0.2, 0.7, 0.4, 0.3, 0.9])  # steps 0, 2, 4 | resumed: 6, 8
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def metric(fuser: Fuser) -> float:
        return next(scores)

    cfg = TrainConfig(
        steps=4, batch_size=3, lr=3e-3, eval_every=2, checkpoint_every=2, objective="choice",
        fuser=FUSER,
    )
    tr = FusionTrainer(s, r, questions(6), cfg, out=tmp_path, val_metric=metric)
    tr.train()
    assert tr.meta["best_step"] == 2
    seen[2] = {k: v.clone() for k, v in tr.fuser.state_dict().items()}
    best = load_fuser(tmp_path / "best")
    for k, v in best.state_dict().items():
        assert torch.equal(v, seen[2][k])
    state = json.loads((tmp_path / "train_state.json").read_text())
    assert state["best"] == {"step": 2, "score": 0.7}
    cfg2 = TrainConfig(
        steps=8, batch_size=3, lr=3e-3, eval_every=2, checkpoint_every=2, objective="choice",
        fuser=FUSER,
    )
    tr2 = FusionTrainer(s, r, questions(6), cfg2, out=tmp_path, resume=True, val_metric=metric)
    assert tr2.best is not None and tr2.best[:2] == (0.7, 2)
    assert [st for st, _ in tr2.val_losses] == [0, 2, 4]
    tr2.train()
    assert tr2.meta["best_step"] == 8
    assert json.loads((tmp_path / "train_state.json").read_text())["best"]["step"] == 8


def test_init_from_a_fuser_and_bad_settings(sides, tmp_path: Path) -> None:
    s, r = sides
    src = _open_fuser(s, r)
    from semcomm.fusion import save_fuser

    save_fuser(src, tmp_path / "start")
    cfg = TrainConfig(steps=2, batch_size=2, checkpoint_every=0, objective="choice", fuser=FUSER)
    tr = FusionTrainer(s, r, questions(4), cfg, init=tmp_path / "start")
    for k, v in tr.fuser.state_dict().items():
        assert torch.equal(v, src.state_dict()[k])
    assert tr.fuser.config.anneal_steps == 2  # this run's temperature schedule
    other = dict(FUSER, hidden_dim=8)
    with pytest.raises(ConfigError, match="other shapes"):
        FusionTrainer(
            s, r, questions(4), TrainConfig(steps=2, objective="choice", fuser=other),
            init=tmp_path / "start",
        )
    with pytest.raises(ConfigError, match="objective must be one of"):
        TrainConfig(objective="letters")
    with pytest.raises(InvalidInputError, match="choice objective needs multiple-choice"):
        from semcomm.fusion import FusionExample

        FusionTrainer(s, r, [FusionExample("a b", " c")], TrainConfig(objective="choice"))


def test_choice_rows_leave_the_head_out(tmp_path: Path) -> None:
    f = tmp_path / "a.jsonl"
    rows = [{"question": f"q{i}", "choices": ["x", "y"], "answer": i % 2} for i in range(10)]
    rows.append({"question": "q1", "choices": ["x", "y"], "answer": 0})  # a duplicate of the head
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    tail = build_choice_rows([f], skip=6)
    assert [x["question"] for x in tail] == ["q6", "q7", "q8", "q9"]
    assert build_choice_rows([f], skip=2, take=3) == rows[2:5]
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in tail))
    assert [q.question for q in read_mcqa(out)] == ["q6", "q7", "q8", "q9"]
