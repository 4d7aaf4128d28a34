"""Training: the loss goes down, checkpoints resume, the CLI trains a saved pair, and a
Qwen2 -> Qwen3 pair (the Qwen2.5-0.5B -> Qwen3-0.6B layout at toy size) trains and generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from semcomm.errors import ConfigError, InvalidInputError
from semcomm.fusion import (
    FusionPipeline,
    FusionTrainer,
    ModelSide,
    TrainConfig,
    load_fuser,
    read_examples,
)
from semcomm.fusion._eval import score_options

from ._fusion_helpers import _one_thread, word_examples  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_pair

FUSER = {"hidden_dim": 32, "num_blocks": 1, "dropout": 0.0}



@pytest.fixture(scope="module")
def qwen_pair():
    return toy_pair("qwen", seed=0)


@pytest.fixture(scope="module")
def cross_pair():
    return toy_pair("cross", seed=0)


def sides(pair, prefix: str = "context: ", suffix: str = " answer:") -> tuple[ModelSide, ModelSide]:
    return (
        ModelSide(pair.sharer, pair.sharer_tokenizer, prefix="", suffix=""),
        ModelSide(pair.receiver, pair.receiver_tokenizer, prefix=prefix, suffix=suffix),
    )


@pytest.mark.parametrize("kind", ["qwen", "cross"])
def test_short_training_lowers_the_loss(kind: str, qwen_pair, cross_pair) -> None:
    pair = qwen_pair if kind == "qwen" else cross_pair
    s, r = sides(pair)
    cfg = TrainConfig(steps=40, batch_size=8, lr=3e-3, warmup=5, checkpoint_every=0, fuser=FUSER)
    tr = FusionTrainer(s, r, word_examples(), cfg)
    alone = tr.evaluate_loss(fused=False)
    before = tr.evaluate_loss()
    assert before == pytest.approx(alone, abs=1e-5)  # zero-init projection: starts at the receiver
    tr.train()
    after = tr.evaluate_loss()
    assert after < before - 0.2, (before, after)
    # the models stayed frozen
    assert not any(p.requires_grad for p in pair.receiver.parameters())


def test_checkpoint_and_resume(qwen_pair, tmp_path: Path) -> None:
    s, r = sides(qwen_pair)
    cfg = TrainConfig(steps=4, batch_size=2, checkpoint_every=2, seed=3, fuser=FUSER)
    tr = FusionTrainer(s, r, word_examples(8), cfg, out=tmp_path)
    tr.train()
    state = json.loads((tmp_path / "train_state.json").read_text())
    assert state["step"] == 4 and len(state["losses"]) == 4
    assert {p.name for p in tmp_path.iterdir()} >= {
        "fuser.safetensors",
        "fuser.json",
        "optimizer.safetensors",
    }
    saved = load_fuser(tmp_path).state_dict()
    cfg2 = TrainConfig(steps=6, batch_size=2, checkpoint_every=2, seed=3, fuser=FUSER)
    tr2 = FusionTrainer(s, r, word_examples(8), cfg2, out=tmp_path, resume=True)
    assert tr2.step == 4 and tr2.losses == state["losses"]
    for k, v in tr2.fuser.state_dict().items():
        assert torch.equal(v, saved[k])
    assert len(tr2.optimizer.state) > 0  # optimizer moments restored, not reset
    tr2.train()
    assert json.loads((tmp_path / "train_state.json").read_text())["step"] == 6


def test_bad_training_input(tmp_path: Path, qwen_pair) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"shared": "x", "answer": "y"}\n{"shared": 3}\n')
    with pytest.raises(InvalidInputError, match="bad.jsonl:2"):
        read_examples(bad)
    bad.write_text("not json\n")
    with pytest.raises(InvalidInputError, match=":1: not valid JSON"):
        read_examples(bad)
    with pytest.raises(InvalidInputError, match="does not exist"):
        read_examples(tmp_path / "missing.jsonl")
    s, r = sides(qwen_pair)
    with pytest.raises(ConfigError, match="bad fuser setting"):
        FusionTrainer(s, r, word_examples(2), TrainConfig(steps=1, fuser={"hidden": 3}))


def test_qwen2_to_qwen3_end_to_end(qwen_pair) -> None:
    s, r = sides(qwen_pair)
    assert (s.spec.model_type, r.spec.model_type) == ("qwen2", "qwen3")
    assert (s.spec.num_layers, s.spec.num_kv_heads, s.spec.head_dim) != (
        r.spec.num_layers,
        r.spec.num_kv_heads,
        r.spec.head_dim,
    )
    cfg = TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup=3, checkpoint_every=0, fuser=FUSER)
    tr = FusionTrainer(s, r, word_examples(), cfg)
    tr.train()
    with torch.no_grad():  # make sure every gate is open so fusion is exercised
        tr.fuser.gate_logit.clamp_(min=0.5)
    pipe = FusionPipeline(s, r, tr.fuser)
    ex = word_examples()[0]
    fused = pipe.generate(ex.shared, max_new_tokens=3)
    alone = pipe.generate(ex.shared, max_new_tokens=3, fuse=False)
    assert fused.stats["fused_tokens"] > 0 and alone.stats["fused_tokens"] == 0
    assert fused.stats["sharer_source"] == "forward"
    # training made the answers likelier through the fused cache than for the receiver alone
    better = 0
    for ex in word_examples()[:8]:
        fp = pipe.encode(ex.shared)
        ans = r.tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
        last, pos = [fp.receiver.input_ids[-1]], len(fp.receiver.input_ids) - 1
        fused_layers, _ = pipe.fused_layers(fp)
        saved, pipe.fuser = pipe.fuser, None
        alone_layers, _ = pipe.fused_layers(fp)
        pipe.fuser = saved
        f_score = score_options(r.model, fused_layers, last, pos, [ans])[0]
        a_score = score_options(r.model, alone_layers, last, pos, [ans])[0]
        better += f_score > a_score
    assert better >= 6


def test_validation_keeps_the_best_fuser(qwen_pair) -> None:
    s, r = sides(qwen_pair)
    scores = iter([0.5, 0.9, 0.1, 0.2])  # steps 0, 2, 4, 6: the best is step 2
    seen: list[dict[str, torch.Tensor]] = []

    def metric(fuser) -> float:
        seen.append({k: v.detach().clone() for k, v in fuser.state_dict().items()})
        return next(scores)

    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, eval_every=2, checkpoint_every=0, fuser=FUSER)
    tr = FusionTrainer(s, r, word_examples(8), cfg, val_metric=metric)
    tr.train()
    assert [st for st, _ in tr.val_losses] == [0, 2, 4, 6]
    assert tr.meta["best_step"] == 2
    for k, v in tr.fuser.state_dict().items():
        assert torch.equal(v, seen[1][k])
    assert not torch.equal(seen[1]["w_in"], seen[3]["w_in"])  # training did move on after step 2


def test_validation_file_errors(tmp_path: Path) -> None:
    from semcomm.cli._tools.fusion_reference import read_mc_items

    bad = tmp_path / "val.jsonl"
    bad.write_text('{"shared": "q", "options": ["a", "b"], "answer_index": 5}\n')
    with pytest.raises(InvalidInputError, match="val.jsonl:1"):
        read_mc_items(bad)
    bad.write_text('{"shared": "q"}\n')
    with pytest.raises(InvalidInputError, match="val.jsonl:1: expected"):
        read_mc_items(bad)
