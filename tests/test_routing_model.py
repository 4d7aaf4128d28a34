"""Model router: training, N-way decisions, budget calibration, evaluation, persistence, CLI."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from semcomm.errors import ConfigError, InvalidInputError
from semcomm.routing import ModelRouter, ModelSpec, load_labelled, render_conversation

EASY = ["say hello to my friend", "what colour is grass", "thank the waiter politely", "name a fruit"]
MEDIUM = ["summarise the history of rome", "explain how vaccines work", "compare two poems"]
HARD = ["prove the prime number theorem", "integrate the gaussian density", "solve the riemann problem"]


def bow(texts: list[str]) -> np.ndarray:
    """A deterministic bag-of-words embedder (64 hashed buckets, unit norm): fast and offline."""
    out = np.zeros((len(texts), 64))
    for i, t in enumerate(texts):
        for w in re.findall(r"[a-z]+", t.lower()):
            out[i, int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % 64] += 1
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def dataset(n: int = 240, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """small answers easy prompts; medium easy+medium; large everything (10% label noise)."""
    rng = np.random.default_rng(seed)
    prompts, labels = [], []
    for i in range(n):
        tier = i % 3
        base = [EASY, MEDIUM, HARD][tier][int(rng.integers(3))]
        prompts.append(f"{base} please {['now', 'today', 'soon'][int(rng.integers(3))]}")
        y = np.array([tier == 0, tier <= 1, True], dtype=float)
        flip = rng.random(3) < 0.1
        labels.append(np.where(flip, 1 - y, y))
    return prompts, np.asarray(labels)


MODELS = [ModelSpec("small", 1.0), ModelSpec("medium", 3.0), ModelSpec("large", 10.0)]


@pytest.fixture(scope="module")
def trained() -> ModelRouter:
    p, y = dataset()
    return ModelRouter(MODELS, embedder=bow).fit(p, y, budget=0.5)


def test_nway_routes_by_difficulty(trained: ModelRouter) -> None:
    trained.calibrate(dataset(60, seed=1)[0], 0.5)
    assert trained.route("say hello to my friend please now").model == "small"
    assert trained.route("explain how vaccines work please today").model == "medium"
    assert trained.route("prove the prime number theorem please soon").model == "large"
    q = trained.route("name a fruit please now").quality
    assert q["small"] > 0.6 and q["large"] > 0.6 and q["small"] > q["medium"] - 0.3


@pytest.mark.parametrize("budget", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_calibration_meets_the_budget(trained: ModelRouter, budget: float) -> None:
    prompts, _ = dataset(90, seed=2)
    lam = trained.calibrate(prompts, budget)
    costs = np.array([0.0, 2 / 9, 1.0])  # normalised (cost - min) / (max - min)
    share = float(np.mean([costs[trained.route(p).index] for p in prompts]))
    assert share <= budget + 1e-9
    if budget == 0.0:
        assert share == 0.0
    if budget >= 0.8:
        assert lam < 0.5  # a generous budget barely penalises cost


def test_evaluation_beats_random_and_recovers_quality(trained: ModelRouter) -> None:
    p, y = dataset(150, seed=3)
    ev = trained.evaluate(p, y)
    assert ev.apgr > 0.8  # random routing scores 0.5
    assert ev.cpt["cpt80"] < 0.5  # 80% of the quality gap for under half the cost share
    assert ev.pgr[0] == pytest.approx(0.0, abs=0.05) and ev.quality[-1] >= ev.quality[0]
    assert ev.oracle_quality >= max(ev.model_quality.values())
    assert np.all(np.diff(ev.cost_share) >= -1e-9)


def test_save_load_roundtrip(trained: ModelRouter, tmp_path: Path) -> None:
    path = trained.save(tmp_path / "r.json")
    back = ModelRouter.load(path, embedder=bow)
    assert back.predictor.rank_ == trained.predictor.rank_ and trained.predictor.cv_logloss
    for prompt in ["name a fruit please now", "solve the riemann problem please soon"]:
        assert back.route(prompt) == trained.route(prompt)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a semcomm model router"):
        ModelRouter.load(tmp_path / "bad.json", embedder=bow)
    doc = json.loads(path.read_text())
    assert "pickle" not in path.read_text() and doc["format"].startswith("semcomm.model-router")


def test_conversations_use_every_turn() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "integrate x"},
            {"role": "assistant", "content": "x^2/2"}, {"role": "user", "content": "and again"}]
    last, whole = render_conversation(msgs)
    assert last == "and again" and "integrate x" in whole and whole.startswith("system: be brief")
    with pytest.raises(InvalidInputError):
        render_conversation([])
    with pytest.raises(InvalidInputError):
        render_conversation("  ")


def test_bad_setup_is_rejected() -> None:
    with pytest.raises(ConfigError):
        ModelRouter([ModelSpec("a", 1.0)])
    with pytest.raises(ConfigError):
        ModelRouter([ModelSpec("a", 1.0), ModelSpec("a", 2.0)])
    r = ModelRouter(MODELS, embedder=bow)
    with pytest.raises(RuntimeError):
        r.route("hi")
    with pytest.raises(InvalidInputError, match="labels must be"):
        r.fit(["a", "b"], np.ones((2, 2)))
    with pytest.raises(ConfigError, match="budget"):
        ModelRouter(MODELS, embedder=bow).fit(*dataset(30), budget=1.5)


def _write_labels(path: Path, n: int = 48) -> None:
    p, y = dataset(n, seed=4)
    with path.open("w") as fh:
        for text, lab in zip(p, y, strict=True):
            fh.write(json.dumps({"question": text, "small_correct": bool(lab[0]),
                                 "large_correct": bool(lab[2])}) + "\n")


def test_load_labelled_parts_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    _write_labels(path)
    full = load_labelled(path)
    train, test = load_labelled(path, part="train"), load_labelled(path, part="test")
    assert full.models == ["large", "small"]
    assert len(train.prompts) + len(test.prompts) == len(full.prompts) and test.prompts
    assert set(train.prompts).isdisjoint(test.prompts)
    path.write_text(path.read_text() + "{oops\n")
    with pytest.raises(InvalidInputError, match="line 49"):
        load_labelled(path)
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_labelled(tmp_path / "none.jsonl")


def test_cli_train_and_eval_with_the_local_embedder(tmp_path: Path) -> None:
    """The CLI path with the real offline all-MiniLM-L6-v2 (small data set)."""
    from semcomm.cli import app

    data = tmp_path / "labels.jsonl"
    _write_labels(data, n=36)
    runner = CliRunner()
    res = runner.invoke(app, ["route", "train", "--data", str(data), "--out", str(tmp_path / "r.json"),
                              "--cost", "small=1", "--cost", "large=5", "--part", "all"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["route", "eval", "--router", str(tmp_path / "r.json"), "--data", str(data),
                              "--part", "all", "--json", str(tmp_path / "e.json"), "--png", str(tmp_path / "e.png")])
    assert res.exit_code == 0, res.output
    ev = json.loads((tmp_path / "e.json").read_text())
    assert ev["n"] == 36 and ev["apgr"] > 0.6
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"
    res = runner.invoke(app, ["route", "train", "--data", str(data), "--out", str(tmp_path / "x.json"),
                              "--cost", "small=1"])
    assert res.exit_code != 0 and "no --cost given" in str(res.exception)


def test_message_objects_and_content_parts() -> None:
    class Part:
        def __init__(self, text: str) -> None:
            self.text = text

    class Msg:
        def __init__(self, role: str, content: object) -> None:
            self.role, self.content = role, content

    last, whole = render_conversation([Msg("user", [Part("first")]), Msg("assistant", None),
                                       {"role": "user", "content": [{"type": "text", "text": "second"}]}])
    assert last == "second" and "first" in whole


def test_rank_selection_by_cross_validated_log_loss() -> None:
    from semcomm.routing import QualityPredictor

    p, y = dataset(240, seed=5)
    q = QualityPredictor().fit(bow(p), y)
    assert set(q.cv_logloss) == {"8", "16", "32", "None"}  # ranks below 64 features, and none
    assert q.cv_logloss[str(q.rank_)] <= min(q.cv_logloss.values()) + 1e-9  # lowest validation loss wins
    assert q.rank_ is not None  # 64 hashed word buckets, ~30 words in use: a projection fits better
    assert q.proj is None or q.proj.shape == (64, q.rank_)
    fixed = QualityPredictor(rank=None).fit(bow(p), y)
    assert fixed.rank_ is None and fixed.proj is None
    with pytest.raises(ConfigError):
        QualityPredictor(rank="best")


_MIXED_PROMPTS = [  # none of these is in the router's training rows
    "Write a Python function that reverses a linked list.",
    "Fix this SQL query: SELECT * FORM users WHERE id = 1",
    "What is the capital of France?", "How do I reset my password?",
    "Where would you put a plate after washing it?",
    "To keep bread fresh longer, what should you do?",
    "Which gas do plants take in from the air?", "What tool would you use to tighten a screw?",
    "Explain recursion with a JavaScript example.",
    "What is the boiling point of water at sea level?",
    "Where do people usually keep their winter coats?",
    "How can I remove a stain from a white shirt?",
    "Why does the moon change shape during the month?",
    "Convert this list comprehension to a for loop: [x*x for x in xs]",
    "What happens to ice when you heat it?", "My invoice shows a double charge, what should I do?",
    "What is a good way to open a stuck jar lid?", "Which animal is known for building dams?",
    "What causes rust on iron?", "How do I sort a dictionary by value in Python?",
]
_CODE = [0, 1, 8, 13, 19]  # indexes of the code requests above


def test_the_shipped_router_for_the_default_pair_loads_by_name_and_splits_traffic() -> None:
    """``[routing] model_router = "smollm2-qwen2.5-coder"`` (the embedded default) resolves to
    the shipped file, routes between the two catalog models, sends a real share of mixed
    requests to each (not everything to one model) and code requests to the code model."""
    from semcomm.routing import SHIPPED_ROUTERS, shipped_router_path

    assert "smollm2-qwen2.5-coder" in SHIPPED_ROUTERS
    assert shipped_router_path("smollm2-qwen2.5-coder").is_file()
    router = ModelRouter.load("smollm2-qwen2.5-coder")
    assert [m.name for m in router.models] == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    picks = [router.route(q).index for q in _MIXED_PROMPTS]
    share = sum(picks) / len(picks)
    assert 0.15 <= share <= 0.85, share
    assert all(picks[i] == 1 for i in _CODE), picks
    with pytest.raises(ConfigError, match="smollm2-qwen2.5-coder"):
        shipped_router_path("no-such-router")
