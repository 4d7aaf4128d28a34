"""`run_demo`: the embedded default through the full request path, cold then warm."""

from __future__ import annotations

from pathlib import Path

from semcomm.cli._tools.demo import run_demo, write_demo_chart, write_demo_report


def test_run_demo_reports_savings_per_stage(tmp_path: Path) -> None:
    result = run_demo(state_dir=tmp_path / "state", n_conversations=1, n_chains=1, max_tokens=4)
    cold, warm = result["cold"], result["warm"]
    # cold: follow-up turns and the chain's second stage reuse KV prefixes
    assert cold["semantic_hits"] == 0 and cold["kv_tokens_saved"] > 0
    # the chain's one hand-off: c2c where a shipped fuser fits the pair, else kv or text
    assert sum(cold["handoffs"].values()) == 1 and set(cold["handoffs"]) <= {"kv", "text", "c2c"}
    # every request is answered (an empty answer is never stored, so it could not hit warm)
    empty = [(r["round"], r["item"], r["hits"]) for r in result["requests"]
             if not r["completion_tokens"]]
    assert not empty, empty
    # warm: repeats are semantic hits; the new follow-up reuses the conversation's KV
    assert warm["semantic_hits"] == cold["requests"]
    assert warm["kv_hit_requests"] == 1
    assert result["speedup"]["latency_total"] > 1
    assert result["stages"]["semantic"]["hits"] == cold["requests"]
    assert result["stages"]["kv"]["tokens_saved"] > 0
    assert {r["round"] for r in result["requests"]} == {"cold", "warm"}
    html = write_demo_report(result, tmp_path / "report.html").read_text()
    assert "<script" not in html and "semcomm quickstart" in html and "<svg" in html
    png = write_demo_chart(result, tmp_path / "chart.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
