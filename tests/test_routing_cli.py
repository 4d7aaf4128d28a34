"""`semcomm route` commands: the simulate contract, synth, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from semcomm.cli import app
from semcomm.cli._tools.route_trace import shared_prefix_workload, write_trace

runner = CliRunner()


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    write_trace(shared_prefix_workload(groups=4, prompts_per_group=10, system_len=2048, question_len=256,
                                       output_len=16, rate=20.0, seed=2), path)
    return path


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "affinity", "default"])
def test_simulate_contract(policy: str, trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    res = runner.invoke(app, ["route", "simulate", "--trace", str(trace_file), "--replicas", "3",
                              "--policy", policy, "--rate-scale", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["requests"] == 40 and doc["completed"] == 40
    assert 0.0 <= doc["hit_rate"] <= 1.0
    assert 0 < doc["ttft_p50_s"] <= doc["ttft_p99_s"]
    assert doc["policy"] == policy and doc["rate_scale"] == 2.0


def test_rate_scale_multiplies_arrival_rate(trace_file: Path, tmp_path: Path) -> None:
    spans = []
    for scale in ("1", "4"):
        out = tmp_path / f"o{scale}.json"
        res = runner.invoke(app, ["route", "simulate", "--trace", str(trace_file), "--replicas", "2",
                                  "--policy", "round-robin", "--rate-scale", scale, "--json", str(out)])
        assert res.exit_code == 0, res.output
        spans.append(json.loads(out.read_text())["makespan_s"])
    assert spans[1] < spans[0] / 2


def test_simulate_compare_png_and_capacity(trace_file: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    res = runner.invoke(app, ["route", "simulate", "--trace", str(trace_file), "--replicas", "2",
                              "--policy", "least-loaded,affinity", "--json", str(out), "--png", str(png),
                              "--capacity", "--slo", "1.0"])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["results"]] == ["least-loaded", "affinity"]
    assert all(r["capacity_rate_scale"] > 0 for r in doc["results"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synth_writes_a_replayable_trace(tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    res = runner.invoke(app, ["route", "synth", "--out", str(out), "--groups", "3", "--prompts-per-group", "4",
                              "--turns", "2", "--zipf", "1.2"])
    assert res.exit_code == 0, res.output
    assert len(out.read_text().splitlines()) == 24


def test_errors_are_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    res = runner.invoke(app, ["route", "simulate", "--trace", str(bad), "--policy", "affinity"])
    assert res.exit_code != 0
    assert "line 2" in str(res.exception)
    res = runner.invoke(app, ["route", "simulate", "--trace", str(bad), "--policy", "nope"])
    assert res.exit_code != 0 and "unknown routing policy" in str(res.exception)


def test_every_route_command_has_help() -> None:
    for cmd in ("simulate", "synth", "train", "eval"):
        res = runner.invoke(app, ["route", cmd, "--help"])
        assert res.exit_code == 0 and len(res.output) > 100
