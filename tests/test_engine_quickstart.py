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
              "--max-new-tokens", "2"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    reqs = report["requests"]
    assert len(reqs) == 6
    assert reqs[0]["cold_hit_tokens"] == 0  # the very first request is a miss
    assert all(r["cold_hit_tokens"] >= 640 for r in reqs[1:])  # shared system prompt reused
    assert all(r["warm_hit_tokens"] == r["prompt_tokens"] - 1 for r in reqs)  # after a restart
    assert reqs[0]["warm_tier"] == "disk"
    assert report["totals"]["all_same_tokens"] is True
    assert (tmp_path / "qs.png").stat().st_size > 1000
