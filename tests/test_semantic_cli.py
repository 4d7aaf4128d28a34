"""`semcomm cache` commands: stats, export/import round trip, clear, calibrate (real MiniLM)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from semcomm import SemanticCache
from semcomm.cli import app
from semcomm.semantic import CallableEmbedder

from ._semantic_helpers import bow_embed, minilm  # noqa: F401

runner = CliRunner()

PAIRS = """question1,question2,is_duplicate
How do I reset my password?,How can I reset my password?,1
What is the capital of France?,What's the capital city of France?,1
How can I lose weight fast?,What is the fastest way to lose weight?,1
How do I learn Python?,What is the best way to learn Python?,1
Is tap water safe to drink in Mexico?,Is it safe to drink tap water in Mexico?,1
How do I cancel my Netflix subscription?,How can I cancel my Netflix subscription?,1
What are the benefits of meditation?,Why is meditation good for you?,1
How do I make pancakes?,What is a good pancake recipe?,1
What is the capital of Austria?,What is the capital of Australia?,0
Can I get my money back?,Can I not get my money back?,0
What are the positive effects of social media?,What are the negative effects of social media?,0
How do I get a refund within 30 days?,How do I get a refund within 60 days?,0
Who founded Microsoft?,Who founded Apple?,0
How do I bake bread?,How do I fix a flat tyre?,0
What is machine learning?,What is the best pizza in Naples?,0
Is the store open on Sunday?,Is the store open on Monday?,0
"""


@pytest.fixture
def filled(tmp_path):
    path = tmp_path / "c.sqlite"
    with SemanticCache(embedder=CallableEmbedder(bow_embed, name="bow64"), path=path) as c:
        c.store("first question here", "one", scope="a")
        c.store("second question here", "two", scope="b", tenant="t", ttl=3600)
    return path


def test_every_cache_command_has_help() -> None:
    for cmd in ("stats", "calibrate", "report", "clear", "export", "import"):
        r = runner.invoke(app, ["cache", cmd, "--help"])
        assert r.exit_code == 0 and len(r.output) > 50, cmd


def test_stats_export_import_clear(filled, tmp_path) -> None:
    r = runner.invoke(app, ["cache", "stats", str(filled)])
    assert r.exit_code == 0, r.output
    assert "entries" in r.output and " 2 " in r.output and "bow64" in r.output
    out = tmp_path / "dump.jsonl"
    r = runner.invoke(app, ["cache", "export", str(filled), str(out)])
    assert r.exit_code == 0 and "exported 2" in r.output
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    bad = json.loads(lines[0])
    bad["answer"] = "tampered"
    out.write_text(json.dumps(bad) + "\n" + lines[1] + "\n")
    dest = tmp_path / "new.sqlite"
    r = runner.invoke(app, ["cache", "import", str(dest), str(out)])
    assert r.exit_code == 0 and "imported 1" in r.output and "rejected 1" in r.output
    c = SemanticCache(embedder=CallableEmbedder(bow_embed, name="bow64"), path=dest)
    assert c.lookup("second question here", scope="b", tenant="t").answer == "two"
    c.close()
    r = runner.invoke(app, ["cache", "clear", str(filled), "--yes"])
    assert r.exit_code == 0 and "cleared 2" in r.output
    c = SemanticCache(embedder=CallableEmbedder(bow_embed, name="bow64"), path=filled)
    assert len(c) == 0


def test_calibrate_prints_threshold_and_writes_png(tmp_path, minilm) -> None:  # noqa: F811
    pairs = tmp_path / "pairs.csv"
    pairs.write_text(PAIRS)
    png = tmp_path / "pr.png"
    r = runner.invoke(app, ["cache", "calibrate", str(pairs), "--target-precision", "0.99",
                            "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "threshold" in r.output and "precision" in r.output
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_calibrate_bad_file_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    from semcomm.errors import InvalidInputError

    r = runner.invoke(app, ["cache", "calibrate", str(bad)])
    assert r.exit_code != 0 and isinstance(r.exception, InvalidInputError)
    assert "question1" in str(r.exception)
