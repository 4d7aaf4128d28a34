"""The larger sharer (Qwen2.5-Coder-1.5B-Instruct): several receivers evaluated in one pass,
the complementarity table under both log-likelihood rules, fusers looked up per pair, and
`fusion eval` for a pair with no shipped fuser. Toy models here; one real check that skips
only when the 1.5B model is not pulled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from semcomm.cli import app
from semcomm.errors import InvalidInputError
from semcomm.fusion import Fuser, FuserConfig, ModelSide
from semcomm.fusion._mcqa import (
    McqaSettings,
    complementarity,
    evaluate_mcqa,
    evaluate_mcqa_receivers,
    find_pair_fuser,
    read_mcqa,
    shipped_pair_fuser_path,
    shipped_pair_fusers,
)

from ._fusion_helpers import _one_thread  # noqa: F401  (autouse fixture)
from ._fusion_toy import toy_pair

QUESTIONS: list[dict[str, Any]] = [
    {"question": "Which fox is red?", "choices": ["the red fox", "a blue dog"], "answer": 0},
    {"question": "Where is the river?", "choices": ["tower", "café", "東京 river"], "answer": 2},
    {"question": "What is blue?", "choices": ["dog", "blue river", "fox", "red"], "answer": 1},
    {"question": "Which tower?", "choices": ["red tower", "blue tower"], "answer": 1},
]
CODER15, CODER05, SMOL = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", \
    "smollm2-135m-instruct"


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
        ModelSide(pair.receiver, pair.receiver_tokenizer, suffix="Answer:",
                  add_special_tokens=True),
    )


def _open_fuser(s: ModelSide, r: ModelSide) -> Fuser:
    torch.manual_seed(0)
    f = Fuser(FuserConfig(sharer=s.spec, receiver=r.spec, hidden_dim=16, num_blocks=1))
    with torch.no_grad():
        f.gate_logit.fill_(1.0)
        f.w_out.normal_(0, 5.0)
    return f.eval()


def test_two_receivers_in_one_pass_give_each_pair_its_own_figures(sides, tmp_path: Path) -> None:
    s, r = sides
    qs = read_mcqa(_write(tmp_path / "q.jsonl", QUESTIONS))
    st = McqaSettings(analysis_tokens=4, bf16=False)
    fz = _open_fuser(s, r)
    alone = evaluate_mcqa(s, r, fz, qs, st)
    both = evaluate_mcqa_receivers(s, {"fused": (r, fz), "plain": (r, None)}, qs, st)
    assert set(both) == {"fused", "plain"}
    assert set(both["fused"]) == {"receiver", "sharer", "t2t", "c2c"}
    assert set(both["plain"]) == {"receiver", "sharer", "t2t"}  # no fuser: no c2c
    for m in ("receiver", "sharer", "t2t", "c2c"):
        for key in ("correct", "correct_loglik_mean"):
            assert both["fused"][m][key] == alone[m][key], (m, key)
    for m in ("receiver", "sharer", "t2t"):
        assert both["plain"][m]["correct"] == alone[m]["correct"]
    # the sharer's work ran once: the same timings enter both pairs
    assert both["fused"]["sharer"]["latency_s"] == both["plain"]["sharer"]["latency_s"]
    assert both["fused"]["t2t"]["median_sharer_generate_s"] == \
        both["plain"]["t2t"]["median_sharer_generate_s"]
    assert both["fused"]["c2c"]["median_sharer_prefill_s"] == \
        both["fused"]["sharer"]["median_prefill_s"]
    with pytest.raises(InvalidInputError, match="no receiver"):
        evaluate_mcqa_receivers(s, {}, qs, st)


def _res(**lists: list[int]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, xs in lists.items():
        method, _, rule = name.partition("__")
        key = "correct_loglik_mean" if rule else "correct"
        out.setdefault(method, {"rule": "loglik"})[key] = xs
    return out


def test_complementarity_gives_the_oracle_and_the_gap_closed_under_both_rules() -> None:
    res = _res(
        receiver=[1, 0, 0, 1, 0], sharer=[0, 1, 0, 1, 0], c2c=[1, 1, 0, 0, 1],
        t2t=[0, 0, 0, 1, 0],
        receiver__m=[1, 1, 0, 0, 0], sharer__m=[0, 1, 1, 1, 0], c2c__m=[1, 1, 0, 0, 0],
    )
    comp = complementarity(res)
    s = comp["by_rule"]["loglik"]
    assert (s["receiver"], s["sharer"], s["either_right"]) == (0.4, 0.4, 0.6)
    assert (s["only_receiver"], s["only_sharer"], s["both_right"]) == (0.2, 0.2, 0.2)
    assert s["counts"] == {"only_receiver": 1, "only_sharer": 1, "both_right": 1, "neither": 2}
    assert s["c2c"] == 0.6 and s["c2c_gap_closed"] == pytest.approx(1.0)
    assert s["c2c_right_of_only_sharer"] == 1.0 and s["t2t"] == 0.2
    assert s["c2c_lost_of_receiver_right"] == 0.2 and s["c2c_right_where_neither"] == 0.2
    m = comp["by_rule"]["loglik_mean"]
    assert (m["receiver"], m["sharer"], m["either_right"]) == (0.4, 0.6, 0.8)
    assert m["c2c"] == 0.4 and m["c2c_gap_closed"] == pytest.approx(0.0)
    assert comp["either_right"] == 0.6  # the flat keys stay those of the run's rule
    # no gap (the receiver already gets every question the sharer gets): no share to report
    flat = complementarity(_res(receiver=[1, 1, 0], sharer=[1, 0, 0], c2c=[1, 1, 0]))
    assert flat["by_rule"]["loglik"]["c2c_gap_closed"] is None


def test_fusers_are_looked_up_per_catalog_pair(tmp_path: Path, monkeypatch) -> None:
    import semcomm.fusion._reference as ref

    assert shipped_pair_fuser_path().name == "qwen2.5-coder-0.5b_to_smollm2-135m"
    assert shipped_pair_fuser_path("qwen2.5-coder-1.5b", "smollm2").name == \
        "qwen2.5-coder-1.5b_to_smollm2-135m"
    assert shipped_pair_fuser_path(CODER15, CODER05).name == \
        "qwen2.5-coder-1.5b_to_qwen2.5-coder-0.5b"
    with pytest.raises(InvalidInputError, match="no fuser is shipped"):
        shipped_pair_fuser_path(SMOL, CODER15)
    assert find_pair_fuser("some/hub-id", SMOL) is None
    monkeypatch.setattr(ref, "ASSETS_DIR", tmp_path)
    assert find_pair_fuser(CODER15, SMOL) is None and shipped_pair_fusers() == []
    (tmp_path / "qwen2.5-coder-1.5b_to_smollm2-135m").mkdir()
    assert find_pair_fuser(CODER15, SMOL) is None  # a folder without fuser.json is no fuser
    (tmp_path / "qwen2.5-coder-1.5b_to_smollm2-135m" / "fuser.json").write_text("{}")
    assert find_pair_fuser(CODER15, SMOL) == tmp_path / "qwen2.5-coder-1.5b_to_smollm2-135m"
    assert shipped_pair_fusers() == [tmp_path / "qwen2.5-coder-1.5b_to_smollm2-135m"]


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


def test_eval_of_a_pair_without_a_fuser_runs_the_rest_and_says_why(folders, tmp_path: Path
                                                                   ) -> None:
    s_dir, r_dir = folders
    qfile = _write(tmp_path / "q.jsonl", QUESTIONS)
    js = tmp_path / "out.json"
    args = ["fusion", "eval", "--data", str(qfile), "--sharer", str(s_dir), "--receiver",
            str(r_dir), "--analysis-tokens", "3", "--json", str(js)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.output, res.exception)
    doc = json.loads(js.read_text())
    assert {"receiver", "sharer", "t2t"} <= set(doc) and "c2c" not in doc
    assert "no fuser is shipped" in doc["setup"]["c2c_note"]
    assert doc["setup"]["methods"] == ["receiver", "sharer", "t2t"]
    by_rule = doc["complementarity"]["by_rule"]
    assert set(by_rule) == {"loglik", "loglik_mean"}
    for rule, c in by_rule.items():
        key = "accuracy" if rule == "loglik" else "accuracy_loglik_mean"
        assert c["receiver"] == doc["receiver"][key] and c["sharer"] == doc["sharer"][key]
        assert c["either_right"] >= max(c["receiver"], c["sharer"])
    assert "complementary" in res.output
    only = CliRunner().invoke(app, [*args[:-2], "--methods", "c2c"])
    assert only.exit_code != 0 and "no fuser is shipped" in str(only.exception)


def _coder15_ready() -> bool:
    try:
        from semcomm.models import is_pulled

        return is_pulled(CODER15) and is_pulled(CODER05)
    except Exception:
        return False


@pytest.mark.skipif(not _coder15_ready(), reason=f"{CODER15} (or {CODER05}) is not pulled")
def test_real_larger_sharer_eval_contract(tmp_path: Path) -> None:
    """`fusion eval --sharer qwen2.5-coder-1.5b-instruct --receiver ...` on 2 questions: the
    contract's keys, and C2C with the pair's shipped fuser when one is shipped."""
    qfile = _write(tmp_path / "q.jsonl", QUESTIONS[:2])
    js = tmp_path / "real.json"
    res = CliRunner().invoke(app, ["fusion", "eval", "--data", str(qfile), "--limit", "2",
                                   "--sharer", CODER15, "--receiver", CODER05,
                                   "--methods", "receiver,sharer,c2c", "--json", str(js)])
    assert res.exit_code == 0, (res.output, res.exception)
    doc = json.loads(js.read_text())
    for m in ("receiver", "sharer"):
        assert doc[m]["n"] == 2 and {"accuracy", "latency_s"} <= set(doc[m])
    shipped = find_pair_fuser(CODER15, CODER05)
    if shipped is None:
        assert "c2c" not in doc and doc["setup"]["c2c_note"]
    else:
        assert doc["c2c"]["n"] == 2 and doc["setup"]["fuser"] == str(shipped)


def test_gateway_picks_the_shipped_fuser_of_the_configured_pair(tmp_path: Path, monkeypatch
                                                                ) -> None:
    """A `c2c` pipeline naming either larger-sharer pair finds that pair's shipped fuser by
    the models' shapes; the default pair keeps its own."""
    from types import SimpleNamespace

    import semcomm.fusion._reference as ref
    import semcomm.server._c2c as c2c

    shapes = {CODER15: ("qwen2", 28, 151_936), CODER05: ("qwen2", 24, 151_936),
              SMOL: ("llama", 30, 49_152)}

    def spec(name: str) -> dict[str, Any]:
        t, n, v = shapes[name]
        return {"model_type": t, "num_layers": n, "vocab_size": v}

    monkeypatch.setattr(ref, "ASSETS_DIR", tmp_path)
    for (s, r), folder in (((CODER05, SMOL), "qwen2.5-coder-0.5b_to_smollm2-135m"),
                           ((CODER15, CODER05), "qwen2.5-coder-1.5b_to_qwen2.5-coder-0.5b"),
                           ((CODER15, SMOL), "qwen2.5-coder-1.5b_to_smollm2-135m")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "fuser.json").write_text(
            json.dumps({"sharer": spec(s), "receiver": spec(r)}))

    def backend(name: str) -> Any:
        t, n, v = shapes[name]
        cfg = SimpleNamespace(model_type=t, num_hidden_layers=n, vocab_size=v)
        return SimpleNamespace(name=name, runner=SimpleNamespace(model=SimpleNamespace(config=cfg)))

    monkeypatch.setattr(c2c, "C2CHandoff", lambda s, r, path: ("handoff", path))
    for s, r, folder in ((CODER05, SMOL, "qwen2.5-coder-0.5b_to_smollm2-135m"),
                         (CODER15, CODER05, "qwen2.5-coder-1.5b_to_qwen2.5-coder-0.5b"),
                         (CODER15, SMOL, "qwen2.5-coder-1.5b_to_smollm2-135m")):
        handoff, why = c2c.find_fuser(backend(s), backend(r), None)
        assert handoff == ("handoff", tmp_path / folder), why
    handoff, why = c2c.find_fuser(backend(SMOL), backend(CODER15), None)
    assert handoff is None and "none of the shipped ones" in why


def test_the_documented_larger_sharer_pipeline_config_loads(tmp_path: Path) -> None:
    """The docs/fusion.md snippet is a valid server config naming the 1.5B -> SmolLM2 pair;
    the embedded default keeps the default pair."""
    import re

    from semcomm.server import load_config

    doc = (Path(__file__).resolve().parents[1] / "docs" / "fusion.md").read_text()
    section = doc.split("### In the gateway", 1)[1]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    cfg = load_config(_write_text(tmp_path / "c.toml", toml))
    stages = cfg.pipelines["semcomm-c2c"].stages
    assert [s.model for s in stages] == [CODER15, SMOL] and cfg.pipelines["semcomm-c2c"].handoff == "c2c"
    default = load_config().pipelines["semcomm-c2c"].stages
    assert [s.model for s in default] == [CODER05, SMOL]


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _smol_ready() -> bool:
    try:
        from semcomm.models import is_pulled

        return is_pulled(CODER15) and is_pulled(SMOL)
    except Exception:
        return False


@pytest.mark.skipif(not _smol_ready(), reason=f"{CODER15} (or {SMOL}) is not pulled")
def test_real_larger_sharer_trains_resumes_and_evaluates(tmp_path: Path) -> None:
    """The bfloat16 1.5B sharer with a float32 receiver: two choice-objective steps, a resume
    to three, and C2C of the trained fuser on the pair (the training tool's code path)."""
    from semcomm.fusion import FusionTrainer, TrainConfig, load_fuser, load_side

    s = load_side(CODER15, template="{shared}Answer:")
    r = load_side(SMOL, template="{shared}Answer:")
    assert s.model.dtype == torch.bfloat16 and r.model.dtype == torch.float32
    qs = read_mcqa(_write(tmp_path / "q.jsonl", QUESTIONS[:2]))
    cfg = TrainConfig(steps=2, batch_size=2, bf16=True, objective="choice", gate_lr=0.05,
                      answer_weight=0.1, checkpoint_every=1, threads=1,
                      fuser={"hidden_dim": 16, "num_blocks": 1, "intermediate_mult": 1.0})
    out = tmp_path / "run"
    first = FusionTrainer(s, r, qs, cfg, out=out).train()
    assert first.steps == 2 and all(x == x for x in first.losses)  # finite, not NaN
    cfg.steps = 3
    again = FusionTrainer(s, r, qs, cfg, out=out, resume=True)
    assert again.step == 2 and again.train().steps == 3
    fz = load_fuser(out, sharer=s.spec, receiver=r.spec)
    res = evaluate_mcqa(s, r, fz, qs[:1], McqaSettings(methods=("receiver", "c2c")))
    assert res["c2c"]["n"] == 1 and res["c2c"]["median_fuse_s"] >= 0


def test_the_training_tool_uses_the_measured_learning_rates(tmp_path: Path, monkeypatch) -> None:
    """The 1.5B -> 0.5B diagnosis (docs/fusion.md): lr 1e-3 / gate lr 0.05 fitted each batch's
    noise and random-walked the gates; the tool's default recipe is lr 1e-4 / gate lr 0.005."""
    import sys

    from tools.train import fusion_larger_sharer as tool

    monkeypatch.setattr(sys, "argv", ["x", "--receiver", "qwen2.5-coder-0.5b-instruct"])
    seen: dict[str, Any] = {}
    real = tool.train_command

    def fake_train_command(args: Any, work: Path) -> list[str]:
        seen["cmd"] = real(args, work)
        return ["true"]

    monkeypatch.setattr(tool, "train_command", fake_train_command)
    monkeypatch.setattr(tool, "data_commands", lambda work, take: [])
    monkeypatch.setenv("SEMCOMM_HOME", str(tmp_path))
    monkeypatch.setattr(tool.subprocess, "run", lambda cmd, **kw: None)
    tool.main()
    cmd = seen["cmd"]
    assert cmd[cmd.index("--lr") + 1] == "0.0001"
    assert cmd[cmd.index("--gate-lr") + 1] == "0.005"
    assert "--resume" in cmd
    # the frozen prefills are kept in the run's folder by default
    work = tmp_path / "train" / "fusion_larger_sharer" / "qwen2.5-coder-0.5b-instruct"
    assert cmd[cmd.index("--prefill-cache") + 1] == str(work / "prefill_cache")
