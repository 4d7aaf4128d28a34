"""`semcomm quickstart`: the workload runs offline, reuses the shared prefix and stays exact."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from semcomm.cli import app


def test_quickstart_json_figures(tmp_path: Path) -> None:
    out = tmp_path / "qs.json"
    res = CliRunner().invoke(
        app, ["quickstart", "--json", str(out), "--png", str(tmp_path / "qs.png"),
              "--max-new-tokens", "6", "--html", str(tmp_path / "report.html")]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    reqs = report["requests"]
    assert len(reqs) == 6
    assert reqs[0]["cold_hit_tokens"] == 0  # the very first request is a miss
    assert report["model"].startswith("smollm2-135m-instruct")  # the real default model
    # real answers: words, the same cold and warm
    assert all(sum(w.isalpha() for w in (r["answer"] or "").split()) >= 2 for r in reqs), reqs
    assert all(r["cold_hit_tokens"] >= 32 for r in reqs[1:])  # shared system prompt reused
    assert all(r["warm_hit_tokens"] == r["prompt_tokens"] for r in reqs)  # after a restart
    assert reqs[0]["warm_tier"] == "disk"
    assert report["totals"]["all_same_tokens"] is True
    assert (tmp_path / "qs.png").stat().st_size > 1000
    gw = report["gateway"]  # the whole request path through the embedded server
    assert gw["cold"]["semantic_hits"] == 0 and gw["warm"]["semantic_hits"] > 0
    assert gw["warm"]["share_not_recomputed"] > gw["cold"]["share_not_recomputed"]
    assert (tmp_path / "report.html").read_text().count("<script") == 0
