"""The shipped cross-encoder verifier: real MiniLM + the trained adapter, as users load it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from semcomm import SemanticCache
from semcomm.errors import ConfigError, InvalidInputError
from semcomm.semantic import CrossEncoderVerifier, ThresholdPolicy
from semcomm.semantic._cross import CROSS_VERIFIER_DIR

# judged as QQP's labels would (the adapter learned them): strict about what is asked
PARAPHRASES = [
    ("How can I reset my password?", "How do I reset my password?"),
    ("What are the benefits of meditation?", "What are the advantages of meditating?"),
    ("How do I get a refund for my order?", "How can I get my money back for an order?"),
]
UNRELATED = [
    ("Can I get my money back?", "What is your refund policy?"),  # close topic, other question
    ("How do I improve my speaking skills?", "How do I improve my writing skills?"),
    ("What is machine learning?", "What is deep learning?"),
]


@pytest.fixture(scope="module")
def xv() -> CrossEncoderVerifier:
    return CrossEncoderVerifier()


def test_shipped_adapter_is_small_and_described() -> None:
    cfg = json.loads((CROSS_VERIFIER_DIR / "config.json").read_text())
    assert cfg["format_version"] == 1 and cfg["rank"] > 0
    assert "tools.train.semantic_cross" in cfg["train"]["command"]
    assert (CROSS_VERIFIER_DIR / "adapter.safetensors").stat().st_size < 2_000_000


def test_paraphrases_pass_and_unrelated_questions_fail(xv: CrossEncoderVerifier) -> None:
    for q, c in PARAPHRASES:
        assert xv.verify(q, c), (q, c)
    for q, c in UNRELATED:
        assert not xv.verify(q, c), (q, c)
    p = xv.scores(PARAPHRASES[0][0], [PARAPHRASES[0][1], UNRELATED[0][1]])
    assert p.shape == (2,) and p[0] > 0.5 > p[1]
    assert np.all((p >= 0) & (p <= 1))


def test_adapter_changes_the_base_model(tmp_path: Path, xv: CrossEncoderVerifier) -> None:
    """A zeroed adapter (the plain base + the head) scores differently: the adapter is used."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "zero"
    shutil.copytree(CROSS_VERIFIER_DIR, d)
    t = load_file(str(d / "adapter.safetensors"))
    save_file({k: (v * 0 if k.endswith("lora_b") else v) for k, v in t.items()},
              str(d / "adapter.safetensors"))
    q, c = PARAPHRASES[2]
    assert abs(CrossEncoderVerifier(d).score(q, c) - xv.score(q, c)) > 1e-3


def test_as_scorer_of_the_threshold_policy(xv: CrossEncoderVerifier) -> None:
    """At a low cosine threshold another question gets through on similarity alone; the
    cross-encoder scorer refuses it and still serves the paraphrase."""
    stored = "How do I reset my password?"
    other = "How do I change my username?"
    para = "How can I reset my password?"
    plain = SemanticCache(threshold=0.45)
    scored = SemanticCache(threshold=0.45, cross_encoder=True)
    explicit = SemanticCache(policy=ThresholdPolicy(0.45, scorer=xv, min_score=xv.threshold))
    for cache in (plain, scored, explicit):
        cache.store(stored, "Settings > Security")
    assert plain.lookup(other) is not None  # the feature is what refuses it below
    for cache in (scored, explicit):
        assert cache.lookup(other) is None
        hit = cache.lookup(para)
        assert hit is not None and hit.answer == "Settings > Security"
        assert cache.lookup(stored) is not None  # identical text: no check needed
    with pytest.raises(ConfigError, match="cross_encoder"):
        SemanticCache(cross_encoder="yes")


def test_as_verifier_of_a_sensitive_scope(xv: CrossEncoderVerifier) -> None:
    cache = SemanticCache(threshold=0.65, verifier=xv.verify, verify_scopes={"billing"})
    cache.store("How do I get a refund for my order?", "Orders > Refund", scope="billing")
    assert cache.lookup("How can I get my money back for an order?", scope="billing") is not None
    assert cache.lookup("How do I cancel my order?", scope="billing") is None
    assert cache.stats().verifier_rejections >= 1


def test_bad_input_and_bad_files(tmp_path: Path, xv: CrossEncoderVerifier) -> None:
    with pytest.raises(InvalidInputError, match="non-empty"):
        xv.scores("  ", ["x"])
    with pytest.raises(InvalidInputError, match="list of strings"):
        xv.scores("q", "one string")  # type: ignore[arg-type]
    assert xv.scores("q", []).shape == (0,)
    with pytest.raises(ConfigError, match="no cross-encoder verifier"):
        CrossEncoderVerifier(tmp_path / "missing")
    d = tmp_path / "v"
    shutil.copytree(CROSS_VERIFIER_DIR, d)
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(ConfigError, match="threshold"):
        CrossEncoderVerifier(d, threshold=1.5)
    (d / "config.json").write_text(json.dumps({**cfg, "format_version": 99}))
    with pytest.raises(ConfigError, match="format_version"):
        CrossEncoderVerifier(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rank": cfg["rank"] * 2}))
    with pytest.raises(ConfigError, match="shape mismatch"):
        CrossEncoderVerifier(d).score("a question?", "another question?")
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "rank"}))
    with pytest.raises(ConfigError, match="rank"):
        CrossEncoderVerifier(d).score("a question?", "another question?")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        CrossEncoderVerifier(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config"):
        CrossEncoderVerifier(d)


def test_server_config_turns_the_verifier_on(tmp_path: Path) -> None:
    """``[semantic] cross_encoder = true`` gives the gateway's cache the shipped scorer."""
    from semcomm.server import load_config
    from semcomm.server._gateway import Gateway
    from semcomm.server._wiring import build_semantic

    def layer(flag: bool):  # type: ignore[no-untyped-def]
        cfg = load_config(None, overrides={
            "server": {"state_dir": str(tmp_path)}, "models": {"tiny": {"path": "tiny"}},
            "semantic": {"backend": "memory", "threshold": 0.45, "cross_encoder": flag},
        }, defaults=False, environ={})
        sem, note = build_semantic(cfg, Gateway(cfg))
        assert sem is not None, note
        return sem.cache

    on, off = layer(True), layer(False)
    assert isinstance(on.policy, ThresholdPolicy) and on.policy.scorer is not None
    assert off.policy.scorer is None  # type: ignore[attr-defined]
    for cache in (on, off):
        cache.store("How do I reset my password?", "Settings > Security")
    assert off.lookup("How do I change my username?") is not None
    assert on.lookup("How do I change my username?") is None


@pytest.mark.parametrize(("section", "verified"), [({}, True), ({"cross_encoder": False}, False)])
def test_server_config_keeps_the_verified_default_unless_turned_off(
        tmp_path: Path, section: dict, verified: bool) -> None:
    """No ``cross_encoder`` key: the gateway's cache is the verified default; ``false``: off."""
    from semcomm.semantic import VERIFIED_THRESHOLD
    from semcomm.server import load_config
    from semcomm.server._gateway import Gateway
    from semcomm.server._wiring import build_semantic

    cfg = load_config(None, overrides={
        "server": {"state_dir": str(tmp_path)}, "models": {"tiny": {"path": "tiny"}},
        "semantic": {"backend": "memory", **section}}, defaults=False, environ={})
    sem, note = build_semantic(cfg, Gateway(cfg))
    assert sem is not None, note
    pol = sem.cache.policy
    assert isinstance(pol.scorer, CrossEncoderVerifier) is verified  # type: ignore[attr-defined]
    assert pol.threshold == (VERIFIED_THRESHOLD if verified else 0.92)  # type: ignore[attr-defined]


def test_the_default_verifies_every_lone_hit_with_the_cross_encoder() -> None:
    """``SemanticCache()`` (default embedder): a lone entry at cos >= 0.91 is served only when
    the shipped cross-encoder gives it P >= 0.65; an identical text is never scored; a custom
    embedder, ``threshold=`` or ``cross_encoder=False`` keep the plain 0.92 rule."""
    from semcomm.semantic import (
        DEFAULT_THRESHOLD,
        VERIFIED_MIN_SCORE,
        VERIFIED_THRESHOLD,
        CallableEmbedder,
        ClusterVotePolicy,
    )

    cache = SemanticCache()
    pol = cache.policy
    assert isinstance(pol, ClusterVotePolicy) and isinstance(pol.scorer, CrossEncoderVerifier)
    assert (pol.threshold, pol.min_score) == (VERIFIED_THRESHOLD, VERIFIED_MIN_SCORE) == (0.91, 0.65)
    plain = SemanticCache(cross_encoder=False)
    assert plain.policy.scorer is None and plain.policy.threshold == DEFAULT_THRESHOLD  # type: ignore[attr-defined]
    toy = SemanticCache(embedder=CallableEmbedder(lambda t: np.ones((len(t), 4)), name="toy", dim=4))
    assert toy.policy.scorer is None  # type: ignore[attr-defined]
    assert SemanticCache(threshold=0.9).policy.scorer is None  # type: ignore[attr-defined]

    for c in (cache, plain):
        c.store("How do I reset my account password?", "Settings > Security")
        c.store("How can I lose weight fast?", "Eat less, move more.")
    hit = cache.lookup("How can I reset the password of my account?")  # cos 0.986, P 0.88
    assert hit is not None and hit.verified and hit.reason == "scored-hit"
    assert cache.stats().verifications == 1
    assert cache.lookup("How can I lose weight fast?") is not None  # identical: not scored
    assert cache.stats().verifications == 1
    # the cost of QQP's strict labels: cos 0.986, P 0.15 -- the plain rule serves it
    assert cache.lookup("How do I lose weight fast?") is None
    assert cache.stats().verifications == 2
    assert plain.lookup("How do I lose weight fast?") is not None
